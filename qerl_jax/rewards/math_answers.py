"""MATH-style rewards via math-verify (QeRL's BigMath reward: format 0.2 + accuracy 1.0).

The answer is read from the <answer> block, or the last \\boxed{...} of the completion; the gold
is parsed by math-verify (boxed first). An unparsable gold or a verifier error gives 0.

Bounded time: answers that would make sympy work for seconds score 0 before they reach it
(answers longer than MAX_ANSWER_CHARS, bracket nesting deeper than MAX_NESTING_DEPTH, numbers
whose evaluation would exceed MAX_NUMBER_DIGITS digits: exponent towers, huge factorials); the
rest is bounded by the caller, as the scoring worker of `scoring.py` bounds each completion's CPU
time. math-verify's own timeouts stay off: they are wall-clock alarms, which a busy host trips
on correct answers, and a limit hit inside them would score 0 without being counted.
The parse of each gold is cached (GOLD_CACHE_SIZE golds): a group's completions share one.
"""

from __future__ import annotations

import functools
import logging
import math
import re

from qerl_jax.rewards.answer_format import extract_answer
from qerl_jax.rewards.registry import register_reward

ACCURACY_REWARD = 1.0
GOLD_CACHE_SIZE = 4096       # parsed golds kept per process (MATH-500 has 500)
MAX_ANSWER_CHARS = 1000      # MATH-500's longest gold answer has 53 characters
MAX_NESTING_DEPTH = 8        # MATH-500 golds nest at most 2 deep; parsing time grows with depth
MAX_NUMBER_DIGITS = 100_000  # 2^{65536} (19,729 digits) verifies in ~0.2 s; 2^{2^{65536}} never

_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")
_LOG10_2 = math.log10(2)


def _is_delimited(text: str) -> bool:
    """Whether math-verify can find the math in `text` itself: a \\boxed or an unescaped $."""
    return "\\boxed" in text or _UNESCAPED_DOLLAR.search(text) is not None


def _nesting_depth(text: str) -> int:
    depth = deepest = 0
    for character in text:
        if character in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif character in ")]}":
            depth = max(depth - 1, 0)
    return deepest


def _value_bound(digits: float) -> float:
    """An upper bound on |x| for an x of at most `digits` decimal digits."""
    return 10.0 ** digits if digits < 300 else math.inf


def _digits_bound(expr) -> float:
    """An upper bound on the decimal digits of the numbers sympy builds to evaluate `expr`.

    Integers, rationals and floats count their own size; a power b^e counts digits(b) * |e|;
    n! and binomial(n, k) count n * digits(n); sums the largest term, products the sum of their
    factors; anything else the largest of its arguments.
    """
    import sympy

    if isinstance(expr, sympy.MatrixBase):
        return max((_digits_bound(entry) for entry in expr), default=1.0)
    if not isinstance(expr, sympy.Basic):
        return 1.0
    if isinstance(expr, sympy.Rational):   # Integer too
        return max(abs(expr.p).bit_length(), expr.q.bit_length()) * _LOG10_2 + 1
    if isinstance(expr, sympy.Float):
        _, _, exponent, bits = expr._mpf_[:4]
        return abs(exponent + bits) * _LOG10_2 + 1
    if not expr.args:
        return 1.0                          # symbols, pi, E, I, oo
    if isinstance(expr, sympy.Pow):
        base, exponent = expr.args
        exponent_value = (abs(float(exponent)) if isinstance(exponent, sympy.Number)
                          and _digits_bound(exponent) < 300 else
                          _value_bound(_digits_bound(exponent)))
        return _digits_bound(base) * max(exponent_value, 1.0)
    if isinstance(expr, (sympy.factorial, sympy.factorial2, sympy.subfactorial, sympy.gamma,
                         sympy.binomial, sympy.RisingFactorial, sympy.FallingFactorial)):
        digits = max(_digits_bound(argument) for argument in expr.args)
        return _value_bound(digits) * digits + 1
    if isinstance(expr, sympy.exp):
        return _value_bound(_digits_bound(expr.args[0])) * math.log10(math.e) + 1
    if isinstance(expr, sympy.Mul):
        return sum(_digits_bound(argument) for argument in expr.args)
    largest = max(_digits_bound(argument) for argument in expr.args)
    return largest + math.log10(len(expr.args)) if isinstance(expr, sympy.Add) else largest


def _small_enough(expr) -> bool:
    try:
        return _digits_bound(expr) <= MAX_NUMBER_DIGITS
    except (RecursionError, OverflowError, TypeError, ValueError, AttributeError):
        return False


class _WithoutTimeoutNotice(logging.Filter):
    """Drops math-verify's notice that its timeouts are off: the caller's limit replaces them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


@functools.cache
def _math_verify():
    """The math_verify module, imported on first use (sympy and ANTLR are heavy)."""
    import math_verify
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_WithoutTimeoutNotice())
    return math_verify


def _parse_bounded(text: str) -> list:
    """math-verify's parse of `text` ($-delimited when not already), dropping what is too large
    to evaluate; [] for text longer or nested deeper than the limits."""
    if len(text) > MAX_ANSWER_CHARS or _nesting_depth(text) > MAX_NESTING_DEPTH:
        return []
    delimited = text if _is_delimited(text) else f"${text}$"
    parsed = _math_verify().parse(delimited, parsing_timeout=None)
    return [item for item in parsed if _small_enough(item)]


@functools.lru_cache(maxsize=GOLD_CACHE_SIZE)
def _parsed_gold(gold: str) -> tuple:
    return tuple(_parse_bounded(gold))


def _verify(gold: str, answer: str) -> bool:
    gold_parsed = list(_parsed_gold(gold))
    if not gold_parsed:
        return False
    answer_parsed = _parse_bounded(answer)
    if not answer_parsed:
        return False
    return bool(_math_verify().verify(gold_parsed, answer_parsed, timeout_seconds=None))


def _answer_text(completion: str) -> str:
    """The <answer> block, else the completion from its last \\boxed (when longer than
    MAX_ANSWER_CHARS), else the completion."""
    answer = extract_answer(completion)
    if answer:
        return answer
    if len(completion) > MAX_ANSWER_CHARS and "\\boxed" in completion:
        return completion[completion.rindex("\\boxed"):][:MAX_ANSWER_CHARS]
    return completion


@register_reward("math_verify")
def math_accuracy_reward(completion: str, gold: str) -> float:
    """1.0 when math-verify judges the completion's answer equal to the gold answer."""
    try:
        return ACCURACY_REWARD if _verify(gold, _answer_text(completion)) else 0.0
    except Exception:
        return 0.0
