"""A preallocated, static-shape KV cache for prefill + one-token decode.

All sequences of a batch share the slot index: prompts are left-padded, so after a prefill of
T slots every sequence's next token goes to slot T, then T+1, ... `valid` marks which slots hold
real tokens (padding slots are never attended to), and `next_position` is each sequence's own
RoPE position for its next token (its count of real tokens so far).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from qerl_jax.models.config import ModelConfig


@struct.dataclass
class KVCache:
    """Per-layer key/value buffers.

    Attributes:
      keys: tuple over layers of [B, S, kv_heads, head_dim].
      values: tuple over layers of [B, S, kv_heads, head_dim].
      valid: [B, S] bool, True where the slot holds a real (non-padding) token.
      next_position: [B] int32, RoPE position of each sequence's next token.
      index: int32 scalar, the next free slot (shared by the batch).
    """

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    valid: jax.Array
    next_position: jax.Array
    index: jax.Array

    @property
    def max_length(self) -> int:
        return self.valid.shape[1]

    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]


def init_kv_cache(config: ModelConfig, batch_size: int, max_length: int,
                  dtype=None) -> KVCache:
    """An empty cache of `max_length` slots for `batch_size` sequences (dtype: compute dtype)."""
    if batch_size <= 0 or max_length <= 0:
        raise ValueError(f"batch_size={batch_size} and max_length={max_length} must be positive")
    dtype = dtype or config.jnp_compute_dtype
    shape = (batch_size, max_length, config.num_key_value_heads, config.resolved_head_dim)
    layers = config.num_hidden_layers
    return KVCache(
        keys=tuple(jnp.zeros(shape, dtype) for _ in range(layers)),
        values=tuple(jnp.zeros(shape, dtype) for _ in range(layers)),
        valid=jnp.zeros((batch_size, max_length), jnp.bool_),
        next_position=jnp.zeros((batch_size,), jnp.int32),
        index=jnp.zeros((), jnp.int32),
    )
