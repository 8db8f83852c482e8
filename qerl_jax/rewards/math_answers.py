"""MATH-style rewards via math-verify (QeRL facts section 4: BigMath format 0.2 + accuracy 1.0).

The answer is read from the <answer> block, or the last \\boxed{...} of the completion; the gold
is parsed by math-verify (boxed first). An unparsable gold or a verifier error gives 0.
"""

from __future__ import annotations

from qerl_jax.rewards.answer_format import extract_answer

ACCURACY_REWARD = 1.0


def _verify(gold: str, answer: str) -> bool:
    from math_verify import parse, verify  # optional heavy import, only when used
    gold_parsed = parse(gold if "\\boxed" in gold or "$" in gold else f"${gold}$",
                        parsing_timeout=None)
    if not gold_parsed:
        return False
    answer_parsed = parse(answer, parsing_timeout=None)
    if not answer_parsed:
        return False
    return bool(verify(gold_parsed, answer_parsed, timeout_seconds=None))


def math_accuracy_reward(completion: str, gold: str) -> float:
    """1.0 when math-verify judges the completion's answer equal to the gold answer."""
    try:
        answer = extract_answer(completion)
        candidate = answer if answer else completion
        if "\\boxed" not in candidate and "$" not in candidate:
            candidate = f"${candidate}$"
        return ACCURACY_REWARD if _verify(gold, candidate) else 0.0
    except Exception:
        return 0.0
