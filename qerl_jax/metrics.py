"""Run metrics: JSONL always, TensorBoard optional, plus run metadata and curve plots."""

from __future__ import annotations

import json
import logging
import os
import platform
import resource
import subprocess
from typing import Sequence

import jax

logger = logging.getLogger(__name__)


def peak_memory_bytes() -> int:
    """Peak device memory where the backend reports it, else the process's peak RSS."""
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"])
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class MetricsWriter:
    """Appends one JSON object per step to metrics.jsonl (and TensorBoard scalars if asked)."""

    def __init__(self, workdir: str, tensorboard: bool = False):
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.tensorboard = None
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
                self.tensorboard = SummaryWriter(os.path.join(workdir, "tensorboard"))
            except ImportError:
                logger.warning("TensorBoard logging asked for but tensorboardX is not "
                               "installed; writing JSONL only")

    def truncate_after(self, step: int) -> None:
        """Drops lines of steps > `step` (a resume replays them)."""
        if not os.path.isfile(self.path):
            return
        with open(self.path) as handle:
            lines = [line for line in handle if line.strip()
                     and json.loads(line)["step"] <= step]
        with open(self.path, "w") as handle:
            handle.writelines(lines)

    def write(self, metrics: dict) -> None:
        with open(self.path, "a") as handle:
            handle.write(json.dumps(metrics, sort_keys=True) + "\n")
        if self.tensorboard is not None:
            for name, value in metrics.items():
                if isinstance(value, (int, float)):
                    self.tensorboard.add_scalar(name, value, metrics["step"])
            self.tensorboard.flush()


def read_metrics(workdir: str) -> list[dict]:
    path = os.path.join(workdir, "metrics.jsonl")
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def git_revision() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(__file__), timeout=10).stdout.strip() or "unknown"
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


def plot_curves(metrics: Sequence[dict], path: str,
                keys: Sequence[str] = ("reward", "entropy", "accuracy")) -> None:
    """PNG of each metric in `keys` against step (one panel each)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = [key for key in keys if any(key in row for row in metrics)]
    figure, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.4), squeeze=False)
    steps = [row["step"] for row in metrics]
    for axis, key in zip(axes[0], keys):
        axis.plot(steps, [row.get(key, float("nan")) for row in metrics], marker=".")
        axis.set_xlabel("step")
        axis.set_title(key)
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
