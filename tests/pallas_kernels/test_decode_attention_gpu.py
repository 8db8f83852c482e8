"""The decode attention's LoRA shares, compiled on the GPU (`pytest -m gpu`).

pallas_kernels.decode_attention with lora_a (the o-projection's LoRA A): the combine kernel
returns each query head's output row times that head's rows of A. Qwen2.5-7B and -32B attention
shapes at batch 8 (and 7B at batch 64: one split, the XLA fallback), cache lengths 300 and 2000,
rank 32: the shares against float64 products of the returned bf16 rows (tolerance 2^-20 of
max|row| x max|A| x head_dim), their sum over heads against the float64 x @ A, and the output
equal bit for bit to the call without lora_a. The same in interpret mode on the CPU:
test_decode_attention.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_attention import decode_attention

pytestmark = pytest.mark.gpu

TOLERANCE = 2.0 ** -20
# (name, batch, kv heads, query heads per kv head, head_dim, cache slots)
CASES = [("7b", 8, 4, 7, 128, 2304), ("32b", 8, 8, 5, 128, 2304), ("7b_b64", 64, 4, 7, 128, 2304)]


@pytest.mark.parametrize("length", [300, 2000])
@pytest.mark.parametrize("name,batch,kv_heads,groups,head_dim,slots", CASES,
                         ids=[case[0] for case in CASES])
def test_lora_shares_match_float64(name, batch, kv_heads, groups, head_dim, slots, length):
    rank = 32
    rng = np.random.default_rng([batch, kv_heads, length])
    q = jnp.asarray(rng.standard_normal((batch, kv_heads, groups, head_dim)), jnp.bfloat16)
    keys = jnp.asarray(rng.standard_normal((batch, slots, kv_heads, head_dim)), jnp.bfloat16)
    values = jnp.asarray(rng.standard_normal((batch, slots, kv_heads, head_dim)), jnp.bfloat16)
    mask = jnp.asarray(rng.random((batch, slots)) < 0.95)
    lora_a = jnp.asarray(rng.standard_normal((kv_heads * groups * head_dim, rank)) * 0.05,
                         jnp.bfloat16)
    scale = head_dim ** -0.5
    plain = decode_attention(q, keys, values, mask, length, scale=scale)
    out, shares = decode_attention(q, keys, values, mask, length, scale=scale, lora_a=lora_a)

    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(plain, np.float32))
    heads = kv_heads * groups
    rows = np.asarray(out, np.float64).reshape(batch, heads, head_dim)
    a = np.asarray(lora_a, np.float64).reshape(heads, head_dim, rank)
    exact = np.einsum("bhd,hdr->bhr", rows, a)
    bound = np.abs(rows).max() * np.abs(a).max() * head_dim
    got = np.asarray(shares, np.float64).reshape(batch, heads, rank)
    assert np.isfinite(got).all()
    share_error = float(np.abs(got - exact).max() / bound)
    sum_error = float(np.abs(got.sum(1) - exact.sum(1)).max() / (bound * heads))
    assert share_error <= TOLERANCE, f"{name} length {length}: share error {share_error:.3g}"
    assert sum_error <= TOLERANCE, f"{name} length {length}: sum error {sum_error:.3g}"


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("length", [300, 2000])
@pytest.mark.parametrize("name,batch,kv_heads,groups,head_dim,slots", CASES,
                         ids=[case[0] for case in CASES])
def test_an_8_bit_cache_matches_float64(name, batch, kv_heads, groups, head_dim, slots,
                                        length, dtype):
    """int8 / float8_e4m3fn codes with per-(slot, head) scales
    (qerl_jax.models.kv_cache.quantize_kv) compiled: the output against float64 attention over
    codes * scales within 1e-2 of its largest magnitude (test_decode_attention.py's bf16
    tolerance)."""
    from qerl_jax.models.kv_cache import dequantize_kv, quantize_kv

    rng = np.random.default_rng([batch, kv_heads, length, 8])
    q = jnp.asarray(rng.standard_normal((batch, kv_heads, groups, head_dim)), jnp.bfloat16)
    (keys, key_scales), (values, value_scales) = (
        quantize_kv(jnp.asarray(rng.standard_normal((batch, slots, kv_heads, head_dim))
                                * 10.0 ** rng.uniform(-1, 1, (batch, slots, kv_heads, 1)),
                                jnp.float32), jnp.dtype(dtype)) for _ in range(2))
    mask = rng.random((batch, slots)) < 0.95
    mask[:, 0] = True
    mask[:, length - 1] = True   # every row still generating
    scale = head_dim ** -0.5
    out = decode_attention(q, keys, values, jnp.asarray(mask), length, scale=scale,
                           key_scales=key_scales, value_scales=value_scales)
    k, v = (np.asarray(dequantize_kv(codes, scales, jnp.float32), np.float64)
            for codes, scales in ((keys, key_scales), (values, value_scales)))
    visible = mask & (np.arange(slots) < length)[None, :]
    scores = np.einsum("bkgd,bskd->bkgs", np.asarray(q, np.float64), k) * scale
    scores = np.where(visible[:, None, None, :], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    reference = np.einsum("bkgs,bskd->bkgd", probs / probs.sum(-1, keepdims=True), v)
    error = np.abs(np.asarray(out, np.float64) - reference).max() / np.abs(reference).max()
    assert error <= 1e-2, f"{name} length {length}: relative error {error:.3g}"
