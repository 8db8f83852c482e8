"""W&B logging (qerl_jax.infra.wandb_logging), offline: the history read back from the offline
run's .wandb files holds every metrics.jsonl row at its step with its values, the run's config
and the sample tables; a resume continues the same W&B run id with each step logged once; a
logging mode without the wandb package is one config error before any work."""

import glob
import json
import os
import shutil
import struct
import zlib

import pytest

from qerl_jax.experiment_config import validate_config
from qerl_jax.infra.errors import ConfigError
from qerl_jax.infra.metrics import read_metrics
from tests.conftest import small_trainer_config

# The .wandb file: a 7-byte header (':W&B', 0xBEE1, version) then LevelDB-log records (masked
# by nothing: crc32 of the type byte and the data) in 32 KiB blocks, each a
# wandb_internal_pb2.Record, split FIRST / MIDDLE / LAST across blocks.
_FILE_HEADER = struct.Struct("<4sHB")
_RECORD_HEADER = struct.Struct("<IHB")
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(path: str):
    """The wandb_internal_pb2.Record messages of a .wandb file, in order."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as handle:
        data = handle.read()
    ident, magic, _ = _FILE_HEADER.unpack_from(data, 0)
    assert (ident, magic) == (b":W&B", 0xBEE1), path
    position, pending = _FILE_HEADER.size, b""
    while position + _RECORD_HEADER.size <= len(data):
        left = _BLOCK - position % _BLOCK
        if left < _RECORD_HEADER.size:   # a block's tail too short for a header: padding
            position += left
            continue
        checksum, length, kind = _RECORD_HEADER.unpack_from(data, position)
        if kind == 0 and length == 0:
            position += left
            continue
        position += _RECORD_HEADER.size
        chunk = data[position:position + length]
        position += length
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == checksum, path
        pending = chunk if kind in (_FULL, _FIRST) else pending + chunk
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def _history_key(item):
    """A history item's key: its name, or (key, field) for a nested value's field (a table's)."""
    nested = tuple(item.nested_key)
    return item.key or (nested[0] if len(nested) == 1 else nested)


def offline_runs(workdir: str) -> list[dict]:
    """Each offline W&B run under workdir/wandb, oldest first: {'id', 'project', 'name',
    'config', 'history' (one {key: value} per history record; a table's nested fields under
    (key, field) tuples)}."""
    runs = []
    for path in sorted(glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "*.wandb"))):
        run = {"history": [], "directory": os.path.dirname(path)}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run.update(id=record.run.run_id, project=record.run.project,
                           name=record.run.display_name,
                           config={item.key: json.loads(item.value_json)
                                   for item in record.run.config.update})
            elif kind == "history":
                run["history"].append({_history_key(item): json.loads(item.value_json)
                                       for item in record.history.item})
        runs.append(run)
    return runs


TIMING_KEYS = ("time/rollout_s", "time/train_s", "time/sampler_compile_s",
               "rollout_tokens_per_s", "peak_memory_bytes", "time/eval_s")


def _metric_values(row: dict, *, timing: bool = True) -> dict:
    """A metrics.jsonl row's (or a history record's) logged numbers, keyed as W&B keys them."""
    return {key: value for key, value in row.items()
            if isinstance(key, str) and not key.startswith("_") and key != "step"
            and value is not None and (timing or key not in TIMING_KEYS)}


@pytest.fixture
def offline(monkeypatch, tmp_path):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-elsewhere"))   # the run's dir wins
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))


def _config():
    config = small_trainer_config(total_steps=4)
    config.checkpoint.every_steps = 2
    config.logging.samples.every_steps = 2
    config.logging.samples.count = 3
    config.logging.wandb.mode = "offline"
    config.logging.wandb.project = "qerl-test"
    return config


def test_offline_history_equals_metrics_and_a_resume_continues_the_run(tmp_path, offline,
                                                                       tiny_warmup):
    from qerl_jax.trainer import Trainer

    workdir = str(tmp_path / "run")
    shutil.copytree(tiny_warmup, os.path.join(workdir, "warmup"))
    Trainer(_config(), workdir).train(stop_after=3)   # checkpoints at steps 2 and 3
    first = read_metrics(workdir)
    # as if killed before the save at exit: the resume starts at step 2 and trains step 2
    # again; W&B holds step 2 already
    shutil.rmtree(os.path.join(workdir, "checkpoints", "3"))
    trainer = Trainer(_config(), workdir, resume=True)
    assert trainer.step == 2
    trainer.train()
    metrics = read_metrics(workdir)
    assert [row["step"] for row in metrics] == [0, 1, 2, 3]
    with open(os.path.join(workdir, "wandb_run.json")) as handle:
        record = json.load(handle)

    runs = offline_runs(workdir)
    assert len(runs) == 2 and not os.path.exists(tmp_path / "wandb-elsewhere" / "wandb")
    assert {run["id"] for run in runs} == {record["id"]} and record["last_step"] == 3
    assert all(run["project"] == "qerl-test" and run["name"] == "run" for run in runs)
    config = json.loads(_config().to_json())
    assert {key: value for key, value in runs[0]["config"].items() if key != "_wandb"} == config

    history = [row for run in runs for row in run["history"]]
    assert [row["_step"] for row in history] == [0, 1, 2, 3]   # each step once, in order
    for row, logged in zip(first[:3] + metrics[3:], history, strict=True):
        assert _metric_values(logged) == _metric_values(row), row["step"]
    # the step trained again after the resume logged its first run's values, which are the
    # same computation (all but the timings)
    assert _metric_values(history[2], timing=False) == _metric_values(metrics[2], timing=False)

    # the sample tables: steps 0 and 2, the samples.jsonl records in W&B's table files
    with open(os.path.join(workdir, "samples.jsonl")) as handle:
        samples = [json.loads(line) for line in handle]
    for row in history:
        table = {key[1]: value for key, value in row.items()
                 if isinstance(key, tuple) and key[0] == "samples"}
        assert bool(table) == (row["_step"] in (0, 2))
        if not table:
            continue
        assert table["_type"] == "table-file" and table["nrows"] == 3
        with open(os.path.join(runs[0]["directory"], "files", table["path"])) as handle:
            logged = json.load(handle)
        expected = [sample for sample in samples if sample["step"] == row["_step"]]
        rows = [dict(zip(logged["columns"], values)) for values in logged["data"]]
        assert [row["completion"] for row in rows] == [s["completion"] for s in expected]
        assert [row["rewards/format"] for row in rows] == [s["rewards"]["format"]
                                                          for s in expected]
        assert [row["advantage"] for row in rows] == [s["advantage"] for s in expected]


def test_a_logging_mode_without_wandb_is_one_config_error(monkeypatch):
    import importlib.util

    config = _config()
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "wandb" else real_find_spec(
                            name, *args))
    with pytest.raises(ConfigError) as error:
        validate_config(config)
    assert str(error.value) == ("config.logging.wandb.mode: 'offline' needs the wandb package "
                                "(pip install qerl-jax[wandb])")
    config.logging.wandb.mode = "off"
    validate_config(config)   # off needs nothing
    config.logging.wandb.mode = "cloud"
    with pytest.raises(ConfigError, match="config.logging.wandb.mode: .*'cloud'"):
        validate_config(config)


def test_the_train_cli_reports_it_before_any_work(tmp_path, monkeypatch, capsys):
    """The CLI's one line and exit status 2, with no run directory made."""
    import importlib.util

    from qerl_jax import train

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "wandb" else real_find_spec(
                            name, *args))
    workdir = tmp_path / "run"
    status = train.main(["train", "--config", "configs/tiny.py", "--workdir", str(workdir),
                         "--config.logging.wandb.mode=online"])
    assert status == 2 and not workdir.exists()
    assert capsys.readouterr().err.strip() == (
        "error: config.logging.wandb.mode: 'online' needs the wandb package "
        "(pip install qerl-jax[wandb])")


def test_a_failing_wandb_init_is_one_config_error(tmp_path, monkeypatch):
    """An online run without a login: one line naming the field and wandb's reason."""
    wandb = pytest.importorskip("wandb")
    from qerl_jax.infra.wandb_logging import WandbRun

    def no_login(**settings):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")
    monkeypatch.setattr(wandb, "init", no_login)
    run = WandbRun(str(tmp_path), mode="online", project="p", run_name="", config={})
    with pytest.raises(ConfigError) as error:
        run.start(0)
    assert str(error.value) == ("config.logging.wandb.mode: 'online': wandb.init failed: No "
                                "API key configured. Use `wandb login` to log in.")
