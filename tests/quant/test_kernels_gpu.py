"""The linear op's compiled kernel paths against its XLA path, on the GPU (`pytest -m gpu`).

For NVFP4, MXFP4 and NF4 weights of Qwen2.5-7B layer shapes, `linear` on the kernel-layout
weight (qerl_jax.quant.kernel_registry: the Triton fused kernel for M <= 64, the Pallas
dequantize kernel + an XLA dot above, and for dx = dy @ W) against `linear` on the
checkpoint-layout weight (jnp dequantize + XLA dot):
- forward, and forward + backward (y and dx): max|y - y_xla| <= 2^-6 max|y_xla|. The kernels
  decode each weight exactly and apply the NVFP4 tensor scale to float32 sums, the XLA path
  rounds each w / tensor_scale to bf16 (tests/quant/test_kernels.py on the CPU).
- with an unmerged LoRA (x @ A) @ B in the fused kernel's epilogue: y, dx, dA and dB within
  2^-5 max|reference| (two more bf16 roundings), and the jaxpr holds the epilogue kernel.
The Mosaic GPU NVFP4 path (Hopper) is tested in tests/pallas_kernels/test_mgpu_nvfp4_gpu.py.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qerl_jax.quant import kernel_registry
from qerl_jax.quant.backends import kernel_layout
from qerl_jax.quant.backends.triton import kernel_names
from qerl_jax.quant.dispatch import select_matmul_path
from qerl_jax.quant.formats import get_format
from qerl_jax.quant.kernel_options import KernelOptions
from qerl_jax.quant.linear_op import LoRAProduct, linear

pytestmark = pytest.mark.gpu

FORMATS = ("nvfp4", "mxfp4", "nf4")
# (layer, N, K) of Qwen2.5-7B: the largest K, the narrow k/v (split-K at decode), q/o
SHAPES = {"down": (3584, 18944), "q/o": (3584, 3584), "k/v": (512, 3584)}
DISPATCH_TOLERANCE = 2.0 ** -6
LORA_TOLERANCE = 2.0 ** -5


@pytest.fixture(scope="module", autouse=True)
def gpu_kernels():
    # the Triton kernels alone: the Mosaic backend, asked first on Hopper, would refuse these
    # kernel-layout weights anyway (they have no permuted copy)
    kernel_registry.register_kernels("gpu", KernelOptions(mosaic_nvfp4="off"))


def _seed(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


@functools.lru_cache(maxsize=2)
def _weights(format_name: str, n: int, k: int):
    """(checkpoint-layout QuantizedWeight, its kernel-layout copy) of a N(0, 0.02) weight."""
    dense = 0.02 * jax.random.normal(jax.random.key(_seed(format_name, n, k)), (n, k),
                                     jnp.float32)
    quantized = get_format(format_name).quantize(dense, name=f"{format_name}[{n}x{k}]",
                                                 check_finite=False)
    prepared = kernel_layout.to_kernel_layout(quantized)
    assert isinstance(prepared, kernel_layout.KernelLayoutWeight), "kept the XLA layout"
    return quantized, prepared


def _relative_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    if not np.all(np.isfinite(actual)):
        return float("inf")
    return float(np.abs(actual - expected).max() / max(float(np.abs(expected).max()), 1e-30))


@jax.jit
def _forward(x, weight):
    return linear(x, weight, compute_dtype=jnp.bfloat16)


@jax.jit
def _forward_backward(x, dy, weight):
    y, vjp = jax.vjp(lambda x: linear(x, weight, compute_dtype=jnp.bfloat16), x)
    return y, vjp(dy)[0]


@pytest.mark.parametrize("layer", ["down", "k/v"])
@pytest.mark.parametrize("format_name", FORMATS)
def test_dispatched_paths_match_the_xla_path(format_name, layer):
    """M = 1 and 64 (the fused kernel: split-K, and its largest M), 2048 (a training
    micro-batch: the dequantize kernel + XLA dot), forward and, at 2048, forward + backward."""
    n, k = SHAPES[layer]
    quantized, prepared = _weights(format_name, n, k)
    fused, dequantize = kernel_names(format_name)
    rng = np.random.default_rng(_seed(format_name, layer))
    for m in (1, 64, 2048):
        path = select_matmul_path(format_name, m, "gpu")
        assert path == (fused if m <= kernel_layout.KERNEL_FORMATS[format_name].max_fused_m else dequantize)
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        error = _relative_error(_forward(x, prepared), _forward(x, quantized))
        assert error <= DISPATCH_TOLERANCE, f"{format_name} {layer} M={m} ({path}): {error:.3g}"
    for m in (2048,):  # dx = dy @ W: the dequantize kernel + XLA dot at every M
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
        y, dx = _forward_backward(x, dy, prepared)
        y_xla, dx_xla = _forward_backward(x, dy, quantized)
        for name, got, want in (("y", y, y_xla), ("dx", dx, dx_xla)):
            error = _relative_error(got, want)
            assert error <= DISPATCH_TOLERANCE, f"{format_name} {layer} M={m} {name}: {error:.3g}"


LORA_CASES = [("q/o", 8, 32), ("q/o", 64, 32), ("down", 1, 32), ("down", 8, 8)]


@pytest.mark.parametrize("layer,m,rank", LORA_CASES)
@pytest.mark.parametrize("format_name", FORMATS)
def test_lora_epilogue_matches_the_xla_path(format_name, layer, m, rank):
    """linear(x, W, b, lora=LoRAProduct(A, B, 2)) with the product in the fused kernel's
    epilogue against separate XLA dots on the checkpoint-layout weight: output and the
    gradients of x, A and B."""
    n, k = SHAPES[layer]
    rng = np.random.default_rng(_seed(format_name, n, k, m, rank))
    dense = jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.float32)
    quantized = get_format(format_name).quantize(dense, name="check.proj")
    prepared = kernel_layout.to_kernel_layout(quantized)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(n) * 0.1, jnp.float32)
    a = jnp.asarray(rng.standard_normal((k, rank)) * 0.05, jnp.float32)
    b = jnp.asarray(rng.standard_normal((rank, n)) * 0.05, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)

    def apply(x, a, b, weight):
        return linear(x, weight, bias, compute_dtype=jnp.bfloat16, lora=LoRAProduct(a, b, 2.0))

    @jax.jit
    def forward_and_grads(x, a, b, weight):
        y, vjp = jax.vjp(lambda x, a, b: apply(x, a, b, weight), x, a, b)
        return (y, *vjp(dy))

    jaxpr = str(jax.make_jaxpr(lambda x: apply(x, a, b, prepared))(x))
    assert f"{format_name}_matmul_lora" in jaxpr, "the LoRA epilogue kernel did not run"
    got = forward_and_grads(x, a, b, prepared)
    want = forward_and_grads(x, a, b, quantized)
    for name, value, reference in zip(("y", "dx", "dA", "dB"), got, want):
        error = _relative_error(value, reference)
        assert error <= LORA_TOLERANCE, f"{format_name} {layer} M={m} r{rank} {name}: {error:.3g}"
