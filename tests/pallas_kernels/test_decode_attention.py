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
    mask[:, min(length, slots) - 1] = True  # and is active (its newest slot valid)
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
def test_lora_x_a_of_the_output_rows(splits, rank):
    """lora_a: the per-head products returned with the output (by the combine kernel with
    splits and a power-of-two rank, by XLA otherwise) equal float64 products of the returned
    bf16 rows: their sum over heads is the o-projection's x @ A (float32 sums, tolerance
    2^-20 relative to the largest |x @ A| contribution), and the output is unchanged."""
    seed = int(np.random.default_rng().integers(1 << 31))
    rng, q, k, v = _problem(seed, 3, 96, 2, 3, 32)
    mask = rng.random((3, 96)) < 0.9
    mask[:, 69] = True  # the newest slot of a row still generating
    mask = jnp.asarray(mask)
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


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("slots,length,block_s,splits", [
    (200, 150, 32, 3),   # split, ragged
    (64, 64, 64, 1),     # one split (no combine)
])
def test_an_8_bit_cache_matches_the_reference_on_its_dequantized_values(slots, length, block_s,
                                                                        splits, dtype):
    """int8 or float8 e4m3 codes with per-(slot, head) float32 scales (kv_cache.quantize_kv):
    the kernel equals the float64 reference on codes * scales within the bf16 tolerance above
    (the codes convert to bf16 exactly; the value scales multiply the float32 probabilities
    before their bf16 rounding); scales that differ by slot and head (x 0.01 to x 100) are
    applied to their own slots."""
    from qerl_jax.models.kv_cache import dequantize_kv, quantize_kv

    seed = int(np.random.default_rng().integers(1 << 31))
    rng, q, k, v = _problem(seed, 3, slots, 2, 4, 32)
    spread = jnp.asarray(10.0 ** rng.uniform(-2, 2, (3, slots, 2, 1)), jnp.float32)
    (k_codes, k_scales), (v_codes, v_scales) = (quantize_kv(x * spread, jnp.dtype(dtype))
                                                for x in (k, v))
    mask = rng.random((3, slots)) < 0.8
    mask[:, 0] = True
    mask[:, length - 1] = True
    out = decode_attention(q, k_codes, v_codes, jnp.asarray(mask), length, scale=0.1,
                           config=DecodeAttentionConfig(block_s=block_s, splits=splits),
                           interpret=True, key_scales=k_scales, value_scales=v_scales)
    ref = _reference(q, dequantize_kv(k_codes, k_scales, jnp.float32),
                     dequantize_kv(v_codes, v_scales, jnp.float32), mask, length, 0.1)
    err = np.abs(np.asarray(out, np.float32) - ref).max() / np.abs(ref).max()
    assert err <= TOLERANCE, f"seed={seed} relative error {err:.2e}"
    with pytest.raises(ValueError, match="key_scales and value_scales must both be float32"):
        decode_attention(q, k_codes, v_codes, jnp.asarray(mask), length, scale=0.1,
                         interpret=True, key_scales=k_scales)


def test_quantize_kv_round_trip():
    """Each vector's largest magnitude maps to 448 (e4m3's largest finite value) or 127 (int8)
    and comes back exactly; every element within e4m3's half-ulp (2^-4 relative, 3 mantissa
    bits) of its value, or 2^-9 of its vector's absmax where subnormal; within half an int8
    step (absmax / 254); all-zero vectors stay zero."""
    from qerl_jax.models.kv_cache import dequantize_kv, quantize_kv

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 9, 3, 64)).astype(np.float32) * 10.0 ** rng.uniform(
        -3, 3, (4, 9, 3, 1))
    x[0, 0, 0] = 0.0
    codes, scales = quantize_kv(jnp.asarray(x), jnp.float8_e4m3fn)
    assert codes.dtype == jnp.float8_e4m3fn and scales.shape == (4, 9, 3)
    back = np.asarray(dequantize_kv(codes, scales, jnp.float32))
    absmax = np.abs(x).max(-1, keepdims=True)
    np.testing.assert_allclose(np.abs(back).max(-1, keepdims=True), absmax, rtol=1e-6)
    assert np.all(np.abs(back - x) <= np.maximum(2.0 ** -4 * np.abs(x), 2.0 ** -9 * absmax))
    assert not back[0, 0, 0].any()
    codes, scales = quantize_kv(jnp.asarray(x), jnp.int8)
    assert codes.dtype == jnp.int8 and int(np.abs(np.asarray(codes)).max()) == 127
    back = np.asarray(dequantize_kv(codes, scales, jnp.float32))
    np.testing.assert_allclose(np.abs(back).max(-1, keepdims=True), absmax, rtol=1e-6)
    assert np.all(np.abs(back - x) <= absmax / 254 * (1 + 1e-6))
    assert not back[0, 0, 0].any()


@pytest.mark.parametrize("splits", [3, 1])
def test_a_finished_row_reads_nothing(splits):
    """A row whose newest slot (length - 1) is masked is a finished sequence: its output is
    zeros (no slot read), and the other rows' outputs equal those of the call where it is
    active, bit for bit."""
    rng, q, k, v = _problem(7, 3, 128, 2, 4, 32)
    mask = rng.random((3, 128)) < 0.9
    mask[:, 0] = True
    mask[:, 99] = True
    config = DecodeAttentionConfig(block_s=16, splits=splits)
    active = decode_attention(q, k, v, jnp.asarray(mask), 100, scale=0.2, config=config,
                              interpret=True)
    mask[1, 99] = False
    finished = decode_attention(q, k, v, jnp.asarray(mask), 100, scale=0.2, config=config,
                                interpret=True)
    assert not np.asarray(finished[1], np.float32).any()
    np.testing.assert_array_equal(np.asarray(finished[::2], np.float32),
                                  np.asarray(active[::2], np.float32))
