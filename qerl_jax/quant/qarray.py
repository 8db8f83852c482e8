"""QuantizedWeight: a frozen 4-bit weight as a plain pytree (arrays + static metadata).

Logical shape (N, K) = (out_features, in_features), like a torch/HF Linear weight; blocks run
along K (the reduction dimension). Layouts, per format (see docs/formats.md):

  nvfp4  codes uint8 [N, K/2] (element 2j in the LOW nibble of byte j)
         block_scales float8_e4m3fn [N, K/16]; tensor_scale float32 [] (a divisor:
         w = e2m1(code) * block_scale / tensor_scale). Identical to compressed-tensors'
         weight_packed / weight_scale / weight_global_scale.
  mxfp4  codes uint8 [N, K/2] (low nibble first); block_scales uint8 [N, K/32] = biased E8M0
         exponent (w = e2m1(code) * 2**(block_scale - 127)); tensor_scale None.
  nf4    codes uint8 [N, K/2] (element 2j in the HIGH nibble, as bitsandbytes); per block of
         64 along K an absmax: block_scales float32 [N, K/64] without double quantization, or
         uint8 [N, K/64] codes into bitsandbytes' signed dynamic 8-bit map with double
         quantization, in which case double_quant_scales float32 [ceil(N*K/64 / 256)] holds the
         absmax of each run of 256 flattened block scales and tensor_scale float32 [] the mean
         that was subtracted (bitsandbytes' `offset`).

Array fields are pytree children (None fields are empty subtrees); format, shape and dtype are
static (they are part of the treedef, so jit specializes on them).

For the Pallas GPU kernels, the kernel backends repack a QuantizedWeight once at load time
into their own subclass (qerl_jax.quant.backends: `KernelLayoutWeight` for the Triton kernels,
`MosaicWeight` for the Mosaic GPU kernel): the checkpoint arrays above stay readable from it,
unpacked losslessly on access. Such a subclass may also make per-launch operands once per
rollout (the `with_*` methods below, which return the weight as it is here).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qerl_jax.quant.formats import get_format, quantized_format_names


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["codes", "block_scales", "tensor_scale", "double_quant_scales"],
                   meta_fields=["format", "shape", "dtype"])
@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizedWeight:
    """A quantized weight of logical shape `shape` = (N, K) = (out_features, in_features).

    Attributes:
      codes: packed 4-bit codes, uint8 [N, K/2].
      block_scales: one scale per block along K [N, K/block] (dtype depends on the format).
      tensor_scale: a per-tensor float32 scalar [] or None (format dependent).
      format: "nvfp4" | "mxfp4" | "nf4".
      shape: logical (N, K).
      dtype: name of the default dequantization dtype ("bfloat16", "float32", ...).
      double_quant_scales: NF4 double quantization only: float32 [ceil(N*K/64/256)].
    """

    codes: Any
    block_scales: Any
    tensor_scale: Any = None
    format: str
    shape: tuple[int, int]
    dtype: str = "bfloat16"
    double_quant_scales: Any = None

    def __post_init__(self):
        # Only static fields are checked: array fields may hold tracers or placeholders while
        # JAX transforms the pytree.
        if self.format not in quantized_format_names():
            raise ValueError(f"QuantizedWeight.format={self.format!r}; known quantized "
                             f"formats: {', '.join(quantized_format_names())}")
        shape = tuple(int(d) for d in self.shape)
        if len(shape) != 2:
            raise ValueError(f"QuantizedWeight.shape must be (out_features, in_features), "
                             f"got {self.shape}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype).name)

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays (codes + all scales)."""
        return sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
                   for leaf in jax.tree_util.tree_leaves(self))

    def dequantize(self, dtype=None) -> jax.Array:
        """The dense weight [N, K] in `dtype` (default: self.dtype)."""
        return get_format(self.format).dequantize(self, dtype)

    # Operands a kernel backend's weight type makes once before a decode loop; the checkpoint
    # layout has none (qerl_jax.models.decode_fusion calls these on every quantized weight).
    def with_lora_operand(self, lora_b, lora_scale: float) -> QuantizedWeight:
        """This weight carrying its single-weight launch's LoRA operand (lora_b [r, N])."""
        del lora_b, lora_scale
        return self

    def with_pair_lora_operand(self, up, gate_b, up_b, lora_scale: float) -> QuantizedWeight:
        """This gate weight carrying its gate|up launch's LoRA operand."""
        del up, gate_b, up_b, lora_scale
        return self

    def with_group_lora_operand(self, members, lora_bs, lora_scales) -> QuantizedWeight:
        """This first weight of a grouped launch (members: the group, this one first) carrying
        the group's LoRA operand."""
        del members, lora_bs, lora_scales
        return self

    def with_prefetch(self, following, following_lora_a) -> QuantizedWeight:
        """This weight, whose decode launch prefetches the following launch's weight (and the
        LoRA A read before it) into L2."""
        del following, following_lora_a
        return self
