"""NVFP4 weight-only matmuls: y = x @ W^T, dx = dy @ W, W [N, K] in NVFP4 (Pallas, Triton backend).

Checkpoint layout (compressed-tensors "nvfp4-pack-quantized", what qerl_jax.quant produces):
  codes uint8 [N, K/2] (even k in the LOW nibble; E2M1 code = sign<<3 | index into
  [0, .5, 1, 1.5, 2, 3, 4, 6]); block_scales float8_e4m3fn [N, K/16]; tensor_scale float32
  scalar, a divisor: w = e2m1(code) * float(block_scale) / tensor_scale.
Kernel layout: see pallas_kernels.blockwise_matmul (nibble planes per K tile, zero padding);
the block scales are stored as canonical UE5M3 codes (uint8, below), not as e4m3 bytes.
Decoding is exact: e2m1 * fp8 scale fits bf16, and 1/tensor_scale is applied to the f32 sums.

Canonical scale codes (kernel layout only; `kernel_scale_codes` / `checkpoint_scales` convert
losslessly for every finite nonnegative e4m3 scale, -0 becoming +0):
  every nonzero e4m3 value (1 + m/8) * 2^e, e in [-9, 8] (the e4m3 subnormals m * 2^-9
  normalized) is the byte ((e + 10) << 3) | m, in [8, 151]; zero is ZERO_SCALE_CODE (255).
  The bf16 bit pattern of scale * 2^P is then (code << 4) + ((117 + P) << 7): one integer
  multiply-add, no float conversion, and for P = 118 one multiply-add makes the packed pair
  (s, s) of the "ptx_paired_scales" decoder: code * 0x00100010 + 0x75807580. For the zero code that pattern
  is about -2^-117: times any e2m1 pattern (<= 6 * 2^-126) the product rounds to 0, so zero
  scales need no special case there; the other decoders select 0 for it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels import blockwise_matmul as bw
from pallas_kernels.e2m1_decode import (DECODE_EXPONENT, e2m1_decode_reference,
                                        e2m1_paired_scaled_planes, e2m1_planes_times_scales,
                                        e2m1_values)

SCALE_BLOCK = 16
# Power of two folded into the block scale per decoder so that decoded weights are normal bf16
# (fp8 decode is e2m1/64; the bf16-pattern decoders give e2m1 * 2^-126 and 448 * 2^118 < 2^127).
_PRESCALE_EXPONENT = {"fp8": 6, "ptx_scaled": 118, "ptx_paired_scales": 118}

# ----------------------------------------------------------------------------------------------
# Canonical scale codes (UE5M3; see the module docstring)

ZERO_SCALE_CODE = 255
_INVALID = -1


def _scale_code_tables() -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 byte -> canonical code, int16 [256], _INVALID for negative or NaN scales;
    canonical code -> e4m3 byte, uint8 [256], 0 for unused codes)."""
    values = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    to_code = np.full(256, _INVALID, np.int16)
    to_byte = np.zeros(256, np.uint8)
    for byte, value in enumerate(values):
        if value == 0:
            to_code[byte] = ZERO_SCALE_CODE
        elif np.isfinite(value) and value > 0:
            exponent = int(np.floor(np.log2(value)))
            mantissa = value / 2.0 ** exponent * 8 - 8
            assert mantissa == int(mantissa) and -9 <= exponent <= 8, (byte, value)
            code = ((exponent + 10) << 3) | int(mantissa)
            to_code[byte] = code
            to_byte[code] = byte
    return to_code, to_byte


_E4M3_TO_CODE, _CODE_TO_E4M3 = _scale_code_tables()


def kernel_scale_codes(block_scales: jax.Array) -> jax.Array:
    """float8_e4m3fn block scales (any shape) -> canonical uint8 codes (lossless for finite
    nonnegative scales. Negative or NaN scales, which NVFP4 does not produce, are refused here
    when the values are concrete; traced, they become the zero code: check concrete scales
    with `invalid_scale_count` first, as qerl_jax.quant.backends.kernel_layout.kernel_refusal does)."""
    codes = _table_codes(block_scales)
    if not isinstance(codes, jax.core.Tracer):
        bad = int(jnp.sum(codes == _INVALID))
        if bad:
            raise ValueError(f"NVFP4 block scales must be finite and >= 0 (UE4M3); {bad} of "
                             f"{block_scales.size} are negative or NaN")
    return codes.astype(jnp.uint8)


def invalid_scale_count(block_scales: jax.Array) -> jax.Array:
    """How many e4m3 block scales are negative or NaN (int32 scalar)."""
    return jnp.sum(_table_codes(block_scales) == _INVALID, dtype=jnp.int32)


def _table_codes(block_scales: jax.Array) -> jax.Array:
    """Canonical codes as int16 (_INVALID for negative or NaN scales), same shape."""
    return jnp.asarray(_E4M3_TO_CODE)[_e4m3_bytes(block_scales).astype(jnp.int32)]


def checkpoint_scales(scale_codes: jax.Array) -> jax.Array:
    """Canonical uint8 codes -> float8_e4m3fn block scales (the inverse of kernel_scale_codes)."""
    if scale_codes.dtype != jnp.uint8:
        raise ValueError(f"NVFP4 kernel scale codes must be uint8, got {scale_codes.dtype}")
    table = jnp.asarray(_CODE_TO_E4M3)
    return jax.lax.bitcast_convert_type(table[scale_codes.astype(jnp.int32)],
                                        jnp.float8_e4m3fn)


def _e4m3_bytes(block_scales: jax.Array) -> jax.Array:
    """The e4m3 scales' bytes (uint8, same shape)."""
    if block_scales.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"NVFP4 block_scales must be float8_e4m3fn, got {block_scales.dtype}")
    return jax.lax.bitcast_convert_type(block_scales, jnp.uint8)


def scale_pattern_offset(prescale_exponent: int) -> int:
    """C with (code << 4) + C = the bf16 bit pattern of scale * 2^prescale_exponent."""
    return (117 + prescale_exponent) << 7


def scale_values_from_codes(codes: jax.Array, prescale_exponent: int) -> jax.Array:
    """Canonical codes (uint8, any shape) -> scale * 2^prescale_exponent as bf16 (exact; 0 for
    the zero code). Integer ops and a bitcast: runs inside the kernels and in interpret mode."""
    wide = codes.astype(jnp.uint16)
    pattern = (wide << 4) + jnp.uint16(scale_pattern_offset(prescale_exponent))
    values = jax.lax.bitcast_convert_type(pattern, jnp.bfloat16)
    return jnp.where(codes == ZERO_SCALE_CODE, jnp.zeros_like(values), values)


_PAIR_MULTIPLIER = 0x00100010
_PAIR_OFFSET = scale_pattern_offset(118) * 0x00010001


def scale_pair_patterns(codes: jax.Array) -> jax.Array:
    """Canonical codes (uint8, any shape) -> uint32 packed bf16x2 patterns (s * 2^118, s * 2^118),
    one integer multiply-add each (the "ptx_paired_scales" decoder's scale operand; the zero code gives a
    pattern of about -2^-117, whose products with e2m1 patterns round to 0)."""
    return codes.astype(jnp.uint32) * jnp.uint32(_PAIR_MULTIPLIER) + jnp.uint32(_PAIR_OFFSET)


# ----------------------------------------------------------------------------------------------
# The format description for the kernels


def _decode(c, s_lo, s_hi, aux_refs, decoder, out_dtype):
    del aux_refs
    if decoder == "ptx_paired_scales" and out_dtype == jnp.bfloat16:
        pairs = [bw.expand_block_scale(scale_pair_patterns(s), SCALE_BLOCK) for s in (s_lo, s_hi)]
        return e2m1_paired_scaled_planes(c, *pairs)
    prescale = _PRESCALE_EXPONENT[decoder]
    scales = [bw.expand_block_scale(scale_values_from_codes(s, prescale).astype(out_dtype),
                                    SCALE_BLOCK) for s in (s_lo, s_hi)]
    return e2m1_planes_times_scales(c, *scales, decoder, out_dtype)


def _scale_values(s):
    return scale_values_from_codes(s, 0).astype(jnp.float32)


NVFP4 = bw.FormatSpec(
    name="nvfp4", scale_block=SCALE_BLOCK,
    decoders=("fp8", "ptx_scaled", "ptx_paired_scales"),
    # "ptx_paired_scales": less kernel time than the PTX decode with a separate scale multiply
    # on the 7B decode shapes and a faster 7B rollout; checked on the GPU in every kernel and
    # orientation.
    interpret_decoder="fp8", gpu_decoder="ptx_paired_scales", decode=_decode,
    epilogue_exponent=lambda d: -(DECODE_EXPONENT[d] + _PRESCALE_EXPONENT[d]),
    decode_values=e2m1_values, value_exponent=lambda d: -6 if d == "fp8" else 0,
    scale_values=_scale_values, kernel_scale_dtype="uint8")


def _check_checkpoint(codes, block_scales):
    n, half_k = codes.shape
    k = 2 * half_k
    if codes.dtype != jnp.uint8:
        raise ValueError(f"NVFP4 codes must be uint8, got {codes.dtype}")
    if k % SCALE_BLOCK or block_scales.shape != (n, k // SCALE_BLOCK):
        raise ValueError(f"NVFP4 block_scales {block_scales.shape} do not match codes "
                         f"{codes.shape}: expected ({n}, {k // SCALE_BLOCK}) with K % 16 == 0")
    if block_scales.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"NVFP4 block_scales must be float8_e4m3fn, got {block_scales.dtype}")
    return n, k


def kernel_layout_scales(block_scales: jax.Array, *, n_pad: int, k_pad: int) -> jax.Array:
    """Checkpoint e4m3 block scales [N, K/16] -> kernel-layout canonical codes uint8
    [N_pad, K_pad/16] (padding: the zero code)."""
    padded = bw.pad_scales(block_scales, n_pad=n_pad, k_pad=k_pad, block=SCALE_BLOCK)
    return kernel_scale_codes(padded)


def repack_nvfp4(codes: jax.Array, block_scales: jax.Array, tensor_scale: jax.Array, *,
                 tile_k: int = 256) -> bw.PackedWeight:
    """Checkpoint NVFP4 arrays -> kernel layout (once, at load time). Lossless: see unpack_nvfp4."""
    n, k = _check_checkpoint(codes, block_scales)
    n_pad, k_pad = bw.padded_sizes(n, k, tile_k)
    planes = bw.to_plane_layout(codes, k=k, tile_k=tile_k, low_nibble_first=True)
    scales = kernel_layout_scales(block_scales, n_pad=n_pad, k_pad=k_pad)
    ts = jnp.asarray(tensor_scale, jnp.float32).reshape(1)
    planes, scales = bw.tile_major_arrays(planes, scales, tile_k)
    return bw.PackedWeight(codes=planes, scales=scales, tensor_scale=ts, fmt="nvfp4", n=n, k=k,
                           tile_k=tile_k)


def unpack_nvfp4(packed: bw.PackedWeight):
    """Kernel layout -> (codes uint8 [N, K/2], block_scales f8 [N, K/16], tensor_scale f32 [])."""
    planes, kernel_scales = bw.row_major_arrays(packed.codes, packed.scales, packed.tile_k)
    codes = bw.from_plane_layout(planes, n=packed.n, k=packed.k, tile_k=packed.tile_k,
                                 low_nibble_first=True)
    scales = checkpoint_scales(kernel_scales[:packed.n, :packed.k // SCALE_BLOCK])
    return codes, scales, packed.tensor_scale[0]


def nvfp4_dequantize_reference(codes, block_scales, tensor_scale) -> jax.Array:
    """Plain jnp dequantization of checkpoint arrays: float32 [N, K]."""
    n, k = _check_checkpoint(codes, block_scales)
    elements = jnp.stack([codes & 15, codes >> 4], axis=-1).reshape(n, k)
    scale = jnp.repeat(block_scales.astype(jnp.float32), SCALE_BLOCK, axis=1)
    return e2m1_decode_reference(elements) * scale / jnp.asarray(tensor_scale, jnp.float32)


def nvfp4_matmul_reference(x, codes, block_scales, tensor_scale) -> jax.Array:
    """Dequantize, then x @ W^T in float32: bf16 [M, N]."""
    w = nvfp4_dequantize_reference(codes, block_scales, tensor_scale)
    y = jnp.dot(x.astype(jnp.float32), w.T, precision=jax.lax.Precision.HIGHEST)
    return y.astype(jnp.bfloat16)


def nvfp4_matmul_transposed_reference(dy, codes, block_scales, tensor_scale) -> jax.Array:
    """Dequantize, then dy @ W in float32: bf16 [M, K]."""
    w = nvfp4_dequantize_reference(codes, block_scales, tensor_scale)
    dx = jnp.dot(dy.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    return dx.astype(jnp.bfloat16)


def nvfp4_matmul(x: jax.Array, packed: bw.PackedWeight, *, interpret: bool = False,
                 config: bw.MatmulConfig | None = None, poison_output: bool = False) -> jax.Array:
    """y [..., N] bf16 = x [..., K] @ W^T with W packed by repack_nvfp4.

    config: tiling; None picks `blockwise_matmul.default_matmul_config(M, packed)`.
    poison_output: NaN-fill the kernel's output buffer first (tests: catches unwritten tiles).
    """
    return bw.blockwise_matmul(x, packed, spec=NVFP4, config=config, interpret=interpret,
                               poison_output=poison_output)


def nvfp4_matmul_transposed(dy: jax.Array, packed: bw.PackedWeight, *, interpret: bool = False,
                            config: bw.TransposedConfig | None = None,
                            poison_output: bool = False) -> jax.Array:
    """dx [..., K] bf16 = dy [..., N] @ W (backward of nvfp4_matmul w.r.t. x)."""
    return bw.blockwise_matmul_transposed(dy, packed, spec=NVFP4, config=config,
                                          interpret=interpret, poison_output=poison_output)


def nvfp4_dequantize(packed: bw.PackedWeight, *, interpret: bool = False,
                     config: bw.DequantizeConfig = bw.DequantizeConfig(),
                     poison_output: bool = False) -> jax.Array:
    """W as bf16 [N, K] from the kernel layout (Pallas tile kernel)."""
    return bw.blockwise_dequantize(packed, spec=NVFP4, config=config, interpret=interpret,
                                   poison_output=poison_output)
