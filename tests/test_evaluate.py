"""The evaluation CLI: PEFT adapters load back exactly; pass@1 runs end to end on GSM8K jsonl."""

import json
import os

import jax
import numpy as np

from qerl_jax.evaluate import load_peft_adapter, main
from qerl_jax.lora import LoRAConfig, add_lora, export_peft_adapter
from qerl_jax.models.char_tokenizer import build_char_tokenizer
from qerl_jax.models.hf_io import load_hf_model
from tests.hf_reference import make_hf_model

SHARED_DATA = os.environ.get("QERL_SHARED_DATA", os.path.join(
    os.path.dirname(__file__), "..", "..", "shared", "data"))


def test_peft_round_trip_and_cli(tmp_path):
    base = str(tmp_path / "base")
    make_hf_model("qwen2", seed=3, vocab_size=104).save_pretrained(base)
    build_char_tokenizer(base)
    model = load_hf_model(base, param_dtype="float32")
    config = LoRAConfig(rank=2, alpha=4, target_modules=("q_proj", "up_proj"))
    add_lora(model, config, jax.random.key(0))
    for layer in model.layers:
        b = layer.mlp.up_proj.lora_b
        b.set_value(0.1 * jax.random.normal(jax.random.key(1), b.get_value().shape))
    adapter = str(tmp_path / "adapter")
    export_peft_adapter(model, adapter, config)
    fresh = load_hf_model(base, param_dtype="float32")
    load_peft_adapter(fresh, adapter)
    tokens = np.random.default_rng(0).integers(0, 104, size=(1, 6))
    np.testing.assert_allclose(np.asarray(fresh(tokens)), np.asarray(model(tokens)), atol=1e-6)

    out = str(tmp_path / "result.json")
    main(["--base", base, "--peft", adapter, "--data",
          os.path.join(SHARED_DATA, "gsm8k", "test.jsonl"), "--task", "gsm8k", "--limit", "3",
          "--max_new_tokens", "8", "--max_prompt_length", "64", "--prompt_style", "plain",
          "--out", out])
    with open(out) as handle:
        result = json.load(handle)
    assert result["problems"] == 3 and 0.0 <= result["pass@1"] <= 1.0


def test_completions_keep_special_think_and_answer_tokens(tmp_path):
    """The char tokenizer registers <think>/<answer> as special tokens: evaluation must decode
    them (as the trainer does), or '<think>6*12</think><answer>72</answer>' reads as '6*1272'."""
    from qerl_jax.evaluate import correctness
    from qerl_jax.models.tokenizer import decode_completion, load_tokenizer
    build_char_tokenizer(str(tmp_path / "tok"))
    tokenizer = load_tokenizer(str(tmp_path / "tok"))
    ids = tokenizer("<think>6*12</think><answer>72</answer>" + tokenizer.eos_token,
                    add_special_tokens=False)["input_ids"]
    text = decode_completion(tokenizer, ids)
    assert text == "<think>6*12</think><answer>72</answer>"
    assert correctness("gsm8k", text, "72") == 1.0
