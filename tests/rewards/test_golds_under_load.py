"""Every MATH-500 and GSM8K test gold, answered in the format, scores correct through the scoring
worker (qerl_jax/rewards/scoring.py) while busy-loop processes keep every core busy: the limits
count CPU time, so a busy host slows correct answers down without failing them."""

import json
import os
import subprocess
import sys

import pytest

from qerl_jax.data.gold_answers import gsm8k_gold_answer
from qerl_jax.rewards import RewardScorer, get_reward_functions

pytestmark = pytest.mark.slow


def _wrap(answer):
    return f"<think>...</think> <answer>{answer}</answer>"


@pytest.fixture
def busy_cores():
    """Two busy-loop processes per core (at least 2, at most 4) for the test's duration."""
    count = min(max(2 * (os.cpu_count() or 1), 2), 4)
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield count
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def _score(completions, golds, names):
    # a fresh worker: each gold's first parse in a process is its costliest
    with RewardScorer() as scorer:
        return scorer.score_completions(completions, golds, get_reward_functions(names))


def test_every_math500_gold_scores_on_a_busy_host(shared_data_dir, busy_cores):
    with open(os.path.join(shared_data_dir, "math500", "test.jsonl")) as handle:
        golds = [json.loads(line)["answer"] for line in handle if line.strip()]
    assert len(golds) == 500
    scores = _score([_wrap(gold) for gold in golds], golds, ["format", "math_verify"])
    assert [gold for gold, score in zip(golds, scores["math_verify"]) if score != 1.0] == []
    assert scores["format"] == [0.2] * len(golds)
    assert scores["timeouts"] == [0.0] * len(golds)


def test_every_gsm8k_test_gold_scores_on_a_busy_host(shared_data_dir, busy_cores):
    with open(os.path.join(shared_data_dir, "gsm8k", "test.jsonl")) as handle:
        golds = [gsm8k_gold_answer(json.loads(line)["answer"]) for line in handle if line.strip()]
    assert len(golds) == 1319
    names = ["format", "gsm8k_exact", "gsm8k_numeric", "math_verify"]
    scores = _score([_wrap(gold) for gold in golds], golds, names)
    assert scores["gsm8k_exact"] == scores["gsm8k_numeric"] == [2.0] * len(golds)
    assert [gold for gold, score in zip(golds, scores["math_verify"]) if score != 1.0] == []
    assert scores["timeouts"] == [0.0] * len(golds)
