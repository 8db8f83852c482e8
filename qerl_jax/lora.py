"""LoRA adapters on the model's projections, applied unmerged, with PEFT export and merging.

W stays frozen (dense bf16 or quantized); each targeted Linear gets A [in, r] ~ U(-1/sqrt(in),
1/sqrt(in)) (PEFT's kaiming-uniform default) and B [r, out] = 0, so training starts at the base
model; y = x W + (alpha / r) * (x A) B (Hu et al. 2021). Optionally the decoder layers' RMSNorm
scales are trained too (QeRL's ln=True: input_layernorm and post_attention_layernorm).
"""

from __future__ import annotations

import dataclasses
import os
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qerl_jax.infra.atomic_io import write_json_atomic
from qerl_jax.models.layers import Linear, LoRAParam, RMSNorm
from qerl_jax.models.safetensors_io import save_safetensors
from qerl_jax.models.transformer import CausalLM
from qerl_jax.registry import LORA_PROJECTIONS

ALL_PROJECTIONS = LORA_PROJECTIONS.names()
_DECODER_NORMS = ("input_layernorm", "post_attention_layernorm")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """rank r, alpha (scale = alpha / r), target projection names, and whether the decoder
    layers' norm scales are trainable (QeRL ln=True)."""

    rank: int = 16
    alpha: float = 16.0
    target_modules: tuple[str, ...] = ALL_PROJECTIONS
    train_norms: bool = False

    def __post_init__(self):
        if self.rank <= 0:
            raise ValueError(f"lora rank={self.rank} must be positive")
        if not self.alpha > 0:
            raise ValueError(f"lora alpha={self.alpha} must be positive")
        unknown = set(self.target_modules) - set(ALL_PROJECTIONS)
        if unknown or not self.target_modules:
            raise ValueError(f"lora target_modules {sorted(unknown) or '()'} not in "
                             f"{ALL_PROJECTIONS}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class TrainableNormScale(nnx.Param):
    """A decoder-layer RMSNorm scale trained alongside LoRA (ln=True)."""


def _named_modules(model: CausalLM, kind):
    for path, node in nnx.iter_graph(model):
        if isinstance(node, kind):
            yield tuple(path), node


def add_lora(model: CausalLM, config: LoRAConfig, key: jax.Array) -> int:
    """Attaches adapters to every targeted Linear of the decoder layers, in place.

    Returns the number of adapted layers. Adapter params are float32.
    """
    count = 0
    for path, layer in _named_modules(model, Linear):
        if path[0] != "layers" or path[-1] not in config.target_modules:
            continue
        bound = 1.0 / np.sqrt(layer.in_features)
        layer_key = jax.random.fold_in(key, count)
        layer.lora_a = LoRAParam(jax.random.uniform(
            layer_key, (layer.in_features, config.rank), jnp.float32, -bound, bound))
        layer.lora_b = LoRAParam(jnp.zeros((config.rank, layer.out_features), jnp.float32))
        layer.lora_scale = config.scale
        count += 1
    if config.train_norms:
        for path, norm in _named_modules(model, RMSNorm):
            if path[0] == "layers" and path[-1] in _DECODER_NORMS:
                norm.scale = TrainableNormScale(norm.scale.get_value().astype(jnp.float32))
    return count


def cast_adapters_for_compute(model: CausalLM) -> int:
    """Casts every adapter's A and B to its layer's compute dtype, in place; returns how many
    layers were cast.

    For decoding: Linear casts A and B to the compute dtype on every call, and inside the
    sampler's while_loop XLA re-runs those converts at every token (about 9 convert kernels per
    layer per step in a GPU profile). Casting once before the
    loop gives bit-identical outputs. Use it on a merged copy inside a jitted function, never on
    the trained state (the optimizer keeps the float32 adapters).
    """
    count = 0
    for _, layer in _named_modules(model, Linear):
        if layer.lora_a is None:
            continue
        for param in (layer.lora_a, layer.lora_b):
            param.set_value(param.get_value().astype(layer.compute_dtype))
        count += 1
    return count


TRAINABLE = nnx.Any(LoRAParam, TrainableNormScale)
"""nnx filter selecting what the optimizer trains."""


def lora_disabled_state(state: nnx.State) -> nnx.State:
    """The same state with every LoRA B zeroed: the base model, for the KL reference, with no
    second copy of the base weights (only the small B matrices are replaced)."""
    def zero_b(path, leaf):
        names = [getattr(part, "key", getattr(part, "name", None)) for part in path]
        return jnp.zeros_like(leaf) if "lora_b" in names else leaf
    return jax.tree_util.tree_map_with_path(zero_b, state)


def merged_dense_weight(layer: Linear, dequantize=None) -> jax.Array:
    """W + scale * A B as a dense [in, out] float32 array (dequantizing a quantized W)."""
    weight = layer.weight.get_value()
    if not isinstance(weight, jax.Array):
        if dequantize is None:
            raise ValueError("merging into a quantized weight needs a dequantize function")
        weight = dequantize(weight).T
    weight = weight.astype(jnp.float32)
    if layer.lora_a is None:
        return weight
    return weight + layer.lora_scale * (layer.lora_a.get_value().astype(jnp.float32)
                                        @ layer.lora_b.get_value().astype(jnp.float32))


def merge_lora(model: CausalLM, dtype=jnp.bfloat16) -> None:
    """Folds every adapter into its base weight (dense `dtype`), in place, and drops it.

    Quantized bases are dequantized first, so the merged model is dense.
    """
    def dequantize(quantized):
        from qerl_jax.quant.formats import get_format  # imported only for quantized bases
        return get_format(quantized.format).dequantize(quantized, jnp.float32)

    for _, layer in _named_modules(model, Linear):
        if layer.lora_a is None:
            continue
        layer.weight = nnx.Param(merged_dense_weight(layer, dequantize).astype(dtype))
        layer.lora_a = None
        layer.lora_b = None
        layer.lora_scale = 0.0


def export_peft_adapter(model: CausalLM, directory: str, config: LoRAConfig,
                        base_model_name_or_path: str = "") -> None:
    """Writes adapter_model.safetensors + adapter_config.json in PEFT's LoRA format.

    PEFT names: base_model.model.model.layers.{i}.{block}.{proj}.lora_A.weight [r, in] and
    lora_B.weight [out, r]. Trained norm scales (ln=True) are not part of PEFT's LoRA format and
    are refused here rather than silently dropped.
    """
    if config.train_norms:
        raise ValueError("train_norms=True adapters also change the RMSNorm scales, which PEFT's "
                         "LoRA format cannot hold; merge_lora and save the full model instead")
    tensors = {}
    for path, layer in _named_modules(model, Linear):
        if layer.lora_a is None:
            continue
        prefix = "base_model.model.model." + ".".join(str(p) for p in path)
        tensors[f"{prefix}.lora_A.weight"] = np.asarray(layer.lora_a.get_value(), np.float32).T
        tensors[f"{prefix}.lora_B.weight"] = np.asarray(layer.lora_b.get_value(), np.float32).T
    if not tensors:
        raise ValueError("the model has no LoRA adapters to export")
    os.makedirs(directory, exist_ok=True)
    save_safetensors(os.path.join(directory, "adapter_model.safetensors"),
                     {k: np.ascontiguousarray(v) for k, v in tensors.items()},
                     {"format": "pt"})
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": config.rank,
        "lora_alpha": config.alpha, "lora_dropout": 0.0, "bias": "none",
        "target_modules": sorted(config.target_modules), "fan_in_fan_out": False,
        "init_lora_weights": True, "use_rslora": False, "use_dora": False,
        "base_model_name_or_path": base_model_name_or_path, "inference_mode": True,
        "modules_to_save": None,
    }
    write_json_atomic(os.path.join(directory, "adapter_config.json"), adapter_config)


def count_lora_parameters(model: CausalLM) -> int:
    return sum(int(np.prod(leaf.shape)) for leaf in
               jax.tree_util.tree_leaves(nnx.state(model, LoRAParam)))

