"""pallas_kernels.mgpu_nvfp4 and its modules on the CPU: the permuted layout (lossless, the same
weights as the checkpoint's float64 dequantization), the decode's bit math (an integer emulation
gives those weights), the LoRA operands' scale folding (float64), the device facts, the split-K
counts and schedules, the jnp references against float64, and that every kernel configuration
(split-K, warp-specialized, uneven splits, grouped operand widths, L2 prefetch, the SwiGLU
epilogue) lowers for CUDA. The kernel's numbers are checked on a GPU by test_mgpu_nvfp4_gpu.py
(Mosaic GPU has no interpret mode for TMA copies); the Mosaic backend by
tests/quant/test_mosaic_backend.py."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import blockwise_matmul as bw
from pallas_kernels import mgpu_nvfp4 as mg
from pallas_kernels import mgpu_nvfp4_layout as layout
from pallas_kernels import mgpu_nvfp4_tuning as tuning
from pallas_kernels import nvfp4_matmul
from tests.pallas_kernels import kernel_checks as kc

# The device the launches below are sized for (the model shapes' expected split counts are
# this one's): no GPU here to read them from.
FACTS = tuning.DeviceFacts(sm_count=132, smem_per_block=227 * 1024)
CONFIG = mg.TuningConfig(device=FACTS)


def cfg(**fields) -> mg.TuningConfig:
    return mg.TuningConfig(device=FACTS, **fields)


@pytest.fixture
def fresh_jit_caches():
    """Drops the jitted launches traced while a test replaced the kernel by a stand-in."""
    yield
    jax.clear_caches()


def _gate_up_pair(n: int, k: int, seed: int = 0):
    """(gate, up PackedWeights [n, k], their pair interleaved in blocks of 32 rows)."""
    gate, up = (kc.nvfp4_packed(n, k, seed=seed + i)[1] for i in (0, 1))
    return gate, up, bw.interleave_gate_up(gate, up, 32)

@pytest.mark.parametrize("n,k", [(200, 608), (64, 256), (130, 512)])
def test_permuted_layout_is_lossless_and_dequantizes_to_the_checkpoint(n, k):
    q, packed = kc.nvfp4_packed(n, k)
    permuted = layout.permute_packed(packed)
    k_tiles = -(-k // 256)
    assert permuted.shape == (packed.codes.shape[0] // 64 * k_tiles * 72, 128)
    codes, scales = layout.unpermute_tiles(permuted)
    assert jnp.array_equal(layout.permute_tiles(codes, scales), permuted)
    # back to the kernel layout (a single-copy weight's operand for the other kernels)
    rows = packed.codes.shape[0]
    back = layout.kernel_layout_from_permuted(permuted, rows=rows, k=k)
    assert jnp.array_equal(back[0], packed.codes) and jnp.array_equal(back[1], packed.scales)
    stacked = jnp.concatenate([permuted, permuted])  # a group's buffer: the second member
    back = layout.kernel_layout_from_permuted(stacked, rows=rows, k=k, line=permuted.shape[0])
    assert jnp.array_equal(back[0], packed.codes) and jnp.array_equal(back[1], packed.scales)
    with pytest.raises(ValueError, match="lines"):
        layout.kernel_layout_from_permuted(permuted, rows=rows, k=k, line=72)
    with pytest.raises(ValueError, match="multiple of 64"):
        layout.kernel_layout_from_permuted(permuted, rows=rows - 32, k=k)
    got = np.asarray(layout.permuted_dequantize_reference(permuted, packed.tensor_scale, n=n, k=k), np.float64)
    expected = kc.nvfp4_float64_weights(q)
    np.testing.assert_allclose(got, expected, rtol=2e-7, atol=0)  # float32 division


def test_kernel_bit_math_gives_the_weights():
    """Integer emulation of _decode_tile (rotations, masks, bf16x2 pattern x 2^126 x scale) on
    every thread's words gives the weights of each tile (e2m1 x block scale, before the
    tensor scale)."""
    q, packed = kc.nvfp4_packed(128, 512, seed=3)
    permuted = np.asarray(layout.permute_packed(packed)).reshape(-1, 72 * 128)
    codes, scale_codes = (np.asarray(a) for a in layout.unpermute_tiles(jnp.asarray(permuted)))
    scale_values = np.asarray(nvfp4_matmul.scale_values_from_codes(jnp.asarray(scale_codes), 0)
                              .astype(jnp.float32), np.float64)
    expected = kc.E2M1[codes] * np.repeat(scale_values, 16, axis=-1)

    def rotl(w, r):
        return ((w << np.uint64(r)) | (w >> np.uint64((32 - r) % 32))) & np.uint64(0xFFFFFFFF)

    def pair_bits(w, k):
        if k < 3:
            return rotl(w, (0, 6, 12)[k]) & np.uint64(0x81C081C0)
        return (rotl(w, 2) & np.uint64(0x00400040)) | (rotl(w, 10) & np.uint64(0x81808180))

    def bf16(bits):
        return (np.asarray(bits, np.uint32) << 16).view(np.float32).astype(np.float64)

    words = permuted[:, :8192].view(np.uint32).reshape(-1, 4, 128, 4)
    got = np.full(expected.shape, np.nan)
    for t in range(128):
        row0, lane_col = 16 * (t // 32) + (t % 32) // 4, t % 4
        for i in range(16):
            w = words[:, i // 4, t, i % 4].astype(np.uint64)
            for k, (c_half, h) in enumerate(layout.PAIR_SLOTS):
                bits = pair_bits(w, k)
                row, col = row0 + 8 * h, 16 * i + 8 * c_half + 2 * lane_col
                scale = scale_values[:, row, i]
                for half in (0, 1):
                    value = bf16((bits >> np.uint64(16 * half)) & np.uint64(0xFFFF))
                    got[:, row, col + half] = value * 2.0 ** 126 * scale
    np.testing.assert_array_equal(got, expected)


def test_lora_operand_folds_the_scales_into_b_transposed():
    """Split 0 adds lora_operand(B) @ down^T into the weight accumulator, which is rescaled by
    2^8 / tensor_scale: that must give lora_scale * down @ B (float64 reference; tolerance:
    the operand's bf16 rounding, 2^-8 relative per term) and zero rows past N."""
    rank, n, m = 32, 200, 5
    b = np.asarray(jax.random.normal(jax.random.key(1), (rank, n)), np.float64)
    down = np.asarray(jax.random.normal(jax.random.key(2), (m, rank)), np.float64)
    tensor_scale, lora_scale = 1234.5, 0.75
    bt = layout.lora_operand(jnp.asarray(b, jnp.float32), jnp.asarray([tensor_scale], jnp.float32),
                         lora_scale)
    assert bt.shape == (256, rank) and bt.dtype == jnp.bfloat16
    bt = np.asarray(bt.astype(jnp.float32), np.float64)
    assert not bt[n:].any()
    got = (bt[:n] @ down.T).T * 2.0 ** -layout.SCALED_EXPONENT / tensor_scale
    expected = lora_scale * down @ b
    bound = 2.0 ** -8 * lora_scale * np.abs(down) @ np.abs(b)
    assert np.all(np.abs(got - expected) <= bound)
    with pytest.raises(ValueError, match=r"lora_b \(24, 200\)"):
        layout.lora_operand(jnp.zeros((24, n)), jnp.ones((1,)))
    with pytest.raises(ValueError, match="n_pad=100"):
        layout.lora_operand(jnp.zeros((rank, n)), jnp.ones((1,)), n_pad=100)


@pytest.mark.parametrize("m,rank,splits,prepared", [(8, 0, None, False), (5, 32, 3, False),
                                                    (16, 16, 1, False), (8, 32, None, True)])
def test_kernel_lowers_for_cuda(m, rank, splits, prepared):
    n, k = 256, 1024
    _, packed = kc.nvfp4_packed(n, k)
    permuted = jax.ShapeDtypeStruct(layout.permute_packed(packed).shape, jnp.uint8)
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    args = [x, permuted, packed.tensor_scale]
    if rank:
        args += [jax.ShapeDtypeStruct((m, rank), jnp.bfloat16),
                 jax.ShapeDtypeStruct((n, rank) if prepared else (rank, n), jnp.bfloat16)]

    def f(x, permuted, ts, *lora):
        kwargs = {}
        if lora and prepared:
            kwargs = dict(lora_x_a=lora[0], lora_bt=lora[1])
        elif lora:
            kwargs = dict(lora_x_a=lora[0], lora_b=lora[1], lora_scale=2.0)
        return mg.mgpu_nvfp4_matmul(x, permuted, ts, n=n, k=k, config=cfg(splits=splits),
                                    **kwargs)

    lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
    assert lowered.out_info.shape == (m, n)


def test_refusals_and_bad_shapes():
    q, packed = kc.nvfp4_packed(64, 256)
    assert layout.refusal(packed) is None
    import dataclasses
    nf4_packed = dataclasses.replace(packed, fmt="nf4")  # (only the fields are read)
    assert "format nf4" in layout.refusal(nf4_packed)
    with pytest.raises(ValueError, match="format nf4"):
        layout.permute_packed(nf4_packed)
    permuted = layout.permute_packed(packed)
    with pytest.raises(ValueError, match=r"x \(8, 128\)"):
        mg.mgpu_nvfp4_matmul(jnp.zeros((8, 128), jnp.bfloat16), permuted, packed.tensor_scale,
                             n=64, k=256)
    with pytest.raises(ValueError, match="splits=3 for 1 K tiles"):
        mg.mgpu_nvfp4_matmul(jnp.zeros((8, 256), jnp.bfloat16), permuted, packed.tensor_scale,
                             n=64, k=256, config=cfg(splits=3))
    with pytest.raises(ValueError, match="operand None"):
        mg.matmul_unscaled(jnp.zeros((8, 256), jnp.bfloat16), permuted, n=64, k=256,
                           lora_x_a=jnp.zeros((8, 32), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"operand \(192, 32\)"):
        mg.mgpu_nvfp4_matmul(jnp.zeros((8, 256), jnp.bfloat16), permuted, packed.tensor_scale,
                             n=64, k=256, lora_x_a=jnp.zeros((8, 32), jnp.bfloat16),
                             lora_bt=jnp.zeros((192, 32), jnp.bfloat16))


def _swiglu_lowering_args(n: int, k: int, m: int):
    """Shapes of a fused SwiGLU launch over a [n, k] gate/up pair at M = m, LoRA r32 on each
    half: x, the pair's permuted buffer, the two tensor scales, x @ A, the pair operand, the
    next layer's LoRA A."""
    tiles = jax.ShapeDtypeStruct(layout.permute_packed(_gate_up_pair(n, k)[2]).shape, jnp.uint8)
    return (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), tiles,
            jax.ShapeDtypeStruct((1,), jnp.float32), jax.ShapeDtypeStruct((1,), jnp.float32),
            jax.ShapeDtypeStruct((m, 64), jnp.bfloat16),
            jax.ShapeDtypeStruct((2 * n, 64), jnp.bfloat16),
            jax.ShapeDtypeStruct((n, 32), jnp.bfloat16))


def test_swiglu_lowers_for_cuda():
    n, k, m = 128, 512, 8
    args = _swiglu_lowering_args(n, k, m)

    def f(x, tiles, ts_g, ts_u, down, operand, next_a):
        return mg.mgpu_nvfp4_swiglu(x, tiles, ts_g, ts_u, out_n=n, k=k, half_block=32,
                                    lora_x_a=down, lora_bt=operand, next_lora_a=next_a,
                                    config=CONFIG)

    lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
    assert [o.shape for o in lowered.out_info] == [(m, n), (m, 32)]
    # one split: the fused SwiGLU epilogue (with and without the next LoRA product)
    for with_next in (True, False):
        def fused(x, tiles, ts_g, ts_u, down, operand, next_a, with_next=with_next):
            return mg.mgpu_nvfp4_swiglu(x, tiles, ts_g, ts_u, out_n=n, k=k, half_block=32,
                                        lora_x_a=down, lora_bt=operand,
                                        next_lora_a=next_a if with_next else None,
                                        config=cfg(splits=1))
        lowered = jax.jit(fused).trace(*args).lower(lowering_platforms=("cuda",))
        text = lowered.as_text()
        assert "mosaic_gpu" in text
        shapes = jax.tree.map(lambda o: o.shape, lowered.out_info)
        assert shapes == (((m, n), (m, 32)) if with_next else (m, n)), shapes


def test_default_splits_at_the_model_shapes():
    """The fewest steps per program within 528 programs, then the fewest splits; splits need
    not divide the K tiles (7B's down projection: 74 K tiles, 9 splits of 8-9 tiles)."""
    assert tuning.default_splits(56, 74, device=FACTS) == 9  # 7B down (N 3584, K 18944)
    assert tuning.default_splits(56, 14, device=FACTS) == 7  # 7B q/o
    assert tuning.default_splits(592, 14, device=FACTS) == 1  # 7B gate|up pair
    assert tuning.default_splits(80, 20, device=FACTS) == 5  # 14B/32B q/o
    assert tuning.default_splits(112, 20, device=FACTS) == 4  # 14B/32B q|k|v grouped
    assert tuning.default_splits(80, 54, device=FACTS) == 6  # 14B down
    assert tuning.default_splits(80, 108, device=FACTS) == 6  # 32B down
    assert tuning.default_splits(864, 20, device=FACTS) == 1  # 32B gate|up pair
    for row_tiles in (1, 7, 56, 80, 300, 600):
        for k_tiles in (1, 3, 14, 37, 74, 108):
            splits = tuning.default_splits(row_tiles, k_tiles, device=FACTS)
            assert 1 <= splits <= k_tiles
            assert row_tiles * splits <= max(528, row_tiles)


def test_splits_follow_the_programs_shared_memory_lets_an_sm_hold():
    """Up to M = 24 an SM holds 4 programs (registers); from M = 32 their x tiles fill its
    shared memory first (3, then 2 at M = 48-64), and the splits shrink to one wave of those:
    the 7B shapes at M = 64 get the counts measured fastest there (q|k|v 3, down 4)."""
    tile_bytes = lambda m: 2 * (m * 256 * 2 + 72 * 128) + m * 64 * 4  # noqa: E731
    for m_pad in range(8, 65, 8):
        resident = tuning.resident_programs(m_pad, FACTS)
        assert resident == min(4, 227 * 1024 // tile_bytes(m_pad))
        for row_tiles, k_tiles in ((56, 74), (56, 14), (72, 14), (592, 14)):
            assert tuning.default_splits(row_tiles, k_tiles, device=FACTS, m=m_pad) == tuning.default_splits(
                row_tiles, k_tiles, device=FACTS, slots=132 * resident)
    assert [tuning.resident_programs(m, FACTS) for m in (8, 24, 32, 40, 48, 64)] == [4, 4, 3, 3, 2, 2]
    assert tuning.resident_programs(57, FACTS) == tuning.resident_programs(64, FACTS)  # x is padded to 8 rows
    assert tuning.default_splits(72, 14, device=FACTS, m=64) == 3  # 7B q|k|v at M = 64 (7 at M = 8)
    assert tuning.default_splits(56, 74, device=FACTS, m=64) == 4  # 7B down (9 at M = 8)
    assert tuning.default_splits(56, 14, device=FACTS, m=8) == tuning.default_splits(56, 14, device=FACTS) == 7
    assert tuning.l2_prefetch_for(jnp.zeros((56 * 14 * 72, 128), jnp.uint8), k=3584,
                                  m=64, config=CONFIG).splits == 4


@pytest.mark.parametrize("rank,splits", [(96, None), (48, 3), (192, 2)])
def test_kernel_lowers_with_grouped_operands_and_uneven_splits(rank, splits):
    """Operand widths of grouped launches (3r: 48, 96, 192; 64- and 32-byte swizzles) and
    splits that do not divide the K tiles (the skipped last step) lower for CUDA."""
    n, k, m = 384, 1792, 8  # 7 K tiles
    permuted = jax.ShapeDtypeStruct((n // 64 * 7 * layout.TILE_LINES, 128), jnp.uint8)
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), permuted,
            jax.ShapeDtypeStruct((m, rank), jnp.bfloat16),
            jax.ShapeDtypeStruct((n, rank), jnp.bfloat16))

    def f(x, permuted, down, operand):
        return mg.matmul_unscaled(x, permuted, n=n, k=k, lora_x_a=down, lora_bt=operand,
                                  config=cfg(splits=splits))

    lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
    assert lowered.out_info.shape == (m, n)


def test_group_lora_operand_is_block_diagonal():
    """group_lora_operand: member i's rows hold its lora_operand in its own columns, zeros in
    the others' (float64 check of the folding is lora_operand's test)."""
    keys = jax.random.split(jax.random.key(8), 3)
    ns, rank = (192, 64, 64), 16
    bs = [jax.random.normal(key, (rank, n)) for key, n in zip(keys, ns)]
    tss = [jnp.asarray([3.0]), jnp.asarray([0.5]), jnp.asarray([7.0])]
    operand = layout.group_lora_operand(bs, tss, (0.5, 0.5, 0.25), (256, 128, 128))
    assert operand.shape == (512, 48) and operand.dtype == jnp.bfloat16
    rows = 0
    for i, (b, ts, scale, n_pad) in enumerate(zip(bs, tss, (0.5, 0.5, 0.25), (256, 128, 128))):
        block = operand[rows:rows + n_pad]
        assert jnp.array_equal(block[:, 16 * i:16 * i + 16],
                               layout.lora_operand(b, ts, scale, n_pad=n_pad))
        assert not jnp.any(jnp.delete(block, np.arange(16 * i, 16 * i + 16), axis=1))
        rows += n_pad
    with pytest.raises(ValueError, match="sum to 24"):
        layout.group_lora_operand([jnp.zeros((8, 64))] * 3, tss, (1.0,) * 3, (64,) * 3)


def test_l2_prefetch_plans_and_lowering():
    """l2_prefetch_for: the next launch's grid and the tiles per program (at most its fewest
    steps); bad plans are refused; a launch with a plan lowers for CUDA (each mode)."""
    permuted = jnp.zeros((16 * 7 * layout.TILE_LINES, 128), jnp.uint8)  # N 1024, 7 K tiles
    plan = tuning.l2_prefetch_for(permuted, k=1792, config=CONFIG)
    assert (plan.row_tiles, plan.k_tiles, plan.splits) == (16, 7, tuning.default_splits(16, 7, device=FACTS))
    assert tuning.l2_prefetch_for(permuted, k=1792, config=cfg(splits=7), ahead=3).ahead == 1  # 1 step each
    assert tuning.l2_prefetch_for(permuted, k=1792, config=cfg(splits=2), ahead=3).ahead == 3
    with pytest.raises(ValueError, match="ahead=4"):
        tuning.l2_prefetch_for(permuted, k=1792, ahead=4, config=CONFIG)
    with pytest.raises(ValueError, match="contiguous_lines"):
        tuning.l2_prefetch_for(permuted, k=1792, contiguous_lines=permuted.shape[0] + 1,
                               config=CONFIG)
    n, k, m = 384, 1792, 8
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
            jax.ShapeDtypeStruct((n // 64 * 7 * layout.TILE_LINES, 128), jnp.uint8),
            jax.ShapeDtypeStruct(permuted.shape, jnp.uint8),
            jax.ShapeDtypeStruct((m, 32), jnp.bfloat16), jax.ShapeDtypeStruct((n, 32),
                                                                              jnp.bfloat16))
    extra = jnp.zeros((600, 96), jnp.bfloat16)  # a LoRA A: 3 boxes of up to 256 rows
    assert tuning.extra_prefetchable(extra) and not tuning.extra_prefetchable(jnp.zeros((8, 3)))
    with pytest.raises(ValueError, match="extra"):
        tuning.l2_prefetch_for(permuted, k=1792, extra=jnp.zeros((8, 300), jnp.bfloat16),
                               config=CONFIG)
    for mode in (dict(ahead=1, config=CONFIG), dict(ahead=3, config=cfg(splits=2)),
                 dict(contiguous_lines=5000, config=CONFIG),
                 dict(ahead=1, extra=extra, config=CONFIG)):
        def f(x, p, q, d, o, mode=mode):
            return mg.matmul_unscaled(x, p, n=n, k=k, lora_x_a=d, lora_bt=o,
                                      l2_prefetch=tuning.l2_prefetch_for(q, k=k, **mode),
                                      config=cfg(splits=3))
        lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
        assert "mosaic_gpu" in lowered.as_text() and lowered.out_info.shape == (m, n)


def test_fused_swiglu_epilogue_plumbing(monkeypatch, fresh_jit_caches):
    """mgpu_nvfp4_swiglu with one split takes the fused epilogue (SwigluEpilogue: the divisors,
    next_lora_a padded to the row tiles' 32 rows each) and sums the row tiles' shares; with the
    kernel replaced by a jnp stand-in that computes what swiglu_epilogue's docstring states,
    its outputs equal the XLA epilogue's (swiglu_epilogue_max_m 0) within bf16 rounding. The epilogue's own
    numbers are checked on the GPU (test_mgpu_nvfp4_gpu.py: the 32B SwiGLU launch against
    Triton's, the sampler)."""
    n, k, m, rank = 96, 512, 5, 16  # out_n 96: the next A is padded from 96 to 128 rows
    keys = jax.random.split(jax.random.key(12), 6)
    gate, up, pair = _gate_up_pair(n, k, seed=12)
    tiles = layout.permute_packed(pair)
    x = jax.random.normal(keys[2], (m, k)).astype(jnp.bfloat16)
    next_a = (jax.random.normal(keys[3], (n, rank)) * 0.1).astype(jnp.bfloat16)
    calls = []

    def stand_in(*args, **kwargs):
        calls.append(kwargs.get("swiglu"))
        return kc.mosaic_reference_unscaled(*args, **kwargs)

    monkeypatch.setattr(mg, "matmul_unscaled", stand_in)
    common = dict(out_n=n, k=k, half_block=32, next_lora_a=next_a)
    fused, fused_next = mg.mgpu_nvfp4_swiglu(x, tiles, gate.tensor_scale,
                                             up.tensor_scale, config=cfg(splits=1),
                                             **common)
    assert calls[-1] is not None and calls[-1].next_lora_a.shape == (128, rank)
    plain, plain_next = mg.mgpu_nvfp4_swiglu(x, tiles, gate.tensor_scale,
                                             up.tensor_scale,
                                             config=cfg(splits=1, swiglu_epilogue_max_m=0),
                                             **common)
    assert calls[-1] is None
    assert fused.shape == plain.shape == (m, n) and fused.dtype == jnp.bfloat16
    assert jnp.array_equal(fused, plain)  # the same roundings in the same order
    assert fused_next.shape == plain_next.shape == (m, rank)
    top = float(jnp.abs(plain_next).max())
    np.testing.assert_allclose(np.asarray(fused_next), np.asarray(plain_next), rtol=0,
                               atol=1e-5 * top)
    # more than one split, or blocks of other than 32 rows: the XLA epilogue
    mg.mgpu_nvfp4_swiglu(x, tiles, gate.tensor_scale, up.tensor_scale, out_n=n, k=k,
                         half_block=32, config=cfg(splits=2))
    assert calls[-1] is None
    monkeypatch.undo()  # the kernel's own argument checks
    with pytest.raises(ValueError, match="one split"):
        mg.matmul_unscaled(x, tiles, n=256, k=k, config=cfg(splits=2),
                           swiglu=mg.SwigluEpilogue(gate.tensor_scale, up.tensor_scale))


def test_identical_launches_lower_to_one_kernel():
    """Launches with the same static configuration (a model's layers) call one cached jitted
    kernel (_split_k_kernel): a program with 8 of them holds one Mosaic GPU module, lowered
    once; another configuration (other splits) adds a second."""
    n, k, m = 384, 1792, 8
    permuted = jax.ShapeDtypeStruct((n // 64 * 7 * layout.TILE_LINES, 128), jnp.uint8)

    def program(x, weights, down, operand):
        y = x
        for i, w in enumerate(weights):
            splits = 3 if i < 7 else 7
            y = mg.matmul_unscaled(y, w, n=n, k=k, lora_x_a=down, lora_bt=operand,
                                   config=cfg(splits=splits))
            y = jnp.tile(y, (1, -(-k // n)))[:, :k].astype(jnp.bfloat16)
        return y

    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), [permuted] * 8,
            jax.ShapeDtypeStruct((m, 32), jnp.bfloat16),
            jax.ShapeDtypeStruct((n, 32), jnp.bfloat16))
    text = jax.jit(program).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("kernel_hash") == 2  # splits 3 (7 launches) and splits 7 (1 launch)
    assert text.count("stablehlo.custom_call @mosaic_gpu_v2") == 2


def test_launch_schedule_and_its_splits():
    """"auto": split-K programs below WARP_SPECIALIZED_MIN_M rows and wherever two fit an SM's
    shared memory with their LoRA tiles; warp-specialized otherwise, where the row tiles pair
    up (odd counts stay split-K, also when it is asked for): at M = 64 the grouped q|k|v (r 96)
    and gate|up pair (r 64) launches, not r 32 or none. The warp-specialized splits fill one
    program per SM (132) with pairs of row tiles, the split-K ones resident_programs per SM; the
    L2 prefetch plan of the next launch takes that launch's splits; the pipeline is 3 deep
    where its shared memory fits, else 2."""
    assert tuning.WARP_SPECIALIZED_MIN_M == 33 and tuning.WS_COMPUTE_WARPGROUPS == 2
    assert [tuning.launch_schedule(64, 72, rank=r, config=CONFIG) for r in (None, 32, 64, 96)] == [
        "split_k", "split_k", "warp_specialized", "warp_specialized"]
    assert tuning.split_k_smem_bytes(64, 64) == 2 * (64 * 512 + 9216) + 64 * 256 + 128 * 128
    assert tuning.launch_schedule(32, 56, rank=192, config=CONFIG) == "split_k"
    assert tuning.launch_schedule(48, 56, rank=96, config=CONFIG) == "split_k"
    assert tuning.launch_schedule(48, 56, rank=192, config=CONFIG) == "warp_specialized"
    assert tuning.launch_schedule(64, 55, rank=96, config=CONFIG) == "split_k"
    assert tuning.launch_schedule(8, 56, config=cfg(schedule="warp_specialized")) == "warp_specialized"
    assert tuning.launch_schedule(64, 7, config=cfg(schedule="warp_specialized")) == "split_k"
    assert tuning.launch_schedule(64, 56, config=cfg(schedule="split_k")) == "split_k"
    with pytest.raises(ValueError, match="stream_k"):
        cfg(schedule="stream_k")
    # 7B launches at M = 64: gate|up pair, down, q|k|v, o
    assert [tuning.launch_splits(r, t, m=64, config=cfg(schedule="warp_specialized"))
            for r, t in ((592, 14), (56, 74), (72, 14), (56, 14))] == [1, 4, 3, 4]
    ws = dict(config=cfg(schedule="warp_specialized"))
    assert tuning.launch_splits(40, 14, m=40, **ws) == tuning.default_splits(20, 14, device=FACTS, slots=132) == 5
    assert tuning.launch_splits(40, 14, m=40, config=CONFIG) == tuning.default_splits(40, 14, device=FACTS, m=40) == 7
    assert tuning.launch_splits(40, 14, m=48, rank=192, config=CONFIG) == 5
    assert tuning.launch_splits(56, 74, m=8, config=CONFIG) == tuning.default_splits(56, 74, device=FACTS) == 9
    permuted = jnp.zeros((40 * 14 * layout.TILE_LINES, 128), jnp.uint8)
    assert tuning.l2_prefetch_for(permuted, k=3584, m=40, **ws).splits == 5
    assert tuning.l2_prefetch_for(permuted, k=3584, m=40, config=CONFIG).splits == 7
    assert tuning.l2_prefetch_for(permuted, k=3584, m=48, rank=192, config=CONFIG).splits == 5
    assert tuning.ws_stages(64, FACTS, 96) == tuning.ws_stages(64, FACTS, 64, swiglu=True) == 3
    assert tuning.ws_stages(64, FACTS, 192) == 2
    assert tuning.ws_smem_bytes(64, 3, 96) == 3 * (2 * 9216 + 64 * 512) + 2 * 64 * 256 + 192 * 192


def test_warp_specialized_kernel_lowers_for_cuda():
    """The warp-specialized kernel lowers for CUDA with every operand the split-K kernel
    takes: no LoRA, LoRA widths 32-192 (the 192-wide operand at 2 stages), splits that do not
    divide the K tiles, M not a multiple of 8, an L2 prefetch plan with an extra array, and the
    fused SwiGLU epilogue with and without the next LoRA product."""
    n, k = 384, 1792  # 6 row tiles, 7 K tiles
    def calls():
        info = mg._warp_specialized_kernel.cache_info()
        return info.hits + info.misses
    calls_before = calls()
    for m, rank, splits in ((64, 0, None), (40, 96, None), (57, 48, 3), (64, 192, 2)):
        args = [jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
                jax.ShapeDtypeStruct((n // 64 * 7 * layout.TILE_LINES, 128), jnp.uint8)]
        if rank:
            args += [jax.ShapeDtypeStruct((m, rank), jnp.bfloat16),
                     jax.ShapeDtypeStruct((n, rank), jnp.bfloat16)]

        def f(x, p, *lora, splits=splits):
            lora = dict(lora_x_a=lora[0], lora_bt=lora[1]) if lora else {}
            return mg.matmul_unscaled(x, p, n=n, k=k, **lora,
                                      config=cfg(splits=splits, schedule="warp_specialized"))

        lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
        assert "mosaic_gpu" in lowered.as_text() and lowered.out_info.shape == (m, n)
    m = 64
    following = jnp.zeros((16 * 7 * layout.TILE_LINES, 128), jnp.uint8)
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
            jax.ShapeDtypeStruct((n // 64 * 7 * layout.TILE_LINES, 128), jnp.uint8),
            jax.ShapeDtypeStruct(following.shape, jnp.uint8),
            jax.ShapeDtypeStruct((m, 32), jnp.bfloat16), jax.ShapeDtypeStruct((n, 32),
                                                                              jnp.bfloat16))

    def prefetching(x, p, q, d, o):
        plan = tuning.l2_prefetch_for(q, k=k, m=m, ahead=1,
                                      extra=jnp.zeros((600, 96), jnp.bfloat16), config=CONFIG)
        return mg.matmul_unscaled(x, p, n=n, k=k, lora_x_a=d, lora_bt=o, l2_prefetch=plan,
                                  config=cfg(schedule="warp_specialized"))

    lowered = jax.jit(prefetching).trace(*args).lower(lowering_platforms=("cuda",))
    assert lowered.out_info.shape == (m, n)
    n, k = 128, 512
    args = _swiglu_lowering_args(n, k, m)
    for with_next in (True, False):
        def fused(x, tiles, ts_g, ts_u, down, operand, next_a, with_next=with_next):
            return mg.mgpu_nvfp4_swiglu(x, tiles, ts_g, ts_u, out_n=n, k=k, half_block=32,
                                        lora_x_a=down, lora_bt=operand,
                                        next_lora_a=next_a if with_next else None,
                                        config=cfg(splits=1, schedule="warp_specialized"))
        lowered = jax.jit(fused).trace(*args).lower(lowering_platforms=("cuda",))
        shapes = jax.tree.map(lambda o: o.shape, lowered.out_info)
        assert shapes == (((m, n), (m, 32)) if with_next else (m, n)), shapes
    assert calls() - calls_before == 7  # every launch above took the warp-specialized kernel


def test_device_facts_come_from_the_device():
    """device_facts: the SM count from core_count, the shared memory per block from the device
    where it reports it, else its compute capability's; a device without an SM count (the CPU)
    is refused with the field to pass instead. TuningConfig's own fields are checked."""
    h100 = types.SimpleNamespace(platform="gpu", core_count=132, compute_capability="9.0")
    assert tuning.device_facts(h100) == tuning.DeviceFacts(132, 227 * 1024, 65536)
    h100.shared_memory_per_block_optin = 200 * 1024
    assert tuning.device_facts(h100).smem_per_block == 200 * 1024
    unknown = types.SimpleNamespace(platform="gpu", core_count=8, compute_capability="7.5")
    with pytest.raises(ValueError, match="compute capability 7.5"):
        tuning.device_facts(unknown)
    with pytest.raises(ValueError, match=r"TuningConfig\(device=DeviceFacts"):
        tuning.device_facts(jax.devices("cpu")[0])
    with pytest.raises(ValueError, match="has no SM count"):
        mg.TuningConfig().facts()  # no GPU here
    assert CONFIG.facts() is FACTS
    for fields, message in ((dict(splits=0), "TuningConfig.splits"),
                            (dict(stages=0), "TuningConfig.stages"),
                            (dict(swiglu_epilogue_max_m=-1), "swiglu_epilogue_max_m")):
        with pytest.raises(ValueError, match=message):
            mg.TuningConfig(**fields)
    with pytest.raises(ValueError, match="sm_count"):
        tuning.DeviceFacts(sm_count=0, smem_per_block=1024)
    # fewer SMs or less shared memory: fewer programs at once, so fewer splits
    small = tuning.DeviceFacts(sm_count=66, smem_per_block=227 * 1024)
    assert tuning.default_splits(56, 74, device=small) < tuning.default_splits(56, 74,
                                                                                device=FACTS)
    assert tuning.resident_programs(8, tuning.DeviceFacts(132, 64 * 1024)) == 2


def test_l2_prefetch_plan_is_a_pytree_of_its_arrays():
    """L2Prefetch passes through jit: its arrays are the leaves, its grid static."""
    buffer, extra = jnp.zeros((16 * 7 * 72, 128), jnp.uint8), jnp.zeros((600, 96), jnp.bfloat16)
    plan = tuning.l2_prefetch_for(buffer, k=1792, extra=extra, config=cfg(splits=3))
    leaves, treedef = jax.tree.flatten(plan)
    assert len(leaves) == 2 and leaves[0] is buffer and leaves[1] is extra
    again = jax.tree.unflatten(treedef, leaves)
    assert again == plan or (again.row_tiles, again.splits, again.ahead) == (16, 3, 2)
    got = jax.jit(lambda p: (p.buffer.shape[0], p.splits, p.ahead))(plan)
    assert got[1:] == (3, 2)


@pytest.mark.parametrize("m,rank,prepared", [(5, 0, False), (8, 32, False), (3, 16, True)])
def test_matmul_reference_is_the_checkpoint_product(m, rank, prepared):
    """mgpu_nvfp4_matmul_reference against float64: x @ W^T with the checkpoint's weights
    (float64 dequantization) plus the LoRA term through the kernel's bf16 operand; bound: float32
    summation, 2^-20 of the absolute product per element."""
    n, k = 200, 608
    q, packed = kc.nvfp4_packed(n, k, seed=21)
    permuted = layout.permute_packed(packed)
    keys = jax.random.split(jax.random.key(22), 3)
    x = jax.random.normal(keys[0], (m, k)).astype(jnp.bfloat16)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    w64 = kc.nvfp4_float64_weights(q)
    expected, bound = x64 @ w64.T, np.abs(x64) @ np.abs(w64).T
    kwargs = {}
    if rank:
        down = jax.random.normal(keys[1], (m, rank)).astype(jnp.bfloat16)
        lora_b = jax.random.normal(keys[2], (rank, n))
        operand = layout.lora_operand(lora_b, packed.tensor_scale, 0.5, n_pad=256)
        kwargs = (dict(lora_x_a=down, lora_bt=operand) if prepared
                  else dict(lora_x_a=down, lora_b=lora_b, lora_scale=0.5))
        bt64 = (np.asarray(operand.astype(jnp.float32), np.float64)[:n]
                * 2.0 ** -layout.SCALED_EXPONENT / float(packed.tensor_scale[0]))
        d64 = np.asarray(down.astype(jnp.float32), np.float64)
        expected, bound = expected + d64 @ bt64.T, bound + np.abs(d64) @ np.abs(bt64).T
    got = np.asarray(mg.mgpu_nvfp4_matmul_reference(x, permuted, packed.tensor_scale, n=n, k=k,
                                                    **kwargs), np.float64)
    assert got.shape == (m, n)
    assert np.all(np.abs(got - expected) <= 2.0 ** -20 * bound + 1e-30)
    unscaled = mg.matmul_unscaled_reference(x, permuted, n=n, k=k)
    assert unscaled.shape == (m, 256) and not np.asarray(unscaled[:, n:]).any()  # zero rows


def test_swiglu_reference_is_the_xla_epilogue_of_the_pair():
    """mgpu_nvfp4_swiglu_reference: silu(bf16(g)) * bf16(u) in bf16 from the float64 products
    of each half (gate and up rows of the interleaved pair) and its next-LoRA product; equal
    within one bf16 rounding of the output (2^-8 relative, and of |g|, |u| through the SwiGLU)."""
    n, k, m = 96, 512, 4
    gate, up, pair = _gate_up_pair(n, k, seed=31)
    tiles = layout.permute_packed(pair)
    x = jax.random.normal(jax.random.key(32), (m, k)).astype(jnp.bfloat16)
    next_a = (jax.random.normal(jax.random.key(33), (n, 16)) * 0.1).astype(jnp.bfloat16)
    out, out_next = mg.mgpu_nvfp4_swiglu_reference(x, tiles, gate.tensor_scale, up.tensor_scale,
                                                   out_n=n, k=k, half_block=32,
                                                   next_lora_a=next_a)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    g, u = (x64 @ kc.nvfp4_float64_weights(kc.nvfp4_packed(n, k, seed=31 + i)[0]).T
            for i in (0, 1))
    silu = g / (1.0 + np.exp(-g)) * u
    got = np.asarray(out.astype(jnp.float32), np.float64)
    tolerance = 2.0 ** -7 * (np.abs(silu) + np.abs(g) * np.abs(u) + np.abs(u)) + 1e-6
    assert out.shape == (m, n) and out.dtype == jnp.bfloat16
    assert np.all(np.abs(got - silu) <= tolerance)
    np.testing.assert_allclose(np.asarray(out_next), got @ np.asarray(
        next_a.astype(jnp.float32), np.float64), rtol=1e-5, atol=1e-5)
