"""The quantizers on the GPU give the CPU's codes and scales, byte for byte (`pytest -m gpu`).

Each format's quantize (get_format(name).quantize under jit) runs on the GPU and on the CPU
backend of the same process; every output array must be identical bit for bit. Inputs, in
float32 and bfloat16 (seeded, [256, 512]): Gaussian N(0, 0.02), Student-t (df 3) x 0.02, and
special blocks: all zero, huge (1e30), tiny (1e-30: below the fp8 subnormal range after
scaling) and exact E2M1 ties. The CPU results themselves are checked against compressed-tensors
and bitsandbytes in test_nvfp4.py, test_mxfp4.py and test_nf4.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qerl_jax.quant.formats import get_format

pytestmark = pytest.mark.gpu


def _weights(seed: int, dtype) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (256, 512)
    gaussian = rng.normal(0, 0.02, shape).astype(np.float32)
    student = (rng.standard_t(3, shape) * 0.02).astype(np.float32)
    special = rng.normal(0, 1, shape).astype(np.float32)
    special[0, :64] = 0.0                                   # all-zero blocks
    special[1, :64] *= 1e30                                 # huge blocks
    special[2, :64] *= 1e-30                                # tiny blocks
    levels = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    special[3, :] = np.resize(np.concatenate([levels, -levels, [6.0]]), 512)  # E2M1 ties
    out = {"gaussian": gaussian, "student_t3": student, "special_blocks": special}
    return {name: np.asarray(jnp.asarray(w, dtype)) for name, w in out.items()}


def _quantize_on(device, fmt, weight) -> list[np.ndarray]:
    """The quantized pytree's arrays, computed under jit on `device`, as host numpy arrays."""
    with jax.default_device(device):
        array = jax.device_put(weight, device)
        quantized = jax.jit(lambda w: fmt.quantize(w, check_finite=False))(array)
        return [np.atleast_1d(np.asarray(jax.device_get(leaf)))
                for leaf in jax.tree_util.tree_leaves(quantized)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("format_name", ["nvfp4", "mxfp4", "nf4"])
def test_gpu_quantizer_equals_cpu_byte_for_byte(format_name, dtype):
    gpu, cpu = jax.devices()[0], jax.devices("cpu")[0]
    fmt = get_format(format_name)
    for name, weight in _weights(0, dtype).items():
        on_gpu, on_cpu = _quantize_on(gpu, fmt, weight), _quantize_on(cpu, fmt, weight)
        assert len(on_gpu) == len(on_cpu), name
        for index, (a, c) in enumerate(zip(on_gpu, on_cpu)):
            assert a.dtype == c.dtype and a.shape == c.shape, (name, index, a.dtype, c.dtype)
            mismatched = int((a.view(np.uint8) != c.view(np.uint8)).sum())
            assert mismatched == 0, (f"{format_name} {jnp.dtype(dtype).name} {name}: array "
                                     f"{index} differs in {mismatched} bytes")
