"""Sample completions (qerl_jax.infra.samples): the records of a step's batch hold its rows'
prompt, completion, rewards, advantage, length and truncation, seeded and reproducible;
samples.jsonl is cut back on resume like metrics.jsonl; TensorBoard gets them as text; a
training run records logging.samples.count of them every logging.samples.every_steps steps."""

import glob
import json
import os
import shutil
import struct
import types

import numpy as np
import pytest

from qerl_jax.infra.errors import ConfigError
from qerl_jax.infra.metrics import MetricsWriter
from qerl_jax.infra.samples import (chosen_rows, samples_due, table_columns, training_samples,
                                    write_samples_file)
from tests.conftest import small_trainer_config

FIELDS = {"step", "prompt", "completion", "rewards", "reward", "advantage", "length",
          "truncated", "correct"}


def tensorboard_texts(directory: str) -> dict[int, list[str]]:
    """step -> the text summaries of every event file in `directory` (TFRecord framing: a
    uint64 length, its crc, the Event proto, its crc)."""
    from tensorboardX.proto import event_pb2

    texts: dict[int, list[str]] = {}
    for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*"))):
        with open(path, "rb") as handle:
            data = handle.read()
        position = 0
        while position < len(data):
            (length,) = struct.unpack_from("<Q", data, position)
            event = event_pb2.Event()
            event.ParseFromString(data[position + 12:position + 12 + length])
            position += 12 + length + 4
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == "text":
                    texts.setdefault(event.step, []).append(
                        value.tensor.string_val[0].decode())
    return texts


def _groups(rng, prompts=3, size=4):
    """Rollout groups as the trainer holds them, with known texts, scores and lengths."""
    groups = []
    for p in range(prompts):
        lengths = rng.integers(1, 13, size)
        correct = rng.integers(0, 2, size).astype(float)
        fmt = rng.integers(0, 2, size) * 0.5
        groups.append({
            "prompt_text": f"prompt {p}", "completions": [f"c{p}.{g}" for g in range(size)],
            "rollout": types.SimpleNamespace(lengths=lengths, truncated=lengths == 12),
            "scores": {"arithmetic": correct, "format": fmt, "total": correct + fmt,
                       "timeouts": np.zeros(size)}})
    return groups


def test_training_samples_are_the_chosen_rows_with_every_field():
    rng = np.random.default_rng(7)
    groups = _groups(rng)
    advantages = rng.normal(size=12).astype(np.float32)
    records = training_samples(5, groups, advantages, ["arithmetic", "format"], "arithmetic",
                               count=4, seed=3)
    rows = chosen_rows(12, 4, 3, 5)
    assert len(set(rows)) == 4 and rows == sorted(rows) and rows == chosen_rows(12, 4, 3, 5)
    assert rows != chosen_rows(12, 4, 3, 6)   # another step draws other rows
    assert len(records) == 4
    for row, record in zip(rows, records, strict=True):
        group, g = groups[row // 4], row % 4
        assert set(record) == FIELDS
        assert record["step"] == 5 and record["prompt"] == f"prompt {row // 4}"
        assert record["completion"] == f"c{row // 4}.{g}"
        assert record["rewards"] == {"arithmetic": group["scores"]["arithmetic"][g],
                                     "format": group["scores"]["format"][g]}
        assert record["reward"] == sum(record["rewards"].values())
        assert record["advantage"] == float(advantages[row])
        assert record["length"] == group["rollout"].lengths[g]
        assert record["truncated"] == (record["length"] == 12)
        assert record["correct"] == (record["rewards"]["arithmetic"] > 0)
    assert len(training_samples(0, groups, advantages, ["format"], "arithmetic", count=50,
                                seed=0)) == 12   # all rows when fewer than the count
    columns, table = table_columns(records)
    assert columns[-2:] == ["rewards/arithmetic", "rewards/format"]
    assert [dict(zip(columns, row))["completion"] for row in table] == [
        record["completion"] for record in records]
    assert [samples_due(step, 3) for step in range(7)] == [True, False, False, True, False,
                                                           False, True]
    assert not any(samples_due(step, 0) for step in range(4))


def test_samples_jsonl_is_cut_back_on_resume_and_tensorboard_gets_text(tmp_path):
    pytest.importorskip("tensorboardX")
    records = {step: [{"step": step, "prompt": "p", "completion": f"c{step}.{i}",
                       "rewards": {"format": 0.5}, "reward": 0.5, "advantage": 0.1 * i,
                       "length": 3, "truncated": False, "correct": False} for i in range(2)]
               for step in range(5)}
    writer = MetricsWriter(str(tmp_path), tensorboard=True)
    writer.start(0)
    assert not os.path.exists(tmp_path / "samples.jsonl")   # created by the first records
    for step in range(5):
        writer.write({"step": step, "reward": 0.5}, records[step] if step % 2 == 0 else None)
    writer.close()

    def samples():
        with open(tmp_path / "samples.jsonl") as handle:
            return [json.loads(line) for line in handle]
    assert samples() == records[0] + records[2] + records[4]
    texts = tensorboard_texts(str(tmp_path / "tensorboard"))
    assert sorted(texts) == [0, 2, 4]
    assert all("c2.0" in text and "c2.1" in text and "advantage 0.1000" in text
               for text in texts[2])

    # a torn last line goes; a resume at step 3 keeps the samples of steps 0 and 2
    with open(tmp_path / "samples.jsonl", "a") as handle:
        handle.write('{"step": 4, "prom')
    writer = MetricsWriter(str(tmp_path))
    writer.start(3)
    assert samples() == records[0] + records[2]
    writer.write({"step": 3, "reward": 0.5}, records[3])
    assert samples() == records[0] + records[2] + records[3]
    writer.start(0)
    assert samples() == []

    (tmp_path / "samples.jsonl").write_text('{"step": 0}\nnot json\n{"step": 2}\n')
    with pytest.raises(ConfigError, match=r"samples.jsonl:2: not a samples row"):
        MetricsWriter(str(tmp_path)).start(1)


def test_write_samples_file_writes_strict_json_lines(tmp_path):
    path = str(tmp_path / "out.samples.jsonl")
    write_samples_file(path, [{"step": None, "completion": "a\nb", "rewards": {"x": 1.0}}])
    with open(path) as handle:
        assert [json.loads(line) for line in handle] == [
            {"step": None, "completion": "a\nb", "rewards": {"x": 1.0}}]


@pytest.mark.slow
def test_a_training_run_records_samples_and_a_resume_records_them_once(tmp_path, tiny_warmup):
    from qerl_jax.trainer import Trainer

    config = small_trainer_config(total_steps=4)
    config.checkpoint.every_steps = 2
    config.logging.samples.every_steps = 2
    config.logging.samples.count = 3
    workdir = str(tmp_path / "run")
    shutil.copytree(tiny_warmup, os.path.join(workdir, "warmup"))
    Trainer(config, workdir).train(stop_after=3)   # checkpoints at steps 2 and 3
    path = os.path.join(workdir, "samples.jsonl")
    with open(path) as handle:
        first = [json.loads(line) for line in handle]
    assert [record["step"] for record in first] == [0, 0, 0, 2, 2, 2]
    for record in first:
        assert set(record) == FIELDS
        assert set(record["rewards"]) == set(config.rewards.names)
        assert record["reward"] == pytest.approx(sum(record["rewards"].values()))
        assert record["correct"] == (record["rewards"]["arithmetic"] > 0)
        assert 1 <= record["length"] <= config.rollout.max_new_tokens
        assert not record["truncated"] or record["length"] == config.rollout.max_new_tokens
        assert record["prompt"].strip() and isinstance(record["advantage"], float)

    # as if killed before the save at exit: the resume trains step 2 again; samples.jsonl
    # holds its records once, the same ones (the same computation)
    shutil.rmtree(os.path.join(workdir, "checkpoints", "3"))
    trainer = Trainer(config, workdir, resume=True)
    assert trainer.step == 2
    trainer.train()
    with open(path) as handle:
        resumed = [json.loads(line) for line in handle]
    assert resumed == first
    texts = tensorboard_texts(os.path.join(workdir, "tensorboard"))
    assert sorted(texts) == [0, 2]
    for record in first:
        assert record["completion"].split("\n")[0] in texts[record["step"]][-1]
