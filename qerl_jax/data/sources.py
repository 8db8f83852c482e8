"""Examples (question + gold answer) from local jsonl / parquet files or a hub dataset name.

Task adapters map raw rows to Examples:
  gsm8k:      question, gold = text after '####' of `answer`
  math:       problem, gold = `answer` (MATH-500) or `solution`'s last boxed answer
  arithmetic: the synthetic task of qerl_jax.rewards.arithmetic (no file)
"""

from __future__ import annotations

import dataclasses
import json
import os

from qerl_jax.rewards.arithmetic import arithmetic_problems
from qerl_jax.rewards.gsm8k import gsm8k_gold_answer

TASKS = ("gsm8k", "math", "arithmetic")


@dataclasses.dataclass(frozen=True)
class Example:
    question: str
    gold: str


def _read_rows(path: str) -> list[dict]:
    if path.endswith(".jsonl") or path.endswith(".json"):
        rows = []
        with open(path) as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}:{number}: invalid JSON ({error})") from None
        return rows
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as parquet
        except ImportError:
            raise ImportError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") \
                from None
        return parquet.read_table(path).to_pylist()
    raise ValueError(f"{path}: unsupported data file type (use .jsonl or .parquet)")


def _read_hub(name: str, split: str, subset: str | None) -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise ImportError(f"data source {name!r} is not a local file and the optional "
                          "`datasets` package is not installed (pip install qerl-jax[datasets])"
                          ) from None
    return list(datasets.load_dataset(name, subset, split=split))


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


def _to_example(task: str, row: dict, where: str) -> Example:
    if task == "gsm8k":
        if "question" not in row or "answer" not in row:
            raise ValueError(f"{where}: a gsm8k row needs 'question' and 'answer' fields, "
                             f"got {sorted(row)}")
        return Example(row["question"], gsm8k_gold_answer(row["answer"]))
    if task == "math":
        question = row.get("problem", row.get("question", row.get("prompt")))
        solution = row.get("solution", "") or ""
        gold = row.get("answer") or _boxed(solution) or solution.strip() or None
        if question is None or gold is None:
            raise ValueError(f"{where}: a math row needs 'problem' and 'answer' (or a boxed "
                             f"'solution'), got {sorted(row)}")
        return Example(question, str(gold))
    raise ValueError(f"unknown task {task!r}; known: {TASKS}")


def load_examples(task: str, source: str = "", *, split: str = "train",
                  subset: str | None = None, limit: int | None = None,
                  arithmetic_count: int = 1000, arithmetic_max_operand: int = 20,
                  seed: int = 0) -> list[Example]:
    """Examples of `task` from `source`: a local .jsonl/.parquet path, or a hub dataset name.

    For task 'arithmetic' no source is needed: `arithmetic_count` problems from `seed`.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known: {TASKS}")
    if task == "arithmetic":
        examples = [Example(p["question"], p["answer"])
                    for p in arithmetic_problems(arithmetic_count, seed,
                                                 max_operand=arithmetic_max_operand)]
    else:
        if not source:
            raise ValueError(f"task {task!r} needs a data source (a .jsonl/.parquet path or a "
                             "hub dataset name)")
        looks_local = os.sep in source or source.endswith((".jsonl", ".json", ".parquet"))
        if looks_local and not os.path.isfile(source):
            raise FileNotFoundError(f"data file {source!r} does not exist")
        rows = _read_rows(source) if looks_local else _read_hub(source, split, subset)
        examples = [_to_example(task, row, f"{source} row {i}") for i, row in enumerate(rows)]
    if not examples:
        raise ValueError(f"data source {source or task!r} holds no examples")
    return examples[:limit] if limit else examples
