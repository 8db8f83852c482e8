"""NF4 weight-only matmuls: y = x @ W^T, dx = dy @ W, W [N, K] in NF4 (Pallas, Triton backend).

Checkpoint layout (bitsandbytes / QLoRA NF4, double quantization already undone):
  codes uint8 [N, K/2] with the FIRST element (even k) in the HIGH nibble; absmax float32
  [N, K/64]: w = NF4_LEVELS[code] * absmax. `nf4_absmax_from_double_quant` undoes bitsandbytes'
  double quantization of absmax.
Kernel layout: see pallas_kernels.blockwise_matmul (nibble planes per K tile, zero padded absmax).
In-kernel decoders (the 16 levels are not a float format, so this is a table lookup):
  "lut":    gather from a 16-entry float32 table input (L1-resident), times absmax in f32.
  "lut16":  the same table in bf16, times bf16 absmax (one rounding more, cheaper multiply).
  "select": a 4-level tree of selects between the constants (no memory access).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import blockwise_matmul as bw

SCALE_BLOCK = 64
# bitsandbytes' NF4 code book (float32 constants, index = 4-bit code).
NF4_LEVELS = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], dtype=np.float32)


def _select_tree(v):
    bits = [((v >> i) & 1) == 1 for i in range(4)]
    level = [float(c) for c in NF4_LEVELS]
    for b in bits:
        level = [jnp.where(b, level[2 * i + 1], level[2 * i]) for i in range(len(level) // 2)]
    return level[0]


def _decode(c, s_lo, s_hi, aux_refs, decoder, out_dtype):
    lut_f32_ref, lut_bf16_ref = aux_refs
    out = []
    for v, s in (((c & 15).astype(jnp.int32), s_lo), ((c >> 4).astype(jnp.int32), s_hi)):
        if decoder == "lut16":
            level, scale = lut_bf16_ref[v], s.astype(jnp.bfloat16)
        elif decoder == "lut":
            level, scale = lut_f32_ref[v], s
        elif decoder == "select":
            level, scale = _select_tree(v), s
        else:
            raise ValueError(f"unknown NF4 decoder {decoder!r}")
        w = level * bw.expand_block_scale(scale, SCALE_BLOCK)
        out.append(w.astype(out_dtype))
    return tuple(out)


def _decode_values(c, aux_refs, decoder):
    lut_f32_ref, lut_bf16_ref = aux_refs
    out = []
    for v in ((c & 15).astype(jnp.int32), (c >> 4).astype(jnp.int32)):
        if decoder == "lut16":
            out.append(lut_bf16_ref[v])
        elif decoder == "lut":
            out.append(lut_f32_ref[v].astype(jnp.bfloat16))
        elif decoder == "select":
            out.append(_select_tree(v).astype(jnp.bfloat16))
        else:
            raise ValueError(f"unknown NF4 decoder {decoder!r}")
    return tuple(out)


NF4 = bw.FormatSpec(
    name="nf4", scale_block=SCALE_BLOCK, decoders=("lut", "lut16", "select"),
    interpret_decoder="lut", gpu_decoder="lut16", decode=_decode,
    epilogue_exponent=lambda d: 0,
    aux_arrays=lambda: (NF4_LEVELS, NF4_LEVELS.astype(jnp.bfloat16)),
    decode_values=_decode_values, scale_values=lambda s: s)


def nf4_absmax_from_double_quant(quantized_absmax: jax.Array, nested_absmax: jax.Array,
                                 nested_code: jax.Array, offset, *,
                                 nested_blocksize: int = 256) -> jax.Array:
    """Undoes bitsandbytes double quantization: absmax = code[q] * nested_absmax[i // 256] + offset.

    Args:
      quantized_absmax: uint8 [B] (flat, one per 64-weight block).
      nested_absmax: float32 [ceil(B / nested_blocksize)].
      nested_code: float32 [256], the 8-bit dynamic map.
      offset: float32 scalar (the mean subtracted before quantizing).
    Returns: float32 [B].
    """
    q = quantized_absmax.astype(jnp.int32).reshape(-1)
    block = jnp.arange(q.shape[0]) // nested_blocksize
    return (jnp.asarray(nested_code, jnp.float32)[q] * jnp.asarray(nested_absmax, jnp.float32)[block]
            + jnp.asarray(offset, jnp.float32))


def _check_checkpoint(codes, absmax):
    n, half_k = codes.shape
    k = 2 * half_k
    if codes.dtype != jnp.uint8:
        raise ValueError(f"NF4 codes must be uint8, got {codes.dtype}")
    if k % SCALE_BLOCK or absmax.shape != (n, k // SCALE_BLOCK):
        raise ValueError(f"NF4 absmax {absmax.shape} does not match codes {codes.shape}: "
                         f"expected ({n}, {k // SCALE_BLOCK}) with K % 64 == 0")
    if absmax.dtype != jnp.float32:
        raise ValueError(f"NF4 absmax must be float32, got {absmax.dtype}")
    return n, k


def repack_nf4(codes: jax.Array, absmax: jax.Array, *, tile_k: int = 256) -> bw.PackedWeight:
    """Checkpoint NF4 arrays -> kernel layout (once, at load time). Lossless: see unpack_nf4."""
    n, k = _check_checkpoint(codes, absmax)
    if tile_k < 2 * SCALE_BLOCK:
        raise ValueError(f"NF4 needs tile_k >= {2 * SCALE_BLOCK}, got {tile_k}")
    n_pad, k_pad = bw.padded_sizes(n, k, tile_k)
    planes = bw.to_plane_layout(codes, k=k, tile_k=tile_k, low_nibble_first=False)
    scales = bw.pad_scales(absmax, n_pad=n_pad, k_pad=k_pad, block=SCALE_BLOCK)
    planes, scales = bw.tile_major_arrays(planes, scales, tile_k)
    return bw.PackedWeight(codes=planes, scales=scales, tensor_scale=jnp.ones((1,), jnp.float32),
                           fmt="nf4", n=n, k=k, tile_k=tile_k)


def unpack_nf4(packed: bw.PackedWeight):
    """Kernel layout -> (codes uint8 [N, K/2] high-nibble-first, absmax float32 [N, K/64])."""
    planes, kernel_scales = bw.row_major_arrays(packed.codes, packed.scales, packed.tile_k)
    codes = bw.from_plane_layout(planes, n=packed.n, k=packed.k, tile_k=packed.tile_k,
                                 low_nibble_first=False)
    return codes, kernel_scales[:packed.n, :packed.k // SCALE_BLOCK]


def nf4_dequantize_reference(codes, absmax) -> jax.Array:
    """Plain jnp dequantization of checkpoint arrays: float32 [N, K]."""
    n, k = _check_checkpoint(codes, absmax)
    elements = jnp.stack([codes >> 4, codes & 15], axis=-1).reshape(n, k).astype(jnp.int32)
    return jnp.asarray(NF4_LEVELS)[elements] * jnp.repeat(absmax, SCALE_BLOCK, axis=1)


def nf4_matmul_reference(x, codes, absmax) -> jax.Array:
    """Dequantize, then x @ W^T in float32: bf16 [M, N]."""
    w = nf4_dequantize_reference(codes, absmax)
    return jnp.dot(x.astype(jnp.float32), w.T,
                   precision=jax.lax.Precision.HIGHEST).astype(jnp.bfloat16)


def nf4_matmul_transposed_reference(dy, codes, absmax) -> jax.Array:
    """Dequantize, then dy @ W in float32: bf16 [M, K]."""
    w = nf4_dequantize_reference(codes, absmax)
    return jnp.dot(dy.astype(jnp.float32), w,
                   precision=jax.lax.Precision.HIGHEST).astype(jnp.bfloat16)


def nf4_matmul(x: jax.Array, packed: bw.PackedWeight, *, interpret: bool = False,
               config: bw.MatmulConfig | None = None, poison_output: bool = False) -> jax.Array:
    """y [..., N] bf16 = x [..., K] @ W^T with W packed by repack_nf4 (see nvfp4_matmul)."""
    return bw.blockwise_matmul(x, packed, spec=NF4, config=config, interpret=interpret,
                               poison_output=poison_output)


def nf4_matmul_transposed(dy: jax.Array, packed: bw.PackedWeight, *, interpret: bool = False,
                          config: bw.TransposedConfig | None = None,
                          poison_output: bool = False) -> jax.Array:
    """dx [..., K] bf16 = dy [..., N] @ W (backward of nf4_matmul w.r.t. x)."""
    return bw.blockwise_matmul_transposed(dy, packed, spec=NF4, config=config,
                                          interpret=interpret, poison_output=poison_output)


def nf4_dequantize(packed: bw.PackedWeight, *, interpret: bool = False,
                   config: bw.DequantizeConfig = bw.DequantizeConfig(),
                   poison_output: bool = False) -> jax.Array:
    """W as bf16 [N, K] from the kernel layout (Pallas tile kernel)."""
    return bw.blockwise_dequantize(packed, spec=NF4, config=config, interpret=interpret,
                                   poison_output=poison_output)
