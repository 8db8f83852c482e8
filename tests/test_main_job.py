"""The README's main job cannot drift: its first GRPO steps, run now in a fresh process (so that
configs/tiny.py's cpu_threads and xla_flags take effect before JAX starts), equal the committed
reference bit for bit (timing fields aside), and the README quotes the reference's summary."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from experiments import main_job_reference as reference
from qerl_jax.infra.metrics import read_metrics
from tests.conftest import REPO_ROOT, config_from_file

FIRST_STEPS = 3

RUN_FIRST_STEPS = textwrap.dedent("""
    import sys
    from tests.conftest import config_from_file
    from qerl_jax.trainer import Trainer
    config = config_from_file("tiny", pinned=True)
    config.logging.progress_bar = False
    Trainer(config, sys.argv[1]).train(stop_after=int(sys.argv[2]))
""")


@pytest.mark.slow
def test_first_steps_equal_the_committed_reference(tmp_path):
    workdir = str(tmp_path / "tiny")
    subprocess.run([sys.executable, "-c", RUN_FIRST_STEPS, workdir, str(FIRST_STEPS)],
                   cwd=REPO_ROOT, check=True)
    expected = reference.read_reference()
    assert len(expected) == config_from_file("tiny").train.total_steps
    assert reference.comparable(read_metrics(workdir)) == expected[:FIRST_STEPS]


def test_reference_records_the_pins_it_was_made_with():
    """summary.json's platform names the CPU settings configs/tiny.py pins now."""
    config = config_from_file("tiny", pinned=True)
    with open(reference.SUMMARY_FILE) as handle:
        platform = json.load(handle)["platform"]
    assert platform["cpu_threads"] == config.cpu_threads
    assert platform["xla_flags"] == config.xla_flags


def test_readme_quotes_the_reference_summary():
    summary = reference.summarize(reference.read_reference())
    with open(os.path.join(REPO_ROOT, "README.md")) as handle:
        readme = handle.read()
    paragraph = readme.split("<!-- main-job-numbers -->", 1)[1].split("\n\n", 1)[0]
    for key in ("reward", "accuracy", "entropy"):
        for end in ("first", "last"):
            value = f"{summary[f'{key}_{end}']:.3f}"
            assert re.search(rf"\b{re.escape(value)}\b", paragraph), (key, end, value)
