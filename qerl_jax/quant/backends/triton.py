"""The Triton backend: the Pallas kernels of pallas_kernels/blockwise_matmul.py on the kernel
layout (kernel_layout.py), per format.

Paths (every kernel path beat the XLA "dequantize with jnp, then dot" path at every shape and M
benchmarks/kernels.py measured; benchmarks/RESULTS.md):
  forward, M <= 64   `TritonDecodeBackend` ("<format>_fused"): the fused decode+matmul kernel.
                     A layer's unmerged
                     LoRA adds its second product (x @ A) @ B in the kernel's epilogue; layers
                     sharing their input (q|k|v) run in one launch; a gate/up pair runs in one
                     launch with the SwiGLU in its epilogue. On Hopper the Mosaic GPU backend
                     (mosaic.py) is asked first for NVFP4; what it refuses comes here.
  forward, M > 64    `TritonDequantizeBackend` ("<format>_dequantize_xla"): the Pallas
                     dequantize kernel writes W in bf16, then one XLA (cuBLAS) dot.
  backward dx=dy@W   dequantize kernel + XLA dot at every M (a fused transposed kernel was
                     slower; docs/decisions.md).
The kernels compute in bfloat16 (f32 accumulation): a layer whose compute dtype is not bfloat16
takes the XLA path, as does a weight still in the checkpoint layout; the reason is logged once.
"""

from __future__ import annotations

import logging

import jax.numpy as jnp
from jax import lax

from pallas_kernels import blockwise_matmul as bw
from qerl_jax.quant.backends.base import MatmulBackend
from qerl_jax.quant.backends.kernel_layout import (KERNEL_FORMATS, KernelLayoutWeight,
                                                   dequantize_backward, group_launch_refusal,
                                                   pair_launch_refusal, to_kernel_layout)
from qerl_jax.quant.backends.xla import tie_weight_to_activations
from qerl_jax.quant.kernel_options import KernelOptions

logger = logging.getLogger(__name__)

_LOGGED: set = set()


def _log_once(level, message: str, *args) -> None:
    key = (message, *map(str, args))
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.log(level, message, *args)


def kernel_names(format_name: str) -> tuple[str, str]:
    """(small-M fused path, large-M dequantize + XLA path) names, as select_matmul_path gives."""
    return f"{format_name}_fused", f"{format_name}_dequantize_xla"


def _layout_refusal(weight, compute_dtype) -> str | None:
    if not isinstance(weight, KernelLayoutWeight):
        return ("the weight is in the checkpoint layout (enable the kernels after loading the "
                "model: qerl_jax.model_quant.enable_kernels)")
    if jnp.dtype(compute_dtype) != jnp.bfloat16:
        return f"compute dtype {jnp.dtype(compute_dtype).name} (the kernels compute in bfloat16)"
    return None


def repack_for_triton(weights, *, tile_k=None, donate=False):
    """The weights in the kernel layout (to_kernel_layout), or None where all already are."""
    if all(isinstance(w, KernelLayoutWeight) for w in weights):
        return None
    return [to_kernel_layout(w, tile_k=tile_k, donate=donate) for w in weights]


class TritonDequantizeBackend(MatmulBackend):
    """M > max_fused_m: the Pallas dequantize kernel (bf16 W [N, K]), then one XLA dot."""

    description = "Pallas dequantize kernel, then XLA dot"

    def __init__(self, format_name: str, *, interpret: bool = False):
        self.name = kernel_names(format_name)[1]
        self.min_m = KERNEL_FORMATS[format_name].max_fused_m + 1
        self.interpret = interpret

    def refusal(self, weight, compute_dtype):
        return _layout_refusal(weight, compute_dtype)

    def apply(self, x, weight, *, compute_dtype):
        x, weight = tie_weight_to_activations(x, weight)
        dense = self.dense(weight, compute_dtype=compute_dtype)
        return lax.dot_general(x.astype(jnp.bfloat16), dense, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)

    def apply_backward(self, grad_output, weight, *, compute_dtype):
        return dequantize_backward(grad_output, weight, compute_dtype=compute_dtype,
                                   interpret=self.interpret)

    def dense(self, weight, *, compute_dtype):
        del compute_dtype   # the kernels compute in bfloat16 (refusal)
        return weight.kernel_dense(self.interpret)

    def repack(self, weights, *, tile_k=None, donate=False):
        return repack_for_triton(weights, tile_k=tile_k, donate=donate)


class TritonDecodeBackend(MatmulBackend):
    """M <= max_fused_m: the fused decode+matmul kernel, with its LoRA epilogue, grouped launch
    and fused SwiGLU launch."""

    description = "fused Triton decode+matmul kernel"
    lora_epilogue = True

    def __init__(self, format_name: str, options: KernelOptions, *, interpret: bool = False):
        self.name = kernel_names(format_name)[0]
        self.max_m = KERNEL_FORMATS[format_name].max_fused_m
        self.options = options
        self.interpret = interpret

    def refusal(self, weight, compute_dtype):
        return _layout_refusal(weight, compute_dtype)

    def repack(self, weights, *, tile_k=None, donate=False):
        return repack_for_triton(weights, tile_k=tile_k, donate=donate)

    def _note_fallback(self, weights, launch: str) -> None:
        """Logs once that a small-M launch of single-copy weights (stored only in the permuted
        layout) takes a Triton kernel: that kernel reads the kernel layout, which is then
        unpermuted at every call (in the decode loop, at every step: a transient copy)."""
        if any(w.single_copy for w in weights):
            _log_once(logging.WARNING, "the %s launch of NVFP4 weights %s, stored only in the "
                      "Mosaic permuted layout, takes the Triton kernel (the dispatch log says "
                      "why the Mosaic GPU kernel does not) and unpermutes them at every call",
                      launch, [w.shape for w in weights])

    def apply(self, x, weight, *, compute_dtype):
        return self.apply_lora(x, weight, None, None, 0.0, compute_dtype=compute_dtype)

    def apply_backward(self, grad_output, weight, *, compute_dtype):
        return dequantize_backward(grad_output, weight, compute_dtype=compute_dtype,
                                   interpret=self.interpret)

    def apply_lora(self, x, weight, lora_x_a, lora_b, lora_scale, *, compute_dtype):
        """x [M, K] bf16 @ W^T (+ lora_scale * lora_x_a [M, r] @ lora_b [r, N] in the kernel's
        epilogue, when lora_x_a is given) -> [M, N] float32 (output rounded to bf16 inside)."""
        del compute_dtype
        self._note_fallback((weight,), "single-weight")
        packed = weight.packed()
        config = bw.default_matmul_config(x.shape[0], packed, self.options.decode_matmul)
        return bw.blockwise_matmul(x, packed, spec=weight.spec, config=config,
                                   interpret=self.interpret, lora_x_a=lora_x_a, lora_b=lora_b,
                                   lora_scale=lora_scale).astype(jnp.float32)

    def group_refusal(self, weights, lora_ranks):
        """Why these kernel-layout weights cannot share one launch (None: they can)."""
        del lora_ranks
        return group_launch_refusal(weights)

    def apply_grouped(self, x, weights, lora_x_a, lora_bs, lora_scales, *, compute_dtype):
        """x [M, K] bf16 @ W_i^T (+ lora_scales[i] * (x @ A_i) @ lora_bs[i]) for weights sharing
        x, in one launch -> tuple of [M, N_i] float32."""
        del compute_dtype
        self._note_fallback(weights, "grouped")
        packed = tuple(w.packed() for w in weights)
        config = bw.default_group_matmul_config(x.shape[0], packed, self.options.decode_matmul)
        ys = bw.blockwise_matmul_group(x, packed, spec=weights[0].spec, config=config,
                                       interpret=self.interpret, lora_x_a=lora_x_a,
                                       lora_bs=lora_bs, lora_scales=lora_scales)
        return tuple(y.astype(jnp.float32) for y in ys)

    def swiglu_refusal(self, m, weights, lora_ranks, lora_scales):
        """Why the fused SwiGLU launch cannot take this (gate, up) (None: it can)."""
        del m, lora_ranks
        return pair_launch_refusal(weights, lora_scales)

    def swiglu_lora_b(self, weights, lora_bs):
        """The fused SwiGLU launch's block-diagonal LoRA B [r_g' + r_u', 2 N_pad] bf16 of a
        pair's (B_gate, B_up) (pallas_kernels.blockwise_matmul.interleave_lora_b)."""
        gate = weights[0]
        return bw.interleave_lora_b(lora_bs[0], lora_bs[1], gate.kernel_rows // 2,
                                    gate.pair_view[0])

    def apply_swiglu(self, x, weights, lora_x_a, lora_bs, lora_scales, pair_lora_b,
                     next_lora_a=None, *, compute_dtype):
        """silu(x @ Wg^T + LoRA_g) * (x @ Wu^T + LoRA_u) [M, N] bf16 for pair views (gate, up)
        in one launch over their interleaved pair. lora_x_a = x @ [A_g | A_u]; pair_lora_b:
        swiglu_lora_b's operand made once, or None to make it here. With next_lora_a [N, r]:
        (output, output @ next_lora_a [M, r] in compute dtype) from the same launch."""
        gate, up = weights
        half_block = gate.pair_view[0]
        self._note_fallback(weights, "gate|up SwiGLU")
        # the two tensor scales go to the kernel as they are: a [2] array of them would be
        # built at every decode step (a concatenate kernel per layer inside the loop)
        lora = {}
        if lora_x_a is not None:
            lora = dict(lora_x_a=lora_x_a, lora_ranks=tuple(b.shape[0] for b in lora_bs),
                        lora_b=self.swiglu_lora_b(weights, lora_bs) if pair_lora_b is None
                        else pair_lora_b, lora_scale=lora_scales[0])
        result = bw.blockwise_matmul_swiglu(
            x, gate.whole_pair(), spec=gate.spec, out_n=gate.shape[0],
            half_block=half_block, interpret=self.interpret,
            tensor_scales=(gate.kernel_tensor_scale(), up.kernel_tensor_scale()),
            next_lora_a=next_lora_a, tuning=self.options.decode_matmul, **lora)
        if next_lora_a is None:
            return result
        y, next_x_a = result
        return y, next_x_a.astype(compute_dtype)
