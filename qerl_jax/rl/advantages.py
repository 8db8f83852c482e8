"""Advantage estimators by name (ADVANTAGE_ESTIMATORS): rewards [P * G] -> advantages
[P * G], per group of the G completions of one prompt:
  group_normalized  (r_i - mean) / (std + 1e-4), std unbiased   (GRPO, arXiv 2402.03300, as
                    QeRL uses it; alias grpo)
  mean_centered     r_i - mean                                  (Dr. GRPO, arXiv 2503.20783
                    sec. 3.1: no std, so no difficulty bias; alias drgrpo)
  rloo              r_i - mean of the other G - 1 rewards       (RLOO, arXiv 2402.14740; as TRL
                    and tunix, without rescaling: it equals G / (G - 1) (r_i - mean))
"""

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


def _grouped(rewards: jax.Array, group_size: int) -> tuple[jax.Array, jax.Array]:
    """([P, G] float32 rewards, [P, 1] bool: the groups whose rewards are all equal) of rewards
    [P * G]. Those groups carry no signal and get exactly 0 from every estimator (a mean of
    G equal floats is not always exact: 3 x 0.2 would leave a residue of order 1e-8 / eps)."""
    if group_size < 2:
        raise ValueError(f"group_size={group_size}: group advantages need G >= 2")
    if rewards.shape[0] % group_size:
        raise ValueError(f"{rewards.shape[0]} rewards do not split into groups of {group_size}")
    grouped = rewards.astype(jnp.float32).reshape(-1, group_size)
    return grouped, jnp.all(grouped == grouped[:, :1], axis=1, keepdims=True)


def _centered(grouped: jax.Array) -> jax.Array:
    """[P, G]: each reward minus its group's mean."""
    return grouped - grouped.mean(axis=1, keepdims=True)


@register_advantage_estimator("group_normalized")
def group_advantages(rewards: jax.Array, group_size: int, eps: float = 1e-4) -> jax.Array:
    """A_i = (r_i - mean_g) / (std_g + eps), std unbiased (N-1), per group of G samples.

    Args:
      rewards: [P * G] float, prompt-major (row p*G + g).
      group_size: G >= 2.
    Returns:
      [P * G] float32 advantages; zero-variance groups get exactly 0.
    """
    grouped, equal = _grouped(rewards, group_size)
    centered = _centered(grouped)
    std = jnp.sqrt((centered ** 2).sum(axis=1, keepdims=True) / (group_size - 1))
    return jnp.where(equal, 0.0, centered / (std + eps)).reshape(-1)


@register_advantage_estimator("mean_centered")
def mean_centered_advantages(rewards: jax.Array, group_size: int) -> jax.Array:
    """A_i = r_i - mean_g (Dr. GRPO, arXiv 2503.20783 sec. 3.1), rewards [P * G] prompt-major
    -> [P * G] float32; zero-variance groups get exactly 0."""
    grouped, equal = _grouped(rewards, group_size)
    return jnp.where(equal, 0.0, _centered(grouped)).reshape(-1)


@register_advantage_estimator("rloo")
def rloo_advantages(rewards: jax.Array, group_size: int) -> jax.Array:
    """A_i = r_i - (sum_g r - r_i) / (G - 1), the leave-one-out baseline (RLOO, arXiv
    2402.14740), rewards [P * G] prompt-major -> [P * G] float32; zero-variance groups get
    exactly 0."""
    grouped, equal = _grouped(rewards, group_size)
    others = (grouped.sum(axis=1, keepdims=True) - grouped) / (group_size - 1)
    return jnp.where(equal, 0.0, grouped - others).reshape(-1)


def zero_variance_groups(rewards: jax.Array, group_size: int) -> jax.Array:
    """[P] bool: groups whose rewards are all equal (DAPO dynamic sampling drops them)."""
    grouped = rewards.reshape(-1, group_size)
    return jnp.all(grouped == grouped[:, :1], axis=1)
