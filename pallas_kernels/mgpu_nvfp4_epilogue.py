"""What a program of the Mosaic GPU NVFP4 kernel (pallas_kernels/mgpu_nvfp4.py) does after its K
loop: the transposed store of the accumulator (so the kernel writes y [M, N], not y^T), the
fused SwiGLU of a gate/up pair with its share of the next LoRA x @ A (inline Mosaic GPU), and
its share of another launch's L2 prefetch."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.mgpu_nvfp4_layout import SCALED_EXPONENT, TILE_LINES


def store_transposed(acc, dst_ref, per_warpgroup: bool = False) -> None:
    """Inline Mosaic GPU: acc [64, M] (any register layout) -> shared memory dst [M, 64]
    transposed, one 4-byte store per element (2 KiB at M = 8), so the kernel writes y, not
    y^T, and XLA keeps the residual stream row-major. per_warpgroup: dst is [warpgroups, M,
    64] and warpgroup w (thread index // 128) stores into dst[w]."""
    from jax._src.lib.mlir.dialects import memref
    lead = warpgroup_index() if per_warpgroup else None
    acc.foreach(lambda value, index: memref.store(
        value, dst_ref, ([] if lead is None else [lead]) + [index[1], index[0]]))


def warpgroup_index():
    """Inline Mosaic GPU: this thread's warpgroup (thread index // 128) as an index."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith
    from jax.experimental.mosaic.gpu import utils
    i32 = ir.IntegerType.get_signless(32)
    return arith.index_cast(ir.IndexType.get(),
                            arith.shrui(utils.thread_idx(), arith.constant(i32, 7)))


def swiglu_epilogue(out_smem, h_smem, gate_ts, up_ts, h_dst, a_src, part_dst,
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
    lead = [warpgroup_index()] if per_warpgroup else []
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


def store_partial(acc_ref, out_smem, dst) -> None:
    """Inside a kernel: acc [64, M] stored transposed into dst [M, 64] of a partial (through
    shared memory, one TMA copy). Waiting for the shared-memory read only, or storing from the
    registers without a wait, was no faster (docs/decisions.md)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))(
        lambda ctx, acc, out: store_transposed(acc, out))(acc_ref[...], out_smem)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, dst)
    plgpu.wait_smem_to_gmem(0)


def issue_l2_prefetch(plan, buffer_gmem, extra_gmem, program, programs: int) -> None:
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
