"""Policy losses: a registered per-token objective, optional k3 KL, and a registered
normalizer (GRPO / DAPO as QeRL trains with them; DAPO: arXiv 2503.14476).

Per token (rho = exp(logp - logp_old)), the policy objective (POLICY_OBJECTIVES,
rl/objectives.py) gives pg; the default, clipped_surrogate, is PPO's clipped ratio with DAPO's
asymmetric clip range; gspo and gspo_token clip the sequence's length-normalised ratio (GSPO),
cispo weights log pi by the stop-gradient capped ratio (CISPO):
  pg  = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)     (clipped_surrogate)
  kl  = exp(ref - logp) - (ref - logp) - 1            (k3; only when beta != 0)
  l   = pg * entropy_mask + beta * kl
How the per-token losses l over valid tokens m are aggregated is the loss type, a registered
normalizer (LOSS_NORMALIZERS; returned as numerator and denominator, so micro-batching stays
exact). Named for what they compute; the names of the papers and TRL are aliases
(qerl_jax.registry lists them):
  sequence_mean           sum_i [sum_t l m / max(sum_t m, 1)] / sequences        (grpo)
  micro_batch_token_mean  sum l m / max(sum m, 1) per micro-batch, averaged      (bnpo; QeRL's
                          released "DAPO" runs)
  constant_length_sum     sum l m / (sequences * max_completion_length)          (dr_grpo)
  batch_token_mean        sum l m / valid tokens of the whole generation batch   (dapo)
All but micro_batch_token_mean have a global denominator: summing numerators over
micro-batches and dividing by it is exact; micro_batch_token_mean averages the micro-batches'
ratios, as TRL's bnpo does. A sequence-level objective (gspo) puts the sequence's loss on each
of its valid tokens, so sequence_mean gives GSPO's mean over sequences; the papers pair gspo with
sequence_mean and cispo with batch_token_mean.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from qerl_jax.registry import LOSS_NORMALIZERS, POLICY_OBJECTIVES, ROLLOUT_CORRECTIONS
# importing the objectives registers them; register_policy_objective stays importable from here
from qerl_jax.rl.objectives import register_policy_objective  # noqa: F401
from qerl_jax.rl.rollout_correction import rollout_correction_sums, rollout_correction_weights


class LossNormalizer(NamedTuple):
    """(masked per-token losses [B, T], mask [B, T], sequences, global valid tokens, config)
    -> (numerator, denominator); `global_denominator`: the same for every micro-batch."""

    function: Callable
    global_denominator: bool


def register_loss_normalizer(name: str, *, global_denominator: bool, aliases=()):
    """Registers a loss type: a new normalizer is one decorated function."""
    def decorate(function):
        LOSS_NORMALIZERS.register(name, LossNormalizer(function, global_denominator),
                                  aliases=aliases)
        return function
    return decorate


def canonical_loss_type(name: str) -> str:
    """The registered name of a loss type or of one of its aliases (grpo, bnpo, ...)."""
    if name not in LOSS_NORMALIZERS:
        raise ValueError(LOSS_NORMALIZERS.unknown_message(name))
    return LOSS_NORMALIZERS.canonical(name)


@register_loss_normalizer("sequence_mean", global_denominator=True)
def _sequence_mean(masked, mask, sequences, global_valid_tokens, config):
    del global_valid_tokens, config
    return ((masked.sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1.0)).sum(),
            jnp.asarray(sequences, jnp.float32))


@register_loss_normalizer("micro_batch_token_mean", global_denominator=False)
def _micro_batch_token_mean(masked, mask, sequences, global_valid_tokens, config):
    del sequences, global_valid_tokens, config
    return masked.sum(), jnp.maximum(mask.sum(), 1.0)


@register_loss_normalizer("constant_length_sum", global_denominator=True)
def _constant_length_sum(masked, mask, sequences, global_valid_tokens, config):
    del mask, global_valid_tokens
    return (masked.sum(),
            jnp.asarray(sequences * config.max_completion_length, jnp.float32))


@register_loss_normalizer("batch_token_mean", global_denominator=True)
def _batch_token_mean(masked, mask, sequences, global_valid_tokens, config):
    del sequences, config
    if global_valid_tokens is None:
        global_valid_tokens = mask.sum()
    return masked.sum(), jnp.maximum(jnp.asarray(global_valid_tokens, jnp.float32), 1.0)


def loss_types() -> tuple[str, ...]:
    """Every accepted value of loss_type: the registered names, then their aliases."""
    return LOSS_NORMALIZERS.names(with_aliases=True)


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Policy objective and its ranges, loss_type, clip range, KL weight, entropy-quantile
    filter, rollout correction and length normalizer."""

    loss_type: str = "micro_batch_token_mean"   # a LOSS_NORMALIZERS name or alias
    epsilon_low: float = 0.2
    epsilon_high: float = 0.28
    beta: float = 0.0
    top_entropy_quantile: float = 1.0
    max_completion_length: int = 1
    rollout_correction: str = "none"   # a ROLLOUT_CORRECTIONS name (rl/rollout_correction.py)
    rollout_correction_cap: float = 3.0   # its cap C on pi_old / pi_rollout (TRL's default)
    policy_objective: str = "clipped_surrogate"   # a POLICY_OBJECTIVES name
    # gspo / gspo_token clip the sequence ratio to [1 - low, 1 + high] (GSPO's values)
    gspo_epsilon_low: float = 3e-4
    gspo_epsilon_high: float = 4e-4
    cispo_epsilon_max: float = 5.0   # cispo's cap on the ratio (TRL's recommended value)

    def __post_init__(self):
        canonical_loss_type(self.loss_type)
        if self.policy_objective not in POLICY_OBJECTIVES:
            raise ValueError(POLICY_OBJECTIVES.unknown_message(self.policy_objective))
        if not (0 <= self.epsilon_low < 1 and self.epsilon_high >= 0):
            raise ValueError(f"clip range epsilon_low={self.epsilon_low}, epsilon_high="
                             f"{self.epsilon_high} is invalid")
        if self.beta < 0:
            raise ValueError(f"beta={self.beta} must be >= 0")
        if not 0 < self.top_entropy_quantile <= 1:
            raise ValueError(f"top_entropy_quantile={self.top_entropy_quantile} not in (0, 1]")
        if self.rollout_correction not in ROLLOUT_CORRECTIONS:
            raise ValueError(ROLLOUT_CORRECTIONS.unknown_message(self.rollout_correction))
        if not self.rollout_correction_cap > 0:
            raise ValueError(f"rollout_correction_cap={self.rollout_correction_cap} must be > 0")
        if self.max_completion_length <= 0:
            raise ValueError(f"max_completion_length={self.max_completion_length} must be > 0")
        if not (0 <= self.gspo_epsilon_low < 1 and self.gspo_epsilon_high >= 0):
            raise ValueError(f"GSPO clip range gspo_epsilon_low={self.gspo_epsilon_low}, "
                             f"gspo_epsilon_high={self.gspo_epsilon_high} is invalid")
        if not self.cispo_epsilon_max > 0:
            raise ValueError(f"cispo_epsilon_max={self.cispo_epsilon_max} must be > 0")

    @classmethod
    def from_config(cls, loss, max_completion_length: int) -> "LossConfig":
        """The LossConfig of an experiment config's `loss` section (its other fields, such as
        the advantage estimator, are not the loss's)."""
        names = {field.name for field in dataclasses.fields(cls)} - {"max_completion_length"}
        return cls(max_completion_length=max_completion_length,
                   **{name: loss[name] for name in names if name in loss})

    @property
    def denominator_is_global(self) -> bool:
        return LOSS_NORMALIZERS.get(self.loss_type).global_denominator


@struct.dataclass
class LossTerms:
    """numerator / denominator = the loss; metrics are sums over valid tokens (divide by
    `valid_tokens`); correction_sums: the rollout correction's counts by name
    (rollout_correction.rollout_correction_sums; empty without the rollout's log-probs)."""

    numerator: jax.Array
    denominator: jax.Array
    valid_tokens: jax.Array
    clipped_tokens: jax.Array
    kl_sum: jax.Array
    correction_sums: dict


def entropy_threshold_mask(entropies: jax.Array, mask: jax.Array, quantile: float) -> jax.Array:
    """[B, T] bool: valid tokens whose entropy is >= the `quantile` of valid-token entropies
    (TRL's top_entropy_quantile; quantile 1.0 keeps every token)."""
    if quantile >= 1.0:
        return jnp.ones_like(mask, dtype=jnp.bool_)
    valid = mask.astype(jnp.bool_)
    values = jnp.where(valid, entropies, jnp.nan)
    threshold = jnp.nanquantile(values, 1.0 - quantile)
    return entropies >= threshold


def policy_loss_terms(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array,
                      mask: jax.Array, config: LossConfig, *,
                      ref_logprobs: jax.Array | None = None,
                      entropies: jax.Array | None = None,
                      global_valid_tokens: jax.Array | None = None,
                      global_sequences: jax.Array | None = None,
                      rollout_logprobs: jax.Array | None = None) -> LossTerms:
    """The loss of one micro-batch as numerator and denominator.

    Each token's policy loss is weighted by the registered config.rollout_correction's weight of
    pi_old / pi_rollout (token or sequence level, truncated or masked at
    config.rollout_correction_cap; constant in the gradient; rl/rollout_correction.py), which
    corrects for sampling from a policy that differs from the trained one (AQN noise on the
    rollout, the kernels' rounding), as TRL's vllm_importance_sampling_mode and verl's
    rollout_is.

    Args:
      logprobs, old_logprobs, ref_logprobs, entropies, rollout_logprobs: [B, T] float32
        (rollout_logprobs: the sampler's log-probs of the same tokens).
      advantages: [B]. mask: [B, T] valid (and non-truncated) completion tokens.
      global_valid_tokens: valid tokens of the whole generation batch (dapo).
      global_sequences: sequences of the whole generation batch (grpo, dr_grpo); defaults to B.
    """
    mask = mask.astype(jnp.float32)
    adv = advantages[:, None].astype(jnp.float32)
    objective = POLICY_OBJECTIVES.get(config.policy_objective)
    per_token, is_clipped = objective(logprobs, old_logprobs, adv, mask, config)
    if config.top_entropy_quantile < 1.0:
        if entropies is None:
            raise ValueError("top_entropy_quantile < 1 needs per-token entropies")
        keep = entropy_threshold_mask(jax.lax.stop_gradient(entropies), mask,
                                      config.top_entropy_quantile)
        per_token = per_token * keep
    correction_sums = {}
    if rollout_logprobs is not None:
        weights, corrected = rollout_correction_weights(
            old_logprobs, rollout_logprobs, mask, config.rollout_correction,
            config.rollout_correction_cap)
        per_token = per_token * weights
        correction_sums = rollout_correction_sums(corrected, mask)
    elif config.rollout_correction != "none":
        raise ValueError(f"rollout_correction={config.rollout_correction!r} needs the "
                         "rollout's log-probs")
    kl = jnp.zeros_like(per_token)
    if config.beta != 0.0:
        if ref_logprobs is None:
            raise ValueError("beta != 0 needs reference log-probs")
        delta = ref_logprobs - logprobs
        kl = jnp.exp(delta) - delta - 1.0
        per_token = per_token + config.beta * kl
    sequences = mask.shape[0] if global_sequences is None else global_sequences
    masked = per_token * mask
    normalizer = LOSS_NORMALIZERS.get(config.loss_type)
    numerator, denominator = normalizer.function(masked, mask, sequences, global_valid_tokens,
                                                 config)
    return LossTerms(numerator=numerator, denominator=denominator, valid_tokens=mask.sum(),
                     clipped_tokens=(is_clipped * mask).sum(),
                     kl_sum=jax.lax.stop_gradient((kl * mask).sum()),
                     correction_sums=correction_sums)


def token_logprobs_and_entropy(logits: jax.Array, tokens: jax.Array,
                               temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """log p(token) and the full-vocabulary entropy of softmax(logits / temperature).

    logits [B, T, V] float32, tokens [B, T] -> ([B, T], [B, T]) float32.
    """
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    chosen = jnp.take_along_axis(log_probs, tokens[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
    return chosen, entropy


def head_logprobs_and_entropy(hidden: jax.Array, logits_fn, tokens: jax.Array,
                              temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """token_logprobs_and_entropy(logits_fn(hidden), tokens, temperature) with a hand-written
    backward pass that holds fewer float32 [..., V] arrays than autodiff's.

    hidden [..., H], tokens [...] -> (log p, entropy) [...] float32; logits_fn a pure function
    [..., H] -> float32 [..., V] (it may close over arrays: jax.closure_convert hoists them).

    The forward pass is token_logprobs_and_entropy's, bit for bit, and keeps no logits. The
    backward recomputes logits = logits_fn(hidden), z = logits / T, p = softmax(z), and pulls
    back the cotangent in one elementwise pass:
        d/dz_i = g_logp (1[i = token] - p_i) - g_H p_i (log p_i + H),
    (H = -sum_i p_i log p_i; d log p_token / dz_i = 1[i = token] - p_i), divided by T, then
    through logits_fn's own VJP (CausalLM's head rounds it to the head's dtype). Autodiff's
    backward keeps the take_along_axis gradient's scatter and a broadcast [..., V] besides the
    two head GEMM outputs; this one keeps the GEMM outputs only.
    """
    converted, consts = jax.closure_convert(logits_fn, hidden)
    return _head_logprobs_and_entropy(converted, float(temperature), hidden, tokens, *consts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _head_logprobs_and_entropy(logits_fn, temperature, hidden, tokens, *consts):
    return token_logprobs_and_entropy(logits_fn(hidden, *consts), tokens, temperature)


def _head_logprobs_and_entropy_fwd(logits_fn, temperature, hidden, tokens, *consts):
    values = token_logprobs_and_entropy(logits_fn(hidden, *consts), tokens, temperature)
    return values, (hidden, tokens, consts)


def _head_logprobs_and_entropy_bwd(logits_fn, temperature, residuals, cotangents):
    hidden, tokens, consts = residuals
    grad_logprob, grad_entropy = cotangents
    logits, pullback = jax.vjp(logits_fn, hidden, *consts)
    # Two reductions over the logits ([..., 1] results), then one elementwise pass: written
    # so that XLA fuses log p and p into their consumers instead of storing them.
    z = logits.astype(jnp.float32) / temperature
    peak = jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    log_normalizer = peak + jnp.log(jnp.sum(jnp.exp(z - peak), axis=-1, keepdims=True))
    entropy = -jnp.sum(jnp.exp(z - log_normalizer) * (z - log_normalizer), axis=-1,
                       keepdims=True)
    log_probs = z - log_normalizer
    probs = jnp.exp(log_probs)
    is_token = jnp.arange(logits.shape[-1]) == tokens[..., None]
    grad_z = (grad_logprob[..., None] * (is_token - probs)
              - grad_entropy[..., None] * probs * (log_probs + entropy))
    grads = pullback((grad_z / temperature).astype(logits.dtype))
    return (grads[0], None, *grads[1:])


_head_logprobs_and_entropy.defvjp(_head_logprobs_and_entropy_fwd, _head_logprobs_and_entropy_bwd)


def chunked_token_logprobs_and_entropy(hidden: jax.Array, logits_fn, tokens: jax.Array,
                                       temperature: float = 1.0,
                                       chunk_size: int = 0) -> tuple[jax.Array, jax.Array]:
    """token_logprobs_and_entropy(logits_fn(hidden), tokens), `chunk_size` positions at a time.

    hidden [B, N, H], tokens [B, N] -> (log p [B, N], entropy [B, N]) float32. Each chunk goes
    through head_logprobs_and_entropy inside lax.map, so neither the forward nor the backward
    pass holds the whole [B, N, V] float32 logits, and each chunk's backward holds one float32
    [B, chunk, V] array. Same values as the unchunked computation (each position's logits are
    the same dot); chunk_size <= 0 or >= N computes it in one piece.

    logits_fn: a pure function [..., H] -> float32 [..., V] (CausalLM.logits_function()).
    """
    if hidden.ndim != 3 or tokens.ndim != 2 or hidden.shape[:2] != tokens.shape:
        raise ValueError(f"hidden {hidden.shape} and tokens {tokens.shape} must be [B, N, H] and "
                         "[B, N]")
    batch, length = tokens.shape
    if chunk_size <= 0 or chunk_size >= length:
        return head_logprobs_and_entropy(hidden, logits_fn, tokens, temperature)
    pad = (-length) % chunk_size
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    tokens = jnp.pad(tokens, ((0, 0), (0, pad)))
    chunks = (length + pad) // chunk_size
    hidden = hidden.reshape(batch, chunks, chunk_size, -1).swapaxes(0, 1)
    tokens = tokens.reshape(batch, chunks, chunk_size).swapaxes(0, 1)

    def one_chunk(hidden_chunk, token_chunk):
        return head_logprobs_and_entropy(hidden_chunk, logits_fn, token_chunk, temperature)

    logprobs, entropy = jax.lax.map(lambda pair: one_chunk(*pair), (hidden, tokens))

    def unchunk(values):
        return values.swapaxes(0, 1).reshape(batch, chunks * chunk_size)[:, :length]
    return unchunk(logprobs), unchunk(entropy)
