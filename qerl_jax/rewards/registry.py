"""Reward functions by name: f(completion: str, gold: str) -> float, summed with weight 1.

Every entry is a module-level function, so that it pickles by reference into the scoring worker
(`scoring.py`); a user's own reward must be one too, in an importable module.
"""

from __future__ import annotations

from typing import Callable, Sequence

from qerl_jax.rewards.answer_format import format_reward
from qerl_jax.rewards.arithmetic import arithmetic_last_integer_reward, arithmetic_reward
from qerl_jax.rewards.gsm8k import gsm8k_exact_reward, gsm8k_numeric_reward
from qerl_jax.rewards.math_answers import math_accuracy_reward

RewardFunction = Callable[[str, str], float]

REWARD_FUNCTIONS: dict[str, RewardFunction] = {
    "format": format_reward,
    "gsm8k_exact": gsm8k_exact_reward,
    "gsm8k_numeric": gsm8k_numeric_reward,
    "math_verify": math_accuracy_reward,
    "arithmetic": arithmetic_reward,
    "arithmetic_last_integer": arithmetic_last_integer_reward,
}


def get_reward_functions(names: Sequence[str]) -> dict[str, RewardFunction]:
    """The named reward functions; a clear error lists the known names."""
    unknown = [name for name in names if name not in REWARD_FUNCTIONS]
    if unknown or not names:
        raise ValueError(f"unknown reward function(s) {unknown or '(none given)'}; known: "
                         f"{sorted(REWARD_FUNCTIONS)}")
    return {name: REWARD_FUNCTIONS[name] for name in names}
