"""The Mosaic GPU backend: NVFP4 decode launches (M <= 64) on Hopper
(pallas_kernels.mgpu_nvfp4), reading the weights in its permuted layout.

Single-weight launches (the o and down projections), grouped q|k|v launches and the fused
SwiGLU launches of gate/up pairs run here where `refusal` says nothing against them; the
Triton decode backend (triton.py) takes every launch this one refuses. The permuted buffer is a
weight's only copy (KernelLayoutWeight.kernel_source): prefill and training dequantize it
directly (pallas_kernels.permuted_dequantize). Measured on the H100, one run each: 7B
rollout 3.27-3.49 s against 3.47-3.68 s on the Triton kernels, 14B 5.89-6.05 against
6.72-6.91, training within 0.06 s (benchmarks/RESULTS.md).

`repack`-side functions make the permuted buffers (`permuted`, `permuted_group`, for a pair
`permuted` of its gate view) and the per-rollout operands (`with_lora_operand`,
`with_pair_lora_operand`, `with_group_lora_operand`, `with_prefetch`); which layers form
groups, pairs and the decode order is the model's business (qerl_jax.models.decode_fusion).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from pallas_kernels import mgpu_nvfp4
from qerl_jax.quant.backends.kernel_layout import KernelLayoutWeight

logger = logging.getLogger(__name__)


def unavailable() -> str | None:
    """Why the Mosaic GPU kernel cannot run on this machine, or None."""
    return mgpu_nvfp4.available()


def rank_refusal(ranks) -> str | None:
    """Why LoRA adapters of these ranks keep the Triton kernels, or None."""
    other = sorted(set(ranks) - set(mgpu_nvfp4.LORA_RANKS))
    if not other:
        return None
    return f"LoRA rank {other} (the Mosaic GPU kernel takes {mgpu_nvfp4.LORA_RANKS})"


def rows(weight: KernelLayoutWeight) -> int:
    """Rows of the permuted buffer of this (not paired) weight alone."""
    k_tiles = -(-weight.shape[1] // mgpu_nvfp4.TILE_K)
    return weight.kernel_rows // mgpu_nvfp4.TILE_ROWS * k_tiles * mgpu_nvfp4.TILE_LINES


# ----------------------------------------------------------------------------------------------
# The permuted layout: made once after loading, the weights' only copy


def layout_refusal(weight) -> str | None:
    """Why this kernel-layout weight (for a pair view: its whole pair) cannot have a permuted
    buffer, or None."""
    if not isinstance(weight, KernelLayoutWeight):
        return "not in the kernel layout"
    if weight.mosaic_tiles is not None or weight.single_copy:
        return "it has its permuted buffer already"
    packed = weight.packed() if weight.pair_view is None else weight.whole_pair()
    return mgpu_nvfp4.refusal(packed)


_permute = jax.jit(mgpu_nvfp4.permute_packed)


def permuted(weight: KernelLayoutWeight) -> jax.Array:
    """The permuted buffer of a weight (of a pair view: of its whole interleaved pair)."""
    return _permute(weight.packed() if weight.pair_view is None else weight.whole_pair())


def only_in(weight: KernelLayoutWeight, buffer: jax.Array, line: int = 0,
            launch_buffer: bool = True) -> KernelLayoutWeight:
    """The weight stored only in `buffer` from line `line` on (its kernel-layout arrays
    dropped); launch_buffer: it also launches from that buffer (mosaic_tiles; False for the k
    and v projections of a q|k|v group, whose launch is q's)."""
    return weight.replace(kernel_codes=None, kernel_scales=None, kernel_source=buffer,
                          kernel_source_line=line,
                          mosaic_tiles=buffer if launch_buffer else None)


def permuted_group(weights) -> jax.Array | None:
    """The permuted buffer of weights stacked by rows for one grouped launch (q|k|v:
    mgpu_nvfp4.group_permuted), or None where they cannot share one."""
    if not all(layout_refusal(w) is None and w.pair_view is None for w in weights):
        return None
    if len({w.shape[1] for w in weights}) != 1:
        return None
    return mgpu_nvfp4.group_permuted([permuted(w) for w in weights],
                                     [w.shape[1] for w in weights])


def group_only_in(weights, buffer: jax.Array) -> list[KernelLayoutWeight]:
    """The group's weights stored only in its buffer (the first launches from it; lines: q 0,
    k after q's, v after k's)."""
    stored, line = [], 0
    for i, weight in enumerate(weights):
        stored.append(only_in(weight, buffer, line, launch_buffer=i == 0))
        line += rows(weight)
    return stored


def permuted_dense(weight: KernelLayoutWeight, interpret: bool) -> jax.Array | None:
    """W [N, K] bf16 of a single-copy NVFP4 weight straight from its permuted buffer
    (pallas_kernels.permuted_dequantize; bit for bit the kernel layout's dequantize), or None
    where that kernel cannot read it."""
    from pallas_kernels.permuted_dequantize import BLOCK_ROWS, permuted_dequantize
    if not (weight.single_copy and weight.format == "nvfp4"
            and weight.tile_k == mgpu_nvfp4.TILE_K
            and (weight.pair_view is None or weight.pair_view[0] % BLOCK_ROWS == 0)):
        return None
    return permuted_dequantize(weight.kernel_source, weight.kernel_tensor_scale(),
                               n=weight.shape[0], k=weight.shape[1],
                               line=weight.kernel_source_line, pair_view=weight.pair_view,
                               interpret=interpret)


# ----------------------------------------------------------------------------------------------
# Operands made once per rollout (on the sampler's merged copy, never on a trained state)


def _launches_alone(weight) -> bool:
    return (getattr(weight, "mosaic_tiles", None) is not None and weight.pair_view is None
            and weight.mosaic_tiles.shape[0] == rows(weight))


def with_lora_operand(weight, lora_b: jax.Array, lora_scale: float):
    """The weight carrying its adapter's LoRA operand (mosaic_lora_operand, from lora_b [r, N]
    and the LoRA scale) when this backend takes its decode launches, else the weight as is."""
    if (not _launches_alone(weight) or lora_b.ndim != 2
            or lora_b.shape[0] not in mgpu_nvfp4.LORA_RANKS):
        return weight
    operand = mgpu_nvfp4.lora_operand(lora_b, weight.kernel_tensor_scale(), lora_scale,
                                      n_pad=weight.kernel_rows)
    return weight.replace(mosaic_lora_operand=operand)


def with_pair_lora_operand(gate, up, gate_b: jax.Array, up_b: jax.Array, lora_scale: float):
    """The gate pair view carrying the pair's LoRA operand (mgpu_nvfp4.pair_lora_operand of
    B_gate and B_up [r, N]) when this backend's SwiGLU launch takes the pair, else the gate
    view as is."""
    if (getattr(gate, "mosaic_tiles", None) is None or gate.pair_view is None
            or getattr(up, "pair_view", None) is None
            or gate_b.shape != up_b.shape or gate_b.shape[0] not in mgpu_nvfp4.LORA_RANKS):
        return gate
    operand = mgpu_nvfp4.pair_lora_operand(
        gate_b, up_b, gate.kernel_tensor_scale(), up.kernel_tensor_scale(), lora_scale,
        n_pad=gate.kernel_rows // 2, half_block=gate.pair_view[0])
    return gate.replace(mosaic_lora_operand=operand)


def group_layout_refusal(weights, lora_bs) -> str | None:
    """Why a grouped launch of these weights (and LoRA Bs, or None without LoRA) cannot run
    here whatever the input, or None: the first weight holding the permuted buffer of all of
    them stacked by rows (the others none), the LoRA ranks (each in LORA_RANKS, their sum a
    kernel operand width)."""
    first = weights[0]
    if (getattr(first, "mosaic_tiles", None) is None
            or any(getattr(w, "pair_view", None) is not None
                   or getattr(w, "mosaic_tiles", None) is not None for w in weights[1:])):
        return "no permuted group buffer"
    if first.mosaic_tiles.shape[0] != sum(rows(w) for w in weights):
        return "the first weight's permuted buffer is not the group's"
    if lora_bs is not None and (
            any(b.ndim != 2 or b.shape[0] not in mgpu_nvfp4.LORA_RANKS for b in lora_bs)
            or not mgpu_nvfp4.operand_rank_ok(sum(b.shape[0] for b in lora_bs))):
        return f"LoRA B {[b.shape for b in lora_bs]}"
    return None


def with_group_lora_operand(weights, lora_bs, lora_scales):
    """The first weight of a grouped launch (q of q|k|v) carrying the group's LoRA operand
    (mgpu_nvfp4.group_lora_operand of the B_i [r_i, N_i] with their LoRA scales) when this
    backend takes the launch's layout, else as is."""
    weights = tuple(weights)
    if group_layout_refusal(weights, tuple(lora_bs)) is not None:
        return weights[0]
    operand = mgpu_nvfp4.group_lora_operand(
        lora_bs, [w.kernel_tensor_scale() for w in weights], lora_scales,
        [w.kernel_rows for w in weights])
    return weights[0].replace(mosaic_lora_operand=operand)


def with_prefetch(weight, following, following_lora_a):
    """The weight whose launch prefetches into L2 the first tiles of the following decode
    launch's weight (its permuted buffer, the same array) and the LoRA A read before it, when
    both launches run here; else as is."""
    if not (isinstance(weight, KernelLayoutWeight) and isinstance(following, KernelLayoutWeight)
            and weight.mosaic_tiles is not None and following.mosaic_tiles is not None):
        return weight
    return weight.replace(mosaic_prefetch=following.mosaic_tiles,
                          mosaic_prefetch_lora_a=following_lora_a,
                          mosaic_prefetch_k=following.shape[1])


def _prefetch_plan(weight, prefetch_tiles: int, m: int, schedule: str = "auto"):
    """The mgpu_nvfp4.L2Prefetch of a weight linked by with_prefetch (its launch at M = m,
    the following launch on `schedule`), else None."""
    target = getattr(weight, "mosaic_prefetch", None)
    if target is None or not prefetch_tiles:
        return None
    lora_a = getattr(weight, "mosaic_prefetch_lora_a", None)  # its width: the operand's
    extra = lora_a if lora_a is not None and mgpu_nvfp4.extra_prefetchable(lora_a) else None
    return mgpu_nvfp4.l2_prefetch_for(target, k=weight.mosaic_prefetch_k, ahead=prefetch_tiles,
                                      extra=extra, m=m, schedule=schedule,
                                      rank=None if lora_a is None else lora_a.shape[-1])


def _prepared_lora_operand(weight, lora_x_a):
    """The weight's per-rollout LoRA operand if it fits this launch's rank, else None."""
    operand = getattr(weight, "mosaic_lora_operand", None)
    if operand is None or operand.shape[1] != lora_x_a.shape[1]:
        return None
    return operand


# ----------------------------------------------------------------------------------------------
# Launches: refusal (from the weights' metadata only, never their arrays) and apply


def refusal(x, weight, lora_x_a) -> str | None:
    """Why this backend does not take this single-weight launch, or None."""
    if getattr(weight, "mosaic_tiles", None) is None or weight.pair_view is not None:
        return "no permuted buffer"
    if weight.mosaic_tiles.shape[0] != rows(weight):
        return "its permuted buffer is a grouped launch's"
    if x.shape[0] > mgpu_nvfp4.MAX_M:
        return f"M {x.shape[0]}"
    if lora_x_a is not None and lora_x_a.shape[1] not in mgpu_nvfp4.LORA_RANKS:
        return f"LoRA rank {lora_x_a.shape[1]}"
    if weight.format != "nvfp4" or weight.tile_k != mgpu_nvfp4.TILE_K:
        return f"format {weight.format}, tile_k {weight.tile_k}"
    return mgpu_nvfp4.available()


def apply(x, weight, lora_x_a, lora_b, lora_scale, *, prefetch_tiles: int,
          schedule: str = "auto"):
    """x [M, K] @ W^T (+ lora_scale * lora_x_a @ lora_b) -> [M, N] float32, rounded to bf16
    like the Triton fused kernel. schedule: mgpu_nvfp4.launch_schedule's (all launches)."""
    kwargs = {}
    if lora_x_a is not None:
        operand = _prepared_lora_operand(weight, lora_x_a)
        kwargs = (dict(lora_x_a=lora_x_a, lora_bt=operand) if operand is not None
                  else dict(lora_x_a=lora_x_a, lora_b=lora_b, lora_scale=lora_scale))
    y = mgpu_nvfp4.mgpu_nvfp4_matmul(x.astype(jnp.bfloat16), weight.mosaic_tiles,
                                     weight.kernel_tensor_scale(), n=weight.shape[0],
                                     k=weight.shape[1],
                                     l2_prefetch=_prefetch_plan(weight, prefetch_tiles,
                                                                x.shape[0], schedule),
                                     schedule=schedule, **kwargs)
    return y.astype(jnp.bfloat16).astype(jnp.float32)


def group_refusal(x, weights, lora_x_a, lora_bs) -> str | None:
    """Why this backend does not take this grouped launch, or None."""
    reason = group_layout_refusal(weights, None if lora_x_a is None else lora_bs)
    if reason is not None:
        return reason
    if x.ndim != 2 or x.shape[0] > mgpu_nvfp4.MAX_M:
        return f"x {x.shape}"
    if lora_x_a is not None and lora_x_a.shape[1] != sum(b.shape[0] for b in lora_bs):
        return f"LoRA x @ A {lora_x_a.shape}, B {[b.shape for b in lora_bs]}"
    return mgpu_nvfp4.available()


def apply_grouped(x, weights, lora_x_a, lora_bs, lora_scales, *, prefetch_tiles: int,
                  schedule: str = "auto"):
    """One matmul over the group's stacked buffer, each member's columns rescaled by its own
    2^8 / tensor_scale and rounded to bf16 (as the fused kernel's outputs) -> tuple of
    [M, N_i] float32."""
    first = weights[0]
    n_pads = [w.kernel_rows for w in weights]
    lora = {}
    if lora_x_a is not None:
        operand = _prepared_lora_operand(first, lora_x_a)
        if operand is None or operand.shape[0] != sum(n_pads):
            operand = mgpu_nvfp4.group_lora_operand(
                lora_bs, [w.kernel_tensor_scale() for w in weights], lora_scales, n_pads)
        lora = dict(lora_x_a=lora_x_a, lora_bt=operand)
    y = mgpu_nvfp4.matmul_unscaled(x.astype(jnp.bfloat16), first.mosaic_tiles, n=sum(n_pads),
                                   k=first.shape[1],
                                   l2_prefetch=_prefetch_plan(first, prefetch_tiles, x.shape[0],
                                                              schedule),
                                   schedule=schedule, **lora)
    outputs, offset = [], 0
    for weight, n_pad in zip(weights, n_pads):
        scale = 2.0 ** -mgpu_nvfp4.SCALED_EXPONENT / weight.kernel_tensor_scale().reshape(())
        member = y[:, offset:offset + weight.shape[0]] * scale
        outputs.append(member.astype(jnp.bfloat16).astype(jnp.float32))
        offset += n_pad
    return tuple(outputs)


def swiglu_refusal(x, gate, lora_x_a, lora_bs) -> str | None:
    """Why this backend does not take this fused SwiGLU launch, or None: the pair's permuted
    copy, M, the LoRA ranks (equal, in LORA_RANKS)."""
    if getattr(gate, "mosaic_tiles", None) is None:
        return "no permuted buffer"
    if x.ndim != 2 or x.shape[0] > mgpu_nvfp4.MAX_M:
        return f"x {x.shape}"
    if lora_x_a is not None and (lora_bs[0].shape != lora_bs[1].shape
                                 or lora_bs[0].shape[0] not in mgpu_nvfp4.LORA_RANKS
                                 or lora_x_a.shape[-1] != 2 * lora_bs[0].shape[0]):
        return f"LoRA x @ A {lora_x_a.shape}, B {[b.shape for b in lora_bs]}"
    return mgpu_nvfp4.available()


def apply_swiglu(x, weights, lora_x_a, lora_bs, lora_scales, next_lora_a, *,
                 prefetch_tiles: int, schedule: str, epilogue_max_m: int):
    """silu(gate) * up [M, N] bf16 of a pair in one launch over its permuted buffer, the SwiGLU
    (and with next_lora_a its product with it) in the kernel's epilogue up to epilogue_max_m
    rows, else in XLA from the launch's output (mgpu_nvfp4_swiglu's `fused`). schedule,
    epilogue_max_m: KernelOptions' mosaic_schedule and mosaic_swiglu_epilogue_max_m."""
    gate, up = weights
    half_block = gate.pair_view[0]
    lora = {}
    if lora_x_a is not None:
        operand = _prepared_lora_operand(gate, lora_x_a)
        if operand is None:
            operand = mgpu_nvfp4.pair_lora_operand(
                lora_bs[0], lora_bs[1], gate.kernel_tensor_scale(), up.kernel_tensor_scale(),
                lora_scales[0], n_pad=gate.kernel_rows // 2, half_block=half_block)
        lora = dict(lora_x_a=lora_x_a, lora_bt=operand)
    return mgpu_nvfp4.mgpu_nvfp4_swiglu(
        x.astype(jnp.bfloat16), gate.mosaic_tiles, gate.kernel_tensor_scale(),
        up.kernel_tensor_scale(), out_n=gate.shape[0], k=gate.shape[1], half_block=half_block,
        next_lora_a=next_lora_a,
        l2_prefetch=_prefetch_plan(gate, prefetch_tiles, x.shape[0], schedule),
        schedule=schedule, fused=x.shape[0] <= epilogue_max_m, **lora)
