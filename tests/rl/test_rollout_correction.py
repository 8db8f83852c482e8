"""Rollout correction modes against float64 numpy formulas written here (weights, the weighted
loss and its gradient, the corrected-token and -sequence counts), sequence ratios whose product
overflows float32, exact micro-batch accumulation, the mismatch sums, config validation; and
the trainer: each mode under AQN resumes exactly.

Tolerances: JAX runs in float32 (unit roundoff u = 2^-24 ~ 6e-8). The references start from the
same float32-rounded inputs, so only JAX's arithmetic differs: a log-ratio summed over T <= 8
tokens of magnitude < 4 is off by < T * 8u ~ 4e-6 in absolute terms, which exp turns into a
relative error of the same size (plus ~2u): rtol 1e-5 on weights. A loss is a float32 sum of
n ~ 50 terms: within (n + 8) u sum |l_t| of the exact one; its per-token gradients are rtol 1e-5,
atol 1e-7. Counts are exact.
"""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qerl_jax.experiment_config import validate_config
from qerl_jax.infra.checkpointing import TrainingCheckpoints
from qerl_jax.infra.errors import ConfigError
from qerl_jax.infra.metrics import read_metrics
from qerl_jax.registry import ROLLOUT_CORRECTIONS
from qerl_jax.rl.losses import LossConfig, policy_loss_terms
from qerl_jax.rl.rollout_correction import (rollout_correction_sums, rollout_correction_weights,
                                            rollout_mismatch_sums)
from tests.conftest import small_trainer_config

MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
CORRECTING_MODES = MODES[1:]
F32 = np.float32


def _numpy_weights(old, rollout, mask, mode, cap):
    """float64 (weights [B, T], corrected [B, T]) from the definitions: r_t = pi_old / pi_rollout
    per token, r = prod_t r_t over a sequence's valid tokens; truncate min(r, C), mask r or 0."""
    old, rollout, mask = (np.asarray(v, np.float64) for v in (old, rollout, mask))
    valid = mask > 0
    if mode == "none":
        return np.ones_like(old), np.zeros(old.shape, bool)
    level, constraint = mode.split("_")
    token_ratio = np.where(valid, np.exp(old - rollout), 1.0)
    if level == "token":
        ratio = token_ratio
    else:
        ratio = np.broadcast_to(np.prod(token_ratio, axis=1, keepdims=True), old.shape)
    above = ratio > cap
    weights = np.minimum(ratio, cap) if constraint == "truncate" else np.where(above, 0.0, ratio)
    return weights, above & valid


def _batch(rng, rows=8, length=7, cap=3.0):
    """float32-representable [rows, length] log-probs: per-token log-ratios of spread 0.5, row 0
    far above the cap per token and per sequence, row 1 far below; no ratio within 1e-3 of C in
    log space (so float32 and float64 agree on which are corrected)."""
    while True:
        logp = rng.normal(-2.0, 0.5, (rows, length))
        old = logp + rng.normal(0, 0.05, (rows, length))
        log_ratio = rng.normal(0, 0.5, (rows, length))
        log_ratio[0] = np.abs(log_ratio[0]) + 1.2          # r_t > e^1.2 > 3 on every token
        log_ratio[1] = -np.abs(log_ratio[1]) - 0.2
        rollout = old - log_ratio
        mask = rng.random((rows, length)) < 0.8
        mask[:2, 0] = True
        mask[2] = False                                    # a sequence without valid tokens
        logp, old, rollout = (v.astype(F32) for v in (logp, old, rollout))
        exact = (old.astype(np.float64) - rollout) * mask
        distances = np.abs(np.concatenate([exact[mask], exact.sum(axis=1)]) - np.log(cap))
        if distances.min() > 1e-3:
            adv = rng.normal(size=rows).astype(F32)
            ref = (logp + rng.normal(0, 0.2, (rows, length))).astype(F32)
            return logp, old, rollout, ref, adv, mask


@pytest.mark.parametrize("mode", MODES)
def test_weights_and_counts_match_float64(mode):
    rng = np.random.default_rng()
    cap = 3.0
    _, old, rollout, _, _, mask = _batch(rng, cap=cap)
    weights, corrected = rollout_correction_weights(jnp.asarray(old), jnp.asarray(rollout),
                                                    jnp.asarray(mask), mode, cap)
    expected, expected_corrected = _numpy_weights(old, rollout, mask, mode, cap)
    np.testing.assert_allclose(np.asarray(weights) * mask, expected * mask, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(corrected), expected_corrected)
    if mode != "none":
        assert expected_corrected[0][mask[0]].all() and not expected_corrected[1].any()
    sums = {k: float(v) for k, v in rollout_correction_sums(corrected, jnp.asarray(mask)).items()}
    assert sums == {"rollout_corrected_tokens": float(expected_corrected.sum()),
                    "rollout_corrected_sequences": float(expected_corrected.any(axis=1).sum()),
                    "rollout_sequences": float(mask.any(axis=1).sum())}
    assert sums["rollout_sequences"] == 7.0      # row 2 has no valid token


@pytest.mark.parametrize("mode", CORRECTING_MODES)
def test_weights_carry_no_gradient(mode):
    rng = np.random.default_rng()
    _, old, rollout, _, _, mask = _batch(rng)
    for argnum in (0, 1):
        grads = jax.grad(lambda *lp: rollout_correction_weights(
            *lp, jnp.asarray(mask), mode, 3.0)[0].sum(), argnums=argnum)(
            jnp.asarray(old), jnp.asarray(rollout))
        assert not np.asarray(grads).any()


def _numpy_loss_and_grad(logp, old, ref, adv, mask, weights, beta):
    """float64 batch_token_mean of w * clipped surrogate + beta * k3 KL and its d / d logp (the
    weight multiplies the policy term only)."""
    logp, old, ref, adv, mask = (np.asarray(v, np.float64) for v in (logp, old, ref, adv, mask))
    ratio, a = np.exp(logp - old), adv[:, None]
    clipped = np.clip(ratio, 0.8, 1.28)
    pg = -np.minimum(ratio * a, clipped * a)
    d_pg = np.where(ratio * a > clipped * a, 0.0, -a * ratio)
    delta = ref - logp
    kl = np.exp(delta) - delta - 1.0
    d_kl = 1.0 - np.exp(delta)
    denominator = max(mask.sum(), 1.0)
    per_token = (pg * weights + beta * kl) * mask
    return per_token.sum() / denominator, (d_pg * weights + beta * d_kl) * mask / denominator


def _numpy_loss_scale(logp, old, ref, adv, mask, weights, beta):
    """float64 sum |l_t| / valid tokens: the size the float32 sums' rounding scales with."""
    logp, old, ref, adv = (np.asarray(v, np.float64) for v in (logp, old, ref, adv))
    ratio, a = np.exp(logp - old), adv[:, None]
    pg = -np.minimum(ratio * a, np.clip(ratio, 0.8, 1.28) * a)
    delta = ref - logp
    per_token = (pg * weights + beta * (np.exp(delta) - delta - 1.0)) * mask
    return np.abs(per_token).sum() / max(mask.sum(), 1.0)


@pytest.mark.parametrize("mode", MODES)
def test_weighted_loss_and_gradient_match_float64(mode):
    """policy_loss_terms with the mode: the clipped surrogate of each token times its weight,
    plus the unweighted k3 KL (beta 0.04), over the batch's valid tokens (batch_token_mean)."""
    rng = np.random.default_rng()
    cap, beta = 3.0, 0.04
    logp, old, rollout, ref, adv, mask = _batch(rng, cap=cap)
    config = LossConfig(loss_type="batch_token_mean", beta=beta, rollout_correction=mode,
                        rollout_correction_cap=cap)

    def loss(lp):
        terms = policy_loss_terms(lp, jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask),
                                  config, ref_logprobs=jnp.asarray(ref),
                                  rollout_logprobs=jnp.asarray(rollout))
        return terms.numerator / terms.denominator

    value, grad = jax.value_and_grad(loss)(jnp.asarray(logp))
    weights, _ = _numpy_weights(old, rollout, mask, mode, cap)
    expected_value, expected_grad = _numpy_loss_and_grad(logp, old, ref, adv, mask, weights, beta)
    # a float32 sum of n terms, each within ~8u of its own size: (n + 8) u sum |l_t|
    scale = _numpy_loss_scale(logp, old, ref, adv, mask, weights, beta)
    np.testing.assert_allclose(float(value), expected_value, rtol=0,
                               atol=(mask.sum() + 8) * 2.0 ** -24 * scale)
    np.testing.assert_allclose(np.asarray(grad), expected_grad, rtol=1e-5, atol=1e-7)
    if mode != "none":
        with pytest.raises(ValueError, match=f"rollout_correction='{mode}' needs the rollout's"):
            policy_loss_terms(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv),
                              jnp.asarray(mask), config, ref_logprobs=jnp.asarray(ref))


@pytest.mark.parametrize("mode", ("sequence_truncate", "sequence_mask"))
def test_sequence_ratios_that_overflow_float32_as_products_are_exact(mode):
    """400 valid tokens at log-ratio +0.5 each (r = e^200; float32 ends at e^88.7), 400 at -0.5
    (r = e^-200, below the smallest float32), and 200 at +0.5 then 199 at -0.5 (r = e^0.5, but
    the running product passes e^88.7 first): the weights are C / 0, 0 and e^0.5. The log-ratios
    and their partial sums are multiples of 0.5, exact in float32, so rtol 1e-6 (exp's ulps)."""
    cap, length = 3.0, 400
    rollout = np.full((3, length), -1.5, F32)
    old = np.full((3, length), -1.0, F32)
    old[1], rollout[1] = -1.5, -1.0
    old[2, 200:] = -2.0                                   # log-ratio -0.5 from token 200
    mask = np.ones((3, length), bool)
    mask[2, -1] = False                                   # 200 tokens at +0.5, 199 at -0.5
    log_ratio = (old - rollout) * mask
    with np.errstate(over="ignore"):
        running = np.cumprod(np.exp(log_ratio[2]), dtype=F32)
    assert np.isinf(running).any() and np.isinf(running[-1])   # the product form fails
    weights, corrected = rollout_correction_weights(jnp.asarray(old), jnp.asarray(rollout),
                                                    jnp.asarray(mask), mode, cap)
    weights = np.asarray(weights)
    assert np.isfinite(weights).all()
    np.testing.assert_allclose(weights[0], cap if mode == "sequence_truncate" else 0.0)
    np.testing.assert_array_equal(weights[1], 0.0)        # e^-200 rounds to 0 in float32
    np.testing.assert_allclose(weights[2][mask[2]], np.exp(0.5), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(corrected).any(axis=1), [True, False, False])


@pytest.mark.parametrize("mode", MODES)
def test_micro_batch_accumulation_is_exact(mode):
    """Micro-batches of whole rows (3 + 3 + 2) with the batch's token count as denominator: the
    summed numerators equal the whole batch's up to float32 summation order (two orders of n
    terms differ by <= 2 (n - 1) u sum |l_t|), the per-token gradients equal (rtol 1e-6), the
    summed counts equal exactly."""
    rng = np.random.default_rng()
    cap = 3.0
    logp, old, rollout, ref, adv, mask = _batch(rng, cap=cap)
    config = LossConfig(loss_type="batch_token_mean", beta=0.04, rollout_correction=mode,
                        rollout_correction_cap=cap)
    total_tokens = jnp.asarray(mask.sum(), jnp.float32)

    def numerator(lp, rows):
        terms = policy_loss_terms(lp, jnp.asarray(old[rows]), jnp.asarray(adv[rows]),
                                  jnp.asarray(mask[rows]), config,
                                  ref_logprobs=jnp.asarray(ref[rows]),
                                  rollout_logprobs=jnp.asarray(rollout[rows]),
                                  global_valid_tokens=total_tokens)
        return terms.numerator / terms.denominator

    def counts(rows):
        _, corrected = rollout_correction_weights(jnp.asarray(old[rows]),
                                                  jnp.asarray(rollout[rows]),
                                                  jnp.asarray(mask[rows]), mode, cap)
        return {k: float(v) for k, v in
                rollout_correction_sums(corrected, jnp.asarray(mask[rows])).items()}

    whole = slice(0, 8)
    value, grad = jax.value_and_grad(numerator)(jnp.asarray(logp), whole)
    parts = [slice(0, 3), slice(3, 6), slice(6, 8)]
    pieces = [jax.value_and_grad(numerator)(jnp.asarray(logp[rows]), rows) for rows in parts]
    weights, _ = _numpy_weights(old, rollout, mask, mode, cap)
    bound = 2 * mask.sum() * 2.0 ** -24 * _numpy_loss_scale(logp, old, ref, adv, mask, weights,
                                                             0.04)
    assert abs(sum(float(v) for v, _ in pieces) - float(value)) <= bound
    np.testing.assert_allclose(np.concatenate([np.asarray(g) for _, g in pieces]),
                               np.asarray(grad), rtol=1e-6, atol=1e-9)
    summed = {key: sum(counts(rows)[key] for rows in parts) for key in counts(whole)}
    assert summed == counts(whole)


def test_rollout_mismatch_sums_match_float64():
    rng = np.random.default_rng()
    train, rollout = rng.normal(-1, 0.5, (3, 9)), rng.normal(-1, 0.5, (3, 9))
    mask = rng.random((3, 9)) > 0.3
    kl_sum, outside = rollout_mismatch_sums(jnp.asarray(train, jnp.float32),
                                            jnp.asarray(rollout, jnp.float32),
                                            jnp.asarray(mask))
    log_ratio = train - rollout
    np.testing.assert_allclose(float(kl_sum), ((np.exp(log_ratio) - 1 - log_ratio) * mask).sum(),
                               rtol=1e-5)
    ratio = np.exp(log_ratio)
    assert float(outside) == float((((ratio < 0.5) | (ratio > 2.0)) & mask).sum())


def test_the_registry_lists_the_modes_and_bad_settings_name_the_field():
    assert ROLLOUT_CORRECTIONS.names() == MODES
    with pytest.raises(ValueError, match=r"unknown rollout correction 'token'; known: none, "):
        LossConfig(rollout_correction="token")
    with pytest.raises(ValueError, match=r"^rollout_correction_cap=0.0 must be > 0$"):
        LossConfig(rollout_correction="token_mask", rollout_correction_cap=0.0)
    config = small_trainer_config(total_steps=1)
    config.loss.rollout_correction = "sequence"
    with pytest.raises(ConfigError, match=r"config\.loss\.rollout_correction: .*'sequence'"):
        validate_config(config)
    config.loss.rollout_correction, config.loss.rollout_correction_cap = "sequence_mask", -1.0
    with pytest.raises(ConfigError, match=r"config\.loss\.rollout_correction_cap"):
        validate_config(config)


# ------------------------------------------------------------------ the trainer, under AQN
NOT_COMPARED = ("rollout_tokens_per_s", "peak_memory_bytes")


def _aqn_config(mode):
    """4 steps with AQN noise at steps 1-3 (stage 0 is noise-free), a checkpoint every 2, and a
    cap C = 1.02 that the noise's mismatch crosses and the noise-free step 0's does not."""
    config = small_trainer_config(total_steps=4)
    config.checkpoint.every_steps = 2
    config.aqn.enabled = True
    config.aqn.stages = 4
    config.aqn.sigma_start, config.aqn.sigma_end = 0.05, 0.01
    config.loss.rollout_correction = mode
    config.loss.rollout_correction_cap = 1.02
    return config


def _comparable(rows):
    return [{k: v for k, v in row.items() if not k.startswith("time/") and k not in NOT_COMPARED}
            for row in rows]


def _workdir(tmp_path, name, warmup):
    workdir = str(tmp_path / name)
    shutil.copytree(warmup, os.path.join(workdir, "warmup"))
    return workdir


@pytest.mark.parametrize("mode", CORRECTING_MODES)
def test_each_mode_trains_under_aqn_and_resumes_exactly(tmp_path, tiny_warmup, mode):
    from qerl_jax.trainer import Trainer

    straight_dir = _workdir(tmp_path, "straight", tiny_warmup)
    Trainer(_aqn_config(mode), straight_dir).train()
    straight = read_metrics(straight_dir)
    assert [row["aqn_sigma"] > 0 for row in straight] == [False, True, True, True]
    assert all(np.isfinite(row["loss"]) for row in straight)
    # step 0's sampler is the trained policy up to float32 rounding: nothing to correct
    assert straight[0]["rollout/corrected_token_fraction"] == 0.0
    assert straight[0]["rollout/corrected_sequence_fraction"] == 0.0
    noisy = straight[1:]
    assert max(row["rollout/corrected_token_fraction"] for row in noisy) > 0.0
    for row in noisy:
        tokens = row["rollout/corrected_token_fraction"]
        sequences = row["rollout/corrected_sequence_fraction"]
        assert 0.0 <= tokens <= 1.0 and 0.0 <= sequences <= 1.0
        assert (tokens > 0) == (sequences > 0)

    resumed_dir = _workdir(tmp_path, "resumed", tiny_warmup)
    Trainer(_aqn_config(mode), resumed_dir).train(stop_after=2)
    trainer = Trainer(_aqn_config(mode), resumed_dir, resume=True)
    assert trainer.checkpoints.latest_step() == 2
    trainer.train()
    assert _comparable(read_metrics(resumed_dir)) == _comparable(straight)
    expected = jax.tree_util.tree_leaves(TrainingCheckpoints(
        os.path.join(straight_dir, "checkpoints"), read_only=True).restore(
        trainer._state_arrays())[0])
    for x, y in zip(expected, jax.tree_util.tree_leaves(trainer._state_arrays()), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
