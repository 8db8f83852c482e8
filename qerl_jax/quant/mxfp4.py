"""MXFP4 weights (OCP Microscaling v1.0): E2M1 elements, one E8M0 power-of-two scale per 32.

Shared exponent of a block of 32 along K, two rules:

  rule="ocp" (default, OCP MX v1.0 section 6.3): e = floor(log2(amax)) - 2, clamped to
      [-127, 127]; an all-zero block gets -127. Elements whose |w| / 2**e exceeds 6 (amax with
      mantissa >= 1.5 lands in [6, 8)) saturate to 6.
  rule="compressed_tensors" (compressed-tensors 0.20 mxfp4-pack-quantized, quantization/utils/
      mxfp_utils.py generate_mx_scales): amax is first rounded to a power of two on its bit
      pattern, (bits + 2**21) & sign_exponent_mask, i.e. up when its mantissa is >= 1.75, then
      e = log2(that) - 2, stored biased and clamped to [0, 255] (a zero block -> 0; an amax
      that rounds to inf -> 255, which compressed-tensors then divides by and gives code 0).

Codes are round-half-even E2M1 of w / 2**e (computed as w * 2**-e, exact), with the same
zero-sign convention as compressed-tensors (a negative w gets code 0x8 unless w / 2**e
underflows in the input dtype: float32, or bfloat16 for bfloat16 weights, where torch divides
in bfloat16). Stored block scales are the biased exponent e + 127 as uint8 (E8M0; 0xFF would
be NaN), exactly compressed-tensors' weight_scale.
Not covered bit for bit: float32-subnormal weights (XLA:CPU flushes them to zero), and
dequantized values below 2**-126 (flushed).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qerl_jax.quant.e2m1 import e2m1_decode, e2m1_encode, pack_nibbles, unpack_nibbles
from qerl_jax.quant.nvfp4 import (BFLOAT16_SMALLEST_SUBNORMAL_EXPONENT,
                                  FLOAT32_SMALLEST_SUBNORMAL_EXPONENT,
                                  quotient_rounds_to_nonzero)
from qerl_jax.quant.formats import Format, register_format, validate_weight
from qerl_jax.quant.qarray import QuantizedWeight

MXFP4_BLOCK_SIZE = 32
E8M0_BIAS = 127
E2M1_EMAX = 2  # floor(log2(6))
MXFP4_RULES = ("ocp", "compressed_tensors")


def mxfp4_biased_exponents(block_amax: jax.Array, rule: str = "ocp") -> jax.Array:
    """Block amax float32 [...] (>= 0) -> biased shared exponents (E8M0 bits) int32 [...]."""
    bits = jax.lax.bitcast_convert_type(block_amax.astype(jnp.float32), jnp.uint32)
    if rule == "ocp":
        # floor(log2(amax)) = exponent field - 127 for normal amax; zero or subnormal amax
        # (exponent field 0) clamps to -127 like any amax below 2**-125.
        exponent_field = (bits >> 23).astype(jnp.int32)
        return jnp.clip(exponent_field - E2M1_EMAX, 0, 2 * E8M0_BIAS)
    if rule == "compressed_tensors":
        power_of_two = (bits + jnp.uint32(1 << 21)) & jnp.uint32(0xFF800000)
        exponent_field = (power_of_two >> 23).astype(jnp.int32)
        return jnp.where(exponent_field == 255, 255,
                         jnp.maximum(exponent_field - E2M1_EMAX, 0))
    raise ValueError(f"unknown MXFP4 rule {rule!r}; known: {', '.join(MXFP4_RULES)}")


@functools.partial(jax.jit, static_argnames=("rule",))
def _mxfp4_codes_and_exponents(weight: jax.Array, rule: str):
    rows, columns = weight.shape
    blocks = weight.astype(jnp.float32).reshape(rows, columns // MXFP4_BLOCK_SIZE,
                                                MXFP4_BLOCK_SIZE)
    biased = mxfp4_biased_exponents(jnp.max(jnp.abs(blocks), axis=-1), rule)[..., None]
    # 2**(127 - biased) is a normal float32 for biased in [0, 253]; 255 means a scale of inf.
    inverse_scale = jax.lax.bitcast_convert_type(
        (jnp.clip(254 - biased, 1, 254) << 23).astype(jnp.uint32), jnp.float32)
    scaled = jnp.where(biased == 255, 0.0, blocks * inverse_scale)
    smallest = (BFLOAT16_SMALLEST_SUBNORMAL_EXPONENT if weight.dtype == jnp.bfloat16
                else FLOAT32_SMALLEST_SUBNORMAL_EXPONENT)
    negative = (blocks < 0) & (biased != 255) & quotient_rounds_to_nonzero(
        blocks, biased - E8M0_BIAS, jnp.zeros_like(biased), smallest_subnormal_exponent=smallest)
    codes = e2m1_encode(scaled, negative).reshape(rows, columns)
    return pack_nibbles(codes), biased[..., 0].astype(jnp.uint8)


def mxfp4_quantize(weight: jax.Array, *, rule: str = "ocp", name: str = "weight",
                   check_finite: bool = True, dtype=None) -> QuantizedWeight:
    """Quantizes W [N, K] = [out, in] to MXFP4 (blocks of 32 along K).

    Args:
      weight: float32 or bfloat16 [N, K]; K must be a multiple of 32.
      rule: "ocp" (default) or "compressed_tensors" (bit-identical to compressed-tensors'
        MXFP4 compressor); see the module docstring.
      name: layer name used in error messages.
      check_finite: reject NaN/Inf (eager; pass False inside jit, see validate_weight).
      dtype: dequantization dtype recorded in the result (default: weight.dtype).
    Returns:
      QuantizedWeight(format="mxfp4"): codes uint8 [N, K/2] (even k in the low nibble),
      block_scales uint8 [N, K/32] (biased E8M0 exponents), tensor_scale None.
    """
    if rule not in MXFP4_RULES:
        raise ValueError(f"layer {name}: unknown MXFP4 rule {rule!r}; known: "
                         f"{', '.join(MXFP4_RULES)}")
    validate_weight(weight, block_size=MXFP4_BLOCK_SIZE, format_name="mxfp4", name=name,
                    check_finite=check_finite)
    codes, exponents = _mxfp4_codes_and_exponents(weight, rule)
    return QuantizedWeight(codes=codes, block_scales=exponents, tensor_scale=None,
                           format="mxfp4", shape=tuple(weight.shape),
                           dtype=jnp.dtype(dtype or weight.dtype).name)


@functools.partial(jax.jit, static_argnames=("dtype",))
def _mxfp4_dequantize(codes, block_scales, dtype):
    rows = codes.shape[0]
    values = e2m1_decode(unpack_nibbles(codes)).reshape(rows, block_scales.shape[1],
                                                        MXFP4_BLOCK_SIZE)
    biased = block_scales.astype(jnp.int32)[..., None]
    scale = jax.lax.bitcast_convert_type((jnp.maximum(biased, 1) << 23).astype(jnp.uint32),
                                         jnp.float32)
    # biased 0 is 2**-127, a float32 subnormal: scale in two normal steps instead.
    dequantized = jnp.where(biased == 0, (values * 2.0 ** -63) * 2.0 ** -64, values * scale)
    return dequantized.reshape(rows, -1).astype(dtype)


def mxfp4_dequantize(quantized: QuantizedWeight, dtype=None) -> jax.Array:
    """MXFP4 QuantizedWeight -> W [N, K] in `dtype`: e2m1(code) * 2**(block_scale - 127)."""
    if quantized.format != "mxfp4":
        raise ValueError(f"mxfp4_dequantize got a {quantized.format!r} QuantizedWeight")
    return _mxfp4_dequantize(quantized.codes, quantized.block_scales,
                             jnp.dtype(dtype or quantized.dtype))


register_format(Format(
    name="mxfp4", bits=4, block_size=MXFP4_BLOCK_SIZE,
    bytes_per_parameter=0.5 + 1 / MXFP4_BLOCK_SIZE,
    quantize=mxfp4_quantize, dequantize=mxfp4_dequantize,
    description="E2M1 + E8M0 power-of-two scale per 32 (OCP MX v1.0)"))
