"""A synthetic arithmetic task with exact integer answers (the CPU end-to-end default).

Problems like "37+8=" (phrasing 'expression', the char-level model's) or "What is 37 + 8?"
(phrasing 'question', for instruct models) are drawn from a seeded numpy Generator; the same
seed draws the same operands in both phrasings. `arithmetic_reward` is 1.0 when the completion's
first integer (or its <answer> block's) equals the exact result; `arithmetic_last_integer_reward`
reads the last integer instead, where an instruct model states the result after restating the
problem ("2 + 1 = 3").
"""

from __future__ import annotations

import re

from qerl_jax.rewards.answer_format import extract_answer

_INTEGER = re.compile(r"-?\d+")
OPERATIONS = ("+", "-", "*")
PHRASINGS = ("expression", "question")


def arithmetic_problems(count: int, seed: int, max_operand: int = 20,
                        operations: tuple[str, ...] = ("+", "-"),
                        phrasing: str = "expression") -> list[dict]:
    """`count` problems {'question': 'a+b=' or 'What is a + b?', 'answer': 'c'} from a seeded
    generator."""
    import numpy as np  # not at module level: the scoring worker starts faster without it

    unknown = set(operations) - set(OPERATIONS)
    if unknown:
        raise ValueError(f"operations {sorted(unknown)} not in {OPERATIONS}")
    if phrasing not in PHRASINGS:
        raise ValueError(f"phrasing {phrasing!r} not in {PHRASINGS}")
    rng = np.random.default_rng(seed)
    problems = []
    for _ in range(count):
        a, b = (int(v) for v in rng.integers(0, max_operand + 1, size=2))
        op = operations[int(rng.integers(len(operations)))]
        result = a + b if op == "+" else a - b if op == "-" else a * b
        question = f"{a}{op}{b}=" if phrasing == "expression" else f"What is {a} {op} {b}?"
        problems.append({"question": question, "answer": str(result)})
    return problems


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


def arithmetic_last_integer_reward(completion: str, gold: str) -> float:
    """1.0 when the last integer of the answer (the <answer> block if present, else the whole
    completion) equals the gold integer exactly."""
    try:
        answer = extract_answer(completion)
        matches = _INTEGER.findall(answer if answer is not None else completion)
        return 1.0 if matches and int(matches[-1]) == int(gold) else 0.0
    except Exception:
        return 0.0
