"""MXFP4 kernels (pallas_kernels/mxfp4_matmul.py) in interpret mode vs the jnp reference."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import blockwise_matmul as bw
from pallas_kernels import mxfp4_matmul as mx
from tests.pallas_kernels import kernel_checks as kc


def make_checkpoint(rng, n, k):
    codes = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scales = rng.integers(100, 140, (n, k // 32), dtype=np.uint8)  # E8M0: 2^-27 .. 2^12
    return jnp.asarray(codes), jnp.asarray(scales)


MXFP4 = kc.FormatUnderTest(
    name="mxfp4", block=32, make_checkpoint=make_checkpoint, repack=mx.repack_mxfp4,
    unpack=mx.unpack_mxfp4, reference=mx.mxfp4_matmul_reference,
    reference_transposed=mx.mxfp4_matmul_transposed_reference,
    dequantize_reference=mx.mxfp4_dequantize_reference, matmul=mx.mxfp4_matmul,
    matmul_transposed=mx.mxfp4_matmul_transposed, dequantize=mx.mxfp4_dequantize)


def test_dequantize_reference_matches_float64_numpy():
    seed = kc.fresh_seed()
    rng = np.random.default_rng(seed)
    codes, scales = make_checkpoint(rng, 5, 64)
    c = np.asarray(codes)
    elements = np.stack([c & 15, c >> 4], axis=-1).reshape(5, 64)  # even k in the low nibble
    values = elements.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    scale = np.repeat(np.asarray(scales).view(ml_dtypes.float8_e8m0fnu).astype(np.float64), 32,
                      axis=1)
    np.testing.assert_allclose(np.asarray(mx.mxfp4_dequantize_reference(codes, scales)),
                               values * scale, rtol=1e-7, err_msg=f"seed={seed}")


def test_repack_is_lossless():
    kc.check_repack_roundtrip(MXFP4)


def test_plane_layout():
    kc.check_plane_layout(MXFP4, low_nibble_first=True)


@pytest.mark.parametrize("m", [1, 3, 16, 64, 300])
def test_matmul_default_config(m):
    kc.check_matmul(MXFP4, m)


@pytest.mark.parametrize("m,config", [
    (300, bw.MatmulConfig(block_m=64, block_n=32, split_k=1, weight_as_lhs=False)),
    (3, bw.MatmulConfig(block_m=16, block_n=32, split_k=2, weight_as_lhs=True,
                        clamp_rows=False)),
    (20, bw.MatmulConfig(block_m=32, block_n=64, split_k=1, weight_as_lhs=True,
                         group_dots=True)),
])
def test_matmul_variants(m, config):
    kc.check_matmul(MXFP4, m, config)


@pytest.mark.parametrize("m,config", [(3, None), (300, None),
                                      (300, bw.TransposedConfig(block_m=128, block_n=32))])
def test_matmul_transposed(m, config):
    kc.check_transposed(MXFP4, m, config)


def test_dequantize_kernel():
    kc.check_dequantize(MXFP4)


def test_leading_dims():
    kc.check_leading_dims(MXFP4)


def test_out_of_range_scale_rejected():
    codes = jnp.zeros((2, 32), jnp.uint8)
    with pytest.raises(ValueError, match="scale code 255"):
        mx.repack_mxfp4(codes, jnp.full((2, 2), 255, jnp.uint8))
    with pytest.raises(ValueError, match="uint8"):
        mx.repack_mxfp4(codes, jnp.zeros((2, 2), jnp.float32))


def test_tile_512_split_k_and_dequantize():
    """A 512 K tile (the --tile-k option of the rollout benchmarks), with split-K at decode M."""
    kc.check_matmul(MXFP4, 8, bw.MatmulConfig(block_m=16, block_n=64, split_k=2), tile_k=512,
                    k=960)  # 2 K tiles, the second ragged
    kc.check_dequantize(MXFP4, tile_k=512)
