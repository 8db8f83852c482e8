"""Which implementation runs the attention of a one-token decode step.

By default Attention runs its XLA path (einsums over the whole static cache, masked). A kernel
registered here for a platform (pallas_kernels.decode_attention, registered by
qerl_jax.model_quant.kernel_setup.enable_kernels / enable_decode_attention on the GPU, or
interpreted in CPU tests) replaces it for decode steps (T = 1 with a cache) whose shapes it
supports; prefill and training keep the XLA path.

    fn(q [B, KVH, G, D], keys [B, S, KVH, D], values, mask [B, S] bool, length int32 scalar,
       *, scale[, lora_a][, key_scales, value_scales]) -> [B, KVH, G, D] in q's dtype
      key_scales / value_scales [B, S, KVH] float32 (an 8-bit cache: keys and values are its
      codes, qerl_jax.models.kv_cache.quantize_kv)
      lora_a [KVH * G * D, r] (the o-projection's LoRA A as stored, which the kernel rounds to
      q's dtype; passed only to a kernel registered with lora_x_a=True): the kernel may return (out, down [B, KVH, G, r] float32), each
      query head's output row times its rows of lora_a, whose sum over heads is the
      o-projection's x @ A; or out alone, and the model computes x @ A itself
    supports(q, keys) -> None, or why not (then the XLA path runs; logged once)
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import jax

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DecodeAttentionKernel:
    name: str
    fn: Callable[..., jax.Array]
    supports: Callable[..., str | None] | None = None
    lora_x_a: bool = False  # fn takes lora_a and may return the o projection's x @ A


_KERNELS: dict[str, DecodeAttentionKernel] = {}
_LOGGED: set[tuple[str, str]] = set()


def register_decode_attention(platform: str, kernel: DecodeAttentionKernel) -> None:
    """Registers (or replaces) the decode-attention kernel of `platform`."""
    _KERNELS[platform] = kernel


def unregister_decode_attention(platform: str) -> None:
    _KERNELS.pop(platform, None)


def decode_attention_kernel(q: jax.Array, keys: jax.Array,
                            platform: str | None = None) -> DecodeAttentionKernel | None:
    """The kernel that runs this decode step's attention on `platform` (default backend), or
    None for the XLA path."""
    platform = platform or jax.default_backend()
    kernel = _KERNELS.get(platform)
    if kernel is None:
        return None
    refusal = None if kernel.supports is None else kernel.supports(q, keys)
    if refusal is not None:
        if (platform, refusal) not in _LOGGED:
            _LOGGED.add((platform, refusal))
            logger.info("decode attention on %s: XLA path, because kernel %s cannot take it: %s",
                        platform, kernel.name, refusal)
        return None
    return kernel
