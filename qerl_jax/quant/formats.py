"""Weight formats by name: "bf16" (dense pass-through), "nvfp4", "mxfp4", "nf4".

    fmt = get_format("nvfp4")
    quantized = fmt.quantize(w_out_in, name="layers.0.mlp.up_proj")   # W [N, K] = [out, in]
    dense = fmt.dequantize(quantized, jnp.bfloat16)                   # [N, K]

Every quantize takes keyword arguments `name` (for error messages) and `check_finite` (see
validate_weight); the quantized formats return a QuantizedWeight, "bf16" returns the weight
cast to bfloat16 (same layout as given). Each format registers itself at the end of its module
(nvfp4.py, mxfp4.py, nf4.py) into FORMATS (qerl_jax.registry lists the built-in names, so the
config schema knows them without JAX). A plug-in format is one module that calls
`register_format(Format(...))`; the XLA path dequantizes it with its own `dequantize`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from qerl_jax.registry import FORMATS


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
      is_quantized: quantize returns a QuantizedWeight (False: a dense array, as bf16's).
    """

    name: str
    bits: int
    block_size: int
    bytes_per_parameter: float
    quantize: Callable[..., Any]
    dequantize: Callable[..., jax.Array]
    description: str
    is_quantized: bool = True


def _bf16_quantize(weight: jax.Array, *, name: str = "weight", check_finite: bool = True,
                   dtype=None) -> jax.Array:
    """Dense pass-through: the weight [N, K] (any layout) cast to bfloat16."""
    validate_weight(weight, block_size=1, format_name="bf16", name=name,
                    check_finite=check_finite)
    return weight.astype(jnp.bfloat16)


def _bf16_dequantize(weight: jax.Array, dtype=None) -> jax.Array:
    return weight.astype(dtype or weight.dtype)


def validate_weight(weight, *, block_size: int, format_name: str, name: str,
                    check_finite: bool) -> None:
    """Checks a weight [N, K] before quantization; raises ValueError naming the layer.

    Shape checks are static and always run (also under jit). The NaN/Inf check needs concrete
    values: with check_finite=True it runs eagerly (one device-side reduction, one bool to the
    host) and raises if `weight` is a tracer, rather than silently skipping; inside jit pass
    check_finite=False and check before tracing.
    """
    shape = tuple(weight.shape)
    if len(shape) != 2:
        raise ValueError(f"layer {name}: expected a 2-D weight [out_features, in_features], "
                         f"got shape {shape}")
    if not jnp.issubdtype(weight.dtype, jnp.floating):
        raise ValueError(f"layer {name}: weight dtype {weight.dtype} is not floating point")
    in_features = shape[1]
    if in_features % block_size:
        raise ValueError(f"layer {name}: in_features={in_features} (weight shape {shape} as "
                         f"[out, in]) is not divisible by {format_name}'s block size "
                         f"{block_size}")
    if not check_finite:
        return
    try:
        finite = bool(jnp.isfinite(weight).all())
    except jax.errors.ConcretizationTypeError as error:
        raise ValueError(
            f"layer {name}: cannot check a traced weight for NaN/Inf inside jit; check it "
            f"eagerly and call the {format_name} quantizer with check_finite=False") from error
    if not finite:
        count = int(jnp.sum(~jnp.isfinite(weight)))
        raise ValueError(f"layer {name}: weight of shape {shape} holds {count} NaN/Inf "
                         f"value(s); refusing to quantize to {format_name}")


def register_format(fmt: Format) -> Format:
    """Adds a format to FORMATS under its name (names are unique)."""
    if not isinstance(fmt, Format):
        raise TypeError(f"register_format takes a Format, got {type(fmt).__name__}")
    return FORMATS.register(fmt.name, fmt)


BF16 = register_format(Format(
    name="bf16", bits=16, block_size=1, bytes_per_parameter=2.0,
    quantize=_bf16_quantize, dequantize=_bf16_dequantize,
    description="dense bfloat16, no quantization", is_quantized=False))


def known_formats() -> tuple[str, ...]:
    """The registered format names."""
    return FORMATS.names()


def quantized_format_names() -> tuple[str, ...]:
    """The registered formats that make a QuantizedWeight."""
    return tuple(name for name, fmt in FORMATS.items() if fmt.is_quantized)


def get_format(name: str | Format) -> Format:
    """The Format registered under `name` (a Format is returned as is)."""
    if isinstance(name, Format):
        return name
    if name not in FORMATS:
        raise ValueError(FORMATS.unknown_message(name))
    return FORMATS.get(name)


def is_quantized_format(name: str | Format) -> bool:
    """Whether the format makes a QuantizedWeight (False for a dense one such as bf16)."""
    return get_format(name).is_quantized


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


__all__ = ["FORMATS", "Format", "bytes_per_parameter", "get_format", "is_quantized_format",
           "known_formats", "quantized_nbytes", "register_format", "validate_weight"]
