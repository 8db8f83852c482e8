"""Hugging Face checkpoints in and out: config.json + safetensors (single file or shards).

Loading builds the model abstractly (shapes only), then reads, checks, casts and places one
tensor at a time from memory-mapped files, so host memory never holds a second full copy.
Linear weights are stored [in, out] here and [out, in] in HF files; they are transposed on the
way in and out. Errors name the directory, file or tensor at fault.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any, Callable, Iterable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qerl_jax.infra.atomic_io import write_json_atomic
from qerl_jax.infra.errors import ConfigError
from qerl_jax.models.config import ModelConfig, dtype_from_name
from qerl_jax.models.safetensors_io import SafetensorsFile, save_safetensors
from qerl_jax.models.transformer import CausalLM, abstract_model

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers some exporters write that carry no parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ConfigError):
    """A checkpoint directory or tensor does not match what the model expects."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Where one HF tensor lives in our model.

    hf_shape is the shape in the file; `transpose` is True for linear weights ([out, in] in the
    file, [in, out] in the model); `is_linear` marks projection weights (the ones quantized).
    """

    hf_name: str
    path: tuple
    hf_shape: tuple[int, ...]
    transpose: bool
    is_linear: bool


def tensor_specs(config: ModelConfig) -> list[TensorSpec]:
    """Every parameter tensor of `config`'s architecture with its HF name and shape."""
    hidden, head_dim = config.hidden_size, config.resolved_head_dim
    q_out = config.num_attention_heads * head_dim
    kv_out = config.num_key_value_heads * head_dim
    inner = config.intermediate_size
    specs = [TensorSpec("model.embed_tokens.weight", ("embed_tokens", "embedding"),
                        (config.vocab_size, hidden), False, False)]
    projections = [("self_attn", "q_proj", q_out, hidden, config.attention_bias),
                   ("self_attn", "k_proj", kv_out, hidden, config.attention_bias),
                   ("self_attn", "v_proj", kv_out, hidden, config.attention_bias),
                   ("self_attn", "o_proj", hidden, q_out,
                    config.attention_bias and config.model_type == "llama"),
                   ("mlp", "gate_proj", inner, hidden, config.mlp_bias),
                   ("mlp", "up_proj", inner, hidden, config.mlp_bias),
                   ("mlp", "down_proj", hidden, inner, config.mlp_bias)]
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            specs.append(TensorSpec(f"{prefix}.{norm}.weight", ("layers", i, norm, "scale"),
                                    (hidden,), False, False))
        for block, name, out_features, in_features, has_bias in projections:
            specs.append(TensorSpec(f"{prefix}.{block}.{name}.weight",
                                    ("layers", i, block, name, "weight"),
                                    (out_features, in_features), True, True))
            if has_bias:
                specs.append(TensorSpec(f"{prefix}.{block}.{name}.bias",
                                        ("layers", i, block, name, "bias"),
                                        (out_features,), False, False))
    specs.append(TensorSpec("model.norm.weight", ("norm", "scale"), (hidden,), False, False))
    if not config.tie_word_embeddings:
        specs.append(TensorSpec("lm_head.weight", ("lm_head", "weight"),
                                (config.vocab_size, hidden), True, False))
    return specs


# ------------------------------------------------------------------------------ reading
def load_hf_config(directory: str, **overrides) -> ModelConfig:
    """Reads `directory`/config.json into a ModelConfig (overrides e.g. param_dtype=...)."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint directory {directory!r} does not exist")
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: not an HF checkpoint directory")
    with open(path) as handle:
        try:
            hf = json.load(handle)
        except json.JSONDecodeError as error:
            raise CheckpointError(f"{path}: invalid JSON: {error}") from None
    return ModelConfig.from_hf_dict(hf, source=path, **overrides)


def open_checkpoint_files(directory: str) -> dict[str, SafetensorsFile]:
    """Maps every tensor name to its open file (one file, or the shards of an index)."""
    single = os.path.join(directory, SINGLE_FILE)
    index_path = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path) as handle:
            try:
                weight_map = json.load(handle)["weight_map"]
            except (json.JSONDecodeError, KeyError) as error:
                raise CheckpointError(f"{index_path}: no valid weight_map ({error})") from None
        shards: dict[str, SafetensorsFile] = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = os.path.join(directory, shard)
            if not os.path.isfile(shard_path):
                raise FileNotFoundError(f"{shard_path} is listed in {index_path} but missing")
            shards[shard] = SafetensorsFile(shard_path)
        by_name = {}
        for name, shard in weight_map.items():
            if name not in shards[shard]:
                raise CheckpointError(f"{index_path} places {name!r} in {shard}, which lacks it")
            by_name[name] = shards[shard]
        return by_name
    if os.path.isfile(single):
        file = SafetensorsFile(single)
        return {name: file for name in file.keys()}
    raise FileNotFoundError(
        f"{directory} holds neither {SINGLE_FILE} nor {INDEX_FILE}: no weights to load")


def check_tensor_names(directory: str, expected: set[str], available: set[str],
                       tie_word_embeddings: bool) -> None:
    """Raises a CheckpointError listing missing and unexpected tensor names."""
    ignorable = {name for name in available if name.endswith(_IGNORED_SUFFIXES)}
    if tie_word_embeddings:
        ignorable.add("lm_head.weight")  # some exporters write the tied head anyway
    missing = sorted(expected - available)
    unexpected = sorted(available - expected - ignorable)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors ({len(missing)}): {missing[:8]}"
                         + (" ..." if len(missing) > 8 else ""))
        if unexpected:
            parts.append(f"unexpected tensors ({len(unexpected)}): {unexpected[:8]}"
                         + (" ..." if len(unexpected) > 8 else ""))
        raise CheckpointError(f"{directory}: " + "; ".join(parts))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_hf_model_files(directory: str, tokenizer_directory: str | None = None) -> ModelConfig:
    """The ModelConfig of an HF checkpoint directory whose config.json, safetensors headers,
    tensor names and shapes all fit, and whose tokenizer directory (default: `directory`)
    holds tokenizer files; read without loading a tensor (seconds: a run checks its model
    files before it touches its run directory).

    Raises:
      CheckpointError: one line naming the directory, file or tensor (a missing one too).
    """
    tokenizer_directory = tokenizer_directory or directory
    config = _checked_hf_config(directory)
    if not any(os.path.isfile(os.path.join(tokenizer_directory, name))
               for name in TOKENIZER_FILES):
        raise CheckpointError(f"{tokenizer_directory}: no tokenizer (none of "
                              f"{', '.join(TOKENIZER_FILES)})")
    return config


def _checked_hf_config(directory: str) -> ModelConfig:
    try:
        config = load_hf_config(directory)
        files = open_checkpoint_files(directory)
    except ConfigError:
        raise
    except (FileNotFoundError, ValueError) as error:   # ValueError: a config.json field
        raise CheckpointError(str(error)) from None
    specs = tensor_specs(config)
    check_tensor_names(directory, {spec.hf_name for spec in specs}, set(files),
                       config.tie_word_embeddings)
    for spec in specs:
        check_shape(files[spec.hf_name], spec.hf_name, spec.hf_shape)
    return config


def check_shape(file: SafetensorsFile, name: str, expected: tuple[int, ...]) -> None:
    """Raises a CheckpointError naming the tensor when its shape is not `expected`."""
    shape = file.shape(name)
    if shape != tuple(expected):
        raise CheckpointError(f"{file.path}: tensor {name!r} has shape {shape}, "
                              f"the config implies {tuple(expected)}")


def variable_at(model: CausalLM, path: tuple) -> nnx.Variable:
    node: Any = model
    for key in path[:-1]:
        node = node[key] if isinstance(key, int) else getattr(node, key)
    return getattr(node, path[-1])


@functools.partial(jax.jit, static_argnames=("dtype", "transpose"))
def to_model_layout(array, dtype, transpose):
    array = array.astype(dtype)
    return array.T if transpose else array


LinearWeightFn = Callable[[TensorSpec, jax.Array], Any]
PlaceFn = Callable[[tuple, Any], Any]   # (model path, value) -> the value where it will live


def load_hf_model(directory: str, *, param_dtype: str = "bfloat16",
                  compute_dtype: str | None = None, remat: bool = False,
                  linear_weight_fn: LinearWeightFn | None = None,
                  place: PlaceFn | None = None) -> CausalLM:
    """Loads an HF Qwen2/Llama checkpoint directory into a CausalLM, tensor by tensor.

    Args:
      directory: holds config.json and model.safetensors or model.safetensors.index.json.
      param_dtype, compute_dtype: 'bfloat16' | 'float32' (compute defaults to param_dtype).
      remat: per-layer gradient checkpointing.
      linear_weight_fn: optional (spec, weight [in, out]) -> value applied to each projection
        weight as it is loaded (e.g. quantization), so the dense copy of only one layer exists.
      place: optional (model path, value) -> value putting each tensor where it will live (e.g.
        qerl_jax.parallel.mesh.place_parameter on a device mesh) as soon as it is loaded.
    Raises:
      FileNotFoundError for a missing directory or file; CheckpointError (a ValueError) for an
      unsupported model_type, missing/unexpected tensors or a shape mismatch (naming it).
    """
    config = load_hf_config(directory, param_dtype=param_dtype,
                            compute_dtype=compute_dtype or param_dtype, remat=remat)
    return load_model_tensors(config, open_checkpoint_files(directory), directory,
                              linear_weight_fn, place)


def load_model_tensors(config: ModelConfig, files: Mapping[str, Any], source: str,
                       linear_weight_fn: LinearWeightFn | None = None,
                       place: PlaceFn | None = None) -> CausalLM:
    """Builds `config`'s model abstractly and fills it one tensor at a time, so the HF and
    GGUF loaders share one checked path.

    Args:
      files: HF tensor name -> an object with `.path`, `.shape(name)` (HF layout) and
        `[name]` (a host array, HF layout), e.g. a SafetensorsFile.
      source: the directory or file named in errors.
      linear_weight_fn, place: as in load_hf_model.
    """
    specs = tensor_specs(config)
    check_tensor_names(source, {spec.hf_name for spec in specs}, set(files),
                       config.tie_word_embeddings)
    model = abstract_model(config)
    target = config.jnp_param_dtype
    for spec in specs:
        file = files[spec.hf_name]
        check_shape(file, spec.hf_name, spec.hf_shape)
        raw = file[spec.hf_name]
        if not np.issubdtype(raw.dtype, np.floating) and raw.dtype.kind != "V":
            raise CheckpointError(f"{file.path}: tensor {spec.hf_name!r} has non-float dtype "
                                  f"{raw.dtype} (a quantized checkpoint? use "
                                  "qerl_jax.quant's loader)")
        value = to_model_layout(jnp.asarray(raw), target, spec.transpose)
        if linear_weight_fn is not None and spec.is_linear:
            value = linear_weight_fn(spec, value)
        if place is not None:
            value = place(spec.path, value)
        variable_at(model, spec.path).set_value(value)
    return model


# ------------------------------------------------------------------------------ writing
def dense_to_hf_array(value: jax.Array, dtype, transpose: bool) -> np.ndarray:
    """A model array as the host array HF files hold (cast, [out, in] for linear weights)."""
    return np.asarray(jax.device_get(to_model_layout(value, dtype, transpose)))


def _hf_tensors(model: CausalLM, dtype) -> Iterator[tuple[str, np.ndarray]]:
    for spec in tensor_specs(model.config):
        value = variable_at(model, spec.path).get_value()
        if not isinstance(value, jax.Array | np.ndarray):
            raise CheckpointError(
                f"{spec.hf_name}: holds a {type(value).__name__}, not a dense array; export "
                "quantized models with qerl_jax.quant's compressed-tensors exporter")
        yield spec.hf_name, dense_to_hf_array(value, dtype, spec.transpose)


def save_hf_model(model: CausalLM, directory: str, *, dtype: str | None = None,
                  max_shard_bytes: int = 2 * 1024**3) -> None:
    """Writes config.json and safetensors (sharded with an index above max_shard_bytes).

    Each file is written atomically; tensors are converted one at a time.
    """
    dtype_name = dtype or model.config.param_dtype
    hf_config = model.config.to_hf_dict()
    hf_config["torch_dtype"] = dtype_name
    write_checkpoint(directory, _hf_tensors(model, dtype_from_name(dtype_name, "dtype")),
                     hf_config, max_shard_bytes)


def write_checkpoint(directory: str, tensors: Iterable[tuple[str, np.ndarray]],
                     hf_config: dict, max_shard_bytes: int = 2 * 1024**3) -> None:
    """Writes named host arrays as safetensors shards (+ index) and config.json, atomically
    file by file; config.json last, so a directory with a config has all its weights."""
    os.makedirs(directory, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    sizes = [0]
    for name, array in tensors:
        if sizes[-1] and sizes[-1] + array.nbytes > max_shard_bytes:
            shards.append({})
            sizes.append(0)
        shards[-1][name] = array
        sizes[-1] += array.nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_safetensors(os.path.join(directory, SINGLE_FILE), shards[0], metadata)
    else:
        weight_map = {}
        for number, shard in enumerate(shards, start=1):
            file_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            save_safetensors(os.path.join(directory, file_name), shard, metadata)
            weight_map.update({name: file_name for name in shard})
        write_json_atomic(os.path.join(directory, INDEX_FILE),
                    {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map})
    write_json_atomic(os.path.join(directory, CONFIG_FILE), hf_config)


