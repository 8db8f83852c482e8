"""The Mosaic GPU backend: NVFP4 decode launches (M <= 64) on Hopper
(pallas_kernels.mgpu_nvfp4), reading the weights in its permuted layout (`MosaicWeight`).

Single-weight launches (the o and down projections), grouped q|k|v launches and the fused
SwiGLU launches of gate/up pairs run here where `MosaicBackend` does not refuse them; it is
registered ahead of the Triton decode backend (triton.py), which takes every launch this one
refuses. The permuted buffer is a weight's only copy (MosaicWeight.kernel_source): prefill and
training dequantize it directly (pallas_kernels.permuted_dequantize). Its speed against the
Triton kernels is in benchmarks/RESULTS.md.

`MosaicBackend.repack` makes the permuted buffers once after loading (one weight, a gate/up
pair's two views, or a q|k|v group in one buffer); the weight type makes the per-rollout
operands (`with_lora_operand`, `with_pair_lora_operand`, `with_group_lora_operand`,
`with_prefetch`). Which layers form groups, pairs and the decode order is the model's business
(qerl_jax.models.decode_fusion).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import mgpu_nvfp4, mgpu_nvfp4_layout, mgpu_nvfp4_tuning
from pallas_kernels.mgpu_nvfp4_tuning import TuningConfig
from qerl_jax.quant.backends.base import MatmulBackend
from qerl_jax.quant.backends.kernel_layout import (KernelLayoutWeight, dequantize_backward,
                                                   group_launch_refusal, pair_launch_refusal)
from qerl_jax.quant.kernel_options import KernelOptions

FORMATS = ("nvfp4",)  # the formats this backend registers for


def rank_refusal(ranks) -> str | None:
    """Why LoRA adapters of these ranks keep the Triton kernels, or None."""
    other = sorted(set(ranks) - set(mgpu_nvfp4_layout.LORA_RANKS))
    if not other:
        return None
    return f"LoRA rank {other} (the Mosaic GPU kernel takes {mgpu_nvfp4_layout.LORA_RANKS})"


def rows(weight: KernelLayoutWeight) -> int:
    """Rows of the permuted buffer of this (not paired) weight alone."""
    k_tiles = -(-weight.shape[1] // mgpu_nvfp4_layout.TILE_K)
    tile_rows = weight.kernel_rows // mgpu_nvfp4_layout.TILE_ROWS
    return tile_rows * k_tiles * mgpu_nvfp4_layout.TILE_LINES


# ----------------------------------------------------------------------------------------------
# The weight type


class MosaicWeight(KernelLayoutWeight):
    """A KernelLayoutWeight with the Mosaic GPU kernel's permuted layout (made by
    MosaicBackend.repack; tests may attach a buffer with `from_kernel_layout`).

    Pytree children, beyond KernelLayoutWeight's (whose kernel_codes / kernel_scales are None
    where the permuted buffer is the only copy):
      mosaic_tiles (or None): the weight in the kernel's permuted layout
        (pallas_kernels.mgpu_nvfp4). On the q projection of a grouped q|k|v launch it is the
        permuted buffer of [W_q; W_k; W_v] (mgpu_nvfp4_layout.group_permuted; k and v then
        hold none).
      mosaic_lora_operand (or None): bf16 [N_pad, r], the kernel's operand for this layer's LoRA
        B (mgpu_nvfp4_layout.lora_operand: B^T with the LoRA and tensor scales folded in; for a
        grouped q|k|v buffer the block-diagonal group operand), made once per rollout on the
        sampler's merged copy, so the decode loop does not transpose B at every token.
      mosaic_prefetch (or None): the next decode launch's permuted buffer (the same array, not a
        copy), whose first tiles this weight's launch prefetches into L2;
        mosaic_prefetch_lora_a: the LoRA A that XLA's x @ A reads before that launch (also
        prefetched), or None.
      kernel_source (or None): the permuted buffer holding this weight's only copy (its own
        mosaic_tiles, its pair's, or its q|k|v group's: the same array), its tiles from line
        kernel_source_line (static) on. Prefill and training (M > 64) get W in bf16 straight
        from it (kernel_dense); the Triton kernels' operands (packed(), kernel_arrays()) and the
        checkpoint view are unpermuted from it where they are used
        (mgpu_nvfp4_layout.kernel_layout_from_permuted; inside jit a transient of one weight).
    Static, beyond KernelLayoutWeight's: mosaic_prefetch_k (the prefetched launch's K),
    kernel_source_line.
    """

    _MOSAIC_CHILDREN = ("mosaic_tiles", "mosaic_lora_operand", "mosaic_prefetch",
                        "mosaic_prefetch_lora_a", "kernel_source")
    _CHILDREN = KernelLayoutWeight._CHILDREN + _MOSAIC_CHILDREN
    _STATIC = KernelLayoutWeight._STATIC + ("mosaic_prefetch_k", "kernel_source_line")

    def __init__(self, *, mosaic_tiles=None, mosaic_lora_operand=None, mosaic_prefetch=None,
                 mosaic_prefetch_lora_a=None, kernel_source=None, mosaic_prefetch_k: int = 0,
                 kernel_source_line: int = 0, **kernel_layout):
        super().__init__(**kernel_layout)
        set_attr = object.__setattr__
        set_attr(self, "mosaic_tiles", mosaic_tiles)
        set_attr(self, "mosaic_lora_operand", mosaic_lora_operand)
        set_attr(self, "mosaic_prefetch", mosaic_prefetch)
        set_attr(self, "mosaic_prefetch_lora_a", mosaic_prefetch_lora_a)
        set_attr(self, "mosaic_prefetch_k", int(mosaic_prefetch_k))
        set_attr(self, "kernel_source", kernel_source)
        set_attr(self, "kernel_source_line", int(kernel_source_line))

    @classmethod
    def from_kernel_layout(cls, weight: KernelLayoutWeight, **mosaic_fields) -> MosaicWeight:
        """`weight` (its kernel-layout arrays kept unless mosaic_fields drop them) with these
        MosaicWeight fields."""
        names = KernelLayoutWeight._CHILDREN + KernelLayoutWeight._STATIC
        return cls(**{**{name: getattr(weight, name) for name in names}, **mosaic_fields})

    @property
    def single_copy(self) -> bool:
        return self.kernel_codes is None and self.kernel_source is not None

    def kernel_arrays(self) -> tuple[jax.Array, jax.Array]:
        """(kernel_codes, kernel_scales), tile-major [kernel_rows, ...]: the arrays, or for a
        single-copy weight their unpermuted form (computed: a transient inside jit)."""
        if self.kernel_codes is not None:
            return self.kernel_codes, self.kernel_scales
        if self.kernel_source is None:
            raise ValueError("MosaicWeight: neither kernel_codes nor kernel_source")
        return mgpu_nvfp4_layout.kernel_layout_from_permuted(
            self.kernel_source, rows=self.kernel_rows, k=self.shape[1],
            line=self.kernel_source_line)

    def stored_arrays(self) -> tuple[jax.Array, ...]:
        return (self.kernel_source,) if self.single_copy else super().stored_arrays()

    def kernel_dense(self, interpret: bool = False) -> jax.Array:
        """W [N, K] bf16: a single-copy weight's straight from its permuted buffer
        (pallas_kernels.permuted_dequantize; bit for bit the kernel layout's dequantize) where
        that kernel reads it, else the kernel layout's."""
        from pallas_kernels.permuted_dequantize import BLOCK_ROWS, permuted_dequantize
        if not (self.single_copy and self.format == "nvfp4"
                and self.tile_k == mgpu_nvfp4_layout.TILE_K
                and (self.pair_view is None or self.pair_view[0] % BLOCK_ROWS == 0)):
            return super().kernel_dense(interpret)
        return permuted_dequantize(self.kernel_source, self.kernel_tensor_scale(),
                                   n=self.shape[0], k=self.shape[1],
                                   line=self.kernel_source_line, pair_view=self.pair_view,
                                   interpret=interpret)

    # Operands made once per rollout (on the sampler's merged copy, never on a trained state)

    def _launches_alone(self) -> bool:
        return (self.mosaic_tiles is not None and self.pair_view is None
                and self.mosaic_tiles.shape[0] == rows(self))

    def with_lora_operand(self, lora_b: jax.Array, lora_scale: float):
        """This weight carrying its adapter's LoRA operand (mosaic_lora_operand, from lora_b
        [r, N] and the LoRA scale) when its single-weight launch runs here, else as is."""
        if (not self._launches_alone() or lora_b.ndim != 2
                or lora_b.shape[0] not in mgpu_nvfp4_layout.LORA_RANKS):
            return self
        operand = mgpu_nvfp4_layout.lora_operand(lora_b, self.kernel_tensor_scale(), lora_scale,
                                          n_pad=self.kernel_rows)
        return self.replace(mosaic_lora_operand=operand)

    def with_pair_lora_operand(self, up, gate_b: jax.Array, up_b: jax.Array,
                               lora_scale: float):
        """This gate pair view carrying the pair's LoRA operand (mgpu_nvfp4_layout.pair_lora_operand
        of B_gate and B_up [r, N]) when the SwiGLU launch runs here, else as is."""
        if (self.mosaic_tiles is None or self.pair_view is None
                or getattr(up, "pair_view", None) is None
                or gate_b.shape != up_b.shape
                or gate_b.shape[0] not in mgpu_nvfp4_layout.LORA_RANKS):
            return self
        operand = mgpu_nvfp4_layout.pair_lora_operand(
            gate_b, up_b, self.kernel_tensor_scale(), up.kernel_tensor_scale(), lora_scale,
            n_pad=self.kernel_rows // 2, half_block=self.pair_view[0])
        return self.replace(mosaic_lora_operand=operand)

    def with_group_lora_operand(self, members, lora_bs, lora_scales):
        """This first weight of a grouped launch (members: the whole group, this one first)
        carrying the group's LoRA operand (mgpu_nvfp4_layout.group_lora_operand of the B_i
        [r_i, N_i] with their LoRA scales) when the launch's layout is this backend's, else as
        is."""
        members = tuple(members)
        if (any(b.ndim != 2 for b in lora_bs)
                or group_layout_refusal(members, [b.shape[0] for b in lora_bs]) is not None):
            return self
        operand = mgpu_nvfp4_layout.group_lora_operand(
            lora_bs, [w.kernel_tensor_scale() for w in members], lora_scales,
            [w.kernel_rows for w in members])
        return self.replace(mosaic_lora_operand=operand)

    def with_prefetch(self, following, following_lora_a):
        """This weight, whose launch prefetches into L2 the first tiles of the following decode
        launch's weight (its permuted buffer, the same array) and the LoRA A read before it,
        when both launches run here; else as is."""
        if (self.mosaic_tiles is None or not isinstance(following, MosaicWeight)
                or following.mosaic_tiles is None):
            return self
        return self.replace(mosaic_prefetch=following.mosaic_tiles,
                            mosaic_prefetch_lora_a=following_lora_a,
                            mosaic_prefetch_k=following.shape[1])


jax.tree_util.register_pytree_with_keys_class(MosaicWeight)


def group_layout_refusal(weights, lora_ranks) -> str | None:
    """Why a grouped launch of these weights (with LoRA adapters of these ranks, or None
    without LoRA) cannot run here whatever the input, or None: the first weight holding the
    permuted buffer of all of them stacked by rows (the others none), the LoRA ranks (each in
    LORA_RANKS, their sum a kernel operand width)."""
    first = weights[0]
    if (getattr(first, "mosaic_tiles", None) is None
            or any(getattr(w, "pair_view", None) is not None
                   or getattr(w, "mosaic_tiles", None) is not None for w in weights[1:])):
        return "no permuted group buffer"
    if first.mosaic_tiles.shape[0] != sum(rows(w) for w in weights):
        return "the first weight's permuted buffer is not the group's"
    if lora_ranks is not None and (
            any(rank not in mgpu_nvfp4_layout.LORA_RANKS for rank in lora_ranks)
            or not mgpu_nvfp4_layout.operand_rank_ok(sum(lora_ranks))):
        return (f"LoRA ranks {list(lora_ranks)} (the kernel takes "
                f"{mgpu_nvfp4_layout.LORA_RANKS} each)")
    return None


# ----------------------------------------------------------------------------------------------
# The permuted layout: made once after loading, the weights' only copy


def layout_refusal(weight) -> str | None:
    """Why this kernel-layout weight (for a pair view: its whole pair) cannot have a permuted
    buffer, or None."""
    if not isinstance(weight, KernelLayoutWeight):
        return "not in the kernel layout"
    if isinstance(weight, MosaicWeight):
        return "it has its permuted buffer already"
    packed = weight.packed() if weight.pair_view is None else weight.whole_pair()
    return mgpu_nvfp4_layout.refusal(packed)


_permute = jax.jit(mgpu_nvfp4_layout.permute_packed)


def permuted(weight: KernelLayoutWeight) -> jax.Array:
    """The permuted buffer of a weight (of a pair view: of its whole interleaved pair)."""
    return _permute(weight.packed() if weight.pair_view is None else weight.whole_pair())


def only_in(weight: KernelLayoutWeight, buffer: jax.Array, line: int = 0,
            launch_buffer: bool = True) -> MosaicWeight:
    """The weight stored only in `buffer` from line `line` on (its kernel-layout arrays
    dropped); launch_buffer: it also launches from that buffer (mosaic_tiles; False for the k
    and v projections of a q|k|v group, whose launch is q's)."""
    return MosaicWeight.from_kernel_layout(
        weight, kernel_codes=None, kernel_scales=None, kernel_source=buffer,
        kernel_source_line=line, mosaic_tiles=buffer if launch_buffer else None)


def permuted_group(weights) -> jax.Array | None:
    """The permuted buffer of weights stacked by rows for one grouped launch (q|k|v:
    mgpu_nvfp4_layout.group_permuted), or None where they cannot share one."""
    if not all(layout_refusal(w) is None and w.pair_view is None for w in weights):
        return None
    if len({w.shape[1] for w in weights}) != 1:
        return None
    return mgpu_nvfp4_layout.group_permuted([permuted(w) for w in weights],
                                     [w.shape[1] for w in weights])


def group_only_in(weights, buffer: jax.Array) -> list[MosaicWeight]:
    """The group's weights stored only in its buffer (the first launches from it; lines: q 0,
    k after q's, v after k's)."""
    stored, line = [], 0
    for i, weight in enumerate(weights):
        stored.append(only_in(weight, buffer, line, launch_buffer=i == 0))
        line += rows(weight)
    return stored


# ----------------------------------------------------------------------------------------------
# The backend


def _prepared_lora_operand(weight, lora_x_a):
    """The weight's per-rollout LoRA operand if it fits this launch's rank, else None."""
    operand = getattr(weight, "mosaic_lora_operand", None)
    if operand is None or operand.shape[1] != lora_x_a.shape[1]:
        return None
    return operand


class MosaicBackend(MatmulBackend):
    """NVFP4 decode launches on the Mosaic GPU kernel (Hopper), with its LoRA epilogue,
    grouped launch and fused SwiGLU launch; the tunings and schedule from KernelOptions."""

    name = "nvfp4_mosaic"
    description = "Mosaic GPU 4-bit kernel (Hopper)"
    max_m = mgpu_nvfp4_layout.MAX_M
    lora_epilogue = True

    def __init__(self, options: KernelOptions = KernelOptions()):
        self.options = options

    @staticmethod
    def unavailable() -> str | None:
        """Why the kernel cannot run on this machine (its GPU's compute capability), or None."""
        return mgpu_nvfp4.available()

    def refusal(self, weight, compute_dtype):
        if not isinstance(weight, MosaicWeight):
            return "the weight has no copy in the Mosaic permuted layout"
        if jnp.dtype(compute_dtype) != jnp.bfloat16:
            return (f"compute dtype {jnp.dtype(compute_dtype).name} (the kernel computes in "
                    "bfloat16)")
        if weight.format not in FORMATS or weight.tile_k != mgpu_nvfp4_layout.TILE_K:
            return f"format {weight.format}, tile_k {weight.tile_k}"
        return self.unavailable()

    def launch_refusal(self, weight, lora_rank):
        if weight.mosaic_tiles is None or weight.pair_view is not None:
            return "no permuted buffer of its own"
        if weight.mosaic_tiles.shape[0] != rows(weight):
            return "its permuted buffer is a grouped launch's"
        if lora_rank is not None and lora_rank not in mgpu_nvfp4_layout.LORA_RANKS:
            return f"LoRA rank {lora_rank} (the kernel takes {mgpu_nvfp4_layout.LORA_RANKS})"
        return None

    def group_refusal(self, weights, lora_ranks):
        return group_launch_refusal(weights) or group_layout_refusal(weights, lora_ranks)

    def swiglu_refusal(self, m, weights, lora_ranks, lora_scales):
        del m
        reason = pair_launch_refusal(weights, lora_scales)
        if reason is not None:
            return reason
        if weights[0].mosaic_tiles is None:
            return "no permuted buffer"
        if lora_ranks is not None and (lora_ranks[0] != lora_ranks[1]
                                       or lora_ranks[0] not in mgpu_nvfp4_layout.LORA_RANKS):
            return (f"LoRA ranks {lora_ranks} (the kernel takes two equal ranks, one of "
                    f"{mgpu_nvfp4_layout.LORA_RANKS})")
        return None

    def repack(self, weights, *, tile_k=None, donate=False):
        """One launch's weights stored only in the permuted layout: one weight, a gate/up
        pair's two views (one buffer of the whole pair), or weights sharing x (one buffer of
        them stacked by rows); None where the kernel cannot read them."""
        del tile_k, donate
        weights = list(weights)
        if len(weights) == 1 or all(getattr(w, "pair_view", None) is not None for w in weights):
            if layout_refusal(weights[0]) is not None:
                return None
            buffer = permuted(weights[0])
            return [only_in(weight, buffer) for weight in weights]
        buffer = permuted_group(weights)
        return None if buffer is None else group_only_in(weights, buffer)

    def _prefetch_plan(self, weight, m: int):
        """The mgpu_nvfp4.L2Prefetch of a weight linked by with_prefetch (its launch at M = m,
        the following launch on the options' schedule), else None."""
        return prefetch_plan(weight, self.options.mosaic_prefetch_tiles, m,
                             self.options.mosaic_schedule)

    def apply(self, x, weight, *, compute_dtype):
        return self.apply_lora(x, weight, None, None, 0.0, compute_dtype=compute_dtype)

    def apply_backward(self, grad_output, weight, *, compute_dtype):
        return dequantize_backward(grad_output, weight, compute_dtype=compute_dtype,
                                   interpret=False)

    def apply_lora(self, x, weight, lora_x_a, lora_b, lora_scale, *, compute_dtype):
        """x [M, K] @ W^T (+ lora_scale * lora_x_a @ lora_b) -> [M, N] float32, rounded to bf16
        like the Triton fused kernel."""
        del compute_dtype
        schedule = self.options.mosaic_schedule
        kwargs = {}
        if lora_x_a is not None:
            operand = _prepared_lora_operand(weight, lora_x_a)
            kwargs = (dict(lora_x_a=lora_x_a, lora_bt=operand) if operand is not None
                      else dict(lora_x_a=lora_x_a, lora_b=lora_b, lora_scale=lora_scale))
        y = mgpu_nvfp4.mgpu_nvfp4_matmul(x.astype(jnp.bfloat16), weight.mosaic_tiles,
                                         weight.kernel_tensor_scale(), n=weight.shape[0],
                                         k=weight.shape[1],
                                         l2_prefetch=self._prefetch_plan(weight, x.shape[0]),
                                         config=TuningConfig(schedule=schedule), **kwargs)
        return y.astype(jnp.bfloat16).astype(jnp.float32)

    def apply_grouped(self, x, weights, lora_x_a, lora_bs, lora_scales, *, compute_dtype):
        """One matmul over the group's stacked buffer, each member's columns rescaled by its own
        2^8 / tensor_scale and rounded to bf16 (as the fused kernel's outputs) -> tuple of
        [M, N_i] float32."""
        del compute_dtype
        schedule = self.options.mosaic_schedule
        first = weights[0]
        n_pads = [w.kernel_rows for w in weights]
        lora = {}
        if lora_x_a is not None:
            operand = _prepared_lora_operand(first, lora_x_a)
            if operand is None or operand.shape[0] != sum(n_pads):
                operand = mgpu_nvfp4_layout.group_lora_operand(
                    lora_bs, [w.kernel_tensor_scale() for w in weights], lora_scales, n_pads)
            lora = dict(lora_x_a=lora_x_a, lora_bt=operand)
        y = mgpu_nvfp4.matmul_unscaled(x.astype(jnp.bfloat16), first.mosaic_tiles,
                                       n=sum(n_pads), k=first.shape[1],
                                       l2_prefetch=self._prefetch_plan(first, x.shape[0]),
                                       config=TuningConfig(schedule=schedule), **lora)
        outputs, offset = [], 0
        for weight, n_pad in zip(weights, n_pads):
            scale = (2.0 ** -mgpu_nvfp4_layout.SCALED_EXPONENT
                     / weight.kernel_tensor_scale().reshape(()))
            member = y[:, offset:offset + weight.shape[0]] * scale
            outputs.append(member.astype(jnp.bfloat16).astype(jnp.float32))
            offset += n_pad
        return tuple(outputs)

    def swiglu_lora_b(self, weights, lora_bs):
        """No operand made outside the loop: the launch reads the gate view's
        mosaic_lora_operand (with_pair_lora_operand), else builds its own."""
        del weights, lora_bs
        return None

    def apply_swiglu(self, x, weights, lora_x_a, lora_bs, lora_scales, pair_lora_b,
                     next_lora_a=None, *, compute_dtype):
        """silu(gate) * up [M, N] bf16 of a pair in one launch over its permuted buffer, the
        SwiGLU (and with next_lora_a its product with it) in the kernel's epilogue up to
        options.mosaic_swiglu_epilogue_max_m rows, else in XLA from the launch's output
        (mgpu_nvfp4_swiglu's `fused`). With next_lora_a: (output, output @ next_lora_a in
        compute dtype)."""
        del pair_lora_b
        schedule = self.options.mosaic_schedule
        epilogue_max_m = self.options.mosaic_swiglu_epilogue_max_m
        gate, up = weights
        half_block = gate.pair_view[0]
        lora = {}
        if lora_x_a is not None:
            operand = _prepared_lora_operand(gate, lora_x_a)
            if operand is None:
                operand = mgpu_nvfp4_layout.pair_lora_operand(
                    lora_bs[0], lora_bs[1], gate.kernel_tensor_scale(), up.kernel_tensor_scale(),
                    lora_scales[0], n_pad=gate.kernel_rows // 2, half_block=half_block)
            lora = dict(lora_x_a=lora_x_a, lora_bt=operand)
        result = mgpu_nvfp4.mgpu_nvfp4_swiglu(
            x.astype(jnp.bfloat16), gate.mosaic_tiles, gate.kernel_tensor_scale(),
            up.kernel_tensor_scale(), out_n=gate.shape[0], k=gate.shape[1],
            half_block=half_block, next_lora_a=next_lora_a,
            l2_prefetch=self._prefetch_plan(gate, x.shape[0]),
            config=TuningConfig(schedule=schedule, swiglu_epilogue_max_m=epilogue_max_m),
            **lora)
        if next_lora_a is None:
            return result
        y, next_x_a = result
        return y, next_x_a.astype(compute_dtype)


def prefetch_plan(weight, prefetch_tiles: int, m: int, schedule: str = "auto"):
    """The mgpu_nvfp4.L2Prefetch of a weight linked by with_prefetch (its launch at M = m,
    the following launch on `schedule`), else None."""
    target = getattr(weight, "mosaic_prefetch", None)
    if target is None or not prefetch_tiles:
        return None
    lora_a = getattr(weight, "mosaic_prefetch_lora_a", None)  # its width: the operand's
    extra = (lora_a if lora_a is not None and mgpu_nvfp4_tuning.extra_prefetchable(lora_a)
             else None)
    return mgpu_nvfp4_tuning.l2_prefetch_for(
        target, k=weight.mosaic_prefetch_k, ahead=prefetch_tiles, extra=extra, m=m,
        rank=None if lora_a is None else lora_a.shape[-1],
        config=TuningConfig(schedule=schedule))
