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
