"""LoRA: init, unmerged application, the LoRA-disabled reference, merge, and PEFT export loaded
by peft itself (logits compared, fp32, max abs diff <= 1e-4 at a logit scale of ~2)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qerl_jax.lora import (TRAINABLE, LoRAConfig, add_lora, count_lora_parameters,
                           export_peft_adapter, lora_disabled_state, merge_lora)
from qerl_jax.models.hf_io import load_hf_model
from qerl_jax.models.layers import LoRAParam
from tests.hf_reference import hf_logits, make_hf_model, save_hf_model_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf_model = make_hf_model("qwen2", seed=31)
    return hf_model, save_hf_model_dir(hf_model, str(tmp_path_factory.mktemp("lora")))


def _randomize_b(model, key):
    for index, (_, layer) in enumerate(nnx.iter_graph(model)):
        if getattr(layer, "lora_b", None) is not None:
            shape = layer.lora_b.get_value().shape
            layer.lora_b.set_value(0.05 * jax.random.normal(jax.random.fold_in(key, index), shape))


def test_fresh_adapters_leave_the_model_unchanged(tiny):
    _, directory = tiny
    model = load_hf_model(directory, param_dtype="float32")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, size=(2, 6)))
    before = np.asarray(model(tokens))
    config = LoRAConfig(rank=4, alpha=8)
    assert add_lora(model, config, jax.random.key(0)) == 7 * 3
    np.testing.assert_array_equal(np.asarray(model(tokens)), before)
    # per layer r * (in + out) for q, k, v, o, gate, up, down (hidden 64, kv 32, inner 160)
    assert count_lora_parameters(model) == 3 * 4 * (2 * (64 + 64) + 2 * (64 + 32) +
                                                    3 * (64 + 160))


def test_peft_loads_the_export_and_matches(tiny, tmp_path):
    from peft import PeftModel
    hf_model, directory = tiny
    model = load_hf_model(directory, param_dtype="float32")
    config = LoRAConfig(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj"))
    add_lora(model, config, jax.random.key(1))
    _randomize_b(model, jax.random.key(2))
    export_peft_adapter(model, str(tmp_path), config)
    peft_model = PeftModel.from_pretrained(make_hf_model("qwen2", seed=31), str(tmp_path))
    tokens = np.random.default_rng(1).integers(0, 256, size=(2, 9))
    reference = hf_logits(peft_model, tokens)
    assert np.abs(reference - hf_logits(hf_model, tokens)).max() > 1e-2  # adapters matter
    np.testing.assert_allclose(np.asarray(model(tokens)), reference, atol=1e-4)


def test_merge_equals_unmerged(tiny):
    _, directory = tiny
    model = load_hf_model(directory, param_dtype="float32")
    add_lora(model, LoRAConfig(rank=2, alpha=4), jax.random.key(3))
    _randomize_b(model, jax.random.key(4))
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 256, size=(1, 7)))
    unmerged = np.asarray(model(tokens))
    merge_lora(model, dtype=jnp.float32)
    assert count_lora_parameters(model) == 0
    np.testing.assert_allclose(np.asarray(model(tokens)), unmerged, atol=1e-5)


def test_disabled_state_is_the_base_model(tiny):
    _, directory = tiny
    model = load_hf_model(directory, param_dtype="float32")
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 256, size=(1, 5)))
    base = np.asarray(model(tokens))
    add_lora(model, LoRAConfig(rank=2, alpha=2), jax.random.key(5))
    _randomize_b(model, jax.random.key(6))
    graphdef, state = nnx.split(model)
    reference = nnx.merge(graphdef, lora_disabled_state(state))
    np.testing.assert_allclose(np.asarray(reference(tokens)), base, atol=1e-6)
    assert np.abs(np.asarray(model(tokens)) - base).max() > 1e-3


def test_train_norms_marks_decoder_norms_trainable(tiny):
    _, directory = tiny
    model = load_hf_model(directory, param_dtype="bfloat16")
    add_lora(model, LoRAConfig(rank=2, train_norms=True), jax.random.key(0))
    trainable = nnx.state(model, TRAINABLE)
    leaves = jax.tree_util.tree_leaves(trainable)
    assert len(leaves) == 3 * (2 * 7 + 2)
    assert model.layers[0].input_layernorm.scale.get_value().dtype == jnp.float32
    assert not isinstance(model.norm.scale, LoRAParam)
    with pytest.raises(ValueError, match="PEFT's LoRA format cannot hold"):
        export_peft_adapter(model, "/tmp/unused", LoRAConfig(rank=2, train_norms=True))


def test_bad_config():
    with pytest.raises(ValueError, match="rank=0"):
        LoRAConfig(rank=0)
    with pytest.raises(ValueError, match="qkv"):
        LoRAConfig(target_modules=("qkv",))


def test_casting_adapters_for_compute_is_bit_identical(tiny):
    """The sampler casts A and B to the compute dtype once, before its decode loop: the outputs
    must equal those of the float32 adapters cast inside every call, bit for bit."""
    from qerl_jax.lora import cast_adapters_for_compute
    _, directory = tiny
    model = load_hf_model(directory, param_dtype="bfloat16", compute_dtype="bfloat16")
    add_lora(model, LoRAConfig(rank=4, alpha=8), jax.random.key(3))
    _randomize_b(model, jax.random.key(4))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, size=(2, 7)))
    before = np.asarray(model(tokens))
    assert cast_adapters_for_compute(model) == 7 * 3
    dtypes = {leaf.dtype for leaf in jax.tree_util.tree_leaves(nnx.state(model, LoRAParam))}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}
    np.testing.assert_array_equal(np.asarray(model(tokens)), before)
