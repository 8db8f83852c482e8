"""Run metrics: strict-JSON lines always (metrics.jsonl, and the sample completions in
samples.jsonl), TensorBoard event files when tensorboardX is installed, a W&B run when
logging.wandb.mode is on, and the run metadata recorded at each start (the curves:
qerl_jax.plots)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import platform
import resource
import subprocess

import jax

from qerl_jax.infra.atomic_io import storage_errors, write_text_atomic
from qerl_jax.infra.errors import ConfigError
from qerl_jax.infra.interrupts import logging_above_progress_bar
from qerl_jax.infra.run_record import METRICS_FILE, SAMPLES_FILE
from qerl_jax.infra.samples import TABLE_KEY, samples_markdown
from qerl_jax.infra.wandb_logging import WandbRun

logger = logging.getLogger(__name__)


def peak_memory_bytes() -> int:
    """Peak device memory where the backend reports it, else the process's peak RSS."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"])
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _finite_or_none(value):
    """Strict JSON: a non-finite float (NaN, +-inf) is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _read_lines(path: str, kind: str = "metrics") -> tuple[list[dict], bool]:
    """(parsed rows, whether a torn last line was dropped) of a run's JSON-lines file. A line
    that is not JSON anywhere but at the end is damage, not an interrupted append: ConfigError
    naming the file and line."""
    with open(path) as handle:
        lines = handle.read().split("\n")
    rows, torn = [], False
    numbered = [(number, line) for number, line in enumerate(lines, start=1) if line.strip()]
    for position, (number, line) in enumerate(numbered):
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or "step" not in row:
                raise ValueError("not an object with a 'step'")
        except ValueError as error:
            if position == len(numbered) - 1:   # an append cut short
                torn = True
                break
            raise ConfigError(f"{path}:{number}: not a {kind} row ({error})") from None
        rows.append(row)
    return rows, torn


def _json_line(row: dict) -> str:
    return json.dumps(row, sort_keys=True, allow_nan=False) + "\n"


class StepLines:
    """A run's file of strict-JSON rows, each with its 'step' (metrics.jsonl, samples.jsonl):
    cut back to the steps before the resumed one at each start, then appended to.

    create=False: a start leaves a missing file missing (the first append creates it)."""

    def __init__(self, path: str, kind: str, *, create: bool = True):
        self.path, self.kind = path, kind   # kind: what a row is, for messages
        self.create = create

    def start(self, resume_step: int) -> list[dict]:
        """Cuts the file back to the rows of steps before `resume_step` (0: empties it) and
        returns them; a torn last line (a kill or a full disk mid-append) is dropped with one
        warning naming the file. The cut file replaces the old one atomically: a failed write
        (StorageError naming the file) leaves it as it was."""
        rows: list[dict] = []
        if os.path.isfile(self.path):
            rows, torn = _read_lines(self.path, self.kind)
            if torn:
                logger.warning("%s: dropped a torn last line (an interrupted write)", self.path)
        elif not self.create:
            return []
        kept = [row for row in rows if row["step"] < resume_step]
        write_text_atomic(self.path, "".join(_json_line(row) for row in kept))
        return kept

    def append(self, rows: list[dict]) -> None:
        """Appends the rows (StorageError naming the file when it cannot be written)."""
        with storage_errors(self.path), open(self.path, "a") as handle:
            handle.write("".join(_json_line(row) for row in rows))
            handle.flush()


class MetricsWriter:
    """Appends one strict-JSON object per step to metrics.jsonl and the sample completions to
    samples.jsonl (TensorBoard scalars and text when tensorboardX is installed and
    `tensorboard` is on; the W&B run `wandb`, when given, gets both)."""

    def __init__(self, workdir: str, tensorboard: bool = False, *, enabled: bool = True,
                 wandb: WandbRun | None = None):
        """enabled=False: start, write and close do nothing (a run's processes but the
        first: one writer per run)."""
        self.enabled = enabled
        self.path = os.path.join(workdir, METRICS_FILE)
        self.lines = StepLines(self.path, "metrics")
        self.samples = StepLines(os.path.join(workdir, SAMPLES_FILE), "samples", create=False)
        self.tensorboard_directory = os.path.join(workdir, "tensorboard")
        self.want_tensorboard = tensorboard
        self.tensorboard = None
        self.wandb = wandb

    @classmethod
    def from_config(cls, config, workdir: str, *, enabled: bool = True) -> "MetricsWriter":
        """The writer config.logging describes: TensorBoard, and the W&B run of
        config.logging.wandb (its config the whole of `config`)."""
        return cls(workdir, config.logging.tensorboard, enabled=enabled,
                   wandb=WandbRun.from_config(config, workdir))

    def _open_tensorboard(self) -> None:
        if not self.want_tensorboard or self.tensorboard is not None:
            return
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            logger.info("tensorboardX is not installed: metrics go to %s only "
                        "(pip install qerl-jax[tensorboard] for TensorBoard event files)",
                        self.path)
            self.want_tensorboard = False
            return
        self.tensorboard = SummaryWriter(self.tensorboard_directory)

    def start(self, resume_step: int) -> None:
        """Cuts metrics.jsonl and samples.jsonl back to the steps before `resume_step` (0:
        empties them; StepLines.start), so a run never holds a step twice, then opens
        TensorBoard and the W&B run (continued when `resume_step` > 0)."""
        if not self.enabled:
            return
        steps = [row["step"] for row in self.lines.start(resume_step)]
        if steps != list(range(resume_step)):
            missing = sorted(set(range(resume_step)) - set(steps))
            logger.warning("%s: steps %s have no metrics row (an earlier run lost them); "
                           "continuing from step %d", self.path, missing[:10], resume_step)
        self.samples.start(resume_step)
        with storage_errors(self.tensorboard_directory):
            self._open_tensorboard()
        if self.wandb is not None:
            self.wandb.start(resume_step)

    def write(self, metrics: dict, samples: list[dict] | None = None) -> None:
        """Appends one row (None and non-finite values as null) and the step's sample records;
        StorageError naming the file when it cannot be written."""
        if not self.enabled:
            return
        step = metrics["step"]
        row = {name: _finite_or_none(value) for name, value in metrics.items()}
        self.lines.append([row])
        if samples:
            self.samples.append(samples)
        if self.tensorboard is not None:
            with storage_errors(self.tensorboard_directory):
                for name, value in metrics.items():
                    if isinstance(value, (int, float)) and math.isfinite(value):
                        self.tensorboard.add_scalar(name, value, step)
                if samples:
                    self.tensorboard.add_text(TABLE_KEY, samples_markdown(samples), step)
                self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log_row(row, step, samples)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb is not None:
            self.wandb.close()


class _Progress:
    """A tqdm bar over the run's steps (None: no bar) showing each step's reward, accuracy and
    entropy."""

    def __init__(self, bar):
        self.bar = bar

    def show(self, metrics: dict) -> None:
        if self.bar is None:
            return
        self.bar.update(1)
        entropy = metrics["entropy"]
        self.bar.set_postfix(reward=f"{metrics['reward']:.3f}", acc=f"{metrics['accuracy']:.2f}",
                             entropy="n/a" if entropy is None else f"{entropy:.3f}",
                             refresh=False)


@contextlib.contextmanager
def progress_bar(enabled: bool, total: int, initial: int):
    """The steps' progress bar (log records print above it), closed when the block ends."""
    if not enabled:
        yield _Progress(None)
        return
    from tqdm import tqdm
    bar = tqdm(total=total, initial=initial, desc="QeRL", unit="step", dynamic_ncols=True)
    try:
        with logging_above_progress_bar(bar):
            yield _Progress(bar)
    finally:
        bar.close()


def read_metrics(workdir: str) -> list[dict]:
    """The rows of a run's metrics.jsonl (a torn last line is left out)."""
    return _read_lines(os.path.join(workdir, METRICS_FILE))[0]


def summary_window(count: int) -> int:
    """Steps per end window of a run's closing summary: a tenth of `count`, at least one."""
    return max(1, count // 10)


def _window_mean(rows: list[dict], key: str) -> float | None:
    values = [row[key] for row in rows if isinstance(row.get(key), (int, float))
              and not isinstance(row.get(key), bool) and math.isfinite(row[key])]
    return sum(values) / len(values) if values else None


def run_summary(rows: list[dict]) -> str | None:
    """The closing line of a run: mean reward, accuracy and entropy over its first and its last
    tenth of training steps (10 steps of 100; at least one), from its metrics rows (evaluation
    rows, which have no reward, are left out); None without training rows."""
    steps = sorted({row["step"]: row for row in rows if "reward" in row}.items())
    if not steps:
        return None
    window = summary_window(len(steps))
    first = [row for _, row in steps[:window]]
    last = [row for _, row in steps[-window:]]

    def span(part: list[dict]) -> str:
        return (f"{part[0]['step']}" if len(part) == 1
                else f"{part[0]['step']}-{part[-1]['step']}")

    def change(key: str) -> str:
        before, after = _window_mean(first, key), _window_mean(last, key)
        text = [f"{value:.3f}" if value is not None else "n/a" for value in (before, after)]
        return f"{key} {text[0]} -> {text[1]}"

    return (f"steps {steps[0][0]}..{steps[-1][0]}: {change('reward')}, {change('accuracy')}, "
            f"{change('entropy')} (means over steps {span(first)} and {span(last)})")


def git_revision() -> str:
    """HEAD's commit, with "-dirty" when tracked files differ from it (the code that ran is
    then not that commit's), or "unknown" outside a git checkout."""
    directory = os.path.dirname(__file__)
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=directory, timeout=10).stdout.strip()
        if not head:
            return "unknown"
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, cwd=directory,
                                 timeout=30).stdout.strip()
        return head + ("-dirty" if changed else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_metadata(config_json: str, seed: int) -> dict:
    """Config, seed, package versions and git revision: written next to the metrics."""
    import flax
    import optax
    import orbax.checkpoint
    return {"seed": seed, "config": json.loads(config_json), "git_revision": git_revision(),
            "versions": {"jax": jax.__version__, "flax": flax.__version__,
                         "optax": optax.__version__, "orbax": orbax.checkpoint.__version__,
                         "python": platform.python_version()},
            "devices": [str(device) for device in jax.devices()]}
