"""The registered policy objectives (clipped_surrogate, GSPO, GSPO-token, CISPO) against float64
numpy implementations of the papers' formulas, loss and gradient, under every loss type; exact
micro-batch accumulation with the global denominators; one trainer step of each.

Tolerances: the inputs are rounded to float32 first, so the only differences are float32
arithmetic (unit roundoff 6e-8). A loss value passes through about a dozen roundings (exp, a mean
over T = 7 tokens, a normalizer sum over B * T = 42 terms, a division), so rtol 1e-5 (about 170
roundoffs) bounds it; the loss is a signed sum whose terms cancel, so atol 1e-6 against terms of
order 1. A gradient entry is a product of at most four rounded factors: rtol 1e-5, atol 1e-7
(entries that are 0 are exactly 0 in both).
"""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from qerl_jax import registry
from qerl_jax.rl.losses import LossConfig, policy_loss_terms

OBJECTIVES = ("clipped_surrogate", "gspo", "gspo_token", "cispo")
GLOBAL_LOSS_TYPES = ("sequence_mean", "constant_length_sum", "batch_token_mean")
RTOL, ATOL, GRAD_ATOL = 1e-5, 1e-6, 1e-7
# relative distance every ratio keeps from a clip boundary (a kink of the loss): 100 times the
# float32 error of a ratio, so both sides of the comparison take the same branch
MARGIN = 1e-5


def _f32(values):
    return np.asarray(values, np.float32).astype(np.float64)


def _kinks(objective, config):
    if objective == "cispo":
        return (config.cispo_epsilon_max,)
    if objective.startswith("gspo"):
        return (1 - config.gspo_epsilon_low, 1 + config.gspo_epsilon_high)
    return (1 - config.epsilon_low, 1 + config.epsilon_high)


def _sequence_ratio(logp, old, mask):
    """GSPO's s_i = (pi(y_i) / pi_old(y_i)) ** (1 / |y_i|), in log space [B]."""
    lengths = mask.sum(1)
    return np.exp(((logp - old) * mask).sum(1) / np.maximum(lengths, 1))


def _batch(rng, objective, config, batch=6, length=7):
    """float32-representable (logp, old, adv, mask) whose ratios keep MARGIN from the clip
    boundaries, with ratios on both sides of one."""
    # log-ratio spread: GSPO's clip range is ~1e-4 wide, CISPO's cap is 5, the PPO range 0.2
    scale = {"gspo": 1e-3, "gspo_token": 1e-3, "cispo": 1.5}.get(objective, 0.3)
    kinks = np.asarray(_kinks(objective, config))
    while True:
        logp = _f32(rng.normal(-2.0, 0.5, (batch, length)))
        old = _f32(logp + rng.normal(0, scale, (batch, length)))
        adv = _f32(rng.normal(size=batch))
        mask = (rng.random((batch, length)) < 0.75).astype(np.float64)
        mask[0] = 0.0                       # a fully masked (e.g. truncated) sequence
        if objective.startswith("gspo"):
            ratios = _sequence_ratio(logp, old, mask)[mask.sum(1) > 0]
        else:
            ratios = np.exp(logp - old)[mask > 0]
        distance = np.abs(ratios[:, None] / kinks[None, :] - 1)
        sides = ratios[:, None] > kinks[None, :]
        if distance.min() > MARGIN and sides.any() and not sides.all():
            return logp, old, adv, mask


def _numpy_objective(objective, logp, old, adv, mask, config):
    """float64 (per-token loss [B, T], d loss_t / d logp_t [B, T], d loss_t / d logp_u within a
    sequence [B, T] (GSPO's sequence ratio couples the tokens), clipped [B, T]) from the
    papers' formulas."""
    a = adv[:, None]
    lengths = np.maximum(mask.sum(1, keepdims=True), 1)
    if objective == "cispo":
        # MiniMax-M1 sec. 3.1: J = sum_t sg(min(r_t, eps_max)) A log pi_t (TRL's cap)
        weight = np.minimum(np.exp(logp - old), config.cispo_epsilon_max)
        loss, own = -weight * a * logp, -weight * a
        return loss, own, np.zeros_like(loss), np.exp(logp - old) > config.cispo_epsilon_max
    if objective == "clipped_surrogate":
        ratio, low, high = np.exp(logp - old), config.epsilon_low, config.epsilon_high
    else:
        ratio = np.broadcast_to(_sequence_ratio(logp, old, mask)[:, None], logp.shape)
        low, high = config.gspo_epsilon_low, config.gspo_epsilon_high
    unclipped, clipped = ratio * a, np.clip(ratio, 1 - low, 1 + high) * a
    loss = -np.minimum(unclipped, clipped)
    takes_clip = clipped < unclipped           # the min is the constant clipped term
    d_ratio = np.where(takes_clip, 0.0, -a)    # d loss / d ratio
    is_clipped = ((ratio < 1 - low) & (a < 0)) | ((ratio > 1 + high) & (a > 0))
    if objective == "clipped_surrogate":
        return loss, d_ratio * ratio, np.zeros_like(loss), is_clipped
    if objective == "gspo_token":
        # sec. 4.3: s_t = sg[s] pi_t / sg[pi_t]: d s_t / d logp_t = s, no other token's
        return loss, d_ratio * ratio, np.zeros_like(loss), is_clipped
    # gspo, sec. 4.1: d s / d logp_u = s / |y| for every valid token u of the sequence
    return loss, np.zeros_like(loss), d_ratio * ratio / lengths * mask, is_clipped


def _numpy_loss_and_grad(objective, logp, old, adv, mask, config):
    """The loss the normalizer makes of the per-token losses, and its gradient [B, T]."""
    loss, own, coupled, is_clipped = _numpy_objective(objective, logp, old, adv, mask, config)
    batch, lengths = mask.shape[0], mask.sum(1, keepdims=True)
    kind = registry.LOSS_NORMALIZERS.canonical(config.loss_type)
    weight = {  # each valid token's weight in the aggregate
        "sequence_mean": np.broadcast_to(1 / (batch * np.maximum(lengths, 1)), mask.shape),
        "micro_batch_token_mean": np.full(mask.shape, 1 / max(mask.sum(), 1)),
        "constant_length_sum": np.full(mask.shape, 1 / (batch * config.max_completion_length)),
        "batch_token_mean": np.full(mask.shape, 1 / max(mask.sum(), 1)),
    }[kind] * mask
    value = (weight * loss).sum()
    # gspo: every token of sequence i carries f_i(s_i), so d/d logp_u = sum_t weight_t f_i'
    grad = weight * own + (weight.sum(1, keepdims=True) * coupled)
    return value, grad, (is_clipped * mask).sum()


def _jax_loss(logp, old, adv, mask, config, **kwargs):
    def loss(lp):
        terms = policy_loss_terms(lp, jnp.asarray(old, jnp.float32), jnp.asarray(adv, jnp.float32),
                                  jnp.asarray(mask), config, **kwargs)
        return terms.numerator / terms.denominator, terms
    (value, terms), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(logp, jnp.float32))
    return float(value), np.asarray(grad), terms


@pytest.mark.parametrize("loss_type", registry.LOSS_NORMALIZERS.names())
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_objective_loss_and_gradient_match_float64(objective, loss_type):
    rng = np.random.default_rng()
    config = LossConfig(policy_objective=objective, loss_type=loss_type, max_completion_length=7)
    logp, old, adv, mask = _batch(rng, objective, config)
    expected, expected_grad, expected_clipped = _numpy_loss_and_grad(objective, logp, old, adv,
                                                                     mask, config)
    value, grad, terms = _jax_loss(logp, old, adv, mask, config)
    np.testing.assert_allclose(value, expected, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grad, expected_grad, rtol=RTOL, atol=GRAD_ATOL)
    assert float(terms.clipped_tokens) == expected_clipped


def test_gspo_with_sequence_mean_is_the_papers_mean_over_sequences():
    """GSPO sec. 4.1 as written: J = (1/G) sum_i min(s_i A_i, clip(s_i) A_i), with the fully
    masked sequence counted as s = 1 (it carries no token, so it adds 0)."""
    rng = np.random.default_rng()
    config = LossConfig(policy_objective="gspo", loss_type="grpo")
    logp, old, adv, mask = _batch(rng, "gspo", config)
    s = _sequence_ratio(logp, old, mask)
    per_sequence = -np.minimum(s * adv, np.clip(s, 1 - 3e-4, 1 + 4e-4) * adv)
    per_sequence[mask.sum(1) == 0] = 0.0
    value, _, _ = _jax_loss(logp, old, adv, mask, config)
    np.testing.assert_allclose(value, per_sequence.mean(), rtol=RTOL, atol=ATOL)


def test_gspo_token_has_gspos_value_and_gradient_with_one_advantage_per_sequence():
    """GSPO sec. 4.3: with A_i,t = A_i, GSPO-token equals GSPO in value and gradient; with
    tokens dropped by the entropy filter, only gspo_token's gradient leaves them out."""
    rng = np.random.default_rng()
    config = LossConfig(policy_objective="gspo", loss_type="grpo")
    logp, old, adv, mask = _batch(rng, "gspo", config)
    results = [_jax_loss(logp, old, adv, mask, LossConfig(policy_objective=name, loss_type="grpo"))
               for name in ("gspo", "gspo_token")]
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-6)   # XLA's fusions differ
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=RTOL, atol=GRAD_ATOL)
    entropies = jnp.asarray(rng.random(mask.shape), jnp.float32)
    filtered = [_jax_loss(logp, old, adv, mask, LossConfig(
        policy_objective=name, loss_type="grpo", top_entropy_quantile=0.5), entropies=entropies)
        for name in ("gspo", "gspo_token")]
    dropped = (np.asarray(entropies) < np.quantile(np.asarray(entropies)[mask > 0], 0.5)) & (
        mask > 0)
    assert np.all(filtered[1][1][dropped] == 0) and np.any(filtered[0][1][dropped] != 0)


def test_cispo_keeps_every_tokens_gradient_and_caps_its_weight():
    """Above the cap the weight is eps_max, not 0: no token's gradient is dropped (CISPO's
    point against clipped_surrogate, which zeroes clipped tokens' gradients)."""
    rng = np.random.default_rng()
    config = LossConfig(policy_objective="cispo", loss_type="dapo")
    logp, old, adv, mask = _batch(rng, "cispo", config)
    _, grad, _ = _jax_loss(logp, old, adv, mask, config)
    above = (np.exp(logp - old) > config.cispo_epsilon_max) & (mask > 0)
    assert above.any()
    np.testing.assert_allclose(grad[above], (-config.cispo_epsilon_max * adv[:, None]
                                             / mask.sum() * np.ones_like(mask))[above],
                               rtol=RTOL)


@pytest.mark.parametrize("loss_type", ["sequence_mean", "micro_batch_token_mean"])
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_on_policy_every_objective_has_the_gradient_minus_advantage(objective, loss_type):
    """pi_old = sg[pi] (one update per rollout): every ratio is 1, nothing is clipped, and the
    gradient is -A m / denominator whatever the objective (sequence_mean: B |y_i|)."""
    rng = np.random.default_rng()
    config = LossConfig(policy_objective=objective, loss_type=loss_type)
    logp, _, adv, mask = _batch(rng, "clipped_surrogate", LossConfig())

    def loss(lp):
        terms = policy_loss_terms(lp, jax.lax.stop_gradient(lp), jnp.asarray(adv, jnp.float32),
                                  jnp.asarray(mask), config)
        return terms.numerator / terms.denominator, terms.clipped_tokens
    (_, clipped), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(logp, jnp.float32))
    denominator = (mask.shape[0] * np.maximum(mask.sum(1, keepdims=True), 1)
                   if loss_type == "sequence_mean" else mask.sum())
    np.testing.assert_allclose(np.asarray(grad), -adv[:, None] * mask / denominator, rtol=RTOL,
                               atol=GRAD_ATOL)
    assert float(clipped) == 0.0


@pytest.mark.parametrize("loss_type", GLOBAL_LOSS_TYPES)
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_micro_batches_accumulate_exactly(objective, loss_type):
    """Rows split into 4 micro-batches of 2: the numerators summed over the global denominator
    and the micro-batches' gradients equal the whole batch's. The per-token gradient is the same
    expression either way (rtol 1e-6); the loss sum only changes its summation order."""
    rng = np.random.default_rng()
    config = LossConfig(policy_objective=objective, loss_type=loss_type, max_completion_length=7)
    logp, old, adv, mask = _batch(rng, objective, config, batch=8)
    whole_value, whole_grad, _ = _jax_loss(logp, old, adv, mask, config)

    def part(rows):
        def numerator_over_global(lp):
            terms = policy_loss_terms(lp, jnp.asarray(old[rows], jnp.float32),
                                      jnp.asarray(adv[rows], jnp.float32),
                                      jnp.asarray(mask[rows]), config,
                                      global_valid_tokens=mask.sum(), global_sequences=8)
            return terms.numerator / terms.denominator
        return jax.value_and_grad(numerator_over_global)(jnp.asarray(logp[rows], jnp.float32))

    parts = [part(slice(i, i + 2)) for i in range(0, 8, 2)]
    np.testing.assert_allclose(sum(float(value) for value, _ in parts), whole_value,
                               rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.concatenate([np.asarray(g) for _, g in parts]), whole_grad,
                               rtol=1e-6, atol=1e-9)


def test_unknown_objective_and_bad_ranges_are_refused():
    with pytest.raises(ValueError) as error:
        LossConfig(policy_objective="ppo")
    assert str(error.value) == registry.POLICY_OBJECTIVES.unknown_message("ppo")
    assert str(error.value) == ("unknown policy objective 'ppo'; known: clipped_surrogate, gspo, "
                                "gspo_token, cispo")
    with pytest.raises(ValueError, match=r"^GSPO clip range gspo_epsilon_low=1.0, "
                                         r"gspo_epsilon_high=0.0004 is invalid$"):
        LossConfig(gspo_epsilon_low=1.0)
    with pytest.raises(ValueError, match=r"^cispo_epsilon_max=0.0 must be > 0$"):
        LossConfig(cispo_epsilon_max=0.0)


def test_loss_config_reads_the_objective_fields_from_the_config():
    from qerl_jax.experiment_config import base_config

    loss = base_config().loss
    loss.policy_objective, loss.gspo_epsilon_high, loss.cispo_epsilon_max = "gspo", 5e-4, 4.0
    config = LossConfig.from_config(loss, 12)
    assert (config.policy_objective, config.gspo_epsilon_low, config.gspo_epsilon_high,
            config.cispo_epsilon_max) == ("gspo", 3e-4, 5e-4, 4.0)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_each_objective_trains_a_step_with_a_finite_loss(objective, tmp_path, tiny_warmup):
    """The tiny trainer (tests/conftest.py) with each objective: finite loss and gradient norm,
    and nothing clipped (one update per rollout: pi_old = sg[pi], so every ratio is 1)."""
    import os
    import shutil

    from qerl_jax.infra.metrics import read_metrics
    from qerl_jax.trainer import Trainer
    from tests.conftest import small_trainer_config

    config = small_trainer_config(total_steps=1)
    config.loss.policy_objective = objective
    workdir = str(tmp_path / objective)
    shutil.copytree(tiny_warmup, os.path.join(workdir, "warmup"))
    Trainer(config, workdir).train()
    [row] = read_metrics(workdir)
    assert np.isfinite(row["loss"]) and np.isfinite(row["grad_norm"]), row
    assert row["clip_fraction"] == 0.0
