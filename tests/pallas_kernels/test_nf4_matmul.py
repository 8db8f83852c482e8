"""NF4 kernels (pallas_kernels/nf4_matmul.py) in interpret mode vs the jnp reference."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import blockwise_matmul as bw
from pallas_kernels import nf4_matmul as nf
from tests.pallas_kernels import kernel_checks as kc


def make_checkpoint(rng, n, k):
    codes = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    absmax = rng.uniform(0.005, 0.3, (n, k // 64)).astype(np.float32)
    return jnp.asarray(codes), jnp.asarray(absmax)


NF4 = kc.FormatUnderTest(
    name="nf4", block=64, make_checkpoint=make_checkpoint, repack=nf.repack_nf4,
    unpack=nf.unpack_nf4, reference=nf.nf4_matmul_reference,
    reference_transposed=nf.nf4_matmul_transposed_reference,
    dequantize_reference=nf.nf4_dequantize_reference, matmul=nf.nf4_matmul,
    matmul_transposed=nf.nf4_matmul_transposed, dequantize=nf.nf4_dequantize)


def test_dequantize_reference_matches_float64_numpy():
    seed = kc.fresh_seed()
    rng = np.random.default_rng(seed)
    codes, absmax = make_checkpoint(rng, 5, 128)
    c = np.asarray(codes)
    elements = np.stack([c >> 4, c & 15], axis=-1).reshape(5, 128)  # first element: HIGH nibble
    levels = nf.NF4_LEVELS.astype(np.float64)[elements]
    expected = levels * np.repeat(np.asarray(absmax, np.float64), 64, axis=1)
    np.testing.assert_allclose(np.asarray(nf.nf4_dequantize_reference(codes, absmax)), expected,
                               rtol=1e-6, err_msg=f"seed={seed}")


def test_double_quant_undo_matches_numpy():
    seed = kc.fresh_seed()
    rng = np.random.default_rng(seed)
    code = np.sort(rng.uniform(-1, 1, 256)).astype(np.float32)
    q = rng.integers(0, 256, 600).astype(np.uint8)
    nested = rng.uniform(0.01, 1, 3).astype(np.float32)
    expected = code[q] * np.repeat(nested, 256)[:600] + np.float32(0.25)
    np.testing.assert_allclose(np.asarray(nf.nf4_absmax_from_double_quant(q, nested, code, 0.25)),
                               expected, rtol=1e-6, err_msg=f"seed={seed}")


def test_repack_is_lossless():
    kc.check_repack_roundtrip(NF4)


def test_plane_layout():
    kc.check_plane_layout(NF4, low_nibble_first=False)


@pytest.mark.parametrize("m", [1, 3, 16, 64, 300])
def test_matmul_default_config(m):
    kc.check_matmul(NF4, m)


@pytest.mark.parametrize("m,config", [
    (300, bw.MatmulConfig(block_m=64, block_n=32, split_k=1, weight_as_lhs=True)),
    (3, bw.MatmulConfig(block_m=16, block_n=32, split_k=1, weight_as_lhs=False,
                        decoder="select", clamp_rows=False)),
    (3, bw.MatmulConfig(block_m=16, block_n=32, split_k=2, weight_as_lhs=True,
                        decoder="lut16")),
    (20, bw.MatmulConfig(block_m=32, block_n=64, split_k=1, weight_as_lhs=True,
                         group_dots=True)),
])
def test_matmul_variants(m, config):
    kc.check_matmul(NF4, m, config)


@pytest.mark.parametrize("m,config", [(3, None), (300, None),
                                      (64, bw.TransposedConfig(block_m=64, block_n=32))])
def test_matmul_transposed(m, config):
    kc.check_transposed(NF4, m, config)


def test_dequantize_kernel():
    kc.check_dequantize(NF4)


def test_leading_dims():
    kc.check_leading_dims(NF4)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="absmax"):
        nf.repack_nf4(jnp.zeros((2, 64), jnp.uint8), jnp.zeros((2, 3), jnp.float32))
    with pytest.raises(ValueError, match="tile_k"):
        nf.repack_nf4(jnp.zeros((2, 64), jnp.uint8), jnp.zeros((2, 2), jnp.float32), tile_k=64)


def test_tile_512_split_k_and_dequantize():
    """A 512 K tile (the --tile-k option of the rollout benchmarks), with split-K at decode M."""
    kc.check_matmul(NF4, 8, bw.MatmulConfig(block_m=16, block_n=64, split_k=2), tile_k=512,
                    k=960)  # 2 K tiles, the second ragged
    kc.check_dequantize(NF4, tile_k=512)

