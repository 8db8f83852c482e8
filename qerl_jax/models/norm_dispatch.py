"""Which implementation runs a decode step's pre-projection RMSNorm together with the LoRA
x @ A of the projections that read it.

By default a DecoderLayer runs RMSNorm (XLA), and the grouped q|k|v (gate|up) launch computes
x @ [A_0 | A_1 | ...] itself (an XLA gemm and its reduction). A kernel registered here for a
platform (pallas_kernels.rmsnorm_lora, registered by
qerl_jax.quant.kernel_dispatch.enable_decode_norm on the GPU, or interpreted in CPU tests)
computes both in one launch for decode steps (T = 1 with a cache) whose shapes it supports;
prefill and training keep the XLA path.

    fn(x [M, H], scale [H], lora_a [H, R], *, eps, out_dtype) -> (normed [M, H], down [M, R])
      both in out_dtype: normed = RMSNorm(x) as qerl_jax.models.layers.RMSNorm computes it,
      down = normed @ lora_a (float32 accumulation)
    supports(x, lora_a, out_dtype) -> None, or why not (then the XLA path runs; logged once)
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import jax

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class NormLoRADownKernel:
    name: str
    fn: Callable[..., tuple[jax.Array, jax.Array]]
    supports: Callable[..., str | None] | None = None


_KERNELS: dict[str, NormLoRADownKernel] = {}
_LOGGED: set[tuple[str, str]] = set()


def register_norm_lora_down(platform: str, kernel: NormLoRADownKernel) -> None:
    """Registers (or replaces) the norm + x @ A kernel of `platform`."""
    _KERNELS[platform] = kernel


def unregister_norm_lora_down(platform: str) -> None:
    _KERNELS.pop(platform, None)


def norm_lora_down_kernel(x: jax.Array, lora_a: jax.Array, out_dtype,
                          platform: str | None = None) -> NormLoRADownKernel | None:
    """The kernel that runs this decode step's norm and x @ A on `platform` (default backend),
    or None for the XLA path."""
    platform = platform or jax.default_backend()
    kernel = _KERNELS.get(platform)
    if kernel is None:
        return None
    refusal = None if kernel.supports is None else kernel.supports(x, lora_a, out_dtype)
    if refusal is not None:
        if (platform, refusal) not in _LOGGED:
            _LOGGED.add((platform, refusal))
            logger.info("decode RMSNorm + LoRA x @ A on %s: XLA path, because kernel %s cannot "
                        "take it: %s", platform, kernel.name, refusal)
        return None
    return kernel
