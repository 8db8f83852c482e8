"""Data files and rows are checked before any model work: each bad input is a ConfigError of
one line naming the file and its 1-based line (or the config field)."""

import json
import os

import pytest

from qerl_jax.data.arithmetic import held_out_arithmetic_examples
from qerl_jax.data.sources import is_local_source
from qerl_jax.infra.errors import ConfigError
from qerl_jax.tasks import load_eval_examples, load_examples, load_training_examples
from tests.conftest import config_from_file, SHARED_DATA_DIR

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARED_DATA = SHARED_DATA_DIR   # ../shared/data beside the repository (tests/conftest.py)


def _jsonl(tmp_path, *lines: str, name: str = "rows.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def _gsm8k_row(question="What is 1+1?", answer="1+1=2\n#### 2") -> str:
    return json.dumps({"question": question, "answer": answer})


def _raises(message: str, *args, **kwargs):
    with pytest.raises(ConfigError) as error:
        load_examples(*args, **kwargs)
    assert str(error.value) == message
    return error


def test_directory_and_missing_paths(tmp_path):
    _raises(f"{tmp_path}: is a directory, expected a .jsonl/.parquet file", "gsm8k",
            str(tmp_path))
    missing = str(tmp_path / "nope.jsonl")
    _raises(f"{missing}: does not exist (expected a .jsonl/.parquet file)", "gsm8k", missing)
    text = tmp_path / "rows.txt"
    text.write_text("x\n")
    _raises(f"{text}: unsupported data file type (use .jsonl or .parquet)", "gsm8k", str(text))
    empty = _jsonl(tmp_path, "", name="empty.jsonl")
    _raises(f"{empty}: holds no examples", "gsm8k", empty)


def test_rows_that_are_not_objects_name_their_line(tmp_path):
    path = _jsonl(tmp_path, _gsm8k_row(), "", "5")
    _raises(f"{path}:3: expected a JSON object, got int", "gsm8k", path)   # blank line 2
    path = _jsonl(tmp_path, '["q", "#### 1"]')
    _raises(f"{path}:1: expected a JSON object, got list", "math", path)


def test_gsm8k_fields_are_checked(tmp_path):
    path = _jsonl(tmp_path, _gsm8k_row(), _gsm8k_row(answer=3))
    _raises(f"{path}:2: field 'answer' must be a string, got int", "gsm8k", path)
    path = _jsonl(tmp_path, _gsm8k_row(question=None))
    _raises(f"{path}:1: field 'question' must be a string, got null", "gsm8k", path)
    path = _jsonl(tmp_path, _gsm8k_row(question="  "))
    _raises(f"{path}:1: field 'question' is empty", "gsm8k", path)
    path = _jsonl(tmp_path, _gsm8k_row(), _gsm8k_row(), _gsm8k_row(answer="so the answer is 2"))
    _raises(f"{path}:3: field 'answer' has no '####' before the final answer (GSM8K's format): "
            "...'so the answer is 2'", "gsm8k", path)
    path = _jsonl(tmp_path, _gsm8k_row(answer="2 ####  "))
    _raises(f"{path}:1: field 'answer' has nothing after its '####'", "gsm8k", path)
    path = _jsonl(tmp_path, json.dumps({"problem": "x"}))
    _raises(f"{path}:1: a gsm8k row needs 'question' and 'answer' fields, got ['problem']",
            "gsm8k", path)


def test_a_key_given_twice_is_refused_by_line(tmp_path):
    """JSON keeps the last of two equal keys silently; a row with one is refused instead, at
    any depth of the row."""
    path = _jsonl(tmp_path, _gsm8k_row(), '{"question": "q", "answer": "#### 1", "answer": "2"}')
    _raises(f"{path}:2: duplicate key 'answer'", "gsm8k", path)
    path = _jsonl(tmp_path, '{"problem": "p", "answer": 1, "meta": {"id": 1, "id": 2}}')
    _raises(f"{path}:1: duplicate key 'id'", "math", path)
    path = _jsonl(tmp_path, '{"problem": "p", "answer": 1, "meta": [{"id": 1}, {"id": 2}]}')
    assert [e.gold for e in load_examples("math", path)] == ["1"]   # equal keys, two objects


def test_math_rows(tmp_path):
    path = _jsonl(tmp_path, json.dumps({"problem": "p", "answer": 7}),
                  json.dumps({"problem": "p", "solution": "so \\boxed{\\frac{1}{2}}"}))
    examples = load_examples("math", path)
    assert [e.gold for e in examples] == ["7", "\\frac{1}{2}"]
    path = _jsonl(tmp_path, json.dumps({"problem": None, "answer": "1"}))
    _raises(f"{path}:1: field 'problem' must be a string, got null", "math", path)
    path = _jsonl(tmp_path, json.dumps({"problem": "p", "answer": None}))
    _raises(f"{path}:1: a math row needs 'problem' and 'answer' (or a boxed 'solution'), got "
            "['answer', 'problem']", "math", path)
    path = _jsonl(tmp_path, json.dumps({"problem": "p", "answer": [1]}))
    _raises(f"{path}:1: field 'answer' must be a string or a number, got list", "math", path)


def test_local_paths_and_hub_names():
    assert not is_local_source("openai/gsm8k")
    assert not is_local_source("open-r1/Big-Math-RL-Verified-Processed")
    assert is_local_source("../shared/data/gsm8k/train.jsonl")
    assert is_local_source("data/train.parquet")
    assert is_local_source("/tmp")


def _tiny_config():
    return config_from_file("tiny")


def test_training_examples_cover_one_step(tmp_path):
    config = _tiny_config()
    assert len(load_training_examples(config)) == config.data.arithmetic_count
    path = _jsonl(tmp_path, *[_gsm8k_row()] * 10)
    config.data.task, config.data.path = "gsm8k", path
    with pytest.raises(ConfigError) as error:
        load_training_examples(config)
    assert str(error.value) == (f"config.data.path: {path} holds 10 examples, fewer than "
                                "config.train.prompts_per_step=16 (one step's prompts)")
    config.train.prompts_per_step = 8
    config.data.limit = 4
    with pytest.raises(ConfigError, match=r"holds 4 examples \(after data.limit=4\), fewer "
                                          r"than config.train.prompts_per_step=8"):
        load_training_examples(config)
    config.data.limit = 0
    assert len(load_training_examples(config)) == 10
    config.data.split = "test"
    with pytest.raises(ConfigError, match=r"^config.data.split: 'test' applies to hub datasets "
                                          r"only; data.path '.*rows.jsonl' is a local file"):
        load_training_examples(config)
    config.data.split = "train"
    config.data.task, config.data.path, config.data.arithmetic_count = "arithmetic", "", 4
    with pytest.raises(ConfigError, match=r"^config.data.arithmetic_count: the arithmetic task "
                                          r"holds 4 examples, fewer than"):
        load_training_examples(config)


def test_eval_examples_are_the_first_rows_of_the_test_split(tmp_path):
    """config.eval: [] when off; a file's first eval.num_examples rows in file order; the
    arithmetic task's held-out problems (none a training question, each once, the first N of a
    longer list); each bad setting is one line naming its field."""
    config = _tiny_config()
    training = load_training_examples(config)
    assert load_eval_examples(config, training) == []
    config.eval.every_steps, config.eval.num_examples = 5, 40
    held_out = load_eval_examples(config, training)
    questions = [example.question for example in held_out]
    assert len(set(questions)) == 40 and not set(questions) & {e.question for e in training}
    config.eval.num_examples = 100
    assert load_eval_examples(config, training)[:40] == held_out
    config.eval.num_examples = 1000
    with pytest.raises(ConfigError, match=r"^config.eval.num_examples: 1000 is more than the "
                                          r"\d+ arithmetic problems \(operands 0..9\) outside "
                                          r"the training set$"):
        load_eval_examples(config, training)
    config.eval.num_examples, config.eval.data_path = 4, "test.jsonl"
    with pytest.raises(ConfigError, match=r"^config.eval.data_path: 'test.jsonl' is unused by "
                                          r"task 'arithmetic'"):
        load_eval_examples(config, training)

    train_path = _jsonl(tmp_path, *[_gsm8k_row()] * 16, name="train.jsonl")
    test_path = _jsonl(tmp_path, *[_gsm8k_row(f"What is {n}+1?", f"#### {n + 1}")
                                   for n in range(6)], name="test.jsonl")
    config.data.task, config.data.path, config.data.arithmetic_count = "gsm8k", train_path, 1000
    config.data.arithmetic_max_operand = 20
    config.eval.data_path = ""
    with pytest.raises(ConfigError, match=r"^config.eval.data_path: required with a local "
                                          r"data.path"):
        load_eval_examples(config, training)
    config.eval.data_path = test_path
    assert load_eval_examples(config, training) == load_examples("gsm8k", test_path)[:4]
    config.eval.num_examples = 7
    with pytest.raises(ConfigError) as error:
        load_eval_examples(config, training)
    assert str(error.value) == ("config.eval.num_examples: 7 is more than the 6 examples of "
                                f"the test split {test_path}")
    config.eval.data_path = str(tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError, match=r"^config.eval.data_path: .*missing.jsonl: does not "
                                          r"exist"):
        load_eval_examples(config, training)


def test_shared_files_load_without_complaint():
    gsm8k = os.path.join(SHARED_DATA, "gsm8k", "train.jsonl")
    math = os.path.join(SHARED_DATA, "math500", "test.jsonl")
    if not (os.path.isfile(gsm8k) and os.path.isfile(math)):
        pytest.skip(f"no shared data under {SHARED_DATA}")
    assert len(load_examples("gsm8k", gsm8k)) == 7473
    assert len(load_examples("math", math)) == 500


def test_held_out_arithmetic_questions_follow_the_phrasing_and_avoid_training():
    """The test split of the question phrasing: the same problems as the expression phrasing's
    (same seed, same draws), asked as questions, none a training question."""
    training = load_examples("arithmetic", arithmetic_count=32, arithmetic_max_operand=9,
                             arithmetic_phrasing="question", seed=5)
    assert all(example.question.startswith("What is ") for example in training)
    held_out = held_out_arithmetic_examples(16, 5, 9, 32, {e.question for e in training},
                                            phrasing="question")
    assert len(held_out) == 16
    assert not {e.question for e in held_out} & {e.question for e in training}
    expressions = held_out_arithmetic_examples(
        16, 5, 9, 32, {e.question.removeprefix("What is ").removesuffix("?").replace(" ", "")
                       + "=" for e in training})
    assert [e.gold for e in expressions] == [e.gold for e in held_out]
    assert [e.question for e in expressions] == [
        e.question.removeprefix("What is ").removesuffix("?").replace(" ", "") + "="
        for e in held_out]
