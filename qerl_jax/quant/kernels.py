"""Which backend runs a quantized matmul: the Pallas kernels registered per platform with
their options (KernelOptions), and the weights repacked once for them.

    register_kernels("gpu", options)       # the Triton decode + dequantize backends per format
    state = prepare_for_kernels(state)     # every QuantizedWeight in the kernel layout

On a platform without compiled kernels (anything but "gpu") nothing is registered unless
interpret=True (Pallas interpret mode: CPU tests), and the XLA reference backend runs. A whole
model is prepared by qerl_jax.model_quant.enable_kernels (layout, gate/up pairs, the Mosaic GPU
layout, decode attention).
"""

from __future__ import annotations

import logging

from qerl_jax.quant import linear_op
from qerl_jax.quant.backends import mosaic
from qerl_jax.quant.backends.kernel_layout import KERNEL_FORMATS, pair_gate_up, pair_refusal
from qerl_jax.quant.backends.sharded import RowShardedBackend
from qerl_jax.quant.backends.triton import (TritonDecodeBackend, TritonDequantizeBackend,
                                            kernel_names)
from qerl_jax.quant.kernel_options import KernelOptions

logger = logging.getLogger(__name__)

KERNEL_PLATFORMS = ("gpu",)

# platform -> (interpret, options, mesh) its kernels were registered with
_REGISTERED: dict[str, tuple] = {}


def registered_options(platform: str) -> KernelOptions | None:
    """The options the kernels of `platform` were registered with, or None."""
    entry = _REGISTERED.get(platform)
    return None if entry is None else entry[1]


def on_mesh(backend, mesh):
    """`backend` as it runs on `mesh`: per device on its rows (RowShardedBackend) where the
    mesh has more than one device, else as it is."""
    if mesh is None or mesh.size == 1:
        return backend
    return RowShardedBackend(backend, mesh)


def register_kernels(platform: str = "gpu", options: KernelOptions = KernelOptions(), *,
                     interpret: bool = False, mesh=None) -> None:
    """Registers the decode (M <= max_fused_m) and dequantize + XLA backends of every kernel
    format with linear_op (idempotent; re-registering with other options replaces them).

    Args:
      platform: "gpu" (compiled Pallas), or any platform with interpret=True.
      options: the kernel choices and tunings (KernelOptions).
      interpret: run the kernels in Pallas interpret mode (CPU tests); never the Mosaic GPU
        kernel.
      mesh: the device mesh the model's programs run on (None: one device). Its weights must
        be replicated (fsdp = tensor = 1): every launch runs per device on that device's rows
        (qerl_jax.quant.backends.sharded).
    """
    if platform not in KERNEL_PLATFORMS and not interpret:
        raise ValueError(f"no compiled Pallas kernels for platform {platform!r} (kernels: "
                         f"{KERNEL_PLATFORMS}); pass interpret=True to run them interpreted")
    if _REGISTERED.get(platform) == (interpret, options, mesh):
        return
    unregister_kernels(platform)
    for format_name in KERNEL_FORMATS:
        linear_op.register_backend(format_name, platform, on_mesh(
            TritonDecodeBackend(format_name, options, interpret=interpret), mesh))
        linear_op.register_backend(format_name, platform, on_mesh(
            TritonDequantizeBackend(format_name, interpret=interpret), mesh))
    _REGISTERED[platform] = (interpret, options, mesh)
    logger.info("registered Pallas kernels for %s (interpret=%s, %s%s)", platform, interpret,
                options, "" if mesh is None else f", per device on mesh {dict(mesh.shape)}")


def unregister_kernels(platform: str = "gpu") -> None:
    """Removes the kernels of `platform` (back to the XLA path)."""
    for format_name in KERNEL_FORMATS:
        for name in kernel_names(format_name):
            linear_op.unregister_backend(format_name, platform, name)
    _REGISTERED.pop(platform, None)


def mosaic_refusal(options: KernelOptions, *, interpret: bool,
                   lora_ranks=()) -> str | None:
    """Why NVFP4 decode launches keep the Triton kernels (logged: a warning where
    options.mosaic_nvfp4 is 'on', else info), or None when the Mosaic GPU kernel takes them:
    the option, interpret mode, this machine, the LoRA ranks the model has or will get."""
    if not options.mosaic:
        return "mosaic_nvfp4 is off"
    if interpret:
        return "interpret mode"
    reason = mosaic.unavailable() or mosaic.rank_refusal(lora_ranks)
    if reason is not None:
        log = logger.warning if options.mosaic_nvfp4 == "on" else logger.info
        log("quant.kernels.mosaic_nvfp4=%s: no Mosaic GPU NVFP4 kernel (%s); the NVFP4 weights "
            "keep the kernel layout and the Triton kernels", options.mosaic_nvfp4, reason)
    return reason


# ----------------------------------------------------------------------------------------------
# Launch layouts and operands for weights the model runs together (which weights those are is
# the model's business: qerl_jax.models.decode_fusion). Each returns the weights as they are
# where no kernel launch would read what it makes.


def pair_weights(gate, up):
    """(gate view, up view) of one interleaved copy of a SwiGLU MLP's gate and up weights, run
    at decode in one launch with the SwiGLU in its epilogue; or (None, why not)."""
    refusal = pair_refusal(gate, up)
    if refusal is not None:
        return None, refusal
    return pair_gate_up(gate, up), None


def decode_layout(weights) -> list:
    """The weights of one decode launch (one weight, or a gate/up pair's two views) stored only
    in the Mosaic GPU permuted layout, or as they are where that kernel cannot read them."""
    first = weights[0]
    if mosaic.layout_refusal(first) is not None:
        return list(weights)
    buffer = mosaic.permuted(first)
    return [mosaic.only_in(weight, buffer) for weight in weights]


def grouped_decode_layout(weights) -> list | None:
    """The weights of a grouped launch (a layer's q|k|v) stored only in one Mosaic GPU permuted
    buffer, or None where that kernel cannot take them together."""
    buffer = mosaic.permuted_group(weights)
    return None if buffer is None else mosaic.group_only_in(weights, buffer)


def with_lora_operand(weight, lora_b, lora_scale: float):
    """The weight carrying its adapter's decode-launch LoRA operand (made once per rollout)."""
    return mosaic.with_lora_operand(weight, lora_b, lora_scale)


def with_pair_lora_operand(gate, up, gate_b, up_b, lora_scale: float):
    """The gate view carrying the gate/up pair's decode-launch LoRA operand."""
    return mosaic.with_pair_lora_operand(gate, up, gate_b, up_b, lora_scale)


def with_group_lora_operand(weights, lora_bs, lora_scales):
    """The first weight of a grouped launch carrying the group's decode-launch LoRA operand."""
    return mosaic.with_group_lora_operand(weights, lora_bs, lora_scales)


def with_prefetch(weight, following, following_lora_a):
    """The weight whose decode launch prefetches the following launch's weight (and the LoRA A
    read before it) into L2 (the Mosaic GPU kernel; quant.kernels.mosaic_prefetch_tiles)."""
    return mosaic.with_prefetch(weight, following, following_lora_a)
