"""HF checkpoint I/O: exact round trips, sharding, interop with transformers, clear errors."""

import os
import shutil

import jax
import numpy as np
import pytest
import torch
import transformers

from qerl_jax.models import init_model, preset
from qerl_jax.models.hf_io import (CheckpointError, load_hf_config, load_hf_model,
                                   save_hf_model)
from qerl_jax.models.safetensors_io import SafetensorsFile, save_safetensors
from tests.hf_reference import hf_logits, make_hf_model, rewrite_config, save_hf_model_dir


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return save_hf_model_dir(make_hf_model("qwen2", seed=7), str(tmp_path_factory.mktemp("q")))


@pytest.fixture
def qwen_copy(qwen_dir, tmp_path):
    target = str(tmp_path / "copy")
    shutil.copytree(qwen_dir, target)
    return target


def _all_tensors(directory):
    tensors = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            file = SafetensorsFile(os.path.join(directory, name))
            tensors.update({key: np.array(file[key]) for key in file.keys()})
    return tensors


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_save_load_round_trip_is_exact(qwen_dir, tmp_path, dtype):
    model = load_hf_model(qwen_dir, param_dtype=dtype)
    out = str(tmp_path / "saved")
    save_hf_model(model, out)
    reloaded = load_hf_model(out, param_dtype=dtype)
    for a, b in zip(jax.tree_util.tree_leaves(jax.tree_util.tree_map(np.asarray, _state(model))),
                    jax.tree_util.tree_leaves(_state(reloaded))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if dtype == "float32":  # the fp32 save equals the original file bit for bit
        original, saved = _all_tensors(qwen_dir), _all_tensors(out)
        assert sorted(saved) == sorted(k for k in original if k != "lm_head.weight")
        for name, array in saved.items():
            np.testing.assert_array_equal(array, original[name], err_msg=name)


def _state(model):
    from flax import nnx
    return nnx.state(model, nnx.Param)


def test_sharded_save_loads_in_ours_and_transformers(tmp_path):
    hf_model = make_hf_model("llama", seed=3)
    source = save_hf_model_dir(hf_model, str(tmp_path / "src"))
    model = load_hf_model(source, param_dtype="float32")
    out = str(tmp_path / "sharded")
    save_hf_model(model, out, max_shard_bytes=64 * 1024)
    assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(out) if f.endswith(".safetensors")]) > 2
    tokens = np.random.default_rng(0).integers(0, 256, size=(2, 7))
    reference = hf_logits(hf_model, tokens)
    np.testing.assert_allclose(np.asarray(load_hf_model(out, param_dtype="float32")(tokens)),
                               reference, atol=1e-4)
    reloaded_by_hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    np.testing.assert_allclose(hf_logits(reloaded_by_hf, tokens), reference, atol=1e-5)


def test_random_model_saves_and_hf_reads_it(tmp_path):
    model = init_model(preset("tiny_qwen2", vocab_size=256), seed=0)
    save_hf_model(model, str(tmp_path))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path),
                                                                 dtype=torch.float32)
    tokens = np.random.default_rng(1).integers(0, 256, size=(1, 6))
    np.testing.assert_allclose(np.asarray(model(tokens)), hf_logits(hf_model, tokens), atol=1e-5)


def test_loading_places_no_extra_dense_copy(qwen_dir):
    """The linear_weight_fn hook sees each projection once, as [in, out], while loading."""
    seen = []

    def record(spec, weight):
        seen.append((spec.hf_name, weight.shape))
        return weight

    config = load_hf_config(qwen_dir)
    load_hf_model(qwen_dir, param_dtype="float32", linear_weight_fn=record)
    assert len(seen) == 7 * config.num_hidden_layers
    assert seen[0][1] == (config.hidden_size, config.hidden_size)


# ------------------------------------------------------------------------------ errors
def test_missing_directory():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_model("/nonexistent/model/dir")


def test_missing_config(qwen_copy):
    os.remove(os.path.join(qwen_copy, "config.json"))
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        load_hf_model(qwen_copy)


def test_missing_weights(qwen_copy):
    os.remove(os.path.join(qwen_copy, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        load_hf_model(qwen_copy)


def test_missing_shard(tmp_path):
    model = init_model(preset("tiny_qwen2"), seed=0)
    save_hf_model(model, str(tmp_path), max_shard_bytes=32 * 1024)
    os.remove(os.path.join(tmp_path, sorted(f for f in os.listdir(tmp_path)
                                            if f.endswith(".safetensors"))[0]))
    with pytest.raises(FileNotFoundError, match="listed in .*index.json but missing"):
        load_hf_model(str(tmp_path))


def test_unsupported_model_type(qwen_copy):
    rewrite_config(qwen_copy, model_type="gpt2")
    with pytest.raises(ValueError, match="model_type='gpt2' is not supported"):
        load_hf_model(qwen_copy)


def _rewrite_tensors(directory, edit):
    path = os.path.join(directory, "model.safetensors")
    tensors = {k: np.array(v) for k, v in
               ((k, SafetensorsFile(path)[k]) for k in SafetensorsFile(path).keys())}
    edit(tensors)
    save_safetensors(path, tensors)


def test_missing_tensor_is_named(qwen_copy):
    _rewrite_tensors(qwen_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors \(1\).*layers\.1\.mlp\.up_proj"):
        load_hf_model(qwen_copy)


def test_unexpected_tensor_is_named(qwen_copy):
    def add(tensors):
        tensors["model.layers.0.extra.weight"] = np.zeros((2,), np.float32)
    _rewrite_tensors(qwen_copy, add)
    with pytest.raises(CheckpointError, match=r"unexpected tensors \(1\).*layers\.0\.extra"):
        load_hf_model(qwen_copy)


def test_shape_mismatch_is_named(qwen_copy):
    def shrink(tensors):
        tensors["model.layers.2.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
    _rewrite_tensors(qwen_copy, shrink)
    with pytest.raises(CheckpointError,
                       match=r"'model\.layers\.2\.self_attn\.k_proj\.weight' has shape \(16, 64\)"):
        load_hf_model(qwen_copy)


def test_config_shape_mismatch_names_tensor(qwen_copy):
    rewrite_config(qwen_copy, intermediate_size=96)
    with pytest.raises(CheckpointError, match=r"mlp\.gate_proj\.weight' has shape \(160, 64\)"):
        load_hf_model(qwen_copy)


def test_corrupt_config_json(qwen_copy):
    with open(os.path.join(qwen_copy, "config.json"), "w") as handle:
        handle.write("{not json")
    with pytest.raises(ValueError, match="config.json: invalid JSON"):
        load_hf_model(qwen_copy)
