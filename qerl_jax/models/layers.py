"""Building blocks of the decoder as Flax NNX modules: Linear, Embedding, RMSNorm, RoPE.

Every projection is a `Linear`, and every `Linear` calls `qerl_jax.quant.linear`: the quantized
formats, LoRA and Pallas kernels plug in there without touching the layers.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from qerl_jax.models.config import RopeScaling
from qerl_jax.quant import LoRAProduct, linear, linear_group, linear_swiglu

INIT_STD = 0.02  # HF initializer_range of Qwen2 / Llama


class LoRAParam(nnx.Param):
    """A trainable low-rank adapter matrix (LoRA A [in, r] or B [r, out])."""


class Linear(nnx.Module):
    """y = x @ W + b (+ scale * (x @ A) @ B) through the shared linear op.

    `weight` is a dense kernel [in_features, out_features] (or, after quantization, a quantized
    weight pytree with logical shape [out_features, in_features]). `lora_a` [in, r] and
    `lora_b` [r, out] are set by qerl_jax.lora and applied unmerged (the base weight is never
    rewritten), with scale = alpha / r.
    """

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool,
                 param_dtype, compute_dtype, rngs: nnx.Rngs):
        self.in_features = in_features
        self.out_features = out_features
        self.compute_dtype = compute_dtype
        self.weight = nnx.Param(
            (INIT_STD * jax.random.normal(rngs.params(), (in_features, out_features),
                                          jnp.float32)).astype(param_dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else None
        # data attributes (not static), so adapters can be attached later by qerl_jax.lora
        self.lora_a = nnx.data(None)
        self.lora_b = nnx.data(None)
        self.lora_scale = 0.0

    def operands(self):
        """(weight, bias or None, LoRAProduct or None): what the linear op needs."""
        bias = None if self.bias is None else self.bias.get_value()
        lora = None if self.lora_a is None else LoRAProduct(
            self.lora_a.get_value(), self.lora_b.get_value(), self.lora_scale)
        return self.weight.get_value(), bias, lora

    def __call__(self, x: jax.Array, lora_x_a: jax.Array | None = None) -> jax.Array:
        """x [..., in] -> [..., out]; lora_x_a: x @ lora_a [..., r] made elsewhere, or None
        (qerl_jax.quant.linear_op.linear)."""
        weight, bias, lora = self.operands()
        return linear(x, weight, bias, compute_dtype=self.compute_dtype, lora=lora,
                      lora_x_a=lora_x_a)


def apply_linears(x: jax.Array, layers, stacked_lora_a: jax.Array | None = None
                  ) -> list[jax.Array]:
    """[layer(x) for layer in layers] for Linear layers that read the same x, through
    qerl_jax.quant.linear_group: quantized layers share one kernel launch where the kernel
    allows (decode), otherwise each runs as layer(x). All layers need one compute dtype.
    `stacked_lora_a` [in, sum r]: the layers' LoRA A matrices side by side, precomputed
    (qerl_jax.models.decode_fusion.stack_grouped_adapters), or None to stack them here when needed."""
    dtypes = {jnp.dtype(layer.compute_dtype) for layer in layers}
    if len(dtypes) != 1:
        raise ValueError(f"apply_linears: layers with compute dtypes {sorted(map(str, dtypes))}")
    weights, biases, loras = zip(*(layer.operands() for layer in layers))
    return linear_group(x, weights, biases, compute_dtype=layers[0].compute_dtype, loras=loras,
                        stacked_lora_a=stacked_lora_a)


def apply_swiglu_linears(x: jax.Array, gate_layer: Linear, up_layer: Linear,
                         stacked_lora_a: jax.Array | None = None,
                         pair_lora_b: jax.Array | None = None,
                         next_lora_a: jax.Array | None = None):
    """swiglu(gate_layer(x), up_layer(x)) [..., out] through qerl_jax.quant.linear_swiglu:
    where the quantized kernel can (gate/up pair views at decode), one launch computes both
    projections and applies the SwiGLU in its epilogue; otherwise apply_linears then swiglu,
    unchanged. `stacked_lora_a` [in, r_gate + r_up] as for apply_linears; `pair_lora_b` the
    fused launch's LoRA B made once (qerl_jax.models.decode_fusion.stack_grouped_adapters) or None.
    `next_lora_a`: the down projection's LoRA A [out, r], or None; with it returns (output,
    output @ next_lora_a from the fused launch, or None where it did not compute it)."""
    if jnp.dtype(gate_layer.compute_dtype) != jnp.dtype(up_layer.compute_dtype):
        raise ValueError(f"apply_swiglu_linears: gate computes in {gate_layer.compute_dtype}, "
                         f"up in {up_layer.compute_dtype}")
    (gate_w, gate_b, gate_lora), (up_w, up_b, up_lora) = (gate_layer.operands(),
                                                          up_layer.operands())
    return linear_swiglu(x, (gate_w, up_w), (gate_b, up_b), activation=swiglu,
                         compute_dtype=gate_layer.compute_dtype, loras=(gate_lora, up_lora),
                         stacked_lora_a=stacked_lora_a, pair_lora_b=pair_lora_b,
                         next_lora_a=next_lora_a)


class Embedding(nnx.Module):
    """Token embedding table [vocab, hidden] (also the lm_head of tied models, see
    CausalLM.logits_function)."""

    def __init__(self, vocab_size: int, hidden_size: int, *, param_dtype, compute_dtype,
                 rngs: nnx.Rngs):
        self.compute_dtype = compute_dtype
        self.embedding = nnx.Param(
            (INIT_STD * jax.random.normal(rngs.params(), (vocab_size, hidden_size),
                                          jnp.float32)).astype(param_dtype))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, T] int -> [B, T, hidden] in compute dtype."""
        return jnp.take(self.embedding.get_value(), tokens, axis=0).astype(self.compute_dtype)


class RMSNorm(nnx.Module):
    """y = scale * x / sqrt(mean(x^2) + eps), computed in float32.

    The scale is the tensor AQN perturbs (QeRL section 3.3): a noisy float32 scale can replace
    it in the state without changing this code.
    """

    def __init__(self, hidden_size: int, *, eps: float, param_dtype, compute_dtype):
        self.eps = eps
        self.compute_dtype = compute_dtype
        self.scale = nnx.Param(jnp.ones((hidden_size,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale.get_value().astype(jnp.float32)).astype(self.compute_dtype)


# ------------------------------------------------------------------------------ RoPE
def rope_inverse_frequencies(head_dim: int, theta: float,
                             scaling: RopeScaling | None = None) -> jax.Array:
    """inv_freq [head_dim/2] float32; with `scaling`, the Llama 3.x frequency remapping."""
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = ((scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    smoothed = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    is_medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return jnp.where(is_medium, smoothed, scaled)


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions [B, T] int -> (cos, sin) [B, T, head_dim] float32 (half-split layout)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates x [B, T, heads, D] by (cos, sin) [B, T, D], HF's rotate_half convention."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


# ------------------------------------------------------------------------------ SwiGLU
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up computed in float32, returned in gate's dtype: gate / up [..., I].

    For narrower-than-float32 inputs (bf16) the backward is hand-written (_swiglu_narrow): it
    keeps only gate and up (which the projections produced anyway) and recomputes the float32
    products, where autodiff kept float32 silu(gate) and up, [tokens, I] each (185 MiB per
    Qwen2.5-7B micro-batch of 2 x 1280 tokens). float32 inputs take the plain autodiff.
    """
    if gate.dtype == jnp.float32:
        return (jax.nn.silu(gate) * up.astype(jnp.float32)).astype(gate.dtype)
    return _swiglu_narrow(gate, up)


@jax.custom_vjp
def _swiglu_narrow(gate, up):
    return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(gate.dtype)


def _swiglu_fwd(gate, up):
    return _swiglu_narrow(gate, up), (gate, up)


def _swiglu_bwd(residuals, grad_output):
    """d/dgate = g * up * sigmoid(gate) * (1 + gate * (1 - sigmoid(gate))); d/dup = g *
    silu(gate); float32, each rounded once to its input's dtype."""
    gate, up = residuals
    gate32, up32 = gate.astype(jnp.float32), up.astype(jnp.float32)
    grad32 = grad_output.astype(jnp.float32)
    sigmoid = jax.nn.sigmoid(gate32)
    grad_gate = grad32 * up32 * sigmoid * (1.0 + gate32 * (1.0 - sigmoid))
    grad_up = grad32 * gate32 * sigmoid
    return grad_gate.astype(gate.dtype), grad_up.astype(up.dtype)


_swiglu_narrow.defvjp(_swiglu_fwd, _swiglu_bwd)
