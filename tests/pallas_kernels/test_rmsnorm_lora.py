"""The RMSNorm + LoRA x @ A kernel (pallas_kernels/rmsnorm_lora.py) in interpret mode against a
float64 numpy reference.

Tolerances:
- normed: the float32 norm rounded once to bf16 (half an ulp, <= 2^-8 |ref|); the kernel's
  float32 mean square is summed in another order than the reference's, which can move a value
  across a rounding boundary: so |normed - ref| <= 2^-7 |ref| (>= one bf16 ulp) + 1e-6.
- down: the kernel's own bf16 normed times A rounded to bf16, float32 accumulation, rounded once
  to bf16: |down - ref| <= 2^-8 |ref| + 1e-5 sum_k |normed_k| |A_k| (the float32 sums' error is
  far below the bf16 rounding; the float64 reference is taken from the kernel's normed output so
  that the norm's ulp is not counted twice).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.rmsnorm_lora import (RMSNormLoRAConfig, rmsnorm_lora_down,
                                         rmsnorm_lora_down_reference)

EPS = 1e-6


def _problem(seed, m, h, r, x_dtype=jnp.bfloat16, scale_dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, h)) * rng.uniform(0.1, 8.0, (m, 1)), x_dtype)
    scale = jnp.asarray(1.0 + 0.2 * rng.standard_normal(h), scale_dtype)
    lora_a = jnp.asarray(rng.standard_normal((h, r)) / np.sqrt(h), jnp.float32)
    return x, scale, lora_a


def _reference_normed(x, scale):
    x = np.asarray(x, np.float64)
    rms = np.sqrt(np.mean(x * x, axis=1, keepdims=True) + EPS)
    return x / rms * np.asarray(scale, np.float64)[None, :]


@pytest.mark.parametrize("m,h,r,chunk,x_dtype,scale_dtype", [
    (8, 640, 96, 128, jnp.bfloat16, jnp.float32),   # q|k|v-like: R = 3 x 32, not a power of 2
    (5, 300, 64, 128, jnp.bfloat16, jnp.bfloat16),  # ragged H and M, a bf16 scale
    (1, 512, 8, 256, jnp.float32, jnp.float32),     # one row, rank below the dot's 16
    (64, 256, 32, 256, jnp.bfloat16, jnp.float32),  # the largest M, one program
])
def test_kernel_matches_float64_reference(m, h, r, chunk, x_dtype, scale_dtype):
    x, scale, lora_a = _problem(m * 1000 + h, m, h, r, x_dtype, scale_dtype)
    config = RMSNormLoRAConfig(chunk=chunk)
    normed, down = rmsnorm_lora_down(x, scale, lora_a, eps=EPS, config=config, interpret=True)
    assert normed.shape == (m, h) and normed.dtype == jnp.bfloat16
    assert down.shape == (m, r) and down.dtype == jnp.bfloat16
    expected = _reference_normed(x, scale)
    normed64 = np.asarray(normed, np.float64)
    assert np.all(np.abs(normed64 - expected) <= 2.0 ** -7 * np.abs(expected) + 1e-6)
    a64 = np.asarray(lora_a.astype(jnp.bfloat16), np.float64)
    product = normed64 @ a64
    bound = 2.0 ** -8 * np.abs(product) + 1e-5 * (np.abs(normed64) @ np.abs(a64))
    assert np.all(np.abs(np.asarray(down, np.float64) - product) <= bound)


def test_kernel_agrees_with_the_jnp_reference_and_its_gradient():
    """The jnp reference (the model's RMSNorm then an XLA dot) gives the same outputs within the
    tolerances above, and the kernel's custom VJP is the reference's."""
    x, scale, lora_a = _problem(3, 4, 384, 48)
    config = RMSNormLoRAConfig(chunk=128)
    got = rmsnorm_lora_down(x, scale, lora_a, eps=EPS, config=config, interpret=True)
    want = rmsnorm_lora_down_reference(x, scale, lora_a, eps=EPS)
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.all(np.abs(g - w) <= 2.0 ** -7 * np.abs(w) + 1e-3 * np.abs(w).max())

    def loss(fn, *args):
        normed, down = fn(*args)
        return (jnp.sum(normed.astype(jnp.float32) ** 2)
                + jnp.sum(jnp.sin(down.astype(jnp.float32))))

    kernel = lambda *a: rmsnorm_lora_down(*a, eps=EPS, config=config, interpret=True)
    reference = lambda *a: rmsnorm_lora_down_reference(*a, eps=EPS)
    x32 = x.astype(jnp.float32)
    grads = jax.grad(lambda *a: loss(kernel, *a), argnums=(0, 1, 2))(x32, scale, lora_a)
    expected = jax.grad(lambda *a: loss(reference, *a), argnums=(0, 1, 2))(x32, scale, lora_a)
    for g, w in zip(grads, expected):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_bad_shapes_and_configs_are_refused():
    x, scale, lora_a = _problem(0, 2, 64, 16)
    with pytest.raises(ValueError, match=r"scale \(63,\)"):
        rmsnorm_lora_down(x, scale[:63], lora_a, eps=EPS, interpret=True)
    with pytest.raises(ValueError, match=r"lora_a \(32, 16\)"):
        rmsnorm_lora_down(x, scale, lora_a[:32], eps=EPS, interpret=True)
    with pytest.raises(ValueError, match=r"x \(65, 64\)"):
        rmsnorm_lora_down(jnp.ones((65, 64)), scale, lora_a, eps=EPS, interpret=True)
    with pytest.raises(ValueError, match="chunk=96"):
        RMSNormLoRAConfig(chunk=96)
