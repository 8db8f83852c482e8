"""Quantize a whole model, layer by layer, to one weight format.

`quantize_model(model, "nvfp4")` replaces every projection weight (q, k, v, o, gate, up, down)
by a QuantizedWeight held in a `QuantizedParam` variable (frozen: never trained or
differentiated); embeddings, lm_head and norms stay dense by default.
`load_quantized_hf_model(directory, "nvfp4")` quantizes while loading, one tensor at a time, so
a 32B checkpoint never exists as a full bf16 copy next to the full quantized copy.
Each quantized layer's relative weight error ||W - deq(Q(W))||_F / ||W||_F is reported.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from qerl_jax.models.hf_io import TensorSpec, load_hf_model
from qerl_jax.models.layers import Linear
from qerl_jax.models.transformer import CausalLM
from qerl_jax.quant.formats import get_format
from qerl_jax.quant.qarray import QuantizedWeight

logger = logging.getLogger(__name__)

# Path components that keep a Linear dense by default (QeRL / NVFP4A16: lm_head, embeddings and
# norms untouched; embeddings and norms are not Linear layers anyway).
DEFAULT_EXCLUDE = ("embed_tokens", "lm_head", "norm")


class QuantizedParam(nnx.Variable):
    """A frozen quantized base weight (a QuantizedWeight pytree). Not an nnx.Param, so
    optimizers and parameter filters never see it."""


@dataclasses.dataclass
class QuantizationReport:
    """What quantize_model did: format, per-layer relative error and byte counts."""

    format: str
    layer_errors: dict[str, float] = dataclasses.field(default_factory=dict)
    quantized_bytes: int = 0  # bytes of the quantized layers' codes + scales
    dense_bytes_bf16: int = 0  # the same layers in bf16

    @property
    def mean_relative_error(self) -> float:
        return sum(self.layer_errors.values()) / max(len(self.layer_errors), 1)

    def summary(self) -> str:
        worst = max(self.layer_errors.items(), key=lambda item: item[1], default=("-", 0.0))
        ratio = self.dense_bytes_bf16 / max(self.quantized_bytes, 1)
        return (f"{self.format}: {len(self.layer_errors)} layers, mean relative error "
                f"{self.mean_relative_error:.4f}, worst {worst[1]:.4f} ({worst[0]}), "
                f"{self.quantized_bytes / 2**20:.1f} MiB vs {self.dense_bytes_bf16 / 2**20:.1f} "
                f"MiB in bf16 ({ratio:.2f}x smaller)")


def _is_excluded(path: str, exclude: Sequence[str]) -> bool:
    parts = path.split(".")
    return any(token in parts for token in exclude)


@functools.partial(jax.jit, static_argnames=("format_name",))
def _quantize_and_measure(weight_in_out: jax.Array, format_name: str):
    """[in, out] dense -> (QuantizedWeight of W^T [out, in], relative Frobenius error)."""
    fmt = get_format(format_name)
    reference = weight_in_out.astype(jnp.float32).T
    quantized = fmt.quantize(weight_in_out.T, check_finite=False)
    restored = fmt.dequantize(quantized, jnp.float32)
    error = jnp.linalg.norm(restored - reference) / jnp.maximum(jnp.linalg.norm(reference),
                                                                1e-30)
    return quantized, error


def quantize_weight(weight_in_out: jax.Array, format_name: str, name: str = "weight"):
    """Quantizes one projection weight [in, out] (model layout); returns (value, rel. error).

    For 'bf16' the value is the dense weight cast to bfloat16. Raises ValueError naming the
    layer for NaN/Inf weights or an in-dimension not divisible by the format's block.
    """
    fmt = get_format(format_name)
    if not bool(jnp.isfinite(weight_in_out).all()):
        raise ValueError(f"layer {name}: weight holds NaN or Inf; refusing to quantize")
    if not fmt.is_quantized:
        value = weight_in_out.astype(jnp.bfloat16)
        reference = weight_in_out.astype(jnp.float32)
        error = jnp.linalg.norm(value.astype(jnp.float32) - reference) / jnp.maximum(
            jnp.linalg.norm(reference), 1e-30)
        return value, float(error)
    in_features = weight_in_out.shape[0]
    if in_features % fmt.block_size:
        raise ValueError(f"layer {name}: in_features={in_features} (weight shape "
                         f"{tuple(weight_in_out.shape)} as [in, out]) is not divisible by "
                         f"{format_name}'s block size {fmt.block_size}")
    quantized, error = _quantize_and_measure(weight_in_out, format_name)
    return quantized, float(error)


def _linear_layers(model: CausalLM):
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Linear):
            yield ".".join(str(part) for part in path), node


def _record(report: QuantizationReport, name: str, value, error: float, shape) -> None:
    report.layer_errors[name] = error
    report.dense_bytes_bf16 += 2 * shape[0] * shape[1]
    report.quantized_bytes += sum(leaf.size * leaf.dtype.itemsize
                                  for leaf in jax.tree_util.tree_leaves(value))


def quantize_model(model: CausalLM, format_name: str, *,
                   exclude: Sequence[str] = DEFAULT_EXCLUDE) -> QuantizationReport:
    """Quantizes `model`'s projection weights in place, one layer at a time.

    Each dense weight is replaced (and freed) before the next is quantized, so peak memory is the
    model plus one layer. Returns the QuantizationReport.
    """
    get_format(format_name)
    report = QuantizationReport(format_name)
    for name, layer in list(_linear_layers(model)):
        if _is_excluded(name, exclude):
            continue
        dense = layer.weight.get_value()
        if isinstance(dense, QuantizedWeight):
            raise ValueError(f"layer {name} is already quantized ({dense.format})")
        value, error = quantize_weight(dense, format_name, name=name)
        _record(report, name, value, error, dense.shape)
        layer.weight = (QuantizedParam(value) if get_format(format_name).is_quantized
                        else nnx.Param(value))
        del dense
    logger.info("quantize_model: %s", report.summary())
    return report


def load_quantized_hf_model(directory: str, format_name: str, *,
                            exclude: Sequence[str] = DEFAULT_EXCLUDE,
                            compute_dtype: str = "bfloat16",
                            remat: bool = False,
                            place=None) -> tuple[CausalLM, QuantizationReport]:
    """Loads an HF checkpoint and quantizes each projection as it is read.

    Only one dense projection exists at a time next to the already-quantized ones. Dense
    (excluded) tensors are loaded in bfloat16. `place`: as in load_hf_model (each tensor put
    where it will live once quantized, e.g. on its shards of a device mesh).
    """
    get_format(format_name)
    report = QuantizationReport(format_name)

    def quantize_on_load(spec: TensorSpec, weight_in_out: jax.Array):
        name = ".".join(str(part) for part in spec.path[:-1])
        if _is_excluded(name, exclude):
            return weight_in_out
        value, error = quantize_weight(weight_in_out, format_name, name=name)
        _record(report, name, value, error, weight_in_out.shape)
        return value

    model = load_hf_model(directory, param_dtype="bfloat16", compute_dtype=compute_dtype,
                          remat=remat, linear_weight_fn=quantize_on_load, place=place)
    mark_quantized_params(model)
    logger.info("load_quantized_hf_model(%s): %s", directory, report.summary())
    return model, report


def mark_quantized_params(model: CausalLM) -> None:
    """Moves QuantizedWeight values held in nnx.Param variables into QuantizedParam ones."""
    for _, layer in _linear_layers(model):
        value = layer.weight.get_value()
        if isinstance(value, QuantizedWeight) and not isinstance(layer.weight, QuantizedParam):
            layer.weight = QuantizedParam(value)
