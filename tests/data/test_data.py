"""Data sources, prompts through the chat template, left truncation, resumable iteration."""

import json
import logging
import os

import pytest

from qerl_jax.data import PromptIterator, encode_prompts
from qerl_jax.data.prompts import QERL_THINK_ANSWER_SUFFIX, build_prompt_text
from qerl_jax.infra.errors import ConfigError
from qerl_jax.models.tokenizer import load_tokenizer
from qerl_jax.tasks import load_examples
from tests.conftest import SHARED_DATA_DIR
from tests.hf_reference import make_tiny_tokenizer

SHARED_DATA = SHARED_DATA_DIR   # ../shared/data beside the repository (tests/conftest.py)


def test_gsm8k_and_math_from_shared_jsonl():
    gsm8k = load_examples("gsm8k", os.path.join(SHARED_DATA, "gsm8k", "test.jsonl"))
    assert len(gsm8k) == 1319 and gsm8k[0].gold == "18"
    math = load_examples("math", os.path.join(SHARED_DATA, "math500", "test.jsonl"), limit=5)
    assert math[0].gold == "\\left( 3, \\frac{\\pi}{2} \\right)"


def test_bad_sources_are_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_examples("gsm8k", "/no/such/file.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "#### 1"}\n{broken\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: invalid JSON"):
        load_examples("gsm8k", str(bad))
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text(json.dumps({"problem": "x"}) + "\n")
    with pytest.raises(ConfigError,
                       match="wrong.jsonl:1: a gsm8k row needs 'question' and 'answer'"):
        load_examples("gsm8k", str(wrong))
    with pytest.raises(ConfigError, match="unknown task"):
        load_examples("gsm9k", "x.jsonl")


def test_prompts_use_the_chat_template_and_left_truncate(tmp_path, caplog):
    tokenizer = load_tokenizer(make_tiny_tokenizer(str(tmp_path)))
    text = build_prompt_text(tokenizer, "1+2=", style="plain")
    assert text.startswith("<|im_start|>user\n1+2=") and text.endswith("assistant\n")
    assert build_prompt_text(tokenizer, "q", style="paper",
                             use_chat_template=False) == "q" + QERL_THINK_ANSWER_SUFFIX
    with caplog.at_level(logging.WARNING):
        batch = encode_prompts(tokenizer, [text, "12+7="], max_prompt_length=8)
    assert batch.truncated == 1 and "left-truncated" in caplog.text
    assert batch.tokens.shape == (2, 8)
    assert tokenizer.decode(batch.tokens[0]) == text[-8:]        # the end is kept
    assert batch.mask[1].tolist() == [False, False, False] + [True] * 5


def test_iterator_is_seeded_and_resumable():
    examples = load_examples("arithmetic", arithmetic_count=10, seed=1)
    straight = PromptIterator(examples, 4, seed=5)
    first = [straight.next_batch() for _ in range(5)]
    resumed = PromptIterator(examples, 4, seed=5)
    head = [resumed.next_batch() for _ in range(2)]
    tail_iterator = PromptIterator(examples, 4, seed=5, position=resumed.position)
    assert head + [tail_iterator.next_batch() for _ in range(3)] == first
    assert first[0] != first[2]  # epoch 2 reshuffles
