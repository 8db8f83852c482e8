"""Shared checks for the 4-bit matmul kernel tests (interpret mode on CPU).

Every check draws a fresh seed, prints it in the failure message, poisons the kernel outputs with
NaN first (so an unwritten tile fails) and compares with the format's plain-jnp reference.

Tolerance (bf16 output): max |y - ref| <= 1e-2 * max |ref| and ||y - ref|| / ||ref|| <= 6e-3.
The output's own bf16 rounding is <= 2^-9 relative; NF4 weights are also rounded to bf16 before
the dot (another ~2^-9 per weight), E2M1 weights are exact in bf16.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import blockwise_matmul as bw
from pallas_kernels import mgpu_nvfp4_layout, nvfp4_matmul
from qerl_jax.quant.nvfp4 import nvfp4_quantize

MAX_REL_ERR = 1e-2
FROBENIUS_REL_ERR = 6e-3


def fresh_seed() -> int:
    return int(np.random.default_rng().integers(1 << 31))


def assert_close(y, ref, context: str, factor: float = 1.0):
    """y within `factor` times the module's tolerance of ref (factor 2 for a SwiGLU epilogue: its
    output multiplies two products, each within the tolerance)."""
    y = np.asarray(y, np.float32)
    ref = np.asarray(ref, np.float32)
    assert y.shape == ref.shape, f"{context}: shape {y.shape} != {ref.shape}"
    assert np.isfinite(y).all(), f"{context}: non-finite output (unwritten tile?)"
    scale = float(np.abs(ref).max())
    assert scale > 0, f"{context}: degenerate reference"
    max_err = float(np.abs(y - ref).max()) / scale
    fro = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
    assert max_err <= factor * MAX_REL_ERR and fro <= factor * FROBENIUS_REL_ERR, (
        f"{context}: max err {max_err:.2e} (<= {factor * MAX_REL_ERR}), Frobenius {fro:.2e} "
        f"(<= {factor * FROBENIUS_REL_ERR})")


@dataclasses.dataclass(frozen=True)
class FormatUnderTest:
    """Binds one format's module functions to a common interface."""
    name: str
    block: int
    make_checkpoint: callable  # (rng, n, k) -> tuple of checkpoint arrays
    repack: callable           # (*ckpt, tile_k=) -> PackedWeight
    unpack: callable           # (packed) -> tuple of checkpoint arrays
    reference: callable        # (x, *ckpt) -> bf16 [M, N]
    reference_transposed: callable
    dequantize_reference: callable
    matmul: callable           # (x, packed, interpret=, config=, poison_output=)
    matmul_transposed: callable
    dequantize: callable


def random_problem(fmt: FormatUnderTest, seed: int, m: int, n: int, k: int, tile_k: int):
    rng = np.random.default_rng(seed)
    ckpt = fmt.make_checkpoint(rng, n, k)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    packed = fmt.repack(*ckpt, tile_k=tile_k)
    return ckpt, x, packed


def ragged_k(fmt: FormatUnderTest, rng, min_k: int = 0) -> int:
    """A K >= min_k that is a multiple of the scale block but not of the 128/256 tiles."""
    while True:
        k = 96 + fmt.block * int(rng.integers(0, 12))
        k = -(-k // fmt.block) * fmt.block
        if k % 128 and k >= min_k:
            return k


def check_repack_roundtrip(fmt: FormatUnderTest):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    for tile_k in (128, 256):
        for n in (1, 80, 130):
            k = ragged_k(fmt, rng)
            ckpt = fmt.make_checkpoint(rng, n, k)
            packed = fmt.repack(*ckpt, tile_k=tile_k)
            n_pad, k_pad = bw.padded_sizes(n, k, tile_k)
            assert packed.codes.shape == (n_pad, k_pad // 2) and packed.codes.dtype == jnp.uint8
            assert packed.scales.shape == (n_pad, k_pad // fmt.block)
            back = fmt.unpack(packed)
            for a, b in zip(ckpt, back):
                a, b = np.atleast_1d(np.asarray(a)), np.atleast_1d(np.asarray(b))
                assert a.dtype == b.dtype and a.shape == b.shape, f"seed={seed}"
                assert (a.view(np.uint8) == b.view(np.uint8)).all(), f"seed={seed}: not lossless"


def check_plane_layout(fmt: FormatUnderTest, low_nibble_first: bool):
    """The kernel layout puts element t*T + j in the low nibble, t*T + T/2 + j in the high one."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    n, k, tile_k = 3, 256, 128
    elements = rng.integers(0, 16, (n, k)).astype(np.uint8)
    first, second = elements[:, 0::2], elements[:, 1::2]
    codes = first | (second << 4) if low_nibble_first else (first << 4) | second
    planes = np.asarray(bw.to_plane_layout(jnp.asarray(codes), k=k, tile_k=tile_k,
                                           low_nibble_first=low_nibble_first))
    for t in range(k // tile_k):
        byte = planes[:n, t * tile_k // 2:(t + 1) * tile_k // 2]
        np.testing.assert_array_equal(byte & 15, elements[:, t * tile_k:t * tile_k + tile_k // 2])
        np.testing.assert_array_equal(byte >> 4, elements[:, t * tile_k + tile_k // 2:(t + 1) * tile_k])


def check_matmul(fmt: FormatUnderTest, m: int, config=None, n: int = 80, tile_k: int = 128,
                 k: int | None = None):
    """k None: a random ragged K (a multiple of split_k tiles when the config splits K)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    split = config.split_k if config is not None else 1
    if k is None:
        k = ragged_k(fmt, rng, min_k=(2 * split - 1) * tile_k // 2 + 1 if split > 1 else 0)
        if split > 1 and -(-k // tile_k) % split:
            k = -(-k // tile_k) * tile_k + tile_k - fmt.block  # an even number of ragged tiles
    ckpt, x, packed = random_problem(fmt, seed, m, n, k, tile_k)
    y = fmt.matmul(x, packed, interpret=True, config=config, poison_output=True)
    assert y.dtype == jnp.bfloat16
    assert_close(y, fmt.reference(x, *ckpt),
                 f"{fmt.name} matmul seed={seed} M={m} N={n} K={k} tile_k={tile_k} {config}")


def check_transposed(fmt: FormatUnderTest, m: int, config=None, n: int = 80, tile_k: int = 128):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    k = ragged_k(fmt, rng)
    ckpt, _, packed = random_problem(fmt, seed, 1, n, k, tile_k)
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    dx = fmt.matmul_transposed(dy, packed, interpret=True, config=config, poison_output=True)
    assert dx.dtype == jnp.bfloat16 and dx.shape == (m, k)
    assert_close(dx, fmt.reference_transposed(dy, *ckpt),
                 f"{fmt.name} transposed seed={seed} M={m} N={n} K={k} {config}")


def check_dequantize(fmt: FormatUnderTest, n: int = 80, tile_k: int = 128):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    k = ragged_k(fmt, rng)
    ckpt, _, packed = random_problem(fmt, seed, 1, n, k, tile_k)
    w = fmt.dequantize(packed, interpret=True, poison_output=True)
    ref = np.asarray(fmt.dequantize_reference(*ckpt))
    assert w.dtype == jnp.bfloat16 and w.shape == (n, k)
    # One bf16 rounding (<= 2^-9 relative; 2^-7 leaves room for a last-ulp f32 difference).
    np.testing.assert_allclose(np.asarray(w, np.float32), ref, rtol=2.0 ** -7, atol=1e-30,
                               err_msg=f"{fmt.name} dequantize seed={seed} K={k}")


def check_leading_dims(fmt: FormatUnderTest):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    k = ragged_k(fmt, rng)
    ckpt, _, packed = random_problem(fmt, seed, 1, 48, k, 128)
    x = jnp.asarray(rng.standard_normal((2, 3, k)), jnp.bfloat16)
    y = fmt.matmul(x, packed, interpret=True, poison_output=True)
    assert y.shape == (2, 3, 48)
    assert_close(y.reshape(6, 48), fmt.reference(x.reshape(6, k), *ckpt),
                 f"{fmt.name} leading dims seed={seed}")


E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def nvfp4_packed(n: int, k: int, seed: int = 0, zero_rows: int = 0):
    """(checkpoint NVFP4 weight, its kernel-layout PackedWeight) of a seeded Gaussian W [n, k];
    zero_rows > 0 zeroes the first 16 columns of that many rows (all-zero blocks: the zero scale
    code)."""
    w = jax.random.normal(jax.random.key(seed), (n, k), jnp.float32)
    if zero_rows:
        w = w.at[:zero_rows, :16].set(0.0)
    q = nvfp4_quantize(w)
    return q, nvfp4_matmul.repack_nvfp4(q.codes, q.block_scales, q.tensor_scale)


def nvfp4_float64_weights(q) -> np.ndarray:
    """float64 W from the checkpoint arrays (E2M1 table x e4m3 scale / tensor scale)."""
    codes = np.asarray(q.codes)
    nib = np.stack([codes & 15, codes >> 4], -1).reshape(codes.shape[0], -1)
    scales = np.asarray(q.block_scales.astype(jnp.float32), np.float64)
    return E2M1[nib] * np.repeat(scales, 16, axis=1) / float(q.tensor_scale)


def mosaic_reference_unscaled(x, permuted, *, n, k, lora_x_a=None, lora_bt=None,
                              l2_prefetch=None, swiglu=None, config=None):
    """mgpu_nvfp4.matmul_unscaled's result from the permuted buffer by float32 jnp (the
    kernel's numbers are checked on the GPU by test_mgpu_nvfp4_gpu.py; an L2 prefetch is a hint
    that changes no result); with swiglu, the fused epilogue's (h, shares) as its docstring
    states them. Shared by the kernel-file and the Mosaic-backend CPU tests."""
    del l2_prefetch, config
    n_pad = mgpu_nvfp4_layout.padded_rows(permuted, k)
    unit = jnp.asarray([2.0 ** -mgpu_nvfp4_layout.SCALED_EXPONENT])
    raw = mgpu_nvfp4_layout.permuted_dequantize_reference(permuted, unit, n=n_pad,
                                                          k=k)  # e2m1 x block scale x 2^-8
    y = x.astype(jnp.float32) @ raw.T
    if lora_x_a is not None:
        y = y + (lora_x_a.astype(jnp.bfloat16).astype(jnp.float32)
                 @ lora_bt.astype(jnp.float32).T)
    if swiglu is None:
        return y
    m, tiles = x.shape[0], n_pad // 64
    y = y.reshape(m, tiles, 2, 32)
    halves = [(y[:, :, i].reshape(m, -1) * 2.0 ** -mgpu_nvfp4_layout.SCALED_EXPONENT
               / jnp.asarray(ts, jnp.float32).reshape(())).astype(jnp.bfloat16)
              .astype(jnp.float32) for i, ts in enumerate((swiglu.gate_divisor,
                                                           swiglu.up_divisor))]
    h = (halves[0] / (1.0 + jnp.exp(-halves[0])) * halves[1]).astype(jnp.bfloat16)
    if swiglu.next_lora_a is None:
        return h, None
    a = swiglu.next_lora_a.astype(jnp.float32).reshape(tiles, 32, -1)
    shares = jnp.einsum("mtj,tjr->tmr", h.astype(jnp.float32).reshape(m, tiles, 32), a)
    return h, shares
