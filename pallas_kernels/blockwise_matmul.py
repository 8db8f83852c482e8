"""Shared Pallas (Triton backend) kernels for bf16 activations x 4-bit weights with block scales.

Every 4-bit format here (NVFP4, MXFP4, NF4) stores W [N, K] as 4-bit codes plus one scale per
block of B consecutive k. The format files (nvfp4_matmul.py, ...) describe their codes and scales
with a `FormatSpec`; this module holds what they share: the kernel layout, the kernels and the
wrappers that pad, launch and slice.

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
storage makes a tile of bn 128-byte pieces K/2 bytes apart: the fused kernel ran 4-9% faster
on the 7B and 32B decode shapes (H100, docs/decisions.md).
The kernels view an array as [N_pad * K tiles, tile columns] (a free reshape) and read tile kt of
rows [w0, w0 + bn) at row `tile_row(w0, kt, k_tiles)`. Every 64-row block holds only its own rows,
so gate/up pairs (interleave_rows, 32-row blocks) go through `row_major` and back.

Kernels (all f32 accumulation):
  matmul       y[M, N] = x[M, K] @ W^T. Grid (M tiles, N tiles, split-K). `weight_as_lhs` computes
               y^T = W @ x^T so the decoded weights are the dot's left operand (registers) and the
               tiny activation tile is the right one; split-K writes f32 partials summed by XLA.
  transposed   dx[M, K] = dy[M, N] @ W, W decoded tile by tile (never stored as bf16 in HBM).
  dequantize   W as bf16 [N, K] (for an XLA matmul at large M).
  swiglu       silu(x @ Wg^T) * (x @ Wu^T) from gate and up interleaved into one weight
               (interleave_gate_up): the matmul kernel with a SwiGLU epilogue
               (blockwise_matmul_swiglu), the model's decode MLP.
Pair views (PackedWeight.pair_view, pair_view_of): gate or up read in place out of the
interleaved pair by the matmul, transposed and dequantize kernels (row tiles within one
half_block), so the pair is the only copy of the two weights.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.e2m1_decode import E2M1_DECODERS

N_MULTIPLE = 128


# ----------------------------------------------------------------------------------------------
# Layout


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def padded_sizes(n: int, k: int, tile_k: int, n_multiple: int = N_MULTIPLE) -> tuple[int, int]:
    return _cdiv(n, n_multiple) * n_multiple, _cdiv(k, tile_k) * tile_k


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


# ----------------------------------------------------------------------------------------------
# Format description


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


# ----------------------------------------------------------------------------------------------
# Configs


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """Tiling of y = x @ W^T. path: "fused" (one kernel) or "dequantize" (bf16 W + XLA dot).

    group_dots: one dot per scale block (K = block size) on unscaled values, the block scale
    applied to its f32 result (no per-weight scale multiply, no scale broadcast).
    clamp_rows: when M is not a multiple of block_m, read activation rows min(r, M-1) (a gather
    with no mask; the extra rows repeat the last one and are not stored) instead of masked
    loads. Off by default: masked rows were as fast or faster on most H100 layer shapes.
    """
    block_m: int = 16
    block_n: int = 64
    split_k: int = 1
    weight_as_lhs: bool = True
    num_warps: int = 4
    num_stages: int = 3
    decoder: str | None = None  # None: the format's interpret/GPU default
    path: str = "fused"
    group_dots: bool = False
    clamp_rows: bool = False


@dataclasses.dataclass(frozen=True)
class TransposedConfig:
    """Tiling of dx = dy @ W: block_m rows of dy, one layout K tile per program, block_n steps."""
    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    decoder: str | None = None
    path: str = "fused"


@dataclasses.dataclass(frozen=True)
class DequantizeConfig:
    block_n: int = 64
    tiles_per_program: int = 1
    num_warps: int = 4
    num_stages: int = 1


def _next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def _valid_split(split: int, k_tiles: int) -> bool:
    """Every one of `split` splits of ceil(k_tiles / split) K tiles gets at least one tile."""
    return split >= 1 and (split - 1) * _cdiv(k_tiles, split) < k_tiles


@dataclasses.dataclass(frozen=True)
class DecodeTuning:
    """What default_matmul_config picks at decode M (M <= 16); a caller passes it (the model's
    from config.quant.kernels.decode_matmul, qerl_jax.quant.kernel_options).

    target_programs: split-K is chosen so the launch has about this many programs (about 5
      waves of an H100's 132 SMs; 640 against 320 measured on an H100, RESULTS.md: NVFP4
      rollouts at batch 8 7B +1.6%, 14B +0.2%, 32B +1.0%, 7B batch 2 +2.5%);
      min_tiles_per_split: the fewest K tiles a split-K program keeps (from the decode-shape
      sweep: RESULTS.md, "Fused-kernel tiling at rollout M"). no_split_programs: N tiles
      alone at or above this many programs: no split.
    block_n (a power of two from 16 to TILE_ROWS = 64: a row tile lies in one block of the
      tile-major layout), num_warps, num_stages, weight_as_lhs (None: per format, see
      default_matmul_config), decoder (None: the format's GPU default): as in MatmulConfig.
    """
    target_programs: int = 640
    min_tiles_per_split: int = 4
    no_split_programs: int = 264
    max_split: int = 8
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    weight_as_lhs: bool | None = None
    decoder: str | None = None

    def __post_init__(self):
        if self.block_n < 16 or self.block_n > TILE_ROWS or self.block_n & (self.block_n - 1):
            raise ValueError(f"DecodeTuning.block_n={self.block_n}: a power of two from 16 to "
                             f"{TILE_ROWS} (the kernel layout's row blocks)")
        if self.max_split < 1 or self.min_tiles_per_split < 1:
            raise ValueError(f"DecodeTuning {self}: max_split and min_tiles_per_split must be "
                             ">= 1")


def parse_tuning(text: str) -> dict:
    """'block_n=32,num_warps=8,weight_as_lhs=true' -> DecodeTuning fields (benchmark command
    lines); names and values are checked."""
    names = {f.name: f for f in dataclasses.fields(DecodeTuning)}
    fields = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        if name not in names or not value:
            raise ValueError(f"decode tuning {item!r}: expected name=value with name in "
                             f"{sorted(names)}")
        if name == "weight_as_lhs":
            if value.lower() not in ("true", "false", "none"):
                raise ValueError(f"decode tuning {item!r}: true, false or none")
            fields[name] = None if value.lower() == "none" else value.lower() == "true"
        elif name == "decoder":
            fields[name] = None if value.lower() == "none" else value
        else:
            fields[name] = int(value)
    return fields


def default_matmul_config(m: int, packed: PackedWeight,
                          tuning: DecodeTuning | None = None) -> MatmulConfig:
    """Heuristic tiling for y = x @ W^T, from sweeps on an H100 (benchmarks/kernels.py --sweep)
    and the decode-shape sweep on an H200 (kernels.py --decode-sweep).

    M <= 64: the fused kernel, 16/32/64-row tiles, 64 output columns per program (at M <= 16
    the block_n, warps and stages of `tuning`, default DecodeTuning()). Split-K: none when the N tiles
    alone fill the GPU (>= 264 programs); else at M <= 16 enough splits for ~640 programs (at
    most 8, each >= 4 K tiles; uneven splits allowed), and above 16 rows 2 (4 for narrow
    weights of < 32 N tiles, e.g. k/v projections). E2M1 formats: inline-asm decode,
    activations as the left dot operand at M <= 16 and the weights as the left one above. NF4:
    bf16 table lookup, weights as the left operand. M > 64: Pallas dequantize kernel + XLA
    (cuBLAS) matmul.
    """
    return _default_config(m, (packed.n_pad,), 2 * packed.codes.shape[1] // packed.tile_k,
                           packed.fmt, max_block_n=packed.max_block_n, tuning=tuning)


def _decoder_fits(decoder: str | None, fmt: str) -> bool:
    """A DecodeTuning decoder applies to the formats it decodes: the E2M1 decoders to NVFP4 and
    MXFP4 ("asmq", which reads NVFP4's canonical scale codes, to NVFP4 only), the others
    (NF4's) to NF4."""
    if decoder == "asmq":
        return fmt == "nvfp4"
    return decoder is not None and (decoder in E2M1_DECODERS) == (fmt in ("nvfp4", "mxfp4"))


def _default_config(m: int, n_pads: tuple[int, ...], k_tiles: int, fmt: str,
                    max_block_n: int | None = None,
                    tuning: DecodeTuning | None = None) -> MatmulConfig:
    """default_matmul_config for one launch over weights of padded N `n_pads` (one weight, or
    a group sharing the launch) and `k_tiles` K tiles: block_n divides every n_pad (and is at
    most max_block_n: a pair view's half_block), and split-K is chosen for the programs of
    all of them together."""
    if m > 64:
        return MatmulConfig(path="dequantize")
    block_m = max(16, _next_pow2(m))
    tuning = tuning or DecodeTuning()
    decode = block_m <= 16
    block_n = min(tuning.block_n, *n_pads) if decode else 64
    if max_block_n is not None:
        block_n = min(block_n, max_block_n)
    while any(n_pad % block_n for n_pad in n_pads):
        block_n //= 2
    n_tiles = sum(n_pads) // block_n
    most = max(1, k_tiles // (tuning.min_tiles_per_split if decode else 4))
    if n_tiles >= (tuning.no_split_programs if decode else 264):
        split = 1
    elif decode:
        split = min(tuning.max_split, most, _cdiv(tuning.target_programs, n_tiles))
    else:
        split = min(4 if n_tiles < 32 else 2, most)
    while not _valid_split(split, k_tiles):
        split -= 1
    weight_as_lhs = fmt == "nf4" or not decode
    if decode and tuning.weight_as_lhs is not None:
        weight_as_lhs = tuning.weight_as_lhs
    return MatmulConfig(block_m=block_m, block_n=block_n, split_k=split,
                        weight_as_lhs=weight_as_lhs,
                        num_warps=tuning.num_warps if decode else 4,
                        num_stages=tuning.num_stages if decode else 3,
                        decoder=tuning.decoder if decode and _decoder_fits(tuning.decoder, fmt)
                        else None)


def default_transposed_config(m: int, packed: PackedWeight) -> TransposedConfig:
    if m <= 64:
        return TransposedConfig(block_m=64, block_n=min(64, packed.max_block_n or 64),
                                num_warps=4, num_stages=3)
    return TransposedConfig(path="dequantize")


# ----------------------------------------------------------------------------------------------
# Kernels


def _dot_nt(a, b):
    """a [P, H] . b [Q, H]^T -> f32 [P, Q]."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_nn(a, b):
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _and_masks(*masks):
    masks = [mk for mk in masks if mk is not None]
    if not masks:
        return None
    out = masks[0]
    for mk in masks[1:]:
        out = out & mk
    return out


def _edge_masks(start_r, size_r, limit_r, start_c, size_c, limit_c, ragged_r, ragged_c):
    rows = (start_r + lax.broadcasted_iota(jnp.int32, (size_r, 1), 0) < limit_r) if ragged_r else None
    cols = (start_c + lax.broadcasted_iota(jnp.int32, (1, size_c), 1) < limit_c) if ragged_c else None
    return _and_masks(rows, cols)


def _load(ref_view, mask, other=0.0):
    if mask is None:
        return ref_view[...]
    return plgpu.load(ref_view, mask=mask, other=other)


def _store(ref_view, value, mask):
    if mask is None:
        ref_view[...] = value
    else:
        plgpu.store(ref_view, value, mask=mask)


def _matmul_kernel(x_ref, codes_ref, scales_ref, ts_ref, *rest, poisoned: bool,
                   lora_scale: float | None = None, **static):
    """One weight: refs (x, codes, scales, tensor scale[, down, lora_b], *aux[, poison], out)."""
    out_ref = rest[-1]
    down_ref = lora_b_ref = None
    if lora_scale is not None:  # LoRA epilogue inputs: down = x @ A [M, r], B [r, N]
        down_ref, lora_b_ref, *rest = rest
    aux_refs = rest[:len(rest) - 1 - int(poisoned)]
    _matmul_program(x_ref, codes_ref, scales_ref, ts_ref, down_ref, lora_b_ref, aux_refs,
                    out_ref, (pl.program_id(0), pl.program_id(1), pl.program_id(2)),
                    lora_scale=lora_scale, **static)


def _grouped_matmul_kernel(x_ref, *refs, members: tuple[tuple[int, int, int], ...],
                           lora_scales: tuple[float, ...] | None,
                           lora_columns: tuple[int, ...] | None, poisoned: bool, **static):
    """Several weights sharing x in one launch. refs: [the LoRA down [M, R] of all members,]
    per member (codes, scales, tensor scale[, lora_b]), then the aux refs, [one poison per
    member,] one output per member. members[i] = (n_i, first N-tile program of member i, its N
    tiles): the programs of the N grid axis are dealt out to the members in order, each running
    the single-weight program; member i's LoRA down is columns [lora_columns[i], + r_i)."""
    count = len(members)
    shared_down = None
    if lora_scales is not None:
        shared_down, *refs = refs
    per_member = 3 if lora_scales is None else 4
    outs = refs[len(refs) - count:]
    aux_refs = refs[count * per_member:len(refs) - count * (1 + int(poisoned))]
    # program ids are read here, outside the branches (interpret mode cannot read them inside)
    pid_m, pid_n, pid_s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    for i, (n, offset, n_tiles) in enumerate(members):
        weight_refs = refs[i * per_member:(i + 1) * per_member]
        lora_b_ref = None if lora_scales is None else weight_refs[3]

        @pl.when((pid_n >= offset) & (pid_n < offset + n_tiles))
        def _(weight_refs=weight_refs, lora_b_ref=lora_b_ref, n=n, offset=offset,
              out_ref=outs[i], i=i):
            _matmul_program(x_ref, *weight_refs[:3], shared_down, lora_b_ref, aux_refs, out_ref,
                            (pid_m, pid_n - offset, pid_s), n=n,
                            lora_scale=None if lora_scales is None else lora_scales[i],
                            down_column=0 if lora_columns is None else lora_columns[i],
                            **static)


def _matmul_program(x_ref, codes_ref, scales_ref, ts_ref, down_ref, lora_b_ref, aux_refs,
                    out_ref, program_ids, *, spec: FormatSpec, decoder: str, m: int, n: int, k: int,
                    bm: int, bn: int, tile_k: int, tiles_per_split: int, k_tiles: int,
                    split: int, weight_as_lhs: bool, group_dots: bool = False,
                    clamp_rows: bool = False, lora_scale: float | None = None,
                    down_column: int = 0, swiglu_n: int | None = None,
                    pair_view: tuple[int, int] | None = None, next_a_ref=None,
                    shares_ref=None):
    """The [bm, bn] output tile (pid_m, pid_n) of split pid_s of y = x @ W^T for one weight;
    program_ids = (pid_m, pid_n, pid_s). The LoRA epilogue reads down_ref's columns
    [down_column, down_column + r) with r = lora_b_ref's rows.

    swiglu_n (one split only): W is a gate/up pair interleaved in blocks of bn / 2 rows
    (interleave_gate_up), ts_ref = (gate's tensor-scale ref [1], up's); the tile's
    halves are gate and up, each rounded to bf16, and silu(gate) * up is stored to columns
    [pid_n * bn / 2, + bn / 2) of the [M, swiglu_n] output.

    pair_view: W is one half of such a pair, read in place (PackedWeight.pair_view; bn must
    divide its half_block).

    next_a_ref / shares_ref (swiglu_n only): the next layer's LoRA A [swiglu_n, r'] and the
    [N tiles, M, r'] float32 output of this tile's share of (SwiGLU output) @ A
    (_swiglu_epilogue)."""
    half = tile_k // 2
    g = half // spec.scale_block
    pid_m, pid_n, pid_s = program_ids
    r0 = pid_m * bm
    n0 = pl.multiple_of(pid_n * bn, bn)
    w0 = pl.multiple_of(pair_row(n0, pair_view), bn)  # the tile's first row in codes / scales
    ragged_m, ragged_k = m % bm != 0, k % tile_k != 0

    def load_x(c0, width):
        if ragged_m and clamp_rows:
            rows = jnp.minimum(r0 + lax.broadcasted_iota(jnp.int32, (bm, 1), 0), m - 1)
            cols = c0 + lax.broadcasted_iota(jnp.int32, (1, width), 1)
            if ragged_k:
                mask = jnp.broadcast_to(cols < k, (bm, width))
                cols = jnp.minimum(cols, k - 1)
                return plgpu.load(x_ref.at[rows, cols], mask=mask, other=0.0)
            return x_ref[rows, cols]
        mask = _edge_masks(r0, bm, m, c0, width, k, ragged_m, ragged_k)
        return _load(x_ref.at[pl.ds(r0, bm), pl.ds(c0, width)], mask)

    def group_body(t, acc):
        # One dot per scale block: codes of block gi of both planes share bytes [gi*B, gi*B+B).
        kt = pid_s * tiles_per_split + t
        row = pl.multiple_of(tile_row(w0, kt, k_tiles), bn)
        blk = spec.scale_block
        for gi in range(g):
            c = codes_ref[pl.ds(row, bn), pl.ds(gi * blk, blk)]
            values = spec.decode_values(c, aux_refs, decoder)
            for p in range(2):
                c0 = pl.multiple_of(kt * tile_k + p * half + gi * blk, blk)
                xg = load_x(c0, blk).astype(jnp.bfloat16)
                sg = spec.scale_values(scales_ref[pl.ds(row, bn), p * g + gi])
                if weight_as_lhs:
                    acc = acc + _dot_nt(values[p], xg) * sg[:, None]
                else:
                    acc = acc + _dot_nt(xg, values[p]) * sg[None, :]
        return acc

    def load_tile(kt):
        """Codes, the two planes' scales and activations of K tile kt (loads only)."""
        row = pl.multiple_of(tile_row(w0, kt, k_tiles), bn)
        c = codes_ref[pl.ds(row, bn), pl.ds(0, half)]
        s_lo = scales_ref[pl.ds(row, bn), pl.ds(0, g)]
        s_hi = scales_ref[pl.ds(row, bn), pl.ds(g, g)]
        xs = tuple(load_x(pl.multiple_of(kt * tile_k + p * half, half), half)
                   for p in range(2))
        return c, s_lo, s_hi, xs

    def multiply_tile(tile, acc):
        c, s_lo, s_hi, xs = tile
        xs = [x.astype(jnp.bfloat16) for x in xs]
        w_lo, w_hi = spec.decode(c, s_lo, s_hi, aux_refs, decoder, jnp.bfloat16)
        if weight_as_lhs:
            return acc + _dot_nt(w_lo, xs[0]) + _dot_nt(w_hi, xs[1])
        return acc + _dot_nt(xs[0], w_lo) + _dot_nt(xs[1], w_hi)

    def body(t, acc):
        return multiply_tile(load_tile(pid_s * tiles_per_split + t), acc)

    acc_shape = (bn, bm) if weight_as_lhs else (bm, bn)
    # K tiles of this split: tiles_per_split, except the last split of an uneven split-K
    # (k_tiles not a multiple of split), which gets the remainder (a dynamic trip count).
    trips = tiles_per_split if k_tiles % tiles_per_split == 0 else jnp.minimum(
        tiles_per_split, k_tiles - pid_s * tiles_per_split)
    acc = lax.fori_loop(0, trips, group_body if group_dots else body,
                        jnp.zeros(acc_shape, jnp.float32))
    y = acc.T if weight_as_lhs else acc
    exponent = -spec.value_exponent(decoder) if group_dots else spec.epilogue_exponent(decoder)
    if swiglu_n is not None:
        _swiglu_epilogue(y * (2.0 ** exponent), ts_ref, down_ref, lora_b_ref, out_ref,
                         lora_scale=lora_scale, down_column=down_column, r0=r0, n0=n0, m=m,
                         n=n, bm=bm, bn=bn, pid_n=pid_n, out_n=swiglu_n,
                         next_a_ref=next_a_ref, shares_ref=shares_ref)
        return
    y = y * ((2.0 ** exponent) / ts_ref[0])
    if lora_scale is not None:
        # + lora_scale * down @ B on this [bm, bn] tile, in f32 before the output rounding;
        # with split-K only the first split adds it.
        rank = lora_b_ref.shape[0]
        down = _load(down_ref.at[pl.ds(r0, bm), pl.ds(down_column, rank)],
                     _edge_masks(r0, bm, m, 0, rank, rank, ragged_m, False))
        lora_b = _load(lora_b_ref.at[pl.ds(0, rank), pl.ds(n0, bn)],
                       _edge_masks(0, rank, rank, n0, bn, n, False, n % bn != 0))
        term = lora_scale * _dot_nn(down.astype(jnp.bfloat16), lora_b.astype(jnp.bfloat16))
        if split > 1:  # 1 in the first split, 0 in the others (integer arithmetic: no i1)
            term = term * (1 - jnp.minimum(pid_s, 1)).astype(jnp.float32)
        y = y + term
    mask = _edge_masks(r0, bm, m, n0, bn, n, ragged_m, n % bn != 0)
    if split == 1:
        _store(out_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)], y.astype(out_ref.dtype), mask)
    else:
        _store(out_ref.at[pid_s, pl.ds(r0, bm), pl.ds(n0, bn)], y, mask)


def _swiglu_matmul_kernel(x_ref, codes_ref, scales_ref, ts_gate_ref, ts_up_ref, *rest,
                          poisoned: bool, lora_scale: float | None = None,
                          with_shares: bool = False, **static):
    """The matmul kernel over an interleaved gate/up pair with the SwiGLU epilogue: refs (x,
    codes, scales, gate's tensor scale [1], up's [1][, down, lora_b][, next_a], *aux[, one
    poison per output], out[, shares])."""
    outputs = 2 if with_shares else 1
    out_refs, rest = rest[len(rest) - outputs:], rest[:len(rest) - outputs]
    if poisoned:
        rest = rest[:len(rest) - outputs]
    down_ref = lora_b_ref = next_a_ref = None
    if lora_scale is not None:  # LoRA epilogue inputs: down = x @ A [M, r], B [r, N]
        down_ref, lora_b_ref, *rest = rest
    if with_shares:
        next_a_ref, *rest = rest
    _matmul_program(x_ref, codes_ref, scales_ref, (ts_gate_ref, ts_up_ref), down_ref,
                    lora_b_ref, tuple(rest), out_refs[0],
                    (pl.program_id(0), pl.program_id(1), pl.program_id(2)),
                    lora_scale=lora_scale, next_a_ref=next_a_ref,
                    shares_ref=out_refs[1] if with_shares else None, **static)


def _swiglu_epilogue(y, ts_ref, down_ref, lora_b_ref, out_ref, *, lora_scale, down_column, r0,
                     n0, m, n, bm, bn, pid_n, out_n, next_a_ref=None, shares_ref=None):
    """silu(gate) * up of an interleaved gate/up tile y [bm, bn] (gate columns first; not yet
    divided by the tensor scales), the LoRA term (block-diagonal B, interleave_lora_b) added to
    each half; stored as bf16 to out [M, out_n] columns [pid_n * bn / 2, + bn / 2). With
    shares_ref: also that bf16 tile times next_a_ref's rows of those columns, float32 [bm, r'],
    to shares_ref[pid_n] (the shares sum to out @ A_next). Stored tiles last instead ([M, r',
    tiles], a row reduction for XLA), XLA's sum took 2.1 us instead of 3.4 but the strided
    stores made the launch 1.9 us slower (32B gate|up, H100, docs/decisions.md)."""
    if lora_scale is not None:
        rank = lora_b_ref.shape[0]
        down = _load(down_ref.at[pl.ds(r0, bm), pl.ds(down_column, rank)],
                     _edge_masks(r0, bm, m, 0, rank, rank, m % bm != 0, False))
        lora_b = lora_b_ref[pl.ds(0, rank), pl.ds(n0, bn)]
        term = lora_scale * _dot_nn(down.astype(jnp.bfloat16), lora_b.astype(jnp.bfloat16))
    gate, up = jnp.split(y, 2, axis=1)
    gate, up = gate / ts_ref[0][0], up / ts_ref[1][0]
    if lora_scale is not None:
        term_gate, term_up = jnp.split(term, 2, axis=1)
        gate, up = gate + term_gate, up + term_up
    gate = gate.astype(jnp.bfloat16).astype(jnp.float32)
    up = up.astype(jnp.bfloat16).astype(jnp.float32)
    out = gate / (1.0 + jnp.exp(-gate)) * up
    half = bn // 2
    c0 = pl.multiple_of(pid_n * half, half)
    out = out.astype(out_ref.dtype)
    _store(out_ref.at[pl.ds(r0, bm), pl.ds(c0, half)], out,
           _edge_masks(r0, bm, m, c0, half, out_n, m % bm != 0,
                       n // 2 > out_n or out_n % half != 0))
    if shares_ref is not None:
        # this tile's share of (SwiGLU output) @ A_next: the rounded output columns [c0, +half)
        # times A_next's rows [c0, +half) (rows past out_n read as 0), float32
        rank = next_a_ref.shape[1]
        a_next = _load(next_a_ref.at[pl.ds(c0, half), pl.ds(0, rank)],
                       _edge_masks(c0, half, out_n, 0, rank, rank, out_n % half != 0, False))
        share = _dot_nn(out.astype(jnp.bfloat16), a_next.astype(jnp.bfloat16))
        _store(shares_ref.at[pid_n, pl.ds(r0, bm), pl.ds(0, rank)], share,
               _edge_masks(r0, bm, m, 0, rank, rank, m % bm != 0, False))


def interleave_rows(a: jax.Array, b: jax.Array, half_block: int) -> jax.Array:
    """[R, W] and [R, W] -> [2R, W]: blocks of half_block rows, a's block j then b's block j."""
    if a.shape != b.shape or a.ndim != 2 or a.shape[0] % half_block:
        raise ValueError(f"interleave_rows: {a.shape} and {b.shape} must be equal [R, W] with "
                         f"R a multiple of {half_block}")
    rows, width = a.shape
    blocks = [x.reshape(rows // half_block, half_block, width) for x in (a, b)]
    return jnp.stack(blocks, axis=1).reshape(2 * rows, width)


def interleave_tile_major_arrays(gate_codes: jax.Array, up_codes: jax.Array,
                                gate_scales: jax.Array, up_scales: jax.Array, *,
                                half_block: int, tile_k: int) -> tuple[jax.Array, jax.Array]:
    """(codes, scales) of a gate/up pair from the two weights' tile-major kernel arrays:
    interleave_rows of each in its row-major form, stored tile-major again (a 64-row block of
    the tile-major layout holds only its own rows, so the interleave cannot work in place)."""
    gate_codes, gate_scales = row_major_arrays(gate_codes, gate_scales, tile_k)
    up_codes, up_scales = row_major_arrays(up_codes, up_scales, tile_k)
    return tile_major_arrays(interleave_rows(gate_codes, up_codes, half_block),
                             interleave_rows(gate_scales, up_scales, half_block), tile_k)


def interleave_gate_up(gate: PackedWeight, up: PackedWeight, half_block: int) -> PackedWeight:
    """One packed weight [2 N_pad, K] from a SwiGLU MLP's gate and up [N, K] (same format, shape
    and layout): rows in blocks of half_block, gate block j then up block j, so that a launch
    with block_n = 2 * half_block reads block j of both in one tile (blockwise_matmul_swiglu).
    tensor_scale [2]: gate's, then up's. The padding rows (N..N_pad) of each are zero.
    pair_view_of(pair, half, ...) reads gate or up back out of it in place."""
    if gate.pair_view is not None or up.pair_view is not None:
        raise ValueError("interleave_gate_up: gate and up must be plain weights, not pair views")
    if (gate.fmt, gate.n, gate.k, gate.tile_k, gate.codes.shape) != (
            up.fmt, up.n, up.k, up.tile_k, up.codes.shape):
        raise ValueError(f"interleave_gate_up: gate {gate.fmt} [{gate.n}, {gate.k}] and up "
                         f"{up.fmt} [{up.n}, {up.k}] must match")
    n_pad = gate.codes.shape[0]
    if n_pad % half_block:
        raise ValueError(f"interleave_gate_up: half_block {half_block} must divide N_pad {n_pad}")
    codes, scales = interleave_tile_major_arrays(gate.codes, up.codes, gate.scales, up.scales,
                                                 half_block=half_block, tile_k=gate.tile_k)
    return PackedWeight(codes=codes, scales=scales,
                        tensor_scale=jnp.concatenate([gate.tensor_scale.reshape(1),
                                                      up.tensor_scale.reshape(1)]),
                        fmt=gate.fmt, n=2 * n_pad, k=gate.k, tile_k=gate.tile_k)


def pair_view_of(pair: PackedWeight, half: int, *, n: int, tensor_scale: jax.Array,
                 half_block: int) -> PackedWeight:
    """Gate (half 0) or up (half 1) of an interleave_gate_up pair as a PackedWeight read in
    place (pair_view; no copy): logical N `n`, its own tensor_scale [1]."""
    return PackedWeight(codes=pair.codes, scales=pair.scales,
                        tensor_scale=jnp.asarray(tensor_scale, jnp.float32).reshape(1),
                        fmt=pair.fmt, n=n, k=pair.k, tile_k=pair.tile_k,
                        pair_view=(half_block, half))


def interleave_lora_b(gate_b: jax.Array, up_b: jax.Array, n_pad: int,
                      half_block: int) -> jax.Array:
    """Block-diagonal LoRA B [r_g' + r_u', 2 N_pad] (bf16) for an interleave_gate_up weight:
    rows [0, r_g) hold B_gate [r_g, N] in the gate blocks' columns, rows [r_g', r_g' + r_u)
    B_up in the up blocks' (zeros elsewhere; each rank zero-padded to a kernel rank r'), so
    down @ B over [x @ A_gate | x @ A_up] (each padded to r') gives each half its own term."""
    blocks = []
    for b, first in ((gate_b, True), (up_b, False)):
        rank, n = b.shape
        b = jnp.pad(b.astype(jnp.bfloat16), ((0, _kernel_rank(rank) - rank), (0, n_pad - n)))
        b = b.reshape(b.shape[0], n_pad // half_block, 1, half_block)
        zeros = jnp.zeros_like(b)
        pair = (b, zeros) if first else (zeros, b)
        blocks.append(jnp.concatenate(pair, axis=2).reshape(b.shape[0], 2 * n_pad))
    return jnp.concatenate(blocks, axis=0)


def blockwise_matmul_swiglu(x: jax.Array, gate_up: PackedWeight, *, spec: FormatSpec,
                            out_n: int, half_block: int, config: MatmulConfig | None = None,
                            interpret: bool = False, poison_output: bool = False,
                            lora_down: jax.Array | None = None,
                            lora_ranks: tuple[int, int] | None = None,
                            lora_b: jax.Array | None = None,
                            lora_scale: float = 0.0,
                            tensor_scales: tuple[jax.Array, jax.Array] | None = None,
                            next_lora_a: jax.Array | None = None,
                            tuning: DecodeTuning | None = None):
    """silu(x @ Wg^T + lg) * (x @ Wu^T + lu), bf16 [..., out_n], from an interleave_gate_up
    weight (made with `half_block`) in ONE single-weight launch (one dot per K step over
    block_n = 2 * half_block rows: half_block of gate and of up) whose epilogue splits the tile
    and applies the SwiGLU. config None: default_matmul_config (with `tuning`) with that block_n (it must be
    fused with one split; None gives one). LoRA: lora_down [..., r_g + r_u] = x @ [A_gate |
    A_up], lora_ranks = (r_g, r_u), lora_b = interleave_lora_b(B_gate, B_up, ...), lora_scale
    (the same for both). tensor_scales: (gate's divisor [1], up's [1]) as two kernel inputs,
    in place of gate_up.tensor_scale [2] (which may then be None): a caller inside a decode
    loop then builds no [2] array at every step. The model's decode MLP
    (qerl_jax.quant.backends.triton, gate/up pairs), where it is faster than
    the grouped launch + XLA's SwiGLU (docs/decisions.md).

    next_lora_a: the next layer's LoRA A [out_n, r] (the MLP's down projection reads this
    output): then returns (y, y @ next_lora_a float32 [..., r]), the product of the bf16
    output with A (float32 sums), from float32 shares [N tiles, M, r'] that each program
    writes for its output columns, summed over the tiles by XLA. The down projection's own
    x @ A product (a split-K gemm and its reduction per layer) is then not needed.
    """
    if gate_up.pair_view is not None:
        raise ValueError("fused SwiGLU: pass the interleaved pair itself, not a view of it")
    if config is None:  # the pair's tiling, with its row blocks and one split
        config = dataclasses.replace(default_matmul_config(math.prod(x.shape[:-1]), gate_up,
                                                           tuning),
                                     block_n=2 * half_block, split_k=1)
    if config.path != "fused" or config.split_k != 1 or config.group_dots:
        raise ValueError(f"fused SwiGLU: config {config} must be fused with split_k=1")
    if config.block_n != 2 * half_block:
        raise ValueError(f"fused SwiGLU: block_n {config.block_n} must be 2 * half_block "
                         f"{half_block} (the interleave's row blocks)")
    if lora_down is not None:
        if lora_ranks is None or len(lora_ranks) != 2 or lora_down.shape[-1] != sum(lora_ranks):
            raise ValueError(f"fused SwiGLU: lora_down {lora_down.shape} needs lora_ranks "
                             f"(r_gate, r_up) summing to its last dim, got {lora_ranks}")
        lead = lora_down.shape[:-1]
        lora_down = pad_lora_down(lora_down.reshape(-1, lora_down.shape[-1]), lora_ranks)
        lora_down = lora_down.reshape(*lead, lora_down.shape[-1])
    if tensor_scales is None:
        if gate_up.tensor_scale is None or gate_up.tensor_scale.shape != (2,):
            raise ValueError(f"fused SwiGLU: the pair's tensor_scale must be [2] (gate's, "
                             f"up's) without tensor_scales, got {gate_up.tensor_scale}")
        tensor_scales = (gate_up.tensor_scale[:1], gate_up.tensor_scale[1:])
    if len(tensor_scales) != 2 or any(jnp.shape(t) != (1,) for t in tensor_scales):
        raise ValueError(f"fused SwiGLU: tensor_scales must be two [1] arrays, got "
                         f"{[jnp.shape(t) for t in tensor_scales]}")
    if next_lora_a is not None and (next_lora_a.ndim != 2 or next_lora_a.shape[0] != out_n):
        raise ValueError(f"fused SwiGLU: next_lora_a {next_lora_a.shape} must be [out_n = "
                         f"{out_n}, r]")
    return _blockwise_matmul_swiglu(x, gate_up, tuple(tensor_scales), spec=spec, out_n=out_n,
                                    config=config, interpret=interpret,
                                    poison_output=poison_output, lora_down=lora_down,
                                    lora_b=lora_b, lora_scale=float(lora_scale),
                                    next_lora_a=next_lora_a)


@functools.partial(jax.jit, static_argnames=("spec", "out_n", "config", "interpret",
                                             "poison_output", "lora_scale"))
def _blockwise_matmul_swiglu(x, packed, tensor_scales, *, spec, out_n, config, interpret,
                             poison_output, lora_down, lora_b, lora_scale, next_lora_a):
    _check_packed(packed, spec)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    k_tiles = 2 * packed.codes.shape[1] // packed.tile_k
    bm, bn = config.block_m, config.block_n
    if packed.n % bn or bm < 16 or bn < 32:
        raise ValueError(f"fused SwiGLU: config {config} does not tile the interleaved pair "
                         f"[{packed.n}, {packed.k}]")
    _check_row_tile(packed, bn)
    has_lora = lora_down is not None
    extra = ()
    if has_lora:
        if lora_b.shape != (lora_down.shape[-1], packed.n):
            raise ValueError(f"fused SwiGLU: lora_down {lora_down.shape} and lora_b "
                             f"{lora_b.shape} must be [..., R] and [R, {packed.n}]")
        extra = (lora_down.reshape(m, -1).astype(jnp.bfloat16), lora_b.astype(jnp.bfloat16))
    out_shape = jax.ShapeDtypeStruct((m, out_n), jnp.bfloat16)
    with_shares = next_lora_a is not None
    if with_shares:
        next_rank = next_lora_a.shape[1]
        next_a = next_lora_a.astype(jnp.bfloat16)
        if _kernel_rank(next_rank) != next_rank:
            next_a = jnp.pad(next_a, ((0, 0), (0, _kernel_rank(next_rank) - next_rank)))
        extra = (*extra, next_a)
        out_shape = (out_shape, jax.ShapeDtypeStruct((packed.n // bn, m, next_a.shape[1]),
                                                     jnp.float32))
    kernel = functools.partial(
        _swiglu_matmul_kernel, spec=spec,
        decoder=_resolve_decoder(spec, config.decoder, interpret),
        m=m, n=packed.n, k=k, bm=bm, bn=bn, tile_k=packed.tile_k, tiles_per_split=k_tiles,
        k_tiles=k_tiles, split=1, weight_as_lhs=config.weight_as_lhs,
        poisoned=bool(poison_output), clamp_rows=config.clamp_rows,
        lora_scale=lora_scale if has_lora else None, swiglu_n=out_n, with_shares=with_shares)
    aux = tuple(jnp.asarray(a) for a in spec.aux_arrays())
    result = _launch(kernel, out_shape, (_cdiv(m, bm), packed.n // bn, 1),
                     (x2, *tile_views(packed, spec),
                      *(jnp.asarray(t, jnp.float32) for t in tensor_scales), *extra, *aux),
                     interpret=interpret, poison_output=poison_output,
                     compiler_params=_compiler_params(interpret, config.num_warps,
                                                      config.num_stages),
                     name=f"{spec.name}_matmul_swiglu" + ("_lora" if has_lora else "")
                     + ("_next" if with_shares else ""))
    if not with_shares:
        return result.reshape(*lead, out_n)
    y, shares = result
    next_down = shares.sum(axis=0)[:, :next_rank]
    return y.reshape(*lead, out_n), next_down.reshape(*lead, next_rank)


def _transposed_kernel(dy_ref, codes_ref, scales_ref, ts_ref, *rest, spec: FormatSpec,
                       decoder: str, m: int, n: int, k: int, bm: int, bn: int, tile_k: int,
                       n_steps: int, k_tiles: int, poisoned: bool,
                       pair_view: tuple[int, int] | None = None):
    out_ref = rest[-1]
    aux_refs = rest[:len(rest) - 1 - int(poisoned)]
    half = tile_k // 2
    g = half // spec.scale_block
    pid_m, kt = pl.program_id(0), pl.program_id(1)
    r0 = pid_m * bm
    ragged_m, ragged_n = m % bm != 0, n % bn != 0

    def body(i, carry):
        acc_lo, acc_hi = carry
        n0 = pl.multiple_of(i * bn, bn)
        w0 = pl.multiple_of(pair_row(n0, pair_view), bn)
        row = pl.multiple_of(tile_row(w0, kt, k_tiles), bn)
        c = codes_ref[pl.ds(row, bn), pl.ds(0, half)]
        s_lo = scales_ref[pl.ds(row, bn), pl.ds(0, g)]
        s_hi = scales_ref[pl.ds(row, bn), pl.ds(g, g)]
        mask = _edge_masks(r0, bm, m, n0, bn, n, ragged_m, ragged_n)
        dy = _load(dy_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)], mask).astype(jnp.bfloat16)
        w_lo, w_hi = spec.decode(c, s_lo, s_hi, aux_refs, decoder, jnp.bfloat16)
        return acc_lo + _dot_nn(dy, w_lo), acc_hi + _dot_nn(dy, w_hi)

    zeros = jnp.zeros((bm, half), jnp.float32)
    acc_lo, acc_hi = lax.fori_loop(0, n_steps, body, (zeros, zeros))
    factor = (2.0 ** spec.epilogue_exponent(decoder)) / ts_ref[0]
    for p, acc in enumerate((acc_lo, acc_hi)):
        c0 = kt * tile_k + p * half
        mask = _edge_masks(r0, bm, m, c0, half, k, ragged_m, k % tile_k != 0)
        _store(out_ref.at[pl.ds(r0, bm), pl.ds(pl.multiple_of(c0, half), half)],
               (acc * factor).astype(out_ref.dtype), mask)


def _dequantize_kernel(codes_ref, scales_ref, ts_ref, *rest, spec: FormatSpec, decoder: str,
                       n: int, k: int, bn: int, tile_k: int, tiles_per_program: int,
                       k_tiles: int, poisoned: bool, pair_view: tuple[int, int] | None = None):
    out_ref = rest[-1]
    aux_refs = rest[:len(rest) - 1 - int(poisoned)]
    half = tile_k // 2
    g = half // spec.scale_block
    pid_n, pid_k = pl.program_id(0), pl.program_id(1)
    n0 = pl.multiple_of(pid_n * bn, bn)
    w0 = pl.multiple_of(pair_row(n0, pair_view), bn)
    factor = (2.0 ** spec.epilogue_exponent(decoder)) / ts_ref[0]
    for j in range(tiles_per_program):
        kt = pid_k * tiles_per_program + j
        row = pl.multiple_of(tile_row(w0, kt, k_tiles), bn)
        c = codes_ref[pl.ds(row, bn), pl.ds(0, half)]
        s_lo = scales_ref[pl.ds(row, bn), pl.ds(0, g)]
        s_hi = scales_ref[pl.ds(row, bn), pl.ds(g, g)]
        planes = spec.decode(c, s_lo, s_hi, aux_refs, decoder, jnp.float32)
        for p, w in enumerate(planes):
            c0 = kt * tile_k + p * half
            mask = _edge_masks(n0, bn, n, c0, half, k, n % bn != 0, k % tile_k != 0)
            _store(out_ref.at[pl.ds(n0, bn), pl.ds(pl.multiple_of(c0, half), half)],
                   (w * factor).astype(out_ref.dtype), mask)


# ----------------------------------------------------------------------------------------------
# Wrappers


def _resolve_decoder(spec: FormatSpec, decoder: str | None, interpret: bool) -> str:
    if decoder is None:
        return spec.interpret_decoder if interpret else spec.gpu_decoder
    if decoder not in spec.decoders:
        raise ValueError(f"{spec.name}: unknown decoder {decoder!r}; expected one of {spec.decoders}")
    return decoder


def _compiler_params(interpret: bool, num_warps: int, num_stages: int):
    if interpret:
        return None
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _check_packed(packed: PackedWeight, spec: FormatSpec):
    if packed.fmt != spec.name:
        raise ValueError(f"weight is packed as {packed.fmt!r}, kernel expects {spec.name!r}")
    if spec.kernel_scale_dtype is not None and packed.scales.dtype != spec.kernel_scale_dtype:
        raise ValueError(f"{spec.name} kernel-layout scales must be {spec.kernel_scale_dtype} "
                         f"(made by the format's repack), got {packed.scales.dtype}")
    half = packed.tile_k // 2
    if half % spec.scale_block or packed.tile_k & (packed.tile_k - 1) or half < 16:
        raise ValueError(f"tile_k={packed.tile_k} must be a power of two, >= 32 and a multiple "
                         f"of 2 * {spec.scale_block}")
    if packed.pair_view is not None:
        half_block, which = packed.pair_view
        rows = packed.codes.shape[0]
        if (which not in (0, 1) or half_block < 16 or half_block & (half_block - 1)
                or rows % (2 * half_block) or rows // 2 < packed.n):
            raise ValueError(f"pair view {packed.pair_view} of a [{rows}, ...] pair for N="
                             f"{packed.n}: expected (half_block a power of two >= 16, half 0 "
                             "or 1) over 2 * half_block-row blocks holding N rows per half")


def _check_row_tile(packed: PackedWeight, bn: int) -> None:
    """A row tile lies in one TILE_ROWS block of the tile-major arrays (bn divides 64), and a
    pair view is read in row tiles within one half_block: bn must divide it."""
    if TILE_ROWS % bn:
        raise ValueError(f"block_n={bn} must divide the kernel layout's {TILE_ROWS}-row blocks "
                         f"(a power of two <= {TILE_ROWS})")
    if packed.max_block_n is not None and packed.max_block_n % bn:
        raise ValueError(f"block_n={bn} must divide the pair view's half_block "
                         f"{packed.max_block_n}")


def _launch(kernel, out_shape, grid, inputs, *, interpret, compiler_params, poison_output, name):
    """pallas_call with optional NaN-poisoned outputs (aliased inputs) to catch unwritten tiles.
    out_shape: one ShapeDtypeStruct, or a tuple of them (one poison input each)."""
    shapes = out_shape if isinstance(out_shape, tuple) else (out_shape,)
    aliases = {}
    if poison_output:
        first = len(inputs)
        inputs = (*inputs, *(jnp.full(o.shape, jnp.nan, o.dtype) for o in shapes))
        aliases = {first + i: i for i in range(len(shapes))}
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid, input_output_aliases=aliases,
        interpret=interpret, compiler_params=compiler_params, name=name)(*inputs)


# tl.dot needs >= 16 along the contraction: LoRA ranks are zero-padded to a power of two >= this.
_MIN_LORA_RANK = 16


def blockwise_matmul(x: jax.Array, packed: PackedWeight, *, spec: FormatSpec,
                     config: MatmulConfig | None = None, interpret: bool = False,
                     poison_output: bool = False, lora_down: jax.Array | None = None,
                     lora_b: jax.Array | None = None, lora_scale: float = 0.0) -> jax.Array:
    """y [..., N] bf16 = x [..., K] @ W^T (+ lora_scale * lora_down @ lora_b) for a packed
    4-bit W [N, K].

    config None picks default_matmul_config(M, packed) (outside the jit).
    lora_down [..., r] (= x @ A, rounded to bf16) and lora_b [r, N]: an unmerged LoRA
    adapter's second product, added in the fused kernel's f32 epilogue (one kernel instead of
    the matmul, the B dot and the add), or after the XLA dot on the dequantize path.
    """
    if config is None:
        config = default_matmul_config(math.prod(x.shape[:-1]), packed)
    return _blockwise_matmul(x, packed, spec=spec, config=config, interpret=interpret,
                             poison_output=poison_output, lora_down=lora_down, lora_b=lora_b,
                             lora_scale=lora_scale)


def _lora_epilogue_inputs(lora_down, lora_b, lead, n):
    """(down [M, r'] bf16, B [r', N] bf16), r' = r zero-padded to a power of two >= 16 (Pallas
    blocks are powers of two; tl.dot needs >= 16 along the contraction)."""
    rank = lora_down.shape[-1]
    if lora_b is None or lora_b.shape != (rank, n) or lora_down.shape[:-1] != tuple(lead):
        raise ValueError(f"LoRA epilogue: lora_down {lora_down.shape} and lora_b "
                         f"{None if lora_b is None else lora_b.shape} must be "
                         f"[..., r] with x's leading dims {tuple(lead)} and [r, N={n}]")
    down2 = lora_down.reshape(-1, rank).astype(jnp.bfloat16)
    lora_b = lora_b.astype(jnp.bfloat16)
    padded_rank = max(_MIN_LORA_RANK, _next_pow2(rank))
    if padded_rank > rank:
        down2 = jnp.pad(down2, ((0, 0), (0, padded_rank - rank)))
        lora_b = jnp.pad(lora_b, ((0, padded_rank - rank), (0, 0)))
    return down2, lora_b


@functools.partial(jax.jit, static_argnames=("spec", "config", "interpret", "poison_output",
                                             "lora_scale"))
def _blockwise_matmul(x, packed: PackedWeight, *, spec: FormatSpec, config: MatmulConfig,
                      interpret: bool, poison_output: bool, lora_down, lora_b,
                      lora_scale: float) -> jax.Array:
    _check_packed(packed, spec)
    lead, k = x.shape[:-1], x.shape[-1]
    if k != packed.k:
        raise ValueError(f"x has K={k}, weight has K={packed.k}")
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    has_lora = lora_down is not None
    if has_lora:
        down2, lora_b = _lora_epilogue_inputs(lora_down, lora_b, lead, packed.n)
    if config.path == "dequantize":
        w = blockwise_dequantize(packed, spec=spec, config=DequantizeConfig(),
                                 interpret=interpret, poison_output=poison_output)
        y = lax.dot_general(x2.astype(jnp.bfloat16), w, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
        if has_lora:
            y = y + lora_scale * jnp.dot(down2, lora_b, preferred_element_type=jnp.float32)
        return y.astype(jnp.bfloat16).reshape(*lead, packed.n)
    if config.path != "fused":
        raise ValueError(f"unknown matmul path {config.path!r}")
    n_pad, half_k = packed.n_pad, packed.codes.shape[1]
    k_tiles = 2 * half_k // packed.tile_k
    bm, bn, split = config.block_m, config.block_n, config.split_k
    _check_row_tile(packed, bn)
    tiles_per_split = _cdiv(k_tiles, split)
    if n_pad % bn or bm < 16 or bn < 16 or not _valid_split(split, k_tiles):
        raise ValueError(f"config {config} does not tile N_pad={n_pad}, K tiles={k_tiles} (every "
                         f"one of the split_k splits of ceil(K tiles / split_k) tiles must get "
                         f"at least one tile)")
    decoder = _resolve_decoder(spec, config.decoder, interpret)
    poisoned = bool(poison_output)
    kernel = functools.partial(
        _matmul_kernel, spec=spec, decoder=decoder, m=m, n=packed.n, k=k, bm=bm, bn=bn,
        tile_k=packed.tile_k, tiles_per_split=tiles_per_split, k_tiles=k_tiles, split=split,
        weight_as_lhs=config.weight_as_lhs, poisoned=poisoned, group_dots=config.group_dots,
        clamp_rows=config.clamp_rows, lora_scale=float(lora_scale) if has_lora else None,
        pair_view=packed.pair_view)
    if config.group_dots and spec.decode_values is None:
        raise ValueError(f"{spec.name} has no group-scaled decoder")
    if split == 1:
        out_shape = jax.ShapeDtypeStruct((m, packed.n), jnp.bfloat16)
    else:
        out_shape = jax.ShapeDtypeStruct((split, m, packed.n), jnp.float32)
    aux = tuple(jnp.asarray(a) for a in spec.aux_arrays())
    # Tiles of N past the logical n hold only padding: not launched (their unmasked stores would
    # land outside the [m, n] output when n is a multiple of bn but n_pad > n).
    y = _launch(kernel, out_shape, (_cdiv(m, bm), _cdiv(packed.n, bn), split),
                (x2, *tile_views(packed, spec), packed.tensor_scale,
                 *((down2, lora_b) if has_lora else ()), *aux),
                interpret=interpret, poison_output=poison_output,
                compiler_params=_compiler_params(interpret, config.num_warps, config.num_stages),
                name=f"{spec.name}_matmul" + ("_lora" if has_lora else ""))
    if split > 1:
        y = y.sum(axis=0).astype(jnp.bfloat16)
    return y.reshape(*lead, packed.n)


def default_group_matmul_config(m: int, packed: tuple[PackedWeight, ...],
                                tuning: DecodeTuning | None = None) -> MatmulConfig:
    """Tiling of a grouped launch: default_matmul_config's rules over all members' N tiles (the
    programs of all members fill the GPU together, so split-K is chosen for their sum)."""
    first = packed[0]
    return _default_config(m, tuple(p.codes.shape[0] for p in packed),
                           2 * first.codes.shape[1] // first.tile_k, first.fmt, tuning=tuning)


def check_group(packed: tuple[PackedWeight, ...], spec: FormatSpec) -> None:
    """Raises ValueError unless the weights can share one launch: >= 1 weight, all of `spec`'s
    format, with the same K, K tile and padded K."""
    if not packed:
        raise ValueError("a grouped matmul needs at least one weight")
    first = packed[0]
    for i, p in enumerate(packed):
        _check_packed(p, spec)
        if p.pair_view is not None:
            raise ValueError(f"grouped matmul: weight {i} is a gate/up pair view (its launch is "
                             "blockwise_matmul_swiglu over the pair, or blockwise_matmul)")
        if (p.k, p.tile_k, p.codes.shape[1]) != (first.k, first.tile_k, first.codes.shape[1]):
            raise ValueError(f"grouped matmul: weight {i} is [N={p.n}, K={p.k}] with tile_k "
                             f"{p.tile_k}; weight 0 has K={first.k}, tile_k {first.tile_k} "
                             "(all weights of a group need the same K and K tile)")


def blockwise_matmul_group(x: jax.Array, packed: tuple[PackedWeight, ...], *, spec: FormatSpec,
                           config: MatmulConfig | None = None, interpret: bool = False,
                           poison_output: bool = False, lora_down: jax.Array | None = None,
                           lora_bs=None,
                           lora_scales: tuple[float, ...] | None = None) -> tuple[jax.Array, ...]:
    """(x @ W_i^T (+ lora_scales[i] * down_i @ lora_bs[i]))_i, bf16 [..., N_i], for weights
    that share x (a layer's q/k/v, or gate/up), in ONE fused-kernel launch: its N-tile programs
    are dealt out to the weights in order. Each output equals blockwise_matmul's of the same
    weight under the same config. Saves a launch and its fill/drain per extra weight, and lets
    small weights (k/v) share the GPU with a large one, without concatenating the weights.

    LoRA (all weights or none): lora_down [..., R] = x @ [A_0 | A_1 | ...], the members' down
    products side by side (one dot for the group), member i's at columns [sum_{j<i} r_j, + r_i)
    with r_i = lora_bs[i].shape[0]; lora_bs[i] [r_i, N_i]. config None picks
    default_group_matmul_config (decided outside the jit). The "dequantize" path runs the
    weights one by one.
    """
    packed = tuple(packed)
    if config is None:
        config = default_group_matmul_config(math.prod(x.shape[:-1]), packed)
    if lora_down is not None:
        lora_bs = tuple(lora_bs)
        lora_scales = tuple(float(s) for s in lora_scales)
        if not len(lora_bs) == len(lora_scales) == len(packed):
            raise ValueError(f"grouped matmul: {len(packed)} weights but {len(lora_bs)} LoRA B "
                             f"matrices and {len(lora_scales)} scales")
        ranks = sum(b.shape[0] for b in lora_bs)
        if lora_down.shape[-1] != ranks:
            raise ValueError(f"grouped matmul: lora_down has {lora_down.shape[-1]} columns; the "
                             f"B matrices' ranks sum to {ranks}")
    return _blockwise_matmul_group(x, packed, spec=spec, config=config, interpret=interpret,
                                   poison_output=poison_output, lora_down=lora_down,
                                   lora_bs=lora_bs, lora_scales=lora_scales)


def _kernel_rank(rank: int) -> int:
    return max(_MIN_LORA_RANK, _next_pow2(rank))


def pad_lora_down(down: jax.Array, ranks) -> jax.Array:
    """LoRA down products side by side [M, sum r_i] -> [M, sum r_i'], each zero-padded to a
    kernel rank r_i' (a power of two >= 16); the same array when every r_i already is one."""
    if all(_kernel_rank(r) == r for r in ranks):
        return down
    starts = [sum(ranks[:i]) for i in range(len(ranks))]
    return jnp.concatenate([jnp.pad(down[:, s:s + r], ((0, 0), (0, _kernel_rank(r) - r)))
                            for s, r in zip(starts, ranks)], axis=1)


@functools.partial(jax.jit, static_argnames=("spec", "config", "interpret", "poison_output",
                                             "lora_scales"))
def _blockwise_matmul_group(x, packed, *, spec: FormatSpec, config: MatmulConfig,
                            interpret: bool, poison_output: bool, lora_down, lora_bs,
                            lora_scales) -> tuple[jax.Array, ...]:
    check_group(packed, spec)
    has_lora = lora_down is not None
    lead, k = x.shape[:-1], x.shape[-1]
    ranks = [b.shape[0] for b in lora_bs] if has_lora else []
    starts = [sum(ranks[:i]) for i in range(len(ranks))]
    if config.path == "dequantize":
        return tuple(_blockwise_matmul(
            x, p, spec=spec, config=config, interpret=interpret, poison_output=poison_output,
            lora_down=lora_down[..., starts[i]:starts[i] + ranks[i]] if has_lora else None,
            lora_b=lora_bs[i] if has_lora else None,
            lora_scale=lora_scales[i] if has_lora else 0.0) for i, p in enumerate(packed))
    if config.path != "fused":
        raise ValueError(f"unknown matmul path {config.path!r}")
    if k != packed[0].k:
        raise ValueError(f"x has K={k}, the grouped weights have K={packed[0].k}")
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    half_k = packed[0].codes.shape[1]
    k_tiles = 2 * half_k // packed[0].tile_k
    bm, bn, split = config.block_m, config.block_n, config.split_k
    if any(p.codes.shape[0] % bn for p in packed) or bm < 16 or bn < 16 or \
            not _valid_split(split, k_tiles):
        raise ValueError(f"config {config} does not tile the grouped weights (N_pad "
                         f"{[p.codes.shape[0] for p in packed]}, K tiles={k_tiles})")
    if config.group_dots:
        raise ValueError("grouped matmul: group_dots is not supported")
    shared, columns = [], None
    if has_lora:
        down2 = lora_down.reshape(m, -1).astype(jnp.bfloat16)
        bs = [b.astype(jnp.bfloat16) for b in lora_bs]
        down2 = pad_lora_down(down2, ranks)  # each member zero-padded to a kernel rank
        if any(_kernel_rank(r) != r for r in ranks):
            bs = [jnp.pad(b, ((0, _kernel_rank(r) - r), (0, 0))) for b, r in zip(bs, ranks)]
        kernel_ranks = [_kernel_rank(r) for r in ranks]
        columns = tuple(sum(kernel_ranks[:i]) for i in range(len(kernel_ranks)))
        shared = [down2]
    members, inputs, offset = [], [], 0
    for i, p in enumerate(packed):
        n_tiles = _cdiv(p.n, bn)
        members.append((p.n, offset, n_tiles))
        offset += n_tiles
        _check_row_tile(p, bn)
        inputs += [*tile_views(p, spec), p.tensor_scale]
        if has_lora:
            if bs[i].shape[1] != p.n:
                raise ValueError(f"grouped matmul: lora_bs[{i}] {lora_bs[i].shape} must be "
                                 f"[r, N={p.n}]")
            inputs.append(bs[i])
    kernel = functools.partial(
        _grouped_matmul_kernel, members=tuple(members),
        lora_scales=lora_scales if has_lora else None, lora_columns=columns,
        poisoned=bool(poison_output), spec=spec,
        decoder=_resolve_decoder(spec, config.decoder, interpret), m=m, k=k, bm=bm, bn=bn,
        tile_k=packed[0].tile_k, tiles_per_split=_cdiv(k_tiles, split), k_tiles=k_tiles,
        split=split, weight_as_lhs=config.weight_as_lhs, clamp_rows=config.clamp_rows)
    if split == 1:
        out_shape = tuple(jax.ShapeDtypeStruct((m, p.n), jnp.bfloat16) for p in packed)
    else:
        out_shape = tuple(jax.ShapeDtypeStruct((split, m, p.n), jnp.float32) for p in packed)
    aux = tuple(jnp.asarray(a) for a in spec.aux_arrays())
    ys = _launch(kernel, out_shape, (_cdiv(m, bm), offset, split),
                 (x2, *shared, *inputs, *aux), interpret=interpret,
                 poison_output=poison_output,
                 compiler_params=_compiler_params(interpret, config.num_warps,
                                                  config.num_stages),
                 name=f"{spec.name}_matmul_group{len(packed)}" + ("_lora" if has_lora else ""))
    if split > 1:
        ys = [y.sum(axis=0).astype(jnp.bfloat16) for y in ys]
    return tuple(y.reshape(*lead, p.n) for y, p in zip(ys, packed))


@functools.partial(jax.jit, static_argnames=("spec", "config", "interpret", "poison_output"))
def blockwise_matmul_transposed(dy: jax.Array, packed: PackedWeight, *, spec: FormatSpec,
                                config: TransposedConfig | None = None, interpret: bool = False,
                                poison_output: bool = False) -> jax.Array:
    """dx [..., K] bf16 = dy [..., N] @ W for a packed 4-bit W [N, K] (the backward of x @ W^T).

    config None picks default_transposed_config(M, packed).
    """
    _check_packed(packed, spec)
    if config is None:
        config = default_transposed_config(dy.size // dy.shape[-1], packed)
    lead, n = dy.shape[:-1], dy.shape[-1]
    if n != packed.n:
        raise ValueError(f"dy has N={n}, weight has N={packed.n}")
    dy2 = dy.reshape(-1, n)
    m = dy2.shape[0]
    if config.path == "dequantize":
        w = blockwise_dequantize(packed, spec=spec, config=DequantizeConfig(),
                                 interpret=interpret, poison_output=poison_output)
        dx = jnp.dot(dy2.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
        return dx.astype(jnp.bfloat16).reshape(*lead, packed.k)
    n_pad, half_k = packed.n_pad, packed.codes.shape[1]
    bm, bn = config.block_m, config.block_n
    if n_pad % bn or bm < 16 or bn < 16:
        raise ValueError(f"config {config} does not tile N_pad={n_pad}")
    _check_row_tile(packed, bn)
    decoder = _resolve_decoder(spec, config.decoder, interpret)
    poisoned = bool(poison_output)
    kernel = functools.partial(
        _transposed_kernel, spec=spec, decoder=decoder, m=m, n=n, k=packed.k, bm=bm, bn=bn,
        tile_k=packed.tile_k, n_steps=_cdiv(n, bn), k_tiles=2 * half_k // packed.tile_k,
        poisoned=poisoned,
        pair_view=packed.pair_view)
    aux = tuple(jnp.asarray(a) for a in spec.aux_arrays())
    dx = _launch(kernel, jax.ShapeDtypeStruct((m, packed.k), jnp.bfloat16),
                 (_cdiv(m, bm), 2 * half_k // packed.tile_k),
                 (dy2, *tile_views(packed, spec), packed.tensor_scale, *aux),
                 interpret=interpret, poison_output=poison_output,
                 compiler_params=_compiler_params(interpret, config.num_warps, config.num_stages),
                 name=f"{spec.name}_matmul_transposed")
    return dx.reshape(*lead, packed.k)


@functools.partial(jax.jit, static_argnames=("spec", "config", "interpret", "poison_output"))
def blockwise_dequantize(packed: PackedWeight, *, spec: FormatSpec,
                         config: DequantizeConfig = DequantizeConfig(), interpret: bool = False,
                         poison_output: bool = False) -> jax.Array:
    """W as bf16 [N, K] (f32 decode and scale, one rounding), written tile by tile."""
    _check_packed(packed, spec)
    n_pad, half_k = packed.n_pad, packed.codes.shape[1]
    k_tiles = 2 * half_k // packed.tile_k
    tpp = math.gcd(config.tiles_per_program, k_tiles)
    bn = min(config.block_n, n_pad, packed.max_block_n or n_pad)
    _check_row_tile(packed, bn)
    poisoned = bool(poison_output)
    # The exact decoder: its cost is hidden behind the 2-byte-per-weight write.
    decoder = spec.interpret_decoder
    kernel = functools.partial(
        _dequantize_kernel, spec=spec, decoder=decoder, n=packed.n, k=packed.k, bn=bn,
        tile_k=packed.tile_k, tiles_per_program=tpp, k_tiles=k_tiles, poisoned=poisoned,
        pair_view=packed.pair_view)
    aux = tuple(jnp.asarray(a) for a in spec.aux_arrays())
    return _launch(kernel, jax.ShapeDtypeStruct((packed.n, packed.k), jnp.bfloat16),
                   (_cdiv(packed.n, bn), k_tiles // tpp),
                   (*tile_views(packed, spec), packed.tensor_scale, *aux),
                   interpret=interpret, poison_output=poison_output,
                   compiler_params=_compiler_params(interpret, config.num_warps,
                                                    config.num_stages),
                   name=f"{spec.name}_dequantize")
