"""Whole-model quantization: every projection quantized, layer errors, load-time quantization,
and clear errors naming the layer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qerl_jax.models import init_model, preset
from qerl_jax.models.hf_io import load_hf_model
from qerl_jax.quant.formats import get_format
from qerl_jax.model_quant.quantize import (QuantizedParam, load_quantized_hf_model,
                                               quantize_model)
from qerl_jax.quant.qarray import QuantizedWeight
from tests.hf_reference import make_hf_model

FORMATS = ["nvfp4", "mxfp4", "nf4"]


def _dequantized_copy(model):
    """The same model with each QuantizedWeight replaced by its dense dequantization [in, out]."""
    graphdef, state = nnx.split(model)
    dense = jax.tree_util.tree_map(
        lambda leaf: get_format(leaf.format).dequantize(leaf, jnp.float32).T
        if isinstance(leaf, QuantizedWeight) else leaf,
        state, is_leaf=lambda leaf: isinstance(leaf, QuantizedWeight))
    return nnx.merge(graphdef, dense)


@pytest.mark.parametrize("format_name", FORMATS)
def test_quantize_model_replaces_every_projection(format_name):
    config = preset("tiny_qwen2", hidden_size=128, intermediate_size=256)
    model = init_model(config, seed=1)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, size=(2, 8)))
    dense_logits = np.asarray(model(tokens))
    report = quantize_model(model, format_name)
    assert len(report.layer_errors) == 7 * config.num_hidden_layers
    assert isinstance(model.layers[1].mlp.down_proj.weight, QuantizedParam)
    assert not isinstance(model.embed_tokens.embedding, QuantizedParam)
    # Gaussian weights: NVFP4 ~0.09-0.1, MXFP4 ~0.11-0.13, NF4 ~0.09-0.1 relative error.
    assert all(0.01 < error < 0.2 for error in report.layer_errors.values()), report.summary()
    assert report.dense_bytes_bf16 / report.quantized_bytes > 3.0
    # The quantized model's forward equals the dense model built from the dequantized weights
    # (the linear op dequantizes exactly), and stays close to the unquantized model.
    quantized_logits = np.asarray(model(tokens))
    np.testing.assert_allclose(quantized_logits, np.asarray(_dequantized_copy(model)(tokens)),
                               atol=2e-5)
    assert np.abs(quantized_logits - dense_logits).max() < 0.5


def test_load_time_quantization_equals_quantize_after_load(tmp_path):
    make_hf_model("qwen2", seed=4).save_pretrained(str(tmp_path))
    loaded, report = load_quantized_hf_model(str(tmp_path), "nvfp4")
    reference = load_hf_model(str(tmp_path), param_dtype="bfloat16")
    quantize_model(reference, "nvfp4")
    a = loaded.layers[2].self_attn.v_proj.weight.get_value()
    b = reference.layers[2].self_attn.v_proj.weight.get_value()
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert set(report.layer_errors) == {f"layers.{i}.{block}.{name}" for i in range(3)
                                        for block, name in [("self_attn", "q_proj"),
                                                            ("self_attn", "k_proj"),
                                                            ("self_attn", "v_proj"),
                                                            ("self_attn", "o_proj"),
                                                            ("mlp", "gate_proj"),
                                                            ("mlp", "up_proj"),
                                                            ("mlp", "down_proj")]}


def test_bf16_format_keeps_dense_weights():
    model = init_model(preset("tiny_qwen2"), seed=0)
    report = quantize_model(model, "bf16")
    weight = model.layers[0].mlp.up_proj.weight
    assert isinstance(weight, nnx.Param) and weight.get_value().dtype == jnp.bfloat16
    assert max(report.layer_errors.values()) < 4e-3


def test_indivisible_dimension_names_the_layer():
    model = init_model(preset("tiny_qwen2", intermediate_size=72), seed=0)
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj.*in_features=72"):
        quantize_model(model, "nvfp4")


def test_nan_weight_names_the_layer():
    model = init_model(preset("tiny_qwen2"), seed=0)
    layer = model.layers[1].self_attn.o_proj
    layer.weight.set_value(layer.weight.get_value().at[3, 5].set(jnp.nan))
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.o_proj.*NaN"):
        quantize_model(model, "mxfp4")


def test_unknown_format():
    with pytest.raises(ValueError, match="nvfp5"):
        quantize_model(init_model(preset("tiny_qwen2")), "nvfp5")
