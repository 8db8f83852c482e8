"""Policy objectives by name (POLICY_OBJECTIVES): the per-token policy-gradient loss that the
normalizers of rl/losses.py aggregate.

Every objective maps (logprobs [B, T], old_logprobs [B, T], advantages [B, 1] float32,
mask [B, T] float32 valid completion tokens, config) to (per-token loss [B, T], clipped [B, T]
bool, for the clip metric). With rho_t = pi(y_t) / pi_old(y_t) and sg the stop-gradient:
  clipped_surrogate  -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A)   (PPO; DAPO's
                     clip-higher)
  gspo               -min(s A, clip(s, 1 - eps_low, 1 + eps_high) A) per sequence (its own
                     gspo_epsilon_* range), s = exp(mean over valid tokens of log rho_t)
                     (GSPO, arXiv 2507.18071 sec. 4.1)
  gspo_token         the same value per token with s_t = sg[s] pi(y_t) / sg[pi(y_t)], so each
                     token's gradient is its own (GSPO-token, arXiv 2507.18071 sec. 4.3)
  cispo              -sg[min(rho_t, eps_max)] A log pi(y_t)   (CISPO, MiniMax-M1 arXiv
                     2506.13585 sec. 3.1: the clipped ratio weights the log-prob, no token's
                     gradient is dropped)
A sequence-level loss is spread over its sequence: every valid token carries the sequence's
loss, so the `sequence_mean` normalizer (grpo) gives the paper's mean over sequences, and the
token-count normalizers weight each sequence by its valid tokens, as TRL does. With one advantage
per sequence, gspo and gspo_token have the same gradient too; they differ where a token's loss is
dropped (top_entropy_quantile) or reweighted (rollout correction). With one update per rollout
(train.num_iterations = 1, pi_old = sg[pi]) every ratio is 1 and all four have the gradient
-A m / denominator of the loss type (gspo's spreads a dropped or reweighted token's share over
its sequence): they differ from the second update of a rollout batch on. The definitions follow TRL's
GRPOTrainer (importance_sampling_level "sequence", loss_type "cispo" with epsilon_high as the
cap) and its GSPO-token trainer ("sequence_token"); tunix's gspo-token and verl's gspo compute
gspo_token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qerl_jax.registry import POLICY_OBJECTIVES


def register_policy_objective(name: str):
    """Registers a policy objective: (logprobs [B, T], old_logprobs [B, T], advantages [B, 1]
    float32, mask [B, T] float32, config) -> (per-token loss [B, T], clipped [B, T] bool, for
    the clip metric). A new objective is one decorated function."""
    return POLICY_OBJECTIVES.register(name)


def _clip_holds(ratio, advantages, low, high):
    """[B, T] bool: where the clip replaces the ratio in min(ratio A, clip(ratio) A)."""
    return ((ratio < 1.0 - low) & (advantages < 0)) | ((ratio > 1.0 + high) & (advantages > 0))


def _clipped_min(ratio, advantages, low, high):
    return -jnp.minimum(ratio * advantages, jnp.clip(ratio, 1.0 - low, 1.0 + high) * advantages)


def sequence_log_ratio(logprobs, old_logprobs, mask):
    """[B, 1]: mean over the valid tokens of log pi - log pi_old (0 for a sequence without
    one), the log of GSPO's length-normalised sequence ratio."""
    # where, not a product: a padded position's log-probs never reach the sum or its gradient
    log_ratio = jnp.where(mask > 0, logprobs - old_logprobs, 0.0)
    return log_ratio.sum(axis=1, keepdims=True) / jnp.maximum(mask.sum(axis=1, keepdims=True), 1.0)


@register_policy_objective("clipped_surrogate")
def clipped_surrogate(logprobs, old_logprobs, advantages, mask, config):
    """-min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) per token [B, T] (PPO's clipped
    ratio, DAPO's clip-higher); clipped: the tokens whose ratio the clip holds."""
    del mask
    ratio = jnp.exp(logprobs - old_logprobs)
    return (_clipped_min(ratio, advantages, config.epsilon_low, config.epsilon_high),
            _clip_holds(ratio, advantages, config.epsilon_low, config.epsilon_high))


@register_policy_objective("gspo")
def gspo(logprobs, old_logprobs, advantages, mask, config):
    """GSPO (arXiv 2507.18071 sec. 4.1): -min(s A, clip(s, 1 - gspo_eps_low, 1 + gspo_eps_high) A)
    per sequence, s = exp(sequence_log_ratio), carried by every token of the sequence [B, T];
    clipped: every token of a sequence whose ratio the clip holds."""
    ratio = jnp.exp(sequence_log_ratio(logprobs, old_logprobs, mask))   # [B, 1]
    low, high = config.gspo_epsilon_low, config.gspo_epsilon_high
    shape = logprobs.shape
    return (jnp.broadcast_to(_clipped_min(ratio, advantages, low, high), shape),
            jnp.broadcast_to(_clip_holds(ratio, advantages, low, high), shape))


@register_policy_objective("gspo_token")
def gspo_token(logprobs, old_logprobs, advantages, mask, config):
    """GSPO-token (arXiv 2507.18071 sec. 4.3; TRL's importance_sampling_level
    "sequence_token"): gspo's loss with the per-token ratio s_t = sg[s] pi(y_t) / sg[pi(y_t)]
    (equal to s in value), clipped per token [B, T]."""
    log_s = jax.lax.stop_gradient(sequence_log_ratio(logprobs, old_logprobs, mask))
    ratio = jnp.exp(log_s + logprobs - jax.lax.stop_gradient(logprobs))
    low, high = config.gspo_epsilon_low, config.gspo_epsilon_high
    return _clipped_min(ratio, advantages, low, high), _clip_holds(ratio, advantages, low, high)


@register_policy_objective("cispo")
def cispo(logprobs, old_logprobs, advantages, mask, config):
    """CISPO (MiniMax-M1, arXiv 2506.13585 sec. 3.1; TRL's loss_type "cispo", whose
    epsilon_high is the cap): -sg[min(rho, cispo_epsilon_max)] A log pi per token [B, T];
    clipped: the tokens whose ratio exceeds the cap (TRL's metric counts those with A > 0)."""
    del mask
    ratio = jnp.exp(jax.lax.stop_gradient(logprobs - old_logprobs))
    weight = jax.lax.stop_gradient(jnp.minimum(ratio, config.cispo_epsilon_max))
    return -weight * advantages * logprobs, ratio > config.cispo_epsilon_max
