"""Group-relative advantages (GRPO; QeRL facts section 3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
