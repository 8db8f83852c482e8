"""One-token (decode) grouped-query attention over a static KV cache, reading only its used part.

The XLA path of qerl_jax.models.transformer.Attention attends over every slot of the
preallocated cache (masked), so a decode step reads the whole cache whatever the length so far:
at Qwen2.5-7B, batch 8 and a 2304-slot cache that is 1.06 GB per step. This kernel reads slots
[0, length) only (length = the cache index after the new token), with FlashAttention's online
softmax, split over the sequence ("flash decoding") so that batch x kv heads x splits programs
fill the GPU; a second small kernel combines the splits' partial results in float32 (one launch
where XLA needed four or five small kernels) and writes q's dtype.

Balanced splits (the default): the used slots [0, length) are divided evenly among the splits
at run time, ceil(ceil(length / block_s) / splits) blocks each, so that early in a rollout every
split reads a few blocks instead of the first ones reading all of them (the program's longest
loop sets the kernel's time). `DecodeAttentionConfig(balanced=0)` gives each split a fixed
range of the cache, ceil(S / block_s / splits) blocks (for comparisons).

    out = decode_attention(q, keys, values, mask, length, scale=1 / sqrt(D))

Shapes: q [B, KVH, G, D] (G = query heads per kv head), keys / values [B, S, KVH, D] (the cache
layout; or an 8-bit cache's codes with key_scales / value_scales [B, S, KVH]), mask [B, S] bool
(True = may attend; slots >= length are never read), length int32
scalar. Returns [B, KVH, G, D] in q's dtype = softmax(q k^T * scale, masked) v per (b, kv
head), computed in float32 and rounded once.

Numerics: scores and the softmax in float32, the probabilities rounded to the inputs' dtype for
the p @ v product (float32 accumulation), as the XLA path does. A row whose newest slot
(length - 1) is masked is a finished sequence (decode_step marks a finished row's slot invalid):
it reads none of its cache and gets zeros, so the cache bytes a step reads shrink as the rows of
a rollout end. A row whose visited slots are all masked otherwise gets the mean of their values
(the XLA path, which masks with a finite minimum, gives the mean over all S slots). The outputs
of both kinds of row are unused.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_MASKED = -1e30  # finite: an all-masked block gives exp(0) = 1, never NaN
_WAVES = 2  # programs per launch: about this many waves of the device's SMs
_INTERPRET_SMS = 132  # SM count assumed off the GPU (interpret mode), a Hopper GPU's


@dataclasses.dataclass(frozen=True)
class DecodeAttentionConfig:
    """block_s: cache slots per loop step; splits: sequence splits (None: enough for about 2
    waves of the device's SMs); balanced: 1 = split the used slots evenly at run time, 0 = fixed ranges of the
    cache; Triton num_warps / num_stages."""
    block_s: int = 64
    splits: int | None = None
    balanced: int = 1
    num_warps: int = 4
    num_stages: int = 3  # faster per call than 2 at 7B and 32B (RESULTS.md)

    def __post_init__(self):
        if self.block_s < 16 or self.block_s & (self.block_s - 1):
            raise ValueError(f"DecodeAttentionConfig.block_s={self.block_s}: a power of two "
                             ">= 16")
        if self.splits is not None and self.splits < 1:
            raise ValueError(f"DecodeAttentionConfig.splits={self.splits}: None or >= 1")
        if self.balanced not in (0, 1):
            raise ValueError(f"DecodeAttentionConfig.balanced={self.balanced}: 0 or 1")


def parse_config(text: str) -> dict:
    """'splits=1,block_s=128' -> DecodeAttentionConfig fields (benchmark command lines);
    names and values are checked ('splits=none' = automatic)."""
    names = {f.name for f in dataclasses.fields(DecodeAttentionConfig)}
    fields = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        if name not in names or not value:
            raise ValueError(f"decode attention setting {item!r}: expected name=value with name "
                             f"in {sorted(names)}")
        fields[name] = None if name == "splits" and value.lower() == "none" else int(value)
    return fields


def _next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _cdiv_traced(a, b: int):
    """ceil(a / b) for a traced integer a."""
    return (a + (b - 1)) // b


def sm_count(device=None) -> int:
    """The streaming multiprocessors of `device` (default jax.devices()[0]) where it reports
    them (a GPU's core_count), else a Hopper GPU's count (interpret mode on the CPU)."""
    device = device or jax.devices()[0]
    count = getattr(device, "core_count", None) if device.platform == "gpu" else None
    return int(count) if count else _INTERPRET_SMS


def default_splits(batch: int, kv_heads: int, slots: int, block_s: int,
                   sms: int | None = None) -> int:
    """Sequence splits so that batch x kv_heads x splits is about 2 waves of `sms` programs
    (default: the device's SM count; at most one split per block of slots)."""
    target = _WAVES * (sm_count() if sms is None else sms)
    return max(1, min(_cdiv(slots, block_s), _cdiv(target, batch * kv_heads)))


def _kernel(length_ref, q_ref, keys_ref, values_ref, mask_ref, key_scales_ref,
            value_scales_ref, o_ref, m_ref, l_ref, *, groups: int, groups_pad: int, slots: int,
            block_s: int, splits: int, blocks_per_split: int, balanced: bool, scale: float):
    """One (batch row, kv head, split): online softmax over the split's blocks of slots.
    Writes the unnormalized float32 acc [G, D] and the row max m / sum l [G] of the split (or,
    with one split, the normalized output). With scale refs (an 8-bit cache) each slot's key
    scale multiplies its scores and its value scale the probabilities before p @ v."""
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = lax.broadcasted_iota(jnp.int32, (groups_pad, 1), 0) < groups
    q = plgpu.load(q_ref.at[b, h, pl.ds(0, groups_pad), :], mask=rows, other=0.0)
    visible = jnp.minimum(length_ref[0], slots)
    # Blocks per split: the used ones shared evenly (<= blocks_per_split, as visible <= slots),
    # or a fixed range of the cache.
    per_split = (_cdiv_traced(_cdiv_traced(visible, block_s), splits) if balanced
                 else blocks_per_split)
    begin = split * per_split * block_s
    trips = jnp.clip(_cdiv_traced(visible - begin, block_s), 0, per_split)
    # a row whose newest slot is masked is a finished sequence (decode_step marks its slot
    # invalid): it reads none of its cache
    newest = plgpu.load(mask_ref.at[b, pl.ds(visible - 1, 1)])
    trips = jnp.where(jnp.max(newest) != 0, trips, 0)
    head_dim = q.shape[-1]

    def body(t, carry):
        m, l, acc = carry
        s0 = begin + t * block_s
        slot = s0 + lax.broadcasted_iota(jnp.int32, (block_s,), 0)
        in_range = slot < visible  # visible <= slots: never past the cache either
        k = plgpu.load(keys_ref.at[b, pl.ds(s0, block_s), h, :], mask=in_range[:, None],
                       other=0.0)
        v = plgpu.load(values_ref.at[b, pl.ds(s0, block_s), h, :], mask=in_range[:, None],
                       other=0.0)
        allowed = plgpu.load(mask_ref.at[b, pl.ds(s0, block_s)], mask=in_range, other=0)
        keep = allowed != 0
        if key_scales_ref is not None:   # 8-bit codes: to q's dtype (exact), scales after
            k, v = k.astype(q.dtype), v.astype(q.dtype)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * scale
        if key_scales_ref is not None:
            s = s * plgpu.load(key_scales_ref.at[b, pl.ds(s0, block_s), h], mask=in_range,
                               other=0.0)[None, :]
        s = jnp.where(keep[None, :], s, _MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        weights = p
        if value_scales_ref is not None:
            weights = p * plgpu.load(value_scales_ref.at[b, pl.ds(s0, block_s), h],
                                     mask=in_range, other=0.0)[None, :]
        acc = acc * alpha[:, None] + lax.dot_general(
            weights.astype(v.dtype), v, (((1,), (0,)), ((), ())),
            preferred_element_type=jnp.float32)
        return m_new, l, acc

    init = (jnp.full((groups_pad,), _MASKED, jnp.float32), jnp.zeros((groups_pad,), jnp.float32),
            jnp.zeros((groups_pad, head_dim), jnp.float32))
    m, l, acc = lax.fori_loop(0, trips, body, init)
    if m_ref is None:  # one split: normalize here and write q's dtype (no combine kernel)
        l = jnp.where(l > 0, l, 1.0)  # padding rows: never stored, no 0/0
        plgpu.store(o_ref.at[b, h, pl.ds(0, groups_pad), :],
                    (acc / l[:, None]).astype(o_ref.dtype), mask=rows)
        return
    # Partials [B, KVH, G, splits, (D)]: one query head's splits are contiguous for the combine.
    plgpu.store(o_ref.at[b, h, pl.ds(0, groups_pad), split, :], acc, mask=rows)
    row_mask = lax.broadcasted_iota(jnp.int32, (groups_pad,), 0) < groups
    plgpu.store(m_ref.at[b, h, pl.ds(0, groups_pad), split], m, mask=row_mask)
    plgpu.store(l_ref.at[b, h, pl.ds(0, groups_pad), split], l, mask=row_mask)


def _combine_kernel(o_ref, m_ref, l_ref, *refs, splits: int, splits_pad: int,
                    groups: int = 1, with_down: bool = False):
    """out = sum_s w_s o_s / sum_s w_s l_s, w_s = exp(m_s - max_s m_s), for one query head
    (b, kv head, g): all its splits in one load (no loop of dependent loads).

    with_down: refs = (lora_a [KVH * G * D, r], out, down); also down[b, h, g, :] = the rounded
    out row @ lora_a's rows of this query head (float32 sum of exact products): the head's
    share of the o-projection's LoRA x @ A."""
    lora_a_ref, out_ref, down_ref = refs if with_down else (None, refs[0], None)
    b, h, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    valid = lax.broadcasted_iota(jnp.int32, (splits_pad,), 0) < splits
    m = plgpu.load(m_ref.at[b, h, g, pl.ds(0, splits_pad)], mask=valid, other=_MASKED)
    l = plgpu.load(l_ref.at[b, h, g, pl.ds(0, splits_pad)], mask=valid, other=0.0)
    o = plgpu.load(o_ref.at[b, h, g, pl.ds(0, splits_pad), :], mask=valid[:, None], other=0.0)
    weight = jnp.exp(m - jnp.max(m))
    total = jnp.sum(weight * l)
    total = jnp.where(total > 0, total, 1.0)  # no 0/0 (a row that read no slot)
    out = (jnp.sum(o * weight[:, None], axis=0) / total).astype(out_ref.dtype)
    plgpu.store(out_ref.at[b, h, g, :], out)
    if with_down:
        head_dim = out.shape[0]
        rows = pl.ds(pl.multiple_of((h * groups + g) * head_dim, head_dim), head_dim)
        a = lora_a_ref[rows, :].astype(jnp.float32)
        down = jnp.sum(out.astype(jnp.float32)[:, None] * a, axis=0)
        plgpu.store(down_ref.at[b, h, g, :], down)


def decode_attention(q: jax.Array, keys: jax.Array, values: jax.Array, mask: jax.Array,
                     length: jax.Array, *, scale: float,
                     config: DecodeAttentionConfig | None = None,
                     interpret: bool = False, lora_a: jax.Array | None = None,
                     key_scales: jax.Array | None = None,
                     value_scales: jax.Array | None = None):
    """See the module docstring. Returns [B, KVH, G, D] in q's dtype. config None:
    DecodeAttentionConfig().

    lora_a [KVH * G * D, r] (the o-projection's LoRA A, rows in the order of the flattened
    output): returns (out, down) instead, down [B, KVH, G, r] float32 = each query head's
    output row (as returned, in q's dtype) times that head's D rows of lora_a, so that
    down.sum((1, 2)) is out.reshape(B, -1) @ lora_a up to the order of the float32 sums. The
    combine kernel computes it (no x @ A launch of its own); with one split (no combine) an
    XLA product does.

    key_scales / value_scales [B, S, KVH] float32: keys and values are an 8-bit cache's codes
    (qerl_jax.models.kv_cache.quantize_kv), slot s of head h standing for codes * scale."""
    config = config or DecodeAttentionConfig()
    batch, kv_heads, groups, head_dim = q.shape
    if lora_a is not None and (lora_a.ndim != 2 or
                               lora_a.shape[0] != kv_heads * groups * head_dim):
        raise ValueError(f"decode_attention: lora_a {lora_a.shape} must be [KVH * G * D = "
                         f"{kv_heads * groups * head_dim}, r] for q {q.shape}")
    if keys.shape != values.shape or keys.ndim != 4 or keys.shape[0] != batch or \
            keys.shape[2] != kv_heads or keys.shape[3] != head_dim:
        raise ValueError(f"decode_attention: keys {keys.shape} / values {values.shape} must be "
                         f"[B={batch}, S, KVH={kv_heads}, D={head_dim}] for q {q.shape}")
    slots = keys.shape[1]
    if (key_scales is None) != (value_scales is None) or (key_scales is not None and any(
            scales.shape != keys.shape[:3] or scales.dtype != jnp.float32
            for scales in (key_scales, value_scales))):
        raise ValueError(f"decode_attention: key_scales and value_scales must both be float32 "
                         f"{keys.shape[:3]} or both None")
    if mask.shape != (batch, slots):
        raise ValueError(f"decode_attention: mask {mask.shape} must be [B={batch}, S={slots}]")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"decode_attention: head_dim {head_dim} must be a power of two >= 16")
    block_s = config.block_s
    if block_s < 16 or block_s & (block_s - 1):
        raise ValueError(f"decode_attention: block_s {block_s} must be a power of two >= 16")
    splits = config.splits or default_splits(batch, kv_heads, slots, block_s)
    blocks_per_split = _cdiv(_cdiv(slots, block_s), splits)
    splits = _cdiv(_cdiv(slots, block_s), blocks_per_split)  # no split without a block
    return _decode_attention(q, keys, values, mask, jnp.asarray(length, jnp.int32).reshape(1),
                             scale=float(scale), block_s=block_s, splits=splits,
                             blocks_per_split=blocks_per_split,
                             balanced=bool(config.balanced), num_warps=config.num_warps,
                             num_stages=config.num_stages, interpret=interpret, lora_a=lora_a,
                             key_scales=key_scales, value_scales=value_scales)


@functools.partial(jax.jit, static_argnames=("scale", "block_s", "splits", "blocks_per_split",
                                             "balanced", "num_warps", "num_stages", "interpret"))
def _decode_attention(q, keys, values, mask, length, *, scale, block_s, splits,
                      blocks_per_split, balanced, num_warps, num_stages, interpret, lora_a,
                      key_scales=None, value_scales=None):
    batch, kv_heads, groups, head_dim = q.shape
    groups_pad = max(16, _next_pow2(groups))
    kernel = functools.partial(_kernel, groups=groups, groups_pad=groups_pad,
                               slots=keys.shape[1], block_s=block_s, splits=splits,
                               blocks_per_split=blocks_per_split, balanced=balanced,
                               scale=scale)
    scaled = key_scales is not None
    operands = (length, q, keys, values, mask.astype(jnp.int32),
                *((key_scales, value_scales) if scaled else ()))

    def with_scale_refs(*refs):   # the scale refs, or None in their places
        inputs = 7 if scaled else 5
        scale_refs = refs[5:7] if scaled else (None, None)
        return (*refs[:5], *scale_refs, *refs[inputs:])

    params = None if interpret else plgpu.CompilerParams(num_warps=num_warps,
                                                         num_stages=num_stages)
    if splits == 1:
        def single(*refs):
            kernel(*with_scale_refs(*refs), None, None)

        out = pl.pallas_call(single, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
                             grid=(batch, kv_heads, 1), interpret=interpret,
                             compiler_params=params, name="decode_attention_single")(*operands)
        return out if lora_a is None else (out, _heads_times_lora_a(out, lora_a))
    partial_shape = (batch, kv_heads, groups, splits)
    out_shape = (jax.ShapeDtypeStruct((*partial_shape, head_dim), jnp.float32),
                 jax.ShapeDtypeStruct(partial_shape, jnp.float32),
                 jax.ShapeDtypeStruct(partial_shape, jnp.float32))
    o, m, l = pl.pallas_call(lambda *refs: kernel(*with_scale_refs(*refs)),
                             out_shape=out_shape, grid=(batch, kv_heads, splits),
                             interpret=interpret, compiler_params=params,
                             name="decode_attention")(*operands)
    rank = None if lora_a is None else lora_a.shape[1]
    with_down = rank is not None and rank & (rank - 1) == 0  # Triton: power-of-two tiles
    combine = functools.partial(_combine_kernel, splits=splits, splits_pad=_next_pow2(splits),
                                groups=groups, with_down=with_down)
    out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    if with_down:
        out_shape = (out_shape, jax.ShapeDtypeStruct((batch, kv_heads, groups,
                                                      lora_a.shape[1]), jnp.float32))
    result = pl.pallas_call(combine, out_shape=out_shape,
                            grid=(batch, kv_heads, groups), interpret=interpret,
                            compiler_params=None if interpret else plgpu.CompilerParams(
                                num_warps=2, num_stages=1),
                            name="decode_attention_combine" + ("_lora" if with_down else ""))(
        o, m, l, *((lora_a.astype(q.dtype),) if with_down else ()))
    if lora_a is not None and not with_down:
        return result, _heads_times_lora_a(result, lora_a)
    return result


def _heads_times_lora_a(out, lora_a):
    """[B, KVH, G, D] x lora_a [KVH * G * D, r] -> per-head products [B, KVH, G, r] float32
    (XLA; lora_a rounded to out's dtype, then both in float32, where the products are exact)."""
    batch, kv_heads, groups, head_dim = out.shape
    a = lora_a.reshape(kv_heads, groups, head_dim, -1).astype(out.dtype)
    return jnp.einsum("bkgd,kgdr->bkgr", out.astype(jnp.float32), a.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def decode_attention_reference(q, keys, values, mask, *, scale: float) -> jax.Array:
    """Plain jnp (float32) reference over all S slots: [B, KVH, G, D]."""
    scores = jnp.einsum("bkgd,bskd->bkgs", q.astype(jnp.float32), keys.astype(jnp.float32))
    scores = jnp.where(mask[:, None, None, :], scores * scale, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bkgs,bskd->bkgd", probs, values.astype(jnp.float32))
