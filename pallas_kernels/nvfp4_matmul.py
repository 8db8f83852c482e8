"""NVFP4 weight-only matmuls: y = x @ W^T, dx = dy @ W, W [N, K] in NVFP4 (Pallas, Triton backend).

Checkpoint layout (compressed-tensors "nvfp4-pack-quantized", what qerl_jax.quant produces):
  codes uint8 [N, K/2] (even k in the LOW nibble; E2M1 code = sign<<3 | index into
  [0, .5, 1, 1.5, 2, 3, 4, 6]); block_scales float8_e4m3fn [N, K/16]; tensor_scale float32
  scalar, a divisor: w = e2m1(code) * float(block_scale) / tensor_scale.
Kernel layout: see pallas_kernels.blockwise_matmul (nibble planes per K tile, zero padding).
Decoding is exact: e2m1 * fp8 scale fits bf16, and 1/tensor_scale is applied to the f32 sums.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import blockwise_matmul as bw
from pallas_kernels.e2m1_decode import (DECODE_EXPONENT, e2m1_decode_reference,
                                        e2m1_planes_times_scales, e2m1_values)

SCALE_BLOCK = 16
# Power of two folded into the block scale per decoder so that decoded weights are normal bf16
# (fp8 decode is e2m1/64; the bf16-pattern decoders give e2m1 * 2^-126 and 448 * 2^118 < 2^127).
_PRESCALE_EXPONENT = {"fp8": 6, "bits": 118, "asm": 118, "asmn": 0, "asms": 118}


def _decode(c, s_lo, s_hi, aux_refs, decoder, out_dtype):
    del aux_refs
    factor = 2.0 ** _PRESCALE_EXPONENT[decoder]
    scales = [bw.expand_block_scale((s.astype(jnp.float32) * factor).astype(out_dtype),
                                    SCALE_BLOCK) for s in (s_lo, s_hi)]
    return e2m1_planes_times_scales(c, *scales, decoder, out_dtype)


def _scale_values(s):
    return s.astype(jnp.float32)


NVFP4 = bw.FormatSpec(
    name="nvfp4", scale_block=SCALE_BLOCK, decoders=("fp8", "bits", "asm", "asmn", "asms"),
    interpret_decoder="fp8", gpu_decoder="asm", decode=_decode,
    epilogue_exponent=lambda d: -(DECODE_EXPONENT[d] + _PRESCALE_EXPONENT[d]),
    decode_values=e2m1_values, value_exponent=lambda d: -6 if d == "fp8" else 0,
    scale_values=_scale_values)


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


def repack_nvfp4(codes: jax.Array, block_scales: jax.Array, tensor_scale: jax.Array, *,
                 tile_k: int = 256) -> bw.PackedWeight:
    """Checkpoint NVFP4 arrays -> kernel layout (once, at load time). Lossless: see unpack_nvfp4."""
    n, k = _check_checkpoint(codes, block_scales)
    n_pad, k_pad = bw.padded_sizes(n, k, tile_k)
    planes = bw.to_plane_layout(codes, k=k, tile_k=tile_k, low_nibble_first=True)
    scales = bw.pad_scales(block_scales, n_pad=n_pad, k_pad=k_pad, block=SCALE_BLOCK)
    ts = jnp.asarray(tensor_scale, jnp.float32).reshape(1)
    return bw.PackedWeight(codes=planes, scales=scales, tensor_scale=ts, fmt="nvfp4", n=n, k=k,
                           tile_k=tile_k)


def unpack_nvfp4(packed: bw.PackedWeight):
    """Kernel layout -> (codes uint8 [N, K/2], block_scales f8 [N, K/16], tensor_scale f32 [])."""
    codes = bw.from_plane_layout(packed.codes, n=packed.n, k=packed.k, tile_k=packed.tile_k,
                                 low_nibble_first=True)
    scales = packed.scales[:packed.n, :packed.k // SCALE_BLOCK]
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
