"""Operator errors never lose an earlier run: each bad input (model file, data, field, changed
config, missing tokenizer, unwritable path, full disk) against each run directory state
(empty, mid-run, finished) is one `error:` line, exit status 2, and every earlier file is
byte-identical afterwards or moved aside intact into replaced-<time>/."""

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from qerl_jax import train
from qerl_jax.infra import atomic_io
from qerl_jax.infra.metrics import read_metrics
from qerl_jax.infra.run_record import REPLACED_PREFIX

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ("--config", os.path.join(REPO, "configs", "tiny.py"), "--config.warmup.steps=5",
         "--config.model.overrides.num_hidden_layers=2",
         "--config.model.overrides.hidden_size=64",
         "--config.model.overrides.intermediate_size=128",
         # the CPU pins act only before JAX starts, and _main trains in this process
         "--config.cpu_threads=0", "--config.xla_flags=")
RUN = ("--config.train.total_steps=4", "--config.train.prompts_per_step=2",
       "--config.rollout.num_generations=2", "--config.rollout.max_new_tokens=4",
       "--config.train.micro_batch_size=4", "--config.checkpoint.every_steps=2",
       "--config.logging.progress_bar=False")
ARGS = MODEL + RUN
# configs/tiny.py on an HF checkpoint directory (the ':ARG'): no preset, no warm-up
HF_CONFIG = f"""import importlib.util


def get_config(hf_path):
    spec = importlib.util.spec_from_file_location("tiny", {os.path.join(REPO, "configs", "tiny.py")!r})
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    config.model.preset, config.model.overrides, config.model.hf_path = "", {{}}, hf_path
    config.warmup.steps = 0
    config.cpu_threads, config.xla_flags = 0, ""   # trained in the test's process
    return config
"""


def _main(capsys, workdir, *extra, model=MODEL) -> tuple[int, str, str]:
    status = train.main(["train", *model, *RUN, f"--workdir={workdir}", *extra])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _error_line(status: int, stderr: str) -> str:
    """The one `error:` line of a refused start (exit 2, no traceback)."""
    assert status == 2, stderr
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, stderr
    return errors[0]


def _snapshot(root: str) -> dict[str, str]:
    """{relative path: sha256} of every file under `root`."""
    files = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as handle:
                files[os.path.relpath(path, root)] = hashlib.sha256(handle.read()).hexdigest()
    return files


def _assert_nothing_lost(root: str, before: dict[str, str], *, moved: bool = False) -> None:
    """Every file of `before` is at its place with the same bytes or (`moved`) at the same
    relative path inside the one replaced-<time>/ folder; unmoved, nothing else appeared."""
    after = _snapshot(root)
    if not moved:
        assert after == before
        return
    replaced = [name for name in os.listdir(root) if name.startswith(REPLACED_PREFIX)]
    assert len(replaced) == 1, os.listdir(root)
    for path, digest in before.items():
        aside = os.path.join(replaced[0], path)
        assert after.get(path) == digest or after.get(aside) == digest, path
    assert any(path.startswith(replaced[0]) for path in after)


# ----------------------------------------------------------------------------- fixtures
def _trainer_run(workdir: str) -> None:
    from qerl_jax.trainer import Trainer

    config, _ = train.parse_command_line(["train", *ARGS, f"--workdir={workdir}"])
    Trainer(config, workdir).train()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{'finished': a 4-step run, 'mid-run': that run as it stood after step 2 (checkpoint 2,
    the metrics of steps 0-1: what a run stopped there leaves)}; each case copies one."""
    root = tmp_path_factory.mktemp("runs")
    finished, mid = str(root / "finished"), str(root / "mid-run")
    _trainer_run(finished)
    shutil.copytree(finished, mid)
    shutil.rmtree(os.path.join(mid, "checkpoints", "4"))
    metrics = os.path.join(mid, "metrics.jsonl")
    with open(metrics) as handle:
        kept = [line for line in handle if json.loads(line)["step"] < 2]
    with open(metrics, "w") as handle:
        handle.writelines(kept)
    return {"finished": finished, "mid-run": mid}


def _tiny_architecture():
    from qerl_jax.models.config import preset
    from tests.conftest import config_from_file

    overrides = dict(config_from_file("tiny").model.overrides, hidden_size=64,
                     intermediate_size=128, num_hidden_layers=2)
    return preset("tiny_qwen2", **overrides)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """HF checkpoint directories of the tiny architecture: 'corrupt' (a broken safetensors
    header), 'truncated' (the file cut in half), 'no_tokenizer' (valid weights, no tokenizer)."""
    from qerl_jax.models.char_tokenizer import build_char_tokenizer
    from qerl_jax.models.hf_io import SINGLE_FILE, tensor_specs, write_checkpoint

    architecture = _tiny_architecture()
    rng = np.random.default_rng(0)
    root = tmp_path_factory.mktemp("models")
    dirs = {}
    for kind in ("corrupt", "truncated", "no_tokenizer"):
        directory = str(root / kind)
        write_checkpoint(directory, ((spec.hf_name, rng.standard_normal(spec.hf_shape)
                                      .astype(np.float32)) for spec in tensor_specs(architecture)),
                         architecture.to_hf_dict())
        path = os.path.join(directory, SINGLE_FILE)
        if kind == "corrupt":
            with open(path, "r+b") as handle:
                handle.seek(8)
                handle.write(b"{not json")
        elif kind == "truncated":
            os.truncate(path, os.path.getsize(path) // 2)
        if kind != "no_tokenizer":
            build_char_tokenizer(directory)
        dirs[kind] = directory
    config_file = root / "hf_config.py"
    config_file.write_text(HF_CONFIG)
    dirs["config"] = str(config_file)
    return dirs


@pytest.fixture
def bad_data(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n7\n")
    return str(data)


def _workdir(tmp_path, runs, state: str) -> str:
    workdir = str(tmp_path / "run")
    if state != "empty":
        shutil.copytree(runs[state], workdir)
    return workdir


# ----------------------------------------------------------------------------- the matrix
def _bad_input(kind: str, model_dirs, bad_data) -> tuple[tuple, list[str], str]:
    """(model arguments, extra arguments, the start of the expected error line) of one bad
    input."""
    from qerl_jax.models.hf_io import SINGLE_FILE

    if kind == "bad_field":
        return (MODEL, ["--config.rollout.temperature=0"],
                "error: config.rollout.temperature: must be > 0, got 0.0")
    if kind == "bad_data":
        return (MODEL, ["--config.data.task=gsm8k", f"--config.data.path={bad_data}",
                        "--config.data.arithmetic_count=1000"],
                f"error: {bad_data}:2: expected a JSON object, got int")
    directory = model_dirs[{"corrupt_model": "corrupt", "truncated_model": "truncated",
                            "missing_tokenizer": "no_tokenizer"}[kind]]
    path = os.path.join(directory, SINGLE_FILE)
    expected = {"corrupt_model": f"error: {path}: corrupt safetensors header",
                "truncated_model": f"error: {path}: truncated: tensor '",
                "missing_tokenizer": f"error: {directory}: no tokenizer"}[kind]
    return ("--config", f"{model_dirs['config']}:{directory}"), [], expected


INPUTS = ("bad_field", "bad_data", "corrupt_model", "truncated_model", "missing_tokenizer")


@pytest.mark.parametrize("kind", INPUTS)
def test_a_bad_input_into_an_empty_workdir_creates_nothing(tmp_path, capsys, model_dirs,
                                                           bad_data, kind):
    model, extra, expected = _bad_input(kind, model_dirs, bad_data)
    workdir = str(tmp_path / "run")
    line = _error_line(*_main(capsys, workdir, *extra, model=model)[::2])
    assert line.startswith(expected), line
    assert not os.path.exists(workdir)


@pytest.mark.parametrize("state", ["mid-run", "finished"])
@pytest.mark.parametrize("mode", ["--overwrite", "--resume"])
@pytest.mark.parametrize("kind", INPUTS)
def test_a_bad_input_into_an_earlier_run_changes_no_file(tmp_path, capsys, runs, model_dirs,
                                                         bad_data, kind, mode, state):
    """--overwrite checks every input before it moves anything; --resume with a model path the
    run did not have is a refused config change (one line per field)."""
    model, extra, expected = _bad_input(kind, model_dirs, bad_data)
    workdir = _workdir(tmp_path, runs, state)
    before = _snapshot(workdir)
    status, _, stderr = _main(capsys, workdir, mode, *extra, model=model)
    if mode == "--resume" and model is not MODEL:
        assert status == 2 and "Traceback" not in stderr, stderr
        assert "error: config.model.hf_path: was '' in the run being resumed" in stderr
    else:
        assert _error_line(status, stderr).startswith(expected)
    _assert_nothing_lost(workdir, before)


def test_a_fresh_start_into_an_earlier_run_is_refused(tmp_path, capsys, runs):
    workdir = _workdir(tmp_path, runs, "finished")
    before = _snapshot(workdir)
    line = _error_line(*_main(capsys, workdir)[::2])
    assert line.startswith(f"error: {workdir} holds an earlier run (run.json, metrics.jsonl, "
                           "checkpoints")
    _assert_nothing_lost(workdir, before)


def test_a_workdir_under_a_file_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    workdir = str(blocker / "run")
    line = _error_line(*_main(capsys, workdir)[::2])
    assert line == f"error: --workdir {workdir}: cannot be created, {blocker} is a file"
    assert blocker.read_text() == ""


@pytest.mark.parametrize("state", ["mid-run", "finished"])
def test_a_changed_config_is_refused_per_field(tmp_path, capsys, runs, state):
    workdir = _workdir(tmp_path, runs, state)
    before = _snapshot(workdir)
    status, _, stderr = _main(capsys, workdir, "--resume", "--config.lora.rank=16")
    assert status == 2 and "Traceback" not in stderr
    assert "error: config.lora.rank: was 8 in the run being resumed, now 16" in stderr
    _assert_nothing_lost(workdir, before)


def test_a_checkpoint_that_does_not_fit_a_changed_config_is_refused_not_moved(tmp_path, capsys,
                                                                                runs):
    """--allow_config_change with another LoRA rank: one line naming the field and the shapes,
    nothing moved aside; the original config then resumes from the same checkpoint."""
    workdir = _workdir(tmp_path, runs, "mid-run")
    before = _snapshot(workdir)
    line = _error_line(*_main(capsys, workdir, "--resume", "--config.lora.rank=16",
                              "--allow_config_change")[::2])
    checkpoint = os.path.join(workdir, "checkpoints", "2")
    assert line.startswith(f"error: checkpoint {checkpoint} does not fit the configured run: "
                           "array "), line
    assert ", 8), the configured run needs (" in line and ", 16)" in line, line
    assert "changed since the run being resumed: config.lora.rank 8 -> 16" in line, line
    _assert_nothing_lost(workdir, before)
    status, _, stderr = _main(capsys, workdir, "--resume")
    assert status == 0, stderr
    assert [row["step"] for row in read_metrics(workdir)] == [0, 1, 2, 3]


def test_a_resume_with_nothing_to_restore_is_refused_unless_restart(tmp_path, capsys, runs):
    """No checkpoint left (all moved aside as damaged) but metrics: --resume names what is
    there instead of silently starting at step 0; --restart starts over, moving them aside."""
    workdir = _workdir(tmp_path, runs, "finished")
    damaged = os.path.join(workdir, "checkpoints_damaged")
    os.makedirs(damaged)
    for step in os.listdir(os.path.join(workdir, "checkpoints")):
        shutil.move(os.path.join(workdir, "checkpoints", step), os.path.join(damaged, step))
    before = _snapshot(workdir)
    left = [name for name in ("metrics.jsonl", "checkpoints_damaged", "curves.png", "tensorboard",
                              "samples.jsonl") if os.path.exists(os.path.join(workdir, name))]
    line = _error_line(*_main(capsys, workdir, "--resume")[::2])
    assert line == (f"error: {workdir}: --resume found no checkpoint in "
                    f"{os.path.join(workdir, 'checkpoints')} to continue from, but the run left "
                    f"{', '.join(left)}: pass --restart to start over at step 0 (the earlier "
                    "files are moved into replaced-<time>/)"), line
    _assert_nothing_lost(workdir, before)
    status, _, stderr = _main(capsys, workdir, "--resume", "--restart",
                              "--config.train.total_steps=1")
    assert status == 0, stderr
    _assert_nothing_lost(workdir, before, moved=True)
    assert [row["step"] for row in read_metrics(workdir)] == [0]


def _full_disk_at(monkeypatch, name: str) -> None:
    """Every open() for writing of a file named `name` (or its temporary) fails with ENOSPC."""
    def full_open(path, mode="r", *args, **kwargs):
        if os.path.basename(str(path)).startswith(name) and mode[0] in "wa":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return open(path, mode, *args, **kwargs)
    monkeypatch.setattr(atomic_io, "open", full_open, raising=False)


@pytest.mark.parametrize("state", ["mid-run", "finished"])
@pytest.mark.parametrize("mode", ["--overwrite", "--resume"])
def test_a_full_disk_is_one_line_naming_the_file(tmp_path, capsys, monkeypatch, runs, state,
                                                 mode):
    workdir = _workdir(tmp_path, runs, state)
    before = _snapshot(workdir)
    _full_disk_at(monkeypatch, "metrics.jsonl")
    line = _error_line(*_main(capsys, workdir, mode)[::2])
    assert line == (f"error: could not write {os.path.join(workdir, 'metrics.jsonl')}: "
                    "no space left on device")
    _assert_nothing_lost(workdir, before, moved=mode == "--overwrite")


@pytest.mark.slow   # a step in a fresh process
def test_overwrite_moves_the_earlier_run_aside_in_one_line(tmp_path, runs):
    """Through the real console: --overwrite with a good config moves the earlier run into
    replaced-<time>/ (saying so in one line), keeps the warm-up cache in place and runs."""
    workdir = _workdir(tmp_path, runs, "finished")
    before = _snapshot(workdir)
    result = subprocess.run([sys.executable, "-m", "qerl_jax.train", *ARGS,
                             f"--workdir={workdir}", "--overwrite",
                             "--config.train.total_steps=1"],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    moved = [line for line in result.stderr.splitlines() if "moved the earlier run's files" in line]
    assert len(moved) == 1 and f"{workdir}/{REPLACED_PREFIX}" in moved[0], result.stderr
    _assert_nothing_lost(workdir, before, moved=True)
    assert all(before[path] == digest for path, digest in _snapshot(workdir).items()
               if path.startswith("warmup"))


def test_a_corrupt_model_with_overwrite_is_one_console_line(tmp_path, runs, model_dirs):
    """The console a user sees: one line, exit 2, every earlier file where it was."""
    workdir = _workdir(tmp_path, runs, "finished")
    before = _snapshot(workdir)
    result = subprocess.run([sys.executable, "-m", "qerl_jax.train", "--config",
                             f"{model_dirs['config']}:{model_dirs['corrupt']}", *RUN,
                             f"--workdir={workdir}", "--overwrite"],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "corrupt safetensors" in lines[0]
    _assert_nothing_lost(workdir, before)


def test_the_closing_line_gives_the_first_and_last_tenth_means(runs, tmp_path, capsys):
    """A finished run's closing line (resumed: nothing left to run) against its metrics.jsonl:
    4 steps, so one step per window."""
    workdir = _workdir(tmp_path, runs, "finished")
    status, out, err = _main(capsys, workdir, "--resume")
    assert status == 0, err
    rows = [row for row in read_metrics(workdir) if "reward" in row]
    first, last = rows[0], rows[-1]
    expected = ", ".join(f"{key} {first[key]:.3f} -> {last[key]:.3f}"
                         for key in ("reward", "accuracy", "entropy"))
    assert out.strip() == (f"steps 0..3: {expected} (means over steps 0 and 3); metrics in "
                           f"{os.path.join(workdir, 'metrics.jsonl')}")
