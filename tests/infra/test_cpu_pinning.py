"""qerl_jax.infra.cpu_pinning: the CPU pins of a config act before JAX starts, or raise."""

import os
import subprocess
import sys
import textwrap

import pytest

from qerl_jax.infra.cpu_pinning import merged_xla_flags, pin_cpu_numerics, pinned_cpus
from tests.conftest import REPO_ROOT


def test_pinned_cpus_are_consecutive_ids_from_start_and_never_more_than_there_are():
    assert pinned_cpus({7, 3, 5, 1}, 2) == {1, 3}
    assert pinned_cpus({7, 3, 5, 1}, 2, start=3) == {7, 1}
    assert pinned_cpus({4}, 2, start=5) == {4}


def test_merged_flags_replace_an_earlier_value_of_the_same_flag_only():
    assert merged_xla_flags("--a=1 --b=2", "--b=3 --c") == "--a=1 --b=3 --c"
    assert merged_xla_flags("", "--c=x") == "--c=x"


def test_settings_not_in_effect_after_the_backend_started_raise_naming_the_field():
    import jax

    jax.numpy.zeros(1).block_until_ready()   # the backend has started
    with pytest.raises(ValueError, match=r"config\.xla_flags=.*already started"):
        pin_cpu_numerics(0, "--xla_cpu_enable_fast_math=false --qerl_not_set_here=1")
    if len(os.sched_getaffinity(0)) > 1:
        with pytest.raises(ValueError, match=r"config\.cpu_threads=1: JAX has already started"):
            pin_cpu_numerics(1, "")


def test_a_fresh_process_gets_the_affinity_and_the_flags_before_jax_starts():
    script = textwrap.dedent("""
        import os
        from qerl_jax.infra.cpu_pinning import pin_cpu_numerics
        pin_cpu_numerics(1, "--xla_cpu_enable_fast_math=false")
        import jax
        jax.numpy.zeros(1).block_until_ready()
        print(len(os.sched_getaffinity(0)), os.environ["XLA_FLAGS"])
    """)
    env = dict(os.environ, XLA_FLAGS="--xla_cpu_enable_fast_math=true")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    assert out == ["1", "--xla_cpu_enable_fast_math=false"]
