"""GSM8K rewards (as QeRL's released code scores them): format 0.2 + correctness 2.0.

`gsm8k_exact_reward` is QeRL's: the extracted answer string equals the gold string (the text
after the solution's last '####', stripped). `gsm8k_numeric_reward` also accepts numerically
equal answers after removing thousands separators, '$', '%', units text and trailing zeros
("1,000" == "1000" == "1000.00").
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from qerl_jax.rewards.answer_format import extract_answer
from qerl_jax.rewards.registry import register_reward

CORRECTNESS_REWARD = 2.0
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def normalize_number(text: str) -> Decimal | None:
    """The last number in `text` as a Decimal (commas removed), or None."""
    try:
        matches = _NUMBER.findall(text.replace("$", "").replace("%", ""))
        if not matches:
            return None
        return Decimal(matches[-1].replace(",", "")).normalize()
    except (InvalidOperation, ValueError, TypeError, AttributeError):
        return None


@register_reward("gsm8k_exact")
def gsm8k_exact_reward(completion: str, gold: str) -> float:
    """2.0 when the extracted answer equals the gold string exactly (QeRL's rule)."""
    try:
        answer = extract_answer(completion)
        return CORRECTNESS_REWARD if answer is not None and answer == gold.strip() else 0.0
    except Exception:
        return 0.0


@register_reward("gsm8k_numeric")
def gsm8k_numeric_reward(completion: str, gold: str) -> float:
    """2.0 when the extracted answer equals the gold number after numeric normalization."""
    try:
        answer = extract_answer(completion)
        if answer is None:
            return 0.0
        if answer == gold.strip():
            return CORRECTNESS_REWARD
        expected, got = normalize_number(gold), normalize_number(answer)
        # the answer must be just the number (possibly with $, commas, units), not a sentence
        # that merely ends with it
        if got is None or expected is None or len(_NUMBER.findall(answer)) != 1:
            return 0.0
        return CORRECTNESS_REWARD if got == expected else 0.0
    except Exception:
        return 0.0
