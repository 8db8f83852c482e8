"""compressed-tensors NVFP4A16 checkpoints in and out (what llm-compressor writes and vLLM serves).

A quantized projection `P` is stored as three tensors instead of `P.weight`:
  P.weight_packed        uint8 [out, in/2]   E2M1 codes, even k in the low nibble
  P.weight_scale         float8_e4m3fn [out, in/16]
  P.weight_global_scale  float32 [1]          a divisor: w = code * scale / global
and config.json carries a `quantization_config` (quant_method compressed-tensors, format
nvfp4-pack-quantized). These map one to one onto our NVFP4 QuantizedWeight, so loading and
exporting copy codes and scales bit for bit.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Iterator

import jax.numpy as jnp
import numpy as np

from qerl_jax.models.config import dtype_from_name
from qerl_jax.models.hf_io import (CONFIG_FILE, CheckpointError, check_shape,
                                   check_tensor_names, dense_to_hf_array, load_hf_config,
                                   open_checkpoint_files, tensor_specs, to_model_layout,
                                   variable_at, write_checkpoint)
from qerl_jax.models.transformer import CausalLM, abstract_model
from qerl_jax.model_quant.quantize import mark_quantized_params
from qerl_jax.quant.qarray import QuantizedWeight

NVFP4_FORMAT = "nvfp4-pack-quantized"
NVFP4_GROUP_SIZE = 16
_QUANTIZED_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale")
COMPRESSED_TENSORS_VERSION = "0.12.0"  # the oldest config layout vLLM reads that we write


def nvfp4a16_quantization_config(ignore: list[str]) -> dict[str, Any]:
    """The config.json `quantization_config` of an NVFP4A16 (weight-only) checkpoint."""
    return {
        "config_groups": {"group_0": {
            "format": NVFP4_FORMAT, "input_activations": None, "output_activations": None,
            "targets": ["Linear"],
            "weights": {"dynamic": False, "group_size": NVFP4_GROUP_SIZE, "num_bits": 4,
                        "observer": "minmax", "scale_dtype": "torch.float8_e4m3fn",
                        "strategy": "tensor_group", "symmetric": True, "type": "float"},
        }},
        "format": NVFP4_FORMAT, "global_compression_ratio": None, "ignore": ignore,
        "kv_cache_scheme": None, "quant_method": "compressed-tensors",
        "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {},
        "version": COMPRESSED_TENSORS_VERSION,
    }


def _matches(module_name: str, pattern: str) -> bool:
    if pattern == "Linear":
        return True
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module_name) is not None
    return module_name == pattern or module_name.endswith("." + pattern)


def _quantized_modules(config_path: str, quantization: dict, linear_modules: list[str]) -> set[str]:
    """The HF module names (e.g. model.layers.0.mlp.up_proj) stored in NVFP4."""
    if quantization.get("quant_method") != "compressed-tensors":
        raise CheckpointError(f"{config_path}: quantization_config.quant_method="
                              f"{quantization.get('quant_method')!r}, expected compressed-tensors")
    groups = quantization.get("config_groups") or {}
    if not groups:
        raise CheckpointError(f"{config_path}: quantization_config has no config_groups")
    ignore = quantization.get("ignore") or []
    quantized: set[str] = set()
    for group_name, group in groups.items():
        fmt = group.get("format") or quantization.get("format")
        weights = group.get("weights") or {}
        where = f"{config_path}: quantization_config.config_groups.{group_name}"
        if fmt != NVFP4_FORMAT:
            raise CheckpointError(f"{where}.format={fmt!r}; only {NVFP4_FORMAT} is supported")
        if (weights.get("num_bits"), weights.get("type"), weights.get("group_size"),
                weights.get("strategy"), weights.get("symmetric")) != (
                    4, "float", NVFP4_GROUP_SIZE, "tensor_group", True):
            raise CheckpointError(f"{where}.weights={weights} is not NVFP4 (4-bit float, "
                                  "group 16, tensor_group, symmetric)")
        if group.get("input_activations"):
            raise CheckpointError(f"{where}: activation quantization (NVFP4 W4A4) is not "
                                  "supported; use an NVFP4A16 (weight-only) checkpoint")
        for module in linear_modules:
            if any(_matches(module, t) for t in group.get("targets", [])) and not any(
                    _matches(module, pattern) for pattern in ignore):
                quantized.add(module)
    return quantized


def load_compressed_tensors_model(directory: str, *, param_dtype: str = "bfloat16",
                                  compute_dtype: str | None = None,
                                  remat: bool = False) -> CausalLM:
    """Loads a compressed-tensors NVFP4A16 checkpoint straight into the quantized model.

    Quantized projections become NVFP4 QuantizedWeights (codes and scales copied bit for bit);
    everything else loads dense in `param_dtype`. Errors name the file and tensor at fault.
    """
    config = load_hf_config(directory, param_dtype=param_dtype,
                            compute_dtype=compute_dtype or param_dtype, remat=remat)
    config_path = os.path.join(directory, CONFIG_FILE)
    with open(config_path) as handle:
        quantization = json.load(handle).get("quantization_config")
    if not quantization:
        raise CheckpointError(f"{config_path} has no quantization_config: not a "
                              "compressed-tensors checkpoint (use load_hf_model)")
    specs = tensor_specs(config)
    linear_names = [spec.hf_name[:-len(".weight")] for spec in specs if spec.transpose]
    quantized = _quantized_modules(config_path, quantization, linear_names)
    if "lm_head" in quantized:
        raise CheckpointError(f"{config_path}: a quantized lm_head is not supported (NVFP4A16 "
                              "ignores lm_head)")
    files = open_checkpoint_files(directory)
    expected = set()
    for spec in specs:
        module = spec.hf_name[:-len(".weight")]
        if spec.is_linear and module in quantized:
            expected.update(f"{module}.{suffix}" for suffix in _QUANTIZED_SUFFIXES)
        else:
            expected.add(spec.hf_name)
    check_tensor_names(directory, expected, set(files), config.tie_word_embeddings)
    model = abstract_model(config)
    target = dtype_from_name(param_dtype, "param_dtype")
    for spec in specs:
        module = spec.hf_name[:-len(".weight")]
        if spec.is_linear and module in quantized:
            out_features, in_features = spec.hf_shape
            if in_features % NVFP4_GROUP_SIZE:
                raise CheckpointError(f"{module}: in_features={in_features} is not a multiple "
                                      f"of the NVFP4 group size {NVFP4_GROUP_SIZE}")
            arrays = {}
            shapes = {"weight_packed": (out_features, in_features // 2),
                      "weight_scale": (out_features, in_features // NVFP4_GROUP_SIZE),
                      "weight_global_scale": (1,)}
            for suffix in _QUANTIZED_SUFFIXES:
                name = f"{module}.{suffix}"
                check_shape(files[name], name, shapes[suffix])
                arrays[suffix] = files[name][name]
            if arrays["weight_packed"].dtype != np.uint8:
                raise CheckpointError(f"{module}.weight_packed has dtype "
                                      f"{arrays['weight_packed'].dtype}, expected uint8")
            value = QuantizedWeight(
                codes=jnp.asarray(arrays["weight_packed"]),
                block_scales=jnp.asarray(arrays["weight_scale"]).astype(jnp.float8_e4m3fn),
                tensor_scale=jnp.asarray(arrays["weight_global_scale"],
                                         jnp.float32).reshape(()),
                format="nvfp4", shape=(out_features, in_features), dtype="bfloat16")
        else:
            file = files[spec.hf_name]
            check_shape(file, spec.hf_name, spec.hf_shape)
            value = to_model_layout(jnp.asarray(file[spec.hf_name]), target, spec.transpose)
        variable_at(model, spec.path).set_value(value)
    mark_quantized_params(model)
    return model


def _export_tensors(model: CausalLM, dtype) -> Iterator[tuple[str, np.ndarray]]:
    for spec in tensor_specs(model.config):
        value = variable_at(model, spec.path).get_value()
        module = spec.hf_name[:-len(".weight")]
        if isinstance(value, QuantizedWeight):
            if value.format != "nvfp4":
                raise CheckpointError(f"{module}: format {value.format!r} cannot be exported to "
                                      f"compressed-tensors {NVFP4_FORMAT}; quantize to nvfp4")
            yield f"{module}.weight_packed", np.asarray(value.codes, np.uint8)
            yield f"{module}.weight_scale", np.asarray(value.block_scales).astype(
                jnp.float8_e4m3fn)
            yield f"{module}.weight_global_scale", np.asarray(
                value.tensor_scale, np.float32).reshape(1)
        else:
            yield spec.hf_name, dense_to_hf_array(value, dtype, spec.transpose)


def export_compressed_tensors(model: CausalLM, directory: str, *, dtype: str = "bfloat16",
                              max_shard_bytes: int = 2 * 1024**3) -> None:
    """Writes the model as a compressed-tensors NVFP4A16 checkpoint (vLLM can serve it).

    NVFP4 projections are written packed; dense tensors in `dtype`. Modules left dense are
    listed in the config's `ignore`.
    """
    dense_linear = []
    for spec in tensor_specs(model.config):
        if spec.transpose and not isinstance(variable_at(model, spec.path).get_value(),
                                             QuantizedWeight):
            dense_linear.append(spec.hf_name[:-len(".weight")])
    if model.config.tie_word_embeddings:
        dense_linear.append("lm_head")
    hf_config = model.config.to_hf_dict()
    hf_config["torch_dtype"] = dtype
    hf_config["quantization_config"] = nvfp4a16_quantization_config(sorted(set(dense_linear)))
    write_checkpoint(directory, _export_tensors(model, dtype_from_name(dtype, "dtype")),
                     hf_config, max_shard_bytes)
