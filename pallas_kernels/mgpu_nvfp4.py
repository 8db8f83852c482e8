"""NVFP4 decode matmul for Hopper: a Pallas Mosaic GPU kernel (TMA pipeline, E2M1 decode in
registers, wgmma) for the sampler's small-M launches (GPU only, JAX >= 0.10; not interpretable:
Mosaic GPU's interpret mode has no TMA rules, so the CPU suite checks its layout, its bit math
and that it lowers for CUDA; tests/pallas_kernels/test_mgpu_nvfp4_gpu.py checks its numbers).

Permuted layout (pallas_kernels/mgpu_nvfp4_layout.py: `permute_packed`, from a PackedWeight in the kernel layout of
pallas_kernels.blockwise_matmul, NVFP4, tile_k = 256; `unpermute_tiles` undoes it, and
pallas_kernels.permuted_dequantize dequantizes it):
  uint8 [row tiles * K tiles * 72, 128]; the 64-row tile b, K tile t is the 9216 bytes at rows
  (b * k_tiles + t) * 72:
  bytes [0, 8192): per thread th of the warpgroup 16 32-bit words, word i at
    (i // 4) * 2048 + th * 16 + (i % 4) * 4 (4 conflict-free 16-byte shared-memory loads per
    thread). Word i holds the thread's 4 bf16 pairs of columns [16 i, 16 i + 16) in the wgmma
    register layout (PAIR_SLOTS: rows r0 = 16 (th // 32) + (th % 32) // 4 and r0 + 8, columns
    16 i + 2 (th % 4) + {0, 1} and + 8), its 32 bits placed (source_bit) so that pair k's bf16x2
    pattern e2m1 * 2^-126 (code bits 0-2 at bits 6-8, the sign at 15; +16 for the second column)
    is rotl(word, r) & 0x81C081C0, r = 0, 6, 12 for k = 0, 1, 2, and
    (rotl(word, 2) & 0x00400040) | (rotl(word, 10) & 0x81808180) for k = 3: 9 integer
    instructions per 8 weights, no register relayout.
  bytes [8192, 9216): the tile's canonical scale codes [64 rows, 16 blocks] (nvfp4_matmul).
Each pair is then scaled by one fma.rn.bf16x2 with its block's (s, s) pattern
(code * 0x00100010 + 0x75807580, the "ptx_paired_scales" operand): exact e2m1 * scale * 2^-8 in bf16.

Kernel (`matmul_unscaled`): grid (row tiles, splits); program (b, s) runs K tiles
[s K_t / splits, (s + 1) K_t / splits) (the splits need not divide K_t: a program with one
tile fewer skips its surplus last step) through a TMA pipeline, decodes each tile and
accumulates acc [64, M] += W_tile [64, 256] @ x_tile^T on the tensor cores (wgmma, M the N of
the instruction), and stores acc transposed (through shared memory, one TMA copy) as split
s's partial of y [M, N], so the consumers of y keep their row-major layout (with y^T partials
XLA laid the residual stream out as [N, M] and transposed it back before every norm, as an H100
program's HLO showed). With LoRA, split 0 also adds its [64, r] tile of the LoRA operand
(`lora_operand`: B^T scaled by lora_scale * tensor_scale * 2^-8, so one factor rescales both
products) times (x @ A)^T into acc (one more wgmma) before storing. The partials are summed by
elementwise adds, which XLA fuses into the consumer of y (no kernel of its own).

A second schedule (`_warp_specialized_kernel`, mgpu_nvfp4_layout.launch_schedule): grid (row
tiles / 2, splits), one program per SM of three warpgroups; two decode and multiply one row tile
each, sharing every x tile, and the third issues the TMA copies. Same splits, same bits as the
split-K kernel. It runs where a split-K program with its LoRA tiles would leave an SM no room
for a second one (at M = 64 the wide operands of q|k|v and gate|up launches); elsewhere the
split-K programs were faster per launch at M = 64 and as fast summed over a layer at M = 33-40
(benchmarks/RESULTS.md).

A stream-K schedule (every program in one wave, each an equal share of the (row tile, K tile)
units) was correct on the H100 but no faster (docs/decisions.md; its code is at commit
7d89713).

`mgpu_nvfp4_matmul`: y = that sum * 2^8 / tensor_scale (one weight). A grouped q|k|v launch is
one matmul_unscaled over the three weights stacked by rows (`group_permuted`) with a
block-diagonal LoRA operand (`group_lora_operand`); the caller rescales each member's columns.
`mgpu_nvfp4_swiglu`: a gate/up pair interleaved in blocks of 32 rows (kernel_layout.pair_gate_up) in one launch,
its LoRA operand block diagonal (`pair_lora_operand`). With one split (the model's pairs) the
kernel's epilogue (`SwigluEpilogue`) applies each half's tensor scale, computes silu(gate) * up
in bf16 and each row tile's share of the next layer's LoRA x @ A, which XLA sums; otherwise
XLA does all of that. The LoRA operands are made once per rollout where the caller can
(KernelLayoutWeight.mosaic_lora_operand, qerl_jax.models.decode_fusion.stack_grouped_adapters), else per call.

`L2Prefetch` (`l2_prefetch=`): after its K loop each program also prefetches into L2 its share
of another launch's first K tiles (and optionally a small array, the LoRA A that XLA's x @ A
reads before that launch): a hint that changes no result (decode_fusion.link_decode_prefetch
chains the sampler's launches; docs/decisions.md).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.mgpu_nvfp4_layout import (CODE_BYTES, L2Prefetch, LORA_RANKS, MAX_M,
                                              MAX_OPERAND_RANK, PAIR_ASM, PAIR_SLOTS,
                                              SCALED_EXPONENT, SCHEDULES, SLOTS, TILE_K,
                                              TILE_LINES, TILE_ROWS, WARP_SPECIALIZED_MIN_M,
                                              WS_COMPUTE_WARPGROUPS, default_splits,
                                              extra_prefetchable, group_lora_operand,
                                              group_permuted, kernel_layout_from_permuted,
                                              l2_prefetch_for, launch_schedule, launch_splits,
                                              lora_operand, operand_rank_ok, padded_rows,
                                              pair_lora_operand, permute_packed, permute_tiles,
                                              permuted_dequantize_reference, refusal,
                                              resident_programs, source_bit,
                                              split_k_smem_bytes, unpermute_shifts,
                                              unpermute_tiles, ws_smem_bytes, ws_stages)

# The kernels and the layout's names, for the backends, the tests and the benchmarks.
__all__ = [
    "CODE_BYTES", "L2Prefetch", "LORA_RANKS", "MAX_M", "MAX_OPERAND_RANK", "PAIR_ASM",
    "PAIR_SLOTS", "SCALED_EXPONENT", "SCHEDULES", "SLOTS", "SwigluEpilogue", "TILE_K",
    "TILE_LINES", "TILE_ROWS", "WARP_SPECIALIZED_MIN_M", "WS_COMPUTE_WARPGROUPS", "available",
    "default_splits", "extra_prefetchable", "group_lora_operand", "group_permuted",
    "kernel_layout_from_permuted", "l2_prefetch_for", "launch_schedule", "launch_splits",
    "lora_operand", "split_k_smem_bytes",
    "matmul_unscaled", "mgpu_nvfp4_matmul", "mgpu_nvfp4_swiglu", "operand_rank_ok",
    "padded_rows", "pair_lora_operand", "permute_packed", "permute_tiles",
    "permuted_dequantize_reference", "refusal", "resident_programs", "source_bit",
    "unpermute_shifts", "unpermute_tiles", "ws_smem_bytes", "ws_stages",
]


def _decode_tile(tile_ref, with_scales: bool = True, warpgroup_stride: int = 0):
    """Inline Mosaic GPU: a permuted tile in shared memory -> the [64, 256] bf16 weights
    (e2m1 * scale * 2^-8) in the wgmma register layout; with_scales=False (the probes' e2m1
    variants): the exact e2m1 values, the scale codes unread. warpgroup_stride: the tile of
    warpgroup w (thread index // 128) starts w * warpgroup_stride bytes into tile_ref."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils

    i32 = ir.IntegerType.get_signless(32)
    i8 = ir.IntegerType.get_signless(8)
    vec4 = ir.VectorType.get((4,), i32)
    bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())

    def const(v):
        return arith.constant(i32, v)

    tid = utils.thread_idx()
    thread = arith.andi(tid, const(127))
    lane = arith.andi(tid, const(31))
    row0 = arith.addi(arith.muli(arith.andi(arith.shrui(tid, const(5)), const(3)), const(16)),
                      arith.shrui(lane, const(2)))
    base = utils.memref_ptr(tile_ref)
    if warpgroup_stride:
        base = utils.getelementptr(
            base, [arith.muli(arith.shrui(tid, const(7)), const(warpgroup_stride))], i8)

    def load16(offset):
        return llvm.load(vec4, utils.getelementptr(base, [offset], i8), alignment=16)

    words = []
    for group in range(4):
        vec = load16(arith.addi(const(group * 2048), arith.muli(thread, const(16))))
        words += [llvm.extractelement(vec, const(j)) for j in range(4)]
    scale_rows, patterns = {}, {}

    def pattern(h, block):  # made at first use (short live ranges)
        if not with_scales:
            return const(0x7E807E80)  # 2^126: the exact e2m1 values
        if h not in scale_rows:
            row = arith.addi(row0, const(8 * h))
            scale_rows[h] = load16(arith.addi(const(CODE_BYTES), arith.muli(row, const(16))))
        if (h, block) not in patterns:
            word = llvm.extractelement(scale_rows[h], const(block // 4))
            code = arith.andi(arith.shrui(word, const(8 * (block % 4))), const(255))
            patterns[(h, block)] = arith.addi(arith.muli(code, const(0x00100010)),
                                              const(0x75807580))
        return patterns[(h, block)]

    out = np.empty(fa.WGMMA_LAYOUT.registers_shape((TILE_ROWS, TILE_K)), dtype=object)
    if out.shape != (1, 32, 1, 1, 2, 1, 1, 1, 1):
        raise NotImplementedError(f"wgmma layout registers {out.shape}")
    for i, word in enumerate(words):
        for k, (c_half, h) in enumerate(PAIR_SLOTS):
            asm = ("{\n.reg .b32 t, u, z;\n" + PAIR_ASM[k]
                   + "\nmov.b32 z, 0x80008000;\nfma.rn.bf16x2 $0, t, $2, z;\n}")
            decoded = llvm.inline_asm(i32, [word, pattern(h, i)], asm, "=r,r,r")
            out[0, 2 * i + c_half, 0, 0, h, 0, 0, 0, 0] = utils.bitcast(decoded, bf16x2)
    return fa.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT, _is_signed=None)


def _store_transposed(acc, dst_ref, per_warpgroup: bool = False) -> None:
    """Inline Mosaic GPU: acc [64, M] (any register layout) -> shared memory dst [M, 64]
    transposed, one 4-byte store per element (2 KiB at M = 8), so the kernel writes y, not
    y^T, and XLA keeps the residual stream row-major. per_warpgroup: dst is [warpgroups, M,
    64] and warpgroup w (thread index // 128) stores into dst[w]."""
    from jax._src.lib.mlir.dialects import memref
    lead = _warpgroup_index() if per_warpgroup else None
    acc.foreach(lambda value, index: memref.store(
        value, dst_ref, ([] if lead is None else [lead]) + [index[1], index[0]]))


def _warpgroup_index():
    """Inline Mosaic GPU: this thread's warpgroup (thread index // 128) as an index."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith
    from jax.experimental.mosaic.gpu import utils
    i32 = ir.IntegerType.get_signless(32)
    return arith.index_cast(ir.IndexType.get(),
                            arith.shrui(utils.thread_idx(), arith.constant(i32, 7)))


def _swizzled(cols: int):
    """SMEM transforms of a bf16 tile [rows, cols] read by wgmma: the largest swizzle (128, 64
    or 32 bytes) that divides its row bytes (cols a multiple of 16)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    swizzle = next(b for b in (128, 64, 32) if (cols * 2) % b == 0)
    return (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))



def mgpu_nvfp4_matmul(x: jax.Array, permuted: jax.Array, tensor_scale: jax.Array, *, n: int,
                      k: int, splits: int | None = None, lora_x_a: jax.Array | None = None,
                      lora_b: jax.Array | None = None, lora_scale=None,
                      lora_bt: jax.Array | None = None, stages: int | None = None,
                      l2_prefetch: L2Prefetch | None = None,
                      schedule: str = "auto") -> jax.Array:
    """y [M, n] float32 = x [M, k] @ W^T / tensor_scale (+ lora_scale * lora_x_a @ lora_b).

    x bf16 [M <= 64, k]; permuted: permute_packed's buffer of W [n, k]; tensor_scale [1];
    lora_x_a [M, r] (x @ A), with either lora_b [r, n] and lora_scale, or lora_bt, the
    LoRA operand lora_operand(lora_b, tensor_scale, lora_scale) made ahead; r in LORA_RANKS.
    splits: split-K programs per row tile (launch_splits); stages, schedule: matmul_unscaled's.
    GPU only (Mosaic GPU)."""
    if lora_x_a is not None and lora_bt is None:
        if lora_b is None or lora_b.shape != (lora_x_a.shape[-1], n):
            raise ValueError(f"mgpu_nvfp4_matmul: lora_x_a {lora_x_a.shape}, B "
                             f"{None if lora_b is None else lora_b.shape}; expected B "
                             f"[{lora_x_a.shape[-1]}, {n}] (or lora_bt)")
        lora_bt = lora_operand(lora_b, tensor_scale, 1.0 if lora_scale is None else lora_scale,
                               n_pad=padded_rows(permuted, k))
    y = matmul_unscaled(x, permuted, n=n, k=k, splits=splits, lora_x_a=lora_x_a,
                        lora_bt=lora_bt, stages=stages, l2_prefetch=l2_prefetch,
                        schedule=schedule)
    return y[:, :n] * (2.0 ** -SCALED_EXPONENT
                       / jnp.asarray(tensor_scale, jnp.float32).reshape(()))



def _issue_l2_prefetch(plan: L2Prefetch, buffer_gmem, extra_gmem, program,
                       programs: int) -> None:
    """Inside a kernel: program `program` of `programs` issues its share of the plan's
    prefetches (one TMA box each; the extra array's boxes by the first programs)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if plan.extra is not None:
        rows = plan.extra.shape[0]
        extra_box = min(256, rows)
        extra_boxes = -(-rows // extra_box)
        for j in range(-(-extra_boxes // programs)):
            q = program + j * programs

            @pl.when(q < extra_boxes)
            def _():
                start = jnp.minimum(q * extra_box, rows - extra_box)  # the last box: clamped
                plgpu.async_prefetch(extra_gmem.at[pl.ds(start, extra_box)])
    if plan.contiguous_lines:
        box = min(3 * TILE_LINES, plan.contiguous_lines)
        boxes = -(-plan.contiguous_lines // box)

        def line_of(q):
            return jnp.minimum(q * box, plan.contiguous_lines - box)
    else:
        box = plan.ahead * TILE_LINES
        boxes = plan.row_tiles * plan.splits

        def line_of(q):
            b, s = q // plan.splits, q % plan.splits
            return (b * plan.k_tiles + s * plan.k_tiles // plan.splits) * TILE_LINES
    for j in range(-(-boxes // programs)):
        q = program + j * programs

        @pl.when(q < boxes)
        def _():
            plgpu.async_prefetch(buffer_gmem.at[pl.ds(line_of(q), box)])


def _tile_product(tile_smem, x_smem, acc_ref, warpgroup_stride: int = 0) -> None:
    """Inside a kernel: acc [64, M] += the decoded weight tile [64, 256] @ x_tile^T (wgmma);
    warpgroup_stride as _decode_tile's (each warpgroup its own tile of tile_smem)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    w = plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(),),
        return_type=plgpu.ShapeDtypeStruct((TILE_ROWS, TILE_K), jnp.bfloat16,
                                           layout=plgpu.Layout.WGMMA),
    )(lambda ctx, tile_ref: _decode_tile(tile_ref, warpgroup_stride=warpgroup_stride))(
        tile_smem)
    plgpu.wgmma(acc_ref, w, x_smem.transpose((1, 0)))
    plgpu.wgmma_wait(0)


def _lora_product(acc_ref, bt_smem, lx_smem, barrier) -> None:
    """Inside a kernel: acc += the LoRA operand's tile [64, r] @ (x A)^T, once its copy is in."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    plgpu.barrier_wait(barrier)
    plgpu.wgmma(acc_ref, bt_smem, lx_smem.transpose((1, 0)))
    plgpu.wgmma_wait(0)


def _store_partial(acc_ref, out_smem, dst) -> None:
    """Inside a kernel: acc [64, M] stored transposed into dst [M, 64] of a partial (through
    shared memory, one TMA copy). Waiting for the shared-memory read only, or storing from the
    registers without a wait, was no faster (docs/decisions.md)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))(
        lambda ctx, acc, out: _store_transposed(acc, out))(acc_ref[...], out_smem)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, dst)
    plgpu.wait_smem_to_gmem(0)


class SwigluEpilogue(NamedTuple):
    """matmul_unscaled's fused SwiGLU epilogue over a gate/up pair interleaved in blocks of 32
    rows (each 64-row tile: gate block b, then up block b): gate_divisor / up_divisor [1] the
    halves' tensor scales; next_lora_a bf16 [row tiles * 32, r] (zero rows past out_n) or None."""
    gate_divisor: jax.Array
    up_divisor: jax.Array
    next_lora_a: jax.Array | None = None


def _swiglu_epilogue(out_smem, h_smem, gate_ts, up_ts, h_dst, a_src, part_dst,
                     per_warpgroup: bool = False) -> None:
    """Inline Mosaic GPU, after acc [64, M] is stored transposed in out_smem [M, 64] (float32
    sums of e2m1 * scale * 2^-8 products): h [M, 32] = bf16(silu(g) * u), g = bf16(out[:, :32] *
    2^8 / ts_g), u = bf16(out[:, 32:] * 2^8 / ts_u) (blockwise_matmul_swiglu's epilogue), into
    h_smem and h_dst (global); with a_src ([32, r], global: next_lora_a's rows of this tile),
    also part_dst [M, r] float32 = h @ a_src, this tile's share of the next LoRA x @ A. Thread t
    of the warpgroup computes elements t, t + 128, ... of each product (row-major).
    per_warpgroup: out_smem and h_smem hold one [M, 64] / [M, 32] tile per warpgroup (leading
    index), each warpgroup's epilogue reads and writes its own."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, memref
    from jax._src.lib.mlir.dialects import math as mlir_math
    from jax.experimental.mosaic.gpu import utils

    f32, bf16, index = ir.F32Type.get(), ir.BF16Type.get(), ir.IndexType.get()
    i32 = ir.IntegerType.get_signless(32)

    def at(v):
        return arith.constant(index, v)

    tid = arith.index_cast(index, arith.andi(utils.thread_idx(), arith.constant(i32, 127)))
    m_pad = ir.MemRefType(out_smem.type).shape[-2]
    lead = [_warpgroup_index()] if per_warpgroup else []
    utils.warpgroup_barrier()  # every thread's transposed store is in
    one, full = arith.constant(f32, 1.0), arith.constant(f32, 2.0 ** -SCALED_EXPONENT)
    scale_g = arith.divf(full, memref.load(gate_ts, [at(0)]))
    scale_u = arith.divf(full, memref.load(up_ts, [at(0)]))

    def rounded(value):
        return arith.extf(f32, arith.truncf(bf16, value))

    for e in range(m_pad * 32 // 128):
        i = arith.addi(tid, at(128 * e))
        row, col = arith.divui(i, at(32)), arith.remui(i, at(32))
        gate = rounded(arith.mulf(memref.load(out_smem, lead + [row, col]), scale_g))
        up = rounded(arith.mulf(memref.load(out_smem, lead + [row, arith.addi(col, at(32))]),
                                scale_u))
        silu = arith.divf(gate, arith.addf(one, mlir_math.exp(arith.negf(gate))))
        h = arith.truncf(bf16, arith.mulf(silu, up))
        memref.store(h, h_smem, lead + [row, col])
        memref.store(h, h_dst, [row, col])
    if a_src is None:
        return
    rank = ir.MemRefType(a_src.type).shape[1]
    utils.warpgroup_barrier()  # all of h is in shared memory
    for e in range(m_pad * rank // 128):
        i = arith.addi(tid, at(128 * e))
        row, col = arith.divui(i, at(rank)), arith.remui(i, at(rank))
        total = arith.constant(f32, 0.0)
        for j in range(32):
            h = arith.extf(f32, memref.load(h_smem, lead + [row, at(j)]))
            a = arith.extf(f32, memref.load(a_src, [at(j), col]))
            total = arith.addf(total, arith.mulf(h, a))
        memref.store(total, part_dst, [row, col])


class _KernelRefs(NamedTuple):
    """The refs a kernel body gets after x and the permuted buffer, in launch order (None
    where its configuration has none): the L2 prefetch's buffer and extra array; the LoRA
    operands (x @ A, the operand); the SwiGLU epilogue's divisors, next LoRA A, h and shares,
    else the partials; the scratch: the transposed store, the LoRA tiles and their barrier, h."""
    prefetch: object = None
    extra: object = None
    lora_x: object = None
    lora_bt: object = None
    gate_ts: object = None
    up_ts: object = None
    next_a: object = None
    h: object = None
    share: object = None
    part: object = None
    out_smem: object = None
    lx_smem: object = None
    bt_smem: object = None
    barrier: object = None
    h_smem: object = None

    @classmethod
    def unpack(cls, refs, *, plan, with_lora: bool, swiglu: bool, next_rank):
        refs, got = list(refs), {}

        def take(*names):
            for name in names:
                got[name] = refs.pop(0)
        if plan is not None:
            take("prefetch", *(("extra",) if plan.extra is not None else ()))
        if with_lora:
            take("lora_x", "lora_bt")
        if swiglu:
            take("gate_ts", "up_ts", *(("next_a",) if next_rank is not None else ()), "h",
                 *(("share",) if next_rank is not None else ()))
        else:
            take("part")
        take("out_smem")
        if with_lora:
            take("lx_smem", "bt_smem", "barrier")
        if swiglu:
            take("h_smem")
        if refs:
            raise ValueError(f"mgpu_nvfp4: {len(refs)} kernel refs left over")
        return cls(**got)


def _out_type(*, m_pad: int, row_tiles: int, splits: int, swiglu: bool, next_rank):
    """A kernel's outputs: the split partials [splits, m_pad, N_pad] float32, or for the SwiGLU
    epilogue h [m_pad, N_pad / 2] bf16 (and the next LoRA's shares [row tiles, m_pad, r])."""
    n_pad = row_tiles * TILE_ROWS
    if not swiglu:
        return jax.ShapeDtypeStruct((splits, m_pad, n_pad), jnp.float32)
    out_type = [jax.ShapeDtypeStruct((m_pad, n_pad // 2), jnp.bfloat16)]
    if next_rank is not None:
        out_type.append(jax.ShapeDtypeStruct((row_tiles, m_pad, next_rank), jnp.float32))
    return tuple(out_type)


def _run_swiglu_epilogue(r: _KernelRefs, tile, per_warpgroup: bool = False) -> None:
    """Inside a kernel, after the transposed store: _swiglu_epilogue of row tile `tile` (its
    32 output columns of h, its share of the next LoRA product)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    half = pl.ds(tile * (TILE_ROWS // 2), TILE_ROWS // 2)
    refs_in = [r.out_smem, r.h_smem, r.gate_ts, r.up_ts, r.h.at[:, half]]
    if r.next_a is not None:
        refs_in += [r.next_a.at[half], r.share.at[tile]]
    plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * len(refs_in))(
        lambda ctx, *refs: _swiglu_epilogue(*refs[:5], *(refs[5:] if len(refs) > 5
                                                         else (None, None)),
                                            per_warpgroup=per_warpgroup))(*refs_in)


def _launch(body, out_type, grid, grid_names, m_pad, rank, swiglu: bool = False):
    """plgpu.kernel of a schedule's body: outputs `out_type`, shared memory for the transposed
    store, (with a LoRA operand of width rank) the LoRA operands' tiles and their barrier,
    (swiglu) h [m_pad, 32]."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    scratch = [plgpu.SMEM((m_pad, TILE_ROWS), jnp.float32)]
    if rank is not None:
        scratch += [plgpu.SMEM((m_pad, rank), jnp.bfloat16, transforms=_swizzled(rank)),
                    plgpu.SMEM((TILE_ROWS, rank), jnp.bfloat16, transforms=_swizzled(rank)),
                    plgpu.Barrier(num_arrivals=2)]
    if swiglu:
        scratch.append(plgpu.SMEM((m_pad, TILE_ROWS // 2), jnp.bfloat16))
    return plgpu.kernel(
        body, out_type=out_type, grid=grid,
        grid_names=grid_names, scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup))


def matmul_unscaled(x: jax.Array, permuted: jax.Array, *, n: int, k: int,
                    splits: int | None = None, lora_x_a: jax.Array | None = None,
                    lora_bt: jax.Array | None = None, stages: int | None = None,
                    l2_prefetch: L2Prefetch | None = None,
                    swiglu: SwigluEpilogue | None = None, schedule: str = "auto"):
    """The kernel: [M, N_pad] float32 sums x @ (e2m1 * block scale * 2^-8)^T
    (+ lora_x_a @ lora_bt^T), i.e. y * tensor_scale * 2^-8 (partials summed by elementwise
    adds that XLA fuses into the consumer). Arguments as mgpu_nvfp4_matmul's; rows of the
    permuted buffer past n are whatever it holds (zeros for permute_packed's padding). Grid
    (row tiles, splits): the split-K schedule of the module docstring. l2_prefetch: another
    launch's first tiles, prefetched into L2 by each program after its K loop.
    swiglu (one split only): instead (h bf16 [M, N_pad / 2], the SwiGLU of a gate/up pair in
    blocks of 32 rows, and with swiglu.next_lora_a the float32 [row tiles, M, r] shares of
    h @ next_lora_a, or None) from the fused epilogue (_swiglu_epilogue).
    schedule (launch_schedule): "split_k" (_split_k_kernel), "warp_specialized"
    (_warp_specialized_kernel) or "auto" (by M); stages: pipeline depth (None: 2 for split-K,
    ws_stages for warp-specialized)."""
    m = x.shape[0]
    k_tiles = -(-k // TILE_K)
    row_tiles = permuted.shape[0] // (TILE_LINES * k_tiles)
    n_pad = row_tiles * TILE_ROWS
    if x.ndim != 2 or x.shape[1] != k or not 1 <= m <= MAX_M:
        raise ValueError(f"mgpu_nvfp4_matmul: x {x.shape}; expected [M <= {MAX_M}, {k}]")
    if permuted.shape != (row_tiles * k_tiles * TILE_LINES, 128) or n_pad < n:
        raise ValueError(f"mgpu_nvfp4_matmul: permuted {permuted.shape} is not a [{n}, {k}] "
                         "weight's permuted layout")
    with_lora = lora_x_a is not None
    if with_lora:
        rank = lora_x_a.shape[1]
        if (lora_x_a.shape != (m, rank) or not operand_rank_ok(rank) or lora_bt is None
                or lora_bt.shape != (n_pad, rank)):
            raise ValueError(f"mgpu_nvfp4_matmul: lora_x_a {lora_x_a.shape}, operand "
                             f"{None if lora_bt is None else lora_bt.shape}; expected [{m}, r] "
                             f"and [{n_pad}, r], r a multiple of 16 up to {MAX_OPERAND_RANK}")
    rank = lora_x_a.shape[1] if with_lora else None
    schedule = launch_schedule(m, row_tiles, schedule, rank)
    warp_specialized = schedule == "warp_specialized"
    if stages is None:
        stages = ws_stages(m, rank, swiglu is not None) if warp_specialized else 2
    splits = (launch_splits(row_tiles, k_tiles, m=m, schedule=schedule, stages=stages,
                            rank=rank) if splits is None else splits)
    if not 1 <= splits <= k_tiles:
        raise ValueError(f"mgpu_nvfp4_matmul: splits={splits} for {k_tiles} K tiles")
    m_pad = -(-m // 8) * 8
    next_a = None if swiglu is None else swiglu.next_lora_a
    if swiglu is not None:
        if splits != 1:
            raise ValueError(f"mgpu_nvfp4_matmul: the SwiGLU epilogue needs one split, not "
                             f"{splits}")
        if next_a is not None and (next_a.ndim != 2 or next_a.shape[0] != row_tiles * 32
                                   or next_a.shape[1] % 16 or next_a.shape[1] > 256):
            raise ValueError(f"mgpu_nvfp4_matmul: next_lora_a {next_a.shape}; expected "
                             f"[{row_tiles * 32}, r], r a multiple of 16 up to 256")
    # K padded to whole tiles: no copy of x at all for M % 8 == 0 and K % 256 == 0 (the model's
    # shapes). With uneven splits a program with one tile fewer than `steps` reloads its last
    # tiles in its last step and skips that step's product.
    x_pad, lora_x = _padded_inputs(x, lora_x_a, m_pad, k_tiles * TILE_K)
    inputs = [x_pad, permuted]
    plan = None  # the prefetch plan's static part (arrays as shapes): part of the kernel's key
    if l2_prefetch is not None:  # the body takes it right after the permuted buffer
        if l2_prefetch.buffer.ndim != 2 or l2_prefetch.buffer.shape[1] != 128:
            raise ValueError(f"mgpu_nvfp4_matmul: l2_prefetch buffer {l2_prefetch.buffer.shape}"
                             " is not a permuted buffer [lines, 128]")
        inputs.append(l2_prefetch.buffer)
        extra = l2_prefetch.extra
        if extra is not None:
            inputs.append(extra)
            extra = jax.ShapeDtypeStruct(extra.shape, extra.dtype)
        plan = l2_prefetch._replace(buffer=None, extra=extra)
    inputs += [lora_x, lora_bt.astype(jnp.bfloat16)] if with_lora else []
    if swiglu is not None:
        inputs += [jnp.asarray(swiglu.gate_divisor, jnp.float32).reshape(1),
                   jnp.asarray(swiglu.up_divisor, jnp.float32).reshape(1)]
        inputs += [] if next_a is None else [next_a.astype(jnp.bfloat16)]
    kernel = (_warp_specialized_kernel if warp_specialized else _split_k_kernel)(
        m_pad=m_pad, k_tiles=k_tiles, row_tiles=row_tiles, splits=splits, stages=stages,
        rank=lora_bt.shape[1] if with_lora else None, plan=plan, swiglu=swiglu is not None,
        next_rank=None if next_a is None else next_a.shape[1])
    outputs = kernel(*inputs)
    if swiglu is not None:
        h = outputs[0][:m]
        return h, (outputs[1][:, :m] if next_a is not None else None)
    partials = outputs
    return functools.reduce(jnp.add, [partials[i, :m] for i in range(splits)])  # fusable


@functools.lru_cache(maxsize=None)
def _split_k_kernel(*, m_pad: int, k_tiles: int, row_tiles: int, splits: int, stages: int,
                    rank: int | None, plan: L2Prefetch | None, swiglu: bool,
                    next_rank: int | None):
    """matmul_unscaled's kernel for one static configuration, as one jitted function (cached):
    every launch of it in a program (a model's layers) calls the same function, so JAX lowers
    the Mosaic GPU kernel once per program, not once per launch (32 launches lowered
    in 0.17 s instead of 4.5 s, on a CPU). rank: the LoRA operand's width (None: no LoRA); plan: the
    L2 prefetch's static part (buffer None, extra as a shape) or None; swiglu / next_rank: the
    fused SwiGLU epilogue and its next-LoRA width."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    steps = -(-k_tiles // splits)
    uneven = k_tiles % splits != 0
    with_lora = rank is not None

    def body(x_gmem, packed_gmem, *refs):
        r = _KernelRefs.unpack(refs, plan=plan, with_lora=with_lora, swiglu=swiglu,
                               next_rank=next_rank)
        b = lax.axis_index("tiles")
        s = lax.axis_index("splits")
        first = s * k_tiles // splits
        last = (s + 1) * k_tiles // splits  # exclusive
        rows = pl.ds(b * TILE_ROWS, TILE_ROWS)
        if with_lora:  # split 0's LoRA operands, in flight while the pipeline runs
            @pl.when(s == 0)
            def _():
                plgpu.copy_gmem_to_smem(r.lora_x, r.lx_smem, r.barrier)
                plgpu.copy_gmem_to_smem(r.lora_bt.at[rows], r.bt_smem, r.barrier)

        def step(indices, tile_smem, x_smem, acc_ref):
            if uneven:
                pl.when(first + indices[0] < last)(
                    lambda: _tile_product(tile_smem, x_smem, acc_ref))
            else:
                _tile_product(tile_smem, x_smem, acc_ref)
            return acc_ref

        def scope(acc_ref):
            plgpu.emit_pipeline(
                step, grid=(steps,),
                in_specs=[
                    plgpu.BlockSpec((TILE_LINES, 128),
                                    lambda j: (b * k_tiles + jnp.minimum(first + j, last - 1),
                                               0)),
                    plgpu.BlockSpec((m_pad, TILE_K),
                                    lambda j: (0, jnp.minimum(first + j, last - 1)),
                                    transforms=_swizzled(TILE_K))],
                max_concurrent_steps=stages, init_carry=acc_ref)(packed_gmem, x_gmem)
            if plan is not None:
                _issue_l2_prefetch(plan, r.prefetch, r.extra, b * splits + s,
                                   row_tiles * splits)
            if with_lora:
                pl.when(s == 0)(lambda: _lora_product(acc_ref, r.bt_smem, r.lx_smem,
                                                      r.barrier))
            if not swiglu:
                _store_partial(acc_ref, r.out_smem, r.part.at[s, :, rows])
                return
            plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))(
                lambda ctx, acc, out: _store_transposed(acc, out))(acc_ref[...], r.out_smem)
            _run_swiglu_epilogue(r, b)

        pl.run_scoped(scope, plgpu.ACC((TILE_ROWS, m_pad), jnp.float32))

    out_type = _out_type(m_pad=m_pad, row_tiles=row_tiles, splits=splits, swiglu=swiglu,
                         next_rank=next_rank)
    return jax.jit(_launch(body, out_type, (row_tiles, splits), ("tiles", "splits"), m_pad,
                           rank, swiglu=swiglu))


@functools.lru_cache(maxsize=None)
def _warp_specialized_kernel(*, m_pad: int, k_tiles: int, row_tiles: int, splits: int,
                             stages: int, rank: int | None, plan: L2Prefetch | None,
                             swiglu: bool, next_rank: int | None):
    """matmul_unscaled's warp-specialized kernel for one static configuration (cached, as
    _split_k_kernel's): grid (row tiles / 2, splits), one program per SM, three warpgroups.
    Warpgroups 0 and 1 each decode one row tile (2c and 2c + 1) and multiply it by the x tile
    they share; warpgroup 2 only issues the TMA copies of both weight tiles and the x tile,
    `stages` steps ahead (plgpu.emit_pipeline_warp_specialized), so a copy waits only for a free
    pipeline slot, not for the decode. At M = 64 each x tile (32 KiB) is read once per two
    weight tiles (9 KiB each) instead of once per tile. Same results as the split-K kernel
    with the same splits: each row tile's products are summed in the same order. The LoRA
    operands (split 0), the L2 prefetch and the SwiGLU epilogue are the split-K kernel's, per
    warpgroup."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    wgs = WS_COMPUTE_WARPGROUPS
    steps = -(-k_tiles // splits)
    uneven = k_tiles % splits != 0
    with_lora = rank is not None
    programs = row_tiles // wgs * splits

    def body(x_gmem, packed_gmem, *refs):
        r = _KernelRefs.unpack(refs, plan=plan, with_lora=with_lora, swiglu=swiglu,
                               next_rank=next_rank)
        c = lax.axis_index("tiles")
        s = lax.axis_index("splits")
        first = s * k_tiles // splits
        last = (s + 1) * k_tiles // splits  # exclusive

        def step(indices, w_smem, x_smem, acc_ref):
            def product():
                _tile_product(w_smem, x_smem, acc_ref,
                              warpgroup_stride=TILE_LINES * 128)
            if uneven:
                pl.when(first + indices[0] < last)(product)
            else:
                product()
            return acc_ref

        def compute_context(run_pipeline):
            wg = lax.axis_index("wg")
            tile = c * wgs + wg
            if with_lora:  # split 0's LoRA operands, in flight while the pipeline runs
                @pl.when(jnp.logical_and(s == 0, wg == 0))
                def _():
                    plgpu.copy_gmem_to_smem(r.lora_x, r.lx_smem, r.barrier)
                    plgpu.copy_gmem_to_smem(
                        r.lora_bt.at[pl.ds(c * wgs * TILE_ROWS, wgs * TILE_ROWS)],
                        r.bt_smem, r.barrier)

            def scoped(acc_ref):
                run_pipeline(acc_ref)
                if plan is not None:
                    _issue_l2_prefetch(plan, r.prefetch, r.extra,
                                       (c * splits + s) * wgs + wg, programs * wgs)
                if with_lora:
                    pl.when(s == 0)(lambda: _lora_product(
                        acc_ref, r.bt_smem.at[pl.ds(wg * TILE_ROWS, TILE_ROWS)], r.lx_smem,
                        r.barrier))
                plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))(
                    lambda ctx, acc, out: _store_transposed(acc, out, per_warpgroup=True))(
                        acc_ref[...], r.out_smem)
                if not swiglu:
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(r.out_smem.at[wg], r.part.at[
                        s, :, pl.ds(tile * TILE_ROWS, TILE_ROWS)])
                    plgpu.wait_smem_to_gmem(0)
                    return
                _run_swiglu_epilogue(r, tile, per_warpgroup=True)

            pl.run_scoped(scoped, plgpu.ACC((TILE_ROWS, m_pad), jnp.float32))

        pipeline = plgpu.emit_pipeline_warp_specialized(
            step, grid=(steps,), memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((wgs, TILE_LINES, 128),
                                lambda j: (c, jnp.minimum(first + j, last - 1), 0)),
                plgpu.BlockSpec((m_pad, TILE_K),
                                lambda j: (0, jnp.minimum(first + j, last - 1)),
                                transforms=_swizzled(TILE_K))],
            wg_axis="wg", num_compute_wgs=wgs, max_concurrent_steps=stages,
            compute_context=compute_context)
        pipeline(packed_gmem, x_gmem)

    out_type = _out_type(m_pad=m_pad, row_tiles=row_tiles, splits=splits, swiglu=swiglu,
                         next_rank=next_rank)
    scratch = [plgpu.SMEM((wgs, m_pad, TILE_ROWS), jnp.float32)]
    if with_lora:
        scratch += [plgpu.SMEM((m_pad, rank), jnp.bfloat16, transforms=_swizzled(rank)),
                    plgpu.SMEM((wgs * TILE_ROWS, rank), jnp.bfloat16,
                               transforms=_swizzled(rank)),
                    plgpu.Barrier(num_arrivals=2)]
    if swiglu:
        scratch.append(plgpu.SMEM((wgs, m_pad, TILE_ROWS // 2), jnp.bfloat16))
    kernel = plgpu.kernel(
        body, out_type=out_type, grid=(row_tiles // wgs, splits),
        grid_names=("tiles", "splits"), scratch_types=scratch,
        num_threads=wgs + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup))

    def launch(x, permuted, *rest):  # the weight tiles of a row pair: one 3-D TMA box
        return kernel(x, permuted.reshape(row_tiles, k_tiles * TILE_LINES, 128), *rest)
    return jax.jit(launch)


def _padded_inputs(x, lora_x_a, m_pad, k_pad):
    """x (and lora_x_a) in bf16, zero-padded to m_pad rows and k_pad columns where needed (no
    copy at the model's shapes)."""
    m, k = x.shape
    x_pad = x.astype(jnp.bfloat16)
    if (m_pad, k_pad) != (m, k):
        x_pad = jnp.pad(x_pad, ((0, m_pad - m), (0, k_pad - k)))
    if lora_x_a is None:
        return x_pad, None
    lora_x = lora_x_a.astype(jnp.bfloat16)
    if m_pad != m:
        lora_x = jnp.pad(lora_x, ((0, m_pad - m), (0, 0)))
    return x_pad, lora_x



def mgpu_nvfp4_swiglu(x: jax.Array, permuted_pair: jax.Array, gate_tensor_scale: jax.Array,
                      up_tensor_scale: jax.Array, *, out_n: int, k: int, half_block: int,
                      lora_x_a: jax.Array | None = None, lora_bt: jax.Array | None = None,
                      next_lora_a: jax.Array | None = None, splits: int | None = None,
                      l2_prefetch: L2Prefetch | None = None, fused: bool = True,
                      schedule: str = "auto"):
    """silu(g) * u bf16 [M, out_n] for a gate/up pair (rows interleaved in blocks of
    half_block, permute_packed of the whole pair) with g = x @ Wg^T / ts_g (+ LoRA), u likewise,
    each rounded to bf16 before the SwiGLU (as blockwise_matmul_swiglu's epilogue). lora_bt:
    pair_lora_operand's, with lora_x_a = x @ [A_gate | A_up]. next_lora_a [out_n, r]: then
    also returns the float32 product of the bf16 output with it, as blockwise_matmul_swiglu's
    next_lora_a. With `fused` (and blocks of 32 rows, one split, r a multiple of 16) the
    kernel's epilogue computes the SwiGLU and each row tile's share of that product
    (SwigluEpilogue; XLA sums the shares); else the kernel gives the pair's product and XLA
    the rest. schedule: matmul_unscaled's."""
    m = x.shape[0]
    n_pad2 = padded_rows(permuted_pair, k)
    if n_pad2 % (2 * half_block) or out_n > n_pad2 // 2:
        raise ValueError(f"mgpu_nvfp4_swiglu: a pair of {n_pad2} rows does not hold two "
                         f"[{out_n}, {k}] halves in blocks of {half_block}")
    row_tiles = n_pad2 // TILE_ROWS
    resolved = (launch_splits(row_tiles, -(-k // TILE_K), m=m, schedule=schedule,
                              rank=None if lora_x_a is None else lora_x_a.shape[1])
                if splits is None else splits)
    if (fused and half_block == TILE_ROWS // 2 and resolved == 1
            and (next_lora_a is None or next_lora_a.shape[1] % 16 == 0)):
        next_a = next_lora_a  # matmul_unscaled takes it in bf16
        if next_a is not None and next_a.shape[0] != n_pad2 // 2:
            next_a = jnp.pad(next_a, ((0, n_pad2 // 2 - next_a.shape[0]), (0, 0)))
        h, shares = matmul_unscaled(
            x, permuted_pair, n=n_pad2, k=k, splits=1, lora_x_a=lora_x_a, lora_bt=lora_bt,
            l2_prefetch=l2_prefetch, schedule=schedule,
            swiglu=SwigluEpilogue(gate_tensor_scale, up_tensor_scale, next_a))
        out = h[:, :out_n]
        return out if next_lora_a is None else (out, shares.sum(axis=0))
    y = matmul_unscaled(x, permuted_pair, n=n_pad2, k=k, splits=splits, lora_x_a=lora_x_a,
                        lora_bt=lora_bt, l2_prefetch=l2_prefetch, schedule=schedule)
    y = y.reshape(m, n_pad2 // (2 * half_block), 2, half_block)
    halves = []
    for half, ts in enumerate((gate_tensor_scale, up_tensor_scale)):
        scale = 2.0 ** -SCALED_EXPONENT / jnp.asarray(ts, jnp.float32).reshape(())
        value = y[:, :, half].reshape(m, -1)[:, :out_n] * scale
        halves.append(value.astype(jnp.bfloat16).astype(jnp.float32))
    gate, up = halves
    out = (gate / (1.0 + jnp.exp(-gate)) * up).astype(jnp.bfloat16)
    if next_lora_a is None:
        return out
    return out, jnp.dot(out, next_lora_a.astype(jnp.bfloat16),
                        preferred_element_type=jnp.float32)


@functools.lru_cache(maxsize=None)
def available() -> str | None:
    """None if Mosaic GPU kernels can run here, else why not."""
    try:
        from jax.experimental.pallas import mosaic_gpu  # noqa: F401
        from jax.experimental.mosaic.gpu import fragmented_array  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the jaxlib build
        return f"Mosaic GPU is not importable: {e}"
    if jax.default_backend() != "gpu":
        return f"backend {jax.default_backend()} (Mosaic GPU kernels run on NVIDIA GPUs)"
    capability = str(getattr(jax.devices()[0], "compute_capability", ""))
    if not capability.startswith("9."):
        return (f"compute capability {capability or 'unknown'} (the kernel's wgmma and TMA "
                "pipeline are Hopper's, sm_90)")
    return None
