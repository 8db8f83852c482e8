"""The config schema's building blocks: `Field` (default, one-line description, value check),
the value checks the schema composes (ranges, choices, registered names) and the type rules
of a field's value against its default. JAX-free."""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any, Callable, Mapping

import ml_collections

from qerl_jax.registry import Registry

Check = Callable[[Any], "str | None"]   # a value -> what is wrong with it, or None


def greater_than(bound: float) -> Check:
    return lambda value: None if value > bound else f"must be > {bound}, got {value!r}"


def at_least(bound: float) -> Check:
    return lambda value: None if value >= bound else f"must be >= {bound}, got {value!r}"


def in_interval(low: float, high: float, *, low_open: bool = False,
                high_open: bool = False) -> Check:
    text = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"

    def check(value):
        above = value > low if low_open else value >= low
        below = value < high if high_open else value <= high
        return None if above and below else f"must be in {text}, got {value!r}"
    return check


def one_of(choices: tuple) -> Check:
    return lambda value: None if value in choices else f"{value!r} not in {choices}"


def registered(names: Registry, *, allow_empty: bool = False) -> Check:
    """A name registered in `names` (read when the check runs: plug-ins' names included); ''
    too with allow_empty."""
    def check(value):
        if allow_empty and value == "":
            return None
        return None if value in names else names.unknown_message(value)
    return check


def names_from(names: Registry, *, allow_empty: bool) -> Check:
    """A tuple of distinct names registered in `names`."""
    def check(value):
        for name in value:
            if name not in names:
                return names.unknown_message(name)
        if len(set(value)) != len(value):
            return f"names a function twice: {tuple(value)}"
        if not value and not allow_empty:
            return f"must name at least one {names.kind}; known: {', '.join(names.names())}"
        return None
    return check


def auto_or(names: Registry) -> Check:
    """'auto' or a name registered in `names`."""
    check = registered(names)
    return lambda value: None if value == "auto" else check(value)


def anything(value) -> None:
    del value
    return None


@dataclasses.dataclass(frozen=True)
class Field:
    """One config field: its default (whose type is the field's type), a one-line description,
    and the check of its value (run after the type check)."""

    default: Any
    description: str
    check: Check = anything


def is_section(value) -> bool:
    return isinstance(value, (ml_collections.ConfigDict, Mapping))


def suggest_field(path: str, known) -> str:
    """'; did you mean config.X?' for the closest known field path, or ''."""
    close = difflib.get_close_matches(path, list(known), n=1, cutoff=0.6)
    return f"; did you mean config.{close[0]}?" if close else ""


def type_name(value) -> str:
    return "None" if value is None else type(value).__name__


def type_problem(value, default) -> str | None:
    """What makes `value` unfit for a field whose default is `default`, or None."""
    got = f"got {value!r} ({type_name(value)})"
    if isinstance(default, bool):
        return None if isinstance(value, bool) else f"must be True or False, {got}"
    if isinstance(default, int):
        return (None if isinstance(value, int) and not isinstance(value, bool)
                else f"must be an integer, {got}")
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be a number, {got}"
        return None if math.isfinite(value) else f"must be finite, got {value!r}"
    if isinstance(default, str):
        return None if isinstance(value, str) else f"must be a string, {got}"
    if isinstance(default, tuple):
        if not isinstance(value, (tuple, list)) or not all(isinstance(v, str) for v in value):
            return f"must be a tuple of names, {got}"
        return None
    if isinstance(default, dict):
        return None if is_section(value) else f"must be a mapping, {got}"
    raise AssertionError(f"no type rule for the default {default!r}")
