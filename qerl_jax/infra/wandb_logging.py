"""Weights & Biases logging (the optional `wandb` extra, pip install qerl-jax[wandb]): one W&B
run per training run, its config the run's config, each metrics row logged at its step and the
sample completions as a table; a resumed run continues the same W&B run.

The run directory's wandb_run.json holds the W&B run's id and the last step logged to it; it is
rewritten (atomically) before each new step is logged. A resume cuts metrics.jsonl back to the
resumed step and trains the cut steps again; W&B keeps its first record of them and its steps
only increase, so a resumed run logs only the steps after the last one logged (the steps of a
resume are the same computation, so the records agree). A start at step 0, or without a
wandb_run.json (W&B was off before), is a new W&B run.
W&B's own files go to the run directory's wandb/ (wandb.init's dir is the run directory).
Imports no wandb (nor JAX) until a run starts: the config schema uses `wandb_mode_problem`.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import uuid
from typing import Mapping

from qerl_jax.infra.atomic_io import write_json_atomic
from qerl_jax.infra.errors import ConfigError
from qerl_jax.infra.run_record import WANDB_RUN_FILE
from qerl_jax.infra.samples import TABLE_KEY, table_columns
from qerl_jax.registry import WANDB_MODES

logger = logging.getLogger(__name__)

INSTALL = "pip install qerl-jax[wandb]"


def wandb_mode_problem(mode) -> str | None:
    """What is wrong with logging.wandb.mode `mode`: an unknown name, or a mode that logs while
    the wandb package is not installed; None when it can run."""
    if mode not in WANDB_MODES:
        return WANDB_MODES.unknown_message(mode)
    if WANDB_MODES.get(mode) is not None and importlib.util.find_spec("wandb") is None:
        return f"{mode!r} needs the wandb package ({INSTALL})"
    return None


def loggable(row: Mapping) -> dict:
    """The finite numbers of a metrics row, without its 'step' (W&B's step is the row's)."""
    return {name: value for name, value in row.items()
            if name != "step" and isinstance(value, (int, float)) and math.isfinite(value)}


class WandbRun:
    """The W&B run of one training run: `start` opens it, `log_row` logs a metrics row (and its
    sample records), `close` finishes it. mode 'off': every call does nothing."""

    def __init__(self, workdir: str, *, mode: str, project: str, run_name: str, config: dict):
        self.workdir = workdir
        self.mode = WANDB_MODES.get(mode)          # wandb.init's mode, None = no run
        self.project = project
        self.run_name = run_name or os.path.basename(os.path.normpath(workdir))
        self.config = config
        self.record_path = os.path.join(workdir, WANDB_RUN_FILE)
        self.run = None
        self.record: dict = {}
        self.logged_before = -1   # the last step an earlier start logged

    @classmethod
    def from_config(cls, config, workdir: str) -> "WandbRun":
        """The W&B run config.logging.wandb describes, its config the whole of `config`."""
        settings = config.logging.wandb
        return cls(workdir, mode=settings.mode, project=settings.project,
                   run_name=settings.run_name, config=json.loads(config.to_json()))

    def _earlier_record(self, resume_step: int) -> dict | None:
        """The W&B run a start at `resume_step` continues: wandb_run.json's, if any."""
        if resume_step <= 0 or not os.path.isfile(self.record_path):
            return None
        try:
            with open(self.record_path) as handle:
                record = json.load(handle)
            if not isinstance(record.get("id"), str) or not isinstance(record.get("last_step"),
                                                                       int):
                raise ValueError("no 'id' string and 'last_step' integer")
        except (ValueError, AttributeError) as error:
            raise ConfigError(f"{self.record_path}: not a W&B run record ({error}); move it "
                              "aside to start a new W&B run") from None
        return record

    def start(self, resume_step: int) -> None:
        """Opens the W&B run: the one wandb_run.json names when `resume_step` > 0 (wandb's
        resume='allow'), else a new one."""
        if self.mode is None:
            return
        import wandb

        record = self._earlier_record(resume_step)
        if record is None:
            record = {"id": uuid.uuid4().hex[:16], "last_step": -1}
        self.record = {**record, "project": self.project, "name": self.run_name}
        self.logged_before = record["last_step"]
        write_json_atomic(self.record_path, self.record)
        try:
            self.run = wandb.init(project=self.project, name=self.run_name, mode=self.mode,
                                  dir=self.workdir, config=self.config, id=record["id"],
                                  resume="allow")
        except wandb.errors.Error as error:   # no login, no network: the config's to change
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise ConfigError(f"config.logging.wandb.mode: {self.mode!r}: wandb.init failed: "
                              f"{reason}") from None
        logger.info("W&B run %s (%s, %s)%s", record["id"], self.project, self.mode,
                    f", continuing after step {self.logged_before}"
                    if self.logged_before >= 0 else "")

    def log_row(self, row: Mapping, step: int, samples: list[dict] | None = None) -> None:
        """Logs a metrics row's numbers (and the step's sample records as a table) at `step`;
        a step an earlier start logged is left out."""
        if self.run is None or step <= self.logged_before:
            return
        values = loggable(row)
        if samples:
            import wandb
            columns, rows = table_columns(samples)
            values[TABLE_KEY] = wandb.Table(columns=columns, data=rows)
        if step > self.record["last_step"]:
            self.record["last_step"] = step
            write_json_atomic(self.record_path, self.record)
        self.run.log(values, step=step)

    def close(self) -> None:
        """Finishes the W&B run (its files complete; online: uploaded)."""
        if self.run is not None:
            self.run.finish()
            self.run = None
