"""The Triton 4-bit kernels of pallas_kernels.blockwise_matmul, compiled on the GPU
(`pytest -m gpu`; the same kernels run in interpret mode on the CPU in test_nvfp4_matmul.py,
test_mxfp4_matmul.py and test_nf4_matmul.py).

For NVFP4, MXFP4 and NF4 checkpoints drawn over their whole code and scale ranges (NVFP4: e4m3
block scales over 2^-9..2^8, 1/64 of them zero): the fused matmul (decode M, split-K, a 512
K tile), the dequantize path (M = 300), the transposed kernel, every decoder of the format
(FormatSpec.decoders), the other tiling options, and a gate/up pair (interleave_gate_up): each
half read in place as a pair view, and the fused SwiGLU launch with LoRA and the next layer's
x @ A. Outputs are poisoned with NaN first (an unwritten tile fails). Tolerance
(kernel_checks.assert_close): max|y - ref| <= 1e-2 max|ref| and Frobenius <= 6e-3, twice that
for the SwiGLU (a product of two bf16-rounded products).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# checkpoints drawn over every code and the whole scale range, their repacks and the jnp
# references: the kernel benchmarks' cases
from benchmarks import _kernel_cases as cases
from pallas_kernels import blockwise_matmul as bw
from tests.pallas_kernels import kernel_checks as kc

pytestmark = pytest.mark.gpu

MODULES, SPECS = cases.MODULES, cases.SPECS
FORMATS = tuple(MODULES)
# (M, N, K, tile_k): K is cut to the format's scale block
CASES = [(1, 80, 1616, 256), (5, 1000, 1616, 256), (16, 1000, 3584, 512),
         (64, 512, 1616, 256), (300, 1000, 1616, 256)]


def _problem(fmt: str, m: int, n: int, k: int, tile_k: int, seed: int):
    """(checkpoint, x [m, k], dy [m, n], packed weight); K cut to the scale block."""
    k = k // SPECS[fmt].scale_block * SPECS[fmt].scale_block
    kw, kx, ky = jax.random.split(jax.random.key(seed), 3)
    ckpt = cases.random_checkpoint(fmt, n, k, kw)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    dy = jax.random.normal(ky, (m, n), jnp.bfloat16)
    return ckpt, x, dy, cases.repack(fmt, ckpt, tile_k)


def _matmul(fmt, x, packed, config):
    return bw.blockwise_matmul(x, packed, spec=SPECS[fmt], config=config, poison_output=True)


def _transposed(fmt, dy, packed, config):
    return bw.blockwise_matmul_transposed(dy, packed, spec=SPECS[fmt], config=config,
                                          poison_output=True)


@pytest.mark.parametrize("m,n,k,tile_k", CASES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_default_configs(fmt, m, n, k, tile_k):
    """The default tiling at every M (fused with split-K at decode M, the dequantize path at
    300) and, at M = 5 and 300, the transposed kernel's default."""
    ckpt, x, dy, packed = _problem(fmt, m, n, k, tile_k, seed=m * 31 + tile_k)
    config = bw.default_matmul_config(m, packed)
    kc.assert_close(_matmul(fmt, x, packed, config), cases.reference(fmt, x, ckpt),
                    f"{fmt} matmul M={m} N={n} K={k} tile_k={tile_k} {config}")
    if m not in (5, 300):
        return
    config = bw.default_transposed_config(m, packed)
    kc.assert_close(_transposed(fmt, dy, packed, config), cases.reference_transposed(fmt, dy, ckpt),
                    f"{fmt} transposed M={m} N={n} K={k} tile_k={tile_k} {config}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_decoder(fmt):
    """Each decoder of the format in the fused kernel (M = 5, split-K) and in the transposed
    kernel."""
    ckpt, x, dy, packed = _problem(fmt, 5, 1000, 1616, 256, seed=11)
    reference = cases.reference(fmt, x, ckpt)
    reference_t = cases.reference_transposed(fmt, dy, ckpt)
    base = bw.default_matmul_config(5, packed)
    transposed = bw.TransposedConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)
    for decoder in SPECS[fmt].decoders:
        config = dataclasses.replace(base, decoder=decoder)
        kc.assert_close(_matmul(fmt, x, packed, config), reference, f"{fmt} matmul {config}")
        config = dataclasses.replace(transposed, decoder=decoder)
        kc.assert_close(_transposed(fmt, dy, packed, config), reference_t,
                        f"{fmt} transposed {config}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_other_tilings(fmt):
    """The fused kernel with the weights as the dot's left operand, without row clamping and
    with grouped dots (M = 5); the dequantize path with another tiling (M = 300)."""
    ckpt, x, _, packed = _problem(fmt, 5, 1000, 1616, 256, seed=12)
    reference = cases.reference(fmt, x, ckpt)
    base = bw.default_matmul_config(5, packed)
    variants = [dataclasses.replace(base, weight_as_lhs=not base.weight_as_lhs),
                dataclasses.replace(base, group_dots=True)]
    if 5 % base.block_m:
        variants.append(dataclasses.replace(base, clamp_rows=False))
    for config in variants:
        kc.assert_close(_matmul(fmt, x, packed, config), reference, f"{fmt} matmul {config}")
    ckpt, x, _, packed = _problem(fmt, 300, 1000, 1616, 256, seed=13)
    config = bw.MatmulConfig(block_m=64, block_n=64, weight_as_lhs=True, num_stages=2)
    kc.assert_close(_matmul(fmt, x, packed, config), cases.reference(fmt, x, ckpt),
                    f"{fmt} matmul M=300 {config}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_gate_up_pair(fmt):
    """Gate and up interleaved into one pair (the model's MLP layout): each half read in place
    as a pair view by the fused kernel (M = 5, 16), the dequantize path (M = 300) and the
    transposed kernel (M = 5); the fused SwiGLU launch (M = 1, 5, 16, 64; LoRA r32 with a
    block-diagonal B) and its next-layer product x @ A, against float64 SwiGLUs of the
    references."""
    spec, rank, n = SPECS[fmt], 32, 1000
    k = 1616 // spec.scale_block * spec.scale_block
    keys = jax.random.split(jax.random.key(14), 4)
    ckpts = [cases.random_checkpoint(fmt, n, k, key) for key in keys[:2]]
    plain = [cases.repack(fmt, ckpt, 256) for ckpt in ckpts]
    pair = bw.interleave_gate_up(*plain, 32)
    views = [bw.pair_view_of(pair, half, n=n, tensor_scale=w.tensor_scale, half_block=32)
             for half, w in enumerate(plain)]
    lora_b = [0.05 * jax.random.normal(jax.random.fold_in(keys[2], i), (rank, n), jnp.bfloat16)
              for i in range(2)]
    pair_b = bw.interleave_lora_b(*lora_b, pair.n // 2, 32)
    for m in (1, 5, 16, 64, 300):
        x = jax.random.normal(jax.random.fold_in(keys[3], m), (m, k), jnp.bfloat16)
        refs = [cases.reference(fmt, x, ckpt) for ckpt in ckpts]
        if m in (5, 16, 300):
            for half, (view, ref) in enumerate(zip(views, refs)):
                kc.assert_close(bw.blockwise_matmul(x, view, spec=spec, poison_output=True),
                                ref, f"{fmt} pair view {half} matmul M={m}")
                if m == 5:
                    dy = jax.random.normal(jax.random.fold_in(keys[3], 1000 + half), (m, n),
                                           jnp.bfloat16)
                    kc.assert_close(_transposed(fmt, dy, view,
                                                bw.default_transposed_config(m, view)),
                                    cases.reference_transposed(fmt, dy, ckpts[half]),
                                    f"{fmt} pair view {half} transposed M={m}")
        if m > 64:
            continue
        down = 0.1 * jax.random.normal(jax.random.fold_in(keys[2], m), (m, 2 * rank),
                                       jnp.bfloat16)
        gate, up = (np.asarray(ref, np.float64) + 2.0 * (
            np.asarray(down[:, i * rank:(i + 1) * rank], np.float64)
            @ np.asarray(lora_b[i], np.float64)) for i, ref in enumerate(refs))
        with np.errstate(over="ignore"):  # exp(-gate) = inf for a very negative gate: 0
            swiglu = gate / (1.0 + np.exp(-gate)) * up
        next_a = 0.05 * jax.random.normal(jax.random.fold_in(keys[2], 2000 + m), (n, rank),
                                          jnp.bfloat16)
        lora = dict(lora_x_a=down, lora_ranks=(rank, rank), lora_b=pair_b, lora_scale=2.0)
        if m == 5:  # the launch without the next product
            y = bw.blockwise_matmul_swiglu(x, pair, spec=spec, out_n=n, half_block=32,
                                           poison_output=True, **lora)
            kc.assert_close(y, swiglu, f"{fmt} fused SwiGLU M={m}", factor=2.0)
        y, y_next = bw.blockwise_matmul_swiglu(x, pair, spec=spec, out_n=n, half_block=32,
                                               poison_output=True, next_lora_a=next_a, **lora)
        kc.assert_close(y, swiglu, f"{fmt} fused SwiGLU (with the next x @ A) M={m}",
                        factor=2.0)
        kc.assert_close(y_next, swiglu @ np.asarray(next_a, np.float64),
                        f"{fmt} fused SwiGLU's next x @ A M={m}", factor=2.0)
