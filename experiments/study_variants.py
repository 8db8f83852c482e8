"""A study's columns: the "format" string that names one, the config fields it sets, and the
same name read back from a run's recorded config.

    <weight format>[+aqn][+<objective>][+<correction>][+<estimator>]     e.g. nvfp4+aqn+gspo

The first part is a weight format (registry.FORMATS); `aqn` turns AQN on (the config's aqn.*
schedule); each further part is looked up in the registry that holds it (AXES below:
POLICY_OBJECTIVES, ROLLOUT_CORRECTIONS, ADVANTAGE_ESTIMATORS), so any registered name, a
plug-in's included, is a study column. A part the format does not name is set to the schema's
default, so a study's columns differ only in what they name. `tis` is the study's alias of the
correction token_truncate with the cap at TIS_CAP (TRL's and verl's truncated importance
sampling); a run with that correction and cap reads back as `+tis`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from qerl_jax import registry

AQN = "aqn"
TIS = "tis"
TIS_CORRECTION = "token_truncate"
TIS_CAP = 2.0
CORRECTION_CAP_FIELD = "loss.rollout_correction_cap"
# the committed studies' run.json files record token truncation as this cap (> 0: on)
LEGACY_TIS_CAP_FIELD = "loss.rollout_is_cap"
GRAMMAR = "<weight format>[+aqn][+<objective>][+<correction>][+<estimator>]"


@dataclasses.dataclass(frozen=True)
class Axis:
    """A kind of '+' part: the config field it sets and the qerl_jax.registry attribute holding
    its names."""
    kind: str
    field: str
    registry: str


# in grammar order
AXES = (Axis("objective", "loss.policy_objective", "POLICY_OBJECTIVES"),
        Axis("correction", "loss.rollout_correction", "ROLLOUT_CORRECTIONS"),
        Axis("estimator", "loss.advantage_estimator", "ADVANTAGE_ESTIMATORS"))
ORDER = (AQN, *(axis.kind for axis in AXES))


@dataclasses.dataclass(frozen=True)
class Variant:
    """One study column: a weight format, AQN on or off, and the named axis parts."""
    weight_format: str
    aqn: bool = False
    parts: tuple[tuple[str, str], ...] = ()   # (axis kind, name as written), grammar order

    @property
    def name(self) -> str:
        """The format string: 'nvfp4+aqn+gspo'."""
        return "+".join([self.weight_format, *([AQN] if self.aqn else []),
                         *(part for _, part in self.parts)])


def _schema_defaults() -> dict:
    from qerl_jax.experiment_config import field_defaults

    return field_defaults()


def _axes() -> list[tuple[Axis, registry.Registry]]:
    """Each axis with its registry (read when asked: plug-ins' names included)."""
    return [(axis, getattr(registry, axis.registry)) for axis in AXES]


def known_parts() -> str:
    """'aqn, tis; policy objective: a, b; ...': every name a '+' part can take."""
    return "; ".join([f"{AQN}, {TIS}"] + [
        f"{names.kind}: {', '.join(names.names(with_aliases=True))}" for _, names in _axes()])


def _kinds_of(part: str) -> list[str]:
    kinds = [AQN] if part == AQN else ["correction"] if part == TIS else []
    return kinds + [axis.kind for axis, names in _axes() if part in names]


def parse_variant(name: str) -> Variant:
    """The Variant a study format names; ValueError (one line naming the part and the known
    names) for an unknown, ambiguous, repeated or misplaced part."""
    weight_format, *parts = name.split("+")
    if weight_format not in registry.FORMATS:
        raise ValueError(f"format {name!r}: {registry.FORMATS.unknown_message(weight_format)}")
    aqn, named, last = False, [], -1
    for part in parts:
        kinds = _kinds_of(part)
        if not kinds:
            raise ValueError(f"format {name!r}: unknown part {part!r}; known: {known_parts()}")
        if len(kinds) > 1:
            raise ValueError(f"format {name!r}: part {part!r} is ambiguous (a name of "
                             f"{' and '.join(kinds)})")
        position = ORDER.index(kinds[0])
        if position <= last:
            raise ValueError(f"format {name!r}: part {part!r} repeats a kind or is out of "
                             f"order; formats read {GRAMMAR}")
        last = position
        if kinds[0] == AQN:
            aqn = True
        else:
            named.append((kinds[0], part))
    return Variant(weight_format, aqn, tuple(named))


def format_overrides(name: str) -> dict[str, object]:
    """Config fields (dotted path -> value) that select study format `name`: quant.format,
    aqn.enabled and every axis field, at the named choice or the schema's default; `+tis` also
    sets the correction cap to TIS_CAP."""
    defaults = _schema_defaults()
    variant = parse_variant(name)
    named = dict(variant.parts)
    overrides: dict[str, object] = {"quant.format": variant.weight_format,
                                    "aqn.enabled": variant.aqn}
    for axis, names in _axes():
        part = named.get(axis.kind)
        if part is None:
            overrides[axis.field] = defaults[axis.field]
        elif axis.kind == "correction" and part == TIS:
            overrides[axis.field] = TIS_CORRECTION
            overrides[CORRECTION_CAP_FIELD] = TIS_CAP
        else:
            overrides[axis.field] = names.canonical(part)
    return overrides


def _recorded(config: Mapping, path: str):
    """The value at dotted `path` of a recorded config dict; None where it was not recorded."""
    value = config
    for key in path.split("."):
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    return value


def variant_of_config(config: Mapping) -> Variant:
    """The Variant of a recorded config dict (run.json's 'config'): quant.format, AQN on, and
    each axis field recorded at a value other than the schema's default (a field the run did
    not record is at its default)."""
    defaults = _schema_defaults()
    parts = []
    for axis in AXES:
        value = _recorded(config, axis.field)
        if axis.kind == "correction":
            cap = _recorded(config, CORRECTION_CAP_FIELD)
            if value == TIS_CORRECTION and cap == TIS_CAP:
                value = TIS
            elif value is None and (_recorded(config, LEGACY_TIS_CAP_FIELD) or 0) > 0:
                value = TIS
        if value is not None and value != defaults[axis.field]:
            parts.append((axis.kind, value))
    return Variant(config["quant"]["format"], bool(_recorded(config, "aqn.enabled")),
                   tuple(parts))


def format_of_config(config: Mapping) -> str:
    """The study format name of a recorded config dict: 'nvfp4+aqn+gspo'."""
    return variant_of_config(config).name


def format_directory_name(name: str) -> str:
    """File-system name of a format: 'nvfp4+aqn' -> 'nvfp4_aqn'."""
    return name.replace("+", "_")
