"""The format registry, QuantizedWeight as a pytree, byte accounting, and bad-input errors
that name the layer, for every format."""

import dataclasses
import secrets

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qerl_jax.quant.formats import (Format, bytes_per_parameter, get_format, known_formats,
                                    quantized_nbytes, register_format)
from qerl_jax.quant.qarray import QuantizedWeight

QUANTIZED = ["nvfp4", "mxfp4", "nf4"]


def _gaussian(shape, dtype=jnp.float32):
    seed = secrets.randbits(32)
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * 0.02, dtype), seed


def test_known_formats_and_unknown_name():
    assert set(known_formats()) == {"bf16", "nvfp4", "mxfp4", "nf4"}
    with pytest.raises(ValueError, match=r"unknown weight format 'nvfp5'.*bf16, nvfp4, mxfp4, nf4"):
        get_format("nvfp5")
    fmt = get_format("nvfp4")
    assert get_format(fmt) is fmt
    register_format(fmt)   # the same object again (a module imported twice): harmless
    with pytest.raises(ValueError, match="weight format 'nvfp4' is already registered"):
        register_format(dataclasses.replace(fmt, description="another nvfp4"))


def test_format_properties_and_bytes_per_parameter():
    expected = {"bf16": (16, 1, 2.0), "nvfp4": (4, 16, 0.5625), "mxfp4": (4, 32, 0.53125),
                "nf4": (4, 64, 0.5 + 1 / 64 + 4 / (64 * 256))}
    for name, (bits, block, per_parameter) in expected.items():
        fmt = get_format(name)
        assert isinstance(fmt, Format) and fmt.name == name
        assert (fmt.bits, fmt.block_size) == (bits, block)
        assert bytes_per_parameter(name) == pytest.approx(per_parameter, rel=1e-12)
        assert fmt.is_quantized == (name != "bf16")


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantized_nbytes_matches_bytes_per_parameter(name):
    weight, _ = _gaussian((256, 1024))
    quantized = get_format(name).quantize(weight)
    scalars = 4 if name == "nvfp4" else 0  # the per-tensor global scale
    if name == "nf4":  # offset + one float32 per run of 256 block scales
        scalars = 4 + 4 * quantized.double_quant_scales.shape[0]
    assert quantized.nbytes == quantized_nbytes(quantized)
    assert quantized_nbytes(quantized) == 256 * 1024 * (0.5 + {"nvfp4": 1 / 16, "mxfp4": 1 / 32,
                                                                "nf4": 1 / 64}[name]) + scalars
    # within 0.1% of the asymptotic figure at this size
    assert quantized_nbytes(quantized) == pytest.approx(bytes_per_parameter(name) * 256 * 1024,
                                                        rel=1e-3)
    params = {"layer": {"weight": quantized, "bias": jnp.zeros((256,), jnp.bfloat16)},
              "norm": jnp.ones((1024,), jnp.float32), "step": 3}
    assert quantized_nbytes(params) == quantized_nbytes(quantized) + 512 + 4096 + 4
    abstract = jax.eval_shape(lambda: params)
    assert quantized_nbytes(abstract) == quantized_nbytes(params)


def test_bf16_is_a_dense_pass_through():
    weight, _ = _gaussian((8, 24))
    fmt = get_format("bf16")
    value = fmt.quantize(weight)
    assert isinstance(value, jax.Array) and value.dtype == jnp.bfloat16 and value.shape == (8, 24)
    np.testing.assert_array_equal(np.asarray(fmt.dequantize(value, jnp.float32)),
                                  np.asarray(weight.astype(jnp.bfloat16), np.float32))
    assert quantized_nbytes(value) == 8 * 24 * 2


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantized_weight_is_a_pytree(name):
    weight, _ = _gaussian((32, 128), jnp.bfloat16)
    quantized = get_format(name).quantize(weight)
    assert isinstance(quantized, QuantizedWeight)
    assert (quantized.format, quantized.shape, quantized.dtype) == (name, (32, 128), "bfloat16")
    assert quantized.codes.shape == (32, 64) and quantized.codes.dtype == jnp.uint8
    leaves, treedef = jax.tree_util.tree_flatten(quantized)
    assert all(isinstance(leaf, jax.Array) for leaf in leaves)  # static fields are not leaves
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert rebuilt.format == name and rebuilt.shape == (32, 128)
    # through jit as an argument and as a result, with static metadata intact
    passed = jax.jit(lambda q: q)(quantized)
    assert passed.format == name and passed.shape == quantized.shape
    dense = jax.jit(lambda q: q.dequantize(jnp.float32))(quantized)
    np.testing.assert_array_equal(np.asarray(dense),
                                  np.asarray(get_format(name).dequantize(quantized, jnp.float32)))
    assert quantized.dequantize().dtype == jnp.bfloat16  # default: the recorded dtype


def test_quantized_weight_rejects_bad_static_fields():
    codes = jnp.zeros((2, 8), jnp.uint8)
    with pytest.raises(ValueError, match="format='int4'"):
        QuantizedWeight(codes=codes, block_scales=codes, format="int4", shape=(2, 16))
    with pytest.raises(ValueError, match="out_features, in_features"):
        QuantizedWeight(codes=codes, block_scales=codes, format="nvfp4", shape=(2, 4, 4))


@pytest.mark.parametrize("name", QUANTIZED + ["bf16"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_round_trip_relative_error(name, dtype):
    """||W - deq(Q(W))||_F / ||W||_F on Gaussian weights: NVFP4 ~0.094, MXFP4 ~0.12,
    NF4 ~0.095, bf16 ~0.002."""
    weight, seed = _gaussian((128, 512), dtype)
    fmt = get_format(name)
    restored = fmt.dequantize(fmt.quantize(weight), jnp.float32)
    reference = weight.astype(jnp.float32)
    error = float(jnp.linalg.norm(restored - reference) / jnp.linalg.norm(reference))
    bounds = {"nvfp4": (0.07, 0.12), "mxfp4": (0.09, 0.15), "nf4": (0.07, 0.12),
              "bf16": (0.0, 0.004)}[name]
    if name == "bf16" and dtype == jnp.bfloat16:
        bounds = (0.0, 0.0)
    assert bounds[0] <= error <= bounds[1], (name, error, f"seed {seed}")


@pytest.mark.parametrize("name", QUANTIZED)
def test_bad_input_errors_name_the_layer(name):
    fmt = get_format(name)
    odd = fmt.block_size + fmt.block_size // 2
    with pytest.raises(ValueError, match=rf"layers\.7\.mlp\.up_proj: in_features={odd} "
                                         rf"\(weight shape \(4, {odd}\).*{name}'s block size"):
        fmt.quantize(jnp.ones((4, odd)), name="layers.7.mlp.up_proj")
    bad = jnp.ones((4, 2 * fmt.block_size)).at[2, 1].set(jnp.nan)
    with pytest.raises(ValueError, match=r"layers\.7\.self_attn\.v_proj: .*1 NaN/Inf"):
        fmt.quantize(bad, name="layers.7.self_attn.v_proj")
    with pytest.raises(ValueError, match=r"v_proj: cannot check a traced weight"):
        jax.jit(lambda w: fmt.quantize(w, name="v_proj"))(bad)
    with pytest.raises(ValueError, match="not floating point"):
        fmt.quantize(jnp.ones((4, 2 * fmt.block_size), jnp.int32), name="v_proj")
