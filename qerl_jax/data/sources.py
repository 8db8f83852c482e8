"""Rows of local jsonl / parquet files or a hub dataset, checked one by one: a bad file or row
raises ConfigError naming the file and its line. What a row means is its task's business
(`qerl_jax.tasks`: each task turns a row dict into an Example).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, Iterable, Iterator

from qerl_jax.infra.errors import ConfigError

FILE_TYPES = (".jsonl", ".json", ".parquet")


@dataclasses.dataclass(frozen=True)
class Example:
    """A question (the prompt's text) and its gold answer (what the rewards compare with)."""

    question: str
    gold: str


RowToExample = Callable[[dict, str], Example]   # (row, 'file:LINE') -> Example, or ConfigError


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


def text_field(row: dict, name: str, where: str) -> str:
    """row[name], which must be a non-empty string; ConfigError naming `where` and the field."""
    value = row[name]
    if not isinstance(value, str):
        raise ConfigError(f"{where}: field {name!r} must be a string, got "
                          f"{json_type_name(value)}")
    if not value.strip():
        raise ConfigError(f"{where}: field {name!r} is empty")
    return value


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _object_without_duplicates(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object's dict; a key given twice would otherwise keep its last value silently."""
    row = {}
    for key, value in pairs:
        if key in row:
            raise _DuplicateKey(key)
        row[key] = value
    return row


def parse_json_row(line: str, where: str) -> object:
    """One jsonl line parsed; ConfigError naming `where` for invalid JSON or a duplicate key."""
    try:
        return json.loads(line, object_pairs_hook=_object_without_duplicates)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{where}: invalid JSON ({error})") from None
    except _DuplicateKey as duplicate:
        raise ConfigError(f"{where}: duplicate key {duplicate.key!r}") from None


def _read_file(path: str) -> Iterator[tuple[str, object]]:
    """(where, row) of each row of a local file; `where` is 'path:LINE' (1-based) for jsonl,
    'path: row N' (1-based) for parquet."""
    if path.endswith((".jsonl", ".json")):
        with open(path) as handle:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    yield f"{path}:{number}", parse_json_row(line, f"{path}:{number}")
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


def read_rows(source: str, *, split: str = "train",
              subset: str | None = None) -> Iterator[tuple[str, object]]:
    """(where, row) of every row of `source`: a local .jsonl/.parquet path, or a hub dataset
    name (its `split`, `subset`).

    Raises:
      ConfigError: a missing, unreadable or unsupported file, or invalid JSON (naming file:line).
    """
    if not is_local_source(source):
        return _read_hub(source, split, subset)
    source = os.path.expanduser(source)
    if os.path.isdir(source):
        raise ConfigError(f"{source}: is a directory, expected a .jsonl/.parquet file")
    if not os.path.isfile(source):
        raise ConfigError(f"{source}: does not exist (expected a .jsonl/.parquet file)")
    if not source.endswith(FILE_TYPES):
        raise ConfigError(f"{source}: unsupported data file type (use .jsonl or .parquet)")
    return _read_file(source)


def rows_to_examples(rows: Iterable[tuple[str, object]],
                     row_to_example: RowToExample) -> list[Example]:
    """Every row through `row_to_example`; a row that is not an object is refused by line."""
    examples = []
    for where, row in rows:
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: expected a JSON object, got {json_type_name(row)}")
        examples.append(row_to_example(row, where))
    return examples
