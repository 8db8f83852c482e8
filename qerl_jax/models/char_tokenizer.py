"""A character-level tokenizer with a Qwen-style chat template, built offline.

Used by the tiny end-to-end default (no downloads): every printable ASCII character is a token,
plus <|endoftext|> (pad), <|im_start|>, <|im_end|> (eos) and the think/answer tags as single
tokens. Saved with save_pretrained, so AutoTokenizer loads it like any HF tokenizer.
"""

from __future__ import annotations

import os

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", "<think>",
                  "</think>", "<answer>", "</answer>"]


def char_vocabulary() -> list[str]:
    """Special tokens, then printable ASCII and newline: 8 + 96 = 104 tokens."""
    return SPECIAL_TOKENS + [chr(code) for code in range(32, 127)] + ["\n"]


def build_char_tokenizer(directory: str):
    """Builds, saves to `directory` and returns the character-level PreTrainedTokenizerFast."""
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate(char_vocabulary())}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<think>", "</think>", "<answer>",
                                   "</answer>"])
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(directory, exist_ok=True)
    fast.save_pretrained(directory)
    return fast
