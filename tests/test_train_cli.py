"""The training CLI: --help lists every config field without importing JAX; a bad input is one
line on stderr and exit status 2 before any model work (the traceback only with --debug); the
Trainer gets the run flags; a stopped or interrupted run exits with its status."""

import errno
import json
import os
import subprocess
import sys
import time
import types

import pytest

from qerl_jax import train
from qerl_jax.experiment_config import FIELDS
from qerl_jax.infra.errors import ConfigError, StorageError, TrainingStopped

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join("configs", "tiny.py")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qerl_jax.train", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def _one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr and not result.stdout
    return lines[0]


def test_help_lists_every_field_fast():
    started = time.perf_counter()
    result = _cli("--help")
    seconds = time.perf_counter() - started
    assert result.returncode == 0, result.stderr
    assert seconds < 3.0, seconds
    lines = result.stdout.splitlines()
    index = lines.index("  config.rollout.temperature=1.0")
    assert lines[index + 1].strip() == FIELDS["rollout.temperature"].description
    for path in FIELDS:
        assert any(line.startswith(f"  config.{path}=") for line in lines), path
    for flag in ("--workdir", "--resume", "--restart", "--overwrite", "--allow_config_change",
                 "--debug"):
        assert f"  {flag}" in result.stdout
    # with --config, the file's values
    result = _cli("--config", TINY, "--help")
    assert "  config.rollout.max_new_tokens=16" in result.stdout.splitlines()


def test_bad_field_is_one_line_exit_2():
    line = _one_error_line(_cli("--config", TINY, "--workdir", "unused",
                                "--config.rollout.temperature=0"))
    assert line == "error: config.rollout.temperature: must be > 0, got 0.0"


def test_debug_shows_the_traceback():
    result = _cli("--config", TINY, "--workdir", "unused", "--config.rollout.temperature=0",
                  "--debug")
    assert result.returncode == 2
    assert "Traceback" in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: config.rollout.temperature: must be > 0, got 0.0")


def test_typo_in_an_override_gets_a_suggestion():
    line = _one_error_line(_cli("--config", TINY, "--workdir", "unused",
                                "--config.trian.learning_rate=1"))
    assert line == ("error: config.trian.learning_rate: unknown field; did you mean "
                    "config.train.learning_rate?")
    line = _one_error_line(_cli("--config", TINY, "--workdir", "unused",
                                "--config.train.total_steps=ten"))
    assert line == ("error: flag --config.train.total_steps=ten: invalid literal for int() "
                    "with base 10: 'ten'")
    line = _one_error_line(_cli("--config", TINY, "--workdir=unused", "--workdr=x"))
    assert "Unknown command line flag 'workdr'" in line


def test_config_file_errors_name_the_file_and_line(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("from qerl_jax.experiment_config import base_config\n\n\n"
                      "def get_config():\n    return base_confg()\n")
    line = _one_error_line(_cli("--config", str(broken), "--workdir", "unused"))
    assert line == (f"error: {broken}:5: NameError: name 'base_confg' is not defined")
    line = _one_error_line(_cli("--config", str(tmp_path / "none.py"), "--workdir", "unused"))
    assert line == f"error: --config {tmp_path / 'none.py'}: no such file"
    line = _one_error_line(_cli("--config", "configs/qerl.py:9b,gsm8k", "--workdir", "unused"))
    assert line.startswith("error: config spec '9b,gsm8k': expected 'SIZE,DATASET'")
    result = _cli("--workdir", "unused")
    assert result.returncode == 2
    assert result.stderr.startswith("error: --config is required")


def test_bad_data_row_fails_before_any_model_work(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n7\n")
    line = _one_error_line(_cli("--config", TINY, "--workdir", str(tmp_path / "run"),
                                "--config.data.task=gsm8k", f"--config.data.path={data}",
                                "--config.data.arithmetic_count=1000"))
    assert line == f"error: {data}:2: expected a JSON object, got int"
    assert not os.path.exists(tmp_path / "run")


def test_validation_imports_no_jax():
    code = ("import sys; from qerl_jax.train import main; "
            "status = main(['train', '--config', 'configs/tiny.py', '--workdir', 'unused', "
            "'--config.aqn.sigma_start=-1.0']); "
            "print(status, sorted(m for m in ('jax', 'flax', 'optax', 'transformers') "
            "if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.stdout.strip() == "2 []", result.stderr
    assert result.stderr.strip() == "error: config.aqn.sigma_start: must be > 0, got -1.0"


class _FakeTrainer:
    """Stands in for qerl_jax.trainer.Trainer: records its arguments, runs `outcome`."""

    calls: list = []
    outcome = None

    def __init__(self, config, workdir, **flags):
        _FakeTrainer.calls.append((config, workdir, flags))
        self.workdir = workdir

    def train(self):
        if _FakeTrainer.outcome is not None:
            raise _FakeTrainer.outcome
        row = {"step": 0, "reward": 0.5, "accuracy": 0.25, "entropy": 0.75}
        with open(os.path.join(self.workdir, "metrics.jsonl"), "w") as handle:
            handle.write(json.dumps(row) + "\n")
        return [row]


@pytest.fixture
def fake_trainer(monkeypatch):
    module = types.ModuleType("qerl_jax.trainer")
    module.Trainer = _FakeTrainer
    monkeypatch.setitem(sys.modules, "qerl_jax.trainer", module)
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")
    _FakeTrainer.calls, _FakeTrainer.outcome = [], None
    return _FakeTrainer


def test_trainer_gets_the_run_flags(fake_trainer, tmp_path, capsys):
    argv = ["train", "--config", os.path.join(REPO, TINY), f"--workdir={tmp_path}",
            "--config.train.total_steps=7", "--resume", "--allow_config_change"]
    assert train.main(argv) == 0
    (config, workdir, flags), = fake_trainer.calls
    assert config.train.total_steps == 7 and workdir == str(tmp_path)
    assert flags == {"resume": True, "overwrite": False, "allow_config_changes": True,
                     "restart": False}
    assert capsys.readouterr().out.strip() == (
        "steps 0..0: reward 0.500 -> 0.500, accuracy 0.250 -> 0.250, entropy 0.750 -> 0.750 "
        f"(means over steps 0 and 0); metrics in {tmp_path}/metrics.jsonl")
    assert train.main(argv[:4] + ["--overwrite"]) == 0
    assert fake_trainer.calls[-1][2] == {"resume": False, "overwrite": True,
                                         "allow_config_changes": False, "restart": False}
    assert train.main(argv[:4] + ["--resume", "--restart"]) == 0
    assert fake_trainer.calls[-1][2] == {"resume": True, "overwrite": False,
                                         "allow_config_changes": False, "restart": True}


@pytest.mark.parametrize("outcome,status,message", [
    (TrainingStopped("stopped at step 3: disk full; checkpoint 2 saved", exit_code=75), 75,
     "stopped at step 3: disk full; checkpoint 2 saved"),
    (KeyboardInterrupt(), 130, "interrupted"),
    (ConfigError("runs/x: holds an earlier run; pass --overwrite or --resume"), 2,
     "error: runs/x: holds an earlier run; pass --overwrite or --resume"),
    (StorageError("could not write runs/x/metrics.jsonl: no space left on device"), 2,
     "error: could not write runs/x/metrics.jsonl: no space left on device"),
    (OSError(errno.EROFS, "Read-only file system", "runs/x/curves.png"), 2,
     "error: runs/x/curves.png: read-only file system"),
    (FileNotFoundError("tokenizer directory 'tok' does not exist"), 2,
     "error: tokenizer directory 'tok' does not exist"),
])
def test_stopped_and_refused_runs_exit_with_their_status(fake_trainer, tmp_path, capsys,
                                                         outcome, status, message):
    fake_trainer.outcome = outcome
    argv = ["train", "--config", os.path.join(REPO, TINY), f"--workdir={tmp_path}"]
    assert train.main(argv) == status
    assert capsys.readouterr().err.strip() == message


@pytest.mark.slow
def test_console_is_clean_and_an_interrupt_is_one_line(tmp_path):
    """A real (shrunken) run through the CLI: each notice is logged once and on a line of its
    own above the progress bar (not inside it), the quantization report once, no transformers
    'PyTorch was not found' advisory, no traceback; SIGINT mid-run ends with one line naming
    the saved checkpoint and exit status 130; --resume finishes the run."""
    workdir = str(tmp_path / "run")
    args = ("--config", TINY, "--workdir", workdir, "--config.warmup.steps=5",
            "--config.train.total_steps=20", "--config.model.overrides.num_hidden_layers=2",
            "--config.checkpoint.every_steps=1000")
    process = subprocess.Popen([sys.executable, "-m", "qerl_jax.train", *args], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    metrics = os.path.join(workdir, "metrics.jsonl")
    while time.time() < deadline and process.poll() is None:   # interrupt after a few steps
        if os.path.isfile(metrics) and sum(1 for _ in open(metrics)) >= 3:
            process.send_signal(2)
            break
        time.sleep(0.2)
    stdout, stderr = process.communicate(timeout=240)
    assert process.returncode == 130, stderr
    records = [line for line in stderr.replace("\r", "\n").splitlines()
               if line.strip() and not line.startswith("QeRL:")]
    assert "Traceback" not in stderr and "PyTorch was not found" not in stderr
    quantization = [line for line in records if "mean relative error" in line]
    assert len(quantization) == 1, records
    notices = [line for line in records if " I " in line or " W " in line]
    assert len(notices) == len(set(line[9:] for line in notices)), notices   # once each
    assert all(line[:2].isdigit() for line in notices), records   # each starts its own line
    last = records[-1]
    assert last.startswith("stopped by SIGINT at step ") and "--resume" in last, records
    assert [line for line in records if line not in notices] == [last], records
    resumed = _cli(*args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.startswith("steps 0..19: reward ")
    assert "(means over steps 0-1 and 18-19)" in resumed.stdout
