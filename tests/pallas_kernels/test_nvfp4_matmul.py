"""NVFP4 kernels (pallas_kernels/nvfp4_matmul.py) in interpret mode vs the jnp reference."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import blockwise_matmul as bw
from pallas_kernels import nvfp4_matmul as nv
from pallas_kernels.e2m1_decode import e2m1_decode_reference
from tests.pallas_kernels import kernel_checks as kc


def make_checkpoint(rng, n, k):
    codes = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    # Block scales over the whole e4m3 range used in practice, subnormals (< 2^-6) included.
    scales = (2.0 ** rng.uniform(-9, 8, (n, k // 16))).astype(ml_dtypes.float8_e4m3fn)
    tensor_scale = np.float32(rng.uniform(0.5, 600))
    return jnp.asarray(codes), jnp.asarray(scales), jnp.asarray(tensor_scale)


NVFP4 = kc.FormatUnderTest(
    name="nvfp4", block=16, make_checkpoint=make_checkpoint, repack=nv.repack_nvfp4,
    unpack=nv.unpack_nvfp4, reference=nv.nvfp4_matmul_reference,
    reference_transposed=nv.nvfp4_matmul_transposed_reference,
    dequantize_reference=nv.nvfp4_dequantize_reference, matmul=nv.nvfp4_matmul,
    matmul_transposed=nv.nvfp4_matmul_transposed, dequantize=nv.nvfp4_dequantize)


def test_e2m1_table_matches_ml_dtypes():
    codes = np.arange(16, dtype=np.uint8)
    expected = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(e2m1_decode_reference(jnp.asarray(codes))), expected)


def test_dequantize_reference_matches_float64_numpy():
    seed = kc.fresh_seed()
    rng = np.random.default_rng(seed)
    codes, scales, ts = make_checkpoint(rng, 5, 64)
    c = np.asarray(codes)
    elements = np.stack([c & 15, c >> 4], axis=-1).reshape(5, 64)  # even k in the low nibble
    values = elements.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    expected = values * np.repeat(np.asarray(scales).astype(np.float64), 16, axis=1) / float(ts)
    np.testing.assert_allclose(np.asarray(nv.nvfp4_dequantize_reference(codes, scales, ts)),
                               expected, rtol=1e-6, err_msg=f"seed={seed}")


def test_repack_is_lossless():
    kc.check_repack_roundtrip(NVFP4)


def test_plane_layout():
    kc.check_plane_layout(NVFP4, low_nibble_first=True)


@pytest.mark.parametrize("m", [1, 3, 16, 64, 300])
def test_matmul_default_config(m):
    kc.check_matmul(NVFP4, m)


@pytest.mark.parametrize("m,config", [
    (300, bw.MatmulConfig(block_m=64, block_n=32, split_k=1, weight_as_lhs=True)),
    (300, bw.MatmulConfig(block_m=128, block_n=64, split_k=1, weight_as_lhs=False)),
    (3, bw.MatmulConfig(block_m=16, block_n=32, split_k=2, weight_as_lhs=True)),
    (3, bw.MatmulConfig(block_m=16, block_n=64, split_k=1, weight_as_lhs=False,
                        clamp_rows=False)),
    (20, bw.MatmulConfig(block_m=32, block_n=32, split_k=2, weight_as_lhs=False,
                         group_dots=True)),
    (64, bw.MatmulConfig(block_m=64, block_n=32, split_k=1, weight_as_lhs=True,
                         group_dots=True)),
])
def test_matmul_variants(m, config):
    kc.check_matmul(NVFP4, m, config)


@pytest.mark.parametrize("split", [2, 3])
def test_matmul_uneven_split_k(split):
    """5 K tiles (the last one ragged) over 2 or 3 splits: the last split gets the remainder."""
    config = bw.MatmulConfig(block_m=16, block_n=32, split_k=split, weight_as_lhs=False)
    kc.check_matmul(NVFP4, 3, config, k=5 * 128 - 16)


def test_matmul_split_k_leaving_a_split_empty_is_refused():
    _, x, packed = kc.random_problem(NVFP4, 0, 3, 80, 5 * 128, 128)
    with pytest.raises(ValueError, match="split_k"):
        NVFP4.matmul(x, packed, interpret=True,
                     config=bw.MatmulConfig(block_m=16, block_n=32, split_k=4))


def test_matmul_tile_256_and_wide_n():
    kc.check_matmul(NVFP4, 5, n=200, tile_k=256)


@pytest.mark.parametrize("m,config", [
    (3, None),
    (300, None),
    (300, bw.TransposedConfig(block_m=128, block_n=32)),
    (64, bw.TransposedConfig(block_m=64, block_n=64)),
])
def test_matmul_transposed(m, config):
    kc.check_transposed(NVFP4, m, config)


def test_dequantize_kernel():
    kc.check_dequantize(NVFP4)


def test_leading_dims():
    kc.check_leading_dims(NVFP4)


def test_bad_inputs_raise():
    codes = jnp.zeros((4, 32), jnp.uint8)
    with pytest.raises(ValueError, match="block_scales"):
        nv.repack_nvfp4(codes, jnp.zeros((4, 3), jnp.float8_e4m3fn), 1.0)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        nv.repack_nvfp4(codes, jnp.zeros((4, 4), jnp.float32), 1.0)
    packed = nv.repack_nvfp4(codes, jnp.ones((4, 4), jnp.float8_e4m3fn), 1.0, tile_k=128)
    with pytest.raises(ValueError, match="K="):
        nv.nvfp4_matmul(jnp.zeros((2, 32), jnp.bfloat16), packed, interpret=True)
    with pytest.raises(ValueError, match="decoder"):
        nv.nvfp4_matmul(jnp.zeros((2, 64), jnp.bfloat16), packed, interpret=True,
                        config=dataclasses.replace(bw.default_matmul_config(2, packed),
                                                   decoder="nope"))


def test_default_tilings_are_valid_and_split_narrow_decode_weights():
    """The default tiling always tiles the packed weight (every split gets a K tile), and at
    decode M it splits K of weights too narrow to fill the GPU (7B down: 56 N tiles -> 8 splits
    of 74 K tiles: ceil(640 / 56) = 12, at most DecodeTuning.max_split = 8) but not of wide
    ones (7B gate/up: 296 N tiles)."""
    def packed(n, k):
        codes = jax.ShapeDtypeStruct((-(-n // 128) * 128, -(-k // 256) * 128), jnp.uint8)
        return bw.PackedWeight(codes=codes, scales=None, tensor_scale=None, fmt="nvfp4", n=n,
                               k=k, tile_k=256)

    for n in (80, 512, 1024, 3584, 5120, 13824, 18944, 27648):
        for k in (256, 640, 3584, 5120, 13824, 18944, 27648):
            for m in (1, 2, 8, 16, 17, 64):
                config = bw.default_matmul_config(m, packed(n, k))
                k_tiles = -(-k // 256)
                assert bw.valid_split(config.split_k, k_tiles), (n, k, m, config)
    assert bw.default_matmul_config(8, packed(3584, 18944)).split_k == 8
    assert bw.default_matmul_config(8, packed(18944, 3584)).split_k == 1
    assert bw.default_matmul_config(128, packed(3584, 18944)).path == "dequantize"


@pytest.mark.parametrize("m,rank,config", [
    (3, 8, bw.MatmulConfig(block_m=16, block_n=32, split_k=1, weight_as_lhs=False)),
    (3, 32, bw.MatmulConfig(block_m=16, block_n=32, split_k=3, weight_as_lhs=False)),
    (20, 24, bw.MatmulConfig(block_m=32, block_n=64, split_k=2, weight_as_lhs=True)),
    (70, 16, bw.MatmulConfig(path="dequantize")),
])
def test_matmul_lora_epilogue(m, rank, config):
    """y = x @ W^T + scale * down @ B with the LoRA product added in the kernel's epilogue
    (N=80 ragged for block_n 32/64, ranks padded to powers of two >= 16, split-K adding it
    once), against the float32 reference plus the same LoRA term in float32."""
    seed = kc.fresh_seed()
    rng = np.random.default_rng(seed)
    ckpt, x, packed = kc.random_problem(NVFP4, seed, m, 80, 5 * 128 - 16, 128)
    down = jnp.asarray(rng.standard_normal((m, rank)), jnp.bfloat16)
    lora_b = jnp.asarray(rng.standard_normal((rank, 80)), jnp.bfloat16)
    y = bw.blockwise_matmul(x, packed, spec=nv.NVFP4, config=config, interpret=True,
                            poison_output=True, lora_x_a=down, lora_b=lora_b, lora_scale=0.5)
    reference = (np.asarray(nv.nvfp4_matmul_reference(x, *ckpt), np.float32)
                 + 0.5 * np.asarray(down, np.float32) @ np.asarray(lora_b, np.float32))
    kc.assert_close(y, jnp.asarray(reference, jnp.bfloat16), f"seed={seed} M={m} r={rank} {config}")


def test_matmul_lora_epilogue_shape_errors():
    _, x, packed = kc.random_problem(NVFP4, 0, 3, 80, 256, 128)
    with pytest.raises(ValueError, match="LoRA epilogue"):
        bw.blockwise_matmul(x, packed, spec=nv.NVFP4, interpret=True,
                            lora_x_a=jnp.zeros((3, 8), jnp.bfloat16),
                            lora_b=jnp.zeros((8, 81), jnp.bfloat16), lora_scale=1.0)


def test_tile_512_split_k_and_dequantize():
    """A 512 K tile (the --tile-k option of the rollout benchmarks), with split-K at decode M."""
    kc.check_matmul(NVFP4, 8, bw.MatmulConfig(block_m=16, block_n=64, split_k=2), tile_k=512,
                    k=960)  # 2 K tiles, the second ragged
    kc.check_dequantize(NVFP4, tile_k=512)


def test_decode_tuning_drives_the_default_config():
    def packed(n, k):
        return bw.PackedWeight(codes=jnp.zeros((n, k // 2), jnp.uint8),
                               scales=jnp.zeros((n, k // 16), jnp.float8_e4m3fn),
                               tensor_scale=jnp.ones((1,), jnp.float32), fmt="nvfp4", n=n, k=k,
                               tile_k=256)

    gate = packed(18944, 3584)
    assert bw.default_matmul_config(8, gate) == bw.default_matmul_config(8, gate,
                                                                         bw.DecodeTuning())
    tuning = bw.DecodeTuning(**bw.parse_tuning("block_n=32,num_warps=8,weight_as_lhs=true"))
    tuned = bw.default_matmul_config(8, gate, tuning)
    assert (tuned.block_n, tuned.num_warps, tuned.weight_as_lhs) == (32, 8, True)
    assert tuned.split_k == 1  # 592 N tiles >= 264: no split
    assert bw.default_matmul_config(32, gate, tuning).num_warps == 4  # only decode M is tuned
    assert bw.parse_tuning("decoder=ptx_scaled,num_stages=4") == {"decoder": "ptx_scaled", "num_stages": 4}
    with pytest.raises(ValueError, match="expected name=value"):
        bw.parse_tuning("block_size=3")
    with pytest.raises(ValueError, match="power of two"):
        bw.DecodeTuning(block_n=48)
    with pytest.raises(ValueError, match="row blocks"):  # row tiles lie in one 64-row block
        bw.DecodeTuning(block_n=128)
    # target_programs splits narrow weights: 7B down, 56 N tiles of 64
    assert bw.default_matmul_config(8, packed(3584, 18944), bw.DecodeTuning(num_warps=2)
                                    ).split_k == 8


@pytest.mark.parametrize("m,split,lora", [(3, 1, False), (5, 2, True), (20, 3, True)])
def test_grouped_matmul_equals_single_launches(m, split, lora):
    """q/k/v-like weights of different N (one ragged) in one launch: each output equals the
    single-weight kernel's under the same config, bit for bit (same tiles, same f32 order)."""
    seed = kc.fresh_seed()
    rng = np.random.default_rng(seed)
    k = 3 * 128
    problems = [kc.random_problem(NVFP4, seed + i, m, n, k, 128) for i, n in
                enumerate((96, 32, 40))]
    x = problems[0][1]
    packed = tuple(p[2] for p in problems)
    downs = bs = scales = stacked = None
    if lora:  # ranks 16 (a kernel rank) and 8, 4 (zero-padded to 16 by the wrapper)
        ranks = (16, 8, 4) if m != 20 else (16, 16, 16)
        downs = [jnp.asarray(rng.standard_normal((m, r)), jnp.bfloat16) for r in ranks]
        bs = [jnp.asarray(0.1 * rng.standard_normal((r, p.n)), jnp.bfloat16)
              for r, p in zip(ranks, packed)]
        scales = (0.5, 1.0, 2.0)
        stacked = jnp.concatenate(downs, axis=1)
    config = bw.MatmulConfig(block_m=max(16, bw.next_pow2(m)), block_n=32, split_k=split,
                             weight_as_lhs=False)
    ys = bw.blockwise_matmul_group(x, packed, spec=nv.NVFP4, config=config, interpret=True,
                                   poison_output=True, lora_x_a=stacked, lora_bs=bs,
                                   lora_scales=scales)
    for i, (p, y) in enumerate(zip(packed, ys)):
        single = bw.blockwise_matmul(x, p, spec=nv.NVFP4, config=config, interpret=True,
                                     lora_x_a=None if downs is None else downs[i],
                                     lora_b=None if bs is None else bs[i],
                                     lora_scale=0.0 if scales is None else scales[i])
        assert y.shape == (m, p.n) and y.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(single, np.float32),
                                      err_msg=f"member {i} seed={seed}")
        ref = np.asarray(x, np.float64) @ np.asarray(
            nv.nvfp4_dequantize_reference(*problems[i][0]), np.float64).T
        if downs is not None:
            ref = ref + scales[i] * (np.asarray(downs[i], np.float64)
                                     @ np.asarray(bs[i], np.float64))
        kc.assert_close(y, ref, f"grouped member {i} seed={seed}")


def test_grouped_matmul_default_config_and_errors():
    problems = [kc.random_problem(NVFP4, i, 4, n, 256, 128) for i, n in enumerate((80, 40))]
    packed = tuple(p[2] for p in problems)
    config = bw.default_group_matmul_config(4, packed)
    assert config.path == "fused" and config.block_m == 16
    ys = bw.blockwise_matmul_group(problems[0][1], packed, spec=nv.NVFP4, interpret=True)
    assert [y.shape for y in ys] == [(4, 80), (4, 40)]
    other_k = kc.random_problem(NVFP4, 9, 4, 40, 384, 128)[2]
    with pytest.raises(ValueError, match="same K"):
        bw.blockwise_matmul_group(problems[0][1], (packed[0], other_k), spec=nv.NVFP4,
                                  interpret=True)
    with pytest.raises(ValueError, match="LoRA B"):
        bw.blockwise_matmul_group(problems[0][1], packed, spec=nv.NVFP4, interpret=True,
                                  lora_x_a=jnp.zeros((4, 8), jnp.bfloat16),
                                  lora_bs=[jnp.zeros((8, 80), jnp.bfloat16)], lora_scales=(1.0,))
    with pytest.raises(ValueError, match="sum to 16"):
        bw.blockwise_matmul_group(problems[0][1], packed, spec=nv.NVFP4, interpret=True,
                                  lora_x_a=jnp.zeros((4, 12), jnp.bfloat16),
                                  lora_bs=[jnp.zeros((8, 80), jnp.bfloat16),
                                           jnp.zeros((8, 40), jnp.bfloat16)],
                                  lora_scales=(1.0, 1.0))


@pytest.mark.parametrize("m,ranks,weight_as_lhs,n", [(3, None, False, 80), (5, (8, 4), False, 96),
                                                     (16, (16, 16), True, 80)])
def test_interleaved_gate_up_swiglu_epilogue(m, ranks, weight_as_lhs, n):
    """blockwise_matmul_swiglu on interleave_gate_up(gate, up) (the experimental single-launch
    SwiGLU) against (1) the grouped launch's bf16 gate and up, then float32 silu(gate) * up:
    within one bf16 ulp (+ 2^-100: XLA flushes silu's f32 subnormals, gate < -87, to zero), and
    (2) the float64 SwiGLU of the exact products, within twice the kernel tolerance (a product
    of two products). N = 80 / 96 leave padding tiles that must not be stored."""
    seed = kc.fresh_seed()
    rng = np.random.default_rng(seed)
    k = 3 * 128
    problems = [kc.random_problem(NVFP4, seed + i, m, n, k, 128) for i in range(2)]
    x = problems[0][1]
    gate, up = (p[2] for p in problems)
    pair = bw.interleave_gate_up(gate, up, 32)
    assert pair.n == 2 * gate.codes.shape[0] and pair.tensor_scale.shape == (2,)
    downs = bs = None
    stacked = b_pair = None
    if ranks is not None:
        downs = [jnp.asarray(rng.standard_normal((m, r)), jnp.bfloat16) for r in ranks]
        bs = [jnp.asarray(0.1 * rng.standard_normal((r, n)), jnp.bfloat16) for r in ranks]
        stacked = jnp.concatenate(downs, axis=1)
        b_pair = bw.interleave_lora_b(bs[0], bs[1], gate.codes.shape[0], 32)
    config = bw.MatmulConfig(block_m=16, block_n=64, split_k=1, weight_as_lhs=weight_as_lhs)
    fused = bw.blockwise_matmul_swiglu(x, pair, spec=nv.NVFP4, out_n=n, half_block=32,
                                       config=config, interpret=True, poison_output=True,
                                       lora_x_a=stacked, lora_ranks=ranks, lora_b=b_pair,
                                       lora_scale=2.0)
    assert fused.shape == (m, n) and fused.dtype == jnp.bfloat16
    g, u = bw.blockwise_matmul_group(x, (gate, up), spec=nv.NVFP4, config=config, interpret=True,
                                     lora_x_a=stacked, lora_bs=bs,
                                     lora_scales=None if ranks is None else (2.0, 2.0))
    unfused = np.asarray((jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32))
                         .astype(jnp.bfloat16), np.float32)
    got = np.asarray(fused, np.float32)
    assert np.all(np.abs(got - unfused) <= np.abs(unfused) * 2.0 ** -7 + 2.0 ** -100), (
        f"seed={seed}")
    exact = []
    for i, problem in enumerate(problems):
        y = np.asarray(x, np.float64) @ np.asarray(
            nv.nvfp4_dequantize_reference(*problem[0]), np.float64).T
        if ranks is not None:
            y = y + 2.0 * (np.asarray(downs[i], np.float64) @ np.asarray(bs[i], np.float64))
        exact.append(y)
    kc.assert_close(fused, exact[0] / (1.0 + np.exp(-exact[0])) * exact[1],
                    f"interleaved SwiGLU seed={seed}", factor=2.0)
    with pytest.raises(ValueError, match="2 \\* half_block"):
        bw.blockwise_matmul_swiglu(x, pair, spec=nv.NVFP4, out_n=n, half_block=16,
                                   config=config, interpret=True)
    if ranks is not None:
        with pytest.raises(ValueError, match="lora_ranks"):
            bw.blockwise_matmul_swiglu(x, pair, spec=nv.NVFP4, out_n=n, half_block=32,
                                       interpret=True, lora_x_a=stacked, lora_b=b_pair)


@pytest.mark.parametrize("m,n,next_rank,ranks", [(3, 80, 8, None), (16, 128, 32, (16, 16))])
def test_swiglu_launch_writes_the_next_lora_x_a(m, n, next_rank, ranks):
    """blockwise_matmul_swiglu(next_lora_a=A) returns the same SwiGLU output bit for bit and
    y @ A from its per-tile float32 shares: against float64 products of the returned bf16 y and
    A, within 1e-6 of sum |y| |A| (float32 sums of exact bf16 products). N = 80 ends inside
    a tile (A's rows past N are not read); rank 8 is padded to the kernel rank 16."""
    seed = kc.fresh_seed()
    rng = np.random.default_rng(seed)
    k = 2 * 128
    problems = [kc.random_problem(NVFP4, seed + i, m, n, k, 128) for i in range(2)]
    x = problems[0][1]
    pair = bw.interleave_gate_up(problems[0][2], problems[1][2], 32)
    lora = {}
    if ranks is not None:
        downs = jnp.asarray(rng.standard_normal((m, sum(ranks))), jnp.bfloat16)
        bs = [jnp.asarray(0.1 * rng.standard_normal((r, n)), jnp.bfloat16) for r in ranks]
        lora = dict(lora_x_a=downs, lora_ranks=ranks, lora_scale=2.0,
                    lora_b=bw.interleave_lora_b(bs[0], bs[1], pair.n // 2, 32))
    a_next = jnp.asarray(rng.standard_normal((n, next_rank)), jnp.bfloat16)
    plain = bw.blockwise_matmul_swiglu(x, pair, spec=nv.NVFP4, out_n=n, half_block=32,
                                       interpret=True, **lora)
    y, next_down = bw.blockwise_matmul_swiglu(x, pair, spec=nv.NVFP4, out_n=n, half_block=32,
                                              interpret=True, poison_output=True,
                                              next_lora_a=a_next, **lora)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(plain, np.float32))
    assert next_down.shape == (m, next_rank) and next_down.dtype == jnp.float32
    y64, a64 = np.asarray(y, np.float64), np.asarray(a_next, np.float64)
    bound = 1e-6 * (np.abs(y64) @ np.abs(a64))
    assert np.all(np.abs(np.asarray(next_down, np.float64) - y64 @ a64) <= bound), f"seed={seed}"
    with pytest.raises(ValueError, match="next_lora_a"):
        bw.blockwise_matmul_swiglu(x, pair, spec=nv.NVFP4, out_n=n, half_block=32,
                                   interpret=True, next_lora_a=a_next[1:])


@pytest.mark.parametrize("m,n", [(5, 80), (70, 96)])
def test_pair_views_read_gate_and_up_in_place(m, n):
    """pair_view_of(interleave_gate_up(gate, up)) read in place by every kernel gives gate's and
    up's results bit for bit: the fused kernel (at M=5, with a LoRA epilogue and split-K), the
    dequantize path (M=70), the transposed kernel and the dequantize kernel. N = 80 / 96 end
    inside a half_block (padding rows of the pair are not read into the output)."""
    seed = kc.fresh_seed()
    rng = np.random.default_rng(seed)
    k = 3 * 128
    problems = [kc.random_problem(NVFP4, seed + i, m, n, k, 128) for i in range(2)]
    x = problems[0][1]
    plain = [p[2] for p in problems]
    pair = bw.interleave_gate_up(*plain, 32)
    views = [bw.pair_view_of(pair, half, n=n, tensor_scale=w.tensor_scale, half_block=32)
             for half, w in enumerate(plain)]
    down = jnp.asarray(rng.standard_normal((m, 8)), jnp.bfloat16)
    lora_b = jnp.asarray(0.1 * rng.standard_normal((8, n)), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    fused = bw.MatmulConfig(block_m=16, block_n=32, split_k=2)
    for half, (view, weight) in enumerate(zip(views, plain)):
        context = f"half {half} seed={seed}"
        assert view.n_pad == weight.codes.shape[0] and view.max_block_n == 32
        for config in (None, fused):
            got = bw.blockwise_matmul(x, view, spec=nv.NVFP4, config=config, interpret=True,
                                      poison_output=True, lora_x_a=down, lora_b=lora_b,
                                      lora_scale=0.5)
            want = bw.blockwise_matmul(x, weight, spec=nv.NVFP4,
                                       config=config or bw.default_matmul_config(m, view),
                                       interpret=True, lora_x_a=down, lora_b=lora_b,
                                       lora_scale=0.5)
            np.testing.assert_array_equal(np.asarray(got, np.float32),
                                          np.asarray(want, np.float32), err_msg=context)
        transposed = bw.TransposedConfig(block_m=16, block_n=32)
        np.testing.assert_array_equal(
            np.asarray(bw.blockwise_matmul_transposed(dy, view, spec=nv.NVFP4, config=transposed,
                                                      interpret=True, poison_output=True)),
            np.asarray(bw.blockwise_matmul_transposed(dy, weight, spec=nv.NVFP4,
                                                      config=transposed, interpret=True)),
            err_msg=context)
        np.testing.assert_array_equal(
            np.asarray(bw.blockwise_dequantize(view, spec=nv.NVFP4, interpret=True,
                                               poison_output=True)),
            np.asarray(bw.blockwise_dequantize(weight, spec=nv.NVFP4, interpret=True)),
            err_msg=context)
    if m <= 64:
        assert bw.default_matmul_config(m, views[0]).block_n <= 32
        with pytest.raises(ValueError, match="half_block 32"):
            bw.blockwise_matmul(x, views[0], spec=nv.NVFP4, interpret=True,
                                config=bw.MatmulConfig(block_m=16, block_n=64))
        with pytest.raises(ValueError, match="pair view"):
            bw.blockwise_matmul_group(x, tuple(views), spec=nv.NVFP4, interpret=True)
    with pytest.raises(ValueError, match="not a view"):
        bw.blockwise_matmul_swiglu(x, views[0], spec=nv.NVFP4, out_n=n, half_block=32,
                                   interpret=True)
    with pytest.raises(ValueError, match="plain weights"):
        bw.interleave_gate_up(views[0], views[1], 32)


# ----------------------------------------------------------------------------------------------
# Canonical scale codes of the kernel layout, and the "ptx_paired_scales" decoder's arithmetic


def _all_finite_nonnegative_e4m3():
    values = np.arange(128, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    return values[np.isfinite(values.astype(np.float32))]


def test_scale_codes_round_trip_every_e4m3_scale():
    """Every finite nonnegative e4m3 value (subnormals and 0 included) -> code -> the same byte,
    and the code's bf16 pattern times 2^-P is the scale's value exactly (float64), for the
    prescale exponents the decoders use."""
    scales = jnp.asarray(_all_finite_nonnegative_e4m3())
    codes = nv.kernel_scale_codes(scales)
    assert codes.dtype == jnp.uint8
    assert len(np.unique(np.asarray(codes))) == scales.size  # injective
    back = nv.checkpoint_scales(codes)
    np.testing.assert_array_equal(np.asarray(back).view(np.uint8),
                                  np.asarray(scales).view(np.uint8))
    expected = np.asarray(scales).astype(np.float64)
    for prescale in (0, 6, 118):
        values = np.asarray(nv.scale_values_from_codes(codes, prescale)).astype(np.float64)
        np.testing.assert_array_equal(values * 2.0 ** -prescale, expected, err_msg=str(prescale))


def test_scale_codes_refuse_negative_and_nan_scales():
    bad = jnp.asarray(np.array([1.0, -2.0, np.nan], np.float32).astype(ml_dtypes.float8_e4m3fn))
    assert int(nv.invalid_scale_count(bad)) == 2
    with pytest.raises(ValueError, match="finite and >= 0"):
        nv.kernel_scale_codes(bad)
    # -0 is a zero scale
    minus_zero = jnp.asarray(np.array([0x80], np.uint8).view(ml_dtypes.float8_e4m3fn))
    assert int(nv.kernel_scale_codes(minus_zero)[0]) == nv.ZERO_SCALE_CODE


def _bf16_pattern_value(pattern: np.ndarray) -> np.ndarray:
    """float64 value of bf16 bit patterns (uint16), subnormals included (numpy, no flushing)."""
    pattern = pattern.astype(np.int64)
    sign = np.where(pattern & 0x8000, -1.0, 1.0)
    exponent = (pattern >> 7) & 0xFF
    mantissa = pattern & 0x7F
    normal = (1 + mantissa / 128.0) * 2.0 ** (exponent.astype(np.float64) - 127)
    subnormal = mantissa / 128.0 * 2.0 ** -126
    assert (exponent < 255).all()
    return sign * np.where(exponent == 0, subnormal, normal)


def test_paired_scales_arithmetic_is_exact_for_every_code_and_scale():
    """The "ptx_paired_scales" asm in numpy: the e2m1 bf16 pattern ((c&8)<<12 | (c&7)<<6, what its
    prmt/and/mul/and yields per nibble) times the low half of the packed pair pattern, rounded
    once to bf16, is e2m1 * scale * 2^-8 for every (code, finite nonnegative scale), and 0 for
    zero scales; both halves of each pair pattern are equal."""
    scales = _all_finite_nonnegative_e4m3()
    pairs = np.asarray(nv.scale_pair_patterns(nv.kernel_scale_codes(jnp.asarray(scales))))
    low, high = pairs & 0xFFFF, pairs >> 16
    np.testing.assert_array_equal(low, high)
    scale_pattern = _bf16_pattern_value(low)
    codes = np.arange(16)
    weight_pattern = _bf16_pattern_value(((codes & 8) << 12) | ((codes & 7) << 6))
    np.testing.assert_array_equal(weight_pattern * 2.0 ** 126,
                                  np.asarray(e2m1_decode_reference(jnp.asarray(codes))))
    product = weight_pattern[:, None] * scale_pattern[None, :]
    rounded = product.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    expected = (np.asarray(e2m1_decode_reference(jnp.asarray(codes)), np.float64)[:, None]
                * scales.astype(np.float64)[None, :] * 2.0 ** -8)
    np.testing.assert_array_equal(rounded, expected)
    assert (np.abs(product[:, scales.astype(np.float32) == 0]) < 2.0 ** -200).all()


def test_paired_scales_decoder_in_interpret_mode():
    """The "ptx_paired_scales" data path (pair patterns expanded over the blocks, the paired decode, here
    in its jnp form on the CPU) against the float32 reference, zero scales included."""
    def with_zero_scales(rng, n, k):
        codes, scales, ts = make_checkpoint(rng, n, k)
        scales = np.array(scales)
        scales[rng.random(scales.shape) < 0.1] = 0
        return codes, jnp.asarray(scales), ts

    fmt = dataclasses.replace(NVFP4, make_checkpoint=with_zero_scales)
    for m, split in ((3, 1), (5, 2)):
        kc.check_matmul(fmt, m, bw.MatmulConfig(block_m=16, block_n=32, split_k=split,
                                                weight_as_lhs=False, decoder="ptx_paired_scales"))


def test_old_layout_scales_are_refused():
    codes, scales, ts = make_checkpoint(np.random.default_rng(0), 8, 64)
    packed = nv.repack_nvfp4(codes, scales, ts, tile_k=64)
    stale = dataclasses.replace(packed, scales=bw.pad_scales(
        scales, n_pad=packed.codes.shape[0], k_pad=64, block=16))
    with pytest.raises(ValueError, match="uint8"):
        nv.nvfp4_matmul(jnp.zeros((2, 64), jnp.bfloat16), stale, interpret=True)


def test_tile_major_layout_round_trip_and_contiguous_tiles():
    """tile_major keeps the [R, C] shape, row_major undoes it, and K tile kt of rows
    [w0, w0 + bn) is the contiguous row range tile_row(w0, kt, k_tiles) + [0, bn) of the
    [R * K tiles, tile columns] view (what the kernels read)."""
    rng = np.random.default_rng(0)
    rows, tile_cols, k_tiles = 3 * bw.TILE_ROWS, 8, 5
    a = jnp.asarray(rng.integers(0, 256, (rows, tile_cols * k_tiles)), jnp.uint8)
    tiled = bw.tile_major(a, tile_cols)
    assert tiled.shape == a.shape
    np.testing.assert_array_equal(bw.row_major(tiled, tile_cols), a)
    view = np.asarray(tiled).reshape(-1, tile_cols)
    for bn in (16, 32, 64):
        for w0 in range(0, rows, bn):
            for kt in range(k_tiles):
                r = int(bw.tile_row(jnp.int32(w0), kt, k_tiles))
                np.testing.assert_array_equal(
                    view[r:r + bn], np.asarray(a)[w0:w0 + bn, kt * tile_cols:(kt + 1) * tile_cols])
    with pytest.raises(ValueError, match="multiple of 64"):
        bw.tile_major(a[:100], tile_cols)
