"""RMSNorm and the LoRA x @ A of the layers that read its output, in one launch (decode M).

At a decode step a pre-norm block runs RMSNorm (one kernel), then the LoRA down product of
the projections that read the normed x (q|k|v, or gate|up: one x @ [A_0 | A_1 | ...]), which
XLA runs as a split-K gemm and a reduction: three small launches of ~2 us each at Qwen2.5-32B
(benchmarks/RESULTS.md, session 15's decode profile). Here the rows' sums of squares are an XLA
reduction (which XLA can fuse into the residual add that produced x), and one launch of C =
ceil(H / chunk) programs does the rest: program c normalizes its chunk of columns, stores it,
and multiplies it by A's rows of that chunk. The float32 products, one share per chunk, sum to
normed @ A; `rmsnorm_lora_down` sums them (one small XLA reduction). A first version had every
program read the whole rows for their mean squares (5 dependent loads at 32B): 7.3-7.8 us per
call in the 32B decode step, slower than the three kernels it replaced (H100, session 18).

    normed, down = rmsnorm_lora_down(x, scale, lora_a, eps=1e-6)

Shapes: x [M, H] (any float dtype; the residual stream), scale [H] (the norm's weight, e.g.
AQN's noisy float32 scale), lora_a [H, R]. Returns normed [M, H] in `out_dtype` (bf16) and
down [M, R] in out_dtype.

Numerics, as qerl_jax.models.layers.RMSNorm followed by an XLA dot in the compute dtype:
  normed = (x32 * rsqrt(sum(x32^2) / H + eps) * scale32) rounded to out_dtype   (QeRL sec. 3.3:
           the scale is the tensor AQN perturbs);
  down   = normed @ A (A rounded to out_dtype), float32 accumulation, rounded once.
Only the summation orders differ (the mean square's and the product's), so normed can differ
from the XLA norm by one ulp where a value sits on a rounding boundary.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MAX_ROWS = 64  # decode M: one block of rows per program


@dataclasses.dataclass(frozen=True)
class RMSNormLoRAConfig:
    """chunk: columns per program (a power of two >= 16); Triton num_warps / num_stages."""
    chunk: int = 128
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        if self.chunk < 16 or self.chunk & (self.chunk - 1):
            raise ValueError(f"RMSNormLoRAConfig.chunk={self.chunk}: a power of two >= 16")
        if self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"RMSNormLoRAConfig {self}: num_warps and num_stages must be >= 1")


def _next_pow2(v: int) -> int:
    return 1 << max(0, int(v) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _kernel(x_ref, square_sum_ref, scale_ref, a_ref, normed_ref, shares_ref, *, m: int,
            h: int, r: int, bm: int, chunk: int, rank_pad: int, eps: float):
    """Program c: columns [c * chunk, + chunk) normalized with the rows' sums of squares
    (stored) and times A's rows of them (float32 share [M, R] to shares[c]). Every load is
    independent of the others, so the program waits for memory once."""
    c = pl.program_id(0)
    rows = lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
    row_ok = rows < m
    c0 = c * chunk
    cols = c0 + lax.broadcasted_iota(jnp.int32, (1, chunk), 1)
    col_ok = cols < h
    ranks = lax.broadcasted_iota(jnp.int32, (1, rank_pad), 1)
    x = plgpu.load(x_ref.at[pl.ds(0, bm), pl.ds(c0, chunk)], mask=row_ok & col_ok,
                   other=0.0).astype(jnp.float32)
    total = plgpu.load(square_sum_ref.at[pl.ds(0, bm)], mask=row_ok[:, 0], other=0.0)
    scale = plgpu.load(scale_ref.at[pl.ds(c0, chunk)], mask=col_ok[0],
                       other=0.0).astype(jnp.float32)
    a = plgpu.load(a_ref.at[pl.ds(c0, chunk), pl.ds(0, rank_pad)],
                   mask=col_ok.reshape(chunk, 1) & (ranks < r), other=0.0)
    inv_rms = lax.rsqrt(total / h + eps)
    normed = (x * inv_rms[:, None] * scale[None, :]).astype(normed_ref.dtype)
    plgpu.store(normed_ref.at[pl.ds(0, bm), pl.ds(c0, chunk)], normed, mask=row_ok & col_ok)
    share = lax.dot_general(normed, a.astype(normed.dtype), (((1,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32)
    plgpu.store(shares_ref.at[c, pl.ds(0, bm), pl.ds(0, rank_pad)], share,
                mask=row_ok & (ranks < r))


def check_inputs(x: jax.Array, scale: jax.Array, lora_a: jax.Array) -> None:
    """Raises ValueError naming the shape that rmsnorm_lora_down cannot take."""
    if x.ndim != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"rmsnorm_lora_down: x {tuple(x.shape)} must be [M <= {MAX_ROWS}, H]")
    h = x.shape[1]
    if scale.shape != (h,):
        raise ValueError(f"rmsnorm_lora_down: scale {tuple(scale.shape)} must be [H = {h}]")
    if lora_a.ndim != 2 or lora_a.shape[0] != h or lora_a.shape[1] < 1:
        raise ValueError(f"rmsnorm_lora_down: lora_a {tuple(lora_a.shape)} must be [H = {h}, R]")


def rmsnorm_lora_down(x: jax.Array, scale: jax.Array, lora_a: jax.Array, *, eps: float,
                      out_dtype=jnp.bfloat16, config: RMSNormLoRAConfig | None = None,
                      interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """(RMSNorm(x) [M, H], RMSNorm(x) @ lora_a [M, R]), both in out_dtype, from one Pallas
    launch and one XLA sum of its per-chunk shares (module docstring). Differentiable: the
    backward is that of the jnp reference (rmsnorm_lora_down_reference)."""
    check_inputs(x, scale, lora_a)
    return _rmsnorm_lora_down(x, scale, lora_a, float(eps), jnp.dtype(out_dtype),
                              config or RMSNormLoRAConfig(), bool(interpret))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _rmsnorm_lora_down(x, scale, lora_a, eps, out_dtype, config, interpret):
    m, h = x.shape
    r = lora_a.shape[1]
    bm = max(16, _next_pow2(m))
    chunk = min(config.chunk, max(16, _next_pow2(h)))
    programs = _cdiv(h, chunk)
    # the rows' sums of squares in XLA: a reduction it can fuse into the fusion that made x (the
    # residual add), so that the kernel's programs need not each read the whole rows
    x32 = x.astype(jnp.float32)
    square_sum = jnp.sum(x32 * x32, axis=1)
    kernel = functools.partial(_kernel, m=m, h=h, r=r, bm=bm, chunk=chunk,
                               rank_pad=max(16, _next_pow2(r)), eps=eps)
    params = None if interpret else plgpu.CompilerParams(num_warps=config.num_warps,
                                                         num_stages=config.num_stages)
    normed, shares = pl.pallas_call(
        kernel, grid=(programs,), interpret=interpret, compiler_params=params,
        out_shape=(jax.ShapeDtypeStruct((m, h), out_dtype),
                   jax.ShapeDtypeStruct((programs, m, r), jnp.float32)),
        name="rmsnorm_lora_down")(x, square_sum, scale, lora_a.astype(out_dtype))
    return normed, shares.sum(axis=0).astype(out_dtype)


def _fwd(x, scale, lora_a, eps, out_dtype, config, interpret):
    return (_rmsnorm_lora_down(x, scale, lora_a, eps, out_dtype, config, interpret),
            (x, scale, lora_a))


def _bwd(eps, out_dtype, config, interpret, residuals, cotangents):
    _, pullback = jax.vjp(functools.partial(rmsnorm_lora_down_reference, eps=eps,
                                            out_dtype=out_dtype), *residuals)
    return pullback(cotangents)


_rmsnorm_lora_down.defvjp(_fwd, _bwd)


def rmsnorm_lora_down_reference(x: jax.Array, scale: jax.Array, lora_a: jax.Array, *,
                                eps: float, out_dtype=jnp.bfloat16
                                ) -> tuple[jax.Array, jax.Array]:
    """The same two results in plain jnp: RMSNorm as qerl_jax.models.layers.RMSNorm computes
    it, then normed @ A in out_dtype with float32 accumulation."""
    x32 = x.astype(jnp.float32)
    normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    normed = (normed * scale.astype(jnp.float32)).astype(out_dtype)
    down = jnp.dot(normed, lora_a.astype(out_dtype), preferred_element_type=jnp.float32)
    return normed, down.astype(out_dtype)
