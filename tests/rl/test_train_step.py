"""training_batch (rollout groups -> training arrays) against a row-by-row numpy construction,
with the default and a registered advantage estimator; a registered policy objective is the one
policy_loss_terms applies (float64 numpy, rtol 1e-6)."""

import types

import jax.numpy as jnp
import numpy as np
import pytest

from qerl_jax import registry
from qerl_jax.rl.advantages import register_advantage_estimator
from qerl_jax.rl.losses import LossConfig, policy_loss_terms, register_policy_objective
from qerl_jax.rl.train_step import training_batch


def _groups(rng, prompt_lengths, group_size, completion_length):
    groups = []
    for length in prompt_lengths:
        rollout = types.SimpleNamespace(
            tokens=rng.integers(1, 50, (group_size, completion_length)),
            mask=rng.random((group_size, completion_length)) < 0.8,
            logprobs=rng.normal(size=(group_size, completion_length)).astype(np.float32),
            truncated=rng.random(group_size) < 0.5)
        groups.append({"prompt_tokens": rng.integers(1, 50, length),
                       "prompt_mask": np.ones(length, bool), "rollout": rollout,
                       "scores": {"total": list(rng.integers(0, 2, group_size) * 1.0),
                                  "format": [0.0] * group_size}})
    return groups


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_training_batch_rows_are_the_groups_left_padded(mask_truncated):
    rng = np.random.default_rng()
    group, completion, prompt_length = 3, 4, 8
    groups = _groups(rng, (5, 7), group, completion)
    batch, rewards, completion_mask, truncated = training_batch(
        groups, group_size=group, prompt_length=prompt_length, completion_length=completion,
        mask_truncated=mask_truncated)
    for index, entry in enumerate(groups):
        prompt = entry["prompt_tokens"]
        for g in range(group):
            row = index * group + g
            expected = np.zeros(prompt_length + completion, np.int64)
            expected[prompt_length - len(prompt):prompt_length] = prompt
            expected[prompt_length:] = entry["rollout"].tokens[g]
            np.testing.assert_array_equal(batch["tokens"][row], expected)
            attention = np.zeros(prompt_length + completion, bool)
            attention[prompt_length - len(prompt):prompt_length] = True
            attention[prompt_length:] = entry["rollout"].mask[g]
            np.testing.assert_array_equal(batch["attention_mask"][row], attention)
            drop = mask_truncated and entry["rollout"].truncated[g]
            np.testing.assert_array_equal(batch["loss_mask"][row],
                                          entry["rollout"].mask[g] & (not drop))
            assert truncated[row] == entry["rollout"].truncated[g]
    totals = np.asarray([r for entry in groups for r in entry["scores"]["total"]], np.float64)
    grouped = totals.reshape(-1, group)
    std = grouped.std(axis=1, ddof=1, keepdims=True)
    expected = ((grouped - grouped.mean(axis=1, keepdims=True)) / (std + 1e-4)).reshape(-1)
    np.testing.assert_allclose(batch["advantages"], expected, rtol=1e-6, atol=1e-6)
    assert rewards["format"] == [0.0] * 2 * group and completion_mask.shape == (6, completion)


def test_a_registered_advantage_estimator_is_used():
    @register_advantage_estimator("test_centered")
    def centered(rewards, group_size):
        grouped = rewards.astype(jnp.float32).reshape(-1, group_size)
        return (grouped - grouped.mean(axis=1, keepdims=True)).reshape(-1)

    try:
        rng = np.random.default_rng()
        groups = _groups(rng, (3, 3), 4, 2)
        batch, *_ = training_batch(groups, group_size=4, prompt_length=4, completion_length=2,
                                   mask_truncated=False, advantage_estimator="test_centered")
        totals = np.asarray([r for entry in groups for r in entry["scores"]["total"]])
        grouped = totals.reshape(-1, 4)
        np.testing.assert_allclose(batch["advantages"],
                                   (grouped - grouped.mean(1, keepdims=True)).reshape(-1),
                                   rtol=1e-6, atol=1e-6)
    finally:
        registry.ADVANTAGE_ESTIMATORS.unregister("test_centered")
    with pytest.raises(ValueError, match=r"^prompt_length=2 is shorter than the longest prompt "
                                         r"\(3 tokens\)$"):
        training_batch(groups, group_size=4, prompt_length=2, completion_length=2,
                       mask_truncated=False)


def test_a_registered_policy_objective_is_the_one_applied():
    @register_policy_objective("test_unclipped")
    def unclipped(logprobs, old_logprobs, advantages, mask, config):
        ratio = jnp.exp(logprobs - old_logprobs)
        return -ratio * advantages, jnp.zeros_like(ratio, dtype=bool)

    try:
        rng = np.random.default_rng()
        logp = rng.normal(-1.0, 0.3, (3, 5))
        old = logp + rng.normal(0, 0.5, (3, 5))   # ratios far outside the clip range
        adv = rng.normal(size=3)
        mask = rng.random((3, 5)) < 0.8
        config = LossConfig(policy_objective="test_unclipped")
        terms = policy_loss_terms(*(jnp.asarray(v, jnp.float32) for v in (logp, old, adv)),
                                  jnp.asarray(mask), config)
        expected = (-np.exp(logp - old) * adv[:, None] * mask).sum() / max(mask.sum(), 1)
        np.testing.assert_allclose(float(terms.numerator / terms.denominator), expected,
                                   rtol=1e-5)
        assert float(terms.clipped_tokens) == 0.0
    finally:
        registry.POLICY_OBJECTIVES.unregister("test_unclipped")
