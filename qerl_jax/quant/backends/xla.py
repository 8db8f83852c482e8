"""The XLA reference backend: dequantize with the format's jnp code, then one dot (float32
accumulation). Runs everywhere, for every format and M; the Pallas backends are checked
against it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qerl_jax.quant.backends.base import MatmulBackend


def tie_weight_to_activations(x: jax.Array, weight):
    """(x, weight) through one optimization barrier, for a forward that dequantizes `weight`.

    A dequantization depends only on the frozen weight, so without this XLA may schedule it
    long before its matmul: in a training forward it then keeps several layers' dense copies
    alive at once. After the barrier the dequantization needs x, so it runs when its layer's
    activations exist (the backward pass ties its re-dequantization to the cotangent the same
    way). Values are unchanged.
    """
    return jax.lax.optimization_barrier((x, weight))


def xla_forward(x: jax.Array, weight, *, compute_dtype) -> jax.Array:
    """x [M, K] (compute dtype) @ dequant(W [N, K]).T -> [M, N] float32."""
    x, weight = tie_weight_to_activations(x, weight)
    dense = weight.dequantize(compute_dtype)
    return jax.lax.dot_general(x, dense, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)


def xla_backward(grad_output: jax.Array, weight, *, compute_dtype) -> jax.Array:
    """dy [M, N] @ dequant(W [N, K]) -> dx [M, K] in compute_dtype (float32 accumulation)."""
    dense = weight.dequantize(compute_dtype)
    return jax.lax.dot_general(grad_output.astype(compute_dtype), dense,
                               (((1,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32).astype(compute_dtype)


class XlaBackend(MatmulBackend):
    """Dequantize + dot for every format and M (the path taken when no kernel is selected)."""

    name = "xla"
    description = "dequantize then XLA dot"

    def apply(self, x, weight, *, compute_dtype):
        return xla_forward(x, weight, compute_dtype=compute_dtype)

    def apply_backward(self, grad_output, weight, *, compute_dtype):
        return xla_backward(grad_output, weight, compute_dtype=compute_dtype)

    def dense(self, weight, *, compute_dtype):
        return weight.dequantize(compute_dtype)


XLA = XlaBackend()
