"""Orbax checkpoints of the training state: trainable params, optimizer state, step, RNG seed
and data position, written only at step boundaries.

Orbax writes each step into a temporary directory and renames it when complete, so a run killed
mid-save resumes from the last complete checkpoint. Restoring falls back from a damaged newest
checkpoint to the newest one that restores (the damaged one is moved aside, never deleted); an
intact one that does not fit the configured run is refused, not moved; a failed write (a full
disk) is one error naming the path, with the earlier checkpoints intact.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from qerl_jax.infra.errors import StorageError, TrainingStopped

logger = logging.getLogger(__name__)

DAMAGED_DIRECTORY = "checkpoints_damaged"   # next to the checkpoints directory


@contextlib.contextmanager
def _quiet_orbax():
    """Orbax logs a failed write or read as tens to hundreds of absl ERROR lines with tracebacks
    (and asyncio its abandoned tasks) before it raises; the caller reports the failure itself,
    in one line. Closed-event-loop reports of its leftover threads are dropped from then on."""
    _drop_closed_event_loop_reports()
    loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]
    levels = [logger_.level for logger_ in loggers]
    for logger_ in loggers:
        logger_.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for logger_, level in zip(loggers, levels):
            logger_.setLevel(level)


def _drop_closed_event_loop_reports() -> None:
    """After a failed write or read, tensorstore's pending operations complete on threads whose
    asyncio loop orbax already closed: each reports 'Event loop is closed' (hundreds on a full
    disk), burying the one line that says what failed. Those, and only those, are dropped; the
    hook in place handles every other report."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_closed_event_loop", False):
        return

    def hook(unraisable) -> None:
        value = unraisable.exc_value
        if isinstance(value, RuntimeError) and str(value) == "Event loop is closed":
            return
        previous(unraisable)
    hook.drops_closed_event_loop = True
    sys.unraisablehook = hook


def _first_line(error: BaseException) -> str:
    text = str(error)
    if "No space left on device" in text or "os_error_code='28'" in text:
        return "no space left on device"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    reason = lines[0] if lines else ""
    reason = f"{type(error).__name__}: {reason}" if reason else type(error).__name__
    return reason if len(reason) <= 200 else reason[:197] + "..."


def _on_many_devices(leaf) -> bool:
    """A jax.Array placed on a device mesh (saved and restored shard by shard)."""
    return isinstance(leaf, jax.Array) and len(leaf.sharding.device_set) > 1


def _restore_target(leaf):
    """What orbax restores a template leaf as: a mesh-placed array onto the template's
    sharding (whatever mesh the checkpoint was written from), anything else as numpy."""
    if _on_many_devices(leaf):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
    return np.zeros(np.shape(leaf), np.asarray(leaf).dtype)


class CheckpointMismatch(ValueError):
    """An intact checkpoint that does not fit the configured run (other shapes, another number
    of arrays, another seed): the config changed, the checkpoint is not damaged."""


def _leaf_name(path) -> str:
    """'trainable/layers/0/mlp/up_proj/lora_a' for a pytree key path."""
    parts = []
    for key in path:
        for attribute in ("key", "idx", "name"):
            if hasattr(key, attribute):
                parts.append(str(getattr(key, attribute)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def check_resume_meta(meta: dict, seed: int) -> None:
    """ValueError unless a checkpoint's metadata fits a run of `seed`: the same seed
    (CheckpointMismatch otherwise) and a data_position [epoch, index]."""
    if meta.get("seed") != seed:
        raise CheckpointMismatch(f"its seed {meta.get('seed')} != config.seed {seed}")
    position = meta.get("data_position")
    if not (isinstance(position, list) and len(position) == 2):
        raise ValueError(f"its data_position {position!r} is not [epoch, index]")


class TrainingCheckpoints:
    """Saves and restores (arrays pytree, JSON metadata) under `directory`.

    The arrays pytree is stored as its flat list of leaves; restoring unflattens them into the
    structure of a template (the freshly initialized state), so any pytree (nnx.State, optax
    states) round-trips exactly. Arrays on a device mesh are written shard by shard (each
    process its own) and restored onto the template's shardings, so a checkpoint written on
    one mesh (or one device) restores onto another.
    """

    def __init__(self, directory: str, max_to_keep: int = 2, *, read_only: bool = False):
        self.directory = os.path.abspath(directory)
        self.max_to_keep = max_to_keep
        self.read_only = read_only
        self.manager = self._open()

    def _open(self) -> ocp.CheckpointManager:
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self.max_to_keep, create=not self.read_only,
            read_only=self.read_only, cleanup_tmp_directories=not self.read_only)
        with _quiet_orbax():
            return ocp.CheckpointManager(self.directory, options=options,
                                         item_names=("arrays", "meta"))

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps()) if os.path.isdir(self.directory) else []

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def step_path(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def save(self, step: int, arrays: Any, meta: dict) -> None:
        """Writes step `step` and waits until it is complete; TrainingStopped naming the path
        when it cannot be written (the partial write is removed, earlier steps stay)."""
        leaves = {f"{index:06d}": leaf if _on_many_devices(leaf)
                  else np.asarray(jax.device_get(leaf))
                  for index, leaf in enumerate(jax.tree_util.tree_leaves(arrays))}
        try:
            with _quiet_orbax():
                self.manager.save(step, args=ocp.args.Composite(
                    arrays=ocp.args.StandardSave(leaves), meta=ocp.args.JsonSave(meta)),
                    force=True)
                self.manager.wait_until_finished()
        except Exception as error:   # orbax/tensorstore raise ValueError for an OS failure
            self._remove_partial(step)
            steps = self.all_steps()
            kept = (f"checkpoints of steps {steps} are intact" if steps
                    else "no earlier checkpoint")
            raise StorageError(f"could not write checkpoint {self.step_path(step)}: "
                               f"{_first_line(error)}; {kept}") from error
        if self.latest_step() != step:
            raise TrainingStopped(f"checkpoint {self.step_path(step)} was not written")

    def _remove_partial(self, step: int) -> None:
        """Removes the failed write's temporary directory (its background writers may still be
        finishing: a few tries), freeing the space it took."""
        for _ in range(10):
            partial = [os.path.join(self.directory, name)
                       for name in (os.listdir(self.directory)
                                    if os.path.isdir(self.directory) else ())
                       if name.startswith(f"{step}.orbax-checkpoint-tmp")]
            if not partial:
                break
            for path in partial:
                shutil.rmtree(path, ignore_errors=True)
            time.sleep(0.2)
        with contextlib.suppress(Exception):
            self.manager.reload()

    def _saved_shapes(self, step: int) -> dict[str, tuple] | None:
        """{leaf key: shape} from checkpoint `step`'s array metadata (no array is read); None
        when the metadata does not read (damage, found by the restore itself)."""
        try:
            with _quiet_orbax():
                metadata = ocp.StandardCheckpointer().metadata(
                    os.path.join(self.step_path(step), "arrays"))
            tree = getattr(metadata, "item_metadata", metadata)
            tree = getattr(tree, "tree", tree)
            return {key: tuple(value.shape) for key, value in dict(tree).items()}
        except Exception:   # any damage or another orbax's metadata layout
            return None

    def _check_fits(self, step: int, paths_and_leaves: list) -> None:
        """CheckpointMismatch when checkpoint `step` holds another number of arrays or other
        shapes than the template's leaves (the config changed)."""
        shapes = self._saved_shapes(step)
        if shapes is None:
            return
        if len(shapes) != len(paths_and_leaves):
            raise CheckpointMismatch(f"it holds {len(shapes)} arrays, the configured run "
                                     f"needs {len(paths_and_leaves)}")
        for index, (path, leaf) in enumerate(paths_and_leaves):
            saved = shapes.get(f"{index:06d}")
            if saved is not None and saved != tuple(np.shape(leaf)):
                raise CheckpointMismatch(
                    f"array {index} ({_leaf_name(path)}) has shape {saved}, the configured "
                    f"run needs {tuple(np.shape(leaf))}")

    def restore(self, template: Any, step: int | None = None) -> tuple[Any, dict]:
        """(arrays shaped like `template`, meta) of checkpoint `step`; raises on any failure."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
        template_leaves = [leaf for _, leaf in paths_and_leaves]
        self._check_fits(step, paths_and_leaves)
        abstract = {f"{index:06d}": _restore_target(leaf)
                    for index, leaf in enumerate(template_leaves)}
        with _quiet_orbax():
            restored = self.manager.restore(step, args=ocp.args.Composite(
                arrays=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        leaves = restored["arrays"]
        if len(leaves) != len(template_leaves):
            raise CheckpointMismatch(f"it holds {len(leaves)} arrays, the configured run "
                                     f"needs {len(template_leaves)}")
        values = []
        for index, leaf in enumerate(template_leaves):
            value = leaves[f"{index:06d}"]
            if np.shape(value) != np.shape(leaf):
                raise CheckpointMismatch(
                    f"array {index} ({_leaf_name(paths_and_leaves[index][0])}) has shape "
                    f"{np.shape(value)}, the configured run needs {np.shape(leaf)}")
            values.append(value if _on_many_devices(leaf)
                          else jax.numpy.asarray(value, dtype=np.asarray(leaf).dtype))
        meta = restored["meta"]
        if not isinstance(meta, dict) or meta.get("step") != step:
            raise ValueError(f"its metadata names step {getattr(meta, 'get', dict().get)('step')}")
        return jax.tree_util.tree_unflatten(treedef, values), dict(meta)

    def restore_newest(self, template: Any, check=None) -> tuple[Any, dict, int] | None:
        """The newest checkpoint that restores: (arrays, meta, step), or None when there are no
        checkpoints. A checkpoint that fails to restore (or `check(meta)` rejects with a
        ValueError) is skipped with one warning naming its path and why, and, unless read-only,
        moved aside to checkpoints_damaged/ so a later save of that step is not refused. When
        checkpoints exist and none restores: TrainingStopped listing each. An intact
        checkpoint that does not fit the template or `check` (CheckpointMismatch: the config
        changed) is not damage: it propagates, naming the checkpoint, and nothing is moved."""
        steps = self.all_steps()
        if not steps:
            return None
        failures = []
        for step in reversed(steps):
            try:
                arrays, meta = self.restore(template, step)
                if check is not None:
                    check(meta)
                return arrays, meta, step
            except CheckpointMismatch as error:
                raise CheckpointMismatch(f"checkpoint {self.step_path(step)} does not fit the "
                                         f"configured run: {error}") from None
            except Exception as error:   # any damage: missing files, bad JSON, torn arrays
                reason = _first_line(error)
                failures.append(f"{self.step_path(step)} ({reason})")
                logger.warning("skipping checkpoint %s: %s", self.step_path(step), reason)
                if not self.read_only:
                    self._move_aside(step)
        raise TrainingStopped("no checkpoint restores: " + "; ".join(failures))

    def _move_aside(self, step: int) -> None:
        target_root = os.path.join(os.path.dirname(self.directory), DAMAGED_DIRECTORY)
        os.makedirs(target_root, exist_ok=True)
        target = os.path.join(target_root, f"{step}-{time.strftime('%Y%m%dT%H%M%S')}")
        shutil.move(self.step_path(step), target)
        logger.warning("moved the damaged checkpoint %s to %s", self.step_path(step), target)
        self.manager.reload()

    def close(self) -> None:
        with _quiet_orbax(), contextlib.suppress(Exception):
            self.manager.close()
