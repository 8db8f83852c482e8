"""The rollout benchmark's roofline: the bytes one decode step reads (weights once, the KV
cache at its context length, the rows still generating), and the read bandwidth measured in the
worker process (jax and numpy imported lazily)."""

from __future__ import annotations

import time


def decode_read_bytes(states, architecture, batch: int, prompt: int,
                      new_tokens: int, kv_cache_dtype: str = "auto",
                      dequantized: bool = False) -> tuple[int, int]:
    """(weight bytes, KV-cache bytes) one decode step must read, on average over a generation:
    every array of the model states once (pair views counted once), except an untied embedding
    table (a step gathers `batch` of its rows; a tied one is the lm_head and is read whole), and
    K and V of every layer at the mean context length prompt + new_tokens / 2 (an 8-bit cache:
    1 byte per value plus a float32 scale per token and kv head). dequantized: the decode loop
    reads every quantized weight as a dense bf16 copy (SamplingConfig.dequantize_once on a
    dequantize-then-dot path): 2 bytes per weight element instead of its arrays."""
    import jax

    from qerl_jax.quant.qarray import QuantizedWeight

    unique, dense = {}, 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(
            states, is_leaf=lambda x: dequantized and isinstance(x, QuantizedWeight)):
        if isinstance(leaf, QuantizedWeight):
            dense += 2 * leaf.shape[0] * leaf.shape[1]
            continue
        if not hasattr(leaf, "dtype"):
            continue
        if "embed_tokens" in jax.tree_util.keystr(path) and not architecture.tie_word_embeddings:
            continue
        unique[id(leaf)] = leaf
    weights = dense + sum(leaf.size * leaf.dtype.itemsize for leaf in unique.values())
    kv = kv_bytes_per_token(architecture, kv_cache_dtype) * batch * (prompt + new_tokens / 2)
    return int(weights), int(kv)


def kv_bytes_per_token(architecture, kv_cache_dtype: str = "auto") -> float:
    """Bytes of K and V, all layers, one token of one sequence (an 8-bit cache: 1 byte per
    value plus a float32 scale per token and kv head)."""
    import numpy as np

    head_dim = architecture.head_dim or architecture.hidden_size // architecture.num_attention_heads
    itemsize = np.dtype(architecture.jnp_compute_dtype).itemsize
    if kv_cache_dtype in ("int8", "float8_e4m3fn"):
        itemsize = 1 + 4 / head_dim
    return (2 * architecture.num_hidden_layers * architecture.num_key_value_heads * head_dim
            * itemsize)


def kv_read_bytes_for_lengths(architecture, prompt: int, lengths, kv_cache_dtype: str = "auto"
                              ) -> tuple[int, int]:
    """(decode steps, KV bytes read over all of them) of a generation whose row r ends after
    lengths[r] tokens: the loop runs max(lengths) steps, and at its step t (0-based) a row
    still generating writes token t and attends over prompt + t + 1 cached tokens; a finished
    row reads none (the Pallas decode-attention kernel skips it; XLA's attention reads every
    slot of every row, so on that path this is a lower bound)."""
    import numpy as np

    lengths = np.asarray(lengths, np.int64)
    # sum over rows of sum_{t < L} (prompt + t + 1) = L * prompt + L (L + 1) / 2
    tokens_read = int(np.sum(lengths * prompt + lengths * (lengths + 1) // 2))
    return int(lengths.max()), int(kv_bytes_per_token(architecture, kv_cache_dtype)
                                   * tokens_read)


def shrink_phase_steps(lengths, sizes) -> list[tuple[int, int]]:
    """(batch size, decode steps) of each decode loop a shrinking batch runs (sampling.
    shrink_schedule's `sizes`) when row r ends after lengths[r] tokens: at step t the rows still
    generating are those with lengths > t, and the loop moves to the next size once at most
    that many are."""
    import numpy as np

    lengths = np.asarray(lengths, np.int64)
    steps = [0] * len(sizes)
    phase = 0
    for step in range(int(lengths.max())):
        generating = int(np.sum(lengths > step))
        while phase + 1 < len(sizes) and generating <= sizes[phase + 1]:
            phase += 1
        steps[phase] += 1
    return [(size, count) for size, count in zip(sizes, steps)]


def read_bandwidth(num_bytes: int, repeats: int = 5) -> float:
    """Bytes/s of a streaming read measured in this process: the sum of a float32 array of
    `num_bytes` (one pass over it; the reduction writes one value), the best of `repeats` timed
    calls after a compile."""
    import jax
    import jax.numpy as jnp

    values = jnp.ones((num_bytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(values).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        begin = time.perf_counter()
        total(values).block_until_ready()
        best = min(best, time.perf_counter() - begin)
    del values
    return num_bytes / best
