"""Registered tasks: the built-ins name their row loaders, gold parsers, correctness rewards and
default rewards; a task registered from outside the package loads by name and scores through its
correctness reward; a generated task's held-out problems come from the task; bad tasks and
names are refused in one line; the names read without JAX."""

import json
import subprocess
import sys

import pytest

from qerl_jax.data.sources import Example, text_field
from qerl_jax.infra.errors import ConfigError
from qerl_jax.rewards import REWARDS, register_reward, score_completions
from qerl_jax.rewards.arithmetic import arithmetic_last_integer_reward, arithmetic_reward
from qerl_jax.rewards.gsm8k import gsm8k_numeric_reward
from qerl_jax.rewards.math_answers import math_accuracy_reward
from qerl_jax.tasks import (TASKS, Task, get_task, load_eval_examples, load_examples,
                            load_training_examples, register_task, task_names)
from tests.conftest import config_from_file


def test_the_built_in_tasks():
    assert task_names()[:3] == ("gsm8k", "math", "arithmetic")
    gsm8k, math, arithmetic = (get_task(name) for name in ("gsm8k", "math", "arithmetic"))
    assert gsm8k.correctness_function() is gsm8k_numeric_reward
    assert gsm8k.reward_names() == ("format", "gsm8k_exact")   # QeRL's GSM8K rewards
    assert math.correctness_function() is math_accuracy_reward
    assert math.reward_names() == ("format", "math_verify")
    assert gsm8k.reads_files and math.reads_files and not arithmetic.reads_files
    assert gsm8k.gold_answer("48 / 2 = 24\n#### 24 ") == "24"
    assert math.gold_answer("so \\boxed{\\frac{1}{\\sqrt{2}}}.") == "\\frac{1}{\\sqrt{2}}"
    assert math.gold_answer("no box: 7") == "no box: 7"
    assert arithmetic.gold_answer("-07") == "-7"


def test_arithmetic_correctness_follows_the_phrasing():
    """'7+5=' answers are read at their first integer, 'What is 7 + 5?' answers at their last
    (an instruct model restates the operands first)."""
    arithmetic = get_task("arithmetic")
    assert arithmetic.correctness_function() is arithmetic_reward
    question = {"arithmetic_phrasing": "question"}
    assert arithmetic.correctness_function(question) is arithmetic_last_integer_reward
    assert arithmetic.reward_names(question) == ("arithmetic_last_integer", "format")
    config = config_from_file("tiny")
    assert arithmetic.correctness_reward(config.data) == "arithmetic"
    assert arithmetic.option_values(config.data) == {
        "arithmetic_count": config.data.arithmetic_count,
        "arithmetic_max_operand": config.data.arithmetic_max_operand,
        "arithmetic_phrasing": "expression"}
    for completion, gold, first, last in (("12", "12", 1.0, 1.0),
                                          ("7 + 5 = 12", "12", 0.0, 1.0),
                                          ("12, not 13", "12", 1.0, 0.0)):
        assert arithmetic.correctness_function()(completion, gold) == first
        assert arithmetic.correctness_function(question)(completion, gold) == last


# ------------------------------------------------------------- a task from outside the package
# module level: the scoring worker loads rewards by reference
def reversed_word_reward(completion: str, gold: str) -> float:
    """5.0 when the <answer> block (else the completion) is the gold word, case-blind."""
    answer = completion.rsplit("<answer>", 1)[-1].split("</answer>", 1)[0]
    return 5.0 if answer.strip().lower() == gold.lower() else 0.0


def reversed_word_example(row: dict, where: str) -> Example:
    """A row {'word': w} asks for w reversed."""
    if "word" not in row:
        raise ConfigError(f"{where}: a reversed_word row needs 'word', got {sorted(row)}")
    word = text_field(row, "word", where)
    return Example(f"Reverse '{word}'.", word[::-1])


@pytest.fixture
def plugin_task():
    register_reward("test_reversed_word")(reversed_word_reward)
    task = register_task(Task("test_reversed_word", correctness="test_reversed_word",
                              default_rewards=("format", "test_reversed_word"),
                              row_to_example=reversed_word_example))
    yield task
    TASKS.unregister("test_reversed_word")
    REWARDS.unregister("test_reversed_word")


def _rows(tmp_path, *rows, name="words.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_a_task_registered_from_outside_loads_and_scores(tmp_path, plugin_task):
    assert get_task("test_reversed_word") is plugin_task
    words = [f"word{n}" for n in range(16)]
    path = _rows(tmp_path, *({"word": word} for word in words))
    examples = load_examples("test_reversed_word", path)
    assert [e.gold for e in examples] == [word[::-1] for word in words]

    config = config_from_file("tiny")
    config.data.task, config.data.path = "test_reversed_word", path
    assert load_training_examples(config) == examples

    correctness = plugin_task.correctness_function(config.data)
    assert correctness is reversed_word_reward
    completions = [f"<think>.</think> <answer>{e.gold.upper()}</answer>" for e in examples[:2]]
    completions.append("<answer>nope</answer>")
    golds = [e.gold for e in examples[:3]]
    scores = score_completions(completions, golds, {"correct": correctness},
                               time_limit_seconds=30.0)
    assert scores["correct"] == [5.0, 5.0, 0.0]

    bad = _rows(tmp_path, {"word": "ok"}, {"text": "x"}, name="bad.jsonl")
    with pytest.raises(ConfigError) as error:
        load_examples("test_reversed_word", bad)
    assert str(error.value) == f"{bad}:2: a reversed_word row needs 'word', got ['text']"


def _counting_task(held_out=None):
    def generate(options, seed):
        return [Example(f"{seed}:{n}", str(n)) for n in range(options["count"])]
    return Task("test_counting", correctness="format", generate=generate, held_out=held_out,
                options={"count": 3}, count_option="count")


def test_a_generated_task_draws_its_examples_and_held_out_problems():
    task = _counting_task(held_out=lambda options, seed, count, training: [
        Example(f"held out {n}", str(n)) for n in range(len(training), len(training) + count)])
    assert load_examples(task, seed=2) == [Example(f"2:{n}", str(n)) for n in range(3)]
    assert len(load_examples(task, count=20, limit=5)) == 5
    register_task(task)
    try:
        config = config_from_file("tiny")
        config.data.task = "test_counting"
        config.train.prompts_per_step = 4
        with pytest.raises(ConfigError) as error:
            load_training_examples(config)
        assert str(error.value).startswith("config.data.count: the test_counting task holds 3 "
                                           "examples, fewer than config.train.prompts_per_step=4")
        config.train.prompts_per_step = 2
        training = load_training_examples(config)
        config.eval.every_steps, config.eval.num_examples = 1, 2
        assert load_eval_examples(config, training) == [Example("held out 3", "3"),
                                                        Example("held out 4", "4")]
        register_task(_counting_task(), replace=True)
        with pytest.raises(ConfigError, match="^config.eval.every_steps: task 'test_counting' "
                                              "generates no held-out problems; set 0$"):
            load_eval_examples(config, training)
    finally:
        TASKS.unregister("test_counting")


def test_bad_tasks_and_names_are_one_line():
    def rows(row, where):
        return Example("q", "a")
    with pytest.raises(ValueError, match="give exactly one of row_to_example"):
        Task("t", correctness="format")
    with pytest.raises(ValueError, match="give exactly one of row_to_example"):
        Task("t", correctness="format", row_to_example=rows, generate=lambda o, s: [])
    with pytest.raises(ValueError, match="held_out goes with generate"):
        Task("t", correctness="format", row_to_example=rows, held_out=lambda *a: [])
    with pytest.raises(ValueError, match="correctness must be a reward name"):
        Task("t", correctness="", row_to_example=rows)
    with pytest.raises(ValueError, match="count_option 'n' is not one of its options"):
        Task("t", correctness="format", generate=lambda o, s: [], count_option="n")
    with pytest.raises(ValueError, match="'gsm8k' is already registered"):
        register_task(Task("gsm8k", correctness="format", row_to_example=rows))
    with pytest.raises(ValueError, match="unknown reward function"):
        Task("t", correctness="no_such_reward", row_to_example=rows).correctness_function()

    with pytest.raises(ConfigError) as error:
        load_examples("gsm9k", "x.jsonl")
    assert str(error.value) == "unknown task 'gsm9k'; known: " + ", ".join(
        TASKS.names(with_aliases=True))
    config = config_from_file("tiny")
    config.data.task = "gsm9k"
    with pytest.raises(ConfigError, match="^config.data.task: unknown task 'gsm9k'; known: "):
        load_training_examples(config)
    with pytest.raises(ConfigError, match=r"^task 'gsm8k' has no option\(s\) "
                                          r"\['arithmetic_count'\]; its options: none$"):
        load_examples("gsm8k", "x.jsonl", arithmetic_count=3)
    with pytest.raises(ConfigError, match="^x.jsonl: task 'arithmetic' generates its problems "
                                          "and reads no data source$"):
        load_examples("arithmetic", "x.jsonl")
    with pytest.raises(ConfigError, match="^task 'math' needs a data source"):
        load_examples("math")


def test_the_task_names_read_without_jax():
    code = ("import sys; from qerl_jax.tasks import TASKS; print(','.join(TASKS.names())); "
            "print(sorted(m for m in ('jax', 'flax', 'math_verify', 'transformers') "
            "if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    names, imported = result.stdout.strip().splitlines()
    assert names == "gsm8k,math,arithmetic" and imported == "[]"
