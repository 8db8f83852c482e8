"""The Pallas (Triton backend) kernel bodies of the blockwise 4-bit matmuls, and what their
launchers share (decoder choice, checks, the launch with poisoned outputs, LoRA rank padding).
The kernels and layout: pallas_kernels/blockwise_matmul.py, blockwise_layout.py.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.blockwise_configs import next_pow2
from pallas_kernels.blockwise_layout import (TILE_ROWS, FormatSpec, PackedWeight, pair_row,
                                             tile_row)

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


def matmul_kernel(x_ref, codes_ref, scales_ref, ts_ref, *rest, poisoned: bool,
                   lora_scale: float | None = None, **static):
    """One weight: refs (x, codes, scales, tensor scale[, down, lora_b], *aux[, poison], out)."""
    out_ref = rest[-1]
    down_ref = lora_b_ref = None
    if lora_scale is not None:  # LoRA epilogue inputs: down = x @ A [M, r], B [r, N]
        down_ref, lora_b_ref, *rest = rest
    aux_refs = rest[:len(rest) - 1 - int(poisoned)]
    matmul_program(x_ref, codes_ref, scales_ref, ts_ref, down_ref, lora_b_ref, aux_refs,
                    out_ref, (pl.program_id(0), pl.program_id(1), pl.program_id(2)),
                    lora_scale=lora_scale, **static)


def grouped_matmul_kernel(x_ref, *refs, members: tuple[tuple[int, int, int], ...],
                           lora_scales: tuple[float, ...] | None,
                           lora_columns: tuple[int, ...] | None, poisoned: bool, **static):
    """Several weights sharing x in one launch. refs: [the LoRA x @ A [M, R] of all members,]
    per member (codes, scales, tensor scale[, lora_b]), then the aux refs, [one poison per
    member,] one output per member. members[i] = (n_i, first N-tile program of member i, its N
    tiles): the programs of the N grid axis are dealt out to the members in order, each running
    the single-weight program; member i's LoRA x @ A is columns [lora_columns[i], + r_i)."""
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
            matmul_program(x_ref, *weight_refs[:3], shared_down, lora_b_ref, aux_refs, out_ref,
                            (pid_m, pid_n - offset, pid_s), n=n,
                            lora_scale=None if lora_scales is None else lora_scales[i],
                            down_column=0 if lora_columns is None else lora_columns[i],
                            **static)


def matmul_program(x_ref, codes_ref, scales_ref, ts_ref, down_ref, lora_b_ref, aux_refs,
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
    (swiglu_epilogue)."""
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
        swiglu_epilogue(y * (2.0 ** exponent), ts_ref, down_ref, lora_b_ref, out_ref,
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


def swiglu_matmul_kernel(x_ref, codes_ref, scales_ref, ts_gate_ref, ts_up_ref, *rest,
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
    matmul_program(x_ref, codes_ref, scales_ref, (ts_gate_ref, ts_up_ref), down_ref,
                    lora_b_ref, tuple(rest), out_refs[0],
                    (pl.program_id(0), pl.program_id(1), pl.program_id(2)),
                    lora_scale=lora_scale, next_a_ref=next_a_ref,
                    shares_ref=out_refs[1] if with_shares else None, **static)


def swiglu_epilogue(y, ts_ref, down_ref, lora_b_ref, out_ref, *, lora_scale, down_column, r0,
                     n0, m, n, bm, bn, pid_n, out_n, next_a_ref=None, shares_ref=None):
    """silu(gate) * up of an interleaved gate/up tile y [bm, bn] (gate columns first; not yet
    divided by the tensor scales), the LoRA term (block-diagonal B, interleave_lora_b) added to
    each half; stored as bf16 to out [M, out_n] columns [pid_n * bn / 2, + bn / 2). With
    shares_ref: also that bf16 tile times next_a_ref's rows of those columns, float32 [bm, r'],
    to shares_ref[pid_n] (the shares sum to out @ A_next). Stored tiles last instead ([M, r',
    tiles], a row reduction for XLA), XLA's sum was faster but the strided stores made the
    launch slower (32B gate|up, docs/decisions.md)."""
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



def transposed_kernel(dy_ref, codes_ref, scales_ref, ts_ref, *rest, spec: FormatSpec,
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


def dequantize_kernel(codes_ref, scales_ref, ts_ref, *rest, spec: FormatSpec, decoder: str,
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



def resolve_decoder(spec: FormatSpec, decoder: str | None, interpret: bool) -> str:
    if decoder is None:
        return spec.interpret_decoder if interpret else spec.gpu_decoder
    if decoder not in spec.decoders:
        raise ValueError(f"{spec.name}: unknown decoder {decoder!r}; expected one of {spec.decoders}")
    return decoder


def compiler_params(interpret: bool, num_warps: int, num_stages: int):
    if interpret:
        return None
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def check_packed(packed: PackedWeight, spec: FormatSpec):
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


def check_row_tile(packed: PackedWeight, bn: int) -> None:
    """A row tile lies in one TILE_ROWS block of the tile-major arrays (bn divides 64), and a
    pair view is read in row tiles within one half_block: bn must divide it."""
    if TILE_ROWS % bn:
        raise ValueError(f"block_n={bn} must divide the kernel layout's {TILE_ROWS}-row blocks "
                         f"(a power of two <= {TILE_ROWS})")
    if packed.max_block_n is not None and packed.max_block_n % bn:
        raise ValueError(f"block_n={bn} must divide the pair view's half_block "
                         f"{packed.max_block_n}")


def launch(kernel, out_shape, grid, inputs, *, interpret, compiler_params, poison_output, name):
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
MIN_LORA_RANK = 16



def lora_epilogue_inputs(lora_x_a, lora_b, lead, n):
    """(down [M, r'] bf16, B [r', N] bf16), r' = r zero-padded to a power of two >= 16 (Pallas
    blocks are powers of two; tl.dot needs >= 16 along the contraction)."""
    rank = lora_x_a.shape[-1]
    if lora_b is None or lora_b.shape != (rank, n) or lora_x_a.shape[:-1] != tuple(lead):
        raise ValueError(f"LoRA epilogue: lora_x_a {lora_x_a.shape} and lora_b "
                         f"{None if lora_b is None else lora_b.shape} must be "
                         f"[..., r] with x's leading dims {tuple(lead)} and [r, N={n}]")
    down2 = lora_x_a.reshape(-1, rank).astype(jnp.bfloat16)
    lora_b = lora_b.astype(jnp.bfloat16)
    padded_rank = max(MIN_LORA_RANK, next_pow2(rank))
    if padded_rank > rank:
        down2 = jnp.pad(down2, ((0, 0), (0, padded_rank - rank)))
        lora_b = jnp.pad(lora_b, ((0, padded_rank - rank), (0, 0)))
    return down2, lora_b



def kernel_rank(rank: int) -> int:
    return max(MIN_LORA_RANK, next_pow2(rank))


def pad_lora_x_a(down: jax.Array, ranks) -> jax.Array:
    """LoRA x @ A products side by side [M, sum r_i] -> [M, sum r_i'], each zero-padded to a
    kernel rank r_i' (a power of two >= 16); the same array when every r_i already is one."""
    if all(kernel_rank(r) == r for r in ranks):
        return down
    starts = [sum(ranks[:i]) for i in range(len(ranks))]
    return jnp.concatenate([jnp.pad(down[:, s:s + r], ((0, 0), (0, kernel_rank(r) - r)))
                            for s, r in zip(starts, ranks)], axis=1)
