"""A run directory's record and guards: run.json keeps every start's config (a list, never
overwritten), a resume may not silently change what is trained or silently start over, and a
fresh run never mixes its files with an earlier run's (they are moved aside, never deleted).

run.json: {"starts": [{"config", "seed", "start_step", "resumed", "started_at", "git_revision",
"versions", "devices", "config_changes"}, ...]}; the last start's config is the current one.
Files of the older single-start form ({"config", "seed", ...}) read as one start.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Mapping

from qerl_jax.infra.atomic_io import storage_errors, write_json_atomic
from qerl_jax.infra.errors import ConfigError
from qerl_jax.registry import LOSS_NORMALIZERS

RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"       # infra.samples' records
WANDB_RUN_FILE = "wandb_run.json"    # infra.wandb_logging: the W&B run a resume continues
WANDB_DIRECTORY = "wandb"            # W&B's own files (wandb.init's dir is the run's)
CHECKPOINTS = "checkpoints"
# What a run writes besides the warm-up cache (which is keyed by its own settings and reused).
RUN_STATE = (RUN_FILE, METRICS_FILE, CHECKPOINTS, "checkpoints_damaged", "curves.png",
             "tensorboard", SAMPLES_FILE, WANDB_RUN_FILE, WANDB_DIRECTORY)
REPLACED_PREFIX = "replaced-"   # + UTC time: an earlier run's files, moved aside by a new start

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
_SAME_MEANING = {"loss.loss_type": LOSS_NORMALIZERS.aliases()}


def _legacy_fields(flat: dict[str, Any]) -> None:
    """Rewrites, in place, the fields of an older schema in a flattened recorded config into
    the fields that compute the same: loss.rollout_is_cap (0 = off) is the token_truncate
    rollout correction with that cap."""
    if "loss.rollout_is_cap" in flat:
        cap = flat.pop("loss.rollout_is_cap")
        flat.setdefault("loss.rollout_correction", "token_truncate" if cap else "none")
        if cap:
            flat.setdefault("loss.rollout_correction_cap", cap)


def _json_form(value):
    return json.loads(json.dumps(value))


def config_changes(old: dict, new: dict, defaults: Mapping[str, Any] | None = None) -> list[dict]:
    """[{'field', 'old', 'new', 'harmless'}] for every leaf that differs (sorted by field);
    tuples and lists compare equal, as in a JSON round trip, and so do a loss type and its
    alias (bnpo and micro_batch_token_mean), and a field of an older schema and the fields
    that replaced it (_legacy_fields). A field the old config lacks (added to the schema
    since) is no change when the new value is its default in `defaults` (field path -> the
    schema's default, experiment_config.field_defaults())."""
    defaults = defaults or {}
    old_flat = flatten_config(json.loads(json.dumps(old)))
    new_flat = flatten_config(json.loads(json.dumps(new)))
    _legacy_fields(old_flat)
    for field, aliases in _SAME_MEANING.items():
        for flat in (old_flat, new_flat):
            if field in flat:
                flat[field] = aliases.get(flat[field], flat[field])
    missing = object()
    changes = []
    for field in sorted(set(old_flat) | set(new_flat)):
        before, after = old_flat.get(field, missing), new_flat.get(field, missing)
        if before is missing and field in defaults and after == _json_form(defaults[field]):
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


def checkpoint_steps(workdir: str) -> list[int]:
    """The steps of the complete checkpoints under `workdir`/checkpoints (orbax names each
    complete step's directory by its number)."""
    directory = os.path.join(workdir, CHECKPOINTS)
    if not os.path.isdir(directory):
        return []
    return sorted(int(name) for name in os.listdir(directory)
                  if name.isdigit() and os.path.isdir(os.path.join(directory, name)))


def check_workdir_path(workdir: str) -> None:
    """ConfigError naming the path unless `workdir` is, or can be created as, a writable
    directory (read-only: nothing is created)."""
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ConfigError(f"--workdir {workdir}: exists and is not a directory")
    existing = workdir
    while not os.path.exists(existing):
        parent = os.path.dirname(existing)
        if parent == existing:
            break
        existing = parent
    if not os.path.isdir(existing):
        raise ConfigError(f"--workdir {workdir}: cannot be created, {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--workdir {workdir}: {existing} is not writable")


@dataclasses.dataclass(frozen=True)
class WorkdirPlan:
    """What a start does to its run directory: the config changes against the last start (to
    record) and the earlier run's files it moves into a replaced-<UTC time>/ folder."""

    config_changes: list
    move_aside: tuple[str, ...] = ()


def check_workdir(workdir: str, config_dict: dict, *, resume: bool, overwrite: bool,
                  allow_config_changes: bool, restart: bool = False,
                  defaults: Mapping[str, Any] | None = None) -> WorkdirPlan:
    """Checks `workdir` before any work and touches nothing (ConfigError, one line, when the
    start is refused):
      - a fresh run into a directory holding an earlier run is refused unless `overwrite`
        (which moves the earlier run's files aside; the warm-up cache stays);
      - a resume with no complete checkpoint into a directory holding metrics or moved-aside
        checkpoints is refused unless `restart` (start over at step 0, the earlier files moved
        aside);
      - a resume whose config changes a field that changes what is trained is refused with
        one line per field unless `allow_config_changes`."""
    check_workdir_path(workdir)
    present = tuple(earlier_run_files(workdir))
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite exclude each other")
    if restart and not resume:
        raise ConfigError("--restart goes with --resume (a fresh run replaces an earlier one "
                          "with --overwrite)")
    if not resume:
        if present and not overwrite:
            raise ConfigError(f"{workdir} holds an earlier run ({', '.join(present)}): pass "
                              "--resume to continue it or --overwrite to replace it (the "
                              "earlier files are moved into replaced-<time>/)")
        return WorkdirPlan([], present)
    if not checkpoint_steps(workdir):
        leftovers = [name for name in present if name != RUN_FILE]
        if leftovers and not restart:
            raise ConfigError(
                f"{workdir}: --resume found no checkpoint in {os.path.join(workdir, CHECKPOINTS)}"
                f" to continue from, but the run left {', '.join(leftovers)}: pass --restart "
                "to start over at step 0 (the earlier files are moved into replaced-<time>/)")
        if leftovers:
            return WorkdirPlan([], present)
    starts = read_starts(workdir)
    if not starts:
        return WorkdirPlan([])
    changes = config_changes(starts[-1]["config"], config_dict, defaults)
    refused = [change for change in changes if not change["harmless"]]
    if refused and not allow_config_changes:
        lines = [f"config.{c['field']}: was {c['old']!r} in the run being resumed, now "
                 f"{c['new']!r}" for c in refused]
        raise ConfigError("\n".join(lines) + "\nthese change what is trained: restore them, "
                          "or pass --allow_config_change to resume with them (recorded in "
                          "run.json)")
    return WorkdirPlan(changes)


def changes_note(changes: list[dict]) -> str:
    """What a resume changed that changes what is trained, in one clause: the reason an intact
    checkpoint does not fit."""
    changed = [f"config.{c['field']} {c['old']!r} -> {c['new']!r}" for c in changes
               if not c["harmless"]]
    if not changed:
        return "no config field changed since the run being resumed"
    return (f"changed since the run being resumed: {', '.join(changed)} (resume with the "
            "earlier values, or start a new run in another --workdir)")


def move_aside(workdir: str, names: tuple[str, ...]) -> str | None:
    """Moves the earlier run's files `names` of `workdir` into `workdir`/replaced-<UTC time>/
    (never deleting anything) and returns that folder; None when there is nothing to move."""
    if not names:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = os.path.join(workdir, f"{REPLACED_PREFIX}{stamp}")
    suffix = 1
    while os.path.exists(target):
        suffix += 1
        target = os.path.join(workdir, f"{REPLACED_PREFIX}{stamp}-{suffix}")
    with storage_errors(target, "move the earlier run's files into"):
        os.makedirs(target)
        for name in names:
            os.rename(os.path.join(workdir, name), os.path.join(target, name))
    return target


def prepare_workdir(workdir: str, config_dict: dict, *, resume: bool, overwrite: bool,
                    allow_config_changes: bool, restart: bool = False,
                    defaults: Mapping[str, Any] | None = None) -> list[dict]:
    """check_workdir, then the earlier run's files moved aside: the config changes (to
    record)."""
    plan = check_workdir(workdir, config_dict, resume=resume, overwrite=overwrite,
                         allow_config_changes=allow_config_changes, restart=restart,
                         defaults=defaults)
    move_aside(workdir, plan.move_aside)
    return plan.config_changes


def record_start(workdir: str, start: dict) -> None:
    """Appends one start to run.json (atomically: the file is replaced, never half-written)."""
    starts = read_starts(workdir)
    entry = dict(start)
    entry.setdefault("started_at", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    write_json_atomic(os.path.join(workdir, RUN_FILE), {"starts": starts + [entry]}, indent=1)
