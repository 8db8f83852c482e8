"""The registered advantage estimators against float64 numpy computations of their formulas on
fresh random rewards. JAX runs in float32 on float32-representable rewards of order 1: an
advantage passes through a group sum of G = 4..5 terms, a subtraction and (group_normalized) a
square root and a division, under 20 roundings of 6e-8, so rtol 1e-5; atol 1e-6 for
advantages that cancel to ~0."""

import jax.numpy as jnp
import numpy as np
import pytest

from qerl_jax import registry
from qerl_jax.rl.advantages import advantages, group_advantages, zero_variance_groups


def _group_normalized(group):
    return (group - group.mean()) / (group.std(ddof=1) + 1e-4)


def _mean_centered(group):
    return group - group.mean()


def _rloo(group):
    return np.array([r - np.delete(group, i).mean() for i, r in enumerate(group)])


REFERENCES = {"group_normalized": _group_normalized, "mean_centered": _mean_centered,
              "rloo": _rloo}


def _rewards(rng, group_size, groups=6):
    rewards = np.asarray(rng.choice([0.0, 0.2, 1.0, 2.2], size=groups * group_size)
                         + rng.normal(0, 0.3, groups * group_size) * (rng.random() < 0.5),
                         np.float32).astype(np.float64)
    rewards[:group_size] = 0.2                # a zero-variance group (0.2 is inexact in binary)
    return rewards


@pytest.mark.parametrize("group_size", [4, 5])
@pytest.mark.parametrize("estimator", sorted(REFERENCES))
def test_estimator_matches_float64(estimator, group_size):
    rng = np.random.default_rng()
    rewards = _rewards(rng, group_size)
    expected = np.concatenate([REFERENCES[estimator](group)
                               for group in rewards.reshape(-1, group_size)])
    got = np.asarray(advantages(jnp.asarray(rewards, jnp.float32), group_size, estimator))
    assert got.dtype == np.float32 and got.shape == rewards.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert np.all(got[:group_size] == 0)      # exactly: the zero-variance group gives no signal


def test_rloo_is_mean_centered_rescaled_by_g_over_g_minus_1():
    """r_i - mean of the others = G / (G - 1) (r_i - mean): the leave-one-out baseline as TRL
    and tunix compute it, without rescaling."""
    rewards = jnp.asarray(np.random.default_rng().random(12), jnp.float32)
    np.testing.assert_allclose(np.asarray(advantages(rewards, 3, "rloo")),
                               1.5 * np.asarray(advantages(rewards, 3, "mean_centered")),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("alias", sorted(registry.ADVANTAGE_ESTIMATORS.aliases()))
def test_aliases_give_the_estimator_they_name(alias):
    rewards = jnp.asarray(np.random.default_rng().random(8), jnp.float32)
    target = registry.ADVANTAGE_ESTIMATORS.aliases()[alias]
    np.testing.assert_array_equal(np.asarray(advantages(rewards, 4, alias)),
                                  np.asarray(advantages(rewards, 4, target)))
    assert registry.ADVANTAGE_ESTIMATORS.aliases() == {"grpo": "group_normalized",
                                                        "drgrpo": "mean_centered"}


def test_group_advantages_is_the_group_normalized_estimator():
    rewards = jnp.asarray(np.random.default_rng().random(8), jnp.float32)
    np.testing.assert_array_equal(np.asarray(group_advantages(rewards, 4)),
                                  np.asarray(advantages(rewards, 4)))
    assert bool(zero_variance_groups(jnp.asarray([1.0, 1.0, 0.0, 1.0]), 2)[0])
    assert not bool(zero_variance_groups(jnp.asarray([1.0, 1.0, 0.0, 1.0]), 2)[1])


@pytest.mark.parametrize("estimator", sorted(REFERENCES))
def test_bad_groups_and_unknown_names_are_refused(estimator):
    with pytest.raises(ValueError, match=r"^group_size=1: group advantages need G >= 2$"):
        advantages(jnp.zeros(4), 1, estimator)
    with pytest.raises(ValueError, match=r"^6 rewards do not split into groups of 4$"):
        advantages(jnp.zeros(6), 4, estimator)
    with pytest.raises(ValueError) as error:
        advantages(jnp.zeros(4), 2, "gae")
    assert str(error.value) == registry.ADVANTAGE_ESTIMATORS.unknown_message("gae")
    assert str(error.value) == ("unknown advantage estimator 'gae'; known: group_normalized, "
                                "mean_centered, rloo, grpo, drgrpo")
