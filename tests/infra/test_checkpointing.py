"""Checkpoints: the newest one that restores wins, damaged ones are skipped with one warning
naming their path and moved aside (never deleted); none restoring is one line."""

import os
import shutil

import numpy as np
import pytest

from qerl_jax.infra.checkpointing import (DAMAGED_DIRECTORY, CheckpointMismatch,
                                          TrainingCheckpoints)
from qerl_jax.infra.errors import TrainingStopped


def _state(value):
    return {"a": np.full((4, 3), value, np.float32), "b": np.arange(5, dtype=np.int32) + value}


def _saved(tmp_path, steps=(1, 2)):
    directory = str(tmp_path / "checkpoints")
    checkpoints = TrainingCheckpoints(directory, max_to_keep=3)
    for step in steps:
        checkpoints.save(step, _state(step), {"step": step})
    checkpoints.close()
    return directory


def _truncate_files(root):
    for folder, _, files in os.walk(root):
        for name in files:
            open(os.path.join(folder, name), "w").close()


@pytest.mark.parametrize("damage", [
    lambda step_dir: shutil.rmtree(os.path.join(step_dir, "arrays")),
    lambda step_dir: _truncate_files(os.path.join(step_dir, "arrays")),
    lambda step_dir: open(os.path.join(step_dir, "meta", "metadata"), "w").write("{bad"),
], ids=["arrays_missing", "arrays_truncated", "meta_not_json"])
def test_restore_falls_back_past_a_damaged_newest_checkpoint(tmp_path, caplog, damage):
    directory = _saved(tmp_path)
    damage(os.path.join(directory, "2"))
    checkpoints = TrainingCheckpoints(directory, max_to_keep=3)
    with caplog.at_level("WARNING"):
        arrays, meta, step = checkpoints.restore_newest(_state(0))
    assert step == 1 and meta["step"] == 1
    np.testing.assert_array_equal(arrays["a"], _state(1)["a"])
    skipped = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
    assert len(skipped) == 1 and os.path.join(directory, "2") in skipped[0]
    assert "\n" not in skipped[0]
    moved = os.listdir(os.path.join(os.path.dirname(directory), DAMAGED_DIRECTORY))
    assert len(moved) == 1 and moved[0].startswith("2-")
    assert checkpoints.all_steps() == [1]
    checkpoints.save(2, _state(5), {"step": 2})          # the step can be written again
    assert checkpoints.restore(_state(0), 2)[1]["step"] == 2


def test_a_shape_mismatch_is_refused_and_nothing_moved(tmp_path):
    """An intact checkpoint that does not fit the template (the config changed) is no damage:
    one line naming the checkpoint, the array and both shapes; nothing is moved aside."""
    directory = _saved(tmp_path, steps=(1, 2))
    checkpoints = TrainingCheckpoints(directory)
    with pytest.raises(CheckpointMismatch) as refused:
        checkpoints.restore_newest({"a": np.zeros((2, 2), np.float32),
                                    "b": np.zeros(5, np.int32)})
    assert str(refused.value) == (f"checkpoint {os.path.join(directory, '2')} does not fit the "
                                  "configured run: array 0 (a) has shape (4, 3), the configured "
                                  "run needs (2, 2)")
    with pytest.raises(CheckpointMismatch, match="holds 2 arrays, the configured run needs 1"):
        checkpoints.restore_newest({"a": np.zeros((4, 3), np.float32)})
    assert sorted(os.listdir(directory)) == ["1", "2"]
    assert not os.path.exists(os.path.join(os.path.dirname(directory), DAMAGED_DIRECTORY))


def test_none_restoring_is_one_line_naming_each(tmp_path):
    directory = _saved(tmp_path)
    for step in (1, 2):
        shutil.rmtree(os.path.join(directory, str(step), "arrays"))
    with pytest.raises(TrainingStopped) as stopped:
        TrainingCheckpoints(directory).restore_newest(_state(0))
    message = str(stopped.value)
    assert "\n" not in message
    assert os.path.join(directory, "2") in message and os.path.join(directory, "1") in message


def test_no_checkpoint_is_none(tmp_path):
    assert TrainingCheckpoints(str(tmp_path / "empty")).restore_newest(_state(0)) is None
