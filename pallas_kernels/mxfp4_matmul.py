"""MXFP4 weight-only matmuls: y = x @ W^T, dx = dy @ W, W [N, K] in MXFP4 (Pallas, Triton backend).

Checkpoint layout (OCP MX v1.0 elements as compressed-tensors packs them):
  codes uint8 [N, K/2] (even k in the LOW nibble; E2M1 code = sign<<3 | index into
  [0, .5, 1, 1.5, 2, 3, 4, 6]); block_scales uint8 E8M0 [N, K/32]: w = e2m1(code) * 2^(s-127).
Kernel layout: see pallas_kernels.blockwise_matmul (nibble planes per K tile, zero padding).
Decoding is exact (e2m1 * 2^e fits bf16). Supported scales: s <= 248 for the "fp8" decoder,
28 <= s <= 154 for "ptx_scaled" (blocks with s < 28, i.e. |w| < 2^-98, lose precision there);
repack rejects s in (154, 255]. 0xFF (NaN) is rejected.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import blockwise_matmul as bw
from pallas_kernels.e2m1_decode import (DECODE_EXPONENT, e2m1_decode_reference,
                                        e2m1_planes_times_scales, e2m1_values)

SCALE_BLOCK = 32
MAX_SCALE_CODE = 154
# Power of two folded into the block scale per decoder: the multiplier 2^(s-127+a) is built from
# its exponent bits, (s + a) must stay in [1, 254] (fp8: a=6 -> s <= 248; ptx_scaled: a=100 -> s <= 154).
_PRESCALE_EXPONENT = {"fp8": 6, "ptx_scaled": 100}


def _decode(c, s_lo, s_hi, aux_refs, decoder, out_dtype):
    del aux_refs
    scales = []
    for s in (s_lo, s_hi):
        bits = (s.astype(jnp.int32) + _PRESCALE_EXPONENT[decoder]) << 23
        scale = jax.lax.bitcast_convert_type(bits, jnp.float32).astype(out_dtype)
        scales.append(bw.expand_block_scale(scale, SCALE_BLOCK))
    return e2m1_planes_times_scales(c, *scales, decoder, out_dtype)


def _scale_values(s):
    # 2^(s-127) from its exponent bits (s = 0, i.e. 2^-127, reads as 0).
    return jax.lax.bitcast_convert_type(s.astype(jnp.int32) << 23, jnp.float32)


MXFP4 = bw.FormatSpec(
    name="mxfp4", scale_block=SCALE_BLOCK, decoders=("fp8", "ptx_scaled"),
    # "ptx_scaled" (block scale applied in the decode asm) was faster than the PTX decode with
    # a separate scale multiply on the 7B layer shapes at M=8, with the same output bits.
    interpret_decoder="fp8", gpu_decoder="ptx_scaled", decode=_decode,
    epilogue_exponent=lambda d: -(DECODE_EXPONENT[d] + _PRESCALE_EXPONENT[d]),
    decode_values=e2m1_values, value_exponent=lambda d: -6 if d == "fp8" else 0,
    scale_values=_scale_values)


def _check_checkpoint(codes, block_scales):
    n, half_k = codes.shape
    k = 2 * half_k
    if codes.dtype != jnp.uint8:
        raise ValueError(f"MXFP4 codes must be uint8, got {codes.dtype}")
    if k % SCALE_BLOCK or block_scales.shape != (n, k // SCALE_BLOCK):
        raise ValueError(f"MXFP4 block_scales {block_scales.shape} do not match codes "
                         f"{codes.shape}: expected ({n}, {k // SCALE_BLOCK}) with K % 32 == 0")
    if block_scales.dtype != jnp.uint8:
        raise ValueError(f"MXFP4 block_scales must be uint8 (E8M0), got {block_scales.dtype}")
    return n, k


def repack_mxfp4(codes: jax.Array, block_scales: jax.Array, *,
                 tile_k: int = 256) -> bw.PackedWeight:
    """Checkpoint MXFP4 arrays -> kernel layout (once, at load time). Lossless: see unpack_mxfp4."""
    n, k = _check_checkpoint(codes, block_scales)
    try:
        top = int(jnp.max(block_scales)) if block_scales.size else 0
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
        # Under jit the scales are abstract: nothing to check here.
        top = 0
    if top > MAX_SCALE_CODE:
        raise ValueError(f"MXFP4 block scale code {top} > {MAX_SCALE_CODE} (2^27) is not "
                         "supported by the kernels (0xFF is NaN)")
    n_pad, k_pad = bw.padded_sizes(n, k, tile_k)
    planes = bw.to_plane_layout(codes, k=k, tile_k=tile_k, low_nibble_first=True)
    scales = bw.pad_scales(block_scales, n_pad=n_pad, k_pad=k_pad, block=SCALE_BLOCK)
    ts = jnp.ones((1,), jnp.float32)
    planes, scales = bw.tile_major_arrays(planes, scales, tile_k)
    return bw.PackedWeight(codes=planes, scales=scales, tensor_scale=ts, fmt="mxfp4", n=n, k=k,
                           tile_k=tile_k)


def unpack_mxfp4(packed: bw.PackedWeight):
    """Kernel layout -> (codes uint8 [N, K/2], block_scales uint8 [N, K/32])."""
    planes, kernel_scales = bw.row_major_arrays(packed.codes, packed.scales, packed.tile_k)
    codes = bw.from_plane_layout(planes, n=packed.n, k=packed.k, tile_k=packed.tile_k,
                                 low_nibble_first=True)
    scales = kernel_scales[:packed.n, :packed.k // SCALE_BLOCK]
    return codes, scales


def mxfp4_dequantize_reference(codes, block_scales) -> jax.Array:
    """Plain jnp dequantization of checkpoint arrays: float32 [N, K]."""
    n, k = _check_checkpoint(codes, block_scales)
    elements = jnp.stack([codes & 15, codes >> 4], axis=-1).reshape(n, k)
    scale = jnp.ldexp(jnp.float32(1.0), block_scales.astype(jnp.int32) - 127)
    scale = jnp.repeat(scale, SCALE_BLOCK, axis=1)
    return e2m1_decode_reference(elements) * scale


def mxfp4_matmul_reference(x, codes, block_scales) -> jax.Array:
    """Dequantize, then x @ W^T in float32: bf16 [M, N]."""
    w = mxfp4_dequantize_reference(codes, block_scales)
    y = jnp.dot(x.astype(jnp.float32), w.T, precision=jax.lax.Precision.HIGHEST)
    return y.astype(jnp.bfloat16)


def mxfp4_matmul_transposed_reference(dy, codes, block_scales) -> jax.Array:
    """Dequantize, then dy @ W in float32: bf16 [M, K]."""
    w = mxfp4_dequantize_reference(codes, block_scales)
    dx = jnp.dot(dy.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    return dx.astype(jnp.bfloat16)


def mxfp4_matmul(x: jax.Array, packed: bw.PackedWeight, *, interpret: bool = False,
                 config: bw.MatmulConfig | None = None, poison_output: bool = False) -> jax.Array:
    """y [..., N] bf16 = x [..., K] @ W^T with W packed by repack_mxfp4.

    config: tiling; None picks `blockwise_matmul.default_matmul_config(M, packed)`.
    poison_output: NaN-fill the kernel's output buffer first (tests: catches unwritten tiles).
    """
    return bw.blockwise_matmul(x, packed, spec=MXFP4, config=config, interpret=interpret,
                               poison_output=poison_output)


def mxfp4_matmul_transposed(dy: jax.Array, packed: bw.PackedWeight, *, interpret: bool = False,
                            config: bw.TransposedConfig | None = None,
                            poison_output: bool = False) -> jax.Array:
    """dx [..., K] bf16 = dy [..., N] @ W (backward of mxfp4_matmul w.r.t. x)."""
    return bw.blockwise_matmul_transposed(dy, packed, spec=MXFP4, config=config,
                                          interpret=interpret, poison_output=poison_output)


def mxfp4_dequantize(packed: bw.PackedWeight, *, interpret: bool = False,
                     config: bw.DequantizeConfig = bw.DequantizeConfig(),
                     poison_output: bool = False) -> jax.Array:
    """W as bf16 [N, K] from the kernel layout (Pallas tile kernel)."""
    return bw.blockwise_dequantize(packed, spec=MXFP4, config=config, interpret=interpret,
                                   poison_output=poison_output)
