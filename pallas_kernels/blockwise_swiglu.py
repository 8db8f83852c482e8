"""The decode MLP's fused kernel: silu(x @ Wg^T) * (x @ Wu^T) from gate and up interleaved into
one packed weight (`interleave_gate_up`), the blockwise matmul with a SwiGLU epilogue, and pair
views that read gate or up in place out of the pair.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.blockwise_configs import DecodeTuning, MatmulConfig, default_matmul_config
from pallas_kernels.blockwise_kernels import (check_packed, check_row_tile, compiler_params,
                                              kernel_rank, launch, pad_lora_x_a,
                                              resolve_decoder, swiglu_matmul_kernel)
from pallas_kernels.blockwise_layout import (FormatSpec, PackedWeight, cdiv, row_major_arrays,
                                             tile_major_arrays, tile_views)

def interleave_rows(a: jax.Array, b: jax.Array, half_block: int) -> jax.Array:
    """[R, W] and [R, W] -> [2R, W]: blocks of half_block rows, a's block j then b's block j."""
    if a.shape != b.shape or a.ndim != 2 or a.shape[0] % half_block:
        raise ValueError(f"interleave_rows: {a.shape} and {b.shape} must be equal [R, W] with "
                         f"R a multiple of {half_block}")
    rows, width = a.shape
    blocks = [x.reshape(rows // half_block, half_block, width) for x in (a, b)]
    return jnp.stack(blocks, axis=1).reshape(2 * rows, width)


def interleave_tile_major_arrays(gate_codes: jax.Array, up_codes: jax.Array,
                                gate_scales: jax.Array, up_scales: jax.Array, *,
                                half_block: int, tile_k: int) -> tuple[jax.Array, jax.Array]:
    """(codes, scales) of a gate/up pair from the two weights' tile-major kernel arrays:
    interleave_rows of each in its row-major form, stored tile-major again (a 64-row block of
    the tile-major layout holds only its own rows, so the interleave cannot work in place)."""
    gate_codes, gate_scales = row_major_arrays(gate_codes, gate_scales, tile_k)
    up_codes, up_scales = row_major_arrays(up_codes, up_scales, tile_k)
    return tile_major_arrays(interleave_rows(gate_codes, up_codes, half_block),
                             interleave_rows(gate_scales, up_scales, half_block), tile_k)


def interleave_gate_up(gate: PackedWeight, up: PackedWeight, half_block: int) -> PackedWeight:
    """One packed weight [2 N_pad, K] from a SwiGLU MLP's gate and up [N, K] (same format, shape
    and layout): rows in blocks of half_block, gate block j then up block j, so that a launch
    with block_n = 2 * half_block reads block j of both in one tile (blockwise_matmul_swiglu).
    tensor_scale [2]: gate's, then up's. The padding rows (N..N_pad) of each are zero.
    pair_view_of(pair, half, ...) reads gate or up back out of it in place."""
    if gate.pair_view is not None or up.pair_view is not None:
        raise ValueError("interleave_gate_up: gate and up must be plain weights, not pair views")
    if (gate.fmt, gate.n, gate.k, gate.tile_k, gate.codes.shape) != (
            up.fmt, up.n, up.k, up.tile_k, up.codes.shape):
        raise ValueError(f"interleave_gate_up: gate {gate.fmt} [{gate.n}, {gate.k}] and up "
                         f"{up.fmt} [{up.n}, {up.k}] must match")
    n_pad = gate.codes.shape[0]
    if n_pad % half_block:
        raise ValueError(f"interleave_gate_up: half_block {half_block} must divide N_pad {n_pad}")
    codes, scales = interleave_tile_major_arrays(gate.codes, up.codes, gate.scales, up.scales,
                                                 half_block=half_block, tile_k=gate.tile_k)
    return PackedWeight(codes=codes, scales=scales,
                        tensor_scale=jnp.concatenate([gate.tensor_scale.reshape(1),
                                                      up.tensor_scale.reshape(1)]),
                        fmt=gate.fmt, n=2 * n_pad, k=gate.k, tile_k=gate.tile_k)


def pair_view_of(pair: PackedWeight, half: int, *, n: int, tensor_scale: jax.Array,
                 half_block: int) -> PackedWeight:
    """Gate (half 0) or up (half 1) of an interleave_gate_up pair as a PackedWeight read in
    place (pair_view; no copy): logical N `n`, its own tensor_scale [1]."""
    return PackedWeight(codes=pair.codes, scales=pair.scales,
                        tensor_scale=jnp.asarray(tensor_scale, jnp.float32).reshape(1),
                        fmt=pair.fmt, n=n, k=pair.k, tile_k=pair.tile_k,
                        pair_view=(half_block, half))


def interleave_lora_b(gate_b: jax.Array, up_b: jax.Array, n_pad: int,
                      half_block: int) -> jax.Array:
    """Block-diagonal LoRA B [r_g' + r_u', 2 N_pad] (bf16) for an interleave_gate_up weight:
    rows [0, r_g) hold B_gate [r_g, N] in the gate blocks' columns, rows [r_g', r_g' + r_u)
    B_up in the up blocks' (zeros elsewhere; each rank zero-padded to a kernel rank r'), so
    down @ B over [x @ A_gate | x @ A_up] (each padded to r') gives each half its own term."""
    blocks = []
    for b, first in ((gate_b, True), (up_b, False)):
        rank, n = b.shape
        b = jnp.pad(b.astype(jnp.bfloat16), ((0, kernel_rank(rank) - rank), (0, n_pad - n)))
        b = b.reshape(b.shape[0], n_pad // half_block, 1, half_block)
        zeros = jnp.zeros_like(b)
        pair = (b, zeros) if first else (zeros, b)
        blocks.append(jnp.concatenate(pair, axis=2).reshape(b.shape[0], 2 * n_pad))
    return jnp.concatenate(blocks, axis=0)


def blockwise_matmul_swiglu(x: jax.Array, gate_up: PackedWeight, *, spec: FormatSpec,
                            out_n: int, half_block: int, config: MatmulConfig | None = None,
                            interpret: bool = False, poison_output: bool = False,
                            lora_x_a: jax.Array | None = None,
                            lora_ranks: tuple[int, int] | None = None,
                            lora_b: jax.Array | None = None,
                            lora_scale: float = 0.0,
                            tensor_scales: tuple[jax.Array, jax.Array] | None = None,
                            next_lora_a: jax.Array | None = None,
                            tuning: DecodeTuning | None = None):
    """silu(x @ Wg^T + lg) * (x @ Wu^T + lu), bf16 [..., out_n], from an interleave_gate_up
    weight (made with `half_block`) in ONE single-weight launch (one dot per K step over
    block_n = 2 * half_block rows: half_block of gate and of up) whose epilogue splits the tile
    and applies the SwiGLU. config None: default_matmul_config (with `tuning`) with that block_n (it must be
    fused with one split; None gives one). LoRA: lora_x_a [..., r_g + r_u] = x @ [A_gate |
    A_up], lora_ranks = (r_g, r_u), lora_b = interleave_lora_b(B_gate, B_up, ...), lora_scale
    (the same for both). tensor_scales: (gate's divisor [1], up's [1]) as two kernel inputs,
    in place of gate_up.tensor_scale [2] (which may then be None): a caller inside a decode
    loop then builds no [2] array at every step. The model's decode MLP
    (qerl_jax.quant.backends.triton, gate/up pairs), where it is faster than
    the grouped launch + XLA's SwiGLU (docs/decisions.md).

    next_lora_a: the next layer's LoRA A [out_n, r] (the MLP's down projection reads this
    output): then returns (y, y @ next_lora_a float32 [..., r]), the product of the bf16
    output with A (float32 sums), from float32 shares [N tiles, M, r'] that each program
    writes for its output columns, summed over the tiles by XLA. The down projection's own
    x @ A product (a split-K gemm and its reduction per layer) is then not needed.
    """
    if gate_up.pair_view is not None:
        raise ValueError("fused SwiGLU: pass the interleaved pair itself, not a view of it")
    if config is None:  # the pair's tiling, with its row blocks and one split
        config = dataclasses.replace(default_matmul_config(math.prod(x.shape[:-1]), gate_up,
                                                           tuning),
                                     block_n=2 * half_block, split_k=1)
    if config.path != "fused" or config.split_k != 1 or config.group_dots:
        raise ValueError(f"fused SwiGLU: config {config} must be fused with split_k=1")
    if config.block_n != 2 * half_block:
        raise ValueError(f"fused SwiGLU: block_n {config.block_n} must be 2 * half_block "
                         f"{half_block} (the interleave's row blocks)")
    if lora_x_a is not None:
        if lora_ranks is None or len(lora_ranks) != 2 or lora_x_a.shape[-1] != sum(lora_ranks):
            raise ValueError(f"fused SwiGLU: lora_x_a {lora_x_a.shape} needs lora_ranks "
                             f"(r_gate, r_up) summing to its last dim, got {lora_ranks}")
        lead = lora_x_a.shape[:-1]
        lora_x_a = pad_lora_x_a(lora_x_a.reshape(-1, lora_x_a.shape[-1]), lora_ranks)
        lora_x_a = lora_x_a.reshape(*lead, lora_x_a.shape[-1])
    if tensor_scales is None:
        if gate_up.tensor_scale is None or gate_up.tensor_scale.shape != (2,):
            raise ValueError(f"fused SwiGLU: the pair's tensor_scale must be [2] (gate's, "
                             f"up's) without tensor_scales, got {gate_up.tensor_scale}")
        tensor_scales = (gate_up.tensor_scale[:1], gate_up.tensor_scale[1:])
    if len(tensor_scales) != 2 or any(jnp.shape(t) != (1,) for t in tensor_scales):
        raise ValueError(f"fused SwiGLU: tensor_scales must be two [1] arrays, got "
                         f"{[jnp.shape(t) for t in tensor_scales]}")
    if next_lora_a is not None and (next_lora_a.ndim != 2 or next_lora_a.shape[0] != out_n):
        raise ValueError(f"fused SwiGLU: next_lora_a {next_lora_a.shape} must be [out_n = "
                         f"{out_n}, r]")
    return _blockwise_matmul_swiglu(x, gate_up, tuple(tensor_scales), spec=spec, out_n=out_n,
                                    config=config, interpret=interpret,
                                    poison_output=poison_output, lora_x_a=lora_x_a,
                                    lora_b=lora_b, lora_scale=float(lora_scale),
                                    next_lora_a=next_lora_a)


@functools.partial(jax.jit, static_argnames=("spec", "out_n", "config", "interpret",
                                             "poison_output", "lora_scale"))
def _blockwise_matmul_swiglu(x, packed, tensor_scales, *, spec, out_n, config, interpret,
                             poison_output, lora_x_a, lora_b, lora_scale, next_lora_a):
    check_packed(packed, spec)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    k_tiles = 2 * packed.codes.shape[1] // packed.tile_k
    bm, bn = config.block_m, config.block_n
    if packed.n % bn or bm < 16 or bn < 32:
        raise ValueError(f"fused SwiGLU: config {config} does not tile the interleaved pair "
                         f"[{packed.n}, {packed.k}]")
    check_row_tile(packed, bn)
    has_lora = lora_x_a is not None
    extra = ()
    if has_lora:
        if lora_b.shape != (lora_x_a.shape[-1], packed.n):
            raise ValueError(f"fused SwiGLU: lora_x_a {lora_x_a.shape} and lora_b "
                             f"{lora_b.shape} must be [..., R] and [R, {packed.n}]")
        extra = (lora_x_a.reshape(m, -1).astype(jnp.bfloat16), lora_b.astype(jnp.bfloat16))
    out_shape = jax.ShapeDtypeStruct((m, out_n), jnp.bfloat16)
    with_shares = next_lora_a is not None
    if with_shares:
        next_rank = next_lora_a.shape[1]
        next_a = next_lora_a.astype(jnp.bfloat16)
        if kernel_rank(next_rank) != next_rank:
            next_a = jnp.pad(next_a, ((0, 0), (0, kernel_rank(next_rank) - next_rank)))
        extra = (*extra, next_a)
        out_shape = (out_shape, jax.ShapeDtypeStruct((packed.n // bn, m, next_a.shape[1]),
                                                     jnp.float32))
    kernel = functools.partial(
        swiglu_matmul_kernel, spec=spec,
        decoder=resolve_decoder(spec, config.decoder, interpret),
        m=m, n=packed.n, k=k, bm=bm, bn=bn, tile_k=packed.tile_k, tiles_per_split=k_tiles,
        k_tiles=k_tiles, split=1, weight_as_lhs=config.weight_as_lhs,
        poisoned=bool(poison_output), clamp_rows=config.clamp_rows,
        lora_scale=lora_scale if has_lora else None, swiglu_n=out_n, with_shares=with_shares)
    aux = tuple(jnp.asarray(a) for a in spec.aux_arrays())
    result = launch(kernel, out_shape, (cdiv(m, bm), packed.n // bn, 1),
                     (x2, *tile_views(packed, spec),
                      *(jnp.asarray(t, jnp.float32) for t in tensor_scales), *extra, *aux),
                     interpret=interpret, poison_output=poison_output,
                     compiler_params=compiler_params(interpret, config.num_warps,
                                                      config.num_stages),
                     name=f"{spec.name}_matmul_swiglu" + ("_lora" if has_lora else "")
                     + ("_next" if with_shares else ""))
    if not with_shares:
        return result.reshape(*lead, out_n)
    y, shares = result
    next_down = shares.sum(axis=0)[:, :next_rank]
    return y.reshape(*lead, out_n), next_down.reshape(*lead, next_rank)
