"""The operands of the Mosaic GPU NVFP4 decode matmul (pallas_kernels/mgpu_nvfp4.py): its
permuted weight layout and its inverse, the reference dequantization, the LoRA operands and a
launch's shape checks and input padding. Host-side and jnp only: no kernel.

Permuted layout (`permute_packed`, from a PackedWeight in the kernel layout of
pallas_kernels.blockwise_matmul, NVFP4, tile_k = 256; `unpermute_tiles` undoes it, and
pallas_kernels.permuted_dequantize dequantizes it): uint8 [row tiles * K tiles * 72, 128]; the
64-row tile b, K tile t is the 9216 bytes at rows (b * k_tiles + t) * 72:
  bytes [0, 8192): per thread th of the warpgroup 16 32-bit words, word i at
    (i // 4) * 2048 + th * 16 + (i % 4) * 4 (4 conflict-free 16-byte shared-memory loads per
    thread). Word i holds the thread's 4 bf16 pairs of columns [16 i, 16 i + 16) in the wgmma
    register layout (PAIR_SLOTS: rows r0 = 16 (th // 32) + (th % 32) // 4 and r0 + 8, columns
    16 i + 2 (th % 4) + {0, 1} and + 8), its 32 bits placed (source_bit) so that pair k's bf16x2
    pattern e2m1 * 2^-126 (code bits 0-2 at bits 6-8, the sign at 15; +16 for the second column)
    is rotl(word, r) & 0x81C081C0, r = 0, 6, 12 for k = 0, 1, 2, and
    (rotl(word, 2) & 0x00400040) | (rotl(word, 10) & 0x81808180) for k = 3 (PAIR_ASM): 9
    integer instructions per 8 weights, no register relayout.
  bytes [8192, 9216): the tile's canonical scale codes [64 rows, 16 blocks] (nvfp4_matmul).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import blockwise_matmul as bw

TILE_ROWS = 64
TILE_K = 256
TILE_LINES = 72  # [72, 128] bytes per tile: 64 lines of codes, 8 of scale codes
CODE_BYTES = 8192
SCALED_EXPONENT = -8  # the decoded weights are e2m1 * scale * 2^-8
MAX_M = 64
LORA_RANKS = (16, 32, 64)  # one adapter's rank
MAX_OPERAND_RANK = 192  # the LoRA operand's width: 3 x 64 (a grouped q|k|v launch)
# (column half, row half) of pair k of a word: columns 16 i + 8 c + 2 (lane % 4) + {0, 1},
# row r0 + 8 h.
PAIR_SLOTS = ((0, 0), (1, 0), (0, 1), (1, 1))
PAIR_ASM = (
    "and.b32 t, $1, 0x81C081C0;",
    "shf.l.wrap.b32 t, $1, $1, 6;\nand.b32 t, t, 0x81C081C0;",
    "shf.l.wrap.b32 t, $1, $1, 12;\nand.b32 t, t, 0x81C081C0;",
    "shf.l.wrap.b32 t, $1, $1, 2;\nand.b32 t, t, 0x00400040;\n"
    "shf.l.wrap.b32 u, $1, $1, 10;\nand.b32 u, u, 0x81808180;\nor.b32 t, t, u;",
)


def source_bit(k: int, half: int, bit: int) -> int:
    """The word bit holding code bit `bit` (0-2 magnitude, 3 sign) of pair k's weight `half`
    (0: the first column)."""
    target = (6 + bit if bit < 3 else 15) + 16 * half
    rotation = (0, 6, 12)[k] if k < 3 else (2 if target % 16 == 6 else 10)
    return (target - rotation) % 32


def _gather_indices():
    """(rows, cols) int32 [128 threads, 16 words, 4 pairs, 2 weights]: each word's weights."""
    thread = np.arange(128)
    r0, q = 16 * (thread // 32) + (thread % 32) // 4, thread % 4
    rows = np.empty((128, 16, 4, 2), np.int32)
    cols = np.empty((128, 16, 4, 2), np.int32)
    for i in range(16):
        for k, (c_half, h) in enumerate(PAIR_SLOTS):
            for half in (0, 1):
                rows[:, i, k, half] = r0 + 8 * h
                cols[:, i, k, half] = 16 * i + 8 * c_half + 2 * q + half
    return rows, cols


def _source_bits() -> np.ndarray:
    bits = np.array([[[source_bit(k, half, b) for b in range(4)] for half in (0, 1)]
                     for k in range(4)], np.uint32)  # [pair, weight, code bit]
    assert sorted(bits.ravel().tolist()) == list(range(32))
    return bits


def permute_tiles(codes: jax.Array, scale_codes: jax.Array) -> jax.Array:
    """E2M1 codes [T, 64, 256] (one per byte, natural column order) and canonical scale codes
    [T, 64, 16] of T (row tile, K tile) tiles -> the permuted layout [T * 72, 128] uint8."""
    t = codes.shape[0]
    if codes.shape[1:] != (TILE_ROWS, TILE_K) or scale_codes.shape != (t, TILE_ROWS, 16):
        raise ValueError(f"permute_tiles: codes {codes.shape}, scales {scale_codes.shape}; "
                         f"expected [T, {TILE_ROWS}, {TILE_K}] and [T, {TILE_ROWS}, 16]")
    rows, cols = _gather_indices()
    picked = codes[:, rows, cols].astype(jnp.uint32)  # [T, 128, 16, 4, 2]
    bits = _source_bits()
    words = sum(((picked >> b) & 1) << bits[:, :, b] for b in range(4))
    words = words.sum(axis=(-2, -1), dtype=jnp.uint32)  # [T, 128, 16]
    words = words.reshape(t, 128, 4, 4).transpose(0, 2, 1, 3)  # [T, group, thread, 4]
    code_bytes = lax.bitcast_convert_type(words, jnp.uint8).reshape(t, CODE_BYTES)
    return jnp.concatenate([code_bytes, scale_codes.astype(jnp.uint8).reshape(t, 1024)],
                           axis=1).reshape(-1, 128)


def unpermute_shifts() -> np.ndarray:
    """uint32 [c_half, h, weight half, code bit]: the word bit of each code bit of the weight
    at column offset 8 c_half + half, row offset 8 h of a word (pair k = c_half + 2 h)."""
    return np.array([[[[source_bit(c_half + 2 * h, half, b) for b in range(4)]
                       for half in (0, 1)] for h in (0, 1)] for c_half in (0, 1)], np.uint32)


def unpermute_tiles(permuted: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inverse of permute_tiles: (codes [T, 64, 256], scale codes [T, 64, 16]). No gather: the
    word index (i // 4) 512 + th 4 + i % 4 of thread th = 32 w + 4 l + q splits into axes
    [i_hi, w, l, q, i_lo], each word gives its 8 weights by shifts (rows 16 w + 8 h + l,
    columns 64 i_hi + 16 i_lo + 8 c_half + 2 q + half), and one transpose orders them."""
    flat = permuted.reshape(-1, TILE_LINES * 128)
    t = flat.shape[0]
    words = lax.bitcast_convert_type(flat[:, :CODE_BYTES].reshape(t, CODE_BYTES // 4, 4),
                                     jnp.uint32).reshape(t, 4, 4, 8, 4, 4)
    shifts = unpermute_shifts()
    words = words[..., None, None, None]  # [T, i_hi, w, l, q, i_lo, c_half, h, half]
    codes = sum(((words >> shifts[..., b]) & 1) << b for b in range(4)).astype(jnp.uint8)
    codes = codes.transpose(0, 2, 7, 3, 1, 5, 6, 4, 8).reshape(t, TILE_ROWS, TILE_K)
    return codes, flat[:, CODE_BYTES:].reshape(t, TILE_ROWS, 16)


def kernel_layout_from_permuted(permuted: jax.Array, *, rows: int, k: int,
                                line: int = 0) -> tuple[jax.Array, jax.Array]:
    """The kernel layout (pallas_kernels.blockwise_matmul, tile-major, tile_k 256) of `rows`
    weight rows (a multiple of 64) whose tiles start at line `line` of a permuted buffer
    [lines, 128] uint8: (codes uint8 [rows, K_pad / 2] nibble planes, canonical scale codes
    uint8 [rows, K_pad / 16]), bit for bit the PackedWeight arrays that permute_packed
    permuted. A weight stored only in the permuted layout (qerl_jax.quant.backends.mosaic)
    gives the other kernels their operand with this (inside jit: a transient)."""
    if rows % TILE_ROWS or permuted.ndim != 2 or permuted.shape[1] != 128:
        raise ValueError(f"kernel_layout_from_permuted: rows {rows} (a multiple of "
                         f"{TILE_ROWS}) of a permuted buffer {permuted.shape} ([lines, 128])")
    k_tiles = -(-k // TILE_K)
    lines = rows // TILE_ROWS * k_tiles * TILE_LINES
    if line < 0 or line + lines > permuted.shape[0]:
        raise ValueError(f"kernel_layout_from_permuted: lines [{line}, {line + lines}) of a "
                         f"buffer of {permuted.shape[0]} ({rows} rows, K {k})")
    codes, scale_codes = unpermute_tiles(lax.slice_in_dim(permuted, line, line + lines))
    planes = (codes[..., :TILE_K // 2] | (codes[..., TILE_K // 2:] << 4)).astype(jnp.uint8)
    return (planes.reshape(rows, k_tiles * TILE_K // 2),
            scale_codes.reshape(rows, k_tiles * 16))


def refusal(packed: bw.PackedWeight) -> str | None:
    """Why `packed` cannot take the permuted layout (None if it can)."""
    if packed.fmt != "nvfp4":
        return f"format {packed.fmt} (the permuted layout is NVFP4's)"
    if packed.tile_k != TILE_K:
        return f"tile_k {packed.tile_k} (the permuted layout has K tiles of {TILE_K})"
    if packed.pair_view is not None:
        return "a gate/up pair view"
    return None


def permute_packed(packed: bw.PackedWeight) -> jax.Array:
    """A PackedWeight (NVFP4, tile_k 256, tile-major nibble planes) -> the permuted layout
    [N_pad / 64 * K tiles * 72, 128] uint8 (its tensor_scale stays with the PackedWeight)."""
    reason = refusal(packed)
    if reason:
        raise ValueError(f"permute_packed: {reason}")
    t = packed.codes.shape[0] * 2 * packed.codes.shape[1] // (TILE_ROWS * TILE_K)
    planes = packed.codes.reshape(t, TILE_ROWS, TILE_K // 2)
    codes = jnp.concatenate([planes & 15, planes >> 4], axis=-1)  # plane order = column order
    return permute_tiles(codes, packed.scales.reshape(t, TILE_ROWS, 16))


def permuted_dequantize_reference(permuted: jax.Array, tensor_scale: jax.Array, *, n: int,
                                  k: int) -> jax.Array:
    """The weights W [n, k] float32 of a permuted buffer, in jnp (a reference; the kernel is
    pallas_kernels.permuted_dequantize)."""
    from pallas_kernels import nvfp4_matmul
    from pallas_kernels.e2m1_decode import e2m1_decode_reference
    codes, scale_codes = unpermute_tiles(permuted)
    t = codes.shape[0]
    k_tiles = -(-k // TILE_K)
    row_tiles = t // k_tiles
    scales = nvfp4_matmul.scale_values_from_codes(scale_codes, 0).astype(jnp.float32)
    w = e2m1_decode_reference(codes) * jnp.repeat(scales, 16, axis=-1)  # [T, 64, 256]
    w = w.reshape(row_tiles, k_tiles, TILE_ROWS, TILE_K).transpose(0, 2, 1, 3)
    w = w.reshape(row_tiles * TILE_ROWS, k_tiles * TILE_K)[:n, :k]
    return w / jnp.asarray(tensor_scale, jnp.float32).reshape(())


def operand_rank_ok(rank: int) -> bool:
    """LoRA operand widths the kernel takes: a multiple of 16 (wgmma's K step) up to
    MAX_OPERAND_RANK (the LORA_RANKS of one adapter, 2r of a gate/up pair, 3r of a grouped
    q|k|v launch)."""
    return rank % 16 == 0 and 16 <= rank <= MAX_OPERAND_RANK


def lora_operand(lora_b: jax.Array, tensor_scale: jax.Array, lora_scale=1.0, *,
                 n_pad: int | None = None) -> jax.Array:
    """The kernel's LoRA operand bf16 [n_pad, r] = (lora_scale * tensor_scale * 2^-8) * B^T,
    zero rows past N, from lora_b [r, N] (wgmma's A operand: [64, r] tiles of B^T, scaled so
    that the weight product's rescale 2^8 / tensor_scale also gives lora_scale * (x A) B)."""
    if lora_b.ndim != 2 or lora_b.shape[0] not in LORA_RANKS:
        raise ValueError(f"lora_operand: lora_b {lora_b.shape}; expected [r, N], r in "
                         f"{LORA_RANKS}")
    n = lora_b.shape[1]
    n_pad = -(-n // TILE_ROWS) * TILE_ROWS if n_pad is None else n_pad
    if n_pad < n or n_pad % TILE_ROWS:
        raise ValueError(f"lora_operand: n_pad={n_pad} for N={n} (a multiple of {TILE_ROWS})")
    factor = (jnp.asarray(lora_scale, jnp.float32) * 2.0 ** SCALED_EXPONENT
              * jnp.asarray(tensor_scale, jnp.float32).reshape(()))
    bt = (lora_b.astype(jnp.float32) * factor).T.astype(jnp.bfloat16)
    return jnp.pad(bt, ((0, n_pad - n), (0, 0))) if n_pad != n else bt


def group_lora_operand(lora_bs, tensor_scales, lora_scales, n_pads) -> jax.Array:
    """The LoRA operand bf16 [sum n_pad_i, sum r_i] of weights stacked by rows in one permuted
    buffer (a grouped q|k|v launch, `group_permuted`): weight i's rows hold
    lora_operand(B_i, tensor_scale_i, lora_scale_i) in columns [r_0 + ... + r_{i-1}, + r_i),
    zeros elsewhere (block diagonal), for lora_x_a = x @ [A_0 | A_1 | ...]."""
    lora_bs, n_pads = tuple(lora_bs), tuple(n_pads)
    if not (len(lora_bs) == len(tuple(tensor_scales)) == len(tuple(lora_scales)) == len(n_pads)):
        raise ValueError("group_lora_operand: one B, tensor scale, LoRA scale and n_pad per "
                         f"weight (got {len(lora_bs)} B)")
    ranks = [b.shape[0] for b in lora_bs]
    if not operand_rank_ok(sum(ranks)):
        raise ValueError(f"group_lora_operand: ranks {ranks} sum to {sum(ranks)}; the kernel "
                         f"takes a multiple of 16 up to {MAX_OPERAND_RANK}")
    blocks, offset = [], 0
    for b, ts, scale, n_pad, rank in zip(lora_bs, tensor_scales, lora_scales, n_pads, ranks):
        operand = lora_operand(b, ts, scale, n_pad=n_pad)
        blocks.append(jnp.pad(operand, ((0, 0), (offset, sum(ranks) - offset - rank))))
        offset += rank
    return jnp.concatenate(blocks, axis=0)


def group_permuted(buffers, ks) -> jax.Array:
    """One permuted buffer of weights sharing K stacked by rows ([W_0; W_1; ...], each padded
    to whole 64-row tiles) from their permute_packed buffers: the tiles are row-tile-major, so
    this is their concatenation."""
    if len(set(ks)) != 1:
        raise ValueError(f"group_permuted: the weights' K differ ({list(ks)})")
    return jnp.concatenate(list(buffers), axis=0)


def padded_inputs(x, lora_x_a, m_pad, k_pad):
    """x (and lora_x_a) in bf16, zero-padded to m_pad rows and k_pad columns where needed (no
    copy at the model's shapes)."""
    m, k = x.shape
    x_pad = x.astype(jnp.bfloat16)
    if (m_pad, k_pad) != (m, k):
        x_pad = jnp.pad(x_pad, ((0, m_pad - m), (0, k_pad - k)))
    if lora_x_a is None:
        return x_pad, None
    lora_x = lora_x_a.astype(jnp.bfloat16)
    if m_pad != m:
        lora_x = jnp.pad(lora_x, ((0, m_pad - m), (0, 0)))
    return x_pad, lora_x


def check_launch(x, permuted, lora_x_a, lora_bt, swiglu, *, n: int, k: int):
    """One line naming the operand whose shape a launch does not take."""
    m = x.shape[0]
    k_tiles = -(-k // TILE_K)
    row_tiles = permuted.shape[0] // (TILE_LINES * k_tiles)
    n_pad = row_tiles * TILE_ROWS
    if x.ndim != 2 or x.shape[1] != k or not 1 <= m <= MAX_M:
        raise ValueError(f"mgpu_nvfp4_matmul: x {x.shape}; expected [M <= {MAX_M}, {k}]")
    if permuted.shape != (row_tiles * k_tiles * TILE_LINES, 128) or n_pad < n:
        raise ValueError(f"mgpu_nvfp4_matmul: permuted {permuted.shape} is not a [{n}, {k}] "
                         "weight's permuted layout")
    if lora_x_a is not None:
        rank = lora_x_a.shape[1]
        if (lora_x_a.shape != (m, rank) or not operand_rank_ok(rank) or lora_bt is None
                or lora_bt.shape != (n_pad, rank)):
            raise ValueError(f"mgpu_nvfp4_matmul: lora_x_a {lora_x_a.shape}, operand "
                             f"{None if lora_bt is None else lora_bt.shape}; expected [{m}, r] "
                             f"and [{n_pad}, r], r a multiple of 16 up to {MAX_OPERAND_RANK}")
    next_a = None if swiglu is None else swiglu.next_lora_a
    if next_a is not None and (next_a.ndim != 2 or next_a.shape[0] != row_tiles * 32
                               or next_a.shape[1] % 16 or next_a.shape[1] > 256):
        raise ValueError(f"mgpu_nvfp4_matmul: next_lora_a {next_a.shape}; expected "
                         f"[{row_tiles * 32}, r], r a multiple of 16 up to 256")


def padded_rows(permuted: jax.Array, k: int) -> int:
    """N_pad of a permuted buffer of a weight with k columns."""
    return permuted.shape[0] // (TILE_LINES * -(-k // TILE_K)) * TILE_ROWS


def pair_lora_operand(gate_b: jax.Array, up_b: jax.Array, gate_tensor_scale: jax.Array,
                      up_tensor_scale: jax.Array, lora_scale=1.0, *, n_pad: int,
                      half_block: int) -> jax.Array:
    """The LoRA operand bf16 [2 n_pad, 2r] of a gate/up pair interleaved in blocks of
    half_block rows (kernel_layout.pair_gate_up): gate rows hold lora_operand(B_gate)'s
    rows in columns [0, r), up rows lora_operand(B_up)'s in [r, 2r), zeros elsewhere (block
    diagonal), for lora_x_a = x @ [A_gate | A_up]; r in LORA_RANKS."""
    rank = gate_b.shape[0]
    if up_b.shape != gate_b.shape or rank not in LORA_RANKS or n_pad % half_block:
        raise ValueError(f"pair_lora_operand: B_gate {gate_b.shape}, B_up {up_b.shape}, "
                         f"n_pad={n_pad}, half_block={half_block}; expected equal [r, N] with "
                         f"r in {LORA_RANKS}, n_pad a multiple of half_block")
    halves = []
    for b, ts in ((gate_b, gate_tensor_scale), (up_b, up_tensor_scale)):
        factor = (jnp.asarray(lora_scale, jnp.float32) * 2.0 ** SCALED_EXPONENT
                  * jnp.asarray(ts, jnp.float32).reshape(()))
        bt = (b.astype(jnp.float32) * factor).T  # [N, r]
        halves.append(jnp.pad(bt, ((0, n_pad - bt.shape[0]), (0, 0)))
                      .reshape(n_pad // half_block, 1, half_block, rank))
    zeros = jnp.zeros_like(halves[0])
    gate_rows = jnp.concatenate([halves[0], zeros], axis=-1)
    up_rows = jnp.concatenate([zeros, halves[1]], axis=-1)
    return jnp.concatenate([gate_rows, up_rows], axis=1).reshape(
        2 * n_pad, 2 * rank).astype(jnp.bfloat16)
