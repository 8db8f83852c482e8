"""MXFP4 in both exponent rules.

rule="compressed_tensors": packed codes and E8M0 scales EQUAL compressed-tensors' own
(compute_dynamic_scales_and_zp with the MXFP4A16 scheme + MXFP4PackedCompressor.compress), and
dequantization equals its decompress, bit for bit, for float32 and bfloat16 weights.
rule="ocp" (default): equal to a float64 numpy implementation of OCP MX v1.0 (shared exponent
floor(log2(amax)) - 2 clamped to [-127, 127]; elements rounded by ml_dtypes' float4_e2m1fn
conversion, half to even, saturating at 6). Fresh random draws; the seed is in failure messages.
"""

import secrets

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from qerl_jax.quant.mxfp4 import mxfp4_dequantize, mxfp4_quantize

compressed_tensors = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.quant_scheme import MXFP4A16  # noqa: E402
from compressed_tensors.quantization.utils.helpers import (  # noqa: E402
    compute_dynamic_scales_and_zp)

DTYPES = {"float32": (torch.float32, jnp.float32), "bfloat16": (torch.bfloat16, jnp.bfloat16)}


def _compressed_tensors_mxfp4(weight: torch.Tensor):
    scheme = QuantizationScheme(targets=["Linear"], **MXFP4A16)
    scale, _ = compute_dynamic_scales_and_zp(weight, scheme.weights, None)
    state = MXFP4PackedCompressor.compress({"weight": weight, "weight_scale": scale}, scheme)
    decompressed = MXFP4PackedCompressor.decompress(dict(state), scheme)["weight"]
    return state, decompressed


def _ocp_reference(weight: np.ndarray):
    """float64 OCP MX v1.0: (codes [N, K] uint8, biased exponents [N, K/32] uint8)."""
    blocks = weight.astype(np.float64).reshape(weight.shape[0], -1, 32)
    amax = np.abs(blocks).max(-1)
    with np.errstate(divide="ignore"):
        shared = np.where(amax > 0, np.floor(np.log2(amax)) - 2, -127)
    shared = np.clip(shared, -127, 127)
    scaled = blocks / 2.0 ** shared[..., None]
    codes = scaled.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    return codes.reshape(weight.shape), (shared + 127).astype(np.uint8)


def _weights(rng, rows, columns):
    """Gaussian blocks of 32 with magnitudes over 1e-30..1e30, zero blocks, blocks whose amax
    mantissa is just below / at / above 1.75 (where the two rules differ) and ties."""
    blocks = rng.standard_normal((rows, columns // 32, 32))
    blocks *= 10.0 ** rng.choice([-30, -12, -3, -1, 0, 2, 12, 30], size=(rows, columns // 32, 1))
    kind = rng.integers(0, 6, size=(rows, columns // 32))
    blocks[kind == 0] = 0.0
    boundary = kind == 1
    exponent = rng.integers(-20, 20, size=boundary.sum())
    mantissa = rng.choice([1.5, 1.7499, 1.75, 1.8, 1.99], size=boundary.sum())
    blocks[boundary] = (rng.uniform(-1, 1, (boundary.sum(), 32))
                        * (mantissa * 2.0 ** exponent)[:, None])
    blocks[boundary, 0] = mantissa * 2.0 ** exponent
    tie = kind == 2  # amax 4 * 2^e (both rules: scale 2^e), elements on E2M1 midpoints
    exponent = rng.integers(-20, 20, size=tie.sum())
    midpoints = rng.choice([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, -0.25, -2.5, -5.0, 5.0],
                           size=(tie.sum(), 32))
    midpoints[:, 0] = 4.0
    blocks[tie] = midpoints * (2.0 ** exponent)[:, None]
    return blocks.reshape(rows, columns).astype(np.float32)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_compressed_tensors_rule_equals_compressed_tensors(dtype_name):
    torch_dtype, jax_dtype = DTYPES[dtype_name]
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    for trial in range(3):
        rows, columns = int(rng.integers(1, 40)), 32 * int(rng.integers(1, 12))
        if trial == 0:
            rows, columns = 64, 512
        weight_t = torch.from_numpy(_weights(rng, rows, columns)).to(torch_dtype)
        reference, decompressed = _compressed_tensors_mxfp4(weight_t)
        quantized = mxfp4_quantize(jnp.asarray(weight_t.float().numpy()).astype(jax_dtype),
                                   rule="compressed_tensors")
        context = f"seed {seed} trial {trial} shape {(rows, columns)}"
        assert quantized.tensor_scale is None and quantized.block_scales.dtype == jnp.uint8
        np.testing.assert_array_equal(np.asarray(quantized.block_scales),
                                      reference["weight_scale"].numpy(), err_msg=context)
        np.testing.assert_array_equal(np.asarray(quantized.codes),
                                      reference["weight_packed"].numpy(), err_msg=context)
        np.testing.assert_array_equal(
            np.asarray(mxfp4_dequantize(quantized, jnp.bfloat16)).view(np.uint16),
            decompressed.view(torch.uint16).numpy(), err_msg=context)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_ocp_rule_equals_float64_reference(dtype_name):
    _, jax_dtype = DTYPES[dtype_name]
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    weight = jnp.asarray(_weights(rng, 48, 256)).astype(jax_dtype)
    quantized = mxfp4_quantize(weight)
    codes, exponents = _ocp_reference(np.asarray(weight, np.float32))
    np.testing.assert_array_equal(np.asarray(quantized.block_scales), exponents,
                                  err_msg=f"seed {seed}")
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    np.testing.assert_array_equal(np.asarray(quantized.codes), packed, err_msg=f"seed {seed}")
    # dequantization is exact: e2m1 * 2^e in float64
    values = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    expected = values * np.repeat(2.0 ** (exponents.astype(np.float64) - 127), 32, axis=1)
    np.testing.assert_array_equal(np.asarray(mxfp4_dequantize(quantized, jnp.float32)),
                                  expected.astype(np.float32), err_msg=f"seed {seed}")


def test_rules_differ_exactly_when_amax_mantissa_is_at_least_1_75():
    mantissas = np.array([1.0, 1.5, 1.74, 1.75, 1.9, 1.99])
    weight = np.zeros((len(mantissas), 32), np.float32)
    weight[:, 0] = mantissas * 2.0 ** 3
    ocp = np.asarray(mxfp4_quantize(jnp.asarray(weight)).block_scales).astype(int)
    ct = np.asarray(mxfp4_quantize(jnp.asarray(weight), rule="compressed_tensors")
                    .block_scales).astype(int)
    np.testing.assert_array_equal(ocp[:, 0], 127 + 3 - 2)
    np.testing.assert_array_equal(ct[:, 0] - ocp[:, 0], (mantissas >= 1.75).astype(int))
    # OCP saturates 1.75 * 2^3 / 2^1 = 7 to 6; compressed-tensors' larger scale keeps 3.5 -> 4
    codes_ocp = np.asarray(mxfp4_quantize(jnp.asarray(weight)).codes)[:, 0] & 0xF
    assert codes_ocp[3] == 7


def test_gaussian_relative_error_and_jit():
    seed = secrets.randbits(32)
    weight = jnp.asarray(np.random.default_rng(seed).standard_normal((64, 512)) * 0.02,
                         jnp.float32)
    quantized = mxfp4_quantize(weight)
    restored = mxfp4_dequantize(quantized, jnp.float32)
    relative_error = float(jnp.linalg.norm(restored - weight) / jnp.linalg.norm(weight))
    assert 0.08 < relative_error < 0.16, relative_error  # ~0.12 for Gaussian weights
    traced = jax.jit(lambda w: mxfp4_quantize(w, check_finite=False))(weight)
    np.testing.assert_array_equal(np.asarray(traced.codes), np.asarray(quantized.codes))
    np.testing.assert_array_equal(np.asarray(traced.block_scales),
                                  np.asarray(quantized.block_scales))


def test_errors_name_the_layer():
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.down_proj.*in_features=48.*mxfp4"):
        mxfp4_quantize(jnp.ones((4, 48)), name="layers.1.mlp.down_proj")
    with pytest.raises(ValueError, match=r"layers\.2\.o_proj.*NaN"):
        mxfp4_quantize(jnp.ones((4, 64)).at[0, 0].set(jnp.nan), name="layers.2.o_proj")
    with pytest.raises(ValueError, match=r"o_proj.*unknown MXFP4 rule 'ieee'"):
        mxfp4_quantize(jnp.ones((4, 64)), rule="ieee", name="o_proj")
