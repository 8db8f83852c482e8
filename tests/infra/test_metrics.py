"""metrics.jsonl: strict JSON, cut back to the resumed step on every start, a torn last line
dropped with one warning naming the file, never a duplicate step."""

import json
import math
import os

import pytest

from qerl_jax.infra.errors import ConfigError
from qerl_jax.infra.metrics import MetricsWriter, read_metrics


def _lines(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as handle:
        return handle.read().splitlines()


def test_non_finite_values_are_written_as_null(tmp_path):
    writer = MetricsWriter(str(tmp_path))
    writer.start(0)
    writer.write({"step": 0, "accuracy": float("nan"), "loss": float("inf"), "reward": 0.5})
    line = _lines(tmp_path)[0]
    assert "NaN" not in line and "Infinity" not in line
    row = json.loads(line, parse_constant=lambda name: pytest.fail(f"bare {name}"))
    assert row == {"step": 0, "accuracy": None, "loss": None, "reward": 0.5}


def test_start_cuts_back_to_the_resumed_step_and_a_fresh_start_empties(tmp_path):
    writer = MetricsWriter(str(tmp_path))
    writer.start(0)
    for step in range(5):
        writer.write({"step": step, "reward": float(step)})
    writer.start(3)
    assert [row["step"] for row in read_metrics(str(tmp_path))] == [0, 1, 2]
    writer.write({"step": 3, "reward": 3.0})
    assert [row["step"] for row in read_metrics(str(tmp_path))] == [0, 1, 2, 3]
    writer.start(0)
    assert _lines(tmp_path) == []


def test_a_torn_last_line_is_dropped_with_one_warning(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "reward": 1.0}\n{"step": 1, "reward": 2.0}\n{"step": 2, "rew')
    assert [row["step"] for row in read_metrics(str(tmp_path))] == [0, 1]
    writer = MetricsWriter(str(tmp_path))
    with caplog.at_level("WARNING"):
        writer.start(2)
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1 and str(path) in warnings[0] and "torn" in warnings[0]
    assert [json.loads(line)["step"] for line in _lines(tmp_path)] == [0, 1]


def test_damage_before_the_last_line_names_the_file_and_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\nnot json\n{"step": 2}\n')
    with pytest.raises(ConfigError, match=r"metrics.jsonl:2: not a metrics row"):
        MetricsWriter(str(tmp_path)).start(1)


def test_tensorboard_event_files_by_default_when_installed(tmp_path):
    pytest.importorskip("tensorboardX")
    writer = MetricsWriter(str(tmp_path), tensorboard=True)
    writer.start(0)
    writer.write({"step": 0, "reward": 0.5, "accuracy": math.nan})
    writer.close()
    events = os.listdir(tmp_path / "tensorboard")
    assert any(name.startswith("events.out.tfevents") for name in events)


def _full_disk(monkeypatch, module):
    """open() for writing in `module` fails with ENOSPC, as on a full disk."""
    import builtins
    import errno

    def full_open(path, mode="r", *args, **kwargs):
        if mode[0] in "wa":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))   # no path, as write() says
        return builtins.open(path, mode, *args, **kwargs)
    monkeypatch.setattr(module, "open", full_open, raising=False)


def test_a_full_disk_is_one_error_naming_the_file_which_stays_intact(tmp_path, monkeypatch):
    from qerl_jax.infra import atomic_io, metrics
    from qerl_jax.infra.errors import StorageError

    writer = MetricsWriter(str(tmp_path))
    writer.start(0)
    writer.write({"step": 0, "reward": 0.5})
    writer.write({"step": 1, "reward": 0.25})
    before = _lines(tmp_path)
    path = os.path.join(tmp_path, "metrics.jsonl")
    _full_disk(monkeypatch, metrics)
    with pytest.raises(StorageError) as append:
        writer.write({"step": 2, "reward": 0.0})
    _full_disk(monkeypatch, atomic_io)
    with pytest.raises(StorageError) as start:
        MetricsWriter(str(tmp_path)).start(1)
    for error in (append.value, start.value):
        assert str(error) == f"could not write {path}: no space left on device"
        assert error.exit_code == 2
    assert _lines(tmp_path) == before
    assert os.listdir(tmp_path) == ["metrics.jsonl"]   # no temporary file left


def _rows(rewards, entropy=None):
    return [{"step": step, "reward": reward, "accuracy": reward / 2,
             "entropy": None if entropy is None else entropy(step)}
            for step, reward in enumerate(rewards)]


def test_run_summary_gives_the_means_of_the_first_and_last_tenth():
    import numpy as np

    from qerl_jax.infra.metrics import run_summary

    rewards = np.random.default_rng(0).random(100)
    rows = _rows(rewards.tolist(), entropy=lambda step: None if step == 95 else 1.0 + step)
    rows.append({"step": 100, "eval/pass@1": 0.5})   # an evaluation row: not a step
    entropies = [1.0 + step for step in range(90, 100) if step != 95]
    expected = (f"steps 0..99: reward {rewards[:10].mean():.3f} -> {rewards[90:].mean():.3f}, "
                f"accuracy {rewards[:10].mean() / 2:.3f} -> {rewards[90:].mean() / 2:.3f}, "
                f"entropy {np.mean(np.arange(10) + 1.0):.3f} -> {np.mean(entropies):.3f} "
                "(means over steps 0-9 and 90-99)")
    assert run_summary(rows) == expected
    assert run_summary(_rows([0.0, 1.0, 0.5, 0.5, 0.25])) == (
        "steps 0..4: reward 0.000 -> 0.250, accuracy 0.000 -> 0.125, entropy n/a -> n/a "
        "(means over steps 0 and 4)")
    assert run_summary(_rows([0.0] * 20 + [1.0] * 5))[:50] == (
        "steps 0..24: reward 0.000 -> 1.000, accuracy 0.000")
    assert run_summary([{"step": 3, "eval/pass@1": 0.5}]) is None
