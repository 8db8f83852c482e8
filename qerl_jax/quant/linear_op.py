"""The one linear op every projection of the model goes through.

y = x @ W (+ b), with W either a dense array [in, out] (bf16/fp32 baseline) or a frozen
QuantizedWeight with logical shape [out, in] = [N, K]. Formats, LoRA and Pallas kernels plug in
here without touching the layers.

Quantized path: y = x @ dequant(W).T through a custom VJP. The weight is frozen, so the VJP
returns a gradient for x only (zero cotangents for the weight's arrays), and the backward pass
dequantizes W again instead of keeping a dense copy from the forward pass: the only residual
is the QuantizedWeight itself (x is not needed for dx = dy @ W).

Dispatch (qerl_jax.quant.dispatch): the backends registered for the weight's (format,
platform) are asked in order; the first whose M range covers the launch and that does not
refuse the weight runs it, else the XLA reference backend (dequantize to the compute dtype,
then one dot with float32 accumulation). The path and every refusal are logged once.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from qerl_jax.quant import dispatch
from qerl_jax.quant.backends.base import MatmulBackend
from qerl_jax.quant.backends.xla import XLA
from qerl_jax.quant.qarray import QuantizedWeight


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _quantized_matmul(x, weight, compute_dtype, forward, backward):
    del backward
    return forward(x, weight, compute_dtype=compute_dtype)


def _quantized_matmul_fwd(x, weight, compute_dtype, forward, backward):
    del backward
    return forward(x, weight, compute_dtype=compute_dtype), weight


def _zero_cotangent(leaf):
    if jnp.issubdtype(leaf.dtype, jnp.inexact):
        return jnp.zeros(leaf.shape, leaf.dtype)
    return np.zeros(leaf.shape, jax.dtypes.float0)


def _grad_x_and_weight_cotangent(grad_output, weight, compute_dtype, backward):
    """(dx = dy @ W, zero cotangents for the frozen weight's arrays)."""
    # The barrier ties the re-dequantization to the cotangent, so XLA can neither hoist it
    # into the forward pass nor merge it with the forward dequantization (which would keep a
    # dense copy of W alive between the passes).
    grad_output, weight = jax.lax.optimization_barrier((grad_output, weight))
    grad_x = backward(grad_output, weight, compute_dtype=compute_dtype)
    return grad_x, jax.tree_util.tree_map(_zero_cotangent, weight)


def _quantized_matmul_bwd(compute_dtype, forward, backward, weight, grad_output):
    del forward
    return _grad_x_and_weight_cotangent(grad_output, weight, compute_dtype, backward)


_quantized_matmul.defvjp(_quantized_matmul_fwd, _quantized_matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _quantized_matmul_lora(x, lora_x_a, lora_b, weight, compute_dtype, scale, lora_forward,
                           backward):
    del backward
    return lora_forward(x, weight, lora_x_a, lora_b, scale, compute_dtype=compute_dtype)


def _quantized_matmul_lora_fwd(x, lora_x_a, lora_b, weight, compute_dtype, scale, lora_forward,
                               backward):
    del backward
    y = lora_forward(x, weight, lora_x_a, lora_b, scale, compute_dtype=compute_dtype)
    return y, (weight, lora_x_a, lora_b)


def _quantized_matmul_lora_bwd(compute_dtype, scale, lora_forward, backward, residuals,
                               grad_output):
    """dx = dy @ W (as the plain op), d lora_x_a = scale dy B^T, d B = scale lora_x_a^T dy (float32
    products, cast to the inputs' dtypes)."""
    del lora_forward
    weight, lora_x_a, lora_b = residuals
    grad32 = grad_output.astype(jnp.float32)
    grad_lora_x_a = scale * jnp.dot(grad32, lora_b.astype(jnp.float32).T)
    grad_b = scale * jnp.dot(lora_x_a.astype(jnp.float32).T, grad32)
    grad_x, grad_weight = _grad_x_and_weight_cotangent(grad_output, weight, compute_dtype,
                                                       backward)
    return grad_x, grad_lora_x_a.astype(lora_x_a.dtype), grad_b.astype(lora_b.dtype), grad_weight


_quantized_matmul_lora.defvjp(_quantized_matmul_lora_fwd, _quantized_matmul_lora_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _grouped_quantized_matmul(x, lora_x_a, lora_bs, weights, compute_dtype, scales, group_forward,
                              backward):
    del backward
    return group_forward(x, weights, lora_x_a, lora_bs, scales, compute_dtype=compute_dtype)


def _grouped_quantized_matmul_fwd(x, lora_x_a, lora_bs, weights, compute_dtype, scales,
                                  group_forward, backward):
    del backward
    ys = group_forward(x, weights, lora_x_a, lora_bs, scales, compute_dtype=compute_dtype)
    return ys, (weights, lora_x_a, lora_bs)


def _grouped_quantized_matmul_bwd(compute_dtype, scales, group_forward, backward, residuals,
                                  grads):
    """Per weight what the single ops' VJPs give (dx_i = dy_i @ W_i; the LoRA products'
    gradients, member i's lora_x_a being columns [sum_{j<i} r_j, + r_i) of `lora_x_a`); dx = sum_i
    dx_i, summed in float32."""
    del group_forward
    weights, lora_x_a, lora_bs = residuals
    grad_x = None
    grad_lora_x_a, grad_bs, grad_weights = [], [], []
    start = 0
    for i, (weight, grad_output) in enumerate(zip(weights, grads)):
        if lora_x_a is not None:
            rank = lora_bs[i].shape[0]
            member_x_a = lora_x_a[:, start:start + rank].astype(jnp.float32)
            start += rank
            grad32 = grad_output.astype(jnp.float32)
            grad_lora_x_a.append(scales[i] * jnp.dot(grad32, lora_bs[i].astype(jnp.float32).T))
            grad_bs.append((scales[i] * jnp.dot(member_x_a.T, grad32)).astype(lora_bs[i].dtype))
        dx, grad_weight = _grad_x_and_weight_cotangent(grad_output, weight, compute_dtype,
                                                       backward)
        grad_weights.append(grad_weight)
        grad_x = dx.astype(jnp.float32) if grad_x is None else grad_x + dx.astype(jnp.float32)
    return (grad_x.astype(compute_dtype),
            None if lora_x_a is None else jnp.concatenate(grad_lora_x_a, axis=1).astype(lora_x_a.dtype),
            None if lora_bs is None else tuple(grad_bs), tuple(grad_weights))


_grouped_quantized_matmul.defvjp(_grouped_quantized_matmul_fwd, _grouped_quantized_matmul_bwd)


@dataclasses.dataclass(frozen=True)
class LoRAProduct:
    """An unmerged LoRA adapter for `linear`: y += scale * (x @ a) @ b.

    a [in, r], b [r, out] (any float dtype; cast to the compute dtype), scale = alpha / r.
    """
    a: jax.Array
    b: jax.Array
    scale: float


def _check_lora_shapes(lora: LoRAProduct, in_features: int, out_features: int) -> None:
    a_shape, b_shape = tuple(lora.a.shape), tuple(lora.b.shape)
    if (len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != in_features
            or b_shape[1] != out_features or a_shape[1] != b_shape[0]):
        raise ValueError(f"linear: LoRA A {a_shape} and B {b_shape} must be [in={in_features}, "
                         f"r] and [r, out={out_features}]")


def _lora_x_a(x2d: jax.Array, lora: LoRAProduct, compute_dtype,
               out_dtype=jnp.float32) -> jax.Array:
    """x @ A in compute dtype, float32 accumulation: [M, r] in out_dtype (the dot writes it
    directly: no separate convert kernel)."""
    return jnp.dot(x2d.astype(compute_dtype), lora.a.astype(compute_dtype),
                   preferred_element_type=out_dtype)


def quantized_matmul(x: jax.Array, weight: QuantizedWeight, *, compute_dtype=jnp.bfloat16,
                     platform: str | None = None) -> jax.Array:
    """x [..., K] @ dequant(weight [N, K]).T -> [..., N] float32 (custom VJP, grad for x only).

    Args:
      x: activations [..., K]; cast to compute_dtype.
      weight: a QuantizedWeight of logical shape [N, K].
      compute_dtype: dtype of the matmul inputs (dequantized weight and x).
      platform: where it runs, for kernel selection (default: jax.default_backend()).
    """
    return _quantized_product(x, weight, compute_dtype, platform, None)[0]


def _forward_backend(weight: QuantizedWeight, m: int, compute_dtype, platform: str,
                     lora_rank: int | None = None) -> tuple[MatmulBackend, list[str]]:
    """The backend an M-row forward of `weight` (with an unmerged LoRA of rank lora_rank, or
    None) runs on (XLA where no registered backend takes it), and the refusals before it."""
    dtype = jnp.dtype(compute_dtype)

    def refusal(backend):
        return backend.refusal(weight, dtype) or backend.launch_refusal(weight, lora_rank)

    kernel, refusals = dispatch.first_taker(weight.format, m, platform, refusal)
    return kernel or XLA, refusals


def dense_weight(weight: QuantizedWeight, m: int, *, compute_dtype=jnp.bfloat16,
                 platform: str | None = None) -> jax.Array | None:
    """The dense W [N, K] that an M-row `linear` of `weight` would make and multiply by (the
    dequantize-then-dot paths: XLA's, or a kernel backend's for large M), bit for bit, or None
    where that forward makes none (a fused kernel decodes the weights inside its launch).
    A caller that runs many such forwards on a frozen weight (a sampler's decode loop) can make
    it once and pass it to `linear` as a dense kernel (its transpose [K, N])."""
    platform = platform or jax.default_backend()
    kernel, _ = _forward_backend(weight, m, compute_dtype, platform)
    return kernel.dense(weight, compute_dtype=jnp.dtype(compute_dtype))


def _quantized_product(x: jax.Array, weight: QuantizedWeight, compute_dtype,
                       platform: str | None, lora: LoRAProduct | None,
                       lora_x_a: jax.Array | None = None) -> tuple[jax.Array, bool]:
    """quantized_matmul, plus `lora`'s product where the selected kernel has a LoRA epilogue:
    ([..., N] float32, whether the LoRA product was added here; if not, the caller adds it).
    lora_x_a: x @ A [M, r] made elsewhere (linear's argument), else computed here."""
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features:
        raise ValueError(f"linear: x has {x.shape[-1]} features but the {weight.format} "
                         f"weight is [out={out_features}, in={in_features}]")
    leading = x.shape[:-1]
    x2d = x.reshape(-1, in_features).astype(compute_dtype)
    platform = platform or jax.default_backend()
    m = x2d.shape[0]
    kernel, refusals = _forward_backend(weight, m, compute_dtype, platform,
                                        None if lora is None else lora.a.shape[1])
    dispatch.log_path_once("matmul", weight.format, platform, m, kernel.name,
                           kernel.description, refusals)
    forward, backward = kernel.apply, kernel.apply_backward
    if lora is not None and kernel.lora_epilogue:
        lora_x_a = (_lora_x_a(x2d, lora, compute_dtype, out_dtype=compute_dtype)
                if lora_x_a is None else lora_x_a.astype(compute_dtype))
        y = _quantized_matmul_lora(x2d, lora_x_a, lora.b.astype(compute_dtype), weight,
                                   jnp.dtype(compute_dtype), float(lora.scale), kernel.apply_lora,
                                   backward)
        return y.reshape(*leading, out_features), True
    y = _quantized_matmul(x2d, weight, jnp.dtype(compute_dtype), forward, backward)
    return y.reshape(*leading, out_features), False


@jax.custom_vjp
def narrow_matmul(x: jax.Array, weight: jax.Array) -> jax.Array:
    """x [..., in] @ weight [in, out] -> float32 [..., out] for bfloat16 / float16 operands
    (float32 accumulation), with a backward pass in the operands' dtype.

    The float32 cotangent is rounded to the weight's dtype before the two products (float32
    accumulation; dx returned in x's dtype). Plain autodiff would multiply the float32
    cotangent by the narrow weight, and XLA converts the whole weight to float32 first: a
    float32 copy of each frozen weight per backward (259 MiB for a Qwen2.5-7B MLP projection)
    and a float32 GEMM. The quantized path's backward (backends.xla.xla_backward) rounds its cotangent the
    same way.
    """
    return jnp.dot(x, weight, preferred_element_type=jnp.float32)


def _narrow_matmul_fwd(x, weight):
    return narrow_matmul(x, weight), (x, weight)


def _narrow_matmul_bwd(residuals, grad_output):
    x, weight = residuals
    grad = grad_output.astype(weight.dtype)
    grad_x = jax.lax.dot_general(grad, weight, (((grad.ndim - 1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)
    flat_x = x.reshape(-1, x.shape[-1])
    grad_weight = jax.lax.dot_general(flat_x, grad.reshape(-1, grad.shape[-1]),
                                      (((0,), (0,)), ((), ())),
                                      preferred_element_type=jnp.float32)
    return grad_x.astype(x.dtype), grad_weight.astype(weight.dtype)


narrow_matmul.defvjp(_narrow_matmul_fwd, _narrow_matmul_bwd)


def linear(x: jax.Array, weight, bias: jax.Array | None = None, *,
           compute_dtype=jnp.bfloat16, lora: LoRAProduct | None = None,
           lora_x_a: jax.Array | None = None) -> jax.Array:
    """Applies a (possibly quantized) linear layer, with an optional unmerged LoRA adapter.

    y = x @ W + b, then y + scale * (x @ A) @ B (float32 sum, one rounding to compute_dtype).
    Where the quantized kernel has a LoRA epilogue (the fused small-M kernels), the adapter's
    second product is added inside the kernel, before the bias.

    Args:
      x: activations [..., in].
      weight: dense kernel [in, out], or a QuantizedWeight of logical shape [out, in].
      bias: optional [out].
      compute_dtype: dtype of the matmul inputs and of the result; accumulation is float32
        (a narrower dense weight goes through narrow_matmul: backward in that dtype).
      lora: optional LoRAProduct (a [in, r], b [r, out], scale).
      lora_x_a: optional x @ a [..., r] computed elsewhere (the decode attention's combine
        kernel computes the o-projection's: qerl_jax.models.transformer), used instead of
        computing it here; only with `lora`. Gradients reach a and x only through however it
        was computed (the decode step takes none).
    Returns:
      [..., out] in compute_dtype.
    """
    if lora is not None:
        _check_lora_shapes(lora, x.shape[-1],
                           weight.shape[0] if isinstance(weight, QuantizedWeight)
                           else weight.shape[-1])
    if lora_x_a is not None:
        rank = lora.a.shape[1] if lora is not None else None
        if lora is None or lora_x_a.shape != (*x.shape[:-1], rank):
            raise ValueError(f"linear: lora_x_a {lora_x_a.shape} needs a LoRA adapter and the "
                             f"shape [*x.shape[:-1], r] = {(*x.shape[:-1], rank)}")
        lora_x_a = lora_x_a.reshape(-1, rank)
    lora_applied = False
    if isinstance(weight, QuantizedWeight):
        y, lora_applied = _quantized_product(x, weight, compute_dtype, None, lora, lora_x_a)
    else:
        x = x.astype(compute_dtype)
        weight = weight.astype(compute_dtype)
        y = (jnp.dot(x, weight, preferred_element_type=jnp.float32)
             if weight.dtype == jnp.float32 else narrow_matmul(x, weight))
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    y = y.astype(compute_dtype)
    if lora is not None and not lora_applied:
        lora_x_a = (_lora_x_a(x.reshape(-1, x.shape[-1]), lora, compute_dtype)
                if lora_x_a is None else lora_x_a)
        up = jnp.dot(lora_x_a.astype(compute_dtype), lora.b.astype(compute_dtype),
                     preferred_element_type=jnp.float32)
        y = (y.astype(jnp.float32) + lora.scale * up.reshape(y.shape)).astype(compute_dtype)
    return y


def _shared_launch_kernel(x2d, weights, loras, compute_dtype, platform: str,
                          launch_refusal: Callable) -> tuple[MatmulBackend | None, list[str]]:
    """The first registered backend for x2d's M that takes every one of `weights` (all
    quantized, one format, LoRA on all or none) and for which `launch_refusal(backend,
    lora_ranks)` is None, or (None, why not): what a launch over several weights needs."""
    formats = {w.format for w in weights}
    if len(formats) != 1:
        return None, [f"mixed formats {sorted(formats)}"]
    if len({lora is None for lora in loras}) != 1:
        return None, ["LoRA on some weights only"]
    dtype = jnp.dtype(compute_dtype)
    lora_ranks = None if loras[0] is None else tuple(lora.a.shape[1] for lora in loras)

    def refusal(backend):
        for weight in weights:
            reason = backend.refusal(weight, dtype)
            if reason is not None:
                return reason
        reason = launch_refusal(backend, lora_ranks)
        if reason is None and lora_ranks is not None and not backend.lora_epilogue:
            return "it has no LoRA epilogue"
        return reason

    return dispatch.first_taker(weights[0].format, x2d.shape[0], platform, refusal)


def _group_kernel(x2d: jax.Array, weights, loras, compute_dtype,
                  platform: str) -> tuple[MatmulBackend | None, list[str]]:
    """The kernel that runs `weights` (all quantized) in one launch for x2d, or (None, why
    not)."""
    if len(weights) < 2:
        return None, ["fewer than two weights"]
    return _shared_launch_kernel(
        x2d, weights, loras, compute_dtype, platform,
        lambda backend, lora_ranks: backend.group_refusal(weights, lora_ranks))


def _check_shared_input_shapes(op_name: str, weights, loras, in_features: int) -> None:
    """ValueError naming the op unless every quantized weight [out, in] (and its LoRA) takes
    the shared input's `in_features`."""
    for w, lora in zip(weights, loras):
        if w.shape[1] != in_features:
            raise ValueError(f"{op_name}: x has {in_features} features but a {w.format} "
                             f"weight is [out={w.shape[0]}, in={w.shape[1]}]")
        if lora is not None:
            _check_lora_shapes(lora, in_features, w.shape[0])


def _select_shared_launch(op_name: str, x: jax.Array, weights, loras, compute_dtype,
                          select: Callable, labels: tuple[str, str]):
    """(x2d [M, in] in compute dtype, kernel or None, its backward) for an op whose quantized
    weights share x: shapes checked (naming op_name), the launch's kernel chosen by
    `select(x2d, weights, loras, compute_dtype, platform)` and the path logged once as
    labels[0] (no kernel) or "<kernel> labels[1]"."""
    in_features = x.shape[-1]
    _check_shared_input_shapes(op_name, weights, loras, in_features)
    x2d = x.reshape(-1, in_features).astype(compute_dtype)
    platform = jax.default_backend()
    kernel, refusals = select(x2d, weights, loras, compute_dtype, platform)
    dispatch.log_path_once(
        f"{op_name} of {len(weights)} weights", weights[0].format, platform, x2d.shape[0],
        labels[0] if kernel is None else f"{kernel.name} {labels[1]}",
        "one launch per weight" if kernel is None else kernel.description, refusals)
    if kernel is None:
        return x2d, None, None
    return x2d, kernel, kernel.apply_backward


def _group_lora_inputs(x2d, loras, stacked_lora_a, compute_dtype):
    """(lora_x_a = x @ [A_0 | A_1 | ...] [M, sum r_i] in compute dtype, (B_i), (scale_i)) for a
    launch over several weights, or (None, None, None) without LoRA. One x @ [A_0 | A_1 | ...]
    for the group: separate x @ A_i dots would be merged by XLA anyway, but then it
    concatenates the A_i inside the decode loop at every step and slices the product apart
    (4-5 extra small kernels per layer and step)."""
    if loras[0] is None:
        return None, None, None
    if stacked_lora_a is None:
        stacked_a = jnp.concatenate([lora.a.astype(compute_dtype) for lora in loras], axis=1)
    else:
        expected = (x2d.shape[1], sum(lora.a.shape[1] for lora in loras))
        if tuple(stacked_lora_a.shape) != expected:
            raise ValueError(f"linear_group: stacked_lora_a {tuple(stacked_lora_a.shape)} "
                             f"must be [in, sum of ranks] = {list(expected)}")
        stacked_a = stacked_lora_a.astype(compute_dtype)
    lora_x_a = jnp.dot(x2d, stacked_a, preferred_element_type=compute_dtype)
    return (lora_x_a, tuple(lora.b.astype(compute_dtype) for lora in loras),
            tuple(float(lora.scale) for lora in loras))


def linear_group(x: jax.Array, weights, biases, *, compute_dtype=jnp.bfloat16,
                 loras=None, stacked_lora_a: jax.Array | None = None) -> list[jax.Array]:
    """`linear` of several layers that read the same x (a layer's q/k/v, or gate/up).

    Where the selected quantized kernel can launch them together (apply_grouped: the fused small-M
    kernels, e.g. at decode), it does, with each layer's LoRA product in the epilogue; each
    output is what `linear` would give up to float32 summation order (the group's split-K may
    differ). Otherwise each layer runs through `linear`, unchanged (dense weights, large M, CPU
    without kernels: bit for bit the single calls).

    Args:
      x: activations [..., in], shared.
      weights: sequence of weights (as for `linear`), all with `in` input features.
      biases: sequence of optional biases [out_i] (same length).
      loras: optional sequence of optional LoRAProducts (same length).
      stacked_lora_a: optional [in, sum r_i], the loras' A matrices side by side in the compute
        dtype, made once outside a loop (qerl_jax.models.decode_fusion.stack_grouped_adapters): the grouped
        launch's x @ [A_0 | A_1 | ...] then reads it instead of concatenating the A_i at every
        call. Ignored where the layers run one by one.
    Returns:
      list of [..., out_i] in compute_dtype.
    """
    weights = tuple(weights)
    biases = tuple(biases)
    loras = tuple(loras) if loras is not None else (None,) * len(weights)
    if not len(weights) == len(biases) == len(loras):
        raise ValueError(f"linear_group: {len(weights)} weights, {len(biases)} biases and "
                         f"{len(loras)} LoRA entries must match")

    def one_by_one():
        return [linear(x, w, b, compute_dtype=compute_dtype, lora=lora)
                for w, b, lora in zip(weights, biases, loras)]

    if not all(isinstance(w, QuantizedWeight) for w in weights):
        return one_by_one()
    leading = x.shape[:-1]
    x2d, kernel, backward = _select_shared_launch("linear_group", x, weights, loras,
                                                  compute_dtype, _group_kernel,
                                                  ("one by one", "grouped"))
    if kernel is None:
        return one_by_one()
    lora_x_a, lora_bs, scales = _group_lora_inputs(x2d, loras, stacked_lora_a, compute_dtype)
    ys = _grouped_quantized_matmul(x2d, lora_x_a, lora_bs, weights, jnp.dtype(compute_dtype),
                                   scales, kernel.apply_grouped, backward)
    outputs = []
    for y, w, bias in zip(ys, weights, biases):
        if bias is not None:
            y = y + bias.astype(jnp.float32)
        outputs.append(y.astype(compute_dtype).reshape(*leading, w.shape[0]))
    return outputs
