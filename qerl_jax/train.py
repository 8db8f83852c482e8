"""CLI: python -m qerl_jax.train --config configs/X.py [--config.field=value ...] --workdir DIR
[--resume]. Thin: parses the config, hands it to the Trainer."""

from __future__ import annotations

import logging
import os

from absl import app, flags
from ml_collections import config_flags

from qerl_jax.trainer import Trainer

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file (configs/*.py)",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory (metrics, checkpoints, plots)")
_RESUME = flags.DEFINE_bool("resume", False, "continue from the last checkpoint in --workdir")


def main(argv):
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every save step at INFO
    if _CONFIG.value is None:
        raise app.UsageError("--config is required (e.g. --config configs/tiny.py)")
    if not _WORKDIR.value:
        raise app.UsageError("--workdir is required")
    trainer = Trainer(_CONFIG.value, os.path.abspath(_WORKDIR.value))
    history = trainer.train(resume=_RESUME.value)
    if history:
        first, last = history[0], history[-1]
        print(f"steps {first['step']}..{last['step']}: reward {first['reward']:.3f} -> "
              f"{last['reward']:.3f}, accuracy {first['accuracy']:.3f} -> "
              f"{last['accuracy']:.3f}; metrics in {trainer.metrics.path}")


if __name__ == "__main__":
    app.run(main)
