"""The Pallas kernel backends of a platform, registered with the dispatch in the order it asks
them, with their options (KernelOptions), and the weights repacked once for them.

    register_kernels("gpu", options)   # per format: Mosaic GPU (NVFP4), Triton decode, Triton
                                       # dequantize + XLA
    repack_launch([weight], "gpu")     # one launch's weights in the first backend's layout

On a platform without compiled kernels (anything but "gpu") nothing is registered unless
interpret=True (Pallas interpret mode: CPU tests), and the XLA reference backend runs. A whole
model is prepared by qerl_jax.model_quant.kernel_setup.enable_kernels (layouts, gate/up pairs,
decode attention; on a device mesh each backend wrapped to run per device).
"""

from __future__ import annotations

import logging
from typing import Callable

from qerl_jax.quant import dispatch
from qerl_jax.quant.backends.base import MatmulBackend
from qerl_jax.quant.backends.kernel_layout import KERNEL_FORMATS, pair_gate_up, pair_refusal
from qerl_jax.quant.backends.mosaic import FORMATS as MOSAIC_FORMATS
from qerl_jax.quant.backends.mosaic import MosaicBackend, rank_refusal
from qerl_jax.quant.backends.triton import (TritonDecodeBackend, TritonDequantizeBackend,
                                            kernel_names)
from qerl_jax.quant.kernel_options import KernelOptions
from qerl_jax.quant.qarray import QuantizedWeight

logger = logging.getLogger(__name__)

KERNEL_PLATFORMS = ("gpu",)

# platform -> (interpret, options, wrap) its kernels were registered with
_REGISTERED: dict[str, tuple] = {}


def registered_options(platform: str) -> KernelOptions | None:
    """The options the kernels of `platform` were registered with, or None."""
    entry = _REGISTERED.get(platform)
    return None if entry is None else entry[1]


def kernel_backends(format_name: str, options: KernelOptions, *,
                    interpret: bool = False) -> list[MatmulBackend]:
    """The kernel backends of one format, in the order dispatch asks them: the Mosaic GPU
    backend first where it serves the format (options.mosaic_nvfp4 not 'off'; never in
    interpret mode), then the Triton decode and dequantize backends."""
    backends = []
    if format_name in MOSAIC_FORMATS and options.mosaic and not interpret:
        backends.append(MosaicBackend(options))
    backends.append(TritonDecodeBackend(format_name, options, interpret=interpret))
    backends.append(TritonDequantizeBackend(format_name, interpret=interpret))
    return backends


def register_kernels(platform: str = "gpu", options: KernelOptions = KernelOptions(), *,
                     interpret: bool = False,
                     wrap: Callable[[MatmulBackend], MatmulBackend] | None = None) -> None:
    """Registers every kernel format's backends (kernel_backends) with the dispatch
    (idempotent; re-registering with other arguments replaces them).

    Args:
      platform: "gpu" (compiled Pallas), or any platform with interpret=True.
      options: the kernel choices and tunings (KernelOptions).
      interpret: run the kernels in Pallas interpret mode (CPU tests); never the Mosaic GPU
        kernel.
      wrap: applied to each backend before it is registered (e.g. to run it per device on a
        mesh: qerl_jax.parallel.sharded_backend.PerDeviceRows); compared by equality for
        idempotence.
    """
    if platform not in KERNEL_PLATFORMS and not interpret:
        raise ValueError(f"no compiled Pallas kernels for platform {platform!r} (kernels: "
                         f"{KERNEL_PLATFORMS}); pass interpret=True to run them interpreted")
    if _REGISTERED.get(platform) == (interpret, options, wrap):
        return
    unregister_kernels(platform)
    for format_name in KERNEL_FORMATS:
        for backend in kernel_backends(format_name, options, interpret=interpret):
            dispatch.register_backend(format_name, platform,
                                      backend if wrap is None else wrap(backend))
    _REGISTERED[platform] = (interpret, options, wrap)
    logger.info("registered Pallas kernels for %s (interpret=%s, %s%s)", platform, interpret,
                options, "" if wrap is None else f", each through {wrap}")


def unregister_kernels(platform: str = "gpu") -> None:
    """Removes the kernels of `platform` (back to the XLA path)."""
    for format_name in KERNEL_FORMATS:
        for name in (*kernel_names(format_name), MosaicBackend.name):
            dispatch.unregister_backend(format_name, platform, name)
    _REGISTERED.pop(platform, None)


def repack_launch(weights, platform: str = "gpu", *, tile_k: int | None = None,
                  donate: bool = False) -> list | None:
    """The weights of one launch (one weight, a gate/up pair's views, or several sharing x) in
    the layout of the first registered backend that makes one for them (its `repack`), or
    None where none does (they stay as they are: dense weights among them, too)."""
    if not all(isinstance(weight, QuantizedWeight) for weight in weights):
        return None
    for backend in dispatch.backends_for(weights[0].format, platform):
        stored = backend.repack(weights, tile_k=tile_k, donate=donate)
        if stored is not None:
            return stored
    return None


def mosaic_refusal(options: KernelOptions, *, interpret: bool,
                   lora_ranks=()) -> str | None:
    """Why NVFP4 decode launches keep the Triton kernels (logged: a warning where
    options.mosaic_nvfp4 is 'on', else info), or None when the Mosaic GPU kernel takes them:
    the option, interpret mode, this machine, the LoRA ranks the model has or will get."""
    if not options.mosaic:
        return "mosaic_nvfp4 is off"
    if interpret:
        return "interpret mode"
    reason = MosaicBackend.unavailable() or rank_refusal(lora_ranks)
    if reason is not None:
        log = logger.warning if options.mosaic_nvfp4 == "on" else logger.info
        log("quant.kernels.mosaic_nvfp4=%s: no Mosaic GPU NVFP4 kernel (%s); the NVFP4 weights "
            "keep the kernel layout and the Triton kernels", options.mosaic_nvfp4, reason)
    return reason


def pair_weights(gate, up):
    """(gate view, up view) of one interleaved copy of a SwiGLU MLP's gate and up weights, run
    at decode in one launch with the SwiGLU in its epilogue; or (None, why not)."""
    refusal = pair_refusal(gate, up)
    if refusal is not None:
        return None, refusal
    return pair_gate_up(gate, up), None
