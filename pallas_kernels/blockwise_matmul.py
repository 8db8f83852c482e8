"""Shared Pallas (Triton backend) kernels for bf16 activations x 4-bit weights with block scales.

Every 4-bit format here (NVFP4, MXFP4, NF4) stores W [N, K] as 4-bit codes plus one scale per
block of B consecutive k. The format files (nvfp4_matmul.py, ...) describe their codes and scales
with a `FormatSpec`; what they share is split by role: the kernel layout (blockwise_layout.py),
the tilings (blockwise_configs.py), the kernel bodies (blockwise_kernels.py), the SwiGLU-fused
decode MLP (blockwise_swiglu.py), and here the wrappers that pad, launch and slice, with the
names of the other four that the formats and the backends use re-exported.

Kernels (all f32 accumulation):
  matmul       y[M, N] = x[M, K] @ W^T. Grid (M tiles, N tiles, split-K). `weight_as_lhs` computes
               y^T = W @ x^T so the decoded weights are the dot's left operand (registers) and the
               tiny activation tile is the right one; split-K writes f32 partials summed by XLA.
  transposed   dx[M, K] = dy[M, N] @ W, W decoded tile by tile (never stored as bf16 in HBM).
  dequantize   W as bf16 [N, K] (for an XLA matmul at large M).
  swiglu       silu(x @ Wg^T) * (x @ Wu^T) from gate and up interleaved into one weight
               (interleave_gate_up): the matmul kernel with a SwiGLU epilogue
               (blockwise_matmul_swiglu), the model's decode MLP.
Pair views (PackedWeight.pair_view, pair_view_of): gate or up read in place out of the
interleaved pair by the matmul, transposed and dequantize kernels (row tiles within one
half_block), so the pair is the only copy of the two weights.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.blockwise_configs import (DecodeTuning, DequantizeConfig, MatmulConfig,
                                              TransposedConfig, default_config,
                                              default_matmul_config, default_transposed_config,
                                              next_pow2, parse_tuning, valid_split)
from pallas_kernels.blockwise_kernels import (check_packed, check_row_tile, compiler_params,
                                              dequantize_kernel, grouped_matmul_kernel,
                                              kernel_rank, launch, lora_epilogue_inputs,
                                              matmul_kernel, pad_lora_x_a, resolve_decoder,
                                              transposed_kernel)
from pallas_kernels.blockwise_layout import (N_MULTIPLE, TILE_ROWS, FormatSpec, PackedWeight,
                                             cdiv, expand_block_scale, from_plane_layout,
                                             pad_scales, padded_sizes, pair_row, row_major,
                                             row_major_arrays, tile_columns, tile_major,
                                             tile_major_arrays, tile_row, tile_views,
                                             to_plane_layout)
from pallas_kernels.blockwise_swiglu import (blockwise_matmul_swiglu, interleave_gate_up,
                                             interleave_lora_b, interleave_rows,
                                             interleave_tile_major_arrays, pair_view_of)

# The names the formats, the backends and the benchmarks use, in one place.
__all__ = [
    "N_MULTIPLE", "TILE_ROWS", "DecodeTuning", "DequantizeConfig", "FormatSpec", "MatmulConfig",
    "PackedWeight", "TransposedConfig", "blockwise_dequantize", "blockwise_matmul",
    "blockwise_matmul_group", "blockwise_matmul_swiglu", "blockwise_matmul_transposed",
    "check_group", "default_group_matmul_config", "default_matmul_config",
    "default_transposed_config", "expand_block_scale", "from_plane_layout", "interleave_gate_up",
    "interleave_lora_b", "interleave_rows", "interleave_tile_major_arrays", "next_pow2",
    "pad_lora_x_a", "pad_scales", "padded_sizes", "pair_row", "pair_view_of", "parse_tuning",
    "row_major", "row_major_arrays", "tile_columns", "tile_major", "tile_major_arrays",
    "tile_row", "tile_views", "to_plane_layout", "valid_split",
]

def blockwise_matmul(x: jax.Array, packed: PackedWeight, *, spec: FormatSpec,
                     config: MatmulConfig | None = None, interpret: bool = False,
                     poison_output: bool = False, lora_x_a: jax.Array | None = None,
                     lora_b: jax.Array | None = None, lora_scale: float = 0.0) -> jax.Array:
    """y [..., N] bf16 = x [..., K] @ W^T (+ lora_scale * lora_x_a @ lora_b) for a packed
    4-bit W [N, K].

    config None picks default_matmul_config(M, packed) (outside the jit).
    lora_x_a [..., r] (= x @ A, rounded to bf16) and lora_b [r, N]: an unmerged LoRA
    adapter's second product, added in the fused kernel's f32 epilogue (one kernel instead of
    the matmul, the B dot and the add), or after the XLA dot on the dequantize path.
    """
    if config is None:
        config = default_matmul_config(math.prod(x.shape[:-1]), packed)
    return _blockwise_matmul(x, packed, spec=spec, config=config, interpret=interpret,
                             poison_output=poison_output, lora_x_a=lora_x_a, lora_b=lora_b,
                             lora_scale=lora_scale)



@functools.partial(jax.jit, static_argnames=("spec", "config", "interpret", "poison_output",
                                             "lora_scale"))
def _blockwise_matmul(x, packed: PackedWeight, *, spec: FormatSpec, config: MatmulConfig,
                      interpret: bool, poison_output: bool, lora_x_a, lora_b,
                      lora_scale: float) -> jax.Array:
    check_packed(packed, spec)
    lead, k = x.shape[:-1], x.shape[-1]
    if k != packed.k:
        raise ValueError(f"x has K={k}, weight has K={packed.k}")
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    has_lora = lora_x_a is not None
    if has_lora:
        down2, lora_b = lora_epilogue_inputs(lora_x_a, lora_b, lead, packed.n)
    if config.path == "dequantize":
        w = blockwise_dequantize(packed, spec=spec, config=DequantizeConfig(),
                                 interpret=interpret, poison_output=poison_output)
        y = lax.dot_general(x2.astype(jnp.bfloat16), w, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
        if has_lora:
            y = y + lora_scale * jnp.dot(down2, lora_b, preferred_element_type=jnp.float32)
        return y.astype(jnp.bfloat16).reshape(*lead, packed.n)
    if config.path != "fused":
        raise ValueError(f"unknown matmul path {config.path!r}")
    n_pad, half_k = packed.n_pad, packed.codes.shape[1]
    k_tiles = 2 * half_k // packed.tile_k
    bm, bn, split = config.block_m, config.block_n, config.split_k
    check_row_tile(packed, bn)
    tiles_per_split = cdiv(k_tiles, split)
    if n_pad % bn or bm < 16 or bn < 16 or not valid_split(split, k_tiles):
        raise ValueError(f"config {config} does not tile N_pad={n_pad}, K tiles={k_tiles} (every "
                         f"one of the split_k splits of ceil(K tiles / split_k) tiles must get "
                         f"at least one tile)")
    decoder = resolve_decoder(spec, config.decoder, interpret)
    poisoned = bool(poison_output)
    kernel = functools.partial(
        matmul_kernel, spec=spec, decoder=decoder, m=m, n=packed.n, k=k, bm=bm, bn=bn,
        tile_k=packed.tile_k, tiles_per_split=tiles_per_split, k_tiles=k_tiles, split=split,
        weight_as_lhs=config.weight_as_lhs, poisoned=poisoned, group_dots=config.group_dots,
        clamp_rows=config.clamp_rows, lora_scale=float(lora_scale) if has_lora else None,
        pair_view=packed.pair_view)
    if config.group_dots and spec.decode_values is None:
        raise ValueError(f"{spec.name} has no group-scaled decoder")
    if split == 1:
        out_shape = jax.ShapeDtypeStruct((m, packed.n), jnp.bfloat16)
    else:
        out_shape = jax.ShapeDtypeStruct((split, m, packed.n), jnp.float32)
    aux = tuple(jnp.asarray(a) for a in spec.aux_arrays())
    # Tiles of N past the logical n hold only padding: not launched (their unmasked stores would
    # land outside the [m, n] output when n is a multiple of bn but n_pad > n).
    y = launch(kernel, out_shape, (cdiv(m, bm), cdiv(packed.n, bn), split),
                (x2, *tile_views(packed, spec), packed.tensor_scale,
                 *((down2, lora_b) if has_lora else ()), *aux),
                interpret=interpret, poison_output=poison_output,
                compiler_params=compiler_params(interpret, config.num_warps, config.num_stages),
                name=f"{spec.name}_matmul" + ("_lora" if has_lora else ""))
    if split > 1:
        y = y.sum(axis=0).astype(jnp.bfloat16)
    return y.reshape(*lead, packed.n)


def default_group_matmul_config(m: int, packed: tuple[PackedWeight, ...],
                                tuning: DecodeTuning | None = None) -> MatmulConfig:
    """Tiling of a grouped launch: default_matmul_config's rules over all members' N tiles (the
    programs of all members fill the GPU together, so split-K is chosen for their sum)."""
    first = packed[0]
    return default_config(m, tuple(p.codes.shape[0] for p in packed),
                           2 * first.codes.shape[1] // first.tile_k, first.fmt, tuning=tuning)


def check_group(packed: tuple[PackedWeight, ...], spec: FormatSpec) -> None:
    """Raises ValueError unless the weights can share one launch: >= 1 weight, all of `spec`'s
    format, with the same K, K tile and padded K."""
    if not packed:
        raise ValueError("a grouped matmul needs at least one weight")
    first = packed[0]
    for i, p in enumerate(packed):
        check_packed(p, spec)
        if p.pair_view is not None:
            raise ValueError(f"grouped matmul: weight {i} is a gate/up pair view (its launch is "
                             "blockwise_matmul_swiglu over the pair, or blockwise_matmul)")
        if (p.k, p.tile_k, p.codes.shape[1]) != (first.k, first.tile_k, first.codes.shape[1]):
            raise ValueError(f"grouped matmul: weight {i} is [N={p.n}, K={p.k}] with tile_k "
                             f"{p.tile_k}; weight 0 has K={first.k}, tile_k {first.tile_k} "
                             "(all weights of a group need the same K and K tile)")


def blockwise_matmul_group(x: jax.Array, packed: tuple[PackedWeight, ...], *, spec: FormatSpec,
                           config: MatmulConfig | None = None, interpret: bool = False,
                           poison_output: bool = False, lora_x_a: jax.Array | None = None,
                           lora_bs=None,
                           lora_scales: tuple[float, ...] | None = None) -> tuple[jax.Array, ...]:
    """(x @ W_i^T (+ lora_scales[i] * down_i @ lora_bs[i]))_i, bf16 [..., N_i], for weights
    that share x (a layer's q/k/v, or gate/up), in ONE fused-kernel launch: its N-tile programs
    are dealt out to the weights in order. Each output equals blockwise_matmul's of the same
    weight under the same config. Saves a launch and its fill/drain per extra weight, and lets
    small weights (k/v) share the GPU with a large one, without concatenating the weights.

    LoRA (all weights or none): lora_x_a [..., R] = x @ [A_0 | A_1 | ...], the members' down
    products side by side (one dot for the group), member i's at columns [sum_{j<i} r_j, + r_i)
    with r_i = lora_bs[i].shape[0]; lora_bs[i] [r_i, N_i]. config None picks
    default_group_matmul_config (decided outside the jit). The "dequantize" path runs the
    weights one by one.
    """
    packed = tuple(packed)
    if config is None:
        config = default_group_matmul_config(math.prod(x.shape[:-1]), packed)
    if lora_x_a is not None:
        lora_bs = tuple(lora_bs)
        lora_scales = tuple(float(s) for s in lora_scales)
        if not len(lora_bs) == len(lora_scales) == len(packed):
            raise ValueError(f"grouped matmul: {len(packed)} weights but {len(lora_bs)} LoRA B "
                             f"matrices and {len(lora_scales)} scales")
        ranks = sum(b.shape[0] for b in lora_bs)
        if lora_x_a.shape[-1] != ranks:
            raise ValueError(f"grouped matmul: lora_x_a has {lora_x_a.shape[-1]} columns; the "
                             f"B matrices' ranks sum to {ranks}")
    return _blockwise_matmul_group(x, packed, spec=spec, config=config, interpret=interpret,
                                   poison_output=poison_output, lora_x_a=lora_x_a,
                                   lora_bs=lora_bs, lora_scales=lora_scales)



@functools.partial(jax.jit, static_argnames=("spec", "config", "interpret", "poison_output",
                                             "lora_scales"))
def _blockwise_matmul_group(x, packed, *, spec: FormatSpec, config: MatmulConfig,
                            interpret: bool, poison_output: bool, lora_x_a, lora_bs,
                            lora_scales) -> tuple[jax.Array, ...]:
    check_group(packed, spec)
    has_lora = lora_x_a is not None
    lead, k = x.shape[:-1], x.shape[-1]
    ranks = [b.shape[0] for b in lora_bs] if has_lora else []
    starts = [sum(ranks[:i]) for i in range(len(ranks))]
    if config.path == "dequantize":
        return tuple(_blockwise_matmul(
            x, p, spec=spec, config=config, interpret=interpret, poison_output=poison_output,
            lora_x_a=lora_x_a[..., starts[i]:starts[i] + ranks[i]] if has_lora else None,
            lora_b=lora_bs[i] if has_lora else None,
            lora_scale=lora_scales[i] if has_lora else 0.0) for i, p in enumerate(packed))
    if config.path != "fused":
        raise ValueError(f"unknown matmul path {config.path!r}")
    if k != packed[0].k:
        raise ValueError(f"x has K={k}, the grouped weights have K={packed[0].k}")
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    half_k = packed[0].codes.shape[1]
    k_tiles = 2 * half_k // packed[0].tile_k
    bm, bn, split = config.block_m, config.block_n, config.split_k
    if any(p.codes.shape[0] % bn for p in packed) or bm < 16 or bn < 16 or \
            not valid_split(split, k_tiles):
        raise ValueError(f"config {config} does not tile the grouped weights (N_pad "
                         f"{[p.codes.shape[0] for p in packed]}, K tiles={k_tiles})")
    if config.group_dots:
        raise ValueError("grouped matmul: group_dots is not supported")
    shared, columns = [], None
    if has_lora:
        down2 = lora_x_a.reshape(m, -1).astype(jnp.bfloat16)
        bs = [b.astype(jnp.bfloat16) for b in lora_bs]
        down2 = pad_lora_x_a(down2, ranks)  # each member zero-padded to a kernel rank
        if any(kernel_rank(r) != r for r in ranks):
            bs = [jnp.pad(b, ((0, kernel_rank(r) - r), (0, 0))) for b, r in zip(bs, ranks)]
        kernel_ranks = [kernel_rank(r) for r in ranks]
        columns = tuple(sum(kernel_ranks[:i]) for i in range(len(kernel_ranks)))
        shared = [down2]
    members, inputs, offset = [], [], 0
    for i, p in enumerate(packed):
        n_tiles = cdiv(p.n, bn)
        members.append((p.n, offset, n_tiles))
        offset += n_tiles
        check_row_tile(p, bn)
        inputs += [*tile_views(p, spec), p.tensor_scale]
        if has_lora:
            if bs[i].shape[1] != p.n:
                raise ValueError(f"grouped matmul: lora_bs[{i}] {lora_bs[i].shape} must be "
                                 f"[r, N={p.n}]")
            inputs.append(bs[i])
    kernel = functools.partial(
        grouped_matmul_kernel, members=tuple(members),
        lora_scales=lora_scales if has_lora else None, lora_columns=columns,
        poisoned=bool(poison_output), spec=spec,
        decoder=resolve_decoder(spec, config.decoder, interpret), m=m, k=k, bm=bm, bn=bn,
        tile_k=packed[0].tile_k, tiles_per_split=cdiv(k_tiles, split), k_tiles=k_tiles,
        split=split, weight_as_lhs=config.weight_as_lhs, clamp_rows=config.clamp_rows)
    if split == 1:
        out_shape = tuple(jax.ShapeDtypeStruct((m, p.n), jnp.bfloat16) for p in packed)
    else:
        out_shape = tuple(jax.ShapeDtypeStruct((split, m, p.n), jnp.float32) for p in packed)
    aux = tuple(jnp.asarray(a) for a in spec.aux_arrays())
    ys = launch(kernel, out_shape, (cdiv(m, bm), offset, split),
                 (x2, *shared, *inputs, *aux), interpret=interpret,
                 poison_output=poison_output,
                 compiler_params=compiler_params(interpret, config.num_warps,
                                                  config.num_stages),
                 name=f"{spec.name}_matmul_group{len(packed)}" + ("_lora" if has_lora else ""))
    if split > 1:
        ys = [y.sum(axis=0).astype(jnp.bfloat16) for y in ys]
    return tuple(y.reshape(*lead, p.n) for y, p in zip(ys, packed))


@functools.partial(jax.jit, static_argnames=("spec", "config", "interpret", "poison_output"))
def blockwise_matmul_transposed(dy: jax.Array, packed: PackedWeight, *, spec: FormatSpec,
                                config: TransposedConfig | None = None, interpret: bool = False,
                                poison_output: bool = False) -> jax.Array:
    """dx [..., K] bf16 = dy [..., N] @ W for a packed 4-bit W [N, K] (the backward of x @ W^T).

    config None picks default_transposed_config(M, packed).
    """
    check_packed(packed, spec)
    if config is None:
        config = default_transposed_config(dy.size // dy.shape[-1], packed)
    lead, n = dy.shape[:-1], dy.shape[-1]
    if n != packed.n:
        raise ValueError(f"dy has N={n}, weight has N={packed.n}")
    dy2 = dy.reshape(-1, n)
    m = dy2.shape[0]
    if config.path == "dequantize":
        w = blockwise_dequantize(packed, spec=spec, config=DequantizeConfig(),
                                 interpret=interpret, poison_output=poison_output)
        dx = jnp.dot(dy2.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
        return dx.astype(jnp.bfloat16).reshape(*lead, packed.k)
    n_pad, half_k = packed.n_pad, packed.codes.shape[1]
    bm, bn = config.block_m, config.block_n
    if n_pad % bn or bm < 16 or bn < 16:
        raise ValueError(f"config {config} does not tile N_pad={n_pad}")
    check_row_tile(packed, bn)
    decoder = resolve_decoder(spec, config.decoder, interpret)
    poisoned = bool(poison_output)
    kernel = functools.partial(
        transposed_kernel, spec=spec, decoder=decoder, m=m, n=n, k=packed.k, bm=bm, bn=bn,
        tile_k=packed.tile_k, n_steps=cdiv(n, bn), k_tiles=2 * half_k // packed.tile_k,
        poisoned=poisoned,
        pair_view=packed.pair_view)
    aux = tuple(jnp.asarray(a) for a in spec.aux_arrays())
    dx = launch(kernel, jax.ShapeDtypeStruct((m, packed.k), jnp.bfloat16),
                 (cdiv(m, bm), 2 * half_k // packed.tile_k),
                 (dy2, *tile_views(packed, spec), packed.tensor_scale, *aux),
                 interpret=interpret, poison_output=poison_output,
                 compiler_params=compiler_params(interpret, config.num_warps, config.num_stages),
                 name=f"{spec.name}_matmul_transposed")
    return dx.reshape(*lead, packed.k)


@functools.partial(jax.jit, static_argnames=("spec", "config", "interpret", "poison_output"))
def blockwise_dequantize(packed: PackedWeight, *, spec: FormatSpec,
                         config: DequantizeConfig = DequantizeConfig(), interpret: bool = False,
                         poison_output: bool = False) -> jax.Array:
    """W as bf16 [N, K] (f32 decode and scale, one rounding), written tile by tile."""
    check_packed(packed, spec)
    n_pad, half_k = packed.n_pad, packed.codes.shape[1]
    k_tiles = 2 * half_k // packed.tile_k
    tpp = math.gcd(config.tiles_per_program, k_tiles)
    bn = min(config.block_n, n_pad, packed.max_block_n or n_pad)
    check_row_tile(packed, bn)
    poisoned = bool(poison_output)
    # The exact decoder: its cost is hidden behind the 2-byte-per-weight write.
    decoder = spec.interpret_decoder
    kernel = functools.partial(
        dequantize_kernel, spec=spec, decoder=decoder, n=packed.n, k=packed.k, bn=bn,
        tile_k=packed.tile_k, tiles_per_program=tpp, k_tiles=k_tiles, poisoned=poisoned,
        pair_view=packed.pair_view)
    aux = tuple(jnp.asarray(a) for a in spec.aux_arrays())
    return launch(kernel, jax.ShapeDtypeStruct((packed.n, packed.k), jnp.bfloat16),
                   (cdiv(packed.n, bn), k_tiles // tpp),
                   (*tile_views(packed, spec), packed.tensor_scale, *aux),
                   interpret=interpret, poison_output=poison_output,
                   compiler_params=compiler_params(interpret, config.num_warps,
                                                    config.num_stages),
                   name=f"{spec.name}_dequantize")
