"""Pallas 4-bit kernels in the quantized linear op: weights repacked once, kernels picked by M.

    model = enable_kernels(model)                 # after quantizing / loading, before nnx.split

Run the model through nnx.split / nnx.merge and jax.jit (as the sampler and trainer do): an
nnx.jit call over the Module writes every array back as a new buffer, so arrays that views
share (a gate/up pair's, a single-copy q/k/v group's buffer) become separate copies
(measured on the CPU, tests/test_mgpu_nvfp4.py uses split/merge for that reason).
    enable_kernels(model, interpret=True)         # CPU tests: Pallas interpret mode

`enable_kernels` (1) replaces every QuantizedWeight of the model by a `KernelLayoutWeight`, the
same weight in the kernels' layout (nibble planes per K tile, zero padding; see
pallas_kernels/blockwise_matmul.py), made once here so that no repack runs inside jit; (2) makes
each SwiGLU MLP's gate and up weights two views of ONE interleaved copy (pair_mlp_weights,
KernelLayoutWeight.pair_view: no extra memory), which decode runs in one launch with the
SwiGLU in its epilogue (linear_op.linear_swiglu; measured on the H100: 7B gate|up + SwiGLU
41.9 us against 43.7 us for the grouped launch + XLA's SwiGLU, 7B rollout +0.4-0.7% in the
same calls, benchmarks/RESULTS.md sessions 12-13); and (3) registers the kernels with
qerl_jax.quant.linear_op for the platform. On a platform without kernels (CPU unless
interpret=True) it changes nothing and the XLA path runs.

Paths per format (from the H100 measurements in benchmarks/kernels_results.md; every kernel path
beat the XLA "dequantize with jnp, then dot" path at every measured shape and M):
  forward, M <= 64   "<format>_fused": the fused decode+matmul kernel (NVFP4 1.23-2.19x, MXFP4
                     1.16-2.28x, NF4 0.74-1.48x of a bf16 dot at M <= 16 outside k/v; the
                     naive XLA path 0.24-0.69x). A layer's unmerged LoRA adds its second
                     product (x @ A) @ B in this kernel's epilogue. Layers sharing their
                     input (q/k/v, gate/up) run in one launch (linear_op.linear_group).
  forward, M > 64    "<format>_dequantize_xla": the Pallas dequantize kernel writes W in bf16,
                     then one XLA (cuBLAS) dot (0.9-1.07x of bf16 at M >= 1024).
  backward dx=dy@W   dequantize kernel + XLA dot at every M: at M = 4096 it was 0.96-1.09x of
                     a bf16 dy @ W while the fused transposed kernel was 0.24-0.57x, and the
                     transposed kernel has no small-M timing (`small_m_backward="transposed"`
                     selects it for M <= 64; benchmarks/kernel_dispatch_check.py times both).
The kernels compute in bfloat16 (f32 accumulation): a layer whose compute dtype is not bfloat16
takes the XLA path, as does a weight still in the checkpoint layout; the reason is logged once.

KernelLayoutWeight is a QuantizedWeight (isinstance holds), so everything written for the
checkpoint layout keeps working: its `codes`, `block_scales`, `tensor_scale` and
`double_quant_scales` are the checkpoint arrays, unpacked losslessly on access (compressed-tensors
export, lora.merge_lora, get_format(...).dequantize), and `to_checkpoint()` returns the plain
QuantizedWeight. NF4 with double quantization keeps its uint8 scale codes and run absmax next to
the float32 absmax the kernels read (+1 byte per 64 weights over the kernel layout alone).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from pallas_kernels import blockwise_matmul as bw
from pallas_kernels import decode_attention as decode_attention_kernels
from pallas_kernels import nvfp4_matmul
from pallas_kernels.mxfp4_matmul import MAX_SCALE_CODE as MXFP4_MAX_SCALE_CODE
from pallas_kernels.mxfp4_matmul import MXFP4
from pallas_kernels.nf4_matmul import NF4
from pallas_kernels.nvfp4_matmul import NVFP4
from qerl_jax.models import attention_dispatch
from qerl_jax.quant import linear_op
from qerl_jax.quant.nf4 import dequantize_block_scales
from qerl_jax.quant.qarray import QuantizedWeight

logger = logging.getLogger(__name__)

SPECS: dict[str, bw.FormatSpec] = {"nvfp4": NVFP4, "mxfp4": MXFP4, "nf4": NF4}
# Element order within a checkpoint byte: True if element 2j is in the LOW nibble.
_LOW_NIBBLE_FIRST = {"nvfp4": True, "mxfp4": True, "nf4": False}
DEFAULT_TILE_K = 256
# Largest M of the fused forward kernel, per format (kernels_results.md, "Recommended dispatch
# thresholds"); the fused kernel's tilings stop at 64 rows, larger M go to dequantize + XLA.
FUSED_MAX_M = {"nvfp4": 64, "mxfp4": 64, "nf4": 64}
KERNEL_PLATFORMS = ("gpu",)


# ----------------------------------------------------------------------------------------------
# The kernel-layout weight


class KernelLayoutWeight(QuantizedWeight):
    """A QuantizedWeight stored in the Pallas kernels' layout (made by `to_kernel_layout`).

    Pytree children (frozen arrays): kernel_codes uint8 [N_pad, K_pad/2] (nibble planes),
    kernel_scales [N_pad, K_pad/B] (the format's scale dtype; NVFP4: canonical uint8 scale
    codes, pallas_kernels/nvfp4_matmul.py; NF4: float32 absmax), both stored tile-major
    (pallas_kernels.blockwise_matmul.tile_major),
    checkpoint_tensor_scale (the QuantizedWeight's tensor_scale, or None),
    nf4_scale_codes / nf4_double_quant_scales (NF4 double quantization only, else None),
    mosaic_tiles (or None): the same NVFP4 weight in the Mosaic GPU kernel's
    permuted layout (pallas_kernels.mgpu_nvfp4; made by enable_kernels on a Hopper GPU unless
    QERL_MOSAIC_NVFP4=0: the weight's only copy by default, see kernel_source;
    a second copy with QERL_MOSAIC_SINGLE_COPY=0). On the q projection of a grouped q/k/v
    launch it is the permuted buffer of [W_q; W_k; W_v] (mgpu_nvfp4.group_permuted; k and v
    then hold none).
    mosaic_lora_operand (or None): bf16 [N_pad, r], the Mosaic GPU kernel's
    operand for this layer's LoRA B (pallas_kernels.mgpu_nvfp4.lora_operand: B^T with the LoRA
    and tensor scales folded in; for a grouped q/k/v buffer the block-diagonal
    mgpu_nvfp4.group_lora_operand [sum N_pad, sum r]), made once per rollout on the sampler's
    merged copy (qerl_jax.lora.stack_grouped_adapters via `with_mosaic_lora_operand` /
    `with_mosaic_group_lora_operand`) so the decode loop does not transpose B at every token.
    mosaic_prefetch (or None): the next decode launch's permuted buffer (the
    same array, not a copy), whose first tiles this weight's Mosaic launch prefetches into L2
    (`link_mosaic_prefetch`, on the sampler's merged copy); mosaic_prefetch_k (static) its K;
    mosaic_prefetch_extra: the LoRA A that XLA's x @ A reads before that launch (also
    prefetched), or None.
    kernel_source (or None): the single-copy form (the Mosaic GPU path, unless
    QERL_MOSAIC_SINGLE_COPY=0): kernel_codes and kernel_scales are None and the weight's only
    copy is the permuted buffer kernel_source (its own mosaic_tiles, its pair's, or its q/k/v
    group's: the same array), its tiles from line kernel_source_line (static) on. Prefill and
    training (M > 64) get W in bf16 straight from it (pallas_kernels.permuted_dequantize,
    _pallas_dense); the other kernels' operands (packed(), kernel_arrays()) and the checkpoint
    view are unpermuted from it where they are used (mgpu_nvfp4.kernel_layout_from_permuted;
    inside jit a transient of one weight), bit for bit the arrays that were permuted.
    Static: format, shape (logical N, K), dtype, tile_k, pair_view, mosaic_prefetch_k,
    kernel_source_line.

    pair_view (half_block, half) or None: kernel_codes / kernel_scales are an MLP's gate and up
    interleaved in blocks of half_block rows ([2 N_pad, ...], `pair_gate_up`), and this weight
    is its half 0 (gate) or 1 (up). The gate and up weights hold the SAME two arrays, so the
    pair is the only copy in memory; the kernels read a half in place
    (pallas_kernels.blockwise_matmul.PackedWeight.pair_view), and the decode launch reads
    both with the SwiGLU in its epilogue (linear_op.linear_swiglu).

    The checkpoint-layout attributes (codes, block_scales, tensor_scale, double_quant_scales)
    are computed from these on access, losslessly (a pair view's from its own rows).
    """

    # Not dataclass fields: the base class's generated __init__/__eq__/__hash__ are bypassed.
    def __init__(self, *, kernel_codes, kernel_scales, checkpoint_tensor_scale=None,
                 nf4_scale_codes=None, nf4_double_quant_scales=None, mosaic_tiles=None,
                 mosaic_lora_operand=None, mosaic_prefetch=None, mosaic_prefetch_extra=None,
                 kernel_source=None, format: str,
                 shape: tuple[int, int], dtype: str = "bfloat16", tile_k: int,
                 pair_view: tuple[int, int] | None = None, mosaic_prefetch_k: int = 0,
                 kernel_source_line: int = 0):
        # No value checks: JAX rebuilds this object with tracers or placeholders as leaves.
        set_attr = object.__setattr__
        set_attr(self, "kernel_codes", kernel_codes)
        set_attr(self, "kernel_scales", kernel_scales)
        set_attr(self, "checkpoint_tensor_scale", checkpoint_tensor_scale)
        set_attr(self, "nf4_scale_codes", nf4_scale_codes)
        set_attr(self, "nf4_double_quant_scales", nf4_double_quant_scales)
        set_attr(self, "mosaic_tiles", mosaic_tiles)
        set_attr(self, "mosaic_lora_operand", mosaic_lora_operand)
        set_attr(self, "mosaic_prefetch", mosaic_prefetch)
        set_attr(self, "mosaic_prefetch_extra", mosaic_prefetch_extra)
        set_attr(self, "mosaic_prefetch_k", int(mosaic_prefetch_k))
        set_attr(self, "kernel_source", kernel_source)
        set_attr(self, "kernel_source_line", int(kernel_source_line))
        set_attr(self, "format", format)
        set_attr(self, "shape", tuple(int(d) for d in shape))
        set_attr(self, "dtype", jnp.dtype(dtype).name)
        set_attr(self, "tile_k", int(tile_k))
        set_attr(self, "pair_view", None if pair_view is None else tuple(int(v) for v in pair_view))

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return (f"KernelLayoutWeight(format={self.format!r}, shape={self.shape}, "
                f"dtype={self.dtype!r}, tile_k={self.tile_k}, "
                f"kernel_rows={self.kernel_rows}"
                + ("" if self.kernel_source is None else ", single copy in the permuted layout")
                + ("" if self.pair_view is None else f", pair_view={self.pair_view}") + ")")

    # pytree protocol
    _CHILDREN = ("kernel_codes", "kernel_scales", "checkpoint_tensor_scale", "nf4_scale_codes",
                 "nf4_double_quant_scales", "mosaic_tiles", "mosaic_lora_operand",
                 "mosaic_prefetch", "mosaic_prefetch_extra", "kernel_source")
    _STATIC = ("format", "shape", "dtype", "tile_k", "pair_view", "mosaic_prefetch_k",
               "kernel_source_line")

    def _aux(self):
        return tuple(getattr(self, name) for name in self._STATIC)

    def tree_flatten_with_keys(self):
        children = tuple((jax.tree_util.GetAttrKey(name), getattr(self, name))
                         for name in self._CHILDREN)
        return children, self._aux()

    def tree_flatten(self):
        return tuple(getattr(self, name) for name in self._CHILDREN), self._aux()

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(**dict(zip(cls._CHILDREN, children)), **dict(zip(cls._STATIC, aux)))

    # the kernels' view
    @property
    def spec(self) -> bw.FormatSpec:
        return SPECS[self.format]

    @property
    def kernel_rows(self) -> int:
        """Rows N_pad of the kernel-layout arrays (2 N_pad for a gate/up pair view), static."""
        if self.kernel_codes is not None:
            return int(self.kernel_codes.shape[0])
        n_pad = bw.padded_sizes(*self.shape, self.tile_k)[0]
        return 2 * n_pad if self.pair_view is not None else n_pad

    @property
    def kernel_code_columns(self) -> int:
        """Columns K_pad / 2 of kernel_codes, static."""
        if self.kernel_codes is not None:
            return int(self.kernel_codes.shape[1])
        return bw.padded_sizes(*self.shape, self.tile_k)[1] // 2

    @property
    def single_copy(self) -> bool:
        """True if the weight is stored only in the Mosaic permuted layout (kernel_source)."""
        return self.kernel_codes is None and self.kernel_source is not None

    def kernel_arrays(self) -> tuple[jax.Array, jax.Array]:
        """(kernel_codes, kernel_scales), tile-major [kernel_rows, ...]: the arrays, or for a
        single-copy weight their unpermuted form (computed: a transient inside jit)."""
        if self.kernel_codes is not None:
            return self.kernel_codes, self.kernel_scales
        if self.kernel_source is None:
            raise ValueError("KernelLayoutWeight: neither kernel_codes nor kernel_source")
        from pallas_kernels import mgpu_nvfp4
        return mgpu_nvfp4.kernel_layout_from_permuted(
            self.kernel_source, rows=self.kernel_rows, k=self.shape[1],
            line=self.kernel_source_line)

    def packed(self) -> bw.PackedWeight:
        """The pallas_kernels PackedWeight: kernel_arrays() (for a stored layout the arrays as
        they are) and the kernels' divisor [1] (NVFP4's tensor scale, else 1)."""
        codes, scales = self.kernel_arrays()
        return bw.PackedWeight(codes=codes, scales=scales, tensor_scale=self.kernel_divisor(),
                               fmt=self.format, n=self.shape[0], k=self.shape[1],
                               tile_k=self.tile_k, pair_view=self.pair_view)

    def kernel_divisor(self) -> jax.Array:
        """The kernels' divisor [1] (NVFP4's tensor scale, else 1), as packed() holds it."""
        if self.format == "nvfp4":
            return jnp.asarray(self.checkpoint_tensor_scale, jnp.float32).reshape(1)
        return jnp.ones((1,), jnp.float32)

    def _row_major(self, scales: bool) -> jax.Array:
        """kernel_codes (scales False) or kernel_scales stored row by row (both are stored
        tile-major, pallas_kernels.blockwise_matmul.tile_major); only that one is converted."""
        codes, block_scales = self.kernel_arrays()
        code_cols, scale_cols = bw.tile_columns(codes.shape[1], block_scales.shape[1],
                                                self.tile_k)
        if scales:
            return bw.row_major(block_scales, scale_cols)
        return bw.row_major(codes, code_cols)

    def _own_rows(self, array: jax.Array) -> jax.Array:
        """This weight's rows [N_pad, ...] of a row-major kernel-layout array (a copy for a pair
        view)."""
        if self.pair_view is None:
            return array
        half_block, half = self.pair_view
        rows, width = array.shape
        return array.reshape(rows // (2 * half_block), 2, half_block, width)[:, half].reshape(
            rows // 2, width)

    # the checkpoint view
    @property
    def codes(self):
        n, k = self.shape
        return bw.from_plane_layout(self._own_rows(self._row_major(scales=False)), n=n, k=k,
                                    tile_k=self.tile_k,
                                    low_nibble_first=_LOW_NIBBLE_FIRST[self.format])

    @property
    def block_scales(self):
        if self.nf4_scale_codes is not None:
            return self.nf4_scale_codes
        n, k = self.shape
        scales = self._own_rows(self._row_major(scales=True))[:n, :k // self.spec.scale_block]
        return nvfp4_matmul.checkpoint_scales(scales) if self.format == "nvfp4" else scales

    @property
    def tensor_scale(self):
        return self.checkpoint_tensor_scale

    @property
    def double_quant_scales(self):
        return self.nf4_double_quant_scales

    def to_checkpoint(self) -> QuantizedWeight:
        """The plain QuantizedWeight (checkpoint layout), bit for bit what was repacked."""
        return QuantizedWeight(codes=self.codes, block_scales=self.block_scales,
                               tensor_scale=self.tensor_scale,
                               double_quant_scales=self.double_quant_scales,
                               format=self.format, shape=self.shape, dtype=self.dtype)

    def dequantize(self, dtype=None) -> jax.Array:
        """The dense weight [N, K] (through the checkpoint view: the format's exact jnp code)."""
        return self.to_checkpoint().dequantize(dtype)


jax.tree_util.register_pytree_with_keys_class(KernelLayoutWeight)


def default_tile_k(format_name: str, in_features: int) -> int:
    """K tile of the kernel layout: 256 (the measured default; 512 for the large MLP weights was
    no faster in the 7B rollout, benchmarks/RESULTS.md session 4); smaller for K < 256 (less
    padding), at least 2 scale blocks and 32."""
    block = SPECS[format_name].scale_block
    return max(min(DEFAULT_TILE_K, bw._next_pow2(in_features)), 2 * block, 32)


def _repack_arrays(weight: QuantizedWeight, tile_k: int) -> KernelLayoutWeight:
    n, k = weight.shape
    fmt = weight.format
    block = SPECS[fmt].scale_block
    n_pad, k_pad = bw.padded_sizes(n, k, tile_k)
    codes = bw.to_plane_layout(weight.codes, k=k, tile_k=tile_k,
                               low_nibble_first=_LOW_NIBBLE_FIRST[fmt])
    scale_codes = run_absmax = None
    if fmt == "nvfp4":  # canonical scale codes (pallas_kernels/nvfp4_matmul.py)
        scales = nvfp4_matmul.kernel_layout_scales(weight.block_scales, n_pad=n_pad, k_pad=k_pad)
    else:
        if fmt == "nf4" and weight.double_quant_scales is not None:
            # the format's own decode, so dequantize() of both layouts agrees bit for bit
            scale_codes, run_absmax = weight.block_scales, weight.double_quant_scales
            absmax = dequantize_block_scales(scale_codes.reshape(-1), run_absmax,
                                             weight.tensor_scale).reshape(scale_codes.shape)
        elif fmt == "nf4":
            absmax = weight.block_scales.astype(jnp.float32)
        else:
            absmax = weight.block_scales
        scales = bw.pad_scales(absmax, n_pad=n_pad, k_pad=k_pad, block=block)
    codes, scales = bw.tile_major_arrays(codes, scales, tile_k)
    return KernelLayoutWeight(kernel_codes=codes, kernel_scales=scales,
                              checkpoint_tensor_scale=weight.tensor_scale,
                              nf4_scale_codes=scale_codes, nf4_double_quant_scales=run_absmax,
                              format=fmt, shape=weight.shape, dtype=weight.dtype, tile_k=tile_k)


_repack = jax.jit(_repack_arrays, static_argnames=("tile_k",))
# The same program with the checkpoint-layout arrays donated: where no padding is needed the
# kernel codes are written into the codes' buffer and the scales keep theirs, so the repack
# allocates nothing that stays.
_repack_donating = jax.jit(_repack_arrays, static_argnames=("tile_k",), donate_argnums=(0,))


def kernel_refusal(weight: QuantizedWeight) -> str | None:
    """Why the kernels cannot take this (checkpoint-layout) weight, or None. Needs concrete
    arrays (run at load time)."""
    if weight.format not in SPECS:
        return f"no kernel for format {weight.format!r}"
    if weight.format == "nvfp4":
        bad = int(nvfp4_matmul.invalid_scale_count(weight.block_scales))
        if bad:
            return (f"{bad} NVFP4 block scales are negative or NaN (the format's scales are "
                    "unsigned, UE4M3)")
    if weight.format == "mxfp4":
        top = int(jnp.max(weight.block_scales)) if weight.block_scales.size else 0
        if top > MXFP4_MAX_SCALE_CODE:
            return (f"an MXFP4 block scale code is {top} > {MXFP4_MAX_SCALE_CODE} (2^27), beyond "
                    "the kernels' decode range")
    return None


def to_kernel_layout(weight: QuantizedWeight, *, tile_k: int | None = None,
                     donate: bool = False) -> QuantizedWeight:
    """Repacks one checkpoint-layout QuantizedWeight into a KernelLayoutWeight (lossless).

    Already-repacked weights are returned as they are; a weight the kernels cannot take is
    returned unchanged (it keeps the XLA path) with a warning naming the reason.
    donate=True consumes `weight` where the kernel layout needs no padding (its buffers become
    the kernel layout's; `weight` must not be used afterwards): what enable_kernels does to a
    Module, whose weights it replaces in place.
    """
    if isinstance(weight, KernelLayoutWeight):
        return weight
    refusal = kernel_refusal(weight)
    if refusal is not None:
        logger.warning("kernel layout: keeping a %s weight %s in the checkpoint layout (XLA "
                       "path): %s", weight.format, weight.shape, refusal)
        return weight
    tile_k = tile_k or default_tile_k(weight.format, weight.shape[1])
    unpadded = bw.padded_sizes(*weight.shape, tile_k) == tuple(weight.shape)
    return (_repack_donating if donate and unpadded else _repack)(weight, tile_k)


def _is_quantized(value) -> bool:
    return isinstance(value, QuantizedWeight)


def prepare_for_kernels(tree: Any, *, tile_k: int | None = None) -> Any:
    """Pure: the same pytree (params, an nnx.State, a single weight) with every QuantizedWeight
    in the kernel layout."""
    return jax.tree_util.tree_map(
        lambda v: to_kernel_layout(v, tile_k=tile_k) if _is_quantized(v) else v, tree,
        is_leaf=_is_quantized)


def restore_checkpoint_layout(tree: Any) -> Any:
    """Pure inverse of prepare_for_kernels: every KernelLayoutWeight back to a QuantizedWeight."""
    def restore(value):
        return value.to_checkpoint() if isinstance(value, KernelLayoutWeight) else value
    return jax.tree_util.tree_map(restore, tree, is_leaf=_is_quantized)


# ----------------------------------------------------------------------------------------------
# Gate/up pairs: one interleaved copy of an MLP's gate and up weights

PAIR_HALF_BLOCK = 32  # rows per block: the decode launch's 64-row tiles hold 32 gate + 32 up


def pair_refusal(gate, up, half_block: int = PAIR_HALF_BLOCK) -> str | None:
    """Why gate and up cannot become pair views (pair_gate_up), or None."""
    if not (isinstance(gate, KernelLayoutWeight) and isinstance(up, KernelLayoutWeight)):
        return "they are not both in the kernel layout"
    if gate.pair_view is not None or up.pair_view is not None:
        return "they are pair views already"
    if gate.kernel_codes is None or up.kernel_codes is None:
        return "a weight is stored only in the Mosaic permuted layout (single copy)"
    described = [(w.format, w.shape, w.dtype, w.tile_k, tuple(w.kernel_codes.shape),
                  tuple(w.kernel_scales.shape)) for w in (gate, up)]
    if described[0] != described[1]:
        return f"gate {described[0]} and up {described[1]} differ in format, shape or layout"
    if gate.kernel_codes.shape[0] % half_block:
        return f"padded N {gate.kernel_codes.shape[0]} is not a multiple of {half_block}"
    return None


_interleaved_pair = jax.jit(bw.interleave_tile_major_arrays,
                            static_argnames=("half_block", "tile_k"))


def pair_gate_up(gate: KernelLayoutWeight, up: KernelLayoutWeight, *,
                 half_block: int = PAIR_HALF_BLOCK) -> tuple[KernelLayoutWeight, ...]:
    """(gate view, up view) of ONE interleaved copy of a SwiGLU MLP's gate and up kernel-layout
    weights [N, K]: rows in blocks of half_block, gate block j then up block j
    (pallas_kernels.blockwise_matmul.interleave_gate_up). Both views hold the same two arrays
    (codes [2 N_pad, K_pad/2], scales [2 N_pad, K_pad/B]) and their own tensor scale and NF4
    double-quantization arrays; each is bit for bit the weight it replaces (checkpoint view,
    dequantize, every kernel). Lossless; ValueError (pair_refusal) when they cannot pair."""
    refusal = pair_refusal(gate, up, half_block)
    if refusal is not None:
        raise ValueError(f"pair_gate_up: {refusal}")
    codes, scales = _interleaved_pair(gate.kernel_codes, up.kernel_codes, gate.kernel_scales,
                                      up.kernel_scales, half_block=half_block,
                                      tile_k=gate.tile_k)
    return tuple(KernelLayoutWeight(
        kernel_codes=codes, kernel_scales=scales,
        checkpoint_tensor_scale=weight.checkpoint_tensor_scale,
        nf4_scale_codes=weight.nf4_scale_codes,
        nf4_double_quant_scales=weight.nf4_double_quant_scales, format=weight.format,
        shape=weight.shape, dtype=weight.dtype, tile_k=weight.tile_k,
        pair_view=(half_block, half)) for half, weight in enumerate((gate, up)))


def _gate_up_modules(model: nnx.Module):
    """(path, module) of every submodule with gate_proj and up_proj layers (SwiGLU MLPs)."""
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and all(
                isinstance(getattr(getattr(node, name, None), "weight", None), nnx.Variable)
                for name in ("gate_proj", "up_proj")):
            yield path, node


def pair_mlp_weights(model: nnx.Module, *, half_block: int = PAIR_HALF_BLOCK) -> int:
    """In place: each SwiGLU MLP's gate_proj / up_proj kernel-layout weights become pair views
    of one interleaved copy (pair_gate_up); returns how many MLPs were paired. MLPs whose
    weights cannot pair (pair_refusal: another format, the checkpoint layout, ...) are left
    as they are, with the reason logged once per reason."""
    count, reasons = 0, set()
    for _, module in _gate_up_modules(model):
        gate_param, up_param = module.gate_proj.weight, module.up_proj.weight
        gate, up = gate_param.get_value(), up_param.get_value()
        if isinstance(gate, KernelLayoutWeight) and gate.pair_view is not None:
            continue
        refusal = pair_refusal(gate, up, half_block)
        if refusal is not None:
            if refusal not in reasons and isinstance(gate, QuantizedWeight):
                reasons.add(refusal)
                logger.info("gate/up pairs: an MLP keeps separate weights: %s", refusal)
            continue
        gate_view, up_view = pair_gate_up(gate, up, half_block=half_block)
        gate_param.set_value(gate_view)
        up_param.set_value(up_view)
        count += 1
    return count


# ----------------------------------------------------------------------------------------------
# The kernels as linear_op sees them


def _supports(weight, compute_dtype) -> str | None:
    if not isinstance(weight, KernelLayoutWeight):
        return ("the weight is in the checkpoint layout (call "
                "qerl_jax.quant.kernel_dispatch.enable_kernels after loading the model)")
    if jnp.dtype(compute_dtype) != jnp.bfloat16:
        return f"compute dtype {jnp.dtype(compute_dtype).name} (the kernels compute in bfloat16)"
    return None


# Sessions 20-25: single-weight NVFP4 launches at decode M (the o and down projections), the
# grouped q|k|v launches and the fused SwiGLU launches of gate/up pairs on the Mosaic GPU kernel
# (pallas_kernels.mgpu_nvfp4), reading those weights in its permuted layout
# (KernelLayoutWeight.mosaic_tiles, made by enable_kernels; by default their only copy, which
# prefill and training dequantize directly: KernelLayoutWeight.kernel_source). On by default
# (since session 26) where the kernel runs (a Hopper GPU; LoRA ranks in mgpu_nvfp4.LORA_RANKS);
# QERL_MOSAIC_NVFP4=0 at registration keeps the Triton kernels. Session 26 measured the GRPO
# step with and without it in one call each: 7B rollout 3.27-3.49 s against 3.47-3.68, 14B
# 5.89-6.05 against 6.72-6.91, training within 0.06 s (RESULTS.md, session 26).
_MOSAIC_NVFP4 = {"single": False, "prefetch_ahead": 0, "prefetch_lora_a": True,
                 "swiglu_epilogue": True, "single_copy": True, "permuted_dequantize": True}
MOSAIC_FLAG = "QERL_MOSAIC_NVFP4"


def _env_switch(name: str, meaning: str, default: bool = True) -> bool:
    """$name as an on/off switch: "1" on, "0" off, unset the default; any other value is a
    ValueError naming the variable and what it switches (`meaning`)."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{name}={value!r}: 1 or 0 ({meaning}; unset: "
                         f"{'1' if default else '0'})")
    return default if value == "" else value == "1"


def _mosaic_flag() -> tuple[bool, bool]:
    """(whether the Mosaic GPU NVFP4 path is on, whether $QERL_MOSAIC_NVFP4 says so
    explicitly): on unless the variable is "0"."""
    on = _env_switch(MOSAIC_FLAG, "1: the Mosaic GPU NVFP4 kernel where it runs, 0: the "
                                  "Triton kernels")
    return on, os.environ.get(MOSAIC_FLAG, "").strip() != ""


def _mosaic_refusal(x, weight, down) -> str | None:
    """Why the Mosaic GPU kernel does not take this single-weight launch, or None (from the
    weight's metadata only: no kernel-layout arrays, which a single copy would unpermute)."""
    from pallas_kernels import mgpu_nvfp4
    if (not _MOSAIC_NVFP4["single"] or getattr(weight, "mosaic_tiles", None) is None
            or weight.pair_view is not None):
        return "off"
    if weight.mosaic_tiles.shape[0] != _mosaic_rows(weight):
        return "its permuted buffer is a grouped launch's"
    if x.shape[0] > mgpu_nvfp4.MAX_M:
        return f"M {x.shape[0]}"
    if down is not None and down.shape[1] not in mgpu_nvfp4.LORA_RANKS:
        return f"LoRA rank {down.shape[1]}"
    if weight.format != "nvfp4" or weight.tile_k != mgpu_nvfp4.TILE_K:
        return f"format {weight.format}, tile_k {weight.tile_k}"
    return mgpu_nvfp4.available()


def _mosaic_rows(weight: KernelLayoutWeight) -> int:
    """Rows of the permuted buffer of this (not paired) weight alone."""
    from pallas_kernels import mgpu_nvfp4
    k_tiles = -(-weight.shape[1] // mgpu_nvfp4.TILE_K)
    return weight.kernel_rows // mgpu_nvfp4.TILE_ROWS * k_tiles * mgpu_nvfp4.TILE_LINES


def _prepared_lora_operand(weight, down):
    """The weight's per-rollout Mosaic LoRA operand if it fits this launch's rank, else None."""
    operand = getattr(weight, "mosaic_lora_operand", None)
    if operand is None or operand.shape[1] != down.shape[1]:
        return None
    return operand


def _replace_children(weight: KernelLayoutWeight, **changes) -> KernelLayoutWeight:
    """The same KernelLayoutWeight with some pytree children or static fields replaced."""
    names = KernelLayoutWeight._CHILDREN + KernelLayoutWeight._STATIC
    unknown = sorted(set(changes) - set(names))
    if unknown:
        raise TypeError(f"_replace_children: {unknown} are not KernelLayoutWeight fields")
    return KernelLayoutWeight(**{name: changes.get(name, getattr(weight, name))
                                 for name in names})


def _prefetch_plan(weight):
    """The mgpu_nvfp4.L2Prefetch of a weight linked by link_mosaic_prefetch, else None."""
    target = getattr(weight, "mosaic_prefetch", None)
    if target is None or not _MOSAIC_NVFP4["prefetch_ahead"]:
        return None
    from pallas_kernels import mgpu_nvfp4
    extra = getattr(weight, "mosaic_prefetch_extra", None)
    if extra is not None and (not _MOSAIC_NVFP4["prefetch_lora_a"]
                              or not mgpu_nvfp4.extra_prefetchable(extra)):
        extra = None
    return mgpu_nvfp4.l2_prefetch_for(target, k=weight.mosaic_prefetch_k,
                                      ahead=_MOSAIC_NVFP4["prefetch_ahead"], extra=extra)


def link_mosaic_prefetch(model) -> int:
    """The Mosaic GPU path only (QERL_MOSAIC_PREFETCH=N, N in 1-3, default 1, 0 off).

    In decode order (each layer's q|k|v, o, gate|up and down launches, then the next layer's),
    each weight whose launch runs on the Mosaic GPU kernel gets the next such launch's permuted
    buffer (mosaic_prefetch, the same array) and its K, and the LoRA A of the x @ A that runs
    before that launch (mosaic_prefetch_extra: o's A, read by the attention's combine; the
    MLP's and the next attention's stacked A from stack_grouped_adapters; down's A), if any.
    The launch then prefetches into L2, after its own K loop, the first N K tiles of each of
    the next launch's programs and (unless QERL_MOSAIC_PREFETCH_LORA_A=0) that A
    (mgpu_nvfp4.L2Prefetch). In place, on the sampler's merged copy (like
    stack_grouped_adapters); returns the links made (0 when off)."""
    if not (_MOSAIC_NVFP4["single"] and _MOSAIC_NVFP4["prefetch_ahead"]):
        return 0

    def lora_a(linear):
        variable = getattr(linear, "lora_a", None)
        return None if variable is None else variable.get_value()

    chain = []  # (weight variable, the LoRA A read by the x @ A before its launch)
    for layer in getattr(model, "layers", ()):
        attention, mlp = layer.self_attn, layer.mlp
        chain += [(attention.q_proj.weight, getattr(attention, "grouped_lora_a", None)),
                  (attention.o_proj.weight, lora_a(attention.o_proj)),
                  (mlp.gate_proj.weight, getattr(mlp, "grouped_lora_a", None)),
                  (mlp.down_proj.weight, lora_a(mlp.down_proj))]
    count = 0
    for (node, _), (following, following_a) in zip(chain, chain[1:]):
        value, target = node.get_value(), following.get_value()
        if not (isinstance(value, KernelLayoutWeight) and isinstance(target, KernelLayoutWeight)
                and value.mosaic_tiles is not None and target.mosaic_tiles is not None):
            continue
        node.set_value(_replace_children(value, mosaic_prefetch=target.mosaic_tiles,
                                         mosaic_prefetch_extra=following_a,
                                         mosaic_prefetch_k=target.shape[1]))
        count += 1
    return count


def with_mosaic_lora_operand(weight, lora_b: jax.Array, lora_scale: float):
    """The Mosaic GPU path: the weight carrying its adapter's Mosaic GPU LoRA
    operand (mosaic_lora_operand, from lora_b [r, N] and the LoRA scale) when the Mosaic kernel
    would take its decode launches, else the weight unchanged. For the sampler's merged copy,
    before its decode loop (qerl_jax.lora.stack_grouped_adapters); never on a trained state."""
    from pallas_kernels import mgpu_nvfp4
    if (not _MOSAIC_NVFP4["single"] or getattr(weight, "mosaic_tiles", None) is None
            or weight.pair_view is not None or lora_b.ndim != 2
            or lora_b.shape[0] not in mgpu_nvfp4.LORA_RANKS
            or weight.mosaic_tiles.shape[0] != _mosaic_rows(weight)):
        return weight
    operand = mgpu_nvfp4.lora_operand(lora_b, weight.kernel_divisor(), lora_scale,
                                      n_pad=weight.kernel_rows)
    return _replace_children(weight, mosaic_lora_operand=operand)


def with_mosaic_pair_lora_operand(gate, up, gate_b: jax.Array, up_b: jax.Array,
                                  lora_scale: float):
    """The Mosaic GPU path: the gate pair view carrying the pair's Mosaic GPU
    LoRA operand (mgpu_nvfp4.pair_lora_operand of B_gate and B_up [r, N]) when the Mosaic
    SwiGLU launch would take the pair, else the gate view unchanged (as
    with_mosaic_lora_operand, for the sampler's merged copy)."""
    from pallas_kernels import mgpu_nvfp4
    if (not _MOSAIC_NVFP4["single"] or getattr(gate, "mosaic_tiles", None) is None
            or gate.pair_view is None or getattr(up, "pair_view", None) is None
            or gate_b.shape != up_b.shape or gate_b.shape[0] not in mgpu_nvfp4.LORA_RANKS):
        return gate
    operand = mgpu_nvfp4.pair_lora_operand(
        gate_b, up_b, gate.kernel_divisor(), up.kernel_divisor(), lora_scale,
        n_pad=gate.kernel_rows // 2, half_block=gate.pair_view[0])
    return _replace_children(gate, mosaic_lora_operand=operand)


def _mosaic_group_layout_refusal(weights, lora_bs) -> str | None:
    """Why the Mosaic GPU kernel cannot take a grouped launch of these weights (and LoRA Bs,
    or None without LoRA) whatever the input, or None: the flag, the first weight holding the
    permuted buffer of all of them stacked by rows (the others none), the LoRA ranks (each in
    LORA_RANKS, their sum a kernel operand width)."""
    from pallas_kernels import mgpu_nvfp4
    first = weights[0]
    if (not _MOSAIC_NVFP4["single"] or getattr(first, "mosaic_tiles", None) is None
            or any(getattr(w, "pair_view", None) is not None
                   or getattr(w, "mosaic_tiles", None) is not None for w in weights[1:])):
        return "off"
    if first.mosaic_tiles.shape[0] != sum(_mosaic_rows(w) for w in weights):
        return "the first weight's permuted buffer is not the group's"
    if lora_bs is not None and (
            any(b.ndim != 2 or b.shape[0] not in mgpu_nvfp4.LORA_RANKS for b in lora_bs)
            or not mgpu_nvfp4.operand_rank_ok(sum(b.shape[0] for b in lora_bs))):
        return f"LoRA B {[b.shape for b in lora_bs]}"
    return None


def _mosaic_group_refusal(x, weights, down, lora_bs) -> str | None:
    """Why the Mosaic GPU kernel does not take this grouped launch, or None:
    _mosaic_group_layout_refusal, M, down [M, sum r_i]."""
    from pallas_kernels import mgpu_nvfp4
    reason = _mosaic_group_layout_refusal(weights, None if down is None else lora_bs)
    if reason is not None:
        return reason
    if x.ndim != 2 or x.shape[0] > mgpu_nvfp4.MAX_M:
        return f"x {x.shape}"
    if down is not None and down.shape[1] != sum(b.shape[0] for b in lora_bs):
        return f"LoRA down {down.shape}, B {[b.shape for b in lora_bs]}"
    return mgpu_nvfp4.available()


def with_mosaic_group_lora_operand(weights, lora_bs, lora_scales):
    """The Mosaic GPU path: the first weight of a grouped launch (q of q/k/v)
    carrying the group's Mosaic GPU LoRA operand (mgpu_nvfp4.group_lora_operand of the B_i
    [r_i, N_i] with their LoRA scales) when the Mosaic kernel would take the launch's layout,
    else unchanged (as with_mosaic_lora_operand, for the sampler's merged copy)."""
    from pallas_kernels import mgpu_nvfp4
    weights = tuple(weights)
    if _mosaic_group_layout_refusal(weights, tuple(lora_bs)) is not None:
        return weights[0]
    operand = mgpu_nvfp4.group_lora_operand(
        lora_bs, [w.kernel_divisor() for w in weights], lora_scales,
        [w.kernel_rows for w in weights])
    return _replace_children(weights[0], mosaic_lora_operand=operand)


def _mosaic_group_forward(x, weights, down, lora_bs, scales):
    """The grouped launch on the Mosaic GPU kernel: one matmul over the stacked buffer, each
    member's columns rescaled by its own 2^8 / tensor_scale and rounded to bf16 (as the fused
    kernel's outputs) -> tuple of [M, N_i] float32."""
    from pallas_kernels import mgpu_nvfp4
    first = weights[0]
    n_pads = [w.kernel_rows for w in weights]
    lora = {}
    if down is not None:
        operand = _prepared_lora_operand(first, down)
        if operand is None or operand.shape[0] != sum(n_pads):
            operand = mgpu_nvfp4.group_lora_operand(
                lora_bs, [w.kernel_divisor() for w in weights], scales, n_pads)
        lora = dict(lora_down=down, lora_bt=operand)
    y = mgpu_nvfp4.matmul_unscaled(x.astype(jnp.bfloat16), first.mosaic_tiles, n=sum(n_pads),
                                   k=first.shape[1], l2_prefetch=_prefetch_plan(first), **lora)
    outputs, offset = [], 0
    for weight, n_pad in zip(weights, n_pads):
        scale = 2.0 ** -mgpu_nvfp4.SCALED_EXPONENT / weight.kernel_divisor().reshape(())
        member = y[:, offset:offset + weight.shape[0]] * scale
        outputs.append(member.astype(jnp.bfloat16).astype(jnp.float32))
        offset += n_pad
    return tuple(outputs)


_SINGLE_COPY_FALLBACKS: set = set()


def _note_single_copy_fallback(weights, launch: str, reason: str) -> None:
    """Logs once per (launch, shapes, reason) that a small-M launch of single-copy weights
    (KernelLayoutWeight.kernel_source) takes a Triton kernel instead of the Mosaic one: that
    kernel reads the kernel layout, which is then unpermuted at every call (in the sampler's
    decode loop, at every step, unless XLA hoists it: a transient copy)."""
    if not any(getattr(w, "single_copy", False) for w in weights):
        return
    key = (launch, tuple(w.shape for w in weights), reason)
    if key in _SINGLE_COPY_FALLBACKS:
        return
    _SINGLE_COPY_FALLBACKS.add(key)
    logger.warning("QERL_MOSAIC_NVFP4: the %s launch of NVFP4 weights %s, stored only in the "
                   "permuted layout, takes the Triton kernel (%s) and unpermutes them at every "
                   "call; QERL_MOSAIC_SINGLE_COPY=0 keeps a kernel-layout copy instead", launch,
                   [w.shape for w in weights], reason)


def _fused_forward_lora(x, weight, down, lora_b, scale, *, compute_dtype, interpret):
    """x [M, K] bf16 @ W^T (+ scale * down [M, r] @ lora_b [r, N], the LoRA product in the
    kernel's epilogue, when down is given) -> [M, N] float32 (fused kernel, output rounded to
    bf16 inside)."""
    del compute_dtype
    refusal = "interpret mode" if interpret else _mosaic_refusal(x, weight, down)
    if refusal is None:
        from pallas_kernels import mgpu_nvfp4
        kwargs = {}
        if down is not None:
            operand = _prepared_lora_operand(weight, down)
            kwargs = (dict(lora_down=down, lora_bt=operand) if operand is not None
                      else dict(lora_down=down, lora_b=lora_b, lora_scale=scale))
        y = mgpu_nvfp4.mgpu_nvfp4_matmul(x.astype(jnp.bfloat16), weight.mosaic_tiles,
                                         weight.kernel_divisor(), n=weight.shape[0],
                                         k=weight.shape[1], l2_prefetch=_prefetch_plan(weight),
                                         **kwargs)
        return y.astype(jnp.bfloat16).astype(jnp.float32)  # rounded like the fused kernel
    _note_single_copy_fallback((weight,), "single-weight", refusal)
    packed = weight.packed()
    config = bw.default_matmul_config(x.shape[0], packed)
    return bw.blockwise_matmul(x, packed, spec=weight.spec, config=config, interpret=interpret,
                               lora_down=down, lora_b=lora_b,
                               lora_scale=scale).astype(jnp.float32)


def _fused_forward_group(x, weights, down, lora_bs, scales, *, compute_dtype, interpret):
    """x [M, K] bf16 @ W_i^T (+ scales[i] * down_i @ lora_bs[i], down = the members' x @ A_i
    side by side) for weights sharing x, in one fused-kernel launch -> tuple of [M, N_i]
    float32."""
    del compute_dtype
    refusal = "interpret mode" if interpret else _mosaic_group_refusal(x, weights, down, lora_bs)
    if refusal is None:
        return _mosaic_group_forward(x, weights, down, lora_bs, scales)
    _note_single_copy_fallback(weights, "grouped", refusal)
    packed = tuple(w.packed() for w in weights)
    config = bw.default_group_matmul_config(x.shape[0], packed)
    ys = bw.blockwise_matmul_group(x, packed, spec=weights[0].spec, config=config,
                                   interpret=interpret, lora_down=down, lora_bs=lora_bs,
                                   lora_scales=scales)
    return tuple(y.astype(jnp.float32) for y in ys)


def _group_supports(weights) -> str | None:
    """Why these kernel-layout weights cannot share one launch (None: they can)."""
    first = weights[0]
    if any(weight.pair_view is not None for weight in weights):
        return ("gate/up pair views (their launch is the fused SwiGLU one, "
                "linear_op.linear_swiglu)")
    for weight in weights[1:]:
        if (weight.format, weight.shape[1], weight.tile_k, weight.kernel_code_columns) != (
                first.format, first.shape[1], first.tile_k, first.kernel_code_columns):
            return (f"{weight.format} {weight.shape} tile_k {weight.tile_k} vs {first.format} "
                    f"{first.shape} tile_k {first.tile_k} (a launch needs one format, K and "
                    "K tile)")
    return None


def _swiglu_supports(m, weights, scales) -> str | None:
    """Why the fused SwiGLU launch cannot take this (gate, up) at M rows (None: it can): they
    must be the two pair views of one interleaved pair (pair_mlp_weights), with one LoRA
    scale."""
    del m
    gate, up = weights
    if not (isinstance(gate, KernelLayoutWeight) and isinstance(up, KernelLayoutWeight)):
        return "gate and up are not in the kernel layout"
    if gate.pair_view is None or up.pair_view is None:
        return ("gate and up are separate weights (enable_kernels(pair_mlp=True) interleaves "
                "them into one pair)")
    if gate.pair_view[1] != 0 or up.pair_view != (gate.pair_view[0], 1):
        return f"pair views {gate.pair_view} / {up.pair_view} are not (gate, up) of one pair"
    if (gate.format, gate.shape, gate.kernel_rows, gate.single_copy) != (
            up.format, up.shape, up.kernel_rows, up.single_copy):
        return f"gate {gate!r} and up {up!r} differ"
    stored = [(w.kernel_source,) if w.single_copy else (w.kernel_codes, w.kernel_scales)
              for w in (gate, up)]
    if not isinstance(stored[0][0], jax.core.Tracer) and any(
            a is not b for a, b in zip(*stored)):
        return "gate and up are views of two different pairs"
    if scales is not None and scales[0] != scales[1]:
        return f"gate and up have different LoRA scales {scales}"
    return None


def _pair_lora_b(weights, lora_bs):
    """The fused SwiGLU launch's block-diagonal LoRA B [r_g' + r_u', 2 N_pad] bf16 of a pair's
    (B_gate, B_up) (pallas_kernels.blockwise_matmul.interleave_lora_b)."""
    gate = weights[0]
    return bw.interleave_lora_b(lora_bs[0], lora_bs[1], gate.kernel_rows // 2,
                                gate.pair_view[0])


def _mosaic_swiglu_refusal(x, gate, down, lora_bs) -> str | None:
    """Why the Mosaic GPU kernel does not take this fused SwiGLU launch, or
    None: the flag, the pair's permuted copy, M, the LoRA ranks (equal, in LORA_RANKS)."""
    from pallas_kernels import mgpu_nvfp4
    if not _MOSAIC_NVFP4["single"] or getattr(gate, "mosaic_tiles", None) is None:
        return "off"
    if x.ndim != 2 or x.shape[0] > mgpu_nvfp4.MAX_M:
        return f"x {x.shape}"
    if down is not None and (lora_bs[0].shape != lora_bs[1].shape
                             or lora_bs[0].shape[0] not in mgpu_nvfp4.LORA_RANKS
                             or down.shape[-1] != 2 * lora_bs[0].shape[0]):
        return f"LoRA down {down.shape}, B {[b.shape for b in lora_bs]}"
    return mgpu_nvfp4.available()


def _fused_forward_swiglu(x, weights, down, lora_bs, scales, pair_lora_b, *, compute_dtype,
                          interpret, next_lora_a=None):
    """silu(x @ Wg^T + LoRA_g) * (x @ Wu^T + LoRA_u) [M, N] bf16 for pair views (gate, up) in
    one launch over their interleaved pair, the SwiGLU in its epilogue. down = x @ [A_g | A_u];
    pair_lora_b: the block-diagonal B made once (_pair_lora_b), or None to make it here."""
    del compute_dtype
    gate, up = weights
    half_block = gate.pair_view[0]
    refusal = "interpret mode" if interpret else _mosaic_swiglu_refusal(x, gate, down, lora_bs)
    if refusal is None:
        from pallas_kernels import mgpu_nvfp4
        lora = {}
        if down is not None:
            operand = _prepared_lora_operand(gate, down)
            if operand is None:
                operand = mgpu_nvfp4.pair_lora_operand(
                    lora_bs[0], lora_bs[1], gate.kernel_divisor(), up.kernel_divisor(),
                    scales[0], n_pad=gate.kernel_rows // 2, half_block=half_block)
            lora = dict(lora_down=down, lora_bt=operand)
        return mgpu_nvfp4.mgpu_nvfp4_swiglu(
            x.astype(jnp.bfloat16), gate.mosaic_tiles, gate.kernel_divisor(),
            up.kernel_divisor(), out_n=gate.shape[0], k=gate.shape[1], half_block=half_block,
            next_lora_a=next_lora_a, l2_prefetch=_prefetch_plan(gate),
            fused=_MOSAIC_NVFP4["swiglu_epilogue"], **lora)
    _note_single_copy_fallback(weights, "gate|up SwiGLU", refusal)
    # the two divisors go to the kernel as they are: a [2] array of them would be built at
    # every decode step (a concatenate kernel per layer inside the sampler's loop)
    pair = _whole_pair(gate)
    lora = {}
    if down is not None:
        lora = dict(lora_down=down, lora_ranks=tuple(b.shape[0] for b in lora_bs),
                    lora_b=_pair_lora_b(weights, lora_bs) if pair_lora_b is None
                    else pair_lora_b, lora_scale=scales[0])
    return bw.blockwise_matmul_swiglu(x, pair, spec=gate.spec, out_n=gate.shape[0],
                                      half_block=half_block, interpret=interpret,
                                      tensor_scales=(gate.kernel_divisor(),
                                                     up.kernel_divisor()),
                                      next_lora_a=next_lora_a, **lora)


def _fused_forward_swiglu_next(x, weights, down, lora_bs, scales, pair_lora_b, next_lora_a, *,
                               compute_dtype, interpret):
    """_fused_forward_swiglu's output and its product with the down projection's LoRA A
    [N, r] ([M, r] in compute dtype) from the same launch: each program multiplies its bf16
    output tile by A's rows (blockwise_matmul_swiglu's next_lora_a)."""
    y, next_down = _fused_forward_swiglu(x, weights, down, lora_bs, scales, pair_lora_b,
                                         compute_dtype=compute_dtype, interpret=interpret,
                                         next_lora_a=next_lora_a)
    return y, next_down.astype(compute_dtype)


def _swiglu_next_supports(next_lora_a) -> str | None:
    """The fused SwiGLU launch computes the next LoRA x @ A unless DecodeTuning turns it off."""
    del next_lora_a
    if not bw.decode_tuning().swiglu_next_lora:
        return "DecodeTuning.swiglu_next_lora is off"
    return None


def _fused_forward(x, weight, *, compute_dtype, interpret):
    """x [M, K] bf16 @ W^T -> [M, N] float32 (the fused kernel, no LoRA)."""
    return _fused_forward_lora(x, weight, None, None, 0.0, compute_dtype=compute_dtype,
                               interpret=interpret)


def _pallas_dense(weight, interpret):
    """W [N, K] bf16 from the Pallas dequantize kernel: of the kernel layout, or for a
    single-copy NVFP4 weight straight from its permuted buffer
    (pallas_kernels.permuted_dequantize, QERL_MOSAIC_PERMUTED_DEQUANTIZE; bit for bit the same
    W), without unpermuting it first."""
    if (weight.single_copy and _MOSAIC_NVFP4["permuted_dequantize"]
            and _permuted_dequantize_takes(weight)):
        from pallas_kernels.permuted_dequantize import permuted_dequantize
        return permuted_dequantize(weight.kernel_source, weight.kernel_divisor(),
                                   n=weight.shape[0], k=weight.shape[1],
                                   line=weight.kernel_source_line, pair_view=weight.pair_view,
                                   interpret=interpret)
    return bw.blockwise_dequantize(weight.packed(), spec=weight.spec, interpret=interpret)


def _permuted_dequantize_takes(weight: KernelLayoutWeight) -> bool:
    from pallas_kernels import mgpu_nvfp4
    from pallas_kernels.permuted_dequantize import BLOCK_ROWS
    return (weight.format == "nvfp4" and weight.tile_k == mgpu_nvfp4.TILE_K
            and (weight.pair_view is None or weight.pair_view[0] % BLOCK_ROWS == 0))


def _dequantize_forward(x, weight, *, compute_dtype, interpret):
    """Pallas dequantize kernel (bf16 W [N, K]) then one XLA dot: [M, N] float32."""
    del compute_dtype
    x, weight = linear_op.tie_weight_to_activations(x, weight)
    dense = _pallas_dense(weight, interpret)
    return lax.dot_general(x.astype(jnp.bfloat16), dense, (((1,), (1,)), ((), ())),
                           preferred_element_type=jnp.float32)


def _dequantize_backward(grad_output, weight, *, compute_dtype, interpret):
    """dy [M, N] @ W (Pallas dequantize kernel + XLA dot) -> dx [M, K] in compute_dtype."""
    dense = _pallas_dense(weight, interpret)
    return lax.dot_general(grad_output.astype(jnp.bfloat16), dense, (((1,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32).astype(compute_dtype)


def _transposed_backward(grad_output, weight, *, compute_dtype, interpret):
    """dy [M, N] @ W with the fused transposed kernel (W decoded tile by tile, never in HBM)."""
    dx = bw.blockwise_matmul_transposed(grad_output.astype(jnp.bfloat16), weight.packed(),
                                        spec=weight.spec, config=bw.TransposedConfig(),
                                        interpret=interpret)
    return dx.astype(compute_dtype)


def kernel_names(format_name: str) -> tuple[str, str]:
    """(small-M fused path, large-M dequantize + XLA path) names as select_matmul_path gives."""
    return f"{format_name}_fused", f"{format_name}_dequantize_xla"


_REGISTERED: dict[str, tuple] = {}  # platform -> the settings its kernels were registered with


def register_kernels(platform: str = "gpu", *, interpret: bool = False,
                     small_m_backward: str = "dequantize",
                     fused_max_m: dict[str, int] | None = None,
                     lora_epilogue: bool = True, grouped: bool = True,
                     fused_swiglu: bool = True) -> None:
    """Registers the fused / dequantize+XLA kernels of every format with linear_op (idempotent;
    re-registering with other settings replaces them).

    Args:
      platform: "gpu" (compiled Pallas, Triton backend), or any platform with interpret=True.
      interpret: run the kernels in Pallas interpret mode (CPU tests).
      small_m_backward: dx = dy @ W for M <= fused_max_m: "dequantize" (measured default) or
        "transposed" (the fused transposed kernel).
      fused_max_m: per format, the largest M of the fused forward (1..64); default FUSED_MAX_M.
      lora_epilogue: the fused kernel adds an unmerged LoRA's (x @ A) @ B in its epilogue;
        False: separate XLA dots (for comparisons).
      grouped: layers that share their input (q/k/v, gate/up; qerl_jax.quant.linear_group)
        run in one fused-kernel launch at small M; False: one launch per layer (comparisons).
      fused_swiglu: an MLP's gate/up pair views (pair_mlp_weights) run at small M as one
        launch with the SwiGLU in its epilogue (linear_op.linear_swiglu); False: each view
        alone, then the SwiGLU (comparisons; unpaired weights take the grouped launch).
    """
    if small_m_backward not in ("dequantize", "transposed"):
        raise ValueError(f"small_m_backward={small_m_backward!r}; expected 'dequantize' or "
                         "'transposed'")
    if platform not in KERNEL_PLATFORMS and not interpret:
        raise ValueError(f"no compiled Pallas kernels for platform {platform!r} (kernels: "
                         f"{KERNEL_PLATFORMS}); pass interpret=True to run them interpreted")
    limits = dict(FUSED_MAX_M, **(fused_max_m or {}))
    for name, limit in limits.items():
        if not 1 <= limit <= 64:
            raise ValueError(f"fused_max_m[{name!r}]={limit}: the fused kernel's tilings cover "
                             "M in [1, 64]")
    _MOSAIC_NVFP4["single"] = _mosaic_flag()[0]
    ahead = os.environ.get("QERL_MOSAIC_PREFETCH", "1")  # with the flag: on unless "0"
    if ahead not in ("0", "1", "2", "3"):
        raise ValueError(f"QERL_MOSAIC_PREFETCH={ahead!r}: 0 (off) or the K tiles to prefetch "
                         "per program of the next launch, 1-3")
    _MOSAIC_NVFP4["prefetch_ahead"] = int(ahead)
    _MOSAIC_NVFP4["prefetch_lora_a"] = _env_switch(
        "QERL_MOSAIC_PREFETCH_LORA_A", "the prefetch also takes the next LoRA A")
    _MOSAIC_NVFP4["swiglu_epilogue"] = _env_switch(
        "QERL_MOSAIC_SWIGLU_EPILOGUE",
        "the SwiGLU and the next LoRA x @ A in the kernel's epilogue, mgpu_nvfp4.SwigluEpilogue")
    _MOSAIC_NVFP4["single_copy"] = _env_switch(
        "QERL_MOSAIC_SINGLE_COPY",
        "the permuted buffers are the weights' only copy, KernelLayoutWeight.kernel_source")
    _MOSAIC_NVFP4["permuted_dequantize"] = _env_switch(
        "QERL_MOSAIC_PERMUTED_DEQUANTIZE", "prefill and training dequantize a single copy "
        "with the permuted-dequantize kernel; 0: unpermute, then the kernel-layout dequantize")
    settings = (interpret, small_m_backward, tuple(sorted(limits.items())), lora_epilogue,
                grouped, fused_swiglu, _MOSAIC_NVFP4["single"])
    if _REGISTERED.get(platform) == settings:
        return
    unregister_kernels(platform)
    small_backward = _transposed_backward if small_m_backward == "transposed" else \
        _dequantize_backward
    for format_name in SPECS:
        fused_name, dequantize_name = kernel_names(format_name)
        limit = limits[format_name]
        linear_op.register_matmul_kernel(
            format_name, platform, functools.partial(_fused_forward, interpret=interpret),
            name=fused_name, min_m=1, max_m=limit,
            grad_fn=functools.partial(small_backward, interpret=interpret), supports=_supports,
            lora_fn=(functools.partial(_fused_forward_lora, interpret=interpret)
                     if lora_epilogue else None),
            group_fn=(functools.partial(_fused_forward_group, interpret=interpret)
                      if grouped else None),
            group_supports=_group_supports,
            swiglu_fn=(functools.partial(_fused_forward_swiglu, interpret=interpret)
                       if fused_swiglu else None),
            swiglu_supports=_swiglu_supports, swiglu_lora_b_fn=_pair_lora_b,
            swiglu_next_fn=(functools.partial(_fused_forward_swiglu_next, interpret=interpret)
                            if fused_swiglu else None),
            swiglu_next_supports=_swiglu_next_supports)
        linear_op.register_matmul_kernel(
            format_name, platform, functools.partial(_dequantize_forward, interpret=interpret),
            name=dequantize_name, min_m=limit + 1, max_m=None,
            grad_fn=functools.partial(_dequantize_backward, interpret=interpret),
            supports=_supports)
    _REGISTERED[platform] = settings
    logger.info("registered Pallas kernels for %s (interpret=%s, fused forward for M <= %s, "
                "small-M backward: %s, LoRA epilogue: %s, grouped launches: %s, fused SwiGLU: "
                "%s)", platform, interpret, limits, small_m_backward, lora_epilogue, grouped,
                fused_swiglu)


def unregister_kernels(platform: str = "gpu") -> None:
    """Removes this module's kernels for `platform`, decode attention included (back to the XLA
    path)."""
    for format_name in SPECS:
        for name in kernel_names(format_name):
            linear_op.unregister_matmul_kernel(format_name, platform, name)
    _REGISTERED.pop(platform, None)
    disable_decode_attention(platform)


def _decode_attention_supports(q, keys) -> str | None:
    head_dim = q.shape[-1]
    if q.dtype != jnp.bfloat16 or keys.dtype != jnp.bfloat16:
        return f"q {q.dtype} / cache {keys.dtype} (the kernel takes bfloat16)"
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} (a power of two >= 16)"
    return None


def enable_decode_attention(platform: str | None = None, *, interpret: bool = False) -> bool:
    """Registers the Pallas decode-attention kernel (pallas_kernels.decode_attention: reads only
    the used part of the KV cache) for one-token decode steps on `platform`. Independent of the
    weight format (bf16 models use it too). Returns whether it was registered (not on a platform
    without compiled kernels unless interpret=True)."""
    platform = platform or jax.default_backend()
    if platform not in KERNEL_PLATFORMS and not interpret:
        return False

    def run(q, keys, values, mask, length, *, scale, lora_a=None):
        if lora_a is not None and not decode_attention_kernels.default_config().lora_down:
            lora_a = None  # the caller then computes x @ A itself
        return decode_attention_kernels.decode_attention(q, keys, values, mask, length,
                                                         scale=scale, interpret=interpret,
                                                         lora_a=lora_a)

    attention_dispatch.register_decode_attention(platform, attention_dispatch.DecodeAttentionKernel(
        name="pallas_decode_attention", fn=run, supports=_decode_attention_supports,
        lora_down=True))
    logger.info("registered the Pallas decode attention for %s (interpret=%s)", platform,
                interpret)
    return True


def disable_decode_attention(platform: str | None = None) -> None:
    attention_dispatch.unregister_decode_attention(platform or jax.default_backend())


def enable_kernels(model_or_state, *, platform: str | None = None, interpret: bool = False,
                   tile_k: int | None = None, small_m_backward: str = "dequantize",
                   lora_epilogue: bool = True, grouped: bool = True,
                   decode_attention: bool = True, donate: bool = False,
                   pair_mlp: bool = True, fused_swiglu: bool = True,
                   lora_rank: int | None = None):
    """Makes the quantized linear layers run the Pallas kernels on `platform`.

    Repacks every QuantizedWeight once (kernel layout) and registers the kernels. An nnx Module
    is changed in place (and returned); any other pytree (an nnx.State, params) is returned
    converted, its inputs untouched. Where there are no compiled kernels (platform other than
    "gpu") and interpret is False, nothing changes and the XLA path runs.

    Args:
      platform: default jax.default_backend().
      interpret: Pallas interpret mode (CPU tests; slow).
      tile_k: K tile of the kernel layout (default: default_tile_k).
      small_m_backward, lora_epilogue, grouped, fused_swiglu: see register_kernels.
      decode_attention: also register the decode-attention kernel (enable_decode_attention).
      pair_mlp: (Module only) each SwiGLU MLP's gate and up weights become two views of one
        interleaved copy (pair_mlp_weights; no extra memory), which the decode steps run in
        one launch with the SwiGLU in its epilogue. A pytree (not a Module) keeps separate
        weights.
      donate: (Module only) hand each checkpoint-layout weight's buffers to its kernel layout
        (to_kernel_layout(donate=True)): no second copy of the scales and codes is allocated,
        but arrays taken from the Module before the call are deleted. For a model nothing
        else references (the trainer's, just built); the default keeps them valid.
      lora_rank: (Module only) the rank of the LoRA adapters the model will be given (the
        trainer's config.lora.rank), if not yet added. On a Hopper GPU the NVFP4 decode
        launches run the Mosaic GPU kernel (unless QERL_MOSAIC_NVFP4=0), which takes LoRA ranks
        in pallas_kernels.mgpu_nvfp4.LORA_RANKS only: with another rank (this one, or an
        adapter the model already has) the weights keep the Triton kernels.
    """
    platform = platform or jax.default_backend()
    if platform not in KERNEL_PLATFORMS and not interpret:
        logger.info("enable_kernels: no Pallas kernels for platform %r; the quantized layers "
                    "keep the XLA path (dequantize + dot)", platform)
        return model_or_state
    register_kernels(platform, interpret=interpret, small_m_backward=small_m_backward,
                     lora_epilogue=lora_epilogue, grouped=grouped, fused_swiglu=fused_swiglu)
    if decode_attention:
        enable_decode_attention(platform, interpret=interpret)
    else:
        disable_decode_attention(platform)
    if not isinstance(model_or_state, nnx.Module):
        return prepare_for_kernels(model_or_state, tile_k=tile_k)
    count = 0
    for _, node in nnx.iter_graph(model_or_state):
        if not isinstance(node, nnx.Variable):
            continue
        value = node.get_value()
        if _is_quantized(value) and not isinstance(value, KernelLayoutWeight):
            node.set_value(to_kernel_layout(value, tile_k=tile_k, donate=donate))
            count += 1
    pairs = pair_mlp_weights(model_or_state) if pair_mlp else 0
    if (_MOSAIC_NVFP4["single"] and not interpret and _mosaic_unavailable() is None
            and _mosaic_ranks_refusal(model_or_state, lora_rank) is None):
        _add_mosaic_tiles(model_or_state, grouped=grouped,
                          single_copy=_MOSAIC_NVFP4["single_copy"])
    logger.info("enable_kernels: %d quantized weights in the kernel layout, %d MLP gate/up "
                "pairs (%s, interpret=%s)", count, pairs, platform, interpret)
    return model_or_state


def _mosaic_unavailable() -> str | None:
    """Why the Mosaic GPU kernel cannot run here (logged: a warning when QERL_MOSAIC_NVFP4=1
    asked for it, else info), or None."""
    from pallas_kernels import mgpu_nvfp4
    reason = mgpu_nvfp4.available()
    if reason is not None:
        log = logger.warning if _mosaic_flag()[1] else logger.info
        log("%s: no Mosaic GPU NVFP4 kernel here (%s); the NVFP4 weights keep the kernel "
            "layout and the Triton kernels", MOSAIC_FLAG, reason)
    return reason


def _mosaic_ranks_refusal(model: nnx.Module, lora_rank: int | None) -> str | None:
    """Why the model's LoRA ranks (lora_rank, and those of the adapters it has) keep the
    Triton kernels (logged), or None when the Mosaic GPU kernel takes them all."""
    from pallas_kernels import mgpu_nvfp4
    ranks = set() if lora_rank is None else {int(lora_rank)}
    for _, node in nnx.iter_graph(model):
        lora_a = getattr(node, "lora_a", None)
        if isinstance(lora_a, nnx.Variable) and lora_a.get_value() is not None:
            ranks.add(int(lora_a.get_value().shape[-1]))
    other = sorted(ranks - set(mgpu_nvfp4.LORA_RANKS))
    if not other:
        return None
    reason = (f"LoRA rank {other} (the Mosaic GPU kernel takes {mgpu_nvfp4.LORA_RANKS}); the "
              "NVFP4 weights keep the Triton kernels")
    log = logger.warning if _mosaic_flag()[1] else logger.info
    log("%s: %s", MOSAIC_FLAG, reason)
    return reason


def _whole_pair(weight: KernelLayoutWeight) -> bw.PackedWeight:
    """The interleaved gate/up pair a pair view reads, as one PackedWeight [2 N_pad, K] (no
    tensor scale: each half keeps its own)."""
    codes, scales = weight.kernel_arrays()
    return bw.PackedWeight(codes=codes, scales=scales, tensor_scale=None, fmt=weight.format,
                           n=weight.kernel_rows, k=weight.shape[1], tile_k=weight.tile_k)


# the attention projections that share one grouped launch at decode
_GROUPED_PROJECTIONS = ("q_proj", "k_proj", "v_proj")


def _add_mosaic_tiles(model: nnx.Module, *, grouped: bool = True,
                      single_copy: bool = False) -> None:
    """Each NVFP4 KernelLayoutWeight also gets its permuted layout (mosaic_tiles)
    for the Mosaic GPU kernel (see _MOSAIC_NVFP4); the two views of a gate/up pair share one
    permuted buffer of the whole interleaved pair. With grouped launches, an attention
    module's q projection gets the permuted buffer of [W_q; W_k; W_v] for the grouped launch
    (mgpu_nvfp4.group_permuted) and k, v none.

    single_copy=True (QERL_MOSAIC_SINGLE_COPY, default 1): the permuted buffers replace the
    kernel-layout arrays instead of adding a copy: every weight given a buffer, and k and v of
    a group, keep kernel_codes / kernel_scales None and read their tiles from the buffer
    (kernel_source, from line kernel_source_line: q 0, k after q's, v after k's), so the
    model's NVFP4 weights take the memory of one layout. Each weight (group, pair) is
    converted as soon as its buffer exists, so its kernel-layout arrays are freed then (once
    nothing else references them) and the conversion needs one weight's (or group's) memory
    more, not a model's. The buffers are made from the weights as they are now: replacing a
    weight later needs enable_kernels on a fresh model."""
    from pallas_kernels import mgpu_nvfp4
    permute = jax.jit(mgpu_nvfp4.permute_packed)
    count, pairs, groups = 0, {}, 0

    def keep_only(node, tiles, line):  # the single copy: the buffer replaces the arrays
        if single_copy:
            node.set_value(_replace_children(node.get_value(), kernel_codes=None,
                                             kernel_scales=None, kernel_source=tiles,
                                             kernel_source_line=line))

    def variable(module, name):
        layer = getattr(module, name, None)
        node = getattr(layer, "weight", None)
        return node if isinstance(node, nnx.Variable) else None

    grouped_nodes = set()
    if grouped:
        for _, module in nnx.iter_graph(model):
            nodes = [variable(module, name) for name in _GROUPED_PROJECTIONS]
            if any(node is None for node in nodes):
                continue
            grouped_nodes.update(id(node) for node in nodes)
            values = [node.get_value() for node in nodes]
            if not all(isinstance(v, KernelLayoutWeight) and v.mosaic_tiles is None
                       and not v.single_copy and mgpu_nvfp4.refusal(v.packed()) is None
                       for v in values):
                continue
            if len({v.shape[1] for v in values}) != 1:
                continue
            tiles = mgpu_nvfp4.group_permuted([permute(v.packed()) for v in values],
                                              [v.shape[1] for v in values])
            nodes[0].set_value(_replace_children(values[0], mosaic_tiles=tiles))
            line = 0
            for node, value in zip(nodes, values):
                keep_only(node, tiles, line)
                line += _mosaic_rows(value)
            groups += 1
    for _, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Variable) or id(node) in grouped_nodes:
            continue
        value = node.get_value()
        if (not isinstance(value, KernelLayoutWeight) or value.mosaic_tiles is not None
                or value.single_copy):
            continue
        packed = value.packed() if value.pair_view is None else _whole_pair(value)
        if mgpu_nvfp4.refusal(packed) is not None:
            continue
        if value.pair_view is None:
            tiles = permute(packed)
        else:  # the pair's two views share one buffer; the entry holds its arrays until both
            key = id(value.kernel_codes)  # views have theirs (the id stays theirs meanwhile)
            if key not in pairs:
                pairs[key] = [permute(packed), value.kernel_codes, 2]
            tiles = pairs[key][0]
            pairs[key][2] -= 1
            if not pairs[key][2]:
                pairs[key][1] = None
        node.set_value(_replace_children(value, mosaic_tiles=tiles))
        keep_only(node, tiles, 0)
        count += 1
    logger.info("enable_kernels: %d NVFP4 weights (%d gate/up pairs) and %d q/k/v groups also "
                "in the Mosaic GPU permuted layout (QERL_MOSAIC_NVFP4=0 turns it off)%s", count,
                len(pairs), groups, "; it is their only copy" if single_copy else "")


def disable_kernels(model_or_state):
    """Every KernelLayoutWeight back to the checkpoint layout (in place for an nnx Module).
    The kernels stay registered; checkpoint-layout weights take the XLA path."""
    if not isinstance(model_or_state, nnx.Module):
        return restore_checkpoint_layout(model_or_state)
    for _, node in nnx.iter_graph(model_or_state):
        if isinstance(node, nnx.Variable) and isinstance(node.get_value(), KernelLayoutWeight):
            node.set_value(node.get_value().to_checkpoint())
    return model_or_state
