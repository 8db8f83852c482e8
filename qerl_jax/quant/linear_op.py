"""The one linear op every projection of the model goes through.

y = x @ W (+ b), with W either a dense array [in, out] (bf16/fp32 baseline) or a frozen
QuantizedWeight with logical shape [out, in] = [N, K]. Formats, LoRA and Pallas kernels plug in
here without touching the layers.

Quantized path: y = x @ dequant(W).T through a custom VJP. The weight is frozen, so the VJP
returns a gradient for x only (zero cotangents for the weight's arrays), and the backward pass
dequantizes W again instead of keeping a dense copy from the forward pass: the only residual
is the QuantizedWeight itself (x is not needed for dx = dy @ W).

Dispatch: `select_matmul_path(format, m, platform)` picks the implementation for an M-row
product. Kernels (pallas_kernels/) register with `register_matmul_kernel` for a (format,
platform) and a range of M, with an optional backward (dy @ W) kernel and an optional
`supports(weight, compute_dtype)` check (e.g. the weight must be in the kernel layout made by
qerl_jax.quant.kernel_dispatch.enable_kernels); without a match the XLA path runs (dequantize to
the compute dtype, then one dot with float32 accumulation). The chosen path and the reason are
logged once per (format, platform, path, reason).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from qerl_jax.quant.qarray import QuantizedWeight

logger = logging.getLogger(__name__)

XLA_PATH = "xla"


@dataclasses.dataclass(frozen=True)
class MatmulKernel:
    """A kernel for quantized matmuls, used for min_m <= M <= max_m (max_m None: unbounded).

    fn(x [M, K], weight, *, compute_dtype) -> y [M, N] float32 (the forward product), and
    optionally grad_fn(grad_y [M, N], weight, *, compute_dtype) -> dx [M, K] in compute_dtype
    (the backward product dy @ W); without grad_fn the backward pass runs on XLA.
    Optionally lora_fn(x, weight, down [M, r], lora_b [r, N], scale, *, compute_dtype) -> y
    [M, N] float32 = x @ W^T + scale * down @ lora_b in one kernel (an unmerged LoRA's second
    product in the epilogue); without it LoRA runs as separate XLA dots.
    supports(weight, compute_dtype) -> None when the kernel can take this weight, else a short
    reason why not (then the XLA path runs and the reason is logged once).
    Optionally group_fn(x, weights, down, lora_bs, scales, *, compute_dtype) -> tuple of
    [M, N_i] float32: several weights that share x (a layer's q/k/v, gate/up) in one launch,
    each output the forward product (plus its LoRA product when down, the members' x @ A_i side
    by side [M, sum r_i], is not None); with
    group_supports(weights) -> None or the reason they cannot share a launch. Without it
    `linear_group` runs the weights one by one.
    Optionally swiglu_fn(x, (gate, up), down, lora_bs, scales, pair_lora_b, *, compute_dtype)
    -> [M, N] in compute dtype: silu(gate product) * (up product) of a SwiGLU MLP in one launch
    (`linear_swiglu`), with swiglu_supports(m, (gate, up), scales or None) -> None or the
    reason it cannot, and swiglu_lora_b_fn((gate, up), (B_gate, B_up)) -> the launch's LoRA
    B operand made once outside a loop (`prepare_swiglu_lora_b`; pair_lora_b is that, or
    None to make it per call).
    Optionally swiglu_next_fn(x, (gate, up), down, lora_bs, scales, pair_lora_b, next_lora_a,
    *, compute_dtype) -> (the swiglu_fn output, its product with next_lora_a [N, r_next] as
    [M, r_next] in compute dtype): the same launch also computes the next layer's LoRA x @ A
    (the MLP's down projection), with swiglu_next_supports(next_lora_a) -> None or the reason
    it does not.
    """

    name: str
    format: str
    platform: str
    fn: Callable[..., jax.Array]
    min_m: int = 1
    max_m: int | None = None
    grad_fn: Callable[..., jax.Array] | None = None
    supports: Callable[..., str | None] | None = None
    lora_fn: Callable[..., jax.Array] | None = None
    group_fn: Callable[..., tuple] | None = None
    group_supports: Callable[..., str | None] | None = None
    swiglu_fn: Callable[..., jax.Array] | None = None
    swiglu_supports: Callable[..., str | None] | None = None
    swiglu_lora_b_fn: Callable[..., jax.Array] | None = None
    swiglu_next_fn: Callable[..., tuple] | None = None
    swiglu_next_supports: Callable[..., str | None] | None = None

    def accepts(self, m: int) -> bool:
        return m >= self.min_m and (self.max_m is None or m <= self.max_m)


_KERNELS: dict[tuple[str, str], list[MatmulKernel]] = {}
_LOGGED: set[tuple[str, str, str, str]] = set()


def register_matmul_kernel(format_name: str, platform: str, fn: Callable[..., jax.Array], *,
                           name: str, min_m: int = 1, max_m: int | None = None,
                           grad_fn: Callable[..., jax.Array] | None = None,
                           supports: Callable[..., str | None] | None = None,
                           lora_fn: Callable[..., jax.Array] | None = None,
                           group_fn: Callable[..., tuple] | None = None,
                           group_supports: Callable[..., str | None] | None = None,
                           swiglu_fn: Callable[..., jax.Array] | None = None,
                           swiglu_supports: Callable[..., str | None] | None = None,
                           swiglu_lora_b_fn: Callable[..., jax.Array] | None = None,
                           swiglu_next_fn: Callable[..., tuple] | None = None,
                           swiglu_next_supports: Callable[..., str | None] | None = None
                           ) -> MatmulKernel:
    """Registers a kernel for (format, platform) ("gpu", "cpu", "tpu") and an M range.

    Kernels registered first win when ranges overlap. Returns the registry entry.
    """
    if max_m is not None and max_m < min_m:
        raise ValueError(f"kernel {name}: max_m={max_m} < min_m={min_m}")
    kernel = MatmulKernel(name=name, format=format_name, platform=platform, fn=fn,
                          min_m=min_m, max_m=max_m, grad_fn=grad_fn, supports=supports,
                          lora_fn=lora_fn, group_fn=group_fn, group_supports=group_supports,
                          swiglu_fn=swiglu_fn, swiglu_supports=swiglu_supports,
                          swiglu_lora_b_fn=swiglu_lora_b_fn, swiglu_next_fn=swiglu_next_fn,
                          swiglu_next_supports=swiglu_next_supports)
    entries = _KERNELS.setdefault((format_name, platform), [])
    if any(entry.name == name for entry in entries):
        raise ValueError(f"a {format_name}/{platform} kernel named {name!r} is already "
                         "registered")
    entries.append(kernel)
    return kernel


def unregister_matmul_kernel(format_name: str, platform: str, name: str) -> None:
    """Removes a registered kernel (tests, benchmarks comparing paths)."""
    entries = _KERNELS.get((format_name, platform), [])
    _KERNELS[(format_name, platform)] = [entry for entry in entries if entry.name != name]


def _select(format_name: str, m: int, platform: str) -> tuple[MatmulKernel | None, str]:
    entries = _KERNELS.get((format_name, platform), [])
    if not entries:
        return None, f"no kernel registered for {format_name} on {platform}"
    for kernel in entries:
        if kernel.accepts(m):
            return kernel, (f"kernel {kernel.name} covers M={m} (M in [{kernel.min_m}, "
                            f"{kernel.max_m if kernel.max_m is not None else 'inf'}])")
    ranges = ", ".join(f"{k.name}: [{k.min_m}, {k.max_m if k.max_m is not None else 'inf'}]"
                       for k in entries)
    return None, f"M={m} is outside every registered kernel's range ({ranges})"


def select_matmul_path(format_name: str, m: int, platform: str) -> str:
    """Name of the forward path for an M-row matmul with a `format_name` weight on `platform`:
    a registered kernel's name, or "xla"."""
    kernel, _ = _select(format_name, m, platform)
    return XLA_PATH if kernel is None else kernel.name


def _log_path_once(format_name: str, platform: str, path: str, reason: str) -> None:
    key = (format_name, platform, path, reason)
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info("quantized linear (%s on %s): %s path, because %s", format_name, platform,
                    path, reason)


def tie_weight_to_activations(x: jax.Array, weight):
    """(x, weight) through one optimization barrier, for a forward that dequantizes `weight`.

    A dequantization depends only on the frozen weight, so without this XLA may schedule it
    long before its matmul: in a training forward it then keeps several layers' dense copies
    alive at once. After the barrier the dequantization needs x, so it runs when its layer's
    activations exist (the backward pass ties its re-dequantization to the cotangent the same
    way). Values are unchanged.
    """
    return jax.lax.optimization_barrier((x, weight))


def _xla_forward(x: jax.Array, weight: QuantizedWeight, *, compute_dtype) -> jax.Array:
    """x [M, K] (compute dtype) @ dequant(W [N, K]).T -> [M, N] float32."""
    x, weight = tie_weight_to_activations(x, weight)
    dense = weight.dequantize(compute_dtype)
    return jax.lax.dot_general(x, dense, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)


def _xla_backward(grad_output: jax.Array, weight: QuantizedWeight, *,
                  compute_dtype) -> jax.Array:
    """dy [M, N] @ dequant(W [N, K]) -> dx [M, K] in compute_dtype (float32 accumulation)."""
    dense = weight.dequantize(compute_dtype)
    return jax.lax.dot_general(grad_output.astype(compute_dtype), dense,
                               (((1,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32).astype(compute_dtype)


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
def _quantized_matmul_lora(x, down, lora_b, weight, compute_dtype, scale, lora_forward,
                           backward):
    del backward
    return lora_forward(x, weight, down, lora_b, scale, compute_dtype=compute_dtype)


def _quantized_matmul_lora_fwd(x, down, lora_b, weight, compute_dtype, scale, lora_forward,
                               backward):
    del backward
    y = lora_forward(x, weight, down, lora_b, scale, compute_dtype=compute_dtype)
    return y, (weight, down, lora_b)


def _quantized_matmul_lora_bwd(compute_dtype, scale, lora_forward, backward, residuals,
                               grad_output):
    """dx = dy @ W (as the plain op), d down = scale dy B^T, d B = scale down^T dy (float32
    products, cast to the inputs' dtypes)."""
    del lora_forward
    weight, down, lora_b = residuals
    grad32 = grad_output.astype(jnp.float32)
    grad_down = scale * jnp.dot(grad32, lora_b.astype(jnp.float32).T)
    grad_b = scale * jnp.dot(down.astype(jnp.float32).T, grad32)
    grad_x, grad_weight = _grad_x_and_weight_cotangent(grad_output, weight, compute_dtype,
                                                       backward)
    return grad_x, grad_down.astype(down.dtype), grad_b.astype(lora_b.dtype), grad_weight


_quantized_matmul_lora.defvjp(_quantized_matmul_lora_fwd, _quantized_matmul_lora_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _grouped_quantized_matmul(x, down, lora_bs, weights, compute_dtype, scales, group_forward,
                              backward):
    del backward
    return group_forward(x, weights, down, lora_bs, scales, compute_dtype=compute_dtype)


def _grouped_quantized_matmul_fwd(x, down, lora_bs, weights, compute_dtype, scales,
                                  group_forward, backward):
    del backward
    ys = group_forward(x, weights, down, lora_bs, scales, compute_dtype=compute_dtype)
    return ys, (weights, down, lora_bs)


def _grouped_quantized_matmul_bwd(compute_dtype, scales, group_forward, backward, residuals,
                                  grads):
    """Per weight what the single ops' VJPs give (dx_i = dy_i @ W_i; the LoRA products'
    gradients, member i's down being columns [sum_{j<i} r_j, + r_i) of `down`); dx = sum_i
    dx_i, summed in float32."""
    del group_forward
    weights, down, lora_bs = residuals
    grad_x = None
    grad_down, grad_bs, grad_weights = [], [], []
    start = 0
    for i, (weight, grad_output) in enumerate(zip(weights, grads)):
        if down is not None:
            rank = lora_bs[i].shape[0]
            member_down = down[:, start:start + rank].astype(jnp.float32)
            start += rank
            grad32 = grad_output.astype(jnp.float32)
            grad_down.append(scales[i] * jnp.dot(grad32, lora_bs[i].astype(jnp.float32).T))
            grad_bs.append((scales[i] * jnp.dot(member_down.T, grad32)).astype(lora_bs[i].dtype))
        dx, grad_weight = _grad_x_and_weight_cotangent(grad_output, weight, compute_dtype,
                                                       backward)
        grad_weights.append(grad_weight)
        grad_x = dx.astype(jnp.float32) if grad_x is None else grad_x + dx.astype(jnp.float32)
    return (grad_x.astype(compute_dtype),
            None if down is None else jnp.concatenate(grad_down, axis=1).astype(down.dtype),
            None if lora_bs is None else tuple(grad_bs), tuple(grad_weights))


_grouped_quantized_matmul.defvjp(_grouped_quantized_matmul_fwd, _grouped_quantized_matmul_bwd)


def _members_forward(kernel: MatmulKernel, x, weights, down, lora_bs, scales, *,
                     compute_dtype):
    """A group_fn that runs the members one by one with `kernel`'s single-weight products
    (its LoRA epilogue where it has one): the recomputation behind the fused SwiGLU's VJP,
    for weights that take no grouped launch (gate/up pair views)."""
    outputs, start = [], 0
    for i, weight in enumerate(weights):
        if down is None:
            outputs.append(kernel.fn(x, weight, compute_dtype=compute_dtype))
            continue
        rank = lora_bs[i].shape[0]
        member_down = down[:, start:start + rank]
        start += rank
        if kernel.lora_fn is not None:
            outputs.append(kernel.lora_fn(x, weight, member_down, lora_bs[i], scales[i],
                                          compute_dtype=compute_dtype))
        else:
            outputs.append(kernel.fn(x, weight, compute_dtype=compute_dtype) + scales[i] * jnp.dot(
                member_down.astype(compute_dtype), lora_bs[i].astype(compute_dtype),
                preferred_element_type=jnp.float32))
    return tuple(outputs)


def _swiglu_of_members(x, down, lora_bs, weights, compute_dtype, scales, kernel, backward):
    """silu(gate) * up of the members' products, each rounded to compute_dtype first, the
    SwiGLU in float32, rounded once: what the fused SwiGLU launch computes, and the function
    whose VJP is its backward."""
    gate, up = (y.astype(compute_dtype).astype(jnp.float32) for y in _grouped_quantized_matmul(
        x, down, lora_bs, weights, compute_dtype, scales,
        functools.partial(_members_forward, kernel), backward))
    return (jax.nn.silu(gate) * up).astype(compute_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _fused_swiglu_matmul(x, down, lora_bs, pair_lora_b, weights, compute_dtype, scales, kernel,
                         backward):
    del backward
    return kernel.swiglu_fn(x, weights, down, lora_bs, scales, pair_lora_b,
                            compute_dtype=compute_dtype)


def _fused_swiglu_matmul_fwd(x, down, lora_bs, pair_lora_b, weights, compute_dtype, scales,
                             kernel, backward):
    y = _fused_swiglu_matmul(x, down, lora_bs, pair_lora_b, weights, compute_dtype, scales,
                             kernel, backward)
    return y, (x, down, lora_bs, pair_lora_b, weights)


def _fused_swiglu_matmul_bwd(compute_dtype, scales, kernel, backward, residuals, grad_output):
    """The VJP of _swiglu_of_members (the products recomputed, then SwiGLU's derivative and
    the single products' own backward): the fused launch keeps no gate/up for it. The
    prepared LoRA B operand gets a zero cotangent (its B matrices get theirs)."""
    x, down, lora_bs, pair_lora_b, weights = residuals
    _, pullback = jax.vjp(
        lambda *primals: _swiglu_of_members(*primals, compute_dtype, scales, kernel, backward),
        x, down, lora_bs, weights)
    grad_x, grad_down, grad_bs, grad_weights = pullback(grad_output)
    grad_pair_b = None if pair_lora_b is None else jnp.zeros_like(pair_lora_b)
    return grad_x, grad_down, grad_bs, grad_pair_b, grad_weights


_fused_swiglu_matmul.defvjp(_fused_swiglu_matmul_fwd, _fused_swiglu_matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _fused_swiglu_matmul_next(x, down, lora_bs, pair_lora_b, weights, next_lora_a,
                              compute_dtype, scales, kernel, backward):
    """(_fused_swiglu_matmul's y, y @ next_lora_a in compute_dtype) from one launch
    (kernel.swiglu_next_fn)."""
    del backward
    return kernel.swiglu_next_fn(x, weights, down, lora_bs, scales, pair_lora_b, next_lora_a,
                                 compute_dtype=compute_dtype)


def _fused_swiglu_matmul_next_fwd(x, down, lora_bs, pair_lora_b, weights, next_lora_a,
                                  compute_dtype, scales, kernel, backward):
    y, next_down = _fused_swiglu_matmul_next(x, down, lora_bs, pair_lora_b, weights,
                                             next_lora_a, compute_dtype, scales, kernel,
                                             backward)
    return (y, next_down), (x, down, lora_bs, pair_lora_b, weights, next_lora_a, y)


def _fused_swiglu_matmul_next_bwd(compute_dtype, scales, kernel, backward, residuals,
                                  cotangents):
    """next_down = y @ A: y's cotangent gains d_next @ A^T (float32, rounded once), A's is
    y^T @ d_next; the rest is _fused_swiglu_matmul's VJP."""
    x, down, lora_bs, pair_lora_b, weights, next_lora_a, y = residuals
    grad_y, grad_next = cotangents
    a32, grad_next32 = next_lora_a.astype(jnp.float32), grad_next.astype(jnp.float32)
    grad_y = (grad_y.astype(jnp.float32) + grad_next32 @ a32.T).astype(y.dtype)
    grads = _fused_swiglu_matmul_bwd(compute_dtype, scales, kernel, backward,
                                     (x, down, lora_bs, pair_lora_b, weights), grad_y)
    grad_a = (y.astype(jnp.float32).T @ grad_next32).astype(next_lora_a.dtype)
    return (*grads, grad_a)


_fused_swiglu_matmul_next.defvjp(_fused_swiglu_matmul_next_fwd, _fused_swiglu_matmul_next_bwd)


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


def _lora_down(x2d: jax.Array, lora: LoRAProduct, compute_dtype,
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


def _quantized_product(x: jax.Array, weight: QuantizedWeight, compute_dtype,
                       platform: str | None, lora: LoRAProduct | None,
                       lora_down: jax.Array | None = None) -> tuple[jax.Array, bool]:
    """quantized_matmul, plus `lora`'s product where the selected kernel has a LoRA epilogue:
    ([..., N] float32, whether the LoRA product was added here; if not, the caller adds it).
    lora_down: x @ A [M, r] made elsewhere (linear's argument), else computed here."""
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features:
        raise ValueError(f"linear: x has {x.shape[-1]} features but the {weight.format} "
                         f"weight is [out={out_features}, in={in_features}]")
    leading = x.shape[:-1]
    x2d = x.reshape(-1, in_features).astype(compute_dtype)
    platform = platform or jax.default_backend()
    kernel, reason = _select(weight.format, x2d.shape[0], platform)
    if kernel is not None and kernel.supports is not None:
        refusal = kernel.supports(weight, jnp.dtype(compute_dtype))
        if refusal is not None:
            kernel, reason = None, f"kernel {kernel.name} cannot take it: {refusal}"
    _log_path_once(weight.format, platform, XLA_PATH if kernel is None else kernel.name, reason)
    forward = _xla_forward if kernel is None else kernel.fn
    backward = _xla_backward if kernel is None or kernel.grad_fn is None else kernel.grad_fn
    if lora is not None and kernel is not None and kernel.lora_fn is not None:
        down = (_lora_down(x2d, lora, compute_dtype, out_dtype=compute_dtype)
                if lora_down is None else lora_down.astype(compute_dtype))
        y = _quantized_matmul_lora(x2d, down, lora.b.astype(compute_dtype), weight,
                                   jnp.dtype(compute_dtype), float(lora.scale), kernel.lora_fn,
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
    and a float32 GEMM. The quantized path's backward (_xla_backward) rounds its cotangent the
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
           lora_down: jax.Array | None = None) -> jax.Array:
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
      lora_down: optional x @ a [..., r] computed elsewhere (the decode attention's combine
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
    if lora_down is not None:
        rank = lora.a.shape[1] if lora is not None else None
        if lora is None or lora_down.shape != (*x.shape[:-1], rank):
            raise ValueError(f"linear: lora_down {lora_down.shape} needs a LoRA adapter and the "
                             f"shape [*x.shape[:-1], r] = {(*x.shape[:-1], rank)}")
        lora_down = lora_down.reshape(-1, rank)
    lora_applied = False
    if isinstance(weight, QuantizedWeight):
        y, lora_applied = _quantized_product(x, weight, compute_dtype, None, lora, lora_down)
    else:
        x = x.astype(compute_dtype)
        weight = weight.astype(compute_dtype)
        y = (jnp.dot(x, weight, preferred_element_type=jnp.float32)
             if weight.dtype == jnp.float32 else narrow_matmul(x, weight))
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    y = y.astype(compute_dtype)
    if lora is not None and not lora_applied:
        down = (_lora_down(x.reshape(-1, x.shape[-1]), lora, compute_dtype)
                if lora_down is None else lora_down)
        up = jnp.dot(down.astype(compute_dtype), lora.b.astype(compute_dtype),
                     preferred_element_type=jnp.float32)
        y = (y.astype(jnp.float32) + lora.scale * up.reshape(y.shape)).astype(compute_dtype)
    return y


def _shared_launch_kernel(x2d, weights, loras, compute_dtype,
                          platform: str) -> tuple[MatmulKernel | None, str]:
    """The kernel selected for x2d's M that takes every one of `weights` (all quantized, one
    format, LoRA on all or none), or (None, why not): what a launch over several weights
    needs before its own checks."""
    formats = {w.format for w in weights}
    if len(formats) != 1:
        return None, f"mixed formats {sorted(formats)}"
    if len({lora is None for lora in loras}) != 1:
        return None, "LoRA on some weights only"
    kernel, reason = _select(weights[0].format, x2d.shape[0], platform)
    if kernel is None:
        return None, reason
    for weight in weights:
        refusal = None if kernel.supports is None else kernel.supports(weight,
                                                                       jnp.dtype(compute_dtype))
        if refusal is not None:
            return None, f"kernel {kernel.name} cannot take it: {refusal}"
    return kernel, reason


def _group_kernel(x2d: jax.Array, weights, loras, compute_dtype,
                  platform: str) -> tuple[MatmulKernel | None, str]:
    """The kernel that runs `weights` (all quantized) in one launch for x2d, or (None, why
    not)."""
    if len(weights) < 2:
        return None, "fewer than two weights"
    kernel, reason = _shared_launch_kernel(x2d, weights, loras, compute_dtype, platform)
    if kernel is None:
        return None, reason
    if kernel.group_fn is None:
        return None, f"kernel {kernel.name} has no grouped launch"
    if loras[0] is not None and kernel.lora_fn is None:
        return None, f"kernel {kernel.name} has no LoRA epilogue"
    refusal = None if kernel.group_supports is None else kernel.group_supports(weights)
    if refusal is not None:
        return None, f"kernel {kernel.name} cannot group them: {refusal}"
    return kernel, f"kernel {kernel.name} groups {len(weights)} weights at M={x2d.shape[0]}"


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
    kernel, reason = select(x2d, weights, loras, compute_dtype, platform)
    _log_path_once(weights[0].format, platform,
                   labels[0] if kernel is None else f"{kernel.name} {labels[1]}", reason)
    if kernel is None:
        return x2d, None, None
    return x2d, kernel, _xla_backward if kernel.grad_fn is None else kernel.grad_fn


def _group_lora_inputs(x2d, loras, stacked_lora_a, compute_dtype):
    """(down = x @ [A_0 | A_1 | ...] [M, sum r_i] in compute dtype, (B_i), (scale_i)) for a
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
    down = jnp.dot(x2d, stacked_a, preferred_element_type=compute_dtype)
    return (down, tuple(lora.b.astype(compute_dtype) for lora in loras),
            tuple(float(lora.scale) for lora in loras))


def linear_group(x: jax.Array, weights, biases, *, compute_dtype=jnp.bfloat16,
                 loras=None, stacked_lora_a: jax.Array | None = None) -> list[jax.Array]:
    """`linear` of several layers that read the same x (a layer's q/k/v, or gate/up).

    Where the selected quantized kernel can launch them together (group_fn: the fused small-M
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
        dtype, made once outside a loop (qerl_jax.lora.stack_grouped_adapters): the grouped
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
    down, lora_bs, scales = _group_lora_inputs(x2d, loras, stacked_lora_a, compute_dtype)
    ys = _grouped_quantized_matmul(x2d, down, lora_bs, weights, jnp.dtype(compute_dtype),
                                   scales, kernel.group_fn, backward)
    outputs = []
    for y, w, bias in zip(ys, weights, biases):
        if bias is not None:
            y = y + bias.astype(jnp.float32)
        outputs.append(y.astype(compute_dtype).reshape(*leading, w.shape[0]))
    return outputs


def _swiglu_kernel(x2d, weights, loras, compute_dtype, platform
                   ) -> tuple[MatmulKernel | None, str]:
    """The kernel whose fused SwiGLU launch takes (gate, up) for x2d, or (None, why not)."""
    kernel, reason = _shared_launch_kernel(x2d, weights, loras, compute_dtype, platform)
    if kernel is None:
        return None, reason
    if kernel.swiglu_fn is None:
        return None, f"kernel {kernel.name} has no fused SwiGLU launch"
    scales = None if loras[0] is None else tuple(float(lora.scale) for lora in loras)
    refusal = (None if kernel.swiglu_supports is None
               else kernel.swiglu_supports(x2d.shape[0], tuple(weights), scales))
    if refusal is not None:
        return None, f"kernel {kernel.name}: no fused SwiGLU: {refusal}"
    return kernel, f"kernel {kernel.name} fuses the SwiGLU at M={x2d.shape[0]}"


def linear_swiglu(x: jax.Array, weights, biases, *, activation: Callable,
                  compute_dtype=jnp.bfloat16, loras=None,
                  stacked_lora_a: jax.Array | None = None,
                  pair_lora_b: jax.Array | None = None,
                  next_lora_a: jax.Array | None = None):
    """activation(*linear_group(x, (gate, up), ...)) for a SwiGLU MLP's gate and up layers,
    [..., N] in compute_dtype, where `activation(gate, up)` is the model's SwiGLU: float32
    silu(gate) * up, rounded to compute_dtype (QeRL's Qwen2.5 MLP, before down_proj).

    Where the selected kernel has a fused SwiGLU launch that takes these weights (swiglu_fn:
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
      next_lora_a: the LoRA A [N, r] of the layer that reads this output (the MLP's down
        projection), or None. Then returns (output, output @ next_lora_a [..., r] in
        compute_dtype, or None): the product comes from the fused launch itself where its
        kernel can (swiglu_next_fn: each program multiplies its output tile by A's rows, a
        split-K gemm and its reduction fewer per layer at decode), else None and the caller
        computes it (linear's lora_down). Its gradient is that of output @ next_lora_a.
    """
    weights, biases = tuple(weights), tuple(biases)
    loras = tuple(loras) if loras is not None else (None, None)
    if not len(weights) == len(biases) == len(loras) == 2:
        raise ValueError(f"linear_swiglu: needs (gate, up): got {len(weights)} weights, "
                         f"{len(biases)} biases and {len(loras)} LoRA entries")
    leading = x.shape[:-1]

    def result(y, next_down=None):
        return y if next_lora_a is None else (y, next_down)

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
    down, lora_bs, scales = _group_lora_inputs(x2d, loras, stacked_lora_a, compute_dtype)
    if down is None:
        pair_lora_b = None
    dtype = jnp.dtype(compute_dtype)
    if next_lora_a is not None and kernel.swiglu_next_fn is not None and (
            kernel.swiglu_next_supports is None
            or kernel.swiglu_next_supports(next_lora_a) is None):
        y, next_down = _fused_swiglu_matmul_next(x2d, down, lora_bs, pair_lora_b, weights,
                                                 next_lora_a, dtype, scales, kernel, backward)
        return (y.astype(compute_dtype).reshape(*leading, out_features),
                next_down.astype(compute_dtype).reshape(*leading, next_lora_a.shape[1]))
    y = _fused_swiglu_matmul(x2d, down, lora_bs, pair_lora_b, weights, dtype, scales, kernel,
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
    if kernel is None or kernel.swiglu_lora_b_fn is None:
        return None
    return kernel.swiglu_lora_b_fn(weights, tuple(lora.b.astype(compute_dtype)
                                                  for lora in loras))
