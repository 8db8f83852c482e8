"""Orbax checkpoints of the training state: trainable params, optimizer state, step, RNG seed
and data position. Orbax writes each step into a temporary directory and renames it when
complete, so a run killed mid-save resumes from the last complete checkpoint.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

logger = logging.getLogger(__name__)


class TrainingCheckpoints:
    """Saves and restores (arrays pytree, JSON metadata) under `directory`.

    The arrays pytree is stored as its flat list of leaves; restoring unflattens them into the
    structure of a template (the freshly initialized state), so any pytree (nnx.State, optax
    states) round-trips exactly.
    """

    def __init__(self, directory: str, max_to_keep: int = 2):
        self.directory = os.path.abspath(directory)
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
            item_names=("arrays", "meta"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, arrays: Any, meta: dict) -> None:
        leaves = {f"{index:06d}": np.asarray(jax.device_get(leaf))
                  for index, leaf in enumerate(jax.tree_util.tree_leaves(arrays))}
        self.manager.save(step, args=ocp.args.Composite(
            arrays=ocp.args.StandardSave(leaves), meta=ocp.args.JsonSave(meta)))
        self.manager.wait_until_finished()

    def restore(self, template: Any, step: int | None = None) -> tuple[Any, dict]:
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        template_leaves, treedef = jax.tree_util.tree_flatten(template)
        abstract = {f"{index:06d}": np.zeros(np.shape(leaf), np.asarray(leaf).dtype)
                    for index, leaf in enumerate(template_leaves)}
        restored = self.manager.restore(step, args=ocp.args.Composite(
            arrays=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        leaves = restored["arrays"]
        if len(leaves) != len(template_leaves):
            raise ValueError(f"checkpoint step {step} in {self.directory} holds {len(leaves)} "
                             f"arrays, the configured model needs {len(template_leaves)}")
        values = []
        for index, leaf in enumerate(template_leaves):
            value = leaves[f"{index:06d}"]
            if np.shape(value) != np.shape(leaf):
                raise ValueError(f"checkpoint step {step}: array {index} has shape "
                                 f"{np.shape(value)}, the configured model needs "
                                 f"{np.shape(leaf)}")
            values.append(jax.numpy.asarray(value, dtype=np.asarray(leaf).dtype))
        return jax.tree_util.tree_unflatten(treedef, values), dict(restored["meta"])

    def close(self) -> None:
        self.manager.close()
