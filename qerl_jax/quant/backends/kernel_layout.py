"""The Triton kernels' weight layout: a QuantizedWeight repacked once (the Triton backends'
`repack`, vLLM's process_weights_after_loading), and gate/up pairs of it.

`KernelLayoutWeight` is the same weight in the kernels' layout (nibble planes per K tile, zero
padding; see pallas_kernels/blockwise_matmul.py), made once by `to_kernel_layout` so that no
repack runs inside jit. It is a QuantizedWeight (isinstance holds), so everything written for
the checkpoint layout keeps working: its `codes`, `block_scales`, `tensor_scale` and
`double_quant_scales` are the checkpoint arrays, unpacked losslessly on access
(compressed-tensors export, lora.merge_lora, get_format(...).dequantize), and `to_checkpoint()`
returns the plain QuantizedWeight. NF4 with double quantization keeps its uint8 scale codes and
run absmax next to the float32 absmax the kernels read (+1 byte per 64 weights).

Each format the Triton kernels take has one `KernelFormat` entry in KERNEL_FORMATS (the Triton
backend's table): its decode spec (pallas_kernels), nibble order, largest fused M, scale
conversion and refusal. A new format adds its entry here and its module under qerl_jax/quant/.
The Mosaic GPU backend's layout (backends/mosaic.py, `MosaicWeight`) is a subclass of this one.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp

from pallas_kernels import blockwise_matmul as bw
from pallas_kernels import nvfp4_matmul
from pallas_kernels.mxfp4_matmul import MAX_SCALE_CODE as MXFP4_MAX_SCALE_CODE
from pallas_kernels.mxfp4_matmul import MXFP4
from pallas_kernels.nf4_matmul import NF4
from pallas_kernels.nvfp4_matmul import NVFP4
from qerl_jax.quant.nf4 import dequantize_block_scales
from qerl_jax.quant.qarray import QuantizedWeight

logger = logging.getLogger(__name__)

DEFAULT_TILE_K = 256


# ----------------------------------------------------------------------------------------------
# The formats the kernels take


@dataclasses.dataclass(frozen=True)
class KernelFormat:
    """How one format sits in the kernel layout."""

    spec: bw.FormatSpec  # the kernels' decode of the format (pallas_kernels)
    low_nibble_first: bool  # element 2j of a checkpoint byte j is its LOW nibble
    # (weight, n_pad, k_pad) -> (kernel scales [N_pad, K_pad/B], block scales kept as they are
    # or None, double-quantization scales kept or None)
    kernel_scales: Callable[..., tuple]
    # kernel scales of this weight's rows [N, K/B] -> the checkpoint's block scales
    checkpoint_scales: Callable[[jax.Array], jax.Array] = lambda scales: scales
    # (weight with concrete arrays) -> why the kernels cannot decode it, or None
    refusal: Callable[[QuantizedWeight], str | None] = lambda weight: None
    tensor_scale_divides: bool = False  # the tensor scale divides the decoded weights
    # largest M of the fused forward kernel (its tilings stop at 64 rows; benchmarks/kernels.py
    # --decode-sweep); larger M take dequantize + XLA
    max_fused_m: int = 64


def _nvfp4_scales(weight, n_pad, k_pad):  # canonical scale codes (pallas_kernels/nvfp4_matmul)
    return nvfp4_matmul.kernel_layout_scales(weight.block_scales, n_pad=n_pad, k_pad=k_pad), \
        None, None


def _nvfp4_refusal(weight) -> str | None:
    bad = int(nvfp4_matmul.invalid_scale_count(weight.block_scales))
    if bad:
        return (f"{bad} NVFP4 block scales are negative or NaN (the format's scales are "
                "unsigned, UE4M3)")
    return None


def _mxfp4_scales(weight, n_pad, k_pad):
    return bw.pad_scales(weight.block_scales, n_pad=n_pad, k_pad=k_pad,
                         block=MXFP4.scale_block), None, None


def _mxfp4_refusal(weight) -> str | None:
    top = int(jnp.max(weight.block_scales)) if weight.block_scales.size else 0
    if top > MXFP4_MAX_SCALE_CODE:
        return (f"an MXFP4 block scale code is {top} > {MXFP4_MAX_SCALE_CODE} (2^27), beyond "
                "the kernels' decode range")
    return None


def _nf4_scales(weight, n_pad, k_pad):
    kept_scales = kept_double_quant = None
    if weight.double_quant_scales is not None:
        # the format's own decode, so dequantize() of both layouts agrees bit for bit
        kept_scales, kept_double_quant = weight.block_scales, weight.double_quant_scales
        absmax = dequantize_block_scales(kept_scales.reshape(-1), kept_double_quant,
                                         weight.tensor_scale).reshape(kept_scales.shape)
    else:
        absmax = weight.block_scales.astype(jnp.float32)
    return (bw.pad_scales(absmax, n_pad=n_pad, k_pad=k_pad, block=NF4.scale_block),
            kept_scales, kept_double_quant)


KERNEL_FORMATS: dict[str, KernelFormat] = {
    "nvfp4": KernelFormat(spec=NVFP4, low_nibble_first=True, kernel_scales=_nvfp4_scales,
                          checkpoint_scales=nvfp4_matmul.checkpoint_scales,
                          refusal=_nvfp4_refusal, tensor_scale_divides=True),
    "mxfp4": KernelFormat(spec=MXFP4, low_nibble_first=True, kernel_scales=_mxfp4_scales,
                          refusal=_mxfp4_refusal),
    "nf4": KernelFormat(spec=NF4, low_nibble_first=False, kernel_scales=_nf4_scales),
}


# ----------------------------------------------------------------------------------------------
# The kernel-layout weight


class KernelLayoutWeight(QuantizedWeight):
    """A QuantizedWeight stored in the Triton kernels' layout (made by `to_kernel_layout`).

    Pytree children (frozen arrays):
      kernel_codes uint8 [N_pad, K_pad/2] (nibble planes), kernel_scales [N_pad, K_pad/B] (the
        format's scale dtype; NVFP4: canonical uint8 scale codes, pallas_kernels/nvfp4_matmul.py;
        NF4: float32 absmax), both tile-major (pallas_kernels.blockwise_matmul.tile_major); a
        subclass may hold them elsewhere (MosaicWeight: None, unpermuted on use).
      checkpoint_tensor_scale: the QuantizedWeight's tensor_scale, or None.
      kept_block_scales / kept_double_quant_scales: checkpoint arrays the kernel scales cannot
        give back losslessly (NF4 double quantization: uint8 scale codes and run absmax), else
        None.
    Static: format, shape (logical N, K), dtype, tile_k, pair_view.

    pair_view (half_block, half) or None: kernel_codes / kernel_scales are an MLP's gate and up
    interleaved in blocks of half_block rows ([2 N_pad, ...], `pair_gate_up`), and this weight
    is its half 0 (gate) or 1 (up). The gate and up weights hold the SAME two arrays, so the
    pair is the only copy in memory; the kernels read a half in place
    (pallas_kernels.blockwise_matmul.PackedWeight.pair_view), and the decode launch reads
    both with the SwiGLU in its epilogue (linear_swiglu.linear_swiglu).

    The checkpoint-layout attributes (codes, block_scales, tensor_scale, double_quant_scales)
    are computed from these on access, losslessly (a pair view's from its own rows).
    """

    # Not dataclass fields: the base class's generated __init__/__eq__/__hash__ are bypassed.
    def __init__(self, *, kernel_codes, kernel_scales, checkpoint_tensor_scale=None,
                 kept_block_scales=None, kept_double_quant_scales=None, format: str,
                 shape: tuple[int, int], dtype: str = "bfloat16", tile_k: int,
                 pair_view: tuple[int, int] | None = None):
        # No value checks: JAX rebuilds this object with tracers or placeholders as leaves.
        set_attr = object.__setattr__
        set_attr(self, "kernel_codes", kernel_codes)
        set_attr(self, "kernel_scales", kernel_scales)
        set_attr(self, "checkpoint_tensor_scale", checkpoint_tensor_scale)
        set_attr(self, "kept_block_scales", kept_block_scales)
        set_attr(self, "kept_double_quant_scales", kept_double_quant_scales)
        set_attr(self, "format", format)
        set_attr(self, "shape", tuple(int(d) for d in shape))
        set_attr(self, "dtype", jnp.dtype(dtype).name)
        set_attr(self, "tile_k", int(tile_k))
        set_attr(self, "pair_view", None if pair_view is None else tuple(int(v) for v in pair_view))

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(format={self.format!r}, shape={self.shape}, "
                f"dtype={self.dtype!r}, tile_k={self.tile_k}, "
                f"kernel_rows={self.kernel_rows}"
                + (", single copy in the permuted layout" if self.single_copy else "")
                + ("" if self.pair_view is None else f", pair_view={self.pair_view}") + ")")

    # pytree protocol (a subclass extends both tuples and registers itself)
    _CHILDREN = ("kernel_codes", "kernel_scales", "checkpoint_tensor_scale", "kept_block_scales",
                 "kept_double_quant_scales")
    _STATIC = ("format", "shape", "dtype", "tile_k", "pair_view")

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

    def replace(self, **changes) -> KernelLayoutWeight:
        """The same weight with some pytree children or static fields replaced."""
        names = self._CHILDREN + self._STATIC
        unknown = sorted(set(changes) - set(names))
        if unknown:
            raise TypeError(f"{type(self).__name__}.replace: {unknown} are not its fields")
        return type(self)(**{name: changes.get(name, getattr(self, name)) for name in names})

    # the kernels' view
    @property
    def kernel_format(self) -> KernelFormat:
        return KERNEL_FORMATS[self.format]

    @property
    def spec(self) -> bw.FormatSpec:
        return self.kernel_format.spec

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
        """True if the kernel-layout arrays are not stored (another layout holds the only copy:
        MosaicWeight)."""
        return False

    def kernel_arrays(self) -> tuple[jax.Array, jax.Array]:
        """(kernel_codes, kernel_scales), tile-major [kernel_rows, ...]."""
        return self.kernel_codes, self.kernel_scales

    def stored_arrays(self) -> tuple[jax.Array, ...]:
        """The arrays that hold this weight's codes and scales in memory (a pair's two views
        hold the same ones)."""
        return self.kernel_codes, self.kernel_scales

    def kernel_dense(self, interpret: bool = False) -> jax.Array:
        """W [N, K] bf16 from a Pallas dequantize kernel (the Triton backends' large-M forward
        and every backward)."""
        return bw.blockwise_dequantize(self.packed(), spec=self.spec, interpret=interpret)

    def packed(self) -> bw.PackedWeight:
        """The pallas_kernels PackedWeight: kernel_arrays() (for a stored layout the arrays as
        they are) and the kernels' tensor scale [1] (kernel_tensor_scale)."""
        codes, scales = self.kernel_arrays()
        return bw.PackedWeight(codes=codes, scales=scales,
                               tensor_scale=self.kernel_tensor_scale(), fmt=self.format,
                               n=self.shape[0], k=self.shape[1], tile_k=self.tile_k,
                               pair_view=self.pair_view)

    def whole_pair(self) -> bw.PackedWeight:
        """The interleaved gate/up pair a pair view reads, as one PackedWeight [2 N_pad, K] (no
        tensor scale: each half keeps its own)."""
        codes, scales = self.kernel_arrays()
        return bw.PackedWeight(codes=codes, scales=scales, tensor_scale=None, fmt=self.format,
                               n=self.kernel_rows, k=self.shape[1], tile_k=self.tile_k)

    def kernel_tensor_scale(self) -> jax.Array:
        """The tensor scale [1] float32 the kernels divide by (NVFP4's; 1 for formats without
        a dividing tensor scale), as packed() holds it."""
        if self.kernel_format.tensor_scale_divides:
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
                                    low_nibble_first=self.kernel_format.low_nibble_first)

    @property
    def block_scales(self):
        if self.kept_block_scales is not None:
            return self.kept_block_scales
        n, k = self.shape
        scales = self._own_rows(self._row_major(scales=True))[:n, :k // self.spec.scale_block]
        return self.kernel_format.checkpoint_scales(scales)

    @property
    def tensor_scale(self):
        return self.checkpoint_tensor_scale

    @property
    def double_quant_scales(self):
        return self.kept_double_quant_scales

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


def dequantize_backward(grad_output, weight, *, compute_dtype, interpret):
    """dy [M, N] @ W (the weight's Pallas dequantize kernel, kernel_dense, + XLA dot) -> dx
    [M, K] in compute_dtype: every kernel backend's backward."""
    dense = weight.kernel_dense(interpret)
    return jax.lax.dot_general(grad_output.astype(jnp.bfloat16), dense,
                               (((1,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32).astype(compute_dtype)


# ----------------------------------------------------------------------------------------------
# Repacking


def default_tile_k(format_name: str, in_features: int) -> int:
    """K tile of the kernel layout: 256 (the measured default; 512 for the large MLP weights was
    no faster in the 7B rollout, benchmarks/RESULTS.md); smaller for K < 256 (less padding), at
    least 2 scale blocks and 32."""
    block = KERNEL_FORMATS[format_name].spec.scale_block
    return max(min(DEFAULT_TILE_K, bw.next_pow2(in_features)), 2 * block, 32)


def _repack_arrays(weight: QuantizedWeight, tile_k: int) -> KernelLayoutWeight:
    n, k = weight.shape
    kernel_format = KERNEL_FORMATS[weight.format]
    n_pad, k_pad = bw.padded_sizes(n, k, tile_k)
    codes = bw.to_plane_layout(weight.codes, k=k, tile_k=tile_k,
                               low_nibble_first=kernel_format.low_nibble_first)
    scales, kept_scales, kept_double_quant = kernel_format.kernel_scales(weight, n_pad, k_pad)
    codes, scales = bw.tile_major_arrays(codes, scales, tile_k)
    return KernelLayoutWeight(kernel_codes=codes, kernel_scales=scales,
                              checkpoint_tensor_scale=weight.tensor_scale,
                              kept_block_scales=kept_scales,
                              kept_double_quant_scales=kept_double_quant,
                              format=weight.format, shape=weight.shape, dtype=weight.dtype,
                              tile_k=tile_k)


_repack = jax.jit(_repack_arrays, static_argnames=("tile_k",))
# The same program with the checkpoint-layout arrays donated: where no padding is needed the
# kernel codes are written into the codes' buffer and the scales keep theirs, so the repack
# allocates nothing that stays.
_repack_donating = jax.jit(_repack_arrays, static_argnames=("tile_k",), donate_argnums=(0,))


def kernel_refusal(weight: QuantizedWeight) -> str | None:
    """Why the kernels cannot take this (checkpoint-layout) weight, or None. Needs concrete
    arrays (run at load time)."""
    if weight.format not in KERNEL_FORMATS:
        return f"no kernel for format {weight.format!r}"
    return KERNEL_FORMATS[weight.format].refusal(weight)


def to_kernel_layout(weight: QuantizedWeight, *, tile_k: int | None = None,
                     donate: bool = False) -> QuantizedWeight:
    """Repacks one checkpoint-layout QuantizedWeight into a KernelLayoutWeight (lossless).

    Already-repacked weights are returned as they are; a weight the kernels cannot take is
    returned unchanged (it keeps the XLA path) with a warning naming the reason.
    donate=True consumes `weight` where the kernel layout needs no padding (its buffers become
    the kernel layout's; `weight` must not be used afterwards): for a model whose weights are
    replaced in place.
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
    if gate.single_copy or up.single_copy:
        return "a weight is stored only in the Mosaic permuted layout (single copy)"
    if type(gate) is not KernelLayoutWeight or type(up) is not KernelLayoutWeight:
        return (f"{type(gate).__name__} / {type(up).__name__}: pairs are made in the Triton "
                "kernel layout, before any other backend's")
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
        kept_block_scales=weight.kept_block_scales,
        kept_double_quant_scales=weight.kept_double_quant_scales, format=weight.format,
        shape=weight.shape, dtype=weight.dtype, tile_k=weight.tile_k,
        pair_view=(half_block, half)) for half, weight in enumerate((gate, up)))


# ----------------------------------------------------------------------------------------------
# What a launch over several kernel-layout weights needs (every kernel backend asks)


def group_launch_refusal(weights) -> str | None:
    """Why these kernel-layout weights (sharing x) cannot share one launch, or None."""
    first = weights[0]
    if any(weight.pair_view is not None for weight in weights):
        return ("gate/up pair views (their launch is the fused SwiGLU one, "
                "linear_swiglu.linear_swiglu)")
    for weight in weights[1:]:
        if (weight.format, weight.shape[1], weight.tile_k, weight.kernel_code_columns) != (
                first.format, first.shape[1], first.tile_k, first.kernel_code_columns):
            return (f"{weight.format} {weight.shape} tile_k {weight.tile_k} vs "
                    f"{first.format} {first.shape} tile_k {first.tile_k} (a launch needs "
                    "one format, K and K tile)")
    return None


def pair_launch_refusal(weights, lora_scales) -> str | None:
    """Why (gate, up) cannot run as one fused SwiGLU launch, or None: they must be the two
    pair views of one interleaved pair, with one LoRA scale (lora_scales, or None)."""
    gate, up = weights
    if not (isinstance(gate, KernelLayoutWeight) and isinstance(up, KernelLayoutWeight)):
        return "gate and up are not in the kernel layout"
    if gate.pair_view is None or up.pair_view is None:
        return ("gate and up are separate weights (KernelOptions.gate_up_pairs interleaves "
                "them into one pair)")
    if gate.pair_view[1] != 0 or up.pair_view != (gate.pair_view[0], 1):
        return f"pair views {gate.pair_view} / {up.pair_view} are not (gate, up) of one pair"
    if (gate.format, gate.shape, gate.kernel_rows, gate.single_copy) != (
            up.format, up.shape, up.kernel_rows, up.single_copy):
        return f"gate {gate!r} and up {up!r} differ"
    stored = [w.stored_arrays() for w in (gate, up)]
    if not isinstance(stored[0][0], jax.core.Tracer) and any(
            a is not b for a, b in zip(*stored)):
        return "gate and up are views of two different pairs"
    if lora_scales is not None and lora_scales[0] != lora_scales[1]:
        return f"gate and up have different LoRA scales {lora_scales}"
    return None
