"""linear_swiglu: a SwiGLU MLP's gate and up projections in one launch with the SwiGLU in its
epilogue (the fused small-M kernels on gate/up pair views), with the unfused path's VJP."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from qerl_jax.quant.backends.base import MatmulBackend
from qerl_jax.quant.linear_op import (_group_lora_inputs, _grouped_quantized_matmul,
                                      _select_shared_launch, _shared_launch_kernel,
                                      linear_group)
from qerl_jax.quant.qarray import QuantizedWeight


def _members_forward(kernel: MatmulBackend, x, weights, lora_x_a, lora_bs, scales, *,
                     compute_dtype):
    """An apply_grouped that runs the members one by one with `kernel`'s single-weight products
    (its LoRA epilogue where it has one): the recomputation behind the fused SwiGLU's VJP,
    for weights that take no grouped launch (gate/up pair views)."""
    outputs, start = [], 0
    for i, weight in enumerate(weights):
        if lora_x_a is None:
            outputs.append(kernel.apply(x, weight, compute_dtype=compute_dtype))
            continue
        rank = lora_bs[i].shape[0]
        member_x_a = lora_x_a[:, start:start + rank]
        start += rank
        if kernel.lora_epilogue:
            outputs.append(kernel.apply_lora(x, weight, member_x_a, lora_bs[i], scales[i],
                                          compute_dtype=compute_dtype))
        else:
            outputs.append(kernel.apply(x, weight, compute_dtype=compute_dtype) + scales[i] * jnp.dot(
                member_x_a.astype(compute_dtype), lora_bs[i].astype(compute_dtype),
                preferred_element_type=jnp.float32))
    return tuple(outputs)


def _swiglu_of_members(x, lora_x_a, lora_bs, weights, compute_dtype, scales, kernel, backward):
    """silu(gate) * up of the members' products, each rounded to compute_dtype first, the
    SwiGLU in float32, rounded once: what the fused SwiGLU launch computes, and the function
    whose VJP is its backward."""
    gate, up = (y.astype(compute_dtype).astype(jnp.float32) for y in _grouped_quantized_matmul(
        x, lora_x_a, lora_bs, weights, compute_dtype, scales,
        functools.partial(_members_forward, kernel), backward))
    return (jax.nn.silu(gate) * up).astype(compute_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _fused_swiglu_matmul(x, lora_x_a, lora_bs, pair_lora_b, weights, compute_dtype, scales, kernel,
                         backward):
    del backward
    return kernel.apply_swiglu(x, weights, lora_x_a, lora_bs, scales, pair_lora_b,
                               compute_dtype=compute_dtype)


def _fused_swiglu_matmul_fwd(x, lora_x_a, lora_bs, pair_lora_b, weights, compute_dtype, scales,
                             kernel, backward):
    y = _fused_swiglu_matmul(x, lora_x_a, lora_bs, pair_lora_b, weights, compute_dtype, scales,
                             kernel, backward)
    return y, (x, lora_x_a, lora_bs, pair_lora_b, weights)


def _fused_swiglu_matmul_bwd(compute_dtype, scales, kernel, backward, residuals, grad_output):
    """The VJP of _swiglu_of_members (the products recomputed, then SwiGLU's derivative and
    the single products' own backward): the fused launch keeps no gate/up for it. The
    prepared LoRA B operand gets a zero cotangent (its B matrices get theirs)."""
    x, lora_x_a, lora_bs, pair_lora_b, weights = residuals
    _, pullback = jax.vjp(
        lambda *primals: _swiglu_of_members(*primals, compute_dtype, scales, kernel, backward),
        x, lora_x_a, lora_bs, weights)
    grad_x, grad_lora_x_a, grad_bs, grad_weights = pullback(grad_output)
    grad_pair_b = None if pair_lora_b is None else jnp.zeros_like(pair_lora_b)
    return grad_x, grad_lora_x_a, grad_bs, grad_pair_b, grad_weights


_fused_swiglu_matmul.defvjp(_fused_swiglu_matmul_fwd, _fused_swiglu_matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _fused_swiglu_matmul_next(x, lora_x_a, lora_bs, pair_lora_b, weights, next_lora_a,
                              compute_dtype, scales, kernel, backward):
    """(_fused_swiglu_matmul's y, y @ next_lora_a in compute_dtype) from one launch
    (kernel.apply_swiglu with next_lora_a)."""
    del backward
    return kernel.apply_swiglu(x, weights, lora_x_a, lora_bs, scales, pair_lora_b, next_lora_a,
                               compute_dtype=compute_dtype)


def _fused_swiglu_matmul_next_fwd(x, lora_x_a, lora_bs, pair_lora_b, weights, next_lora_a,
                                  compute_dtype, scales, kernel, backward):
    y, next_x_a = _fused_swiglu_matmul_next(x, lora_x_a, lora_bs, pair_lora_b, weights,
                                             next_lora_a, compute_dtype, scales, kernel,
                                             backward)
    return (y, next_x_a), (x, lora_x_a, lora_bs, pair_lora_b, weights, next_lora_a, y)


def _fused_swiglu_matmul_next_bwd(compute_dtype, scales, kernel, backward, residuals,
                                  cotangents):
    """next_x_a = y @ A: y's cotangent gains d_next @ A^T (float32, rounded once), A's is
    y^T @ d_next; the rest is _fused_swiglu_matmul's VJP."""
    x, lora_x_a, lora_bs, pair_lora_b, weights, next_lora_a, y = residuals
    grad_y, grad_next = cotangents
    a32, grad_next32 = next_lora_a.astype(jnp.float32), grad_next.astype(jnp.float32)
    grad_y = (grad_y.astype(jnp.float32) + grad_next32 @ a32.T).astype(y.dtype)
    grads = _fused_swiglu_matmul_bwd(compute_dtype, scales, kernel, backward,
                                     (x, lora_x_a, lora_bs, pair_lora_b, weights), grad_y)
    grad_a = (y.astype(jnp.float32).T @ grad_next32).astype(next_lora_a.dtype)
    return (*grads, grad_a)


_fused_swiglu_matmul_next.defvjp(_fused_swiglu_matmul_next_fwd, _fused_swiglu_matmul_next_bwd)


def _swiglu_kernel(x2d, weights, loras, compute_dtype, platform
                   ) -> tuple[MatmulBackend | None, list[str]]:
    """The kernel whose fused SwiGLU launch takes (gate, up) for x2d, or (None, why not)."""
    scales = None if loras[0] is None else tuple(float(lora.scale) for lora in loras)
    return _shared_launch_kernel(
        x2d, weights, loras, compute_dtype, platform,
        lambda backend, lora_ranks: backend.swiglu_refusal(x2d.shape[0], tuple(weights),
                                                           lora_ranks, scales))


def linear_swiglu(x: jax.Array, weights, biases, *, activation: Callable,
                  compute_dtype=jnp.bfloat16, loras=None,
                  stacked_lora_a: jax.Array | None = None,
                  pair_lora_b: jax.Array | None = None,
                  next_lora_a: jax.Array | None = None):
    """activation(*linear_group(x, (gate, up), ...)) for a SwiGLU MLP's gate and up layers,
    [..., N] in compute_dtype, where `activation(gate, up)` is the model's SwiGLU: float32
    silu(gate) * up, rounded to compute_dtype (QeRL's Qwen2.5 MLP, before down_proj).

    Where the selected kernel has a fused SwiGLU launch that takes these weights (apply_swiglu:
    the fused small-M kernels on gate/up pair views, e.g. at decode; both quantized, no
    biases), ONE launch reads gate and up (one interleaved weight) and writes silu(gate) * up:
    gate and up never reach HBM and no separate SwiGLU kernel runs. Its output is the unfused
    path's up to the exp of silu (one bf16 ulp); its backward is the unfused path's VJP
    (recomputed). Elsewhere this is exactly activation(*linear_group(...)).

    Args:
      x: activations [..., in], shared.
      weights: (gate, up), as for `linear`.
      biases: (gate bias, up bias), each optional [N].
      activation: the SwiGLU applied where nothing is fused.
      loras, stacked_lora_a: as for `linear_group` (the stacked A is [in, r_gate + r_up]).
      pair_lora_b: the fused launch's LoRA B operand made once outside a loop
        (prepare_swiglu_lora_b), or None (made per call where needed).
      next_lora_a: the LoRA A [N, r] of the layer that reads this output (the MLP's lora_x_a
        projection), or None. Then returns (output, output @ next_lora_a [..., r] in
        compute_dtype, or None): the product comes from the fused launch itself where its
        kernel can (apply_swiglu with next_lora_a: each program multiplies its output tile by A's rows, a
        split-K gemm and its reduction fewer per layer at decode), else None and the caller
        computes it (linear's lora_x_a). Its gradient is that of output @ next_lora_a.
    """
    weights, biases = tuple(weights), tuple(biases)
    loras = tuple(loras) if loras is not None else (None, None)
    if not len(weights) == len(biases) == len(loras) == 2:
        raise ValueError(f"linear_swiglu: needs (gate, up): got {len(weights)} weights, "
                         f"{len(biases)} biases and {len(loras)} LoRA entries")
    leading = x.shape[:-1]

    def result(y, next_x_a=None):
        return y if next_lora_a is None else (y, next_x_a)

    def unfused():
        return result(activation(*linear_group(x, weights, biases, compute_dtype=compute_dtype,
                                                loras=loras, stacked_lora_a=stacked_lora_a)))

    if any(b is not None for b in biases) or not all(isinstance(w, QuantizedWeight)
                                                     for w in weights):
        return unfused()
    if weights[0].shape != weights[1].shape:
        raise ValueError(f"linear_swiglu: gate {weights[0].shape} and up {weights[1].shape} "
                         "must have the same shape [out, in]")
    out_features = weights[0].shape[0]
    if next_lora_a is not None and (next_lora_a.ndim != 2
                                    or next_lora_a.shape[0] != out_features):
        raise ValueError(f"linear_swiglu: next_lora_a {tuple(next_lora_a.shape)} must be "
                         f"[N = {out_features}, r]")
    x2d, kernel, backward = _select_shared_launch("linear_swiglu", x, weights, loras,
                                                  compute_dtype, _swiglu_kernel,
                                                  ("unfused SwiGLU", "fused SwiGLU"))
    if kernel is None:
        return unfused()
    lora_x_a, lora_bs, scales = _group_lora_inputs(x2d, loras, stacked_lora_a, compute_dtype)
    if lora_x_a is None:
        pair_lora_b = None
    dtype = jnp.dtype(compute_dtype)
    if next_lora_a is not None:
        y, next_x_a = _fused_swiglu_matmul_next(x2d, lora_x_a, lora_bs, pair_lora_b, weights,
                                                 next_lora_a, dtype, scales, kernel, backward)
        return (y.astype(compute_dtype).reshape(*leading, out_features),
                next_x_a.astype(compute_dtype).reshape(*leading, next_lora_a.shape[1]))
    y = _fused_swiglu_matmul(x2d, lora_x_a, lora_bs, pair_lora_b, weights, dtype, scales, kernel,
                             backward)
    return result(y.astype(compute_dtype).reshape(*leading, out_features))


def prepare_swiglu_lora_b(weights, loras, *, compute_dtype=jnp.bfloat16) -> jax.Array | None:
    """The fused SwiGLU launch's LoRA B operand for (gate, up) with adapters `loras` (for
    linear_swiglu's pair_lora_b), made once before a decode loop, or None where no fused
    SwiGLU launch would take them at decode (M = 1) on this platform. For the Pallas pair
    views: the block-diagonal [B_gate | B_up] in the pair's column order."""
    weights, loras = tuple(weights), tuple(loras)
    if len(weights) != 2 or any(lora is None for lora in loras) or not all(
            isinstance(w, QuantizedWeight) for w in weights):
        return None
    x_row = jax.ShapeDtypeStruct((1, weights[0].shape[1]), jnp.dtype(compute_dtype))
    kernel, _ = _swiglu_kernel(x_row, weights, loras, compute_dtype, jax.default_backend())
    if kernel is None:
        return None
    return kernel.swiglu_lora_b(weights, tuple(lora.b.astype(compute_dtype)
                                                  for lora in loras))
