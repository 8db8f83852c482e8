"""Losses and their gradients against float64 numpy computations of the formulas
(GRPO / DAPO as QeRL trains) on fresh random batches. JAX runs in float32: rtol 1e-5, atol 1e-6."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qerl_jax.registry import LOSS_NORMALIZERS
from qerl_jax.rl.losses import (LossConfig, chunked_token_logprobs_and_entropy,
                                entropy_threshold_mask, loss_types, policy_loss_terms,
                                token_logprobs_and_entropy)

LOSS_TYPE_ALIASES = LOSS_NORMALIZERS.aliases()


def _batch(rng, batch=6, length=7):
    logp = rng.normal(-2.0, 0.5, size=(batch, length))
    old = logp + rng.normal(0, 0.3, size=(batch, length))   # ratios well outside the clip
    ref = logp + rng.normal(0, 0.2, size=(batch, length))
    adv = rng.normal(size=batch)
    mask = rng.random((batch, length)) < 0.75
    mask[0] = False                       # a fully masked (e.g. truncated) sequence
    entropy = rng.random((batch, length)) * 3
    return logp, old, ref, adv, mask.astype(np.float64), entropy


def _numpy_loss_and_grad(logp, old, ref, adv, mask, entropy, cfg, global_tokens=None):
    """float64 loss and d loss / d logp, written from the formulas."""
    ratio = np.exp(logp - old)
    a = adv[:, None]
    unclipped, clipped = ratio * a, np.clip(ratio, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high) * a
    pg = -np.minimum(unclipped, clipped)
    # gradient of pg: -a * ratio where the unclipped branch is the min (or the clip is inactive)
    clip_active = (ratio < 1 - cfg.epsilon_low) | (ratio > 1 + cfg.epsilon_high)
    takes_clipped = (clipped < unclipped) & clip_active
    d_pg = np.where(takes_clipped, 0.0, -a * ratio)
    keep = np.ones_like(mask)
    if cfg.top_entropy_quantile < 1:
        threshold = np.quantile(entropy[mask > 0], 1 - cfg.top_entropy_quantile)
        keep = (entropy >= threshold).astype(np.float64)
    delta = ref - logp
    kl = np.exp(delta) - delta - 1
    d_kl = -np.exp(delta) + 1
    per_token = pg * keep + cfg.beta * kl
    d_token = d_pg * keep + cfg.beta * d_kl
    batch = mask.shape[0]
    kind = {canonical: alias for alias, canonical in LOSS_TYPE_ALIASES.items()}.get(
        cfg.loss_type, cfg.loss_type)   # the float64 formulas under the papers' names
    if kind == "grpo":
        lengths = np.maximum(mask.sum(1, keepdims=True), 1)
        loss = ((per_token * mask).sum(1) / lengths[:, 0]).mean()
        grad = d_token * mask / lengths / batch
    else:
        denominator = {"bnpo": max(mask.sum(), 1), "dr_grpo": batch * cfg.max_completion_length,
                       "dapo": global_tokens if global_tokens else max(mask.sum(), 1)}[kind]
        loss = (per_token * mask).sum() / denominator
        grad = d_token * mask / denominator
    return loss, grad


@pytest.mark.parametrize("loss_type", loss_types())
@pytest.mark.parametrize("beta,quantile", [(0.0, 1.0), (0.04, 1.0), (0.04, 0.5)])
def test_loss_and_gradient_match_float64(loss_type, beta, quantile):
    rng = np.random.default_rng()
    logp, old, ref, adv, mask, entropy = _batch(rng)
    cfg = LossConfig(loss_type=loss_type, beta=beta, top_entropy_quantile=quantile,
                     max_completion_length=7)
    expected_loss, expected_grad = _numpy_loss_and_grad(logp, old, ref, adv, mask, entropy, cfg)

    def loss_fn(lp):
        terms = policy_loss_terms(lp, jnp.asarray(old, jnp.float32), jnp.asarray(adv, jnp.float32),
                                  jnp.asarray(mask), cfg, ref_logprobs=jnp.asarray(ref, jnp.float32),
                                  entropies=jnp.asarray(entropy, jnp.float32))
        return terms.numerator / terms.denominator

    loss, grad = jax.value_and_grad(loss_fn)(jnp.asarray(logp, jnp.float32))
    np.testing.assert_allclose(float(loss), expected_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), expected_grad, rtol=1e-4, atol=1e-6)


def test_num_iterations_one_gradient_is_minus_advantage():
    """With logp_old = stop_gradient(logp), rho == 1 and d loss / d logp = -A m / denom."""
    rng = np.random.default_rng()
    logp, _, _, adv, mask, _ = _batch(rng)
    cfg = LossConfig(loss_type="bnpo")

    def loss_fn(lp):
        terms = policy_loss_terms(lp, jax.lax.stop_gradient(lp), jnp.asarray(adv, jnp.float32),
                                  jnp.asarray(mask), cfg)
        return terms.numerator / terms.denominator

    grad = jax.grad(loss_fn)(jnp.asarray(logp, jnp.float32))
    np.testing.assert_allclose(np.asarray(grad), -adv[:, None] * mask / mask.sum(), rtol=1e-5,
                               atol=1e-7)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_global_denominators_make_micro_batches_exact(loss_type):
    rng = np.random.default_rng()
    logp, old, _, adv, mask, _ = _batch(rng, batch=8)
    cfg = LossConfig(loss_type=loss_type, max_completion_length=7)
    args = lambda s: (jnp.asarray(logp[s], jnp.float32), jnp.asarray(old[s], jnp.float32),
                      jnp.asarray(adv[s], jnp.float32), jnp.asarray(mask[s]))
    whole = policy_loss_terms(*args(slice(None)), cfg)
    parts = [policy_loss_terms(*args(slice(i, i + 2)), cfg, global_valid_tokens=mask.sum(),
                               global_sequences=8) for i in range(0, 8, 2)]
    accumulated = sum(float(p.numerator) for p in parts) / float(parts[0].denominator)
    # The loss is a signed sum whose terms cancel, so it can be ~1e-4 while its terms are ~1:
    # the module's float32 tolerance (rtol 1e-5, atol 1e-6) applies, not a relative one alone.
    np.testing.assert_allclose(accumulated, float(whole.numerator / whole.denominator),
                               rtol=1e-5, atol=1e-6)


def test_clip_fraction_counts_active_clips():
    logp = jnp.log(jnp.array([[1.5, 0.5, 1.0, 1.1]]))
    terms = policy_loss_terms(logp, jnp.zeros((1, 4)), jnp.array([1.0]), jnp.ones((1, 4)),
                              LossConfig(epsilon_low=0.2, epsilon_high=0.28))
    assert float(terms.clipped_tokens) == 1.0  # only rho=1.5 with A>0 is clipped


def test_logprobs_and_entropy_float64():
    rng = np.random.default_rng()
    logits = rng.normal(size=(2, 3, 11)) * 3
    tokens = rng.integers(0, 11, size=(2, 3))
    chosen, entropy = token_logprobs_and_entropy(jnp.asarray(logits, jnp.float32),
                                                 jnp.asarray(tokens), temperature=0.7)
    scaled = logits / 0.7
    log_p = scaled - scaled.max(-1, keepdims=True)
    log_p = log_p - np.log(np.exp(log_p).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(chosen),
                               np.take_along_axis(log_p, tokens[..., None], -1)[..., 0],
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(entropy), -(np.exp(log_p) * log_p).sum(-1),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [0, 3, 4, 10, 64])
def test_chunked_logprobs_equal_the_whole_computation_with_gradients(chunk_size):
    """Chunked log-probs/entropy (lax.map + jax.checkpoint over positions, N=10 not a multiple
    of the chunk) equal the one-piece computation, and so do the gradients w.r.t. the hidden
    states and the head weight of a loss using both. float32: rtol 1e-5, atol 1e-6."""
    rng = np.random.default_rng(chunk_size)
    hidden = jnp.asarray(rng.normal(size=(3, 10, 16)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(16, 40)) / 4, jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 40, size=(3, 10)))
    weights = jnp.asarray(rng.normal(size=(3, 10)), jnp.float32)

    def loss(hidden, head, chunk):
        logits_fn = lambda h: jnp.dot(h, head, precision=jax.lax.Precision.HIGHEST)
        logp, entropy = chunked_token_logprobs_and_entropy(hidden, logits_fn, tokens, 0.9, chunk)
        return jnp.sum(weights * logp) + 0.1 * jnp.sum(entropy), (logp, entropy)

    (value, (logp, entropy)), grads = jax.jit(
        jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)(
        hidden, head, chunk_size)
    (ref_value, (ref_logp, ref_entropy)), ref_grads = jax.value_and_grad(
        loss, argnums=(0, 1), has_aux=True)(hidden, head, 0)
    assert logp.shape == entropy.shape == (3, 10)
    for got, want in [(logp, ref_logp), (entropy, ref_entropy), (value, ref_value),
                      *zip(grads, ref_grads)]:
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_head_logprobs_backward_equals_autodiff(temperature):
    """head_logprobs_and_entropy's hand-written backward equals JAX's autodiff of the plain
    token_logprobs_and_entropy(logits_fn(hidden)) for a loss weighting both outputs (gradients
    of the hidden states and of a head closed over, float32: rtol 1e-4, atol 1e-6); the forward
    values are bit-identical. With a bfloat16 head (CausalLM's head_logits), the gradients agree
    within bfloat16 rounding of the cotangent (rtol 2e-2 on the norm)."""
    from qerl_jax.models.transformer import head_logits
    from qerl_jax.rl.losses import head_logprobs_and_entropy, token_logprobs_and_entropy
    rng = np.random.default_rng(3)
    hidden = jnp.asarray(rng.normal(size=(2, 7, 16)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(16, 50)) / 3, jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 50, size=(2, 7)))
    weights = jnp.asarray(rng.normal(size=(2, 7)), jnp.float32)
    entropy_weights = jnp.asarray(rng.normal(size=(2, 7)), jnp.float32)

    def loss(hidden, head, fused, dtype=jnp.float32):
        def logits_fn(h):
            return head_logits(h.astype(dtype), head.astype(dtype))
        if fused:
            logp, entropy = head_logprobs_and_entropy(hidden, logits_fn, tokens, temperature)
        else:
            logp, entropy = token_logprobs_and_entropy(logits_fn(hidden), tokens, temperature)
        return jnp.sum(weights * logp) + jnp.sum(entropy_weights * entropy), (logp, entropy)

    grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    (value, (logp, entropy)), grads = jax.jit(grad, static_argnums=2)(hidden, head, True)
    (ref_value, (ref_logp, ref_entropy)), ref_grads = jax.jit(grad, static_argnums=2)(
        hidden, head, False)
    np.testing.assert_array_equal(np.asarray(logp), np.asarray(ref_logp))
    np.testing.assert_array_equal(np.asarray(entropy), np.asarray(ref_entropy))
    for got, want in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)
    (_, _), narrow = jax.jit(grad, static_argnums=(2, 3))(hidden, head, True, jnp.bfloat16)
    (_, _), narrow_ref = jax.jit(grad, static_argnums=(2, 3))(hidden, head, False, jnp.bfloat16)
    for got, want in zip(narrow, narrow_ref):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        assert np.linalg.norm(got - want) <= 2e-2 * np.linalg.norm(want)


def test_entropy_mask_uses_valid_tokens_only():
    entropy = jnp.array([[0.0, 1.0, 2.0, 100.0]])
    mask = jnp.array([[1, 1, 1, 0]])
    kept = np.asarray(entropy_threshold_mask(entropy, mask, 0.5))
    np.testing.assert_array_equal(kept[0, :3], [False, True, True])


def test_bad_loss_config():
    with pytest.raises(ValueError, match=r"^unknown loss type 'ppo'; known: sequence_mean, "
                                         r"micro_batch_token_mean, .*, dapo$"):
        LossConfig(loss_type="ppo")
    with pytest.raises(ValueError, match=r"^unknown policy objective 'ppo'; known: "
                                         r"clipped_surrogate, gspo, gspo_token, cispo$"):
        LossConfig(policy_objective="ppo")


def test_chunked_logprobs_name_mismatched_shapes():
    with pytest.raises(ValueError, match=r"hidden \(2, 5, 4\) and tokens \(2, 6\)"):
        chunked_token_logprobs_and_entropy(jnp.zeros((2, 5, 4)), lambda h: h,
                                           jnp.zeros((2, 6), jnp.int32), 1.0, 2)


@pytest.mark.parametrize("alias", sorted(LOSS_TYPE_ALIASES))
def test_papers_names_are_aliases_of_the_registered_loss_types(alias):
    """grpo/bnpo/dr_grpo/dapo give exactly the loss of the type they name."""
    rng = np.random.default_rng()
    shape = (3, 6)
    logp, old, ref = (jnp.asarray(rng.normal(-1, 0.3, shape), jnp.float32) for _ in range(3))
    adv = jnp.asarray(rng.normal(size=shape[0]), jnp.float32)
    mask = jnp.asarray(rng.random(shape) > 0.3)
    terms = [policy_loss_terms(logp, old, adv, mask, LossConfig(
        loss_type=name, beta=0.04, max_completion_length=6), ref_logprobs=ref)
        for name in (alias, LOSS_TYPE_ALIASES[alias])]
    assert float(terms[0].numerator) == float(terms[1].numerator)
    assert float(terms[0].denominator) == float(terms[1].denominator)
    assert (LossConfig(loss_type=alias).denominator_is_global
            == LossConfig(loss_type=LOSS_TYPE_ALIASES[alias]).denominator_is_global)


def test_truncated_importance_sampling_matches_float64():
    """token_truncate: the policy loss of each token times min(exp(old - rollout), cap), held
    constant in the gradient (micro_batch_token_mean, no KL); float64 numpy, rtol 1e-5."""
    rng = np.random.default_rng()
    shape, cap = (4, 7), 2.0
    logp = rng.normal(-1.5, 0.4, shape)
    old = logp + rng.normal(0, 0.05, shape)
    rollout = old + rng.normal(0, 0.8, shape)          # some ratios above the cap
    adv = rng.normal(size=shape[0])
    mask = (rng.random(shape) > 0.25).astype(np.float64)
    config = LossConfig(loss_type="micro_batch_token_mean", rollout_correction="token_truncate",
                        rollout_correction_cap=cap)

    def loss(lp):
        terms = policy_loss_terms(lp, jnp.asarray(old, jnp.float32),
                                  jnp.asarray(adv, jnp.float32), jnp.asarray(mask > 0), config,
                                  rollout_logprobs=jnp.asarray(rollout, jnp.float32))
        return terms.numerator / terms.denominator

    value, grad = jax.value_and_grad(loss)(jnp.asarray(logp, jnp.float32))
    weight = np.minimum(np.exp(old - rollout), cap)
    assert (np.exp(old - rollout) > cap).any()
    ratio = np.exp(logp - old)
    a = adv[:, None]
    clipped = np.clip(ratio, 0.8, 1.28)
    pg = -np.minimum(ratio * a, clipped * a)
    takes_clipped = ratio * a > clipped * a
    d_pg = np.where(takes_clipped, 0.0, -a * ratio)
    denominator = mask.sum()
    np.testing.assert_allclose(float(value), (pg * weight * mask).sum() / denominator,
                               rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), d_pg * weight * mask / denominator,
                               rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="needs the rollout's log-probs"):
        policy_loss_terms(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv),
                          jnp.asarray(mask > 0), config)
