"""The README's main job cannot drift: its first GRPO steps, run now, equal the committed
reference bit for bit (timing fields aside), and the README quotes the reference's summary."""

import os
import re

from experiments import main_job_reference as reference
from qerl_jax.infra.metrics import read_metrics
from qerl_jax.trainer import Trainer
from tests.conftest import config_from_file

ROOT = os.path.join(os.path.dirname(__file__), "..")
FIRST_STEPS = 3


def _main_job_config():
    return config_from_file("tiny")


def test_first_steps_equal_the_committed_reference(tmp_path):
    config = _main_job_config()
    config.logging.progress_bar = False
    workdir = str(tmp_path / "tiny")
    Trainer(config, workdir).train(stop_after=FIRST_STEPS)
    expected = reference.read_reference()
    assert len(expected) == config.train.total_steps
    assert reference.comparable(read_metrics(workdir)) == expected[:FIRST_STEPS]


def test_readme_quotes_the_reference_summary():
    summary = reference.summarize(reference.read_reference())
    with open(os.path.join(ROOT, "README.md")) as handle:
        readme = handle.read()
    paragraph = readme.split("<!-- main-job-numbers -->", 1)[1].split("\n\n", 1)[0]
    for key in ("reward", "accuracy", "entropy"):
        for end in ("first", "last"):
            value = f"{summary[f'{key}_{end}']:.3f}"
            assert re.search(rf"\b{re.escape(value)}\b", paragraph), (key, end, value)
