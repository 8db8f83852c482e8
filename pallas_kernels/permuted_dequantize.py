"""NVFP4 dequantize (bf16 W [N, K]) straight from the Mosaic GPU kernel's permuted layout.

A weight whose only copy is the Mosaic GPU kernel's bit-permuted buffer
(pallas_kernels.mgpu_nvfp4) is read by prefill and training through W in bf16. This Triton
kernel decodes the permuted tiles directly, instead of unpermuting the buffer into the kernel
layout with XLA first (mgpu_nvfp4_layout.kernel_layout_from_permuted) and then running the
kernel-layout dequantize (blockwise_matmul.blockwise_dequantize), which was slower
(docs/decisions.md).

The permuted tile (mgpu_nvfp4_layout.permute_tiles): 64 rows x 256 columns of E2M1 codes in
2048 uint32 words, word (i_hi, w, l, q, i_lo) (that nesting, i_hi outermost) holding the 8
codes of rows 16 w + 8 h + l and columns 64 i_hi + 16 i_lo + 8 c_half + 2 q + half for h,
c_half, half in {0, 1} at the bits mgpu_nvfp4_layout.source_bit gives; then 64 rows x 16
canonical scale codes. For fixed (h, c_half, half) the 2048 words map one to one onto a
[32 rows, 64 columns] sub-grid, so each program (32 rows = half a tile, one K tile) loads its
1024 words once as four [16 (w, l), 16 (q, i_lo)] blocks and takes every code out with shifts.

    w = permuted_dequantize(permuted, tensor_scale, n=N, k=K, line=0)   # [N, K] bf16

Numerics: value = e2m1 * block scale (exact in float32) times 1 / tensor_scale (float32),
rounded once to bf16: bit for bit blockwise_dequantize's W of the unpermuted weight (whose
decoder scales by powers of two that cancel exactly).

Each block's values are regrouped in registers (reshapes, a transpose, two-way joins) so that
every store writes 64 contiguous columns of a row: storing each (h, c_half, half) sub-grid as
it comes out (2-byte scattered stores) was slower on most weights (docs/decisions.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import blockwise_matmul as bw
from pallas_kernels import mgpu_nvfp4_layout as layout
from pallas_kernels.nvfp4_matmul import scale_values_from_codes

BLOCK_ROWS = 32  # rows per program: half a permuted tile (a gate/up pair view's block)
_TILE_LINES = layout.TILE_LINES
# The kernel reads the buffer's 128-byte lines as uint32 rows of 16 words (2 per line; a
# word block (i_hi, w) starts 32 i_hi + 8 w rows into its tile) and as uint8 rows of 16 scale
# codes (8 per line; a tile's scale codes start CODE_BYTES / 16 rows into it, one row each).
_WORD_ROWS_PER_LINE = 2
_SCALE_ROWS_PER_LINE = 8
_CODE_SCALE_ROW = layout.CODE_BYTES // 16


def _shifts() -> list:
    """[c_half][h][half][bit] -> the word bit of that code bit (Python ints)."""
    return layout.unpermute_shifts().tolist()


def _code(words, shifts):
    """The 4-bit codes at `shifts` (code bits 0-3) of every word."""
    code = (words >> shifts[0]) & 1
    for bit in (1, 2, 3):
        code = code | (((words >> shifts[bit]) & 1) << bit)
    return code


def _e2m1(code):
    """uint32 E2M1 codes -> float32 values (exact; bit 3 the sign), by building the bits."""
    magnitude = code & 7
    exponent, mantissa = magnitude >> 1, magnitude & 1
    normal = ((exponent + 126) << 23) | (mantissa << 22)
    bits = jnp.where(exponent == 0, jnp.where(mantissa == 1, jnp.uint32(0x3F000000),
                                              jnp.uint32(0)), normal)
    bits = bits | ((code & 8) << 28)
    return lax.bitcast_convert_type(bits.astype(jnp.uint32), jnp.float32)


def _kernel(words_ref, scales_ref, ts_ref, out_ref, *, n: int, k: int, k_tiles: int, line: int,
            pair_view):
    pid_n, kt = pl.program_id(0), pl.program_id(1)
    n0 = pid_n * BLOCK_ROWS
    src = bw.pair_row(n0, pair_view)  # the block's first row in the buffer's weight rows
    tile = (src >> 6) * k_tiles + kt
    w_base = (src & 63) >> 4  # 0 or 2: which half of the tile's 64 rows
    tile_line = line + tile * _TILE_LINES
    factor = 1.0 / ts_ref[0]
    shifts = _shifts()
    i = lax.broadcasted_iota(jnp.int32, (16, 1), 0)  # (w', l) of a [16, 16] word block
    local_rows = 16 * (i >> 3) + (i & 7)  # + 8 h: the rows of a sub-grid within the block
    lo = lax.broadcasted_iota(jnp.int32, (1, 4), 1)
    for i_hi in range(4):
        words = words_ref[pl.ds(tile_line * _WORD_ROWS_PER_LINE + i_hi * 32 + w_base * 8, 16),
                          :]  # [16 (w', l), 16 (q, i_lo)]
        words = words.reshape(16, 4, 4).transpose(0, 2, 1)  # [16, i_lo, q]
        cols = kt * layout.TILE_K + 64 * i_hi + lax.broadcasted_iota(jnp.int32, (1, 64), 1)
        for h in (0, 1):
            rows = local_rows + 8 * h  # [16, 1]
            out_rows = n0 + rows
            scale_rows = (tile_line * _SCALE_ROWS_PER_LINE + _CODE_SCALE_ROW + w_base * 16
                          + rows)
            codes = plgpu.load(scales_ref.at[scale_rows, 4 * i_hi + lo])  # [16, i_lo]
            scale = scale_values_from_codes(codes, 0).astype(jnp.float32)[:, :, None]
            halves = []
            for c_half in (0, 1):
                pair = [_e2m1(_code(words, shifts[c_half][h][half])) * scale
                        for half in (0, 1)]
                halves.append(jnp.stack(pair, axis=-1).reshape(16, 4, 8))  # (q, half)
            # columns 16 i_lo + 8 c_half + 2 q + half of this i_hi's 64
            values = jnp.stack(halves, axis=-1).transpose(0, 1, 3, 2).reshape(16, 64)
            plgpu.store(out_ref.at[out_rows, cols], (values * factor).astype(out_ref.dtype),
                        mask=(out_rows < n) & (cols < k))


def permuted_dequantize(permuted: jax.Array, tensor_scale: jax.Array, *, n: int, k: int,
                        line: int = 0, pair_view: tuple[int, int] | None = None,
                        interpret: bool = False) -> jax.Array:
    """W [n, k] bf16 of the weight whose permuted tiles start at line `line` of `permuted`
    ([lines, 128] uint8, mgpu_nvfp4_layout's permuted layout; tiles ordered row tile by row tile, K tiles
    inside). tensor_scale: the kernels' divisor ([1] or scalar float32). pair_view: (half_block,
    half) of a gate/up pair view (the buffer holds the interleaved pair; half_block a multiple
    of 32), as PackedWeight.pair_view."""
    if permuted.dtype != jnp.uint8 or permuted.ndim != 2 or permuted.shape[1] != 128:
        raise ValueError(f"permuted_dequantize: permuted {permuted.dtype}{list(permuted.shape)}"
                         " must be uint8 [lines, 128]")
    if pair_view is not None and (pair_view[0] % BLOCK_ROWS or pair_view[1] not in (0, 1)):
        raise ValueError(f"permuted_dequantize: pair_view {pair_view} must be (a multiple of "
                         f"{BLOCK_ROWS}, 0 or 1)")
    k_tiles = -(-k // layout.TILE_K)
    source_rows = -(-n // 64) * 64 * (1 if pair_view is None else 2)
    lines = source_rows // 64 * k_tiles * _TILE_LINES
    if line < 0 or line + lines > permuted.shape[0]:
        raise ValueError(f"permuted_dequantize: lines [{line}, {line + lines}) ({n} x {k}"
                         f"{', a pair view' if pair_view else ''}) of a buffer of "
                         f"{permuted.shape[0]} lines")
    return _permuted_dequantize(permuted, jnp.asarray(tensor_scale, jnp.float32).reshape(1),
                                n=n, k=k, k_tiles=k_tiles, line=line, pair_view=pair_view,
                                interpret=interpret)


@functools.partial(jax.jit, static_argnames=("n", "k", "k_tiles", "line", "pair_view",
                                             "interpret"))
def _permuted_dequantize(permuted, tensor_scale, *, n, k, k_tiles, line, pair_view, interpret):
    lines = permuted.shape[0]
    words = lax.bitcast_convert_type(permuted.reshape(lines, 32, 4), jnp.uint32)
    words = words.reshape(lines * _WORD_ROWS_PER_LINE, 16)
    scale_codes = permuted.reshape(lines * _SCALE_ROWS_PER_LINE, 16)
    kernel = functools.partial(_kernel, n=n, k=k, k_tiles=k_tiles, line=line,
                               pair_view=pair_view)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((n, k), jnp.bfloat16),
        grid=(-(-n // BLOCK_ROWS), k_tiles), interpret=interpret,
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=4, num_stages=1),
        name="nvfp4_permuted_dequantize")(words, scale_codes, tensor_scale)
