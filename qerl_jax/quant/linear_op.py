"""The one linear op every projection of the model goes through.

y = x @ W (+ b), with W either a dense array [in, out] (bf16/fp32 baseline) or a quantized
weight pytree. Formats, LoRA and Pallas kernels plug in here without touching the layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def linear(x: jax.Array, weight, bias: jax.Array | None = None, *,
           compute_dtype=jnp.bfloat16) -> jax.Array:
    """Applies a (possibly quantized) linear layer.

    Args:
      x: activations [..., in].
      weight: dense kernel [in, out].
      bias: optional [out].
      compute_dtype: dtype of the matmul inputs and of the result; accumulation is float32.
    Returns:
      [..., out] in compute_dtype.
    """
    x = x.astype(compute_dtype)
    y = jnp.dot(x, weight.astype(compute_dtype), preferred_element_type=jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(compute_dtype)
