"""Presets and config validation."""

import pytest

from qerl_jax.models import abstract_model, count_parameters, preset
from qerl_jax.models.config import ModelConfig

# Published sizes (Qwen2.5 model cards). Two cards round further than 0.5%: 0.5B says 0.49B
# but its checkpoint holds 494,032,768 parameters (0.8% above), and 32B says 32.5B but its
# checkpoint holds 32,763,876,352 (model.safetensors.index.json total_size 65,527,752,704 bytes
# in bf16; 0.8% above). Those two are checked against the checkpoints' exact counts instead.
PUBLISHED = {"qwen2p5_1p5b": 1.54e9, "qwen2p5_3b": 3.09e9, "qwen2p5_7b": 7.62e9,
             "qwen2p5_14b": 14.7e9, "qwen2p5_72b": 72.7e9}
CHECKPOINT_EXACT = {"qwen2p5_0p5b": 494_032_768, "qwen2p5_32b": 65_527_752_704 // 2}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts_within_half_percent(name):
    config = preset(name)
    counted = count_parameters(abstract_model(config))
    assert counted == config.num_parameters()
    assert abs(counted - PUBLISHED[name]) / PUBLISHED[name] <= 0.005, counted


@pytest.mark.parametrize("name", sorted(CHECKPOINT_EXACT))
def test_preset_parameter_counts_equal_checkpoints(name):
    assert count_parameters(abstract_model(preset(name))) == CHECKPOINT_EXACT[name]


def test_llama3p1_8b_count():
    assert abs(preset("llama3p1_8b").num_parameters() - 8.03e9) / 8.03e9 <= 0.005


def test_qwen_presets_use_published_rope_and_bias():
    config = preset("qwen2p5_7b")
    assert config.rope_theta == 1e6 and config.attention_bias and not config.tie_word_embeddings
    assert preset("qwen2p5_0p5b").tie_word_embeddings


@pytest.mark.parametrize("field,value,message", [
    ("num_key_value_heads", 3, "multiple of num_key_value_heads"),
    ("hidden_size", 0, "hidden_size=0 must be a positive integer"),
    ("param_dtype", "int8", "param_dtype='int8'"),
    ("model_type", "gpt2", "model_type='gpt2' is not supported"),
    ("rms_norm_eps", 0.0, "rms_norm_eps"),
])
def test_invalid_fields_are_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        preset("tiny_qwen2", **{field: value})


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown model preset 'qwen9'"):
        preset("qwen9")


def test_hf_dict_round_trip():
    for name in ("qwen2p5_7b", "llama3p1_8b"):
        config = preset(name)
        again = ModelConfig.from_hf_dict(config.to_hf_dict())
        assert again == config.replace(param_dtype="bfloat16", compute_dtype="bfloat16")


def test_hf_dict_rejects_sliding_window():
    hf = preset("tiny_qwen2").to_hf_dict()
    hf["use_sliding_window"] = True
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelConfig.from_hf_dict(hf, source="x/config.json")
