"""MATH answers (qerl_jax/rewards/math_answers.py): all 500 MATH-500 golds score when answered
in the format, escaped-dollar golds included; math-verify's wall-clock alarms are never armed, so
a process that gets little CPU still scores correct answers; each gold is parsed once; answers
that would make sympy run for seconds score 0 at once."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import math_verify
import pytest
import sympy
from hypothesis import given, settings, strategies as st

from qerl_jax.rewards import get_reward_functions, score_completions
from qerl_jax.rewards import math_answers
from qerl_jax.rewards.math_answers import math_accuracy_reward


def _wrap(answer):
    return f"<think>...</think><answer>{answer}</answer>"


def test_every_math500_gold_scores_in_the_answer_format(shared_data_dir):
    with open(os.path.join(shared_data_dir, "math500", "test.jsonl")) as handle:
        golds = [json.loads(line)["answer"] for line in handle if line.strip()]
    assert len(golds) == 500
    scores = score_completions([_wrap(gold) for gold in golds], golds,
                               get_reward_functions(["math_verify"]))
    missed = [gold for gold, score in zip(golds, scores["math_verify"]) if score != 1.0]
    assert not missed
    assert scores["timeouts"] == [0.0] * 500


@pytest.mark.parametrize("answer, gold", [
    ("\\$36", "\\$36"), ("36", "\\$36"), ("$36$", "\\$36"), ("\\boxed{36}", "\\$36"),
    ("\\$18.90", "\\$18.90"), ("18.9", "\\$18.90"),
    ("\\$32,\\!348", "\\$32,\\!348"), ("32348", "\\$32,\\!348")])
def test_escaped_dollar_golds_score(answer, gold):
    assert math_accuracy_reward(_wrap(answer), gold) == 1.0


def test_escaped_dollar_gold_still_rejects_a_wrong_answer():
    assert math_accuracy_reward(_wrap("37"), "\\$36") == 0.0


class _Spy:
    """Records the keyword arguments of math-verify's parse and verify."""

    def __init__(self, monkeypatch):
        self.calls = []
        self.arguments = []
        for name in ("parse", "verify"):
            original = getattr(math_verify, name)
            monkeypatch.setattr(math_verify, name, self._recording(name, original))

    def _recording(self, name, original):
        def recorded(*args, **kwargs):
            self.calls.append((name, kwargs))
            if name == "parse":
                self.arguments.append((name, args))
            return original(*args, **kwargs)
        return recorded

    def timeouts(self):
        return {(name, kwargs.get("parsing_timeout", kwargs.get("timeout_seconds")))
                for name, kwargs in self.calls}

    def parsed(self):
        return [args[0] for name, args in self.arguments]


def test_math_verify_wall_clock_alarms_stay_off_in_any_thread(monkeypatch):
    spy = _Spy(monkeypatch)
    assert math_accuracy_reward(_wrap("\\frac{1}{2}"), "0.5") == 1.0
    results = []
    thread = threading.Thread(target=lambda: results.append(
        (math_accuracy_reward(_wrap("\\frac{1}{4}"), "0.25"),
         math_accuracy_reward(_wrap("3"), "4"))))
    thread.start()
    thread.join()
    assert results == [(1.0, 0.0)]
    assert spy.timeouts() == {("parse", None), ("verify", None)}


def test_each_gold_is_parsed_once(monkeypatch):
    spy = _Spy(monkeypatch)
    gold = "\\left( 7, \\frac{\\pi}{5} \\right)"
    for answer, expected in [(gold, 1.0), ("(7, \\pi/5)", 1.0), ("(7, \\pi/4)", 0.0)]:
        assert math_accuracy_reward(_wrap(answer), gold) == expected
    parsed = spy.parsed()
    assert parsed.count(f"${gold}$") == 2   # once as the gold, once as the first answer
    assert len(parsed) == 4


# the golds of MATH-500 that cost the most CPU time on their first parse in a process
_COSTLY_GOLDS = ["\\left[ \\frac{\\pi^2}{8}, \\frac{5 \\pi^2}{4} \\right]",
                 "\\left( 3, \\frac{\\pi}{2} \\right)"]
_THROTTLED_SCORER = """
import sys
from qerl_jax.rewards.math_answers import math_accuracy_reward
golds = sys.argv[1:]
math_accuracy_reward("<answer>1</answer>", "1")   # imports done before the throttling
print("ready", flush=True)
sys.stdin.readline()
print(" ".join(str(math_accuracy_reward(f"<answer>{gold}</answer>", gold)) for gold in golds))
"""


def test_a_process_that_gets_little_cpu_still_scores_correct_answers():
    """The scoring process runs 50 ms in every 1.15 s (SIGSTOP / SIGCONT), as on a host with
    twenty busy processes per core; a wall-clock limit of 1 s per parse scores these golds 0."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child = subprocess.Popen([sys.executable, "-c", _THROTTLED_SCORER, *_COSTLY_GOLDS],
                             cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        child.stdin.write("go\n")
        child.stdin.flush()
        deadline = time.monotonic() + 120.0
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
            child.send_signal(signal.SIGSTOP)
            time.sleep(1.1)
            child.send_signal(signal.SIGCONT)
        output = child.stdout.read()
    finally:
        child.kill()
        child.wait()
    assert output.split() == ["1.0"] * len(_COSTLY_GOLDS)


@pytest.mark.parametrize("answer", [
    "2^{2^{2^{2^{2^{2}}}}}", "9^{9^{9^{9}}}", "10^{10^{10}}", "2^{-2^{2^{2^{2^{2}}}}}",
    "(10^{10})!", "\\binom{10^{9}}{5 \\cdot 10^{8}}", "x^{10^{10}}", "e^{10^{10^{10}}}",
    "10^{10^{10}} - 10^{10^{10}} + 36", "1.5 \\times 10^{10^{10}}",
    pytest.param("(" * 30 + "36" + ")" * 30, id="parentheses_30"),
    pytest.param("{" * 30 + "36" + "}" * 30, id="braces_30"),
    pytest.param("36" + " + 0" * 300, id="1202_characters")])
def test_answers_too_costly_to_evaluate_score_zero_at_once(answer):
    started = time.perf_counter()
    assert math_accuracy_reward(_wrap(answer), "36") == 0.0
    assert math_accuracy_reward(_wrap("36"), answer) == 0.0     # as the gold too
    assert time.perf_counter() - started < 1.0


@pytest.mark.parametrize("answer, gold", [
    ("2^{100}", "1267650600228229401496703205376"), ("2^{65536}", "2^{65536}"),
    ("20!", "2432902008176640000"), ("\\frac{1}{2}", "0.5"), ("10^{-3}", "0.001"),
    ("\\sqrt{2}^{2}", "2"), ("((((36))))", "36"), ("\\left[ \\frac{\\pi^2}{8}, 1 \\right]",
                                                  "\\left[ \\frac{\\pi^2}{8}, 1 \\right]")])
def test_large_but_reasonable_answers_still_verify(answer, gold):
    assert math_accuracy_reward(_wrap(answer), gold) == 1.0


def test_a_long_completion_without_tags_is_read_from_its_last_box():
    completion = "reasoning " * 500 + "so \\boxed{36}."
    assert math_accuracy_reward(completion, "36") == 1.0
    assert math_accuracy_reward("reasoning " * 500 + "so 36.", "36") == 0.0


def _expressions():
    """Unevaluated sympy expressions of small integers: sums, products, powers, factorials."""
    leaves = st.integers(-40, 40).map(sympy.Integer)

    def extend(children):
        return st.one_of(
            st.tuples(children, children).map(lambda pair: sympy.Add(*pair, evaluate=False)),
            st.tuples(children, children).map(lambda pair: sympy.Mul(*pair, evaluate=False)),
            st.tuples(children, st.integers(0, 12).map(sympy.Integer)).map(
                lambda pair: sympy.Pow(*pair, evaluate=False)),
            st.integers(0, 60).map(lambda n: sympy.factorial(sympy.Integer(n), evaluate=False)))
    return st.recursive(leaves, extend, max_leaves=6)


@settings(max_examples=300, deadline=None)
@given(_expressions())
def test_digit_bound_covers_every_number_evaluation_builds(expr):
    def largest_digits(node):
        value = node.doit()
        own = len(str(abs(value.p))) if isinstance(value, sympy.Rational) else 1
        return max([own] + [largest_digits(argument) for argument in node.args])
    try:
        actual = largest_digits(expr)
    except (ZeroDivisionError, ValueError):
        return   # 0 to a negative power and the like: nothing to bound
    assert math_answers._digits_bound(expr) >= actual
