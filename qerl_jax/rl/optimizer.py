"""The optimizer of the trainable params (LoRA matrices and norm scales) and its schedule."""

from __future__ import annotations

import math

import jax
import ml_collections
import optax


def make_optimizer(train: ml_collections.ConfigDict):
    """(optimizer, lr schedule): AdamW (betas 0.9/0.99), weight decay masked off norms (only
    LoRA matrices decay), linear warmup then cosine decay to 0, clip by global norm (the released
    QeRL scripts)."""
    warmup_steps = max(1, int(math.ceil(train.warmup_ratio * train.total_steps)))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, train.learning_rate, warmup_steps, max(train.total_steps, warmup_steps + 1),
        end_value=0.0)

    def decay_mask(params):
        def is_lora(path, _):
            names = [getattr(part, "key", getattr(part, "name", None)) for part in path]
            return "lora_a" in names or "lora_b" in names
        return jax.tree_util.tree_map_with_path(is_lora, params)

    return optax.chain(
        optax.clip_by_global_norm(train.max_grad_norm),
        optax.adamw(schedule, b1=train.adam_b1, b2=train.adam_b2,
                    weight_decay=train.weight_decay, mask=decay_mask)), schedule
