"""Rewards of the synthetic arithmetic task (exact integer answers).

`arithmetic_reward` is 1.0 when the completion's first integer (or its <answer> block's) equals
the exact result, as a char-level model answers '37+8='; `arithmetic_last_integer_reward` reads
the last integer instead, where an instruct model states the result after restating the
problem ("2 + 1 = 3").
"""

from __future__ import annotations

import re

from qerl_jax.rewards.answer_format import extract_answer
from qerl_jax.rewards.registry import register_reward

_INTEGER = re.compile(r"-?\d+")


@register_reward("arithmetic")
def arithmetic_reward(completion: str, gold: str) -> float:
    """1.0 when the answer (the <answer> block if present, else the completion's first integer)
    equals the gold integer exactly."""
    try:
        answer = extract_answer(completion)
        text = answer if answer is not None else completion
        match = _INTEGER.search(text)
        return 1.0 if match is not None and int(match.group()) == int(gold) else 0.0
    except Exception:
        return 0.0


@register_reward("arithmetic_last_integer")
def arithmetic_last_integer_reward(completion: str, gold: str) -> float:
    """1.0 when the last integer of the answer (the <answer> block if present, else the whole
    completion) equals the gold integer exactly."""
    try:
        answer = extract_answer(completion)
        matches = _INTEGER.findall(answer if answer is not None else completion)
        return 1.0 if matches and int(matches[-1]) == int(gold) else 0.0
    except Exception:
        return 0.0
