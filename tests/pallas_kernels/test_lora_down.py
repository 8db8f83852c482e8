"""The LoRA down partial-sums kernel (pallas_kernels/lora_down.py) in interpret mode against
float64 numpy.

Tolerance: the operands are bf16 values in both (the kernel rounds x and A to bf16, the
reference uses the same rounded values in float64); the kernel accumulates in float32, so each
partial sum is within 1e-5 * sum |x||A| of the float64 one (K <= 4096 products, float32 unit
roundoff 6e-8 times K). Gradients: float32 products of the same operands, within 1e-5 of the
largest float64 gradient.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.lora_down import (LoRADownConfig, lora_down_partials,
                                      lora_down_partials_reference, split_plan)


def _problem(seed, m, k, r):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    a = jnp.asarray(rng.standard_normal((k, r)) * 0.05, jnp.bfloat16)
    return rng, x, a


def _slices(k, config):
    _, per_split, splits = split_plan(k, config)
    width = per_split * config.block_k
    return [(s * width, min(k, (s + 1) * width)) for s in range(splits)]


@pytest.mark.parametrize("m,k,r,config", [
    (8, 3584, 96, LoRADownConfig()),                           # 7B q|k|v at batch 8: 7 slices
    (5, 1000, 24, LoRADownConfig(splits=3, block_k=64, block_r=16)),  # ragged K, M and r
    (20, 256, 32, LoRADownConfig(splits=16)),                  # 2 K blocks: 2 slices; 2 M tiles
    (1, 320, 8, LoRADownConfig(splits=1)),                     # one slice
])
def test_partials_match_float64_slices(m, k, r, config):
    _, x, a = _problem(0, m, k, r)
    partials = np.asarray(lora_down_partials(x, a, config=config, interpret=True))
    slices = _slices(k, config)
    assert partials.shape == (len(slices), m, r) and partials.dtype == np.float32
    x64, a64 = np.asarray(x, np.float64), np.asarray(a, np.float64)
    for s, (lo, hi) in enumerate(slices):
        want = x64[:, lo:hi] @ a64[lo:hi]
        bound = 1e-5 * (np.abs(x64[:, lo:hi]) @ np.abs(a64[lo:hi])).max()
        assert np.abs(partials[s] - want).max() <= bound, (s, lo, hi)
    np.testing.assert_allclose(partials.sum(0), x64 @ a64,
                               atol=1e-5 * (np.abs(x64) @ np.abs(a64)).max())
    reference = np.asarray(lora_down_partials_reference(x, a, config))
    np.testing.assert_allclose(partials, reference, atol=1e-5 * np.abs(reference).max())


def test_gradients_match_float64():
    config = LoRADownConfig(splits=3, block_k=64, block_r=16)
    rng, x, a = _problem(1, 5, 1000, 24)
    x, a = x.astype(jnp.float32), a.astype(jnp.float32)
    slices = _slices(1000, config)
    weights = jnp.asarray(rng.standard_normal((len(slices), 5, 24)), jnp.float32)

    def loss(x, a):
        return jnp.sum(lora_down_partials(x, a, config=config, interpret=True) * weights)

    dx, da = jax.grad(loss, (0, 1))(x, a)
    x64, a64, w64 = (np.asarray(v, np.float64) for v in (x, a, weights))
    dx_ref, da_ref = np.zeros_like(x64), np.zeros_like(a64)
    for s, (lo, hi) in enumerate(slices):
        dx_ref[:, lo:hi] = w64[s] @ a64[lo:hi].T
        da_ref[lo:hi] = x64[:, lo:hi].T @ w64[s]
    for got, want in ((dx, dx_ref), (da, da_ref)):
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5 * np.abs(want).max())


def test_bad_shapes_and_configs_are_named():
    x = jnp.ones((4, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"x \(4, 64\) and A \(32, 8\)"):
        lora_down_partials(x, jnp.ones((32, 8), jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match="block_r=24"):
        lora_down_partials(x, jnp.ones((64, 8), jnp.bfloat16),
                           config=LoRADownConfig(block_r=24), interpret=True)
    with pytest.raises(ValueError, match="splits=0"):
        lora_down_partials(x, jnp.ones((64, 8), jnp.bfloat16),
                           config=LoRADownConfig(splits=0), interpret=True)
