"""NVFP4 decode matmul for Hopper, a Pallas Mosaic GPU kernel (TMA pipeline, E2M1 decode in
registers, wgmma) for small-M launches: y [M <= 64, N] = x [M, K] @ W^T / tensor_scale
(+ LoRA), W [N, K] NVFP4 in the permuted layout of mgpu_nvfp4_layout (decode:
mgpu_nvfp4_decode; schedules, split counts and device facts: mgpu_nvfp4_tuning).

Grid (row tiles, splits): program (b, s) runs K tiles [s K_t / splits, (s + 1) K_t / splits)
(a program with one tile fewer skips its surplus last step), accumulates acc [64, M] +=
W_tile [64, 256] @ x_tile^T and stores acc transposed as split s's partial of y [M, N], which
XLA sums by elementwise adds fused into y's consumer. Split 0 also adds the LoRA operand's
[64, r] tile times (x @ A)^T. The warp-specialized schedule runs two row tiles per program (two
compute warpgroups sharing each x tile, a third issuing the TMA copies), same splits, same bits.
After its K loop a program may prefetch another launch's first tiles into L2 (L2Prefetch). GPU
only: Mosaic GPU's interpret mode has no TMA rules, so the CPU tests check the layout, the bit
math and the lowering, and tests/pallas_kernels/test_mgpu_nvfp4_gpu.py the numbers.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.mgpu_nvfp4_decode import decode_tile
from pallas_kernels.mgpu_nvfp4_epilogue import (issue_l2_prefetch, store_partial,
                                                store_transposed, swiglu_epilogue)
from pallas_kernels.mgpu_nvfp4_layout import (SCALED_EXPONENT, TILE_K, TILE_LINES, TILE_ROWS,
                                              check_launch, lora_operand, padded_inputs,
                                              padded_rows, permuted_dequantize_reference)
from pallas_kernels.mgpu_nvfp4_tuning import (WS_COMPUTE_WARPGROUPS, L2Prefetch, TuningConfig,
                                              launch_schedule, launch_splits, ws_stages)

__all__ = ["SwigluEpilogue", "TuningConfig", "available", "matmul_unscaled",
           "matmul_unscaled_reference", "mgpu_nvfp4_matmul", "mgpu_nvfp4_matmul_reference",
           "mgpu_nvfp4_swiglu", "mgpu_nvfp4_swiglu_reference"]


class SwigluEpilogue(NamedTuple):
    """matmul_unscaled's fused SwiGLU epilogue over a gate/up pair interleaved in blocks of 32
    rows (each 64-row tile: gate block b, then up block b): gate_divisor / up_divisor [1] the
    halves' tensor scales; next_lora_a bf16 [row tiles * 32, r] (zero rows past out_n) or None."""
    gate_divisor: jax.Array
    up_divisor: jax.Array
    next_lora_a: jax.Array | None = None


class _KernelRefs(NamedTuple):
    """A kernel body's refs by name (None where its configuration has none), in launch order:
    inputs, outputs, scratch. M_pad = M rounded up to 8, N_pad = row tiles * 64, W = the
    program's compute warpgroups (warp-specialized: 2, leading axis; split-K: none)."""
    x: object = None  # bf16 [M_pad, K_tiles * 256] (GMEM)
    packed: object = None  # uint8 permuted buffer [row tiles * K_tiles * 72, 128] (GMEM)
    prefetch: object = None  # uint8 [lines, 128]: the L2 prefetch plan's buffer (GMEM)
    extra: object = None  # [rows, <= 256 cols]: the plan's extra array (GMEM)
    lora_x: object = None  # bf16 [M_pad, r]: x @ A (GMEM)
    lora_bt: object = None  # bf16 [N_pad, r]: the LoRA operand (GMEM)
    gate_ts: object = None  # f32 [1]: the gate half's tensor scale (GMEM)
    up_ts: object = None  # f32 [1]: the up half's tensor scale (GMEM)
    next_a: object = None  # bf16 [N_pad / 2, r']: the next LoRA A (GMEM)
    part: object = None  # f32 [splits, M_pad, N_pad]: the split partials (GMEM out)
    h: object = None  # bf16 [M_pad, N_pad / 2]: silu(gate) * up (GMEM out)
    share: object = None  # f32 [row tiles, M_pad, r']: each tile's h @ next_a (GMEM out)
    out_smem: object = None  # f32 [(W,) M_pad, 64]: the transposed accumulator (SMEM)
    lx_smem: object = None  # bf16 [M_pad, r]: x @ A (SMEM, swizzled)
    bt_smem: object = None  # bf16 [W * 64, r]: the operand's rows of the tiles (SMEM, swizzled)
    barrier: object = None  # the two LoRA copies' barrier
    h_smem: object = None  # bf16 [(W,) M_pad, 32]: h of the tile (SMEM)

    @classmethod
    def named(cls, names, refs) -> _KernelRefs:
        if len(names) != len(refs):
            raise ValueError(f"mgpu_nvfp4: {len(refs)} kernel refs for {len(names)} names")
        return cls(**dict(zip(names, refs)))


def _swizzled(cols: int):
    """SMEM transforms of a bf16 tile [rows, cols] read by wgmma: the largest swizzle (128, 64
    or 32 bytes) that divides its row bytes (cols a multiple of 16)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    swizzle = next(b for b in (128, 64, 32) if (cols * 2) % b == 0)
    return (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))


def _tile_product(tile_smem, x_smem, acc_ref, warpgroup_stride: int = 0) -> None:
    """Inside a kernel: acc [64, M] += the decoded weight tile [64, 256] @ x_tile^T (wgmma);
    warpgroup_stride as decode_tile's (each warpgroup its own tile of tile_smem)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    w = plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(),),
        return_type=plgpu.ShapeDtypeStruct((TILE_ROWS, TILE_K), jnp.bfloat16,
                                           layout=plgpu.Layout.WGMMA),
    )(lambda ctx, tile_ref: decode_tile(tile_ref, warpgroup_stride=warpgroup_stride))(
        tile_smem)
    plgpu.wgmma(acc_ref, w, x_smem.transpose((1, 0)))
    plgpu.wgmma_wait(0)


def _lora_product(acc_ref, bt_smem, lx_smem, barrier) -> None:
    """Inside a kernel: acc += the LoRA operand's tile [64, r] @ (x A)^T, once its copy is in."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    plgpu.barrier_wait(barrier)
    plgpu.wgmma(acc_ref, bt_smem, lx_smem.transpose((1, 0)))
    plgpu.wgmma_wait(0)


def _run_swiglu_epilogue(r: _KernelRefs, tile, per_warpgroup: bool = False) -> None:
    """Inside a kernel, after the transposed store: swiglu_epilogue of row tile `tile` (its
    32 output columns of h, its share of the next LoRA product)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    half = pl.ds(tile * (TILE_ROWS // 2), TILE_ROWS // 2)
    refs_in = [r.out_smem, r.h_smem, r.gate_ts, r.up_ts, r.h.at[:, half]]
    if r.next_a is not None:
        refs_in += [r.next_a.at[half], r.share.at[tile]]
    plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * len(refs_in))(
        lambda ctx, *refs: swiglu_epilogue(*refs[:5], *(refs[5:] if len(refs) > 5
                                                        else (None, None)),
                                           per_warpgroup=per_warpgroup))(*refs_in)


def _out_types(*, m_pad: int, row_tiles: int, splits: int, swiglu: bool, next_rank) -> dict:
    """A kernel's outputs by name: the split partials [splits, m_pad, N_pad] float32, or for
    the SwiGLU epilogue h [m_pad, N_pad / 2] bf16 (and the next LoRA's shares [row tiles,
    m_pad, r])."""
    n_pad = row_tiles * TILE_ROWS
    if not swiglu:
        return {"part": jax.ShapeDtypeStruct((splits, m_pad, n_pad), jnp.float32)}
    out = {"h": jax.ShapeDtypeStruct((m_pad, n_pad // 2), jnp.bfloat16)}
    if next_rank is not None:
        out["share"] = jax.ShapeDtypeStruct((row_tiles, m_pad, next_rank), jnp.float32)
    return out


def _scratch_types(*, m_pad: int, rank, swiglu: bool, wgs: int | None = None) -> dict:
    """A kernel's shared memory by name: the transposed store, (with a LoRA operand of width
    rank) the LoRA operands' tiles and their barrier, (swiglu) h; wgs: one of each per compute
    warpgroup (warp-specialized), None: one program's (split-K)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    lead = () if wgs is None else (wgs,)
    scratch = {"out_smem": plgpu.SMEM((*lead, m_pad, TILE_ROWS), jnp.float32)}
    if rank is not None:
        scratch["lx_smem"] = plgpu.SMEM((m_pad, rank), jnp.bfloat16, transforms=_swizzled(rank))
        scratch["bt_smem"] = plgpu.SMEM(((wgs or 1) * TILE_ROWS, rank), jnp.bfloat16,
                                        transforms=_swizzled(rank))
        scratch["barrier"] = plgpu.Barrier(num_arrivals=2)
    if swiglu:
        scratch["h_smem"] = plgpu.SMEM((*lead, m_pad, TILE_ROWS // 2), jnp.bfloat16)
    return scratch


def _kernel(body, *, input_names, out_types: dict, scratch: dict, grid, **mesh):
    """plgpu.kernel of a schedule's body, which gets its refs by name (_KernelRefs)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    names = (*input_names, *out_types, *scratch)

    def named_body(*refs):
        body(_KernelRefs.named(names, refs))
    named_body.__name__ = body.__name__  # the Mosaic GPU module's name
    out_type = tuple(out_types.values())
    return plgpu.kernel(
        named_body, out_type=out_type if "part" not in out_types else out_type[0], grid=grid,
        grid_names=("tiles", "splits"), scratch_types=list(scratch.values()),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup), **mesh)


@functools.lru_cache(maxsize=None)
def _split_k_kernel(*, m_pad: int, k_tiles: int, row_tiles: int, splits: int, stages: int,
                    rank: int | None, plan: L2Prefetch | None, swiglu: bool,
                    next_rank: int | None, input_names: tuple[str, ...]):
    """matmul_unscaled's split-K kernel for one static configuration, as one jitted function
    (cached): every launch of it in a program (a model's layers) calls the same function, so
    JAX lowers the Mosaic GPU kernel once per program, not once per launch. rank: the LoRA
    operand's width (None: no LoRA); plan: the L2 prefetch's static part (buffer None, extra
    as a shape) or None; swiglu / next_rank: the fused SwiGLU epilogue and its next-LoRA
    width; input_names: the launch's inputs, in order (_KernelRefs' names)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    steps = -(-k_tiles // splits)
    uneven = k_tiles % splits != 0
    with_lora = rank is not None

    def body(r: _KernelRefs):
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

        def scope(acc_ref):  # acc_ref: f32 [64, M_pad] (wgmma accumulator)
            plgpu.emit_pipeline(
                step, grid=(steps,),
                in_specs=[
                    plgpu.BlockSpec((TILE_LINES, 128),
                                    lambda j: (b * k_tiles + jnp.minimum(first + j, last - 1),
                                               0)),
                    plgpu.BlockSpec((m_pad, TILE_K),
                                    lambda j: (0, jnp.minimum(first + j, last - 1)),
                                    transforms=_swizzled(TILE_K))],
                max_concurrent_steps=stages, init_carry=acc_ref)(r.packed, r.x)
            if plan is not None:
                issue_l2_prefetch(plan, r.prefetch, r.extra, b * splits + s,
                                   row_tiles * splits)
            if with_lora:
                pl.when(s == 0)(lambda: _lora_product(acc_ref, r.bt_smem, r.lx_smem,
                                                      r.barrier))
            if not swiglu:
                store_partial(acc_ref, r.out_smem, r.part.at[s, :, rows])
                return
            plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))(
                lambda ctx, acc, out: store_transposed(acc, out))(acc_ref[...], r.out_smem)
            _run_swiglu_epilogue(r, b)

        pl.run_scoped(scope, plgpu.ACC((TILE_ROWS, m_pad), jnp.float32))

    kernel = _kernel(
        body, input_names=input_names, grid=(row_tiles, splits),
        out_types=_out_types(m_pad=m_pad, row_tiles=row_tiles, splits=splits, swiglu=swiglu,
                             next_rank=next_rank),
        scratch=_scratch_types(m_pad=m_pad, rank=rank, swiglu=swiglu))
    return jax.jit(kernel)


@functools.lru_cache(maxsize=None)
def _warp_specialized_kernel(*, m_pad: int, k_tiles: int, row_tiles: int, splits: int,
                             stages: int, rank: int | None, plan: L2Prefetch | None,
                             swiglu: bool, next_rank: int | None,
                             input_names: tuple[str, ...]):
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

    def body(r: _KernelRefs):  # r.packed: uint8 [row tiles, K_tiles * 72, 128] here
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

            def scoped(acc_ref):  # acc_ref: f32 [64, M_pad], this warpgroup's row tile
                run_pipeline(acc_ref)
                if plan is not None:
                    issue_l2_prefetch(plan, r.prefetch, r.extra,
                                       (c * splits + s) * wgs + wg, programs * wgs)
                if with_lora:
                    pl.when(s == 0)(lambda: _lora_product(
                        acc_ref, r.bt_smem.at[pl.ds(wg * TILE_ROWS, TILE_ROWS)], r.lx_smem,
                        r.barrier))
                plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))(
                    lambda ctx, acc, out: store_transposed(acc, out, per_warpgroup=True))(
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
        pipeline(r.packed, r.x)

    kernel = _kernel(
        body, input_names=input_names, grid=(row_tiles // wgs, splits),
        out_types=_out_types(m_pad=m_pad, row_tiles=row_tiles, splits=splits, swiglu=swiglu,
                             next_rank=next_rank),
        scratch=_scratch_types(m_pad=m_pad, rank=rank, swiglu=swiglu, wgs=wgs),
        num_threads=wgs + 1, thread_name="wg")

    def launch(x, permuted, *rest):  # the weight tiles of a row pair: one 3-D TMA box
        return kernel(x, permuted.reshape(row_tiles, k_tiles * TILE_LINES, 128), *rest)
    return jax.jit(launch)


@functools.partial(jax.jit, static_argnames=("n", "k", "config"), inline=True)
def matmul_unscaled(x: jax.Array, permuted: jax.Array, *, n: int, k: int,
                    lora_x_a: jax.Array | None = None, lora_bt: jax.Array | None = None,
                    l2_prefetch: L2Prefetch | None = None,
                    swiglu: SwigluEpilogue | None = None,
                    config: TuningConfig = TuningConfig()):
    """The kernel: [M, N_pad] float32 sums x @ (e2m1 * block scale * 2^-8)^T
    (+ lora_x_a @ lora_bt^T), i.e. y * tensor_scale * 2^-8 (partials summed by elementwise
    adds that XLA fuses into the consumer). x bf16 [M <= 64, k]; permuted: permute_packed's
    buffer of W [n, k] (rows past n: whatever it holds, zeros for permute_packed's padding);
    lora_x_a [M, r] with lora_bt [N_pad, r] (lora_operand, group_lora_operand or
    pair_lora_operand; r a multiple of 16 up to MAX_OPERAND_RANK). l2_prefetch: another
    launch's first tiles, prefetched into L2 by each program after its K loop. swiglu (one
    split only): instead (h bf16 [M, N_pad / 2], the SwiGLU of a gate/up pair in blocks of 32
    rows, and with swiglu.next_lora_a the float32 [row tiles, M, r] shares of
    h @ next_lora_a, or None) from the fused epilogue. config: the schedule, splits and
    stages (mgpu_nvfp4_tuning). GPU only (Mosaic GPU)."""
    check_launch(x, permuted, lora_x_a, lora_bt, swiglu, n=n, k=k)
    m = x.shape[0]
    k_tiles = -(-k // TILE_K)
    row_tiles = permuted.shape[0] // (TILE_LINES * k_tiles)
    with_lora = lora_x_a is not None
    rank = lora_x_a.shape[1] if with_lora else None
    schedule = launch_schedule(m, row_tiles, rank=rank, config=config)
    warp_specialized = schedule == "warp_specialized"
    stages = config.stages
    if stages is None:
        stages = (ws_stages(m, config.facts(), rank, swiglu is not None) if warp_specialized
                  else 2)
    splits = config.splits
    if splits is None:
        splits = launch_splits(row_tiles, k_tiles, m=m, rank=rank, stages=stages,
                               config=TuningConfig(schedule=schedule, device=config.device))
    if not 1 <= splits <= k_tiles:
        raise ValueError(f"mgpu_nvfp4_matmul: splits={splits} for {k_tiles} K tiles")
    if swiglu is not None and splits != 1:
        raise ValueError(f"mgpu_nvfp4_matmul: the SwiGLU epilogue needs one split, not "
                         f"{splits}")
    m_pad = -(-m // 8) * 8
    next_a = None if swiglu is None else swiglu.next_lora_a
    # K padded to whole tiles: no copy of x at all for M % 8 == 0 and K % 256 == 0 (the model's
    # shapes). With uneven splits a program with one tile fewer than `steps` reloads its last
    # tiles in its last step and skips that step's product.
    x_pad, lora_x = padded_inputs(x, lora_x_a, m_pad, k_tiles * TILE_K)
    inputs = {"x": x_pad, "packed": permuted}  # in launch order (_KernelRefs' names)
    plan = None  # the prefetch plan's static part (arrays as shapes): part of the kernel's key
    if l2_prefetch is not None:
        if l2_prefetch.buffer.ndim != 2 or l2_prefetch.buffer.shape[1] != 128:
            raise ValueError(f"mgpu_nvfp4_matmul: l2_prefetch buffer {l2_prefetch.buffer.shape}"
                             " is not a permuted buffer [lines, 128]")
        inputs["prefetch"] = l2_prefetch.buffer
        extra = l2_prefetch.extra
        if extra is not None:
            inputs["extra"] = extra
            extra = jax.ShapeDtypeStruct(extra.shape, extra.dtype)
        plan = dataclasses.replace(l2_prefetch, buffer=None, extra=extra)
    if with_lora:
        inputs.update(lora_x=lora_x, lora_bt=lora_bt.astype(jnp.bfloat16))
    if swiglu is not None:
        inputs.update(gate_ts=jnp.asarray(swiglu.gate_divisor, jnp.float32).reshape(1),
                      up_ts=jnp.asarray(swiglu.up_divisor, jnp.float32).reshape(1))
        if next_a is not None:
            inputs["next_a"] = next_a.astype(jnp.bfloat16)
    kernel = (_warp_specialized_kernel if warp_specialized else _split_k_kernel)(
        m_pad=m_pad, k_tiles=k_tiles, row_tiles=row_tiles, splits=splits, stages=stages,
        rank=rank, plan=plan, swiglu=swiglu is not None,
        next_rank=None if next_a is None else next_a.shape[1], input_names=tuple(inputs))
    outputs = kernel(*inputs.values())
    if swiglu is not None:
        h = outputs[0][:m]
        return h, (outputs[1][:, :m] if next_a is not None else None)
    partials = outputs
    return functools.reduce(jnp.add, [partials[i, :m] for i in range(splits)])  # fusable


def _lora_bt_of(lora_x_a, lora_b, lora_scale, lora_bt, tensor_scale, *, n: int, n_pad: int):
    """The LoRA operand of a single-weight launch: lora_bt if made ahead, else from lora_b."""
    if lora_x_a is None or lora_bt is not None:
        return lora_bt
    if lora_b is None or lora_b.shape != (lora_x_a.shape[-1], n):
        raise ValueError(f"mgpu_nvfp4_matmul: lora_x_a {lora_x_a.shape}, B "
                         f"{None if lora_b is None else lora_b.shape}; expected B "
                         f"[{lora_x_a.shape[-1]}, {n}] (or lora_bt)")
    return lora_operand(lora_b, tensor_scale, 1.0 if lora_scale is None else lora_scale,
                        n_pad=n_pad)


@functools.partial(jax.jit, static_argnames=("n", "k", "config"), inline=True)
def mgpu_nvfp4_matmul(x: jax.Array, permuted: jax.Array, tensor_scale: jax.Array, *, n: int,
                      k: int, lora_x_a: jax.Array | None = None,
                      lora_b: jax.Array | None = None, lora_scale=None,
                      lora_bt: jax.Array | None = None, l2_prefetch: L2Prefetch | None = None,
                      config: TuningConfig = TuningConfig()) -> jax.Array:
    """y [M, n] float32 = x [M, k] @ W^T / tensor_scale (+ lora_scale * lora_x_a @ lora_b).

    x bf16 [M <= 64, k]; permuted: permute_packed's buffer of W [n, k]; tensor_scale [1];
    lora_x_a [M, r] (x @ A), with either lora_b [r, n] and lora_scale, or lora_bt, the
    LoRA operand lora_operand(lora_b, tensor_scale, lora_scale) made ahead; r in LORA_RANKS.
    l2_prefetch, config: matmul_unscaled's. GPU only (Mosaic GPU)."""
    lora_bt = _lora_bt_of(lora_x_a, lora_b, lora_scale, lora_bt, tensor_scale, n=n,
                          n_pad=padded_rows(permuted, k))
    y = matmul_unscaled(x, permuted, n=n, k=k, lora_x_a=lora_x_a, lora_bt=lora_bt,
                        l2_prefetch=l2_prefetch, config=config)
    return y[:, :n] * (2.0 ** -SCALED_EXPONENT
                       / jnp.asarray(tensor_scale, jnp.float32).reshape(()))


def _swiglu_of_sums(y, gate_tensor_scale, up_tensor_scale, next_lora_a, *, out_n: int,
                    half_block: int):
    """silu(g) * u bf16 [M, out_n] (and its float32 product with next_lora_a) from a gate/up
    pair's unscaled sums y [M, N_pad] (rows interleaved in blocks of half_block): g and u
    rescaled by 2^8 / their tensor scales and rounded to bf16 before the SwiGLU."""
    m = y.shape[0]
    y = y.reshape(m, y.shape[1] // (2 * half_block), 2, half_block)
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


@functools.partial(jax.jit, static_argnames=("out_n", "k", "half_block", "config"),
                   inline=True)
def mgpu_nvfp4_swiglu(x: jax.Array, permuted_pair: jax.Array, gate_tensor_scale: jax.Array,
                      up_tensor_scale: jax.Array, *, out_n: int, k: int, half_block: int,
                      lora_x_a: jax.Array | None = None, lora_bt: jax.Array | None = None,
                      next_lora_a: jax.Array | None = None,
                      l2_prefetch: L2Prefetch | None = None,
                      config: TuningConfig = TuningConfig()):
    """silu(g) * u bf16 [M, out_n] for a gate/up pair (rows interleaved in blocks of
    half_block, permute_packed of the whole pair) with g = x @ Wg^T / ts_g (+ LoRA), u likewise,
    each rounded to bf16 before the SwiGLU (as blockwise_matmul_swiglu's epilogue). lora_bt:
    pair_lora_operand's, with lora_x_a = x @ [A_gate | A_up]. next_lora_a [out_n, r]: then
    also returns the float32 product of the bf16 output with it, as blockwise_matmul_swiglu's
    next_lora_a. Up to config.swiglu_epilogue_max_m rows (with blocks of 32 rows, one split, r
    a multiple of 16) the kernel's epilogue computes the SwiGLU and each row tile's share of
    that product (SwigluEpilogue; XLA sums the shares); else the kernel gives the pair's
    product and XLA the rest."""
    m = x.shape[0]
    n_pad2 = padded_rows(permuted_pair, k)
    if n_pad2 % (2 * half_block) or out_n > n_pad2 // 2:
        raise ValueError(f"mgpu_nvfp4_swiglu: a pair of {n_pad2} rows does not hold two "
                         f"[{out_n}, {k}] halves in blocks of {half_block}")
    row_tiles = n_pad2 // TILE_ROWS
    resolved = (launch_splits(row_tiles, -(-k // TILE_K), m=m,
                              rank=None if lora_x_a is None else lora_x_a.shape[1],
                              stages=config.stages or 2, config=config)
                if config.splits is None else config.splits)
    if (m <= config.swiglu_epilogue_max_m and half_block == TILE_ROWS // 2 and resolved == 1
            and (next_lora_a is None or next_lora_a.shape[1] % 16 == 0)):
        next_a = next_lora_a  # matmul_unscaled takes it in bf16
        if next_a is not None and next_a.shape[0] != n_pad2 // 2:
            next_a = jnp.pad(next_a, ((0, n_pad2 // 2 - next_a.shape[0]), (0, 0)))
        h, shares = matmul_unscaled(
            x, permuted_pair, n=n_pad2, k=k, lora_x_a=lora_x_a, lora_bt=lora_bt,
            l2_prefetch=l2_prefetch, config=dataclasses.replace(config, splits=1),
            swiglu=SwigluEpilogue(gate_tensor_scale, up_tensor_scale, next_a))
        out = h[:, :out_n]
        return out if next_lora_a is None else (out, shares.sum(axis=0))
    y = matmul_unscaled(x, permuted_pair, n=n_pad2, k=k, lora_x_a=lora_x_a, lora_bt=lora_bt,
                        l2_prefetch=l2_prefetch, config=config)
    return _swiglu_of_sums(y, gate_tensor_scale, up_tensor_scale, next_lora_a, out_n=out_n,
                           half_block=half_block)


def matmul_unscaled_reference(x: jax.Array, permuted: jax.Array, *, n: int, k: int,
                              lora_x_a: jax.Array | None = None,
                              lora_bt: jax.Array | None = None) -> jax.Array:
    """matmul_unscaled in plain jnp: [M, N_pad] float32 = bf16(x) @ (e2m1 * scale * 2^-8)^T
    (+ bf16(lora_x_a) @ bf16(lora_bt)^T), the weights dequantized first (exact in float32),
    products summed in float32: the kernel equals it up to the order of those sums."""
    del n  # the kernel computes every row of the buffer
    n_pad = padded_rows(permuted, k)
    w = permuted_dequantize_reference(permuted, jnp.float32(2.0 ** -SCALED_EXPONENT),
                                      n=n_pad, k=k)

    def dot(a, b):
        return jnp.dot(a.astype(jnp.bfloat16).astype(jnp.float32),
                       b.astype(jnp.bfloat16).astype(jnp.float32).T,
                       precision=lax.Precision.HIGHEST)
    y = dot(x, w)
    return y if lora_x_a is None else y + dot(lora_x_a, lora_bt)


def mgpu_nvfp4_matmul_reference(x: jax.Array, permuted: jax.Array, tensor_scale: jax.Array, *,
                                n: int, k: int, lora_x_a: jax.Array | None = None,
                                lora_b: jax.Array | None = None, lora_scale=None,
                                lora_bt: jax.Array | None = None) -> jax.Array:
    """mgpu_nvfp4_matmul in plain jnp (matmul_unscaled_reference rescaled by
    2^8 / tensor_scale; the LoRA operand rounded to bf16 as the kernel's): [M, n] float32."""
    lora_bt = _lora_bt_of(lora_x_a, lora_b, lora_scale, lora_bt, tensor_scale, n=n,
                          n_pad=padded_rows(permuted, k))
    y = matmul_unscaled_reference(x, permuted, n=n, k=k, lora_x_a=lora_x_a, lora_bt=lora_bt)
    return y[:, :n] * (2.0 ** -SCALED_EXPONENT
                       / jnp.asarray(tensor_scale, jnp.float32).reshape(()))


def mgpu_nvfp4_swiglu_reference(x: jax.Array, permuted_pair: jax.Array,
                                gate_tensor_scale: jax.Array, up_tensor_scale: jax.Array, *,
                                out_n: int, k: int, half_block: int,
                                lora_x_a: jax.Array | None = None,
                                lora_bt: jax.Array | None = None,
                                next_lora_a: jax.Array | None = None):
    """mgpu_nvfp4_swiglu in plain jnp: the SwiGLU of matmul_unscaled_reference's sums (g and
    u rounded to bf16, the output bf16, its product with next_lora_a float32)."""
    y = matmul_unscaled_reference(x, permuted_pair, n=padded_rows(permuted_pair, k), k=k,
                                  lora_x_a=lora_x_a, lora_bt=lora_bt)
    return _swiglu_of_sums(y, gate_tensor_scale, up_tensor_scale, next_lora_a, out_n=out_n,
                           half_block=half_block)


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
