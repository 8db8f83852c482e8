"""The Qwen2 / Qwen2.5 (and Llama 3.x) decoder as Flax NNX modules.

Two forward modes share one code path:
  * full sequence (training): `model(tokens, attention_mask=mask)` on left-padded batches, with
    position ids from the mask;
  * cached (sampling): `prefill(model, tokens, mask, cache)` writes T slots of a preallocated
    static-shape KV cache in one pass, then `decode_step(model, token, cache)` appends one token.
Compute runs in `config.compute_dtype`; RMSNorm, softmax and logits in float32.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from qerl_jax.models.attention_dispatch import decode_attention_kernel
from qerl_jax.models.config import ModelConfig
from qerl_jax.models.kv_cache import KVCache, dequantize_kv, quantize_kv
from qerl_jax.models.layers import (Embedding, Linear, RMSNorm, apply_linears, apply_rope,
                                    apply_swiglu_linears, rope_cos_sin,
                                    rope_inverse_frequencies)
from qerl_jax.parallel.mesh import constrain_attention_inputs
from qerl_jax.quant.linear_op import narrow_matmul

_MASKED = float(jnp.finfo(jnp.float32).min)  # finite, so all-masked (padding) rows stay finite


def _module_list(modules):
    return nnx.List(modules) if hasattr(nnx, "List") else list(modules)


def _attend(q, mask, *, keys, values, scale, compute_dtype):
    """softmax(q k^T * scale, masked) v: q [B, T, KVH, G, D], mask [B, T, S] bool, keys /
    values [B, S, KVH, D] -> [B, T, KVH, G, D] float32 (scores and softmax in float32, the
    probabilities rounded to compute_dtype for the second product)."""
    scores = jnp.einsum("btkgd,bskd->bkgts", q, keys.astype(q.dtype),
                        preferred_element_type=jnp.float32)
    scores = scores * scale
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bkgts,bskd->btkgd", probs.astype(compute_dtype),
                      values.astype(compute_dtype), preferred_element_type=jnp.float32)


def _attend_in_query_chunks(attend, q, mask, chunk: int):
    """attend(q, mask) over blocks of `chunk` queries (lax.map, each block under
    jax.checkpoint): the [B, heads, chunk, S] float32 scores of one block at a time, also in
    the backward, which recomputes each block's. Every query row's softmax is its own, so the
    result is the unchunked one's up to the dots' summation order. T is padded to a multiple
    of `chunk` with fully masked rows, dropped at the end."""
    batch, length = q.shape[:2]
    blocks = -(-length // chunk)
    pad = blocks * chunk - length
    if pad:
        q = jnp.pad(q, ((0, 0), (0, pad)) + ((0, 0),) * (q.ndim - 2))
        mask = jnp.pad(mask, ((0, 0), (0, pad), (0, 0)))
    q_blocks = jnp.moveaxis(q.reshape(batch, blocks, chunk, *q.shape[2:]), 1, 0)
    mask_blocks = jnp.moveaxis(mask.reshape(batch, blocks, chunk, mask.shape[-1]), 1, 0)
    out = jax.lax.map(lambda block: jax.checkpoint(attend)(*block), (q_blocks, mask_blocks))
    out = jnp.moveaxis(out, 0, 1).reshape(batch, blocks * chunk, *out.shape[3:])
    return out[:, :length]


def _attend_fused(q, mask, *, keys, values, scale, compute_dtype, implementation="cudnn",
                  mesh=None):
    """The causal full-sequence attention through jax.nn.dot_product_attention: q [B, T, KVH,
    G, D], mask [B, T, T] bool (causal & key padding, as CausalLM builds it), keys / values
    [B, T, KVH, D] -> [B, T, KVH, G, D] in compute_dtype.

    With implementation='cudnn' this is cuDNN's fused flash attention: the [T, T] scores and
    probabilities live only in on-chip tiles (float32 accumulation, the probabilities rounded
    to compute_dtype for the second product, as _attend does), and the backward keeps only the
    [B, heads, T] log-sum-exp. The mask enters as an additive compute_dtype bias [B, 1, T, T]
    (0 or a large negative number) on top of cuDNN's causal mask, which lets it skip the tiles
    above the diagonal. Query head h reads key/value head h // G, the grouping of _attend.

    Rows of real tokens equal _attend's up to rounding. A left-padding row (no real key at or
    before it) averages the values of the padding keys up to it instead of all T keys; those
    rows are masked out of every loss and no real row attends to them.
    ('xla' runs JAX's reference implementation of the same call: the CPU tests use it.)
    On a device `mesh` the inputs are first placed as cuDNN's partitioner requires
    (qerl_jax.parallel.mesh.constrain_attention_inputs).
    """
    batch, length, kv_heads, groups, head_dim = q.shape
    large_negative = jnp.asarray(-0.7 * float(jnp.finfo(compute_dtype).max), compute_dtype)
    bias = jnp.where(mask, jnp.asarray(0, compute_dtype), large_negative)[:, None]
    q, keys, values, bias = constrain_attention_inputs(
        q.reshape(batch, length, kv_heads * groups, head_dim).astype(compute_dtype),
        keys.astype(compute_dtype), values.astype(compute_dtype), bias, mesh)
    out = jax.nn.dot_product_attention(q, keys, values, bias=bias, scale=scale,
                                       is_causal=True, implementation=implementation)
    return out.reshape(batch, length, kv_heads, groups, head_dim)


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE (q/k/v biases for Qwen2, none for Llama)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.resolved_head_dim
        self.compute_dtype = config.jnp_compute_dtype
        self.query_chunk = config.attention_query_chunk
        self.implementation = config.attention_implementation
        self.mesh = None   # the device mesh of the fused attention's inputs (set_attention_mesh)
        hidden = config.hidden_size
        common = dict(param_dtype=config.jnp_param_dtype, compute_dtype=self.compute_dtype,
                      rngs=rngs)
        bias = config.attention_bias
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, use_bias=bias, **common)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, use_bias=bias, **common)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim, use_bias=bias, **common)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden,
                             use_bias=config.attention_bias and config.model_type == "llama",
                             **common)
        # [hidden, 3r]: the q/k/v adapters' A side by side, set only inside the sampler
        # (qerl_jax.models.decode_fusion.stack_grouped_adapters), so the decode loop does not re-stack them
        self.grouped_lora_a = nnx.data(None)

    def __call__(self, x, cos, sin, mask, cached_kv=None, cache_index=None):
        """x [B, T, H]; cos/sin [B, T, D]; mask [B, T, S] bool (True = may attend).

        Without a cache S == T. With `cached_kv` = (keys, values) each [B, S, kv_heads, D] (or
        (keys, values, key_scales, value_scales) of an 8-bit cache: codes and float32 scales
        [B, S, kv_heads], kv_cache.quantize_kv), the new keys/values are written at slots
        [cache_index, cache_index + T) and the updated tuple is returned; a mask over fewer
        slots than the cache's ([B, T, S'], S' < S: prefill into an empty cache) makes a
        multi-token step attend over the first S' slots only.
        Returns (out [B, T, H], new cached_kv or None).

        q/k/v go through one `apply_linears` call (one kernel launch where the quantized kernel
        can group them). A one-token step with a cache uses the decode-attention kernel
        registered for the platform (qerl_jax.models.attention_dispatch), which reads only the
        filled slots. Without a cache, attention_implementation 'cudnn' takes cuDNN's flash
        attention (_attend_fused); otherwise the einsums below attend over all S slots,
        masked.
        """
        batch, length, _ = x.shape
        q, k, v = apply_linears(x, (self.q_proj, self.k_proj, self.v_proj),
                                self.grouped_lora_a)
        q = q.reshape(batch, length, self.num_heads, self.head_dim)
        k = k.reshape(batch, length, self.num_kv_heads, self.head_dim)
        v = v.reshape(batch, length, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        new_kv, kv_scales = None, ()
        if cached_kv is not None:
            keys_cache, values_cache, *kv_scales = cached_kv
            start = (0, cache_index, 0, 0)
            if kv_scales:   # scaled 8-bit codes: one float32 scale per token and kv head
                (k, key_scale), (v, value_scale) = (quantize_kv(k, keys_cache.dtype),
                                                    quantize_kv(v, values_cache.dtype))
                kv_scales = [jax.lax.dynamic_update_slice(old, new, start[:3]) for old, new in
                             zip(kv_scales, (key_scale, value_scale))]
            keys = jax.lax.dynamic_update_slice(keys_cache, k.astype(keys_cache.dtype), start)
            values = jax.lax.dynamic_update_slice(values_cache, v.astype(values_cache.dtype),
                                                  start)
            new_kv = (keys, values, *kv_scales)
        else:
            keys, values = k, v
        groups = self.num_heads // self.num_kv_heads
        q = q.reshape(batch, length, self.num_kv_heads, groups, self.head_dim)
        kernel = (decode_attention_kernel(q[:, 0], keys)
                  if cached_kv is not None and length == 1 else None)
        if kernel is not None:
            # A decode step: the kernel reads only slots [0, cache_index] of the cache. With an
            # o-projection adapter, a kernel that can also returns each head's share of its
            # x @ A (one small launch fewer per layer); summed over the heads here.
            extra = {}
            if kernel.lora_x_a and self.o_proj.lora_a is not None:  # rounded to q's dtype there
                extra["lora_a"] = self.o_proj.lora_a.get_value()
            if kv_scales:
                extra["key_scales"], extra["value_scales"] = kv_scales
            result = kernel.fn(q[:, 0], keys, values, mask[:, 0, :], cache_index + 1,
                               scale=1.0 / math.sqrt(self.head_dim), **extra)
            out, lora_x_a = result if isinstance(result, tuple) else (result, None)
            out = out.astype(self.compute_dtype).reshape(batch, 1, self.num_heads * self.head_dim)
            if lora_x_a is not None:  # [B, KVH, G, r] float32 -> x @ A [B, 1, r], rounded once
                lora_x_a = lora_x_a.sum(axis=(1, 2)).astype(self.compute_dtype)[:, None, :]
            return self.o_proj(out, lora_x_a=lora_x_a), new_kv
        scale = 1.0 / math.sqrt(self.head_dim)
        if mask.shape[-1] < keys.shape[1]:
            # a mask over the cache's first slots only (prefill into an empty cache): the
            # slots past it hold nothing, so attention reads only these
            keys, values = keys[:, :mask.shape[-1]], values[:, :mask.shape[-1]]
            kv_scales = [scales[:, :mask.shape[-1]] for scales in kv_scales]
        if kv_scales:
            keys, values = (dequantize_kv(codes, scales, self.compute_dtype)
                            for codes, scales in zip((keys, values), kv_scales))
        attend = functools.partial(_attend, keys=keys, values=values, scale=scale,
                                   compute_dtype=self.compute_dtype)
        if self.implementation == "cudnn" and cached_kv is None:
            out = _attend_fused(q, mask, keys=keys, values=values, scale=scale,
                                compute_dtype=self.compute_dtype, implementation="cudnn",
                                mesh=self.mesh)
        elif self.query_chunk and length > self.query_chunk:
            out = _attend_in_query_chunks(attend, q, mask, self.query_chunk)
        else:
            out = attend(q, mask)
        out = out.astype(self.compute_dtype).reshape(batch, length, self.num_heads * self.head_dim)
        return self.o_proj(out), new_kv


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        common = dict(use_bias=config.mlp_bias, param_dtype=config.jnp_param_dtype,
                      compute_dtype=config.jnp_compute_dtype, rngs=rngs)
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(hidden, inner, **common)
        self.up_proj = Linear(hidden, inner, **common)
        self.down_proj = Linear(inner, hidden, **common)
        self.grouped_lora_a = nnx.data(None)  # [hidden, 2r], as Attention.grouped_lora_a
        # the fused SwiGLU launch's LoRA B of gate/up pair views, made once per rollout
        # (qerl_jax.models.decode_fusion.stack_grouped_adapters), or None
        self.pair_lora_b = nnx.data(None)

    def __call__(self, x):
        """With a down-projection adapter, the fused SwiGLU launch (decode) also returns
        swiglu @ A_down, so the down projection runs no x @ A product of its own
        (linear_swiglu.linear_swiglu's next_lora_a); elsewhere down_proj computes it."""
        if self.down_proj.lora_a is None:
            return self.down_proj(apply_swiglu_linears(x, self.gate_proj, self.up_proj,
                                                       self.grouped_lora_a, self.pair_lora_b))
        hidden, lora_x_a = apply_swiglu_linears(x, self.gate_proj, self.up_proj,
                                            self.grouped_lora_a, self.pair_lora_b,
                                            next_lora_a=self.down_proj.lora_a.get_value())
        return self.down_proj(hidden, lora_x_a=lora_x_a)


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        norm = dict(eps=config.rms_norm_eps, param_dtype=config.jnp_param_dtype,
                    compute_dtype=config.jnp_compute_dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, **norm)
        self.self_attn = Attention(config, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, **norm)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, x, cos, sin, mask, cached_kv=None, cache_index=None):
        attended, new_kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, cached_kv,
                                          cache_index)
        x = x + attended
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, new_kv


def _layer_forward(layer, x, cos, sin, mask, cached_kv, cache_index):
    return layer(x, cos, sin, mask, cached_kv, cache_index)


def _remat_layer_forward(layer, x, cos, sin, mask, cached_kv, cache_index):
    """The layer under jax.checkpoint (activations recomputed in the backward pass).

    A pure function of the layer's state, merged inside the checkpoint: nnx.remat would update
    the caller's Variables from the inner trace, which flax >= 0.12.10 rejects inside jit.
    """
    if cached_kv is not None:  # decoding: no gradients, nothing to save
        return layer(x, cos, sin, mask, cached_kv, cache_index)
    graphdef, state = nnx.split(layer)

    def run(state, x, cos, sin, mask):
        return nnx.merge(graphdef, state)(x, cos, sin, mask)[0]

    return jax.checkpoint(run)(state, x, cos, sin, mask), None


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
    """RoPE position ids of a left-padded batch: [B, T] mask -> [B, T] int32 (pads get 0)."""
    mask = attention_mask.astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)


def head_logits(hidden: jax.Array, weight: jax.Array) -> jax.Array:
    """hidden [..., H] @ weight [H, V] -> float32 logits [..., V] (inputs in the compute dtype,
    float32 accumulation).

    For a weight narrower than float32 (bf16) the backward pass stays in that dtype
    (qerl_jax.quant.linear_op.narrow_matmul, which the dense linear layers use too): the
    float32 logits cotangent is rounded to the weight's dtype before the two products (float32
    accumulation). Plain autodiff would multiply the float32
    cotangent by the bf16 head, and XLA converts the whole head to float32 first: a [H, V]
    float32 copy (2 GB for Qwen2.5-7B) that lives through the training program. A float32
    weight takes the plain dot and its autodiff (there is no copy to avoid).
    """
    if weight.dtype == jnp.float32:
        return jnp.dot(hidden, weight, preferred_element_type=jnp.float32)
    return narrow_matmul(hidden, weight)


class CausalLM(nnx.Module):
    """Decoder-only language model: embed -> N x DecoderLayer -> RMSNorm -> lm_head."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        dtypes = dict(param_dtype=config.jnp_param_dtype, compute_dtype=config.jnp_compute_dtype)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, rngs=rngs, **dtypes)
        self.layers = _module_list(DecoderLayer(config, rngs=rngs)
                                   for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, **dtypes)
        self.lm_head = None if config.tie_word_embeddings else Linear(
            config.hidden_size, config.vocab_size, use_bias=False, rngs=rngs, **dtypes)

    # ------------------------------------------------------------------ hidden states
    def hidden_states(self, tokens, positions, mask, cache: KVCache | None = None):
        """Runs the decoder stack; returns (final-normed hidden [B, T, H], new cache).

        tokens/positions [B, T]; mask [B, T, S] bool (S = T, the cache length, or the cache's
        first S slots that a prefill into an empty cache attends to).
        """
        x = self.embed_tokens(tokens)
        config = self.config
        inv_freq = rope_inverse_frequencies(config.resolved_head_dim, config.rope_theta,
                                            config.rope_scaling)
        cos, sin = rope_cos_sin(positions, inv_freq)
        forward = _remat_layer_forward if self.config.remat else _layer_forward
        new_layers = []
        for i, layer in enumerate(self.layers):
            cached_kv = None if cache is None else cache.layer(i)
            x, new_kv = forward(layer, x, cos, sin, mask, cached_kv,
                                None if cache is None else cache.index)
            new_layers.append(new_kv)
        x = self.norm(x)
        if cache is not None:
            cache = cache.with_layers(new_layers)
        return x, cache

    def logits_function(self):
        """A pure function hidden [..., H] -> float32 logits [..., vocab] over this model's head
        arrays (lm_head, or the tied embedding). Being a closure over arrays, not Variables, it
        can run inside lax.map / jax.checkpoint (the chunked log-probs of the trainer)."""
        if self.lm_head is None:  # tied: the embedding table [vocab, H], transposed
            weight = self.embed_tokens.embedding.get_value().T
            dtype = self.embed_tokens.compute_dtype
        else:
            weight = self.lm_head.weight.get_value()
            dtype = self.lm_head.compute_dtype

        def logits(hidden):
            return head_logits(hidden.astype(dtype), weight.astype(dtype))
        return logits

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., H] -> float32 logits [..., vocab]."""
        return self.logits_function()(hidden)

    def target_hidden(self, tokens, attention_mask, num_targets: int) -> jax.Array:
        """Final-normed hidden states [B, num_targets, H] of the positions that predict the last
        `num_targets` tokens (the completion), without the prompt positions' logits: the trainer
        applies the head to them in chunks (rl.losses.chunked_token_logprobs_and_entropy)."""
        attention_mask = attention_mask.astype(jnp.bool_)
        positions = positions_from_mask(attention_mask)
        length = tokens.shape[1]
        causal = jnp.tril(jnp.ones((length, length), jnp.bool_))
        mask = causal[None] & attention_mask[:, None, :]
        hidden, _ = self.hidden_states(tokens, positions, mask)
        return hidden[:, length - num_targets - 1:length - 1]

    def __call__(self, tokens, attention_mask=None, positions=None):
        """Full-sequence forward. tokens [B, T]; mask [B, T] (1 = real, left padding).

        Returns float32 logits [B, T, vocab]. Positions default to those of the mask.
        """
        if attention_mask is None:
            attention_mask = jnp.ones(tokens.shape, jnp.bool_)
        attention_mask = attention_mask.astype(jnp.bool_)
        if positions is None:
            positions = positions_from_mask(attention_mask)
        length = tokens.shape[1]
        causal = jnp.tril(jnp.ones((length, length), jnp.bool_))
        mask = causal[None] & attention_mask[:, None, :]
        hidden, _ = self.hidden_states(tokens, positions, mask)
        return self.logits(hidden)


# ------------------------------------------------------------------------------ cached modes
def _cached_mask(cache: KVCache, new_valid: jax.Array, length: int) -> tuple[jax.Array, jax.Array]:
    """(attention mask [B, T, S], updated valid [B, S]) for T new tokens at cache.index."""
    valid = jax.lax.dynamic_update_slice(cache.valid, new_valid.astype(jnp.bool_),
                                         (0, cache.index))
    slots = jnp.arange(cache.max_length)
    query_slots = cache.index + jnp.arange(length)
    causal = slots[None, :] <= query_slots[:, None]
    return causal[None] & valid[:, None, :], valid


def prefill(model: CausalLM, tokens: jax.Array, attention_mask: jax.Array,
            cache: KVCache, *, empty_cache: bool = False) -> tuple[jax.Array, KVCache]:
    """Writes a left-padded prompt batch into the cache in one pass.

    Args:
      tokens: [B, T] prompt ids, left-padded.
      attention_mask: [B, T], 1 for real tokens.
      cache: a cache with `index` at the first slot to write (0 for a fresh cache).
      empty_cache: the caller's promise that the cache is fresh (index 0, nothing valid, as
        init_kv_cache makes it): attention then reads only the prompt's T slots, not all S
        (the rest are masked anyway, but reading them costs a long prefill a large share of its
        time when S >> T). The index is traced, so this cannot be checked here.
    Returns:
      (float32 logits of each sequence's last prompt token [B, vocab], updated cache).
    """
    batch, length = tokens.shape
    if batch != cache.batch_size:
        raise ValueError(f"tokens batch {batch} != cache batch {cache.batch_size}")
    if length > cache.max_length:
        raise ValueError(f"prompt length {length} exceeds cache length {cache.max_length}")
    attention_mask = attention_mask.astype(jnp.bool_)
    positions = cache.next_position[:, None] + positions_from_mask(attention_mask)
    mask, valid = _cached_mask(cache, attention_mask, length)
    if empty_cache:
        mask = mask[..., :length]  # Attention reads the cache's first mask.shape[-1] slots
    hidden, cache = model.hidden_states(tokens, positions, mask, cache)
    logits = model.logits(hidden[:, -1])
    cache = cache.replace(valid=valid,
                          next_position=cache.next_position
                          + attention_mask.sum(axis=-1).astype(jnp.int32),
                          index=cache.index + length)
    return logits, cache


def decode_step(model: CausalLM, token: jax.Array, cache: KVCache,
                active: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
    """Appends one token per sequence at slot cache.index.

    Args:
      token: [B] ids.
      cache: the cache after prefill (and earlier steps).
      active: optional [B] bool; inactive (finished) sequences still run but their slot is
        marked invalid, so they never attend to it.
    Returns:
      (float32 logits [B, vocab] for the next token, updated cache).
    """
    new_valid = jnp.ones((token.shape[0], 1), jnp.bool_) if active is None else active[:, None]
    positions = cache.next_position[:, None]
    mask, valid = _cached_mask(cache, new_valid, 1)
    hidden, cache = model.hidden_states(token[:, None], positions, mask, cache)
    logits = model.logits(hidden[:, 0])
    cache = cache.replace(valid=valid, next_position=cache.next_position + 1,
                          index=cache.index + 1)
    return logits, cache


def set_attention_query_chunk(model: CausalLM, chunk: int) -> None:
    """Sets ModelConfig.attention_query_chunk of a built model, in place (its config and every
    Attention; for programs traced afterwards): the XLA attention of longer sequences then runs
    over blocks of `chunk` queries (0 = all at once)."""
    model.config = model.config.replace(attention_query_chunk=chunk)  # validates it
    for layer in model.layers:
        layer.self_attn.query_chunk = chunk


def cudnn_attention_problems(config: ModelConfig) -> list[str]:
    """Why cuDNN's fused attention cannot run this model here ([] when it can): JAX's default
    backend must be an NVIDIA GPU, compute_dtype bfloat16 or float16, head_dim a multiple of 8
    and at most 128."""
    backend, kind = jax.default_backend(), jax.devices()[0].device_kind
    problems = []
    if backend != "gpu" or "nvidia" not in kind.lower():
        problems.append(f"JAX's default backend is {backend!r} ({kind}), not an NVIDIA GPU")
    if config.compute_dtype not in ("bfloat16", "float16"):
        problems.append(f"compute_dtype={config.compute_dtype!r} (needs bfloat16 or float16)")
    head_dim = config.resolved_head_dim
    if head_dim % 8 or head_dim > 128:
        problems.append(f"head_dim={head_dim} (needs a multiple of 8, at most 128)")
    return problems


def set_attention_mesh(model: CausalLM, mesh) -> None:
    """The device mesh the model's programs run on (None or one device: nothing to place), in
    place on every Attention, for programs traced afterwards: cuDNN's fused attention then gets
    its inputs split the one way its partitioner accepts (rows over data x fsdp, heads over
    tensor)."""
    mesh = mesh if mesh is not None and mesh.size > 1 else None
    for layer in model.layers:
        layer.self_attn.mesh = mesh


def set_attention_implementation(model: CausalLM, implementation: str) -> str:
    """Sets ModelConfig.attention_implementation of a built model, in place (its config and
    every Attention; for programs traced afterwards); returns the implementation set.

    'auto' picks 'cudnn' where cuDNN's fused attention can run (cudnn_attention_problems is
    empty: an NVIDIA GPU, bf16/fp16 compute) and 'xla' elsewhere. An explicit 'cudnn' that
    cannot run raises here, when the model is built, not inside a traced program.
    """
    problems = (cudnn_attention_problems(model.config)
                if implementation in ("auto", "cudnn") else [])
    if implementation == "auto":
        implementation = "xla" if problems else "cudnn"
    elif implementation == "cudnn" and problems:
        raise ValueError("attention_implementation='cudnn' (cuDNN fused attention) cannot run "
                         "here: " + "; ".join(problems)
                         + ". Use attention_implementation='xla' or 'auto'.")
    model.config = model.config.replace(attention_implementation=implementation)  # validates
    for layer in model.layers:
        layer.self_attn.implementation = implementation
    return implementation


def init_model(config: ModelConfig, seed: int = 0) -> CausalLM:
    """A randomly initialized model (N(0, 0.02) weights, unit norms, zero biases)."""
    return CausalLM(config, rngs=nnx.Rngs(params=seed))


def abstract_model(config: ModelConfig) -> CausalLM:
    """The model with ShapeDtypeStruct leaves: shapes only, no memory (for loading/counting)."""
    return nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(params=0)))


def count_parameters(model: CausalLM) -> int:
    """Number of scalar parameters held by nnx.Param variables."""
    state = nnx.state(model, nnx.Param)
    return sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(state))
