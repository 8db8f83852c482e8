"""Independent references for the tests: tiny random HF models (PyTorch, CPU) and tokenizers.

Weights are perturbed away from HF's init (norms ~1 +- 0.1, biases nonzero) so that loading a
wrong tensor cannot pass unnoticed.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

TINY_SHAPES = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def make_hf_model(arch: str, seed: int = 0, **overrides):
    """A tiny random HF causal LM in float32: arch 'qwen2' (biases, tied) or 'llama'
    (no biases, untied, llama3 rope scaling)."""
    torch.manual_seed(seed)
    fields = dict(TINY_SHAPES)
    if arch == "qwen2":
        fields.update(rope_theta=1_000_000.0, tie_word_embeddings=True, rms_norm_eps=1e-6)
        fields.update(overrides)
        config = transformers.Qwen2Config(**fields)
        model = transformers.Qwen2ForCausalLM(config)
    elif arch == "llama":
        fields.update(rope_theta=500_000.0, tie_word_embeddings=False, rms_norm_eps=1e-5,
                      attention_bias=False,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64})
        fields.update(overrides)
        config = transformers.LlamaConfig(**fields)
        model = transformers.LlamaForCausalLM(config)
    else:
        raise ValueError(arch)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith(".bias"):
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
            else:  # scale up so the logits span a few units (a meaningful comparison)
                param.copy_(0.08 * torch.randn(param.shape, generator=generator))
    return model.float().eval()


def left_padded_batch(rng, lengths, total, vocab=256, low=0):
    """Random tokens [B, total] in [low, vocab) left-padded (pad id 0) to the given lengths,
    with the matching int32 mask."""
    tokens = rng.integers(low, vocab, size=(len(lengths), total))
    mask = np.zeros((len(lengths), total), np.int32)
    for row, length in enumerate(lengths):
        mask[row, total - length:] = 1
        tokens[row, :total - length] = 0
    return tokens, mask


def save_hf_model_dir(model, directory: str) -> str:
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def hf_logits(model, tokens: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
    """float32 logits [B, T, V] of the HF model with left-padding-aware position ids."""
    input_ids = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
    if attention_mask is None:
        attention_mask = np.ones(tokens.shape, np.int64)
    mask = torch.as_tensor(np.asarray(attention_mask), dtype=torch.long)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids)
    return out.logits.float().numpy()


CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tiny_tokenizer(directory: str, vocab_size: int = 256) -> str:
    """A word-level tokenizer (special tokens, digits, letters, punctuation) with a Qwen-style
    chat template, saved with save_pretrained into `directory`."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    symbols = list("0123456789+-*/=()<>.,:;!? \n") + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    words = ["system", "user", "assistant", "think", "answer", "/think", "/answer"]
    vocab = {token: i for i, token in enumerate(specials + symbols + words)}
    if len(vocab) > vocab_size:
        raise ValueError("vocab_size too small")
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token="<unk>", additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(directory, exist_ok=True)
    fast.save_pretrained(directory)
    return directory


def rewrite_config(directory: str, **fields) -> None:
    path = os.path.join(directory, "config.json")
    with open(path) as handle:
        config = json.load(handle)
    config.update(fields)
    with open(path, "w") as handle:
        json.dump(config, handle)
