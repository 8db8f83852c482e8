"""The decode-attention kernel (pallas_kernels/decode_attention.py) in interpret mode against a
float64 numpy reference.

Tolerance: scores and softmax run in float32; the probabilities are rounded to bf16 for the
p @ v product (<= 2^-9 relative each) and the output to bf16 (<= 2^-9), so |out - ref| <= 1e-2 *
max |ref| (a few bf16 ulps of the largest output); q, k, v are bf16 inputs in both.
"""

import numpy as np
import jax.numpy as jnp
import pytest

from pallas_kernels.decode_attention import (DecodeAttentionConfig, decode_attention,
                                             default_splits)

TOLERANCE = 1e-2


def _reference(q, k, v, mask, length, scale):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    mask = np.asarray(mask) & (np.arange(k.shape[1]) < length)[None, :]
    scores = np.einsum("bkgd,bskd->bkgs", q, k) * scale
    scores = np.where(mask[:, None, None, :], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("bkgs,bskd->bkgd", probs, v)


def _problem(seed, batch, slots, kv_heads, groups, head_dim):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((batch, kv_heads, groups, head_dim)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((batch, slots, kv_heads, head_dim)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((batch, slots, kv_heads, head_dim)), jnp.bfloat16)
    return rng, q, k, v


@pytest.mark.parametrize("slots,length,groups,block_s,splits", [
    (200, 150, 7, 32, 3),     # ragged cache, length inside the last split's range
    (200, 200, 7, 32, None),  # full cache, default splits
    (96, 17, 2, 16, 4),       # early decode: the later splits read nothing
    (64, 64, 16, 64, 1),      # one split, one block (normalized in the kernel, no combine)
    (200, 150, 7, 32, 1),     # one split over several blocks, ragged cache
    (256, 100, 5, 16, 5),     # 4 splits (16 blocks / 4 each); balanced: 7 used -> 2, 2, 2, 1
    (160, 150, 3, 16, 4),     # 10 blocks, 4 splits of 3: the last gets one block
])
@pytest.mark.parametrize("balanced", [1, 0])
def test_matches_reference(slots, length, groups, block_s, splits, balanced):
    seed = int(np.random.default_rng().integers(1 << 31))
    rng, q, k, v = _problem(seed, 3, slots, 2, groups, 32)
    mask = rng.random((3, slots)) < 0.8
    mask[:, 0] = True  # every row attends to something in range
    mask[1, :5] = False  # a left-padded row
    scale = 32 ** -0.5
    out = decode_attention(q, k, v, jnp.asarray(mask), length, scale=scale,
                           config=DecodeAttentionConfig(block_s=block_s, splits=splits,
                                                        balanced=balanced),
                           interpret=True)
    ref = _reference(q, k, v, mask, length, scale)
    assert out.shape == ref.shape and out.dtype == jnp.bfloat16
    err = np.abs(np.asarray(out, np.float32) - ref).max() / np.abs(ref).max()
    assert err <= TOLERANCE, f"seed={seed} relative error {err:.2e}"


@pytest.mark.parametrize("splits,rank", [(4, 16), (1, 16), (4, 24)])
def test_lora_down_of_the_output_rows(splits, rank):
    """lora_a: the per-head products returned with the output (by the combine kernel with
    splits and a power-of-two rank, by XLA otherwise) equal float64 products of the returned
    bf16 rows: their sum over heads is the o-projection's x @ A (float32 sums, tolerance
    2^-20 relative to the largest |x @ A| contribution), and the output is unchanged."""
    seed = int(np.random.default_rng().integers(1 << 31))
    rng, q, k, v = _problem(seed, 3, 96, 2, 3, 32)
    mask = jnp.asarray(rng.random((3, 96)) < 0.9)
    lora_a = jnp.asarray(rng.standard_normal((2 * 3 * 32, rank)), jnp.bfloat16)
    config = DecodeAttentionConfig(block_s=16, splits=splits)
    plain = decode_attention(q, k, v, mask, 70, scale=0.2, config=config, interpret=True)
    out, down = decode_attention(q, k, v, mask, 70, scale=0.2, config=config, interpret=True,
                                 lora_a=lora_a)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(plain, np.float32))
    assert down.shape == (3, 2, 3, rank) and down.dtype == jnp.float32
    rows = np.asarray(out, np.float64).reshape(3, 6, 32)
    a = np.asarray(lora_a, np.float64).reshape(6, 32, rank)
    exact = np.einsum("bhd,hdr->bhr", rows, a)
    scale = np.abs(rows).max() * np.abs(a).max() * 32
    np.testing.assert_allclose(np.asarray(down, np.float64).reshape(3, 6, rank), exact,
                               rtol=0, atol=2.0 ** -20 * scale, err_msg=f"seed={seed}")
    with pytest.raises(ValueError, match="lora_a"):
        decode_attention(q, k, v, mask, 70, scale=0.2, interpret=True,
                         lora_a=jnp.zeros((5, rank), jnp.bfloat16))


@pytest.mark.parametrize("balanced", [1, 0])
def test_slots_past_length_are_not_read(balanced):
    """NaN keys/values beyond `length` do not reach the output (those slots are never loaded)."""
    rng, q, k, v = _problem(0, 2, 128, 2, 4, 16)
    k = k.at[:, 40:].set(jnp.nan)
    v = v.at[:, 40:].set(jnp.nan)
    mask = jnp.ones((2, 128), bool)
    out = decode_attention(q, k, v, mask, 40, scale=0.25, interpret=True,
                           config=DecodeAttentionConfig(block_s=16, splits=4, balanced=balanced))
    ref = _reference(q[:, :, :, :], k[:, :40], v[:, :40], np.ones((2, 40), bool), 40, 0.25)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    np.testing.assert_allclose(np.asarray(out, np.float32), ref,
                               atol=TOLERANCE * np.abs(ref).max())


def test_all_masked_row_stays_finite_and_errors():
    _, q, k, v = _problem(1, 2, 64, 1, 2, 16)
    mask = np.ones((2, 64), bool)
    mask[0] = False  # e.g. a finished sequence's padding row
    out = decode_attention(q, k, v, jnp.asarray(mask), 64, scale=0.25, interpret=True)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    single = decode_attention(q, k, v, jnp.asarray(mask), 64, scale=0.25, interpret=True,
                              config=DecodeAttentionConfig(splits=1))
    assert np.isfinite(np.asarray(single, np.float32)).all()
    with pytest.raises(ValueError, match="mask"):
        decode_attention(q, k, v, jnp.ones((2, 63), bool), 64, scale=0.25, interpret=True)
    with pytest.raises(ValueError, match="head_dim"):
        decode_attention(q[..., :12], k[..., :12], v[..., :12], jnp.asarray(mask), 64,
                         scale=0.25, interpret=True)
    assert default_splits(8, 4, 2304, 64) == 9
    assert default_splits(1, 1, 100, 64) == 2


def test_config_is_checked_and_parsed():
    """DecodeAttentionConfig checks its fields; parse_config (benchmark command lines) checks
    names and values; a config given to decode_attention is the one it uses."""
    from pallas_kernels import decode_attention as module
    assert module.parse_config("splits=1,block_s=128") == {"splits": 1, "block_s": 128}
    assert module.parse_config("splits=none") == {"splits": None}
    with pytest.raises(ValueError, match="expected name=value"):
        module.parse_config("split=2")
    with pytest.raises(ValueError, match="block_s"):
        module.DecodeAttentionConfig(block_s=48)
    with pytest.raises(ValueError, match="balanced"):
        module.DecodeAttentionConfig(balanced=2)
    _, q, k, v = _problem(2, 2, 96, 2, 4, 16)
    mask = jnp.ones((2, 96), bool)
    got = decode_attention(q, k, v, mask, 70, scale=0.25, interpret=True,
                           config=module.DecodeAttentionConfig(splits=1))
    ref = _reference(q, k, v, np.ones((2, 96), bool), 70, 0.25)
    np.testing.assert_allclose(np.asarray(got, np.float32), ref,
                               atol=TOLERANCE * np.abs(ref).max())
