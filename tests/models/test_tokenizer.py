"""Tokenizer loading from local files and chat-templated prompts."""

import pytest

from qerl_jax.models.tokenizer import chat_prompt, eos_token_ids, load_tokenizer
from tests.hf_reference import make_tiny_tokenizer


def test_chat_prompt_uses_the_template(tmp_path):
    tokenizer = load_tokenizer(make_tiny_tokenizer(str(tmp_path)))
    text = chat_prompt(tokenizer, "1+2=", system_message="think")
    assert text == ("<|im_start|>system\nthink<|im_end|>\n<|im_start|>user\n1+2=<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert eos_token_ids(tokenizer) == (tokenizer.convert_tokens_to_ids("<|im_end|>"),)


def test_missing_tokenizer_directory():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer("/nonexistent/tokenizer")


def test_directory_without_tokenizer(tmp_path):
    with pytest.raises(FileNotFoundError, match="no loadable tokenizer"):
        load_tokenizer(str(tmp_path))


def test_template_missing_is_a_clear_error(tmp_path):
    tokenizer = load_tokenizer(make_tiny_tokenizer(str(tmp_path)))
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="has no chat_template"):
        chat_prompt(tokenizer, "hi")
