"""Examples (question + gold answer) from local jsonl / parquet files or a hub dataset name,
checked row by row: a bad file or row raises ConfigError naming the file and its line. The
training examples (config.data) and the fixed held-out evaluation subset (config.eval).

Task adapters map raw rows to Examples:
  gsm8k:      question, gold = text after '####' of `answer`
  math:       problem, gold = `answer` (MATH-500) or `solution`'s last boxed answer
  arithmetic: the synthetic task of qerl_jax.rewards.arithmetic (no file)
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterator

from qerl_jax.infra.errors import ConfigError
from qerl_jax.rewards.arithmetic import arithmetic_problems
from qerl_jax.rewards.gsm8k import gsm8k_gold_answer

TASKS = ("gsm8k", "math", "arithmetic")
FILE_TYPES = (".jsonl", ".json", ".parquet")


@dataclasses.dataclass(frozen=True)
class Example:
    question: str
    gold: str


def is_local_source(source: str) -> bool:
    """True for a path on disk (or one that reads as a file path), False for a hub dataset
    name such as 'openai/gsm8k'."""
    return (source.endswith(FILE_TYPES) or os.path.exists(os.path.expanduser(source))
            or source.startswith((os.sep, ".", "~")))


def json_type_name(value) -> str:
    """The JSON name of a parsed value's type: null, bool, int, float, string, list, object."""
    names = {type(None): "null", bool: "bool", int: "int", float: "float", str: "string",
             list: "list", dict: "object"}
    return names.get(type(value), type(value).__name__)


def _read_rows(path: str) -> Iterator[tuple[str, object]]:
    """(where, row) of each row of a local file; `where` is 'path:LINE' (1-based) for jsonl,
    'path: row N' (1-based) for parquet."""
    if path.endswith((".jsonl", ".json")):
        with open(path) as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ConfigError(f"{path}:{number}: invalid JSON ({error})") from None
                yield f"{path}:{number}", row
        return
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise ImportError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") \
            from None
    for number, row in enumerate(parquet.read_table(path).to_pylist(), start=1):
        yield f"{path}: row {number}", row


def _read_hub(name: str, split: str, subset: str | None) -> Iterator[tuple[str, object]]:
    try:
        import datasets
    except ImportError:
        raise ImportError(f"data source {name!r} is not a local file and the optional "
                          "`datasets` package is not installed (pip install qerl-jax[datasets])"
                          ) from None
    for number, row in enumerate(datasets.load_dataset(name, subset, split=split), start=1):
        yield f"{name} ({split}) row {number}", row


def _boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            if depth == 0:
                return text[begin:index]
            depth -= 1
    return None


def _text_field(row: dict, name: str, where: str) -> str:
    value = row[name]
    if not isinstance(value, str):
        raise ConfigError(f"{where}: field {name!r} must be a string, got "
                          f"{json_type_name(value)}")
    if not value.strip():
        raise ConfigError(f"{where}: field {name!r} is empty")
    return value


def _to_example(task: str, row: object, where: str) -> Example:
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {json_type_name(row)}")
    if task == "gsm8k":
        if "question" not in row or "answer" not in row:
            raise ConfigError(f"{where}: a gsm8k row needs 'question' and 'answer' fields, "
                              f"got {sorted(row)}")
        question = _text_field(row, "question", where)
        answer = _text_field(row, "answer", where)
        if "####" not in answer:
            raise ConfigError(f"{where}: field 'answer' has no '####' before the final answer "
                              f"(GSM8K's format): ...{answer[-60:]!r}")
        gold = gsm8k_gold_answer(answer)
        if not gold:
            raise ConfigError(f"{where}: field 'answer' has nothing after its '####'")
        return Example(question, gold)
    if task == "math":
        name = next((key for key in ("problem", "question", "prompt") if key in row), None)
        solution = row.get("solution")
        answer = row.get("answer")
        if name is None or (answer in (None, "") and not solution):
            raise ConfigError(f"{where}: a math row needs 'problem' and 'answer' (or a boxed "
                              f"'solution'), got {sorted(row)}")
        question = _text_field(row, name, where)
        if answer not in (None, ""):
            if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
                raise ConfigError(f"{where}: field 'answer' must be a string or a number, got "
                                  f"{json_type_name(answer)}")
            return Example(question, str(answer))
        solution = _text_field(row, "solution", where)
        return Example(question, _boxed(solution) or solution.strip())
    raise ConfigError(f"unknown task {task!r}; known: {TASKS}")


def load_examples(task: str, source: str = "", *, split: str = "train",
                  subset: str | None = None, limit: int | None = None,
                  arithmetic_count: int = 1000, arithmetic_max_operand: int = 20,
                  arithmetic_phrasing: str = "expression", seed: int = 0) -> list[Example]:
    """Examples of `task` from `source`: a local .jsonl/.parquet path, or a hub dataset name.

    For task 'arithmetic' no source is needed: `arithmetic_count` problems from `seed`. Every
    row is checked (also those past `limit`).

    Raises:
      ConfigError: a missing or unreadable source, or a bad row (naming file:line).
    """
    if task not in TASKS:
        raise ConfigError(f"unknown task {task!r}; known: {TASKS}")
    if task == "arithmetic":
        examples = [Example(p["question"], p["answer"])
                    for p in arithmetic_problems(arithmetic_count, seed,
                                                 max_operand=arithmetic_max_operand,
                                                 phrasing=arithmetic_phrasing)]
    else:
        if not source:
            raise ConfigError(f"task {task!r} needs a data source (a .jsonl/.parquet path or "
                              "a hub dataset name)")
        if is_local_source(source):
            source = os.path.expanduser(source)
            if os.path.isdir(source):
                raise ConfigError(f"{source}: is a directory, expected a .jsonl/.parquet file")
            if not os.path.isfile(source):
                raise ConfigError(f"{source}: does not exist (expected a .jsonl/.parquet file)")
            if not source.endswith(FILE_TYPES):
                raise ConfigError(f"{source}: unsupported data file type (use .jsonl or "
                                  ".parquet)")
            rows = _read_rows(source)
        else:
            rows = _read_hub(source, split, subset)
        examples = [_to_example(task, row, where) for where, row in rows]
    if not examples:
        raise ConfigError(f"{source or task}: holds no examples")
    return examples[:limit] if limit else examples


def load_training_examples(config) -> list[Example]:
    """The examples config.data asks for, checked before any model work: the file, every row,
    and that there are enough for one step (train.prompts_per_step).

    Args:
      config: a config validate_config accepts.
    Raises:
      ConfigError: naming the config field, or the file and line of a bad row.
    """
    data = config.data
    local = data.task != "arithmetic" and is_local_source(data.path)
    if local and data.split != "train":
        raise ConfigError(f"config.data.split: {data.split!r} applies to hub datasets only; "
                          f"data.path {data.path!r} is a local file (the file is the split)")
    examples = load_examples(data.task, data.path, split=data.split,
                             subset=data.subset or None, limit=data.limit or None,
                             arithmetic_count=data.arithmetic_count,
                             arithmetic_max_operand=data.arithmetic_max_operand,
                             arithmetic_phrasing=data.arithmetic_phrasing, seed=config.seed)
    needed = config.train.prompts_per_step
    if len(examples) < needed:
        field, source = (("data.arithmetic_count", "the arithmetic task") if not data.path
                         else ("data.path", data.path))
        after = f" (after data.limit={data.limit})" if data.limit else ""
        raise ConfigError(f"config.{field}: {source} holds {len(examples)} examples{after}, "
                          f"fewer than config.train.prompts_per_step={needed} (one step's "
                          "prompts)")
    return examples


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
                                           phrasing=phrasing)[
                training_count:]:
            if problem["question"] not in seen:
                seen.add(problem["question"])
                picked.append(Example(problem["question"], problem["answer"]))
                if len(picked) == count:
                    return picked
        drawn *= 2


def load_eval_examples(config, training_examples: list[Example]) -> list[Example]:
    """The fixed held-out subset config.eval asks for ([] when eval.every_steps is 0): the first
    eval.num_examples rows of the task's test split, in file order (as `evaluate --limit`).

    The test split is eval.data_path (a local file, or a hub dataset's 'test' split); '' means
    the 'test' split of the hub dataset data.path. Task arithmetic generates it
    (held_out_arithmetic_examples, never a training question).

    Args:
      config: a config validate_config accepts.
      training_examples: load_training_examples(config).
    Raises:
      ConfigError: naming the config field, or the file and line of a bad row.
    """
    data, evaluation = config.data, config.eval
    if not evaluation.every_steps:
        return []
    count = evaluation.num_examples
    if data.task == "arithmetic":
        if evaluation.data_path:
            raise ConfigError(f"config.eval.data_path: {evaluation.data_path!r} is unused by "
                              "task 'arithmetic' (its held-out problems are generated); set ''")
        return held_out_arithmetic_examples(
            count, config.seed, data.arithmetic_max_operand, data.arithmetic_count,
            {example.question for example in training_examples},
            phrasing=data.arithmetic_phrasing)
    source = evaluation.data_path or data.path
    if not evaluation.data_path and is_local_source(data.path):
        raise ConfigError(f"config.eval.data_path: required with a local data.path "
                          f"({data.path!r} is the training split); set the test split's "
                          ".jsonl/.parquet file")
    try:
        examples = load_examples(data.task, source, split="test", subset=data.subset or None)
    except ConfigError as error:
        raise ConfigError(f"config.eval.data_path: {error}") from None
    if len(examples) < count:
        raise ConfigError(f"config.eval.num_examples: {count} is more than the "
                          f"{len(examples)} examples of the test split {source}")
    return examples[:count]
