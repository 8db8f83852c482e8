"""The reward registry: the built-ins register by decorator, their names read without JAX or
math-verify, a plug-in reward registers from outside the package and scores in the worker, and
bad names or non-module-level functions are refused in one line."""

import subprocess
import sys

import pytest

from qerl_jax.rewards import (REWARDS, get_reward_functions, register_reward, reward_names,
                              score_completions)
from qerl_jax.rewards.answer_format import format_reward
from qerl_jax.rewards.arithmetic import arithmetic_last_integer_reward, arithmetic_reward
from qerl_jax.rewards.gsm8k import gsm8k_exact_reward, gsm8k_numeric_reward
from qerl_jax.rewards.math_answers import math_accuracy_reward

BUILT_INS = {"format": format_reward, "gsm8k_exact": gsm8k_exact_reward,
             "gsm8k_numeric": gsm8k_numeric_reward, "math_verify": math_accuracy_reward,
             "arithmetic": arithmetic_reward,
             "arithmetic_last_integer": arithmetic_last_integer_reward}


def test_the_built_ins_are_registered_under_their_names():
    assert reward_names() == REWARDS.names()
    assert set(BUILT_INS) <= set(reward_names())
    assert get_reward_functions(list(BUILT_INS)) == BUILT_INS


def test_the_names_are_read_without_jax_or_math_verify():
    code = ("import sys; from qerl_jax.rewards.registry import REWARDS; "
            "print(','.join(REWARDS.names())); "
            "print(sorted(m for m in ('jax', 'flax', 'numpy', 'math_verify', 'sympy') "
            "if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    names, imported = result.stdout.strip().splitlines()
    assert names.split(",") == list(BUILT_INS) and imported == "[]"


def plugin_reward(completion: str, gold: str) -> float:
    """A reward registered from outside qerl_jax: 3.0 when the completion ends with the gold."""
    return 3.0 if completion.endswith(gold) else 0.0


def test_a_plugin_reward_is_selectable_and_scores_in_the_worker():
    register_reward("test_plugin_reward")(plugin_reward)
    try:
        functions = get_reward_functions(["format", "test_plugin_reward"])
        assert functions["test_plugin_reward"] is plugin_reward
        scores = score_completions(["x 12", "12 x"], ["12", "12"], functions,
                                   time_limit_seconds=30.0)
        assert scores["test_plugin_reward"] == [3.0, 0.0] and scores["total"] == [3.0, 0.0]
        register_reward("test_plugin_reward")(plugin_reward)   # the same module imported again
        with pytest.raises(ValueError, match="'test_plugin_reward' is already registered"):
            register_reward("test_plugin_reward")(format_reward)
    finally:
        REWARDS.unregister("test_plugin_reward")
    assert "test_plugin_reward" not in reward_names()


def test_a_function_defined_inside_another_is_refused():
    def local(completion, gold):
        return 0.0
    with pytest.raises(ValueError, match="not a module-level function"):
        register_reward("test_local_reward")(local)
    assert "test_local_reward" not in REWARDS


def test_unknown_and_missing_names_are_one_line_listing_the_known():
    for names, shown in ((["format", "gsm9k"], "['gsm9k']"), ([], "(none given)")):
        with pytest.raises(ValueError) as error:
            get_reward_functions(names)
        message = str(error.value)
        assert "\n" not in message and message.startswith(f"unknown reward function(s) {shown}")
        assert message.endswith("known: " + ", ".join(REWARDS.names(with_aliases=True)))
