"""The synthetic arithmetic task's problems, exact integer answers (the CPU end-to-end default).

Problems like "37+8=" (phrasing 'expression', the char-level model's) or "What is 37 + 8?"
(phrasing 'question', for instruct models) are drawn from a seeded numpy Generator; the same
seed draws the same operands in both phrasings. The held-out problems continue the training
problems' stream, none of them a training question.
"""

from __future__ import annotations

from qerl_jax.data.sources import Example
from qerl_jax.infra.errors import ConfigError
from qerl_jax.registry import ARITHMETIC_PHRASINGS

OPERATIONS = ("+", "-", "*")
PHRASINGS = ARITHMETIC_PHRASINGS.names()


def arithmetic_problems(count: int, seed: int, max_operand: int = 20,
                        operations: tuple[str, ...] = ("+", "-"),
                        phrasing: str = "expression") -> list[dict]:
    """`count` problems {'question': 'a+b=' or 'What is a + b?', 'answer': 'c'} from a seeded
    generator."""
    import numpy as np  # not at module level: `--help` and the config schema stay light

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


def arithmetic_examples(count: int, seed: int, max_operand: int = 20,
                        phrasing: str = "expression") -> list[Example]:
    """`arithmetic_problems` as Examples (the training split)."""
    return [Example(problem["question"], problem["answer"])
            for problem in arithmetic_problems(count, seed, max_operand=max_operand,
                                               phrasing=phrasing)]


def held_out_arithmetic_examples(count: int, seed: int, max_operand: int, training_count: int,
                                 training_questions: set[str], *,
                                 phrasing: str = "expression") -> list[Example]:
    """The arithmetic task's test split, first `count` rows: the problems drawn after the
    `training_count` training ones from the same seeded stream, each question once, none of
    `training_questions`.

    Raises:
      ConfigError: naming config.eval.num_examples when fewer such problems exist.
    """
    universe = 2 * (max_operand + 1) ** 2   # distinct 'a+b=' and 'a-b=' questions
    available = universe - len(training_questions)
    if count > available:
        raise ConfigError(f"config.eval.num_examples: {count} is more than the {available} "
                          f"arithmetic problems (operands 0..{max_operand}) outside the "
                          "training set")
    drawn = training_count + 4 * count
    while True:   # ends: `available` >= count distinct unseen questions exist
        picked, seen = [], set(training_questions)
        for problem in arithmetic_problems(drawn, seed, max_operand=max_operand,
                                           phrasing=phrasing)[training_count:]:
            if problem["question"] not in seen:
                seen.add(problem["question"])
                picked.append(Example(problem["question"], problem["answer"]))
                if len(picked) == count:
                    return picked
        drawn *= 2


def arithmetic_gold_answer(answer: str) -> str:
    """The gold of an arithmetic answer: its integer, written without sign noise or spaces."""
    return str(int(answer.strip()))
