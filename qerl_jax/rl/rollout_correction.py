"""Rollout correction: importance weights for tokens sampled from a rollout policy that differs
from the trained one (AQN noise on the rollout, the 4-bit kernels' rounding), and the mismatch
metrics between the two.

The ratio of the trained policy before the update (pi_old) to the sampler's (pi_rollout), on
the valid tokens m of each sequence, per token or per sequence:
  token     r_t = exp(log pi_old(y_t) - log pi_rollout(y_t))
  sequence  r   = exp(sum_t m_t (log pi_old(y_t) - log pi_rollout(y_t)))     (one per sequence)
A registered mode (ROLLOUT_CORRECTIONS, config `loss.rollout_correction`) turns a ratio into a
weight with the cap C (`loss.rollout_correction_cap`):
  none               1
  token_truncate     min(r_t, C)                      (truncated IS, TIS)
  token_mask         r_t if r_t <= C else 0           (masked IS, MIS)
  sequence_truncate  min(r, C) on every token of the sequence
  sequence_mask      r if r <= C else 0 on every token of the sequence
as TRL's GRPOTrainer (`vllm_importance_sampling_mode`, `vllm_importance_sampling_clip_max`,
default C = 3; a masked token keeps its ratio r, not 1) and verl's rollout_corr_helper
(`rollout_is` token / sequence). The weight multiplies each token's policy loss, not the KL term,
and carries no gradient. Sequence ratios stay in log space: the log-ratio is compared with
log C and only values <= log C are exponentiated, so a long sequence whose product of ratios
overflows float32 gets its exact weight (TRL exponentiates the sum, then clamps; verl clamps the
log-ratio to +-20 first: the same weights wherever e^-20 < r and C < e^20).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qerl_jax.registry import ROLLOUT_CORRECTIONS


def register_rollout_correction(name: str):
    """Registers a rollout correction mode: (log-ratio log pi_old - log pi_rollout [B, T], 0 off
    the valid tokens; mask [B, T] float32; cap C) -> (weights [B, T] float32, corrected [B, T]
    bool: the tokens whose weight is not their ratio)."""
    return ROLLOUT_CORRECTIONS.register(name)


def _sequence_log_ratio(log_ratio: jax.Array, mask: jax.Array) -> jax.Array:
    """The log of each sequence's ratio, on every token [B, T]."""
    return jnp.broadcast_to((log_ratio * mask).sum(axis=1, keepdims=True), log_ratio.shape)


def _truncate(log_ratio: jax.Array, cap: float) -> tuple[jax.Array, jax.Array]:
    log_cap = jnp.log(cap)
    return jnp.exp(jnp.minimum(log_ratio, log_cap)), log_ratio > log_cap


def _mask(log_ratio: jax.Array, cap: float) -> tuple[jax.Array, jax.Array]:
    log_cap = jnp.log(cap)
    above = log_ratio > log_cap
    # the minimum keeps exp finite where the ratio is dropped anyway
    return jnp.where(above, 0.0, jnp.exp(jnp.minimum(log_ratio, log_cap))), above


@register_rollout_correction("none")
def no_correction(log_ratio, mask, cap):
    """Weight 1 on every token."""
    del mask, cap
    return jnp.ones_like(log_ratio), jnp.zeros(log_ratio.shape, jnp.bool_)


@register_rollout_correction("token_truncate")
def token_truncate(log_ratio, mask, cap):
    """min(r_t, C) per token (TRL token_truncate, verl rollout_is=token)."""
    del mask
    return _truncate(log_ratio, cap)


@register_rollout_correction("token_mask")
def token_mask(log_ratio, mask, cap):
    """r_t where r_t <= C, else 0, per token (TRL token_mask)."""
    del mask
    return _mask(log_ratio, cap)


@register_rollout_correction("sequence_truncate")
def sequence_truncate(log_ratio, mask, cap):
    """min(r, C) with r the sequence's product of token ratios (TRL sequence_truncate, verl
    rollout_is=sequence)."""
    return _truncate(_sequence_log_ratio(log_ratio, mask), cap)


@register_rollout_correction("sequence_mask")
def sequence_mask(log_ratio, mask, cap):
    """r where the sequence's ratio r <= C, else 0 (TRL sequence_mask)."""
    return _mask(_sequence_log_ratio(log_ratio, mask), cap)


def rollout_correction_weights(old_logprobs: jax.Array, rollout_logprobs: jax.Array,
                               mask: jax.Array, mode: str,
                               cap: float) -> tuple[jax.Array, jax.Array]:
    """(weights [B, T] without gradient, corrected [B, T] bool: the valid tokens whose weight was
    truncated or masked) of the registered `mode` with cap C, from [B, T] log-probs of the
    sampled tokens under pi_old and pi_rollout and the valid-token mask."""
    mask = mask.astype(jnp.float32)
    # padding contributes a log-ratio of 0 (TRL multiplies the difference by the mask)
    log_ratio = (jax.lax.stop_gradient(old_logprobs) - rollout_logprobs) * mask
    weights, corrected = ROLLOUT_CORRECTIONS.get(mode)(log_ratio, mask, cap)
    return jax.lax.stop_gradient(weights), corrected & (mask > 0)


def rollout_correction_sums(corrected: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
    """Sums over the rows of [B, T] corrected / valid-token masks, for per-step fractions summed
    over micro-batches: corrected tokens (divide by the valid tokens), sequences with a
    corrected token and sequences with a valid token (their ratio)."""
    valid = mask.astype(jnp.bool_)
    corrected = corrected & valid
    return {"rollout_corrected_tokens": corrected.sum().astype(jnp.float32),
            "rollout_corrected_sequences": corrected.any(axis=1).sum().astype(jnp.float32),
            "rollout_sequences": valid.any(axis=1).sum().astype(jnp.float32)}


def rollout_mismatch_sums(logprobs: jax.Array, rollout_logprobs: jax.Array,
                          mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum of the k3 estimate of KL(pi_rollout || pi_train), number of tokens whose ratio
    pi_train / pi_rollout is outside [1/2, 2]) over the valid tokens of [B, T] log-probs of
    tokens sampled from the rollout policy; divide by the valid tokens for means."""
    log_ratio = jax.lax.stop_gradient(logprobs) - rollout_logprobs
    mask = mask.astype(jnp.float32)
    k3 = jnp.expm1(log_ratio) - log_ratio   # >= 0; expm1 keeps it accurate near 0
    outside = (jnp.abs(log_ratio) > jnp.log(2.0)).astype(jnp.float32)
    return (k3 * mask).sum(), (outside * mask).sum()
