"""compressed-tensors NVFP4A16 interop: load what compressed-tensors writes, export what it reads.

The reference is compressed-tensors itself (CPU): a tiny HF Qwen2 model is quantized inside the
test with compressed-tensors' NVFP4A16 scheme (data-free min-max scales, as llm-compressor's
NVFP4A16 recipe computes them), compressed and saved; transformers then loads it through the
compressed-tensors quantizer, which decompresses on the first forward. Tolerance: both sides
compute with the same dequantized weights; ours in bf16, the reference in fp32, so
max |dlogit| <= 0.1 and mean <= 0.02 at a logit scale of ~2 (as the bf16 model tests).
"""

import json
import os

import numpy as np
import pytest
import torch
import transformers

from qerl_jax.models.hf_io import CheckpointError
from qerl_jax.models.safetensors_io import SafetensorsFile
from qerl_jax.model_quant.compressed_tensors_io import (export_compressed_tensors,
                                                  load_compressed_tensors_model)
from qerl_jax.model_quant.quantize import QuantizedParam
from qerl_jax.quant.qarray import QuantizedWeight
from tests.hf_reference import hf_logits, make_hf_model, rewrite_config


def _compress_with_compressed_tensors(model, directory):
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.quant_scheme import NVFP4A16
    from compressed_tensors.quantization.utils.helpers import (compute_dynamic_scales_and_zp,
                                                               generate_gparam)
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], **NVFP4A16)},
        ignore=["lm_head"])
    apply_quantization_config(model, config)
    for _, module in model.named_modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        weight = module.weight.data
        global_scale = generate_gparam(weight.min(), weight.max())
        module.weight_global_scale.data.copy_(global_scale)
        scale, _ = compute_dynamic_scales_and_zp(weight, module.quantization_scheme.weights,
                                                 module, global_scale=global_scale)
        module.weight_scale.data.copy_(scale)
    compressor = ModelCompressor.from_pretrained_model(model, "nvfp4-pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(directory)
    compressor.update_config(directory)
    return directory


@pytest.fixture(scope="module")
def nvfp4_checkpoint(tmp_path_factory):
    model = make_hf_model("qwen2", seed=11).to(torch.bfloat16)
    return _compress_with_compressed_tensors(model, str(tmp_path_factory.mktemp("ct")))


def _reference_logits(directory, tokens):
    """Logits of compressed-tensors' own decompressed weights, evaluated in float32."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    hf_logits(model, tokens[:, :2])  # the first forward decompresses in place
    decompressed = {name: tensor.float() for name, tensor in model.state_dict().items()
                    if not name.endswith(("weight_scale", "weight_global_scale"))}
    config = transformers.AutoConfig.from_pretrained(directory)
    del config.quantization_config
    reference = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = reference.load_state_dict(decompressed, strict=False)
    assert not [m for m in missing if m != "lm_head.weight"] and not unexpected, (missing,
                                                                                   unexpected)
    if config.tie_word_embeddings:
        reference.tie_weights()
    return hf_logits(reference.eval(), tokens)


def test_loads_nvfp4a16_and_matches_compressed_tensors_logits(nvfp4_checkpoint):
    ours = load_compressed_tensors_model(nvfp4_checkpoint)
    q_proj = ours.layers[0].self_attn.q_proj
    assert isinstance(q_proj.weight, QuantizedParam)
    value = q_proj.weight.get_value()
    assert isinstance(value, QuantizedWeight) and value.format == "nvfp4"
    file = SafetensorsFile(os.path.join(nvfp4_checkpoint, "model.safetensors"))
    np.testing.assert_array_equal(np.asarray(value.codes),
                                  file["model.layers.0.self_attn.q_proj.weight_packed"])
    tokens = np.random.default_rng(0).integers(0, 256, size=(2, 12))
    reference = _reference_logits(nvfp4_checkpoint, tokens)
    logits = np.asarray(ours(tokens))
    diff = np.abs(logits - reference)
    assert np.abs(reference).max() > 1.0
    assert diff.max() <= 0.1 and diff.mean() <= 0.02, (diff.max(), diff.mean())


def test_export_round_trip_is_bit_exact_and_readable(nvfp4_checkpoint, tmp_path):
    ours = load_compressed_tensors_model(nvfp4_checkpoint)
    out = str(tmp_path / "export")
    export_compressed_tensors(ours, out)
    original = SafetensorsFile(os.path.join(nvfp4_checkpoint, "model.safetensors"))
    exported = SafetensorsFile(os.path.join(out, "model.safetensors"))
    assert sorted(exported.keys()) == sorted(original.keys())
    for name in original.keys():
        assert exported.dtype(name) == original.dtype(name), name
        np.testing.assert_array_equal(np.asarray(exported[name]).view(np.uint8),
                                      np.asarray(original[name]).view(np.uint8), err_msg=name)
    with open(os.path.join(out, "config.json")) as handle:
        assert json.load(handle)["quantization_config"]["format"] == "nvfp4-pack-quantized"
    tokens = np.random.default_rng(1).integers(0, 256, size=(1, 9))
    np.testing.assert_allclose(_reference_logits(out, tokens),
                               _reference_logits(nvfp4_checkpoint, tokens), atol=1e-5)


def test_quantized_by_us_exports_and_compressed_tensors_reads_it(tmp_path):
    from qerl_jax.models.hf_io import load_hf_model
    from qerl_jax.model_quant.quantize import quantize_model
    source = str(tmp_path / "dense")
    make_hf_model("llama", seed=5).save_pretrained(source)
    ours = load_hf_model(source, param_dtype="bfloat16")
    quantize_model(ours, "nvfp4")
    out = str(tmp_path / "nvfp4")
    export_compressed_tensors(ours, out)
    tokens = np.random.default_rng(2).integers(0, 256, size=(2, 10))
    reference = _reference_logits(out, tokens)
    diff = np.abs(np.asarray(ours(tokens)) - reference)
    assert diff.max() <= 0.1 and diff.mean() <= 0.02, (diff.max(), diff.mean())


def test_rejects_w4a4_checkpoints(nvfp4_checkpoint, tmp_path):
    import shutil
    copy = str(tmp_path / "w4a4")
    shutil.copytree(nvfp4_checkpoint, copy)
    with open(os.path.join(copy, "config.json")) as handle:
        quantization = json.load(handle)["quantization_config"]
    quantization["config_groups"]["group_0"]["input_activations"] = {"num_bits": 4}
    rewrite_config(copy, quantization_config=quantization)
    with pytest.raises(CheckpointError, match="activation quantization"):
        load_compressed_tensors_model(copy)


def test_plain_checkpoint_is_rejected_with_a_pointer(tmp_path):
    make_hf_model("qwen2", seed=1).save_pretrained(str(tmp_path))
    with pytest.raises(CheckpointError, match="no quantization_config"):
        load_compressed_tensors_model(str(tmp_path))
