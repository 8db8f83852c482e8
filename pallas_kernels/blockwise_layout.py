"""The kernel layout of a 4-bit weight for the blockwise Pallas kernels, and what a format tells
them (`FormatSpec`).

Kernel layout (made once by `to_plane_layout`, undone losslessly by `from_plane_layout`):
  codes  uint8 [N_pad, K_pad/2]: for each K tile t of width tile_k, byte j in [0, tile_k/2) of the
         tile holds element k = t*tile_k + j in its LOW nibble and k = t*tile_k + tile_k/2 + j in
         its HIGH nibble (two "planes" per tile, so the kernel needs no interleave: it does one dot
         per plane with the matching half of the activation tile).
  scales [N_pad, K_pad/B], block order along k unchanged (zero padded, so padded weights are 0;
         NVFP4 stores canonical uint8 codes, its padding the zero code: nvfp4_matmul.py).
  tensor_scale float32 [1]: a divisor applied to the accumulator (NVFP4's global scale, else 1).
N_pad is a multiple of `n_multiple` (128), K_pad a multiple of tile_k; activations and outputs are
never padded in HBM: the kernels mask the edges.

Tile-major storage (`tile_major` / `row_major`, applied by the formats' repacks after the plane
layout): codes and scales keep their [N_pad, C] shapes, but each block of TILE_ROWS (64) rows
stores its K tiles one after another, [K tiles, 64 rows, tile columns], instead of row by row.
A kernel's [bn <= 64, tile_k/2] code tile is then one contiguous 8 KB piece of memory (and its
scales one 1 KB piece), and one program's consecutive K tiles are adjacent, where row-major
storage makes a tile of bn 128-byte pieces K/2 bytes apart: the fused kernel ran faster on
the 7B and 32B decode shapes (docs/decisions.md).
The kernels view an array as [N_pad * K tiles, tile columns] (a free reshape) and read tile kt of
rows [w0, w0 + bn) at row `tile_row(w0, kt, k_tiles)`. Every 64-row block holds only its own rows,
so gate/up pairs (interleave_rows, 32-row blocks) go through `row_major` and back.

"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

N_MULTIPLE = 128



def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def padded_sizes(n: int, k: int, tile_k: int, n_multiple: int = N_MULTIPLE) -> tuple[int, int]:
    return cdiv(n, n_multiple) * n_multiple, cdiv(k, tile_k) * tile_k


def to_plane_layout(codes: jax.Array, *, k: int, tile_k: int, low_nibble_first: bool,
                    n_multiple: int = N_MULTIPLE) -> jax.Array:
    """Checkpoint codes uint8 [N, K/2] -> kernel codes uint8 [N_pad, K_pad/2] (nibble planes).

    Args:
      codes: two codes per byte; element 2i is in the low nibble if `low_nibble_first` (NVFP4,
        MXFP4 as compressed-tensors writes them) else in the high nibble (bitsandbytes NF4).
      k: logical K (even).
      tile_k: K tile of the kernel layout (multiple of 2 * scale block, power of two).
    """
    n = codes.shape[0]
    if codes.shape[1] * 2 != k:
        raise ValueError(f"codes have {codes.shape[1]} bytes per row; expected K/2 = {k // 2}")
    n_pad, k_pad = padded_sizes(n, k, tile_k, n_multiple)
    codes = codes.astype(jnp.uint8)
    lo, hi = codes & 15, codes >> 4
    pair = (lo, hi) if low_nibble_first else (hi, lo)
    elements = jnp.stack(pair, axis=-1).reshape(n, k)
    elements = jnp.pad(elements, ((0, n_pad - n), (0, k_pad - k)))
    tiles = elements.reshape(n_pad, k_pad // tile_k, 2, tile_k // 2)
    planes = tiles[:, :, 0, :] | (tiles[:, :, 1, :] << 4)
    return planes.reshape(n_pad, k_pad // 2)


def from_plane_layout(planes: jax.Array, *, n: int, k: int, tile_k: int,
                      low_nibble_first: bool) -> jax.Array:
    """Inverse of `to_plane_layout`: kernel codes -> checkpoint codes uint8 [N, K/2]."""
    n_pad, half_k_pad = planes.shape
    k_pad = 2 * half_k_pad
    tiles = planes.reshape(n_pad, k_pad // tile_k, 1, tile_k // 2)
    elements = jnp.concatenate([tiles & 15, tiles >> 4], axis=2).reshape(n_pad, k_pad)
    pairs = elements[:n, :k].reshape(n, k // 2, 2)
    first, second = pairs[..., 0], pairs[..., 1]
    if low_nibble_first:
        return (first | (second << 4)).astype(jnp.uint8)
    return ((first << 4) | second).astype(jnp.uint8)


def pad_scales(scales: jax.Array, *, n_pad: int, k_pad: int, block: int) -> jax.Array:
    """Zero-pads block scales [N, K/B] to [N_pad, K_pad/B] (padded weights decode to 0); the
    same array when no padding is needed (no copy)."""
    n, nb = scales.shape
    if n_pad == n and k_pad // block == nb:
        return scales
    return jnp.pad(scales, ((0, n_pad - n), (0, k_pad // block - nb)))


TILE_ROWS = 64
_TILE_SHIFT = TILE_ROWS.bit_length() - 1


def _swap_tile_axes(array: jax.Array, tile_cols: int, *, to_tiles: bool, name: str):
    """[R, C] viewed as [R/64, 64, C/tile_cols, tile_cols] (to_tiles) or [R/64, C/tile_cols,
    64, tile_cols] with its two middle axes swapped, back in the [R, C] shape."""
    rows, cols = array.shape
    if rows % TILE_ROWS or cols % tile_cols:
        raise ValueError(f"{name}: [{rows}, {cols}] needs rows a multiple of {TILE_ROWS} "
                         f"and columns a multiple of {tile_cols}")
    middle = (TILE_ROWS, cols // tile_cols) if to_tiles else (cols // tile_cols, TILE_ROWS)
    blocks = array.reshape(rows // TILE_ROWS, *middle, tile_cols)
    return blocks.transpose(0, 2, 1, 3).reshape(rows, cols)


def tile_major(array: jax.Array, tile_cols: int) -> jax.Array:
    """Row-major kernel-layout array [R, C] (R a multiple of TILE_ROWS, C of tile_cols) -> the
    same shape stored tile-major: block b of TILE_ROWS rows holds [C / tile_cols, TILE_ROWS,
    tile_cols], its K tiles one after another (module docstring)."""
    return _swap_tile_axes(array, tile_cols, to_tiles=True, name="tile_major")


def row_major(array: jax.Array, tile_cols: int) -> jax.Array:
    """Inverse of tile_major: the row-major [R, C] array."""
    return _swap_tile_axes(array, tile_cols, to_tiles=False, name="row_major")


def tile_row(w0, kt, k_tiles: int):
    """Row of K tile kt of rows [w0, w0 + bn) in the [R * K tiles, tile columns] view of a
    tile-major array (w0 a multiple of bn <= TILE_ROWS). Shifts and masks, as in pair_row."""
    return ((w0 >> _TILE_SHIFT) * k_tiles + kt) * TILE_ROWS + (w0 & (TILE_ROWS - 1))


def tile_major_arrays(codes: jax.Array, scales: jax.Array, tile_k: int):
    """Row-major plane-layout codes [R, K_pad/2] and scales [R, K_pad/B] -> both tile-major
    (what a PackedWeight holds)."""
    code_cols, scale_cols = tile_columns(codes.shape[1], scales.shape[1], tile_k)
    return tile_major(codes, code_cols), tile_major(scales, scale_cols)


def row_major_arrays(codes: jax.Array, scales: jax.Array, tile_k: int):
    """Inverse of tile_major_arrays: (row-major codes, row-major scales)."""
    code_cols, scale_cols = tile_columns(codes.shape[1], scales.shape[1], tile_k)
    return row_major(codes, code_cols), row_major(scales, scale_cols)


def tile_columns(packed_codes_cols: int, scales_cols: int, tile_k: int) -> tuple[int, int]:
    """(code, scale) columns per K tile of kernel-layout arrays with these widths."""
    k_tiles = 2 * packed_codes_cols // tile_k
    if k_tiles < 1 or scales_cols % k_tiles:
        raise ValueError(f"kernel layout: {packed_codes_cols} code bytes and {scales_cols} "
                         f"scales per row do not make whole K tiles of {tile_k}")
    return tile_k // 2, scales_cols // k_tiles


def tile_views(packed: "PackedWeight", spec: "FormatSpec") -> tuple[jax.Array, jax.Array]:
    """(codes, scales) of a packed weight as the kernels read them: [rows * K tiles, tile_k/2]
    and [rows * K tiles, 2 g] (free reshapes of the tile-major arrays)."""
    return (packed.codes.reshape(-1, packed.tile_k // 2),
            packed.scales.reshape(-1, packed.tile_k // spec.scale_block))


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["codes", "scales", "tensor_scale"],
                   meta_fields=["fmt", "n", "k", "tile_k", "pair_view"])
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A 4-bit weight W [n, k] in kernel layout (see module docstring).

    codes uint8 [N_pad, K_pad/2]; scales [N_pad, K_pad/B] (format's scale dtype), both stored
    tile-major (tile_major; the formats' repacks make them);
    tensor_scale float32 [1] (w = decoded / tensor_scale); fmt in {"nvfp4", "mxfp4", "nf4"};
    n, k logical; tile_k the K tile.

    pair_view (half_block, half) or None: codes and scales are those of a gate/up pair
    interleaved in blocks of half_block rows (interleave_gate_up, [2 N_pad, ...]) and this
    weight is its `half` (0: gate, 1: up): logical row r is the pair's row
    (r // half_block) * 2 half_block + half * half_block + r % half_block. The kernels read
    such a view in place (row tiles of at most half_block rows), so the pair is the only copy
    of gate and up in memory.
    """
    codes: jax.Array
    scales: jax.Array
    tensor_scale: jax.Array
    fmt: str
    n: int
    k: int
    tile_k: int
    pair_view: tuple[int, int] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def n_pad(self) -> int:
        """Padded N of this weight (half the pair's rows for a pair view)."""
        rows = self.codes.shape[0]
        return rows // 2 if self.pair_view is not None else rows

    @property
    def max_block_n(self) -> int | None:
        """The largest row tile the kernels may use on it (a pair view's half_block)."""
        return None if self.pair_view is None else self.pair_view[0]


def pair_row(n0, pair_view: tuple[int, int] | None):
    """Row of the codes / scales arrays holding logical row n0 >= 0 of a weight (n0 itself
    unless the weight is a pair view; n0 and a tile of rows from it must lie in one
    half_block). Shifts and masks (half_block is a power of two): the Triton lowering of
    integer // and % inside a fori_loop failed on the GPU (an i32 / i1 mismatch)."""
    if pair_view is None:
        return n0
    half_block, half = pair_view
    shift = half_block.bit_length() - 1
    return (((n0 >> shift) << (shift + 1)) + half * half_block) + (n0 & (half_block - 1))




@dataclasses.dataclass(frozen=True)
class FormatSpec:
    """What the kernels need to know of a format.

    decode(c, s_lo, s_hi, aux_refs, decoder, out_dtype) -> (w_lo, w_hi): decodes a code tile
      uint8 [R, H] and the raw scale tiles of its two planes [R, H/B] into scaled weights
      [R, H] of out_dtype, times 2^-epilogue_exponent(decoder).
    aux_arrays(): constant extra kernel inputs (e.g. the NF4 level table), read via aux_refs.
    For the group-scaled matmul (MatmulConfig.group_dots), which applies each block scale to the
    f32 result of a dot over that block instead of to every weight:
    decode_values(c, aux_refs, decoder) -> (v_lo, v_hi): unscaled values, bf16 [R, H], times
      2^value_exponent(decoder);
    scale_values(s) -> float32 [R]: one column of raw block scales as multipliers.
    kernel_scale_dtype: the dtype of PackedWeight.scales the decoders read (checked at launch),
      where the kernel layout stores scales in a form of its own (NVFP4: uint8 codes).
    """
    name: str
    scale_block: int
    decoders: tuple[str, ...]
    interpret_decoder: str
    gpu_decoder: str
    decode: Callable
    epilogue_exponent: Callable[[str], int]
    aux_arrays: Callable[[], tuple[np.ndarray, ...]] = lambda: ()
    decode_values: Callable | None = None
    value_exponent: Callable[[str], int] = lambda d: 0
    scale_values: Callable | None = None
    kernel_scale_dtype: str | None = None  # the kernel layout's scale dtype, if fixed


def expand_block_scale(s: jax.Array, block: int) -> jax.Array:
    """[R, G] -> [R, G*block]: each scale repeated over its block of k."""
    r, g = s.shape
    return jnp.broadcast_to(s[:, :, None], (r, g, block)).reshape(r, g * block)
