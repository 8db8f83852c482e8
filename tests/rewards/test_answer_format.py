"""The format check (qerl_jax/rewards/answer_format.py) means exactly what QeRL's regex means,
in linear time: property tests against the regex, and degenerate 100k-character tag runs."""

import re
import time

import pytest
from hypothesis import given, settings, strategies as st

from qerl_jax.rewards.answer_format import format_reward, has_think_answer_format

# the definition the linear check keeps (search, DOTALL); cubic on long runs of open tags
FORMAT_REGEX = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)

# the whole tags weigh double, so that strings hold complete blocks often; the whitespace
# includes what \s matches beyond ASCII (no-break and em spaces, \x1c, NEL)
TAG_PIECES = (["<think>", "</think>", "<answer>", "</answer>"] * 2
              + ["<think", "</answer", "</", "<", ">"]
              + [" ", "\n", "\t", "\u00a0", "\u2003", "\x1c", "\x85", "a"])


@settings(max_examples=4000, deadline=None)
@given(st.lists(st.sampled_from(TAG_PIECES), max_size=16).map("".join))
def test_format_check_matches_the_regex_on_tag_soup(text):
    assert has_think_answer_format(text) == bool(FORMAT_REGEX.search(text))


@settings(max_examples=2000, deadline=None)
@given(st.text(alphabet="<>/thinkaswer \n\t\u00a0x", max_size=60))
def test_format_check_matches_the_regex_on_characters(text):
    assert has_think_answer_format(text) == bool(FORMAT_REGEX.search(text))


def _runs(length):
    """pytest params (text, expected): open-tag runs of about `length` characters, with and
    without a well-formed block at the end."""
    def repeat(piece):
        return piece * (length // len(piece))
    runs = []
    for piece in ("<think>", "<answer>", "</think>", "<think></think><answer>",
                  "</think> <answer>", "<think></think>", "<think>\n \t"):
        name = repr(piece)[1:-1]
        runs.append(pytest.param(repeat(piece), False, id=f"{name}*"))
        runs.append(pytest.param(repeat(piece) + "<think>a</think> <answer>b</answer>", True,
                                 id=f"{name}*+format"))
    runs.append(pytest.param(repeat("<think></think><answer>") + "</answer>", True,
                             id="<think></think><answer>*+</answer>"))
    runs.append(pytest.param("<think>" + repeat(" ") + "</think>" + repeat("\n") +
                             "<answer></answer>", True, id="long-whitespace"))
    runs.append(pytest.param("<think></think>" + repeat(" ") + "x<answer></answer>", False,
                             id="whitespace-then-text"))
    return runs


@pytest.mark.parametrize("text, expected", _runs(2_000))
def test_degenerate_runs_agree_with_the_regex(text, expected):
    assert bool(FORMAT_REGEX.search(text)) == expected
    assert has_think_answer_format(text) == expected


@pytest.mark.parametrize("text, expected", _runs(100_000))
def test_degenerate_100k_runs_are_fast(text, expected):
    started = time.perf_counter()
    assert has_think_answer_format(text) == expected
    assert format_reward(text) == (0.2 if expected else 0.0)
    assert time.perf_counter() - started < 0.1


def test_format_reward_takes_any_input():
    assert format_reward("<think>a</think>\n<answer>b</answer>") == 0.2
    assert format_reward("<think>a</think>\n<answer>b</answer>", "gold unused") == 0.2
    assert format_reward("<answer>b</answer><think>a</think>") == 0.0
    for odd in (None, 3, b"<think></think><answer></answer>", ""):
        assert format_reward(odd) == 0.0
