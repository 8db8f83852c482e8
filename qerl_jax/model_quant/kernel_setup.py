"""The Pallas kernels on a whole model: its weights repacked once, gate/up pairs, the Mosaic GPU
layout, and the decode-attention kernel, as the KernelOptions say.

    model = enable_kernels(model, options)        # after quantizing / loading, before nnx.split
    enable_kernels(model, interpret=True)         # CPU tests: Pallas interpret mode

Run the model through nnx.split / nnx.merge and jax.jit (as the sampler and trainer do): an
nnx.jit call over the Module writes every array back as a new buffer, so arrays that views
share (a gate/up pair's, a q|k|v group's buffer) become separate copies (measured on the CPU).
On a platform without kernels (CPU unless interpret=True) nothing changes and the XLA path
runs.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from pallas_kernels import decode_attention as decode_attention_kernels
from qerl_jax.models import attention_dispatch, decode_fusion
from qerl_jax.parallel.mesh import batch_spec
from qerl_jax.parallel.sharded_backend import PerDeviceRows
from qerl_jax.quant import kernel_registry
from qerl_jax.quant.backends.kernel_layout import (KernelLayoutWeight, prepare_for_kernels,
                                                   restore_checkpoint_layout)
from qerl_jax.quant.kernel_options import KernelOptions
from qerl_jax.quant.qarray import QuantizedWeight

logger = logging.getLogger(__name__)


def _float8_refusal() -> str | None:
    """Why this GPU's Triton cannot convert float8 (compute capability below 8.9), or None."""
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or not capability:
        return None
    if tuple(int(part) for part in str(capability).split(".")[:2]) < (8, 9):
        return (f"a float8_e4m3fn cache on compute capability {capability} (Triton converts "
                "float8 from 8.9)")
    return None


def _decode_attention_refusal(q, keys) -> str | None:
    head_dim = q.shape[-1]
    if q.dtype != jnp.bfloat16 or keys.dtype not in (jnp.bfloat16, jnp.int8,
                                                     jnp.float8_e4m3fn):
        return (f"q {q.dtype} / cache {keys.dtype} (the kernel takes bfloat16 q and a "
                "bfloat16, int8 or float8_e4m3fn cache)")
    if keys.dtype == jnp.float8_e4m3fn:
        refusal = _float8_refusal()
        if refusal is not None:
            return refusal
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} (a power of two >= 16)"
    return None


def _per_device_attention(mesh, run):
    """`run` (the decode-attention kernel) per device of `mesh`: each device attends over its
    rows (the mesh's batch axes) and, where the tensor axis divides the kv heads, its heads;
    the o projection's LoRA A enters split by the same heads (its rows are the flattened
    heads), so each device returns its heads' share of x @ A, summed over all heads by the
    model."""
    sizes = dict(mesh.shape)

    def sharded(q, keys, values, mask, length, *, scale, lora_a=None, key_scales=None,
                value_scales=None):
        rows = batch_spec((q.shape[0],), sizes)
        rows = rows[0] if rows else None
        heads = "tensor" if sizes["tensor"] > 1 and q.shape[1] % sizes["tensor"] == 0 else None
        q_spec, cache_spec = P(rows, heads), P(rows, None, heads)
        extra = {"lora_a": (lora_a, P(heads)), "key_scales": (key_scales, cache_spec),
                 "value_scales": (value_scales, cache_spec)}
        extra = {name: pair for name, pair in extra.items() if pair[0] is not None}

        def body(q, keys, values, mask, length, *extra_operands):
            return run(q, keys, values, mask, length, scale=scale,
                       **dict(zip(extra, extra_operands)))

        in_specs = (q_spec, cache_spec, cache_spec, P(rows), P(),
                    *(spec for _, spec in extra.values()))
        operands = (q, keys, values, mask, jnp.asarray(length, jnp.int32),
                    *(operand for operand, _ in extra.values()))
        out_specs = q_spec if lora_a is None else (q_spec, q_spec)
        return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)(*operands)
    return sharded


def enable_decode_attention(platform: str | None = None,
                            options: KernelOptions = KernelOptions(), *,
                            interpret: bool = False, mesh=None) -> bool:
    """Registers the Pallas decode-attention kernel (pallas_kernels.decode_attention: reads only
    the used part of the KV cache; its combine step also computes the o projection's LoRA
    x @ A) for one-token decode steps on `platform`, with options.decode_attention_tiling.
    Independent of the weight format (bf16 models use it too). With a `mesh` of several
    devices it runs per device on its rows and heads. Returns whether it was registered (not
    on a platform without compiled kernels unless interpret=True)."""
    platform = platform or jax.default_backend()
    if platform not in kernel_registry.KERNEL_PLATFORMS and not interpret:
        return False
    tiling = options.decode_attention_tiling

    def run(q, keys, values, mask, length, *, scale, lora_a=None, key_scales=None,
            value_scales=None):
        return decode_attention_kernels.decode_attention(
            q, keys, values, mask, length, scale=scale, config=tiling, interpret=interpret,
            lora_a=lora_a, key_scales=key_scales, value_scales=value_scales)

    if mesh is not None and mesh.size > 1:
        run = _per_device_attention(mesh, run)

    attention_dispatch.register_decode_attention(platform, attention_dispatch.DecodeAttentionKernel(
        name="pallas_decode_attention", fn=run, supports=_decode_attention_refusal,
        lora_x_a=True))
    logger.info("registered the Pallas decode attention for %s (interpret=%s%s)", platform,
                interpret, "" if mesh is None else f", per device on mesh {dict(mesh.shape)}")
    return True


def disable_decode_attention(platform: str | None = None) -> None:
    attention_dispatch.unregister_decode_attention(platform or jax.default_backend())


def _lora_ranks(model: nnx.Module, lora_rank: int | None) -> set[int]:
    ranks = set() if lora_rank is None else {int(lora_rank)}
    for _, node in nnx.iter_graph(model):
        lora_a = getattr(node, "lora_a", None)
        if isinstance(lora_a, nnx.Variable) and lora_a.get_value() is not None:
            ranks.add(int(lora_a.get_value().shape[-1]))
    return ranks


def enable_kernels(model_or_state, options: KernelOptions = KernelOptions(), *,
                   platform: str | None = None, interpret: bool = False,
                   tile_k: int | None = None, donate: bool = False,
                   lora_rank: int | None = None, mesh=None):
    """Makes the quantized linear layers run the Pallas kernels on `platform`.

    Registers the kernels (qerl_jax.quant.kernel_registry.register_kernels; on a mesh each
    backend runs per device, qerl_jax.parallel.sharded_backend) and repacks every
    QuantizedWeight once (the registered backends' repack: the kernel layout). An nnx Module
    is changed in place (and returned): with options.gate_up_pairs each MLP's gate and up
    weights become one interleaved pair (decode_fusion.pair_gate_up_weights: no extra
    memory), and on a Hopper GPU the weights whose decode launches the Mosaic GPU kernel runs
    are stored only in its permuted layout (decode_fusion.add_decode_layouts with the Mosaic
    backend's repack) unless options.mosaic_nvfp4 is 'off'. Any other pytree
    (an nnx.State, params) is returned converted, its inputs untouched, without pairs. Where
    there are no compiled kernels (platform other than "gpu") and interpret is False, or
    options.enabled is False, nothing changes and the XLA path runs.

    Args:
      options: the kernel choices and tunings (config.quant.kernels).
      platform: default jax.default_backend().
      interpret: Pallas interpret mode (CPU tests; slow).
      tile_k: K tile of the kernel layout (default: kernel_layout.default_tile_k).
      donate: (Module only) hand each checkpoint-layout weight's buffers to its kernel layout
        (kernel_layout.to_kernel_layout(donate=True)): no second copy of the scales and
        codes is allocated, but arrays taken from the Module before the call are deleted.
        For a model nothing else references (the trainer's, just built); the default keeps
        them valid.
      lora_rank: (Module only) the rank of the LoRA adapters the model will be given (the
        trainer's config.lora.rank), if not yet added. The Mosaic GPU kernel takes LoRA ranks
        in pallas_kernels.mgpu_nvfp4.LORA_RANKS only: with another rank (this one, or an
        adapter the model already has) the weights keep the Triton kernels.
      mesh: the device mesh the model will run on (None: one device); its weights must be
        replicated (fsdp = tensor = 1). Every launch then runs per device on its rows.
    """
    platform = platform or jax.default_backend()
    if not options.enabled or (platform not in kernel_registry.KERNEL_PLATFORMS and not interpret):
        logger.info("enable_kernels: no Pallas kernels (platform %r, enabled=%s); the quantized "
                    "layers keep the XLA path (dequantize + dot)", platform, options.enabled)
        return model_or_state
    if mesh is not None and (mesh.shape["fsdp"] > 1 or mesh.shape["tensor"] > 1):
        raise ValueError(f"enable_kernels: mesh {dict(mesh.shape)} splits the weights; the "
                         "matmul kernels run per device on replicated weights (fsdp = tensor "
                         "= 1) only")
    kernel_registry.register_kernels(platform, options, interpret=interpret,
                                     wrap=None if mesh is None else PerDeviceRows(mesh))
    if options.decode_attention:
        enable_decode_attention(platform, options, interpret=interpret, mesh=mesh)
    else:
        disable_decode_attention(platform)
    if not isinstance(model_or_state, nnx.Module):
        return prepare_for_kernels(model_or_state, tile_k=tile_k)
    count = 0
    for _, node in nnx.iter_graph(model_or_state):
        if not isinstance(node, nnx.Variable):
            continue
        value = node.get_value()
        if isinstance(value, QuantizedWeight) and not isinstance(value, KernelLayoutWeight):
            stored = kernel_registry.repack_launch([value], platform, tile_k=tile_k,
                                                   donate=donate)
            if stored is not None:
                node.set_value(stored[0])
            count += 1
    pairs = (decode_fusion.pair_gate_up_weights(model_or_state, kernel_registry.pair_weights)
             if options.gate_up_pairs else 0)
    if kernel_registry.mosaic_refusal(options, interpret=interpret,
                                      lora_ranks=_lora_ranks(model_or_state, lora_rank)) is None:
        weights, mosaic_pairs, groups = decode_fusion.add_decode_layouts(
            model_or_state, lambda launch: kernel_registry.repack_launch(launch, platform))
        logger.info("enable_kernels: %d NVFP4 weights (%d gate/up pairs) and %d q|k|v groups "
                    "stored only in the Mosaic GPU permuted layout", weights, mosaic_pairs,
                    groups)
    logger.info("enable_kernels: %d quantized weights in the kernel layout, %d MLP gate/up "
                "pairs (%s, interpret=%s)", count, pairs, platform, interpret)
    return model_or_state


def disable_kernels(model_or_state):
    """Every KernelLayoutWeight back to the checkpoint layout (in place for an nnx Module).
    The kernels stay registered; checkpoint-layout weights take the XLA path."""
    if not isinstance(model_or_state, nnx.Module):
        return restore_checkpoint_layout(model_or_state)
    for _, node in nnx.iter_graph(model_or_state):
        if isinstance(node, nnx.Variable) and isinstance(node.get_value(), KernelLayoutWeight):
            node.set_value(node.get_value().to_checkpoint())
    return model_or_state
