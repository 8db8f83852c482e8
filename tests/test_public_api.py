"""The public surface of `qerl_jax`: every exported name resolves, and importing the package
(or its config schema) imports no JAX."""

import subprocess
import sys

import qerl_jax


def test_every_exported_name_resolves():
    for name in qerl_jax.__all__:
        assert getattr(qerl_jax, name) is not None, name


def test_importing_the_package_imports_no_jax():
    code = ("import sys, qerl_jax, qerl_jax.experiment_config; "
            "print(sorted(m for m in ('jax', 'flax', 'optax') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]"
