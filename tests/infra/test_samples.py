"""Sample completions (qerl_jax.infra.samples): the records of a step's batch hold its rows'
prompt, completion, rewards, advantage, length and truncation, seeded and reproducible;
samples.jsonl is cut back on resume like metrics.jsonl; TensorBoard gets them as text; a
training run records logging.samples.count of them every logging.samples.every_steps steps."""

import glob
import json
import os
import shutil
import struct

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


def _batch(rng, rows=12, prompt_width=5, width=6):
    """A training batch as rl.train_step.training_batch lays it out (left-padded prompts, then
    completions), with known tokens, masks, rewards and advantages."""
    prompt_lengths = rng.integers(1, prompt_width + 1, rows)
    lengths = rng.integers(1, width + 1, rows)
    tokens = rng.integers(1, 100, (rows, prompt_width + width))
    attention = np.concatenate([np.arange(prompt_width)[None] >= prompt_width
                                - prompt_lengths[:, None],
                                np.arange(width)[None] < lengths[:, None]], axis=1)
    tokens = np.where(attention, tokens, 0)
    correct = rng.integers(0, 2, rows).astype(float)
    fmt = rng.integers(0, 2, rows) * 0.5
    batch = {"tokens": tokens, "attention_mask": attention,
             "completion_tokens": tokens[:, prompt_width:],
             "advantages": rng.normal(size=rows).astype(np.float32)}
    rewards = {"arithmetic": list(correct), "format": list(fmt), "total": list(correct + fmt),
               "timeouts": [0.0] * rows}
    return batch, rewards, lengths == width, prompt_lengths, lengths


def _text(ids):
    return " ".join(map(str, ids))


def test_training_samples_are_the_chosen_rows_with_every_field():
    rng = np.random.default_rng(7)
    batch, rewards, truncated, prompt_lengths, lengths = _batch(rng)
    records = training_samples(
        5, batch, rewards, truncated, reward_names=["arithmetic", "format"],
        correctness_key="arithmetic", decode_prompt=lambda ids: "P " + _text(ids),
        decode_completion=_text, count=4, seed=3)
    rows = chosen_rows(12, 4, 3, 5)
    assert len(set(rows)) == 4 and rows == sorted(rows) and rows == chosen_rows(12, 4, 3, 5)
    assert rows != chosen_rows(12, 4, 3, 6)   # another step draws other rows
    assert len(records) == 4
    for row, record in zip(rows, records, strict=True):
        assert set(record) == FIELDS
        prompt = batch["tokens"][row, 5 - prompt_lengths[row]:5]
        completion = batch["tokens"][row, 5:5 + lengths[row]]
        assert record["step"] == 5 and record["prompt"] == "P " + _text(prompt)
        assert record["completion"] == _text(completion)
        assert record["rewards"] == {"arithmetic": rewards["arithmetic"][row],
                                     "format": rewards["format"][row]}
        assert record["reward"] == sum(record["rewards"].values())
        assert record["advantage"] == float(batch["advantages"][row])
        assert record["length"] == lengths[row]
        assert record["truncated"] == (lengths[row] == 6)
        assert record["correct"] == (record["rewards"]["arithmetic"] > 0)
    everything = training_samples(0, batch, rewards, truncated, reward_names=["format"],
                                  correctness_key="arithmetic", decode_prompt=_text,
                                  decode_completion=_text, count=50, seed=0)
    assert [record["completion"] for record in everything] == [
        _text(batch["tokens"][row, 5:5 + lengths[row]]) for row in range(12)]   # all rows
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
