"""One GRPO update as jitted programs over the split model states, and the training batch a
rollout's groups become. The trainer (qerl_jax/trainer.py) owns the states and calls these.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from qerl_jax.rl.advantages import advantages as estimate_advantages
from qerl_jax.rl.losses import LossConfig, chunked_token_logprobs_and_entropy, policy_loss_terms
from qerl_jax.rl.rollout_correction import rollout_mismatch_sums


class TrainPrograms(NamedTuple):
    """The jitted pieces of one update (each takes the trainable and frozen states as inputs).

    logprobs(trainable, frozen, batch): the completion tokens' log-probs [rows, completion].
    accumulate_gradient(trainable, frozen, batch, global_valid_tokens, global_sequences,
      grad_sum) -> ((loss, (terms, sums)), grad_sum + this micro-batch's gradient); grad_sum
      donated; sums: the micro-batch's metric sums by name (entropy, rollout mismatch and
      correction: LossTerms.correction_sums), added over micro-batches by the caller.
    zero_grads(trainable): a zero gradient tree. scale(tree, s): tree * s.
    apply_update(trainable, opt_state, grads) -> (trainable, opt_state, grad_norm, finite): the
      optimizer step, skipped (states kept) when the gradient norm is not finite; the states are
      donated. apply_update_copy: the same without donation.
    """
    logprobs: Callable
    accumulate_gradient: Callable
    zero_grads: Callable
    apply_update: Callable
    apply_update_copy: Callable
    scale: Callable


def make_train_programs(graphdef, loss_config: LossConfig,
                        optimizer: optax.GradientTransformation, *, temperature: float,
                        completion_length: int, logits_chunk_size: int,
                        state_shardings: tuple | None = None) -> TrainPrograms:
    """The update's programs for one model graph, loss and optimizer.

    state_shardings: (trainable's, opt_state's) NamedSharding trees on a device mesh
      (qerl_jax.parallel.mesh.tree_shardings): the gradients and updated states keep them
      (None: one device, shardings left to the inputs)."""

    def completion_logprobs(trainable, frozen, batch):
        model = nnx.merge(graphdef, trainable, frozen)
        hidden = model.target_hidden(batch["tokens"], batch["attention_mask"],
                                     completion_length)
        return chunked_token_logprobs_and_entropy(
            hidden, model.logits_function(), batch["completion_tokens"], temperature,
            logits_chunk_size)

    def micro_batch_loss(trainable, frozen, batch, global_valid_tokens, global_sequences):
        logprobs, entropy = completion_logprobs(trainable, frozen, batch)
        old = batch.get("old_logprobs")
        old = jax.lax.stop_gradient(logprobs) if old is None else old
        terms = policy_loss_terms(
            logprobs, old, batch["advantages"], batch["loss_mask"], loss_config,
            ref_logprobs=batch.get("ref_logprobs"), entropies=entropy,
            global_valid_tokens=global_valid_tokens, global_sequences=global_sequences,
            rollout_logprobs=batch["rollout_logprobs"])
        mask = batch["loss_mask"].astype(jnp.float32)
        sums = {"entropy_sum": jax.lax.stop_gradient((entropy * mask).sum())}
        sums["rollout_kl_sum"], sums["rollout_outside_sum"] = rollout_mismatch_sums(
            logprobs, batch["rollout_logprobs"], mask)
        sums.update(terms.correction_sums)   # which tokens and sequences the correction changed
        return terms.numerator / terms.denominator, (terms, sums)

    logprobs = jax.jit(lambda t, f, b: completion_logprobs(t, f, b)[0])
    value_and_grad = jax.value_and_grad(micro_batch_loss, has_aux=True)

    def accumulate_gradient(trainable, frozen, batch, global_valid_tokens, global_sequences,
                            grad_sum):
        """(loss, aux), grad_sum + this micro-batch's gradient. The sum is donated and
        updated inside the program, so a step holds one gradient tree (plus the program's
        own), not the sum, the last micro-batch's gradient and the new one."""
        (loss, aux), grads = value_and_grad(trainable, frozen, batch, global_valid_tokens,
                                            global_sequences)
        grad_sum = jax.tree_util.tree_map(jnp.add, grad_sum, grads)
        if state_shardings is not None:
            grad_sum = jax.lax.with_sharding_constraint(grad_sum, state_shardings[0])
        return (loss, aux), grad_sum

    grads_out, update_out = {}, {}
    if state_shardings is not None:
        trainable_shardings, opt_shardings = state_shardings
        replicated = jax.sharding.NamedSharding(
            jax.tree_util.tree_leaves(trainable_shardings)[0].mesh, jax.sharding.PartitionSpec())
        grads_out = {"out_shardings": trainable_shardings}
        update_out = {"out_shardings": (trainable_shardings, opt_shardings, replicated,
                                        replicated)}
    accumulate_gradient_program = jax.jit(accumulate_gradient, donate_argnums=(5,))
    # keep_unused: the (committed) input stays an argument, so the zeros come out committed
    # like the sums accumulate_gradient returns (a program without inputs returns uncommitted
    # arrays, and jit would compile accumulate_gradient once per committed flag)
    zero_grads = jax.jit(lambda t: jax.tree_util.tree_map(jnp.zeros_like, t),
                         keep_unused=True, **grads_out)

    def apply_update(trainable, opt_state, grads):
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm)
        updates, new_opt_state = optimizer.update(grads, opt_state, trainable)
        new_trainable = optax.apply_updates(trainable, updates)
        keep = lambda new, old: jax.tree_util.tree_map(
            lambda a, b: jnp.where(finite, a, b), new, old)
        return (keep(new_trainable, trainable), keep(new_opt_state, opt_state), grad_norm,
                finite)

    apply_update_program = jax.jit(apply_update, donate_argnums=(0, 1), **update_out)
    apply_update_copy = jax.jit(apply_update, **update_out)
    scale = jax.jit(lambda a, s: jax.tree_util.tree_map(lambda x: x * s, a))
    return TrainPrograms(logprobs, accumulate_gradient_program, zero_grads, apply_update_program,
                         apply_update_copy, scale)


def training_batch(groups: list[dict], *, group_size: int, prompt_length: int,
                   completion_length: int, mask_truncated: bool,
                   advantage_estimator: str = "group_normalized"):
    """The training arrays of the rollout groups (prompt_tokens, prompt_mask, rollout, scores per
    group; group_size completions of completion_length tokens each): prompts left-padded to
    prompt_length (>= the longest) + completion tokens, masks, the advantages of the registered
    `advantage_estimator` and the rollout's log-probs. Returns (batch, rewards by name,
    completion_mask, truncated)."""
    group = group_size
    longest = max(len(g["prompt_tokens"]) for g in groups)
    if prompt_length < longest:
        raise ValueError(f"prompt_length={prompt_length} is shorter than the longest prompt "
                         f"({longest} tokens)")
    rows = len(groups) * group
    tokens = np.zeros((rows, prompt_length + completion_length), np.int32)
    attention = np.zeros_like(tokens, dtype=np.bool_)
    completion_tokens = np.zeros((rows, completion_length), np.int32)
    completion_mask = np.zeros((rows, completion_length), np.bool_)
    rollout_logprobs = np.zeros((rows, completion_length), np.float32)
    truncated = np.zeros((rows,), np.bool_)
    rewards: dict[str, list[float]] = {}
    for index, entry in enumerate(groups):
        prompt = entry["prompt_tokens"]
        mask = entry["prompt_mask"]
        for g in range(group):
            row = index * group + g
            tokens[row, prompt_length - len(prompt):prompt_length] = prompt
            attention[row, prompt_length - len(prompt):prompt_length] = mask
            completion_tokens[row] = entry["rollout"].tokens[g]
            completion_mask[row] = entry["rollout"].mask[g]
            rollout_logprobs[row] = entry["rollout"].logprobs[g]
            truncated[row] = entry["rollout"].truncated[g]
        for name, values in entry["scores"].items():
            rewards.setdefault(name, []).extend(values)
    tokens[:, prompt_length:] = completion_tokens
    attention[:, prompt_length:] = completion_mask
    loss_mask = completion_mask.copy()
    if mask_truncated:
        loss_mask &= ~truncated[:, None]
    total = np.asarray(rewards["total"], np.float32)
    advantages = np.asarray(estimate_advantages(jnp.asarray(total), group, advantage_estimator))
    batch = {"tokens": tokens, "attention_mask": attention,
             "completion_tokens": completion_tokens, "loss_mask": loss_mask,
             "advantages": advantages, "rollout_logprobs": rollout_logprobs}
    return batch, rewards, completion_mask, truncated
