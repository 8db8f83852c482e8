"""The Pallas kernels per device on a mesh of GPUs (compiled, not interpreted): the CPU test
tests/parallel/test_mesh.py::test_pallas_kernels_run_per_device_on_a_mesh on the meshes the
machine's GPUs fit (data=2 needs 2 GPUs, data=2 x tensor=2 4, the data=8 launches 8)."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests.parallel.test_mesh import REPO, WORKER

pytestmark = pytest.mark.gpu


def test_pallas_kernels_run_per_device_on_gpus(tmp_path):
    """Every launch equals the same kernel on each GPU's rows bit for bit; greedy tokens equal
    one GPU's; the loss within 1e-5 relative and the gradients within 1e-3 of each leaf's
    largest magnitude (the CPU test's bounds, the loss's loosened for the GPU's bfloat16
    dots)."""
    if jax.device_count() < 2:
        pytest.skip(f"needs 2 GPUs (this machine has {jax.device_count()})")
    out = str(tmp_path / "kernels.npz")
    result = subprocess.run([sys.executable, WORKER, "kernels", out], cwd=REPO,
                            env=dict(os.environ), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    results = np.load(out)
    single = {key.split("/", 1)[1]: results[key] for key in results if key.startswith("single/")}
    meshes = sorted({key.split("/")[0] for key in results if "/launch/" in key})
    assert "data=2" in meshes
    for mesh in meshes:
        launches = [key for key in results if key.startswith(f"{mesh}/launch/")]
        assert launches and all(bool(results[key]) for key in launches), \
            [key for key in launches if not results[key]]
        if f"{mesh}/tokens" not in results:   # the data=8 launches only
            continue
        np.testing.assert_array_equal(results[f"{mesh}/tokens"], single["tokens"], err_msg=mesh)
        np.testing.assert_allclose(results[f"{mesh}/loss"], single["loss"], rtol=1e-5,
                                   err_msg=mesh)
        for name in (name for name in single if name.startswith("grad0")):
            scale = np.max(np.abs(single[name]))
            assert np.max(np.abs(results[f"{mesh}/{name}"] - single[name])) <= 1e-3 * scale, \
                (mesh, name)
