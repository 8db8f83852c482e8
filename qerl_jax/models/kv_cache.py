"""A preallocated, static-shape KV cache for prefill + one-token decode.

All sequences of a batch share the slot index: prompts are left-padded, so after a prefill of
T slots every sequence's next token goes to slot T, then T+1, ... `valid` marks which slots hold
real tokens (padding slots are never attended to), and `next_position` is each sequence's own
RoPE position for its next token (its count of real tokens so far).

An 8-bit cache (init_kv_cache(..., dtype="int8" or "float8_e4m3fn")) stores each token's key
and value of each kv head as 8-bit codes with one float32 scale (absmax / 127 for int8, rounded
to the nearest step; absmax / 448, e4m3's largest finite value, for float8): half the bytes a
decode step reads from a bfloat16 cache, plus 4 bytes per head_dim codes. quantize_kv /
dequantize_kv are the two directions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from qerl_jax.models.config import ModelConfig


# cache dtypes stored as scaled 8-bit codes -> the largest finite value of each
SCALED_KV_DTYPES = {"int8": 127.0, "float8_e4m3fn": 448.0}


def quantize_kv(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., head_dim] -> (codes [..., head_dim] in `dtype`, float32 scales [...]): one scale
    per vector, absmax / the format's largest value (1 for an all-zero vector)."""
    largest = SCALED_KV_DTYPES[jnp.dtype(dtype).name]
    x32 = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(x32), axis=-1)
    scale = jnp.where(absmax > 0, absmax / largest, 1.0)
    scaled = x32 / scale[..., None]
    if jnp.issubdtype(dtype, jnp.integer):
        scaled = jnp.round(scaled)
    codes = jnp.clip(scaled, -largest, largest).astype(dtype)
    return codes, scale


def dequantize_kv(codes: jax.Array, scales: jax.Array, dtype) -> jax.Array:
    """codes [..., head_dim] * scales [...] in `dtype` (float32 product, rounded once)."""
    return (codes.astype(jnp.float32) * scales[..., None]).astype(dtype)


@struct.dataclass
class KVCache:
    """Per-layer key/value buffers.

    Attributes:
      keys: tuple over layers of [B, S, kv_heads, head_dim].
      values: tuple over layers of [B, S, kv_heads, head_dim].
      valid: [B, S] bool, True where the slot holds a real (non-padding) token.
      next_position: [B] int32, RoPE position of each sequence's next token.
      index: int32 scalar, the next free slot (shared by the batch).
      key_scales, value_scales: for an 8-bit cache, tuples over layers of float32 [B, S,
        kv_heads] (keys / values hold the codes); empty tuples otherwise.
    """

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    valid: jax.Array
    next_position: jax.Array
    index: jax.Array
    key_scales: tuple[jax.Array, ...] = ()
    value_scales: tuple[jax.Array, ...] = ()

    @property
    def scaled(self) -> bool:
        """Whether keys and values are scaled 8-bit codes."""
        return bool(self.key_scales)

    def layer(self, i: int) -> tuple[jax.Array, ...]:
        """Layer i's (keys, values), or (keys, values, key_scales, value_scales)."""
        if self.scaled:
            return (self.keys[i], self.values[i], self.key_scales[i], self.value_scales[i])
        return (self.keys[i], self.values[i])

    def with_layers(self, layers) -> "KVCache":
        """The cache holding `layers` (each as layer() gives it)."""
        layers = list(layers)
        fields = dict(keys=tuple(x[0] for x in layers), values=tuple(x[1] for x in layers))
        if self.scaled:
            fields.update(key_scales=tuple(x[2] for x in layers),
                          value_scales=tuple(x[3] for x in layers))
        return self.replace(**fields)

    @property
    def max_length(self) -> int:
        return self.valid.shape[1]

    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]


def init_kv_cache(config: ModelConfig, batch_size: int, max_length: int,
                  dtype=None) -> KVCache:
    """An empty cache of `max_length` slots for `batch_size` sequences (dtype: the compute
    dtype; "int8" or "float8_e4m3fn": scaled 8-bit codes)."""
    if batch_size <= 0 or max_length <= 0:
        raise ValueError(f"batch_size={batch_size} and max_length={max_length} must be positive")
    dtype = jnp.dtype(dtype or config.jnp_compute_dtype)
    shape = (batch_size, max_length, config.num_key_value_heads, config.resolved_head_dim)
    layers = config.num_hidden_layers
    scaled = dtype.name in SCALED_KV_DTYPES

    def scales():   # one float32 scale per token and kv head of each layer (8-bit codes)
        return tuple(jnp.ones(shape[:-1], jnp.float32) for _ in range(layers)) if scaled else ()
    return KVCache(
        keys=tuple(jnp.zeros(shape, dtype) for _ in range(layers)),
        values=tuple(jnp.zeros(shape, dtype) for _ in range(layers)),
        valid=jnp.zeros((batch_size, max_length), jnp.bool_),
        next_position=jnp.zeros((batch_size,), jnp.int32),
        index=jnp.zeros((), jnp.int32),
        key_scales=scales(),
        value_scales=scales(),
    )
