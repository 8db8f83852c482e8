"""NVFP4 weights exactly as compressed-tensors / llm-compressor make them ("nvfp4-pack-quantized").

Recipe (compressed-tensors 0.20: quantization/utils/helpers.py generate_gparam and
calculate_qparams, quantization/lifecycle/forward.py _quantize, compressors/nvfp4/helpers.py
pack_fp4_to_uint8), for a weight W [N, K] and blocks of 16 along K:

  global     = 448 * 6 / max(amax(W), tiny)        (1.0 if that overflows)   -> tensor_scale
  block      = fp8_e4m3(min(global * (amax(block) / 6), 448)), 0 -> 0.125   -> block_scales
  code       = e2m1(W / (block / global))            (round half to even, saturate at 6)
  dequant    = e2m1 value * (block / global)

Bit-exactness details reproduced from the reference (all checked by tests/quant/test_nvfp4.py):
- Intermediate math runs in the input's dtype where torch does: for bfloat16 weights
  `1 / amax`, `* 2688` (torch evaluates 2688 / t as t.reciprocal() * 2688) and `amax / 6` are
  each rounded to bfloat16; `global * block`, `block / global` and `W / scale` are float32.
  Roundings to bfloat16 and to FP8 E4M3 are done on the bit patterns (integer ops), because
  XLA may drop f32 -> bf16 -> f32 convert pairs inside jit (excess precision on GPU), and
  divisions go through `exact_divide`, because XLA rewrites a division by a broadcast or a
  constant into a multiplication by the reciprocal (off by one bit now and then).
- A zero FP8 block scale (all-zero block, or one below FP8's subnormal range relative to the
  global scale) is replaced by 0.125, compressed-tensors' eps for float8_e4m3fn.
- Sign of zero codes: a negative weight whose scaled value rounds to 0 gets code 0x8 ("-0")
  unless its IEEE float32 quotient underflows to -0.0 (then torch.sign gives 0 and the code
  is 0x0). The underflow test is done on exponents, so XLA's flush-to-zero of subnormals does
  not change the result.
Not covered: float32-subnormal weights (|w| < 1.2e-38); XLA:CPU flushes them to zero.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qerl_jax.quant.e2m1 import (E2M1_MAX, e2m1_decode, e2m1_encode, pack_nibbles,
                                 unpack_nibbles)
from qerl_jax.quant.formats import Format, register_format, validate_weight
from qerl_jax.quant.qarray import QuantizedWeight

NVFP4_BLOCK_SIZE = 16
FP8_E4M3_MAX = 448.0
FP8_E4M3_BITS_OF_EPS = 0x20  # 0.125, compressed-tensors' replacement for a zero FP8 scale
FLOAT32_TINY = 2.0 ** -126  # torch.finfo(float32 or bfloat16).tiny
FLOAT32_SMALLEST_SUBNORMAL_EXPONENT = -149
BFLOAT16_SMALLEST_SUBNORMAL_EXPONENT = -133


def round_float32_to_bfloat16(x: jax.Array) -> jax.Array:
    """float32 [...] -> float32 [...] holding the nearest bfloat16 (ties to even), via bits.

    Same as torch's float -> bfloat16 conversion for finite inputs (overflow -> inf).
    """
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    rounded = (bits + jnp.uint32(0x7FFF) + ((bits >> 16) & 1)) & jnp.uint32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(rounded, jnp.float32)


def float32_to_float8_e4m3fn_bits(x: jax.Array) -> jax.Array:
    """Non-negative float32 [...] (<= 448) -> FP8 E4M3FN bit patterns uint8 [...], RNE.

    Normal range (x >= 2**-6): round the float32 mantissa to 3 bits (ties to even) on the bit
    pattern and rebias the exponent (127 -> 7). Subnormal range: round(x * 2**9), which is
    exact scaling followed by round-half-even; the integer is the E4M3 bit pattern (8 -> 2**-6).
    """
    x = x.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    rounded = bits + jnp.uint32(0x7FFFF) + ((bits >> 20) & 1)
    normal = (rounded >> 20).astype(jnp.int32) - ((127 - 7) << 3)
    subnormal = jnp.round(x * 512.0).astype(jnp.int32)
    return jnp.where(x >= 2.0 ** -6, normal, subnormal).astype(jnp.uint8)


def _exponent_and_mantissa(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float32 [...] -> (unbiased exponent int32, 23-bit mantissa int32) of a normal float."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    exponent = ((bits >> 23) & 0xFF).astype(jnp.int32) - 127
    return exponent, (bits & 0x7FFFFF).astype(jnp.int32)


def quotient_rounds_to_nonzero(numerator: jax.Array, denominator_exponent: jax.Array,
                               denominator_mantissa: jax.Array, *,
                               smallest_subnormal_exponent: int) -> jax.Array:
    """Whether IEEE division |numerator| / d rounds to a nonzero value (subnormals kept).

    d = (1 + mantissa / 2**23) * 2**exponent. The quotient is nonzero iff it exceeds half the
    smallest subnormal 2**s of the result type (a tie rounds to the even 0). Decided on
    exponents and mantissas so that flush-to-zero hardware gives the IEEE answer. Valid for
    normal numerators (0 -> False).
    """
    exponent, mantissa = _exponent_and_mantissa(numerator)
    half_smallest = smallest_subnormal_exponent - 1
    difference = exponent - denominator_exponent
    return (numerator != 0) & ((difference > half_smallest)
                               | ((difference == half_smallest)
                                  & (mantissa > denominator_mantissa)))


def _round_like_input(x: jax.Array, input_dtype) -> jax.Array:
    if jnp.dtype(input_dtype) == jnp.bfloat16:
        return round_float32_to_bfloat16(x)
    return x


def exact_divide(numerator: jax.Array, denominator) -> jax.Array:
    """IEEE float division numerator / denominator (broadcasting), as torch computes it.

    XLA's algebraic simplifier rewrites a division by a broadcast (scalar or per-block
    divisor) or by a constant into a multiplication by the reciprocal, which differs in the
    last bit. Materializing the broadcast divisor behind an optimization barrier keeps the
    true division. Costs one divisor-sized temporary.
    """
    numerator = jnp.asarray(numerator, jnp.float32)
    denominator = jnp.asarray(denominator, jnp.float32)
    shape = jnp.broadcast_shapes(numerator.shape, denominator.shape)
    numerator = jnp.broadcast_to(numerator, shape)
    denominator = jax.lax.optimization_barrier(jnp.broadcast_to(denominator, shape))
    return numerator / denominator


@jax.jit
def nvfp4_global_scale(weight: jax.Array) -> jax.Array:
    """compressed-tensors' weight_global_scale of W [N, K]: 448*6 / amax(W), a float32 [].

    torch computes 2688 / t as t.reciprocal() * 2688, both rounded to W's dtype; an overflow
    (amax below ~8e-36) gives 1.0, as generate_gparam's nan_to_num does.
    """
    amax = jnp.maximum(jnp.max(jnp.abs(weight.astype(jnp.float32))), FLOAT32_TINY)
    reciprocal = _round_like_input(exact_divide(1.0, amax), weight.dtype)
    global_scale = _round_like_input(reciprocal * (FP8_E4M3_MAX * E2M1_MAX), weight.dtype)
    return jnp.where(jnp.isfinite(global_scale), global_scale, 1.0).astype(jnp.float32)


@jax.jit
def _nvfp4_codes_and_block_scales(weight: jax.Array, global_scale: jax.Array):
    """W [N, K] + global float32 [] -> (packed codes uint8 [N, K/2], fp8 scales [N, K/16])."""
    rows, columns = weight.shape
    blocks = weight.astype(jnp.float32).reshape(rows, columns // NVFP4_BLOCK_SIZE,
                                                NVFP4_BLOCK_SIZE)
    block_amax = jnp.max(jnp.abs(blocks), axis=-1)
    block_scale = _round_like_input(exact_divide(block_amax, E2M1_MAX), weight.dtype)
    block_scale = jnp.minimum(global_scale * block_scale, FP8_E4M3_MAX)
    scale_bits = float32_to_float8_e4m3fn_bits(block_scale)
    scale_bits = jnp.where(scale_bits == 0, jnp.uint8(FP8_E4M3_BITS_OF_EPS), scale_bits)
    scale_fp8 = jax.lax.bitcast_convert_type(scale_bits, jnp.float8_e4m3fn)
    effective_scale = exact_divide(scale_fp8.astype(jnp.float32), global_scale)[..., None]
    scaled = exact_divide(blocks, effective_scale)
    scale_exponent, scale_mantissa = _exponent_and_mantissa(effective_scale)
    negative = (blocks < 0) & quotient_rounds_to_nonzero(
        blocks, scale_exponent, scale_mantissa,
        smallest_subnormal_exponent=FLOAT32_SMALLEST_SUBNORMAL_EXPONENT)
    codes = e2m1_encode(scaled, negative).reshape(rows, columns)
    return pack_nibbles(codes), scale_fp8


def nvfp4_quantize(weight: jax.Array, *, name: str = "weight", check_finite: bool = True,
                   global_scale: jax.Array | None = None,
                   dtype=None) -> QuantizedWeight:
    """Quantizes W [N, K] = [out, in] to NVFP4, bit-identical to compressed-tensors.

    Args:
      weight: float32 or bfloat16 [N, K]; K must be a multiple of 16. (A float16 weight is cast
        exactly to float32 and handled like one; compressed-tensors would round some
        intermediates to float16, so bit-exactness is claimed for float32 and bfloat16.)
      name: layer name used in error messages.
      check_finite: reject NaN/Inf weights (eager check: raises if `weight` is traced; pass
        False inside jit after checking outside).
      global_scale: optional float32 [] tensor scale to use instead of 448*6/amax(W) (e.g. one
        shared by q/k/v, as QeRL's llm-compressor copy does).
      dtype: dequantization dtype recorded in the result (default: weight.dtype).
    Returns:
      QuantizedWeight(format="nvfp4"): codes uint8 [N, K/2] (even k in the low nibble),
      block_scales float8_e4m3fn [N, K/16], tensor_scale float32 [] (a divisor).
    """
    validate_weight(weight, block_size=NVFP4_BLOCK_SIZE, format_name="nvfp4", name=name,
                    check_finite=check_finite)
    if global_scale is None:
        global_scale = nvfp4_global_scale(weight)
    global_scale = jnp.asarray(global_scale, jnp.float32).reshape(())
    codes, block_scales = _nvfp4_codes_and_block_scales(weight, global_scale)
    return QuantizedWeight(codes=codes, block_scales=block_scales, tensor_scale=global_scale,
                           format="nvfp4", shape=tuple(weight.shape),
                           dtype=jnp.dtype(dtype or weight.dtype).name)


@functools.partial(jax.jit, static_argnames=("dtype",))
def _nvfp4_dequantize(codes, block_scales, tensor_scale, dtype):
    rows = codes.shape[0]
    values = e2m1_decode(unpack_nibbles(codes)).reshape(rows, block_scales.shape[1],
                                                        NVFP4_BLOCK_SIZE)
    scale = exact_divide(block_scales.astype(jnp.float32), tensor_scale)
    return (values * scale[..., None]).reshape(rows, -1).astype(dtype)


def nvfp4_dequantize(quantized: QuantizedWeight, dtype=None) -> jax.Array:
    """NVFP4 QuantizedWeight -> W [N, K] in `dtype` (default quantized.dtype).

    w = e2m1(code) * (block_scale / global_scale) in float32, then one rounding to `dtype`
    (what compressed-tensors' decompress computes).
    """
    if quantized.format != "nvfp4":
        raise ValueError(f"nvfp4_dequantize got a {quantized.format!r} QuantizedWeight")
    return _nvfp4_dequantize(quantized.codes, quantized.block_scales, quantized.tensor_scale,
                             jnp.dtype(dtype or quantized.dtype))


register_format(Format(
    name="nvfp4", bits=4, block_size=NVFP4_BLOCK_SIZE,
    bytes_per_parameter=0.5 + 1 / NVFP4_BLOCK_SIZE,
    quantize=nvfp4_quantize, dequantize=nvfp4_dequantize,
    description="E2M1 + FP8 E4M3 scale per 16 + FP32 tensor scale (compressed-tensors)"))
