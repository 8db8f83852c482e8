"""qerl_jax.infra.xla_autotuning: the XLA_FLAGS it composes, and its clear errors.

That the flags make GPU rollouts reproducible is measured on the GPU (benchmarks/RESULTS.md,
"Reproducible GPU rollouts"): the CPU backend accepts the flags and ignores them.
"""

import os
import subprocess
import sys
import textwrap

import ml_collections
import pytest

from qerl_jax import experiment_config
from qerl_jax.infra.xla_autotuning import (DUMP_FLAG, LOAD_FLAG, autotune_xla_flags,
                                     persist_autotuning)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_flags_dump_always_load_only_an_existing_file_and_replace_earlier_values():
    assert autotune_xla_flags("", "/r/a.textproto", exists=False) == \
        f"{DUMP_FLAG}=/r/a.textproto"
    assert autotune_xla_flags("--xla_foo=1", "/r/a.textproto", exists=True) == \
        f"--xla_foo=1 {LOAD_FLAG}=/r/a.textproto {DUMP_FLAG}=/r/a.textproto"
    earlier = f"{LOAD_FLAG}=/old {DUMP_FLAG}=/old --xla_bar=2"
    assert autotune_xla_flags(earlier, "/new dir/a", exists=True) == \
        f"--xla_bar=2 '{LOAD_FLAG}=/new dir/a' '{DUMP_FLAG}=/new dir/a'"


def test_empty_path_is_off(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1")
    assert persist_autotuning("") is None
    assert os.environ["XLA_FLAGS"] == "--xla_foo=1"


def test_errors_name_the_field(tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")
    with pytest.raises(ValueError, match="config.xla_autotune_results: .* is a directory"):
        persist_autotuning(str(tmp_path))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="config.xla_autotune_results: cannot create"):
        persist_autotuning(str(blocker / "sub" / "a.textproto"))
    # this test process has started JAX's CPU backend (other tests ran computations first, or
    # start it here): the flags could not take effect any more
    import jax.numpy as jnp
    jnp.ones(2).block_until_ready()
    with pytest.raises(ValueError, match="already started its backend"):
        persist_autotuning(str(tmp_path / "a.textproto"))
    assert os.environ["XLA_FLAGS"] == ""
    fields = experiment_config.base_config().to_dict()
    fields["xla_autotune_results"] = 3  # a ConfigDict keeps a field's type: build it so
    config = ml_collections.ConfigDict(fields)
    with pytest.raises(ValueError, match="xla_autotune_results"):
        experiment_config.validate_config(config)


def test_fresh_process_sets_the_flags_before_the_backend_starts(tmp_path):
    """In a fresh process: the first call sets the dump flag only, a later process (file
    present) loads and dumps, and a second call in the same process (another trainer) is
    accepted although the backend has started."""
    path = tmp_path / "runs" / "autotune.textproto"
    script = textwrap.dedent(f"""
        import os, jax.numpy as jnp
        from qerl_jax.infra.xla_autotuning import persist_autotuning
        assert persist_autotuning({str(path)!r}) == {str(path)!r}
        print(os.environ["XLA_FLAGS"])
        jnp.ones(2).block_until_ready()
        assert persist_autotuning({str(path)!r}) == {str(path)!r}
    """)
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu", PYTHONPATH=REPO)

    def run():
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().splitlines()[-1]

    assert run() == f"{DUMP_FLAG}={path}"
    assert path.parent.is_dir()
    path.write_text("results {}\n")  # what a GPU run would have written
    assert run() == f"{LOAD_FLAG}={path} {DUMP_FLAG}={path}"
