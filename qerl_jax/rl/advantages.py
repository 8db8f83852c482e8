"""Advantage estimators by name (ADVANTAGE_ESTIMATORS): rewards [P * G] -> advantages
[P * G]; the default is GRPO's group-normalized one (arXiv 2402.03300, as QeRL uses it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qerl_jax.registry import ADVANTAGE_ESTIMATORS


def register_advantage_estimator(name: str):
    """Registers an advantage estimator: (rewards [P * G] float, group_size G) -> [P * G]
    float32, rows prompt-major (row p*G + g)."""
    return ADVANTAGE_ESTIMATORS.register(name)


def advantages(rewards: jax.Array, group_size: int, estimator: str = "group_normalized"
               ) -> jax.Array:
    """The advantages [P * G] of rewards [P * G] by the registered `estimator`."""
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(ADVANTAGE_ESTIMATORS.unknown_message(estimator))
    return ADVANTAGE_ESTIMATORS.get(estimator)(rewards, group_size)


@register_advantage_estimator("group_normalized")
def group_advantages(rewards: jax.Array, group_size: int, eps: float = 1e-4) -> jax.Array:
    """A_i = (r_i - mean_g) / (std_g + eps), std unbiased (N-1), per group of G samples.

    Args:
      rewards: [P * G] float, prompt-major (row p*G + g).
      group_size: G >= 2.
    Returns:
      [P * G] float32 advantages; zero-variance groups get exactly 0.
    """
    if group_size < 2:
        raise ValueError(f"group_size={group_size}: group advantages need G >= 2")
    if rewards.shape[0] % group_size:
        raise ValueError(f"{rewards.shape[0]} rewards do not split into groups of {group_size}")
    grouped = rewards.astype(jnp.float32).reshape(-1, group_size)
    mean = grouped.mean(axis=1, keepdims=True)
    std = jnp.sqrt(((grouped - mean) ** 2).sum(axis=1, keepdims=True) / (group_size - 1))
    return ((grouped - mean) / (std + eps)).reshape(-1)


def zero_variance_groups(rewards: jax.Array, group_size: int) -> jax.Array:
    """[P] bool: groups whose rewards are all equal (DAPO dynamic sampling drops them)."""
    grouped = rewards.reshape(-1, group_size)
    return jnp.all(grouped == grouped[:, :1], axis=1)
