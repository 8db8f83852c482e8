"""A run directory's record and guards: run.json keeps every start's config (a list, never
overwritten), a resume may not silently change what is trained, and a fresh run never mixes
its files with an earlier run's.

run.json: {"starts": [{"config", "seed", "start_step", "resumed", "started_at", "git_revision",
"versions", "devices", "config_changes"}, ...]}; the last start's config is the current one.
Files of the older single-start form ({"config", "seed", ...}) read as one start.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any

from qerl_jax.infra.atomic_io import write_json_atomic
from qerl_jax.infra.errors import ConfigError
from qerl_jax.experiment_config import FIELDS, LOSS_TYPE_ALIASES

RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
# What a run writes besides the warm-up cache (which is keyed by its own settings and reused).
RUN_STATE = (RUN_FILE, METRICS_FILE, CHECKPOINTS, "checkpoints_damaged", "curves.png",
             "tensorboard")

# Fields that change how a run executes or is recorded, not what it trains: they may change
# on resume (and are recorded). Every other field is refused without allow_config_changes.
# Prefixes end with '.'.
HARMLESS_FIELDS = (
    "logging.", "checkpoint.", "eval.", "compilation_cache_dir", "xla_autotune_results",
    "rollout.offload_weights_for_compile", "rollout.offload_method", "rollout.dequantize_once",
    "rollout.shrink_min_rows",   # numerics only: the rows keep their keys at any batch size
    "quant.kernels.",
    "quant.kernels", "quant.gate_up_pairs",  # records that name the kernel choices without a section
    "model.attention_implementation", "model.attention_query_chunk",
    "model.remat", "train.micro_batch_size", "train.logits_chunk_size",
    "train.max_consecutive_nonfinite", "rewards.time_limit_seconds",
    "mesh.", "distributed.",   # a checkpoint restores onto any mesh
)


def _is_harmless(field: str) -> bool:
    return any(field == name or (name.endswith(".") and field.startswith(name))
               for name in HARMLESS_FIELDS)


def flatten_config(config: dict, prefix: str = "") -> dict[str, Any]:
    """{'a.b': value} for every leaf of a nested config dict (lists/tuples are leaves)."""
    flat: dict[str, Any] = {}
    for name, value in config.items():
        path = f"{prefix}{name}"
        if isinstance(value, dict) and value:
            flat.update(flatten_config(value, path + "."))
        else:
            flat[path] = value
    return flat


# Values that name the same thing: compared by what they mean, not how they are spelled.
_SAME_MEANING = {"loss.loss_type": LOSS_TYPE_ALIASES}


def _json_form(value):
    return json.loads(json.dumps(value))


def config_changes(old: dict, new: dict) -> list[dict]:
    """[{'field', 'old', 'new', 'harmless'}] for every leaf that differs (sorted by field);
    tuples and lists compare equal, as in a JSON round trip, and so do a loss type and its
    alias (bnpo and micro_batch_token_mean). A field the old config lacks (added to the schema
    since) is no change when the new value is its default."""
    old_flat = flatten_config(json.loads(json.dumps(old)))
    new_flat = flatten_config(json.loads(json.dumps(new)))
    for field, aliases in _SAME_MEANING.items():
        for flat in (old_flat, new_flat):
            if field in flat:
                flat[field] = aliases.get(flat[field], flat[field])
    missing = object()
    changes = []
    for field in sorted(set(old_flat) | set(new_flat)):
        before, after = old_flat.get(field, missing), new_flat.get(field, missing)
        if before is missing and field in FIELDS and after == _json_form(FIELDS[field].default):
            continue   # a field added since the run started, at the default it behaved as
        if before != after:
            changes.append({"field": field,
                            "old": None if before is missing else before,
                            "new": None if after is missing else after,
                            "harmless": _is_harmless(field)})
    return changes


def read_starts(workdir: str) -> list[dict]:
    """Every recorded start of the run in `workdir` (oldest first); [] without a run.json."""
    path = os.path.join(workdir, RUN_FILE)
    if not os.path.isfile(path):
        return []
    try:
        with open(path) as handle:
            record = json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: not valid JSON ({error}); move it aside to start over") \
            from None
    if isinstance(record, dict) and isinstance(record.get("starts"), list):
        return record["starts"]
    if isinstance(record, dict) and isinstance(record.get("config"), dict):
        return [record]
    raise ConfigError(f"{path}: neither a 'starts' list nor a 'config' object")


def current_config(workdir: str) -> dict:
    """The config dict of the run's last start."""
    path = os.path.join(workdir, RUN_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such file (not a run directory)")
    starts = read_starts(workdir)
    if not starts or not isinstance(starts[-1].get("config"), dict):
        raise ConfigError(f"{path}: its last start holds no config")
    return starts[-1]["config"]


def earlier_run_files(workdir: str) -> list[str]:
    """The names of an earlier run's files present in `workdir`."""
    present = []
    for name in RUN_STATE:
        path = os.path.join(workdir, name)
        if os.path.isfile(path) or (os.path.isdir(path) and os.listdir(path)):
            present.append(name)
    return present


def prepare_workdir(workdir: str, config_dict: dict, *, resume: bool, overwrite: bool,
                    allow_config_changes: bool) -> list[dict]:
    """Checks `workdir` before any work: a fresh run into a directory holding an earlier run is
    refused unless `overwrite` (then the earlier run's files are removed; the warm-up cache
    stays); a resume whose config changes a field that changes what is trained is refused with
    one line per field unless `allow_config_changes`. Returns the changes against the last
    start (to record)."""
    present = earlier_run_files(workdir)
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite exclude each other")
    if not resume:
        if present and not overwrite:
            raise ConfigError(f"{workdir} holds an earlier run ({', '.join(present)}): pass "
                              "--resume to continue it or --overwrite to replace it")
        for name in present:
            path = os.path.join(workdir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        return []
    starts = read_starts(workdir)
    if not starts:
        return []
    changes = config_changes(starts[-1]["config"], config_dict)
    refused = [change for change in changes if not change["harmless"]]
    if refused and not allow_config_changes:
        lines = [f"config.{c['field']}: was {c['old']!r} in the run being resumed, now "
                 f"{c['new']!r}" for c in refused]
        raise ConfigError("\n".join(lines) + "\nthese change what is trained: restore them, "
                          "or pass --allow_config_change to resume with them (recorded in "
                          "run.json)")
    return changes


def record_start(workdir: str, start: dict) -> None:
    """Appends one start to run.json (atomically: the file is replaced, never half-written)."""
    starts = read_starts(workdir)
    entry = dict(start)
    entry.setdefault("started_at", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    write_json_atomic(os.path.join(workdir, RUN_FILE), {"starts": starts + [entry]}, indent=1)
