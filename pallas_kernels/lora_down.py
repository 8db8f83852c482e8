"""The LoRA down product x @ A at decode M as float32 partial sums over slices of K (Pallas,
Triton backend): no reduction kernel; the fused 4-bit kernels add the partials up in their
epilogue (pallas_kernels.blockwise_matmul, `lora_down` of shape [S, M, r]).

XLA runs x [M <= 16, K] @ A [K, r] at decode as a split-K gemm (32-64 slices of K) plus a
reduction kernel: at Qwen2.5-7B, 4 products per layer cost ~16.6 us per layer, 6.2 of them in
the reductions (benchmarks/RESULTS.md, session 10). Here one launch writes the partials:

    partials[s] = x[:, K_s] @ A[K_s, :]      (float32, s = 0 .. S-1)
    sum_s partials[s] = x @ A

K_s = K blocks [s * blocks_per_split, (s + 1) * blocks_per_split) of block_k columns (the last
split may be shorter; S = ceil(K blocks / blocks_per_split), so no split is empty). Grid:
(M tiles of 16 rows, r tiles of block_r columns, S); each program loops over its K blocks with
a float32 accumulator (bf16 operands, as the XLA dot). Rows past M, columns past r and K past
its end are masked.

The sum's order (S partials, then the dot's own order inside each) differs from XLA's, so the
result equals x @ A up to float32 rounding; a fixed S gives the same bits on every run (no
atomics).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_BLOCK_M = 16  # tl.dot needs >= 16 rows


@dataclasses.dataclass(frozen=True)
class LoRADownConfig:
    """splits: the most K slices (S; fewer when K has fewer blocks); block_k: K columns per loop
    step; block_r: A columns per program (a power of two >= 16); Triton warps / stages."""
    splits: int = 8
    block_k: int = 128
    block_r: int = 32
    num_warps: int = 4
    num_stages: int = 3


def split_plan(k: int, config: LoRADownConfig) -> tuple[int, int, int]:
    """(K blocks, blocks per split, S) for K columns under `config`."""
    if config.splits < 1:
        raise ValueError(f"LoRADownConfig.splits={config.splits}: at least 1")
    k_blocks = -(-k // config.block_k)
    per_split = -(-k_blocks // min(config.splits, k_blocks))
    return k_blocks, per_split, -(-k_blocks // per_split)


def _check(x: jax.Array, a: jax.Array, config: LoRADownConfig) -> None:
    if x.ndim != 2 or a.ndim != 2 or x.shape[1] != a.shape[0]:
        raise ValueError(f"lora_down_partials: x {x.shape} and A {a.shape} must be [M, K] and "
                         "[K, r]")
    for name in ("block_k", "block_r"):
        value = getattr(config, name)
        if value < 16 or value & (value - 1):
            raise ValueError(f"LoRADownConfig.{name}={value}: a power of two >= 16")


def _partials_kernel(x_ref, a_ref, out_ref, *, m: int, k: int, r: int, block_k: int,
                     block_r: int, per_split: int, k_blocks: int):
    pid_m, pid_r, pid_s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    r0 = pid_m * _BLOCK_M
    c0 = pl.multiple_of(pid_r * block_r, block_r)
    rows = r0 + lax.broadcasted_iota(jnp.int32, (_BLOCK_M, 1), 0)
    cols = c0 + lax.broadcasted_iota(jnp.int32, (1, block_r), 1)
    ragged_k = k % block_k != 0
    first = pid_s * per_split

    def body(t, acc):
        k0 = pl.multiple_of((first + t) * block_k, block_k)
        ks = k0 + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        x_mask = rows < m
        if ragged_k:
            x_mask = x_mask & (ks < k)
        xs = plgpu.load(x_ref.at[pl.ds(r0, _BLOCK_M), pl.ds(k0, block_k)],
                        mask=jnp.broadcast_to(x_mask, (_BLOCK_M, block_k)), other=0.0)
        a_mask = cols < r
        if ragged_k:
            a_mask = a_mask & (k0 + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0) < k)
        a_tile = plgpu.load(a_ref.at[pl.ds(k0, block_k), pl.ds(c0, block_r)],
                            mask=jnp.broadcast_to(a_mask, (block_k, block_r)), other=0.0)
        return acc + lax.dot_general(xs.astype(jnp.bfloat16), a_tile.astype(jnp.bfloat16),
                                     (((1,), (0,)), ((), ())),
                                     preferred_element_type=jnp.float32)

    trips = per_split if k_blocks % per_split == 0 else jnp.minimum(per_split,
                                                                    k_blocks - first)
    acc = lax.fori_loop(0, trips, body, jnp.zeros((_BLOCK_M, block_r), jnp.float32))
    plgpu.store(out_ref.at[pid_s, pl.ds(r0, _BLOCK_M), pl.ds(c0, block_r)], acc,
                mask=jnp.broadcast_to((rows < m) & (cols < r), (_BLOCK_M, block_r)))


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def _partials(x, a, *, config: LoRADownConfig, interpret: bool):
    m, k = x.shape
    r = a.shape[1]
    k_blocks, per_split, splits = split_plan(k, config)
    kernel = functools.partial(_partials_kernel, m=m, k=k, r=r, block_k=config.block_k,
                               block_r=config.block_r, per_split=per_split, k_blocks=k_blocks)
    params = None if interpret else plgpu.CompilerParams(num_warps=config.num_warps,
                                                         num_stages=config.num_stages)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((splits, m, r), jnp.float32),
        grid=(-(-m // _BLOCK_M), -(-r // config.block_r), splits), interpret=interpret,
        compiler_params=params, name="lora_down_partials")(x.astype(jnp.bfloat16),
                                                           a.astype(jnp.bfloat16))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _partials_with_vjp(x, a, config, interpret):
    return _partials(x, a, config=config, interpret=interpret)


def _fwd(x, a, config, interpret):
    return _partials(x, a, config=config, interpret=interpret), (x, a)


def _bwd(config, interpret, residuals, grad):
    """grad [S, M, r]: dx[:, K_s] = grad[s] A[K_s]^T, dA[K_s] = x[:, K_s]^T grad[s] (float32,
    cast to the inputs' dtypes)."""
    del interpret
    x, a = residuals
    k = x.shape[1]
    _, per_split, splits = split_plan(k, config)
    width = per_split * config.block_k
    pad = splits * width - k
    x3 = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, pad))).reshape(x.shape[0], splits, width)
    a3 = jnp.pad(a.astype(jnp.float32), ((0, pad), (0, 0))).reshape(splits, width, a.shape[1])
    grad = grad.astype(jnp.float32)
    dx = jnp.einsum("smr,swr->msw", grad, a3).reshape(x.shape[0], -1)[:, :k]
    da = jnp.einsum("msw,smr->swr", x3, grad).reshape(-1, a.shape[1])[:k]
    return dx.astype(x.dtype), da.astype(a.dtype)


_partials_with_vjp.defvjp(_fwd, _bwd)


def lora_down_partials(x: jax.Array, a: jax.Array, *, config: LoRADownConfig | None = None,
                       interpret: bool = False) -> jax.Array:
    """x [M, K] @ A [K, r] as float32 partial sums [S, M, r] over S slices of K (module
    docstring); operands rounded to bf16, float32 accumulation. Differentiable (custom VJP)."""
    config = config or LoRADownConfig()
    _check(x, a, config)
    return _partials_with_vjp(x, a, config, interpret)


def lora_down_partials_reference(x: jax.Array, a: jax.Array,
                                 config: LoRADownConfig | None = None) -> jax.Array:
    """The same partial sums with jnp (float32 einsum over the same K slices)."""
    config = config or LoRADownConfig()
    _check(x, a, config)
    k = x.shape[1]
    _, per_split, splits = split_plan(k, config)
    width = per_split * config.block_k
    pad = splits * width - k
    x3 = jnp.pad(x.astype(jnp.bfloat16).astype(jnp.float32),
                 ((0, 0), (0, pad))).reshape(x.shape[0], splits, width)
    a3 = jnp.pad(a.astype(jnp.bfloat16).astype(jnp.float32),
                 ((0, pad), (0, 0))).reshape(splits, width, a.shape[1])
    return jnp.einsum("msw,swr->smr", x3, a3, precision=lax.Precision.HIGHEST)
