"""RMSNorm and the next launch's LoRA x @ A in one Pallas (Triton) launch, for decode steps.

At a one-token decode step each pre-norm junction of a layer (before q|k|v, before gate|up)
took three small XLA kernels: the norm, a split-K x @ A product of the normed rows with the
grouped launch's stacked LoRA A matrices, and the reduction of its splits. This kernel does
the three in one launch:

    normed = (f32(x) * rsqrt(sum(f32(x)^2) * (1 / H) + eps) * f32(scale)).astype(x.dtype)
    x_a    = (normed @ lora_a, float32 sums of the exact products).astype(x.dtype)

x [M, H], scale [H], lora_a [H, R] (the compute dtype; R a multiple of block_r). Grid
(M / block_m, R / block_r): each program normalizes its block_m rows (every program of a row
block recomputes the row's sum of squares: H elements, cheap next to its [H, block_r] slice
of lora_a) and multiplies them by its columns of lora_a in chunks of block_h; the programs of
column block 0 also store the normed rows. The elementwise steps are the XLA path's
(qerl_jax.models.layers.RMSNorm: x * rsqrt(mean + eps), then * scale, rounded once); the sums
(of squares, of products) run in another order, so results may differ from XLA's in the last
float32 bit before rounding.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


@dataclasses.dataclass(frozen=True)
class RMSNormLoRAConfig:
    """block_m: rows per program; block_r: LoRA columns per program; block_h: hidden elements
    per loop step (powers of two); Triton num_warps / num_stages."""
    block_m: int = 1
    block_r: int = 16
    block_h: int = 512
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_m", "block_r", "block_h"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"RMSNormLoRAConfig.{name}={value}: a power of two")


def refusal(x_shape, lora_a_shape, config: RMSNormLoRAConfig = RMSNormLoRAConfig()
            ) -> str | None:
    """Why the kernel does not take these shapes (None: it does)."""
    if len(x_shape) != 2 or len(lora_a_shape) != 2 or lora_a_shape[0] != x_shape[1]:
        return f"x {tuple(x_shape)}, lora_a {tuple(lora_a_shape)}: expected [M, H] and [H, R]"
    if lora_a_shape[1] % config.block_r:
        return f"LoRA width {lora_a_shape[1]} is not a multiple of block_r={config.block_r}"
    return None


def _kernel(x_ref, scale_ref, a_ref, normed_ref, xa_ref, *, hidden: int, eps: float,
            block_m: int, block_r: int, block_h: int, rows: int):
    i, j = pl.program_id(0), pl.program_id(1)
    row = i * block_m + lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
    row_ok = row < rows
    row_ids = pl.ds(i * block_m, block_m)
    chunks = -(-hidden // block_h)

    def columns(c):   # (the chunk's slice, [block_h] mask of its columns inside H)
        col = c * block_h + lax.broadcasted_iota(jnp.int32, (block_h,), 0)
        return pl.ds(c * block_h, block_h), col < hidden

    def load_x(c):
        cols, col_ok = columns(c)
        return plgpu.load(x_ref.at[row_ids, cols], mask=row_ok & col_ok[None, :],
                          other=0.0).astype(jnp.float32)

    def squares(c, total):
        x = load_x(c)
        return total + jnp.sum(x * x, axis=1, keepdims=True)

    total = lax.fori_loop(0, chunks, squares, jnp.zeros((block_m, 1), jnp.float32))
    inverse = lax.rsqrt(total * (1.0 / hidden) + eps)    # [block_m, 1]

    def product(c, acc):
        cols, col_ok = columns(c)
        scale = plgpu.load(scale_ref.at[cols], mask=col_ok, other=0.0).astype(jnp.float32)
        normed = ((load_x(c) * inverse) * scale[None, :]).astype(normed_ref.dtype)

        @pl.when(j == 0)
        def _():
            plgpu.store(normed_ref.at[row_ids, cols], normed, mask=row_ok & col_ok[None, :])

        a = plgpu.load(a_ref.at[cols, pl.ds(j * block_r, block_r)], mask=col_ok[:, None],
                       other=0.0).astype(jnp.float32)             # [block_h, block_r]
        if block_m >= 16:   # tensor cores: bf16 products are exact, float32 sums
            return acc + lax.dot_general(normed, a.astype(normed.dtype),
                                         (((1,), (0,)), ((), ())),
                                         preferred_element_type=jnp.float32)
        products = normed.astype(jnp.float32)[:, :, None] * a[None, :, :]
        return acc + jnp.sum(products, axis=1)

    acc = lax.fori_loop(0, chunks, product, jnp.zeros((block_m, block_r), jnp.float32))
    plgpu.store(xa_ref.at[row_ids, pl.ds(j * block_r, block_r)], acc.astype(xa_ref.dtype),
                mask=row_ok)


def rmsnorm_lora(x: jax.Array, scale: jax.Array, lora_a: jax.Array, *, eps: float,
                 config: RMSNormLoRAConfig | None = None, interpret: bool = False):
    """(normed [M, H], x_a [M, R]) in x's dtype (module docstring). x [M, H]; scale [H];
    lora_a [H, R], R a multiple of config.block_r (read in x's dtype)."""
    config = config or RMSNormLoRAConfig()
    reason = refusal(x.shape, lora_a.shape, config)
    if reason is not None:
        raise ValueError(f"rmsnorm_lora: {reason}")
    if scale.shape != (x.shape[1],):
        raise ValueError(f"rmsnorm_lora: scale {scale.shape}; expected [{x.shape[1]}]")
    return _rmsnorm_lora(x, scale, lora_a.astype(x.dtype), eps=float(eps), config=config,
                         interpret=interpret)


@functools.partial(jax.jit, static_argnames=("eps", "config", "interpret"))
def _rmsnorm_lora(x, scale, lora_a, *, eps, config, interpret):
    rows, hidden = x.shape
    width = lora_a.shape[1]
    kernel = functools.partial(_kernel, hidden=hidden, eps=eps, block_m=config.block_m,
                               block_r=config.block_r, block_h=config.block_h, rows=rows)
    params = None if interpret else plgpu.CompilerParams(num_warps=config.num_warps,
                                                         num_stages=config.num_stages)
    return pl.pallas_call(
        kernel, out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype),
                           jax.ShapeDtypeStruct((rows, width), x.dtype)),
        grid=(-(-rows // config.block_m), width // config.block_r), interpret=interpret,
        compiler_params=params, name="rmsnorm_lora")(x, scale, lora_a)


def rmsnorm_lora_reference(x, scale, lora_a, *, eps: float):
    """The XLA path's (normed, x_a): RMSNorm as qerl_jax.models.layers.RMSNorm, then the
    product in float32 (HIGHEST) rounded once."""
    x32 = x.astype(jnp.float32)
    inverse = lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    normed = (x32 * inverse * scale.astype(jnp.float32)).astype(x.dtype)
    x_a = jnp.dot(normed.astype(jnp.float32), lora_a.astype(x.dtype).astype(jnp.float32),
                  precision=lax.Precision.HIGHEST)
    return normed, x_a.astype(x.dtype)
