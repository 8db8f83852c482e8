"""Our decoder against transformers' Qwen2 / Llama on tiny random checkpoints (CPU).

Logit scale of these models: |logits| up to ~2.3, std ~0.65 (asserted in [1, 50]). Tolerances:
fp32 max abs diff <= 1e-4; bf16 params + bf16 compute vs the fp32 HF reference: max abs diff
<= 0.1 and mean abs diff <= 0.02 (observed 0.026-0.039 and 0.005-0.006; bf16 rounds ~0.4%,
accumulated over 3 layers); fp32 observed ~1.5e-6; cached decode vs full forward in fp32: <= 1e-4.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qerl_jax.models import decode_step, init_kv_cache, prefill
from qerl_jax.models.hf_io import load_hf_model
from qerl_jax.models.transformer import head_logits, set_attention_query_chunk
from tests.hf_reference import hf_logits, left_padded_batch, make_hf_model, save_hf_model_dir

ARCHS = ["qwen2", "llama"]


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory):
    arch = request.param
    model = make_hf_model(arch, seed=ARCHS.index(arch))
    directory = save_hf_model_dir(model, str(tmp_path_factory.mktemp(arch)))
    return arch, model, directory


def _left_padded_batch(rng, vocab, lengths, total):
    return left_padded_batch(rng, lengths, total, vocab)


def _valid_max_abs_diff(ours, reference, mask):
    diff = np.abs(np.asarray(ours, np.float64) - reference.astype(np.float64))
    return float(diff[mask.astype(bool)].max()), float(diff[mask.astype(bool)].mean())


def test_fp32_logits_match_transformers(checkpoint):
    _, hf_model, directory = checkpoint
    ours = load_hf_model(directory, param_dtype="float32")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, size=(2, 19))
    reference = hf_logits(hf_model, tokens)
    logits = np.asarray(jax.jit(lambda t: ours(t))(tokens))
    scale = float(np.abs(reference).max())
    assert 1.0 < scale < 50.0, f"logit scale {scale} out of the meaningful range"
    max_diff, _ = _valid_max_abs_diff(logits, reference, np.ones(tokens.shape))
    assert max_diff <= 1e-4, f"max abs diff {max_diff} (logit scale {scale})"


def test_fp32_left_padded_batch_matches_transformers(checkpoint):
    _, hf_model, directory = checkpoint
    ours = load_hf_model(directory, param_dtype="float32")
    rng = np.random.default_rng(1)
    tokens, mask = _left_padded_batch(rng, 256, lengths=[17, 9, 4], total=17)
    reference = hf_logits(hf_model, tokens, mask)
    logits = np.asarray(ours(jnp.asarray(tokens), jnp.asarray(mask)))
    assert np.isfinite(logits).all(), "padding rows must stay finite"
    max_diff, _ = _valid_max_abs_diff(logits, reference, mask)
    assert max_diff <= 1e-4, f"max abs diff at valid positions {max_diff}"


def test_bf16_logits_within_tolerance(checkpoint):
    _, hf_model, directory = checkpoint
    ours = load_hf_model(directory, param_dtype="bfloat16")
    assert ours.layers[0].mlp.up_proj.weight.get_value().dtype == jnp.bfloat16
    rng = np.random.default_rng(2)
    tokens, mask = _left_padded_batch(rng, 256, lengths=[16, 7], total=16)
    reference = hf_logits(hf_model, tokens, mask)
    logits = np.asarray(ours(jnp.asarray(tokens), jnp.asarray(mask)))
    assert logits.dtype == np.float32, "logits are computed in float32"
    max_diff, mean_diff = _valid_max_abs_diff(logits, reference, mask)
    assert max_diff <= 0.1 and mean_diff <= 0.02, (max_diff, mean_diff)


@pytest.mark.parametrize("empty_cache", [False, True])
def test_prefill_then_decode_matches_full_forward(checkpoint, empty_cache):
    """Prefill + cached decode against the full forward (fp32, 1e-4); with empty_cache the
    prefill's attention reads only the prompt's slots of the fresh cache, and the cache it
    writes is the same as without (1e-6) in every valid slot (a left-padding slot holds the
    keys of a query with nothing to attend to, whose uniform weights then spread over fewer
    slots; no query ever reads those slots)."""
    _, _, directory = checkpoint
    ours = load_hf_model(directory, param_dtype="float32")
    rng = np.random.default_rng(3)
    prompt_len, new_tokens = 8, 6
    tokens, mask = _left_padded_batch(rng, 256, lengths=[8, 5, 2], total=prompt_len)
    continuation = rng.integers(0, 256, size=(3, new_tokens))
    full_tokens = np.concatenate([tokens, continuation], axis=1)
    full_mask = np.concatenate([mask, np.ones_like(continuation, dtype=np.int32)], axis=1)
    full = np.asarray(ours(jnp.asarray(full_tokens), jnp.asarray(full_mask)))

    cache = init_kv_cache(ours.config, batch_size=3, max_length=prompt_len + new_tokens + 3)
    step = jax.jit(decode_step)
    run_prefill = jax.jit(prefill, static_argnames=("empty_cache",))
    logits, cache_all = run_prefill(ours, jnp.asarray(tokens), jnp.asarray(mask), cache)
    if empty_cache:
        logits, cache = run_prefill(ours, jnp.asarray(tokens), jnp.asarray(mask), cache,
                                    empty_cache=True)
        valid = np.asarray(cache.valid)
        np.testing.assert_array_equal(valid, np.asarray(cache_all.valid))
        assert int(cache.index) == int(cache_all.index) == prompt_len
        for a, b in zip(cache.keys + cache.values, cache_all.keys + cache_all.values):
            np.testing.assert_allclose(np.asarray(a)[valid], np.asarray(b)[valid], atol=1e-6,
                                       rtol=0)
    else:
        cache = cache_all
    np.testing.assert_allclose(np.asarray(logits), full[:, prompt_len - 1], atol=1e-4, rtol=0)
    for i in range(new_tokens - 1):
        logits, cache = step(ours, jnp.asarray(continuation[:, i]), cache)
        np.testing.assert_allclose(np.asarray(logits), full[:, prompt_len + i], atol=1e-4,
                                   rtol=0, err_msg=f"decode step {i}")
    assert int(cache.index) == prompt_len + new_tokens - 1
    np.testing.assert_array_equal(np.asarray(cache.next_position),
                                  mask.sum(1) + new_tokens - 1)


def test_inactive_sequences_do_not_disturb_others(checkpoint):
    """A finished sequence's slots are invalid: other rows' logits are unaffected."""
    _, _, directory = checkpoint
    ours = load_hf_model(directory, param_dtype="float32")
    tokens = np.random.default_rng(4).integers(0, 256, size=(2, 5))
    mask = np.ones((2, 5), np.int32)
    cache = init_kv_cache(ours.config, 2, 10)
    _, cache = prefill(ours, jnp.asarray(tokens), jnp.asarray(mask), cache)
    _, cache_a = decode_step(ours, jnp.array([3, 4]), cache, active=jnp.array([True, False]))
    logits_a, _ = decode_step(ours, jnp.array([7, 7]), cache_a)
    _, cache_b = decode_step(ours, jnp.array([3, 9]), cache, active=jnp.array([True, False]))
    logits_b, _ = decode_step(ours, jnp.array([7, 7]), cache_b)
    np.testing.assert_allclose(np.asarray(logits_a), np.asarray(logits_b), atol=1e-6)


def test_remat_gives_same_loss_and_gradients(checkpoint):
    from flax import nnx
    _, _, directory = checkpoint
    plain = load_hf_model(directory, param_dtype="float32")
    remat = load_hf_model(directory, param_dtype="float32", remat=True)
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 256, size=(2, 9)))

    def loss(model):
        logits = model(tokens[:, :-1])
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    loss_plain, grads_plain = nnx.value_and_grad(loss)(plain)
    loss_remat, grads_remat = nnx.value_and_grad(loss)(remat)
    np.testing.assert_allclose(float(loss_plain), float(loss_remat), rtol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(nnx.state(grads_plain)),
                    jax.tree_util.tree_leaves(nnx.state(grads_remat))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def _head_problem(dtype):
    keys = jax.random.split(jax.random.key(3), 3)
    hidden = jax.random.normal(keys[0], (2, 5, 24), jnp.float32).astype(dtype)
    weight = (0.2 * jax.random.normal(keys[1], (24, 40), jnp.float32)).astype(dtype)
    cotangent = jax.random.normal(keys[2], (2, 5, 40), jnp.float32)
    return hidden, weight, cotangent


def _head_vjp(function, hidden, weight, cotangent):
    logits, pullback = jax.vjp(function, hidden, weight)
    return (logits, *pullback(cotangent))


def test_head_logits_float32_is_the_plain_dot_and_the_custom_vjp_agrees_with_autodiff():
    """float32: the plain dot and its autodiff, bit for bit (CPU runs keep their numbers); the
    narrow-dtype VJP run on float32 inputs (no rounding) agrees with autodiff to 1e-6."""
    from qerl_jax.quant.linear_op import narrow_matmul
    hidden, weight, cotangent = _head_problem(jnp.float32)
    plain = lambda h, w: jnp.dot(h, w, preferred_element_type=jnp.float32)  # noqa: E731
    reference = _head_vjp(plain, hidden, weight, cotangent)
    for ours, expected in zip(_head_vjp(head_logits, hidden, weight, cotangent), reference):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(expected))
    for ours, expected in zip(_head_vjp(narrow_matmul, hidden, weight, cotangent),
                              reference):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(expected), rtol=1e-6,
                                   atol=1e-6)


def test_head_logits_bf16_backward_against_float64_and_without_a_float32_head_copy():
    """bf16 head: the backward rounds the cotangent to bf16 once and accumulates in float32
    (float64 numpy reference of exactly that, tolerance 2 bf16 ulps of the output scale); the
    gradient program holds no float32 [H, V] array (what autodiff alone makes: the whole head
    converted to float32, 2 GB for Qwen2.5-7B)."""
    hidden, weight, cotangent = _head_problem(jnp.bfloat16)
    logits, grad_hidden, grad_weight = _head_vjp(head_logits, hidden, weight, cotangent)
    h64 = np.asarray(hidden.astype(jnp.float32), np.float64)
    w64 = np.asarray(weight.astype(jnp.float32), np.float64)
    g64 = np.asarray(cotangent.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    for ours, expected in ((logits, h64 @ w64), (grad_hidden, g64 @ w64.T),
                           (grad_weight, np.einsum("bnh,bnv->hv", h64, g64))):
        ours = np.asarray(ours.astype(jnp.float32), np.float64)
        np.testing.assert_allclose(ours, expected, rtol=0,
                                   atol=2 * 2.0 ** -8 * np.abs(expected).max())

    def loss(h):
        return jnp.sum(head_logits(h, weight) * cotangent)

    def plain_loss(h):
        return jnp.sum(jnp.dot(h, weight, preferred_element_type=jnp.float32) * cotangent)

    head_f32 = "tensor<24x40xf32>"
    assert head_f32 in jax.jit(jax.grad(plain_loss)).lower(hidden).as_text()  # the copy
    assert head_f32 not in jax.jit(jax.grad(loss)).lower(hidden).as_text()


def _avals(jaxpr):
    """(shape, dtype) of every equation output in a jaxpr and its sub-jaxprs."""
    shapes = []
    for eqn in jaxpr.eqns:
        shapes += [(tuple(getattr(v.aval, "shape", ())), getattr(v.aval, "dtype", None))
                   for v in eqn.outvars]
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    shapes += _avals(sub)
    return shapes


def _token_loss(tokens, mask):
    """A loss over the logits of the real tokens of a left-padded batch."""
    def loss(model):
        logits = model(tokens, attention_mask=mask)
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 0] * mask)
    return loss


def _assert_same_loss_logits_and_grads(model, reference, tokens, mask, atol=1e-5):
    """Two variants of one model: loss (rtol atol), real-token logits and every gradient (atol)."""
    from flax import nnx
    loss = _token_loss(tokens, mask)
    loss_ref, grads_ref = nnx.value_and_grad(loss)(reference)
    loss_model, grads_model = nnx.value_and_grad(loss)(model)
    np.testing.assert_allclose(float(loss_model), float(loss_ref), rtol=atol)
    valid = np.asarray(mask, bool)
    np.testing.assert_allclose(np.asarray(model(tokens, attention_mask=mask))[valid],
                               np.asarray(reference(tokens, attention_mask=mask))[valid],
                               atol=atol)
    for a, b in zip(jax.tree_util.tree_leaves(nnx.state(grads_model)),
                    jax.tree_util.tree_leaves(nnx.state(grads_ref))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol)


def test_attention_in_query_chunks_matches_all_queries_at_once(checkpoint):
    """ModelConfig.attention_query_chunk: the XLA attention over blocks of queries (lax.map,
    each block under jax.checkpoint) gives the all-at-once logits, loss and gradients (fp32,
    <= 1e-5; observed ~1e-7) on left-padded rows whose length (11) is not a multiple of the
    chunk (4); the gradient program never holds float32 [B, KVH, G, T, S] scores with
    [T, S] = [11, 11], only [4, 11] blocks."""
    from flax import nnx
    _, _, directory = checkpoint
    whole = load_hf_model(directory, param_dtype="float32", remat=True)
    chunked = load_hf_model(directory, param_dtype="float32", remat=True)
    set_attention_query_chunk(chunked, 4)
    assert chunked.config.attention_query_chunk == 4
    rng = np.random.default_rng(6)
    tokens, mask = _left_padded_batch(rng, whole.config.vocab_size, [11, 7], 11)
    tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
    _assert_same_loss_logits_and_grads(chunked, whole, tokens, mask)
    loss = _token_loss(tokens, mask)

    def shapes(model):
        graphdef, state = nnx.split(model)
        jaxpr = jax.make_jaxpr(jax.grad(lambda s: loss(nnx.merge(graphdef, s))))(state)
        return [shape[-2:] for shape, dtype in _avals(jaxpr.jaxpr)
                if len(shape) == 5 and dtype == jnp.float32]

    assert (11, 11) in shapes(whole)  # the check can see the full scores
    chunked_shapes = shapes(chunked)
    assert (11, 11) not in chunked_shapes and (4, 11) in chunked_shapes
    with pytest.raises(ValueError, match="attention_query_chunk"):
        whole.config.replace(attention_query_chunk=-1)


def _causal_padded_mask(mask):
    """The [B, T, T] mask CausalLM builds for a left-padded batch (mask [B, T])."""
    length = mask.shape[1]
    return jnp.tril(jnp.ones((length, length), jnp.bool_))[None] & mask[:, None, :].astype(bool)


@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)])
def test_fused_attention_call_matches_the_einsum_attention(dtype, atol):
    """_attend_fused (the jax.nn.dot_product_attention call that attention_implementation
    'cudnn' makes), run here with JAX's XLA reference implementation, equals _attend on every
    real-token row, values and the gradients of q, k, v: same GQA head grouping (q head h reads
    kv head h // G), scale, causal and padding mask. float32 <= 2e-6 (observed ~1e-7); bfloat16
    <= 2e-2 (both round the probabilities to bf16; values ~N(0, 1)). Padding rows differ by
    design (the docstring) and are left out."""
    from qerl_jax.models.transformer import _attend, _attend_fused
    rng = np.random.default_rng(8)
    batch, length, kv_heads, groups, head_dim = 3, 13, 2, 3, 16
    q = jnp.asarray(rng.standard_normal((batch, length, kv_heads, groups, head_dim)), dtype)
    k = jnp.asarray(rng.standard_normal((batch, length, kv_heads, head_dim)), dtype)
    v = jnp.asarray(rng.standard_normal((batch, length, kv_heads, head_dim)), dtype)
    _, padding = left_padded_batch(rng, [13, 8, 1], length, 50)
    mask = _causal_padded_mask(jnp.asarray(padding))
    real = np.asarray(padding, bool)
    cotangent = jnp.asarray(rng.standard_normal(q.shape), jnp.float32) * real[:, :, None, None,
                                                                               None]
    common = dict(scale=0.3, compute_dtype=dtype)

    def einsum(q, k, v):
        return _attend(q, mask, keys=k, values=v, **common)

    def fused(q, k, v):
        return _attend_fused(q, mask, keys=k, values=v, implementation="xla", **common)

    outputs = []
    for attend in (einsum, fused):
        out, vjp = jax.vjp(attend, q, k, v)
        outputs.append((np.asarray(out, np.float32),
                        [np.asarray(g, np.float32) for g in vjp(cotangent.astype(out.dtype))]))
    (out_einsum, grads_einsum), (out_fused, grads_fused) = outputs
    assert out_fused.shape == q.shape
    np.testing.assert_allclose(out_fused[real], out_einsum[real], atol=atol)
    for name, a, b in zip("qkv", grads_fused, grads_einsum):
        np.testing.assert_allclose(a, b, atol=atol * 4, err_msg=f"d{name}")
    assert np.isfinite(out_fused).all()


def test_attention_implementation_reaches_the_attention_layers(checkpoint, monkeypatch):
    """A model whose layers are set to the fused attention routes its full-sequence forward
    through _attend_fused (here patched to JAX's XLA reference implementation, since cuDNN
    needs a GPU): the same logits on real tokens, loss and gradients as the einsum attention
    (fp32, <= 1e-5); the cached (sampler) paths keep the einsum/decode-kernel attention."""
    from qerl_jax.models import transformer
    calls = []
    reference_call = transformer._attend_fused

    def traced(*args, **kwargs):
        calls.append(kwargs["implementation"])
        return reference_call(*args, **{**kwargs, "implementation": "xla"})

    monkeypatch.setattr(transformer, "_attend_fused", traced)
    _, _, directory = checkpoint
    einsum = load_hf_model(directory, param_dtype="float32", remat=True)
    fused = load_hf_model(directory, param_dtype="float32", remat=True)
    for layer in fused.layers:    # set_attention_implementation would refuse on a CPU
        layer.self_attn.implementation = "cudnn"
    rng = np.random.default_rng(9)
    tokens, mask = _left_padded_batch(rng, einsum.config.vocab_size, [11, 6], 11)
    tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
    einsum(tokens, attention_mask=mask)
    assert not calls
    _assert_same_loss_logits_and_grads(fused, einsum, tokens, mask)
    assert calls and set(calls) == {"cudnn"}
    calls.clear()
    cache = init_kv_cache(fused.config, batch_size=2, max_length=16, dtype=jnp.float32)
    logits, cache = prefill(fused, tokens, mask, cache)
    decode_step(fused, jnp.argmax(logits, -1), cache)
    assert not calls


def test_attention_implementation_is_validated():
    """attention_implementation: unknown names, the combination with query chunks, and 'cudnn'
    where cuDNN cannot run (this CPU) raise errors naming the field and the reason; 'auto'
    resolves to 'xla' here."""
    from qerl_jax.models.config import preset
    from qerl_jax.models.transformer import init_model, set_attention_implementation
    config = preset("tiny_qwen2")
    with pytest.raises(ValueError, match="attention_implementation='flash'"):
        config.replace(attention_implementation="flash")
    with pytest.raises(ValueError, match="attention_query_chunk=64 applies to the 'xla'"):
        config.replace(attention_implementation="cudnn", attention_query_chunk=64)
    model = init_model(config.replace(num_hidden_layers=1))
    with pytest.raises(ValueError, match="default backend is 'cpu'"):
        set_attention_implementation(model, "cudnn")
    assert set_attention_implementation(model, "auto") == "xla"
    assert model.config.attention_implementation == "xla"
    assert all(layer.self_attn.implementation == "xla" for layer in model.layers)


def test_swiglu_bf16_backward_against_float64_and_saves_only_its_inputs():
    """layers.swiglu with bf16 gate/up: the hand-written backward equals the float64 derivative
    of silu(gate) * up (inputs and cotangent as rounded to bf16; tolerance 1 bf16 ulp of each
    gradient's scale), agrees with autodiff of the float32 expression within bf16 rounding, and
    saves only gate and up for the backward (autodiff saves five float32 [.., I] arrays). float32
    inputs give the plain expression, bit for bit."""
    from jax._src.ad_checkpoint import saved_residuals

    from qerl_jax.models.layers import swiglu
    rng = np.random.default_rng(10)
    gate = jnp.asarray(rng.standard_normal((3, 7, 32)) * 2, jnp.bfloat16)
    up = jnp.asarray(rng.standard_normal((3, 7, 32)), jnp.bfloat16)
    cotangent = jnp.asarray(rng.standard_normal((3, 7, 32)), jnp.bfloat16)
    out, pullback = jax.vjp(swiglu, gate, up)
    grad_gate, grad_up = pullback(cotangent)
    g, u, c = (np.asarray(a.astype(jnp.float32), np.float64) for a in (gate, up, cotangent))
    sigmoid = 1 / (1 + np.exp(-g))
    expected = {"out": g * sigmoid * u, "gate": c * u * sigmoid * (1 + g * (1 - sigmoid)),
                "up": c * g * sigmoid}
    for name, ours in (("out", out), ("gate", grad_gate), ("up", grad_up)):
        assert ours.dtype == jnp.bfloat16
        ours = np.asarray(ours.astype(jnp.float32), np.float64)
        np.testing.assert_allclose(ours, expected[name], rtol=0,
                                   atol=2.0 ** -8 * np.abs(expected[name]).max(), err_msg=name)

    def plain(gate, up):
        return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(gate.dtype)

    plain_grads = jax.vjp(plain, gate, up)[1](cotangent)
    for ours, theirs in zip((grad_gate, grad_up), plain_grads):
        ours, theirs = np.asarray(ours, np.float32), np.asarray(theirs, np.float32)
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=2.0 ** -7 * np.abs(theirs).max())
    loss = lambda f: lambda gate, up: jnp.sum(f(gate, up).astype(jnp.float32))  # noqa: E731
    assert [r[0].dtype for r in saved_residuals(loss(swiglu), gate, up)] == [jnp.bfloat16] * 2
    assert sum(r[0].dtype == jnp.float32 for r in saved_residuals(loss(plain), gate, up)) >= 2
    gate32, up32 = gate.astype(jnp.float32), up.astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(swiglu(gate32, up32)),
                                  np.asarray(jax.nn.silu(gate32) * up32))
