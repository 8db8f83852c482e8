"""Weight formats by name: "bf16" (dense pass-through), "nvfp4", "mxfp4", "nf4".

    fmt = get_format("nvfp4")
    quantized = fmt.quantize(w_out_in, name="layers.0.mlp.up_proj")   # W [N, K] = [out, in]
    dense = fmt.dequantize(quantized, jnp.bfloat16)                   # [N, K]

Every quantize takes keyword arguments `name` (for error messages) and `check_finite` (see
qarray.validate_weight); the quantized formats return a QuantizedWeight, "bf16" returns the
weight cast to bfloat16 (same layout as given).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from qerl_jax.quant.mxfp4 import MXFP4_BLOCK_SIZE, mxfp4_dequantize, mxfp4_quantize
from qerl_jax.quant.nf4 import (DOUBLE_QUANT_BLOCK_SIZE, NF4_BLOCK_SIZE, nf4_dequantize,
                                nf4_quantize)
from qerl_jax.quant.nvfp4 import NVFP4_BLOCK_SIZE, nvfp4_dequantize, nvfp4_quantize
from qerl_jax.quant.qarray import QuantizedWeight, validate_weight


@dataclasses.dataclass(frozen=True)
class Format:
    """A weight format.

    Attributes:
      name: registry name.
      bits: bits per element code (16 for bf16, 4 for the 4-bit formats).
      block_size: elements per block scale along K (1 for bf16: no blocks).
      bytes_per_parameter: storage per weight element, scales included, per-tensor scalars
        excluded (they vanish for real layer sizes).
      quantize: (weight [N, K], *, name=..., check_finite=...) -> QuantizedWeight (or array).
      dequantize: (quantized, dtype=None) -> [N, K] array.
      description: one line for docs and error messages.
    """

    name: str
    bits: int
    block_size: int
    bytes_per_parameter: float
    quantize: Callable[..., Any]
    dequantize: Callable[..., jax.Array]
    description: str

    @property
    def is_quantized(self) -> bool:
        return self.name != "bf16"


def _bf16_quantize(weight: jax.Array, *, name: str = "weight", check_finite: bool = True,
                   dtype=None) -> jax.Array:
    """Dense pass-through: the weight [N, K] (any layout) cast to bfloat16."""
    validate_weight(weight, block_size=1, format_name="bf16", name=name,
                    check_finite=check_finite)
    return weight.astype(jnp.bfloat16)


def _bf16_dequantize(weight: jax.Array, dtype=None) -> jax.Array:
    return weight.astype(dtype or weight.dtype)


_FORMATS: dict[str, Format] = {}


def register_format(fmt: Format) -> Format:
    """Adds a format to the registry (names are unique)."""
    if fmt.name in _FORMATS:
        raise ValueError(f"weight format {fmt.name!r} is already registered")
    _FORMATS[fmt.name] = fmt
    return fmt


register_format(Format(
    name="bf16", bits=16, block_size=1, bytes_per_parameter=2.0,
    quantize=_bf16_quantize, dequantize=_bf16_dequantize,
    description="dense bfloat16, no quantization"))
register_format(Format(
    name="nvfp4", bits=4, block_size=NVFP4_BLOCK_SIZE,
    bytes_per_parameter=0.5 + 1 / NVFP4_BLOCK_SIZE,
    quantize=nvfp4_quantize, dequantize=nvfp4_dequantize,
    description="E2M1 + FP8 E4M3 scale per 16 + FP32 tensor scale (compressed-tensors)"))
register_format(Format(
    name="mxfp4", bits=4, block_size=MXFP4_BLOCK_SIZE,
    bytes_per_parameter=0.5 + 1 / MXFP4_BLOCK_SIZE,
    quantize=mxfp4_quantize, dequantize=mxfp4_dequantize,
    description="E2M1 + E8M0 power-of-two scale per 32 (OCP MX v1.0)"))
register_format(Format(
    name="nf4", bits=4, block_size=NF4_BLOCK_SIZE,
    bytes_per_parameter=0.5 + 1 / NF4_BLOCK_SIZE + 4 / (NF4_BLOCK_SIZE * DOUBLE_QUANT_BLOCK_SIZE),
    quantize=nf4_quantize, dequantize=nf4_dequantize,
    description="NormalFloat4 + absmax per 64, double-quantized (bitsandbytes / QLoRA)"))


def known_formats() -> tuple[str, ...]:
    return tuple(_FORMATS)


def get_format(name: str | Format) -> Format:
    """The Format registered under `name` (a Format is returned as is)."""
    if isinstance(name, Format):
        return name
    try:
        return _FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown weight format {name!r}; known formats: "
                         f"{', '.join(_FORMATS)}") from None


def bytes_per_parameter(format_name: str | Format) -> float:
    """Storage bytes per weight element of a format (bf16: 2.0; nvfp4: 0.5625; mxfp4: 0.53125;
    nf4 with double quantization: 0.515869...), per-tensor scalars excluded."""
    return get_format(format_name).bytes_per_parameter


def quantized_nbytes(tree: Any) -> int:
    """Total bytes of the arrays in a pytree of params, QuantizedWeights counted by their codes
    and scales (dense leaves by size * itemsize; jax.ShapeDtypeStruct leaves work too)."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            total += int(np.prod(leaf.shape, dtype=np.int64)) * jnp.dtype(leaf.dtype).itemsize
        else:  # a Python scalar: counted as the JAX array it becomes
            total += int(np.size(leaf)) * jnp.dtype(jnp.result_type(leaf)).itemsize
    return total


__all__ = ["Format", "QuantizedWeight", "bytes_per_parameter", "get_format", "known_formats",
           "quantized_nbytes", "register_format"]
