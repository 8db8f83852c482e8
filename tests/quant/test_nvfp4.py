"""NVFP4 against compressed-tensors itself (CPU, pure PyTorch): packed codes, FP8 block scales
and the global scale must be EQUAL bit for bit, and dequantization must equal
compressed-tensors' decompress bit for bit.

The reference path is what llm-compressor runs for an NVFP4A16 weight: generate_gparam(min,
max) for the global scale, compute_dynamic_scales_and_zp for the FP8 block scales, and
NVFP4PackedCompressor.compress (quantize + pack_fp4_to_uint8). Inputs are fresh random draws
(the seed is in every failure message), float32 and bfloat16.
"""

import secrets

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from qerl_jax.quant.nvfp4 import nvfp4_dequantize, nvfp4_global_scale, nvfp4_quantize

compressed_tensors = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.quant_scheme import NVFP4A16  # noqa: E402
from compressed_tensors.quantization.utils.helpers import (  # noqa: E402
    compute_dynamic_scales_and_zp, generate_gparam)

DTYPES = {"float32": (torch.float32, jnp.float32), "bfloat16": (torch.bfloat16, jnp.bfloat16)}


def _compressed_tensors_nvfp4(weight: torch.Tensor, global_scale: torch.Tensor | None = None):
    """compressed-tensors' NVFP4A16 state dict {weight_packed, weight_scale,
    weight_global_scale} for a weight [N, K], plus its decompressed weight."""
    scheme = QuantizationScheme(targets=["Linear"], **NVFP4A16)
    if global_scale is None:
        global_scale = generate_gparam(weight.min(), weight.max())
    scale, _ = compute_dynamic_scales_and_zp(weight, scheme.weights, None,
                                             global_scale=global_scale)
    state = NVFP4PackedCompressor.compress(
        {"weight": weight, "weight_scale": scale, "weight_global_scale": global_scale}, scheme)
    decompressed = NVFP4PackedCompressor.decompress(dict(state), scheme)["weight"]
    return state, decompressed


def _assert_equal_to_reference(weight_np: np.ndarray, dtype_name: str, context: str,
                               global_scale: float | None = None):
    torch_dtype, jax_dtype = DTYPES[dtype_name]
    weight_t = torch.from_numpy(weight_np).to(torch_dtype)
    reference, decompressed = _compressed_tensors_nvfp4(
        weight_t, None if global_scale is None else torch.tensor([global_scale]))
    weight_j = jnp.asarray(weight_t.float().numpy()).astype(jax_dtype)
    quantized = nvfp4_quantize(weight_j, global_scale=global_scale)
    np.testing.assert_array_equal(np.asarray(quantized.tensor_scale).reshape(1),
                                  reference["weight_global_scale"].numpy(), err_msg=context)
    np.testing.assert_array_equal(np.asarray(quantized.block_scales).view(np.uint8),
                                  reference["weight_scale"].view(torch.uint8).numpy(),
                                  err_msg=context)
    codes, expected = np.asarray(quantized.codes), reference["weight_packed"].numpy()
    mismatch = np.argwhere(codes != expected)
    assert mismatch.size == 0, (f"{context}: {len(mismatch)} packed bytes differ, first at "
                                f"{mismatch[:3].tolist()}: ours {codes[tuple(mismatch[0])]:#04x}"
                                f" reference {expected[tuple(mismatch[0])]:#04x}")
    assert quantized.codes.dtype == jnp.uint8 and quantized.block_scales.dtype == jnp.float8_e4m3fn
    # decompress returns bfloat16; our dequantization in bfloat16 must be the same bits
    np.testing.assert_array_equal(
        np.asarray(nvfp4_dequantize(quantized, jnp.bfloat16)).view(np.uint16),
        decompressed.view(torch.uint16).numpy(), err_msg=context)
    return quantized


def _mixed_magnitude_weight(rng, rows, columns):
    """Gaussian blocks of 16 with per-block magnitudes spread over 1e-6..1e3, some all-zero
    blocks, some blocks with a single nonzero, some tiny enough for the FP8 scale to
    underflow, some in FP8's subnormal range, and exact block-amax ties."""
    blocks = rng.standard_normal((rows, columns // 16, 16))
    magnitude = 10.0 ** rng.uniform(-6, 3, size=(rows, columns // 16, 1))
    weight = blocks * magnitude
    kind = rng.integers(0, 8, size=(rows, columns // 16))
    weight[kind == 0] = 0.0
    single = kind == 1
    weight[single] = 0.0
    weight[single, rng.integers(0, 16)] = -rng.uniform(0.1, 2.0)
    weight[kind == 2] *= 1e-5  # FP8 scale underflows to 0 -> 0.125
    weight[kind == 3] *= 3e-3  # FP8 subnormal block scales
    tie = kind == 4
    weight[tie] = np.round(weight[tie] / magnitude[tie] * 2) / 2 * magnitude[tie]
    return weight.reshape(rows, columns).astype(np.float32)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_random_weights_equal_compressed_tensors(dtype_name):
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    for trial in range(3):
        rows, columns = int(rng.integers(1, 48)), 16 * int(rng.integers(1, 24))
        weight = _mixed_magnitude_weight(rng, rows, columns)
        _assert_equal_to_reference(weight, dtype_name,
                                   f"seed {seed} trial {trial} shape {(rows, columns)}")


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_gaussian_weights_equal_compressed_tensors(dtype_name):
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((192, 1024)) * 0.02).astype(np.float32)
    quantized = _assert_equal_to_reference(weight, dtype_name, f"seed {seed}")
    restored = np.asarray(nvfp4_dequantize(quantized, jnp.float32))
    relative_error = np.linalg.norm(restored - weight) / np.linalg.norm(weight)
    assert 0.05 < relative_error < 0.13, relative_error  # ~0.094 for Gaussian weights


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_huge_and_tiny_blocks(dtype_name):
    """1e30-scale blocks next to 1e-30-scale blocks, and single blocks that span 1e40 (scaled
    values that underflow: the sign convention of zero codes is exercised)."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((8, 128))
    weight[:, :64] *= 1e30
    weight[:, 64:] *= 1e-30
    weight[::2, 64:80] = rng.standard_normal((4, 16)) * 10.0 ** rng.integers(-20, 30, (4, 16))
    weight[1, :16] = -(10.0 ** np.arange(-30, 34, 4))  # one block spanning 1e-30..1e30
    _assert_equal_to_reference(weight.astype(np.float32), dtype_name, f"seed {seed}")


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_tiny_tensor_global_scale_overflows_to_one(dtype_name):
    """amax < 7.9e-36: 2688 / amax overflows float32 and compressed-tensors falls back to 1.
    (Magnitudes stay above float32's normal minimum: XLA:CPU flushes subnormals.)"""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    weight = (rng.choice([-1, 1], (4, 32)) * rng.uniform(1, 7, (4, 32)) * 1e-36).astype(np.float32)
    quantized = _assert_equal_to_reference(weight, dtype_name, f"seed {seed}")
    assert float(quantized.tensor_scale) == 1.0


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_all_zero_weight(dtype_name):
    quantized = _assert_equal_to_reference(np.zeros((3, 48), np.float32), dtype_name, "zeros")
    assert float(quantized.tensor_scale) == 1.0
    np.testing.assert_array_equal(np.asarray(quantized.block_scales, np.float32), 0.125)
    assert not np.asarray(nvfp4_dequantize(quantized, jnp.float32)).any()


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_exact_ties_between_e2m1_levels(dtype_name):
    """With global scale 1 and block amax 6 * 2^e the block scale is exactly 2^e, so
    w = 2^e * (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) lands exactly between two E2M1 levels."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    midpoints = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    rows = []
    for exponent in rng.integers(-8, 8, size=6):
        row = rng.choice(np.concatenate([midpoints, -midpoints]), size=32)
        row[::16] = 6.0  # block amax 6 -> block scale 1 (times 2^e)
        rows.append(row * 2.0 ** exponent)
    weight = np.stack(rows).astype(np.float32)
    quantized = _assert_equal_to_reference(weight, dtype_name, f"seed {seed}",
                                           global_scale=1.0)
    scaled = weight / np.repeat(np.asarray(quantized.block_scales, np.float32), 16, axis=1)
    assert set(np.abs(scaled).ravel()) <= set(midpoints) | {6.0}


def test_global_scale_matches_generate_gparam_for_bfloat16_math():
    """bfloat16 weights: 448*6/amax is evaluated as bf16(bf16(1/amax) * 2688)."""
    seed = secrets.randbits(32)
    amaxes = 10.0 ** np.random.default_rng(seed).uniform(-30, 30, 2000)
    for torch_dtype, jax_dtype in DTYPES.values():
        tensors = torch.tensor(amaxes, dtype=torch.float32).to(torch_dtype)
        expected = np.array([generate_gparam(-t, t).item() for t in tensors], np.float32)
        ours = np.array(jax.vmap(lambda a: nvfp4_global_scale(a[None, None]))(
            jnp.asarray(tensors.float().numpy()).astype(jax_dtype)))
        np.testing.assert_array_equal(ours, expected, err_msg=f"seed {seed} {torch_dtype}")


def test_quantize_under_jit_equals_eager():
    seed = secrets.randbits(32)
    weight = jnp.asarray(np.random.default_rng(seed).standard_normal((32, 64)), jnp.bfloat16)
    eager = nvfp4_quantize(weight)
    traced = jax.jit(lambda w: nvfp4_quantize(w, check_finite=False))(weight)
    for a, b in zip(jax.tree_util.tree_leaves(eager), jax.tree_util.tree_leaves(traced)):
        np.testing.assert_array_equal(np.asarray(a).reshape(-1).view(np.uint8),
                                      np.asarray(b).reshape(-1).view(np.uint8))
    assert traced.shape == (32, 64) and traced.dtype == "bfloat16" and traced.format == "nvfp4"


def test_errors_name_the_layer():
    with pytest.raises(ValueError, match=r"layers\.3\.mlp\.up_proj.*in_features=40.*\(8, 40\)"):
        nvfp4_quantize(jnp.ones((8, 40)), name="layers.3.mlp.up_proj")
    bad = jnp.ones((4, 32)).at[1, 2].set(jnp.inf)
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.q_proj.*1 NaN/Inf"):
        nvfp4_quantize(bad, name="layers.0.attn.q_proj")
    with pytest.raises(ValueError, match=r"q_proj.*traced.*check_finite=False"):
        jax.jit(lambda w: nvfp4_quantize(w, name="q_proj"))(jnp.ones((4, 32)))
    with pytest.raises(ValueError, match="2-D"):
        nvfp4_quantize(jnp.ones((4, 4, 32)))
