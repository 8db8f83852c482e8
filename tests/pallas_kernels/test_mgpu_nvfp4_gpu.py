"""The Mosaic GPU NVFP4 decode kernel on a Hopper GPU (`pytest -m gpu`).

- The matmul, y = x @ W^T / tensor_scale (+ scale * down @ B), for random NVFP4 checkpoints (the
  whole e4m3 scale range, 1/64 of the scales zero) over M, LoRA ranks, split counts (some that
  do not divide the K tiles) and shapes, against a float64 product of the checkpoint's weights
  and of the LoRA term with the kernel's bf16 roundings (bf16(down) @ its LoRA operand,
  mgpu_nvfp4_layout.lora_operand, rescaled by 2^8 / tensor_scale; the operand's scale folding is
  checked against float64 on the CPU in test_mgpu_nvfp4.py). Bound per element: 1e-5 x
  (|x| @ |W|^T + the same product of absolute values of the LoRA term), float32 accumulation
  over K <= 27648 of exact products. "prepared" cases pass the operand made ahead (lora_bt, as
  the sampler does), the others pass B and the LoRA scale.
- mgpu_nvfp4_matmul and mgpu_nvfp4_swiglu (both epilogues) against the jnp references of
  their file (mgpu_nvfp4_matmul_reference, mgpu_nvfp4_swiglu_reference) on each schedule: the
  matmul within the bound above, the SwiGLU within bf16 rounding.
- The warp-specialized schedule (asked for, M = 33-64; two compute warpgroups and a copying
  one) against the split-K schedule at the same splits, bit for bit (each row tile's products
  are summed in the same order): single weights with and without LoRA, uneven splits, M not a
  multiple of 8 (these also against float64 with the bound above); grouped q|k|v launches (7B;
  14B and 32B at M = 64); the fused SwiGLU launch of a 7B and a 32B gate|up pair at M = 64
  (the split-K launch also against its XLA epilogue within 2^-7 of the largest |output|); and
  the sampler at batch 64 with each schedule setting, equal token for token and log-prob for
  log-prob.
- The grouped q|k|v launch: three weights' buffers stacked (group_permuted), the block-diagonal
  operand (group_lora_operand), each member's columns rescaled by its own 2^8 / tensor_scale,
  each against its float64 product with the same bound.
- The gate|up SwiGLU launch of a 32B pair with the next layer's LoRA product, the SwiGLU in the
  kernel's epilogue and in XLA, against the Triton fused SwiGLU launch on the same pair: within
  2^-7 of the largest |output| (bf16 outputs of sums in different orders).
- The sampler end to end (a random 1.5B NVFP4 model, rank-32 LoRA with nonzero B, batch 8, 64
  tokens at temperature 1 from one key) on the Mosaic path, the Triton kernels and the XLA path:
  a random model's next-token distribution is nearly uniform, so summation order alone moves
  some draws; the Mosaic path's largest log-prob gap on the common token prefixes must be at
  most max(0.05, twice the Triton-XLA gap).
- SamplingConfig.shrink_batch on that model with dequantize_once: 72 rows (the
  dequantize-then-dot path) of which half stop after 4 tokens, so the loop goes on with 36 rows
  on the Mosaic kernels; against the same rows kept at 72 (the same per-row keys): each row's
  log-probs on the common token prefix within max(0.05, twice the gap between those 72 rows
  alone and as the first 72 of 96), at least half the long rows' prefixes reaching the 36-row
  loop, budgets kept, nothing after a row's end.
- SamplingConfig.dequantize_once (decode_fusion.dequantize_for_rollout) on that model at 72 rows
  (the dequantize-then-dot path), teacher-forced: every log-prob within max(0.02, twice the gap
  between the same rows run at batch 72 and 96) of the per-step dequantize's.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import blockwise_matmul as bw
from pallas_kernels import mgpu_nvfp4 as mg
from pallas_kernels import mgpu_nvfp4_layout as layout
from pallas_kernels import mgpu_nvfp4_tuning as tuning
from pallas_kernels import nvfp4_matmul

pytestmark = pytest.mark.gpu

HALF_BLOCK = 32  # rows of each gate / up block in an interleaved pair
BOUND = 1e-5  # of |x| @ |W|^T (+ the LoRA term's absolute product), per element
WS = mg.TuningConfig(schedule="warp_specialized")
MATMUL_CASES = [  # (n, k, m, rank, splits, LoRA operand prepared)
    (256, 1024, 8, 0, None, False), (256, 1024, 5, 32, 3, False), (200, 608, 1, 16, 1, True),
    (1024, 5120, 16, 32, None, False), (640, 2304, 64, 64, 2, True),
    (5120, 27648, 8, 32, None, True), (5120, 5120, 8, 32, 4, False),
    (384, 4096, 3, 0, 16, False),
    # splits that do not divide the K tiles (7 K tiles in 3; 7B's down: 74 in 9), 14B's down
    # (LoRA operand made in the call) and gate|up pair shapes
    (384, 1792, 8, 32, 3, True), (3584, 18944, 8, 32, None, True),
    (5120, 13824, 8, 32, None, False), (27648, 5120, 5, 16, None, True),
    # M = 64 at the default splits (sized for 2 programs per SM: 7B's down in 4)
    (3584, 18944, 64, 32, None, True)]
GROUP_CASES = [  # (member Ns, k, m, rank of each, splits): grouped q|k|v launches
    ((5120, 1024, 1024), 5120, 8, 32, None), ((256, 128, 128), 1792, 5, 16, 3),
    ((3584, 512, 512), 3584, 8, 64, None), ((3584, 512, 512), 3584, 64, 32, None)]


@pytest.fixture(scope="module", autouse=True)
def hopper():
    reason = mg.available()
    if reason is not None:
        pytest.skip(f"no Mosaic GPU kernel here: {reason}")


def _random_checkpoint(n: int, k: int, key):
    """NVFP4 checkpoint arrays (codes, e4m3 block scales over 2^-9..2^8 with ~1/64 zero,
    tensor scale in [50, 500]): every code and the whole scale range in use."""
    kc, ks, kz, kt = jax.random.split(key, 4)
    codes = jax.random.bits(kc, (n, k // 2), jnp.uint8)
    scales = 2.0 ** jax.random.uniform(ks, (n, k // 16), minval=-9, maxval=8)
    scales = jnp.where(jax.random.bernoulli(kz, 1 / 64, scales.shape), 0.0, scales)
    return codes, scales.astype(jnp.float8_e4m3fn), jax.random.uniform(kt, (), minval=50,
                                                                       maxval=500)


def _inputs(key, n: int, k: int, m: int, rank: int):
    """(checkpoint, x [m, k], down [m, rank], B [rank, n]) bf16; down and B None at rank 0."""
    ckpt = _random_checkpoint(n, k, jax.random.fold_in(key, 1))
    x = jax.random.normal(jax.random.fold_in(key, 2), (m, k), jnp.bfloat16)
    if not rank:
        return ckpt, x, None, None
    down = jax.random.normal(jax.random.fold_in(key, 3), (m, rank), jnp.bfloat16)
    lora_b = 0.01 * jax.random.normal(jax.random.fold_in(key, 4), (rank, n), jnp.bfloat16)
    return ckpt, x, down, lora_b


def _float64(array) -> np.ndarray:
    return np.asarray(jnp.asarray(array).astype(jnp.float32), np.float64)


def _float64_check(y, ckpt, x, down, operand, packed, n, rank):
    """Largest |y - float64 reference| / (BOUND x the absolute product): the checkpoint's
    weights times x, plus the LoRA term with the kernel's bf16 roundings (bf16(down) @ the
    operand, rescaled by 2^8 / tensor_scale)."""
    w = np.asarray(nvfp4_matmul.nvfp4_dequantize_reference(*ckpt), np.float64)
    x64 = _float64(x)
    reference, bound = x64 @ w.T, np.abs(x64) @ np.abs(w).T
    if rank:
        lx = _float64(down.astype(jnp.bfloat16))
        bt = _float64(operand)[:n]
        rescale = 2.0 ** -layout.SCALED_EXPONENT / float(np.asarray(packed.tensor_scale).reshape(()))
        reference = reference + (lx @ bt.T) * rescale
        bound = bound + (np.abs(lx) @ np.abs(bt).T) * rescale
    return float((np.abs(y - reference) / (BOUND * bound + 1e-30)).max())


@pytest.mark.parametrize("n,k,m,rank,splits,prepared", MATMUL_CASES)
def test_matmul_matches_float64(n, k, m, rank, splits, prepared):
    ckpt, x, down, lora_b = _inputs(jax.random.key(n * 7 + k), n, k, m, rank)
    packed = nvfp4_matmul.repack_nvfp4(*ckpt)
    permuted = layout.permute_packed(packed)
    operand, kwargs = None, {}
    if rank:
        operand = layout.lora_operand(lora_b, packed.tensor_scale, 2.0, n_pad=packed.codes.shape[0])
        kwargs = (dict(lora_x_a=down, lora_bt=operand) if prepared
                  else dict(lora_x_a=down, lora_b=lora_b, lora_scale=2.0))
    fn = jax.jit(lambda x, p, ts, kw: mg.mgpu_nvfp4_matmul(
        x, p, ts, n=n, k=k, config=mg.TuningConfig(splits=splits), **kw))
    y = np.asarray(fn(x, permuted, packed.tensor_scale, kwargs), np.float64)
    assert np.isfinite(y).all()
    excess = _float64_check(y, ckpt, x, down, operand, packed, n, rank)
    assert excess <= 1.0, f"largest error / bound {excess:.3g}"


def _group_inputs(ns, k: int, m: int, rank: int, seed: int):
    """A grouped q|k|v launch's operands: (members (_inputs each), x, the stacked x @ A,
    repacked weights, their stacked permuted buffer, padded row counts, the block-diagonal
    LoRA operand with LoRA scale 2)."""
    members = [_inputs(jax.random.key(seed * i + k), n, k, m, rank) for i, n in enumerate(ns)]
    x = members[0][1]
    down = jnp.concatenate([member[2] for member in members], axis=1)
    packed = [nvfp4_matmul.repack_nvfp4(*member[0]) for member in members]
    tiles = layout.group_permuted([layout.permute_packed(p) for p in packed], [k] * len(ns))
    n_pads = [p.codes.shape[0] for p in packed]
    operand = layout.group_lora_operand([member[3] for member in members],
                                    [p.tensor_scale for p in packed], [2.0] * len(ns), n_pads)
    return members, x, down, packed, tiles, n_pads, operand


@pytest.mark.parametrize("ns,k,m,rank,splits", GROUP_CASES)
def test_grouped_launch_matches_float64(ns, k, m, rank, splits):
    members, x, down, packed, tiles, n_pads, operand = _group_inputs(ns, k, m, rank, 1000)
    fn = jax.jit(lambda x, t, d, o: mg.matmul_unscaled(
        x, t, n=sum(n_pads), k=k, lora_x_a=d, lora_bt=o, config=mg.TuningConfig(splits=splits)))
    y = np.asarray(fn(x, tiles, down, operand), np.float64)
    assert np.isfinite(y).all()
    x64, lx, bt_all = _float64(x), _float64(down), _float64(operand)
    offset = 0
    for index, (n, member, p, n_pad) in enumerate(zip(ns, members, packed, n_pads)):
        rescale = 2.0 ** -layout.SCALED_EXPONENT / float(np.asarray(p.tensor_scale).reshape(()))
        got = y[:, offset:offset + n] * rescale
        w = np.asarray(nvfp4_matmul.nvfp4_dequantize_reference(*member[0]), np.float64)
        bt = bt_all[offset:offset + n]
        reference = x64 @ w.T + (lx @ bt.T) * rescale
        bound = np.abs(x64) @ np.abs(w).T + (np.abs(lx) @ np.abs(bt).T) * rescale
        excess = float((np.abs(got - reference) / (BOUND * bound + 1e-30)).max())
        assert excess <= 1.0, f"member {index}: largest error / bound {excess:.3g}"
        offset += n_pad


class _GateUpPair(NamedTuple):
    """A random NVFP4 gate/up pair (each [n, k]) and its launch operands: interleaved in
    blocks of 32 rows (`pair`, repacked), x [m, k] and down [m, 2 rank] bf16, both halves' LoRA
    B [rank, n], the next layer's LoRA A [n, rank], the halves' tensor scales and the pair's
    LoRA operand (pair_lora_operand, LoRA scale 1)."""
    pair: object
    x: jax.Array
    down: jax.Array
    gate_b: jax.Array
    up_b: jax.Array
    next_a: jax.Array
    scales: tuple
    operand: jax.Array
    n_pad: int


def _gate_up_pair(n: int, k: int, m: int, rank: int, seed: int) -> _GateUpPair:
    from qerl_jax.quant.nvfp4 import nvfp4_quantize
    keys = jax.random.split(jax.random.key(seed), 8)
    gate, up = (nvfp4_matmul.repack_nvfp4(*_checkpoint_arrays(nvfp4_quantize(
        jax.random.normal(keys[i], (n, k)) * 0.02)), tile_k=layout.TILE_K) for i in (0, 1))
    pair = bw.interleave_gate_up(gate, up, HALF_BLOCK)
    n_pad = gate.codes.shape[0]
    gate_b, up_b = ((jax.random.normal(keys[i], (rank, n)) * 0.01).astype(jnp.bfloat16)
                    for i in (4, 5))
    scales = (gate.tensor_scale, up.tensor_scale)
    return _GateUpPair(
        pair=pair, x=jax.random.normal(keys[2], (m, k), jnp.bfloat16),
        down=(jax.random.normal(keys[3], (m, 2 * rank)) * 0.1).astype(jnp.bfloat16),
        gate_b=gate_b, up_b=up_b,
        next_a=(jax.random.normal(keys[6], (n, rank)) * 0.01).astype(jnp.bfloat16),
        scales=scales, n_pad=n_pad,
        operand=layout.pair_lora_operand(gate_b, up_b, *scales, 1.0, n_pad=n_pad,
                                     half_block=HALF_BLOCK))


def _within_bf16_of(value, reference, name: str) -> None:
    """bf16 outputs of sums in different orders: within 2^-7 of the largest |reference|."""
    value, reference = _float64(value), _float64(reference)
    assert value.shape == reference.shape and np.isfinite(value).all(), name
    error = float(np.abs(value - reference).max() / (2.0 ** -7 * np.abs(reference).max()))
    assert error <= 1.0, f"{name}: largest error / (2^-7 max|reference|) {error:.3g}"


@pytest.mark.parametrize("fused", [True, False], ids=["kernel_epilogue", "xla_epilogue"])
def test_swiglu_launch_matches_the_triton_launch(fused):
    """The 32B gate|up pair (27648 x 5120 each), M = 8, LoRA r32 on both halves and the next
    layer's LoRA A: the Mosaic launch against Triton's blockwise_matmul_swiglu."""
    n, k, m, rank = 27648, 5120, 8, 32
    g = _gate_up_pair(n, k, m, rank, 7)
    want, want_next = jax.jit(lambda x, d: bw.blockwise_matmul_swiglu(
        x, g.pair, spec=nvfp4_matmul.NVFP4, out_n=n, half_block=HALF_BLOCK, lora_x_a=d,
        lora_ranks=(rank, rank),
        lora_b=bw.interleave_lora_b(g.gate_b, g.up_b, g.n_pad, HALF_BLOCK),
        lora_scale=1.0, tensor_scales=g.scales, next_lora_a=g.next_a))(g.x, g.down)
    got, got_next = jax.jit(lambda x, d: mg.mgpu_nvfp4_swiglu(
        x, layout.permute_packed(g.pair), *g.scales, out_n=n, k=k, half_block=HALF_BLOCK,
        lora_x_a=d, lora_bt=g.operand, next_lora_a=g.next_a,
        config=mg.TuningConfig(swiglu_epilogue_max_m=64 if fused else 0)))(g.x, g.down)
    for name, value, reference in (("output", got, want), ("next LoRA", got_next, want_next)):
        _within_bf16_of(value, reference, name)


@pytest.mark.parametrize("schedule", ["split_k", "warp_specialized"])
def test_kernels_equal_their_references(schedule):
    """mgpu_nvfp4_matmul and mgpu_nvfp4_swiglu (SwiGLU in the kernel's epilogue and in XLA)
    against the jnp references of their file (dequantize, then float32 dots), M = 64, LoRA
    r32, on each schedule: the matmul within BOUND of the absolute product (float32 sums in
    another order), the SwiGLU outputs within bf16 rounding of the reference's."""
    n, k, m, rank = 1024, 2304, 64, 32
    ckpt, x, down, lora_b = _inputs(jax.random.key(77), n, k, m, rank)
    packed = nvfp4_matmul.repack_nvfp4(*ckpt)
    permuted = layout.permute_packed(packed)
    lora = dict(lora_x_a=down, lora_b=lora_b, lora_scale=2.0)
    config = mg.TuningConfig(schedule=schedule)
    got = _float64(mg.mgpu_nvfp4_matmul(x, permuted, packed.tensor_scale, n=n, k=k,
                                        config=config, **lora))
    want = _float64(mg.mgpu_nvfp4_matmul_reference(x, permuted, packed.tensor_scale, n=n,
                                                   k=k, **lora))
    w = np.abs(_float64(layout.permuted_dequantize_reference(permuted, packed.tensor_scale,
                                                             n=n, k=k)))
    operand = layout.lora_operand(lora_b, packed.tensor_scale, 2.0, n_pad=packed.codes.shape[0])
    bound = np.abs(_float64(x)) @ w.T + (np.abs(_float64(down)) @ np.abs(_float64(operand))[:n].T
                                          * 2.0 ** -layout.SCALED_EXPONENT
                                          / float(np.asarray(packed.tensor_scale).reshape(())))
    assert np.isfinite(got).all()
    assert float((np.abs(got - want) / (BOUND * bound + 1e-30)).max()) <= 1.0
    g = _gate_up_pair(n, k, m, rank, 78)
    pair = layout.permute_packed(g.pair)
    want_out, want_next = mg.mgpu_nvfp4_swiglu_reference(
        g.x, pair, *g.scales, out_n=n, k=k, half_block=HALF_BLOCK, lora_x_a=g.down,
        lora_bt=g.operand, next_lora_a=g.next_a)
    for max_m in (64, 0):
        out, out_next = mg.mgpu_nvfp4_swiglu(
            g.x, pair, *g.scales, out_n=n, k=k, half_block=HALF_BLOCK, lora_x_a=g.down,
            lora_bt=g.operand, next_lora_a=g.next_a,
            config=mg.TuningConfig(schedule=schedule, splits=1, swiglu_epilogue_max_m=max_m))
        _within_bf16_of(out, want_out, f"output, epilogue up to M = {max_m}")
        _within_bf16_of(out_next, want_next, f"next LoRA, epilogue up to M = {max_m}")


WS_CASES = [  # (n, k, m, rank, splits, LoRA operand prepared): warp-specialized launches
    (3584, 18944, 64, 32, None, True), (640, 2304, 40, 64, 2, True),
    (384, 1792, 57, 32, 3, False), (256, 1024, 33, 0, None, False),
    (37888, 3584, 64, 32, None, True)]


@pytest.mark.parametrize("n,k,m,rank,splits,prepared", WS_CASES)
def test_warp_specialized_schedule_matches_split_k_and_float64(n, k, m, rank, splits,
                                                               prepared):
    ckpt, x, down, lora_b = _inputs(jax.random.key(n * 3 + k + m), n, k, m, rank)
    packed = nvfp4_matmul.repack_nvfp4(*ckpt)
    permuted = layout.permute_packed(packed)
    row_tiles, k_tiles = -(-n // layout.TILE_ROWS), -(-k // layout.TILE_K)
    assert tuning.launch_schedule(m, row_tiles, config=WS) == "warp_specialized"
    if splits is None:
        splits = tuning.launch_splits(row_tiles, k_tiles, m=m, config=WS)
    operand, kwargs = None, {}
    if rank:
        operand = layout.lora_operand(lora_b, packed.tensor_scale, 2.0, n_pad=packed.codes.shape[0])
        kwargs = (dict(lora_x_a=down, lora_bt=operand) if prepared
                  else dict(lora_x_a=down, lora_b=lora_b, lora_scale=2.0))
    outputs = {}
    for schedule in ("warp_specialized", "split_k"):
        fn = jax.jit(lambda x, p, ts, kw, schedule=schedule: mg.mgpu_nvfp4_matmul(
            x, p, ts, n=n, k=k, config=mg.TuningConfig(schedule=schedule, splits=splits),
            **kw))
        outputs[schedule] = np.asarray(fn(x, permuted, packed.tensor_scale, kwargs), np.float64)
    y = outputs["warp_specialized"]
    assert np.isfinite(y).all()
    np.testing.assert_array_equal(y, outputs["split_k"])
    excess = _float64_check(y, ckpt, x, down, operand, packed, n, rank)
    assert excess <= 1.0, f"largest error / bound {excess:.3g}"


@pytest.mark.parametrize("ns,k,m", [((3584, 512, 512), 3584, 48),
                                     ((5120, 1024, 1024), 5120, 64)], ids=["7b", "14b_32b"])
def test_warp_specialized_grouped_launch_matches_split_k(ns, k, m):
    """A q|k|v grouped launch (LoRA r32 each) of 7B at M = 48 and of 14B and 32B (the same
    shape) at M = 64: both schedules, same splits, bit for bit."""
    _, x, down, _, tiles, n_pads, operand = _group_inputs(ns, k, m, 32, 2000)
    splits = tuning.launch_splits(sum(n_pads) // layout.TILE_ROWS, k // layout.TILE_K, m=m)
    outputs = [np.asarray(jax.jit(lambda x, t, d, o, schedule=schedule: mg.matmul_unscaled(
        x, t, n=sum(n_pads), k=k, lora_x_a=d, lora_bt=o,
        config=mg.TuningConfig(schedule=schedule, splits=splits)))(
            x, tiles, down, operand)) for schedule in ("warp_specialized", "split_k")]
    assert np.isfinite(outputs[0]).all()
    np.testing.assert_array_equal(*outputs)


@pytest.mark.parametrize("n,k", [(18944, 3584), (27648, 5120)], ids=["7b", "32b"])
def test_warp_specialized_swiglu_launch_matches_split_k(n, k):
    """A gate|up pair (7B: 18944 x 3584 each; 32B: 27648 x 5120), M = 64, LoRA r32 on both
    halves and the next layer's LoRA A, the SwiGLU in the kernel's epilogue: the
    warp-specialized launch equals the split-K one bit for bit; that one is within 2^-7 of
    the largest |output| of the same products with the SwiGLU in XLA."""
    g = _gate_up_pair(n, k, 64, 32, 11)
    pair = layout.permute_packed(g.pair)
    results = {}
    for schedule, fused in (("warp_specialized", True), ("split_k", True), ("split_k", False)):
        results[schedule, fused] = jax.device_get(jax.jit(
            lambda x, d, schedule=schedule, fused=fused: mg.mgpu_nvfp4_swiglu(
                x, pair, *g.scales, out_n=n, k=k, half_block=HALF_BLOCK, lora_x_a=d,
                lora_bt=g.operand, next_lora_a=g.next_a,
                config=mg.TuningConfig(schedule=schedule, splits=1,
                                       swiglu_epilogue_max_m=64 if fused else 0)))(
                                           g.x, g.down))
    for got, want in zip(results["warp_specialized", True], results["split_k", True]):
        assert np.isfinite(_float64(got)).all()
        np.testing.assert_array_equal(_float64(got), _float64(want))
    for name, value, reference in zip(("output", "next LoRA"), results["split_k", True],
                                      results["split_k", False]):
        _within_bf16_of(value, reference, name)


def _checkpoint_arrays(quantized):
    return quantized.codes, quantized.block_scales, quantized.tensor_scale


def _model(path: str, schedule: str = "auto"):
    """(architecture, graphdef, (trainable, frozen)) of one random 1.5B NVFP4 model (seed 0)
    with a rank-32 LoRA (nonzero B), on `path`: "xla" (no Pallas kernel), "triton" (the Triton
    kernels) or "mosaic" (the Mosaic GPU NVFP4 path)."""
    from flax import nnx

    from qerl_jax.lora import TRAINABLE, LoRAConfig, add_lora
    from qerl_jax.models.config import preset
    from qerl_jax.models.layers import Linear
    from qerl_jax.model_quant import kernel_setup as model_kernels
    from qerl_jax.model_quant.random_model import random_quantized_model
    from qerl_jax.quant import kernel_registry
    from qerl_jax.quant.kernel_options import KernelOptions

    architecture = preset("qwen2p5_1p5b", param_dtype="bfloat16", compute_dtype="bfloat16",
                          remat=False)
    model = random_quantized_model(architecture, "nvfp4", seed=0)
    add_lora(model, LoRAConfig(rank=32, alpha=32.0, train_norms=True), jax.random.key(1))
    adapted = [node for _, node in nnx.iter_graph(model)
               if isinstance(node, Linear) and node.lora_b is not None]
    for index, layer in enumerate(adapted):
        value = layer.lora_b.get_value()
        layer.lora_b.set_value(1e-3 * jax.random.normal(
            jax.random.fold_in(jax.random.key(2), index), value.shape, value.dtype))
    kernel_registry.unregister_kernels("gpu")
    model_kernels.disable_decode_attention("gpu")
    if path != "xla":
        options = KernelOptions(mosaic_nvfp4="on" if path == "mosaic" else "off",
                                mosaic_schedule=schedule)
        model_kernels.enable_kernels(model, options)
    graphdef, trainable, frozen = nnx.split(model, TRAINABLE, ...)
    return architecture, graphdef, (trainable, frozen)


def _rollout(path: str, monkeypatch, batch: int = 8, schedule: str = "auto"):
    """(tokens, log-probs) of 64 sampled tokens from _model(path, schedule), prompt 64."""
    from qerl_jax import sampling

    architecture, graphdef, (trainable, frozen) = _model(path, schedule)
    config = sampling.SamplingConfig(max_new_tokens=64, temperature=1.0, eos_token_ids=(),
                                     num_generations=1, prompt_bucket=64)
    tokens = jax.random.randint(jax.random.key(7), (batch, 64), 0, architecture.vocab_size,
                                jnp.int32)
    rollout = sampling.generate_from_states(graphdef, (trainable, frozen), tokens,
                                            jnp.ones((batch, 64), jnp.bool_),
                                            jax.random.key(8), config)
    return jax.device_get((rollout.tokens, rollout.logprobs))


def _largest_gap(a, b) -> float:
    """The largest |log-prob difference| over each row's common token prefix."""
    (tokens_a, logprobs_a), (tokens_b, logprobs_b) = a, b
    differs = np.asarray(tokens_a) != np.asarray(tokens_b)
    prefix = np.where(differs.any(1), differs.argmax(1), differs.shape[1])
    return max(float(np.abs(np.asarray(logprobs_a)[i, :p] - np.asarray(logprobs_b)[i, :p])
                     .max(initial=0.0)) for i, p in enumerate(prefix))


def test_sampler_on_the_mosaic_path_agrees_within_the_noise_floor(monkeypatch):
    from qerl_jax.model_quant.kernel_setup import disable_decode_attention
    from qerl_jax.quant.kernel_registry import unregister_kernels
    try:
        rollouts = {path: _rollout(path, monkeypatch) for path in ("xla", "triton", "mosaic")}
    finally:
        unregister_kernels("gpu")
        disable_decode_attention("gpu")
    floor = _largest_gap(rollouts["triton"], rollouts["xla"])
    for other in ("triton", "xla"):
        gap = _largest_gap(rollouts["mosaic"], rollouts[other])
        assert gap <= max(0.05, 2 * floor), f"Mosaic vs {other}: {gap:.3g} (floor {floor:.3g})"


def test_sampler_schedules_give_the_same_rollout():
    """Batch 64 on the Mosaic path of the 1.5B model: every decode launch at M = 64 takes the
    warp-specialized kernel ('warp_specialized'), the split-K one ('split_k') or each the one
    'auto' picks (each traced afresh: the warp-specialized kernel is built for none of the
    'split_k' launches, for all of the others' and for some of 'auto''s). At this model's
    shapes both schedules choose the same splits, and each row
    tile's products are summed in the same order, so the three rollouts (one process, the same
    XLA programs around the kernels) are equal token for token and log-prob for log-prob."""
    from qerl_jax.model_quant.kernel_setup import disable_decode_attention
    from qerl_jax.quant.kernel_registry import unregister_kernels
    for n, k in ((1536, 1536), (1536, 8960), (2048, 1536), (17920, 1536)):
        row_tiles, k_tiles = n // layout.TILE_ROWS, k // layout.TILE_K
        assert len({tuning.launch_splits(row_tiles, k_tiles, m=64,
                                              config=mg.TuningConfig(schedule=s))
                    for s in ("split_k", "warp_specialized")}) == 1
    def warp_specialized_traced():
        info = mg._warp_specialized_kernel.cache_info()
        return info.hits + info.misses

    rollouts, traced = {}, {}
    try:
        for schedule in ("split_k", "warp_specialized", "auto"):
            # the three models are alike: without this the sampler's jit would reuse the first
            # trace, whose launches read the kernel options registered then
            jax.clear_caches()
            before = warp_specialized_traced()
            rollouts[schedule] = _rollout("mosaic", None, batch=64, schedule=schedule)
            traced[schedule] = warp_specialized_traced() - before
    finally:
        unregister_kernels("gpu")
        disable_decode_attention("gpu")
    assert traced["split_k"] == 0 and traced["warp_specialized"] > traced["auto"] > 0, traced
    tokens, logprobs = rollouts["split_k"]
    assert np.isfinite(np.asarray(logprobs)).all()
    for schedule in ("warp_specialized", "auto"):
        np.testing.assert_array_equal(rollouts[schedule][0], tokens, err_msg=schedule)
        np.testing.assert_array_equal(rollouts[schedule][1], logprobs, err_msg=schedule)


def test_dequantize_once_agrees_with_the_per_step_dequantize():
    """Above the fused kernels' M = 64 the decode matmuls dequantize each weight, then dot.
    decode_fusion.dequantize_for_rollout (SamplingConfig.dequantize_once) makes those same bf16
    weights once; only the GEMMs may differ (their float32 summation order). Teacher-forced
    (a prefill of 64 tokens, then 8 given tokens) on the Mosaic path, 72 rows: every log-prob
    of the vocabulary moves by at most max(0.02, 2 x the floor), the floor being how far the
    same 72 rows move when run at batch 96 (other GEMM tilings, the same math)."""
    from flax import nnx

    from qerl_jax.model_quant.kernel_setup import disable_decode_attention
    from qerl_jax.models.decode_fusion import dequantize_for_rollout
    from qerl_jax.models.kv_cache import init_kv_cache
    from qerl_jax.models.transformer import decode_step, prefill
    from qerl_jax.quant.kernel_registry import unregister_kernels

    try:
        architecture, graphdef, states = _model("mosaic")
        prompts = jax.random.randint(jax.random.key(7), (96, 64), 0, architecture.vocab_size,
                                     jnp.int32)
        forced = jax.random.randint(jax.random.key(9), (96, 8), 0, architecture.vocab_size,
                                    jnp.int32)

        @functools.partial(jax.jit, static_argnames=("rows", "once"))
        def log_probs(states, rows, once):
            model = nnx.merge(graphdef, *states)
            cache = init_kv_cache(model.config, rows, 72)
            logits, cache = prefill(model, prompts[:rows], jnp.ones((rows, 64), jnp.bool_),
                                    cache, empty_cache=True)
            if once:
                assert dequantize_for_rollout(model, rows, after=logits) == 7 * 28
            steps = [logits]
            for t in range(8):
                logits, cache = decode_step(model, forced[:rows, t], cache)
                steps.append(logits)
            return jax.nn.log_softmax(jnp.stack(steps).astype(jnp.float32), axis=-1)

        per_step = np.asarray(log_probs(states, 72, False))
        once = np.asarray(log_probs(states, 72, True))
        wider = np.asarray(log_probs(states, 96, False))[:, :72]
    finally:
        unregister_kernels("gpu")
        disable_decode_attention("gpu")
    assert np.isfinite(once).all()
    floor = float(np.abs(wider - per_step).max())
    gap = float(np.abs(once - per_step).max())
    assert gap <= max(0.02, 2 * floor), f"dequantize once: {gap:.3g} (floor {floor:.3g})"


def test_a_shrinking_batch_agrees_with_the_full_batch():
    """SamplingConfig.shrink_batch with dequantize_once on the Mosaic path: the 72-row loop
    multiplies by the dense copies, the 36-row loop (after half the rows stop at 4 tokens) by
    the fused NVFP4 kernels; against the 72 rows decoded together to the end (the same per-row
    keys), each row's common-prefix log-probs within max(0.05, 2 x the floor), the floor being
    the gap between those 72 rows run alone and as the first 72 of 96 rows (other GEMM
    tilings, the same math; rows keep their keys). Budgets kept, nothing after a row's end."""
    from qerl_jax import sampling
    from qerl_jax.model_quant.kernel_setup import disable_decode_attention
    from qerl_jax.quant.kernel_registry import unregister_kernels

    try:
        architecture, graphdef, states = _model("mosaic")
        prompts = jax.random.randint(jax.random.key(7), (96, 64), 0, architecture.vocab_size,
                                     jnp.int32)
        budgets = np.where(np.arange(96) % 2 == 1, 4, 32).astype(np.int32)
        budgets[72:] = 32
        config = sampling.SamplingConfig(max_new_tokens=32, temperature=1.0, eos_token_ids=(),
                                         prompt_bucket=64, dequantize_once=True,
                                         shrink_batch=True, shrink_min_rows=36)

        def run(rows, config):
            rollout = sampling.generate_from_states(
                graphdef, states, prompts[:rows], jnp.ones((rows, 64), jnp.bool_),
                jax.random.key(8), config, stop_lengths=budgets[:rows])
            return jax.device_get((rollout.tokens, rollout.logprobs, rollout.lengths))

        shrunk = run(72, config)
        full = run(72, dataclasses.replace(config, shrink_min_rows=72))
        wider = run(96, dataclasses.replace(config, shrink_min_rows=96))
    finally:
        unregister_kernels("gpu")
        disable_decode_attention("gpu")
    np.testing.assert_array_equal(shrunk[2], budgets[:72])
    assert all((shrunk[0][row, length:] == 0).all() for row, length in enumerate(budgets[:72]))
    assert np.isfinite(shrunk[1]).all()
    floor = _largest_gap(full[:2], tuple(part[:72] for part in wider[:2]))
    gap = _largest_gap(shrunk[:2], full[:2])
    # the comparison reaches the 36-row loop (steps 4 on): most long rows share > 4 tokens
    differs = shrunk[0] != full[0]
    prefix = np.where(differs.any(1), differs.argmax(1), differs.shape[1])[budgets[:72] == 32]
    print(f"shrunk vs full batch: {gap:.3g}; floor {floor:.3g}; common prefixes of the "
          f"32-token rows: median {np.median(prefix):.0f}, min {prefix.min()}")
    assert (prefix > 4).mean() >= 0.5, prefix
    assert gap <= max(0.05, 2 * floor), f"shrunk vs full batch: {gap:.3g} (floor {floor:.3g})"
