"""The arithmetic task's generated problems: seeded, exact (checked by Python's own arithmetic),
the same draws in both phrasings, and refused operations or phrasings named."""

import re

import pytest

from qerl_jax.data.arithmetic import (PHRASINGS, arithmetic_examples, arithmetic_gold_answer,
                                      arithmetic_problems)


def test_problems_are_seeded_and_their_answers_exact():
    problems = arithmetic_problems(200, seed=11, max_operand=30, operations=("+", "-", "*"))
    assert problems == arithmetic_problems(200, seed=11, max_operand=30,
                                           operations=("+", "-", "*"))
    assert problems != arithmetic_problems(200, seed=12, max_operand=30,
                                           operations=("+", "-", "*"))
    for problem in problems:
        a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)=", problem["question"]).groups()
        assert 0 <= int(a) <= 30 and 0 <= int(b) <= 30
        assert int(problem["answer"]) == {"+": int(a) + int(b), "-": int(a) - int(b),
                                          "*": int(a) * int(b)}[op]
    assert {re.search(r"[-+*]", p["question"]).group() for p in problems} == {"+", "-", "*"}


def test_question_phrasing_draws_the_same_problems():
    expressions = arithmetic_problems(50, seed=3)
    questions = arithmetic_problems(50, seed=3, phrasing="question")
    for expression, question in zip(expressions, questions):
        a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)=", expression["question"]).groups()
        assert question["question"] == f"What is {a} {op} {b}?"
        assert question["answer"] == expression["answer"]
    examples = arithmetic_examples(50, seed=3, phrasing="question")
    assert [(e.question, e.gold) for e in examples] == [(q["question"], q["answer"])
                                                       for q in questions]


def test_bad_operations_and_phrasings_are_named():
    with pytest.raises(ValueError, match=r"operations \['/'\] not in"):
        arithmetic_problems(3, seed=0, operations=("+", "/"))
    with pytest.raises(ValueError, match="phrasing 'prose' not in"):
        arithmetic_problems(3, seed=0, phrasing="prose")
    assert PHRASINGS == ("expression", "question")


def test_gold_answers_are_plain_integers():
    assert arithmetic_gold_answer(" -07 ") == "-7"
    assert arithmetic_gold_answer("12") == "12"
    with pytest.raises(ValueError):
        arithmetic_gold_answer("twelve")
