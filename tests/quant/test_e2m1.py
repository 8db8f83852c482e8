"""E2M1 encode/decode and nibble packing against ml_dtypes' float4_e2m1fn (an independent
numpy implementation: round half to even, saturating at 6)."""

import secrets

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qerl_jax.quant.e2m1 import (E2M1_MAGNITUDES, e2m1_decode, e2m1_decode_numpy, e2m1_encode,
                                 pack_nibbles, unpack_nibbles)


def _reference_codes(values: np.ndarray) -> np.ndarray:
    """ml_dtypes float32 -> float4_e2m1fn bits (saturating), the expected codes."""
    return np.asarray(values, np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF


def test_every_level_encodes_to_its_own_code():
    levels = np.asarray(E2M1_MAGNITUDES, np.float32)
    values = np.concatenate([levels, -levels])
    expected = np.concatenate([np.arange(8), np.arange(8) | 8]).astype(np.uint8)
    np.testing.assert_array_equal(np.asarray(e2m1_encode(jnp.asarray(values))), expected)


def test_ties_round_to_even_and_neighbours_round_to_nearest():
    midpoints = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    # expected: the neighbour with the even index (0, 2, 2, 4, 4, 6, 6)
    np.testing.assert_array_equal(np.asarray(e2m1_encode(jnp.asarray(midpoints))),
                                  [0, 2, 2, 4, 4, 6, 6])
    above = np.nextafter(midpoints, np.float32(np.inf))
    below = np.nextafter(midpoints, np.float32(0))
    for values in (midpoints, -midpoints, above, -above, below, -below):
        np.testing.assert_array_equal(np.asarray(e2m1_encode(jnp.asarray(values))),
                                      _reference_codes(values), err_msg=str(values))


def test_saturates_at_six():
    values = np.array([6.0, 6.5, 7.9, 1e30, np.inf, -6.5, -np.inf], np.float32)
    np.testing.assert_array_equal(np.asarray(e2m1_encode(jnp.asarray(values))),
                                  [7, 7, 7, 7, 7, 15, 15])


def test_random_values_match_ml_dtypes_eagerly_and_under_jit():
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal(20000) * rng.choice([0.1, 1, 3, 10], 20000)).astype(np.float32)
    values = np.concatenate([values, rng.integers(-16, 17, 2000) / np.float32(4)])  # ties
    expected = _reference_codes(values)
    np.testing.assert_array_equal(np.asarray(e2m1_encode(jnp.asarray(values))), expected,
                                  err_msg=f"seed {seed}")
    np.testing.assert_array_equal(np.asarray(jax.jit(e2m1_encode)(jnp.asarray(values))),
                                  expected, err_msg=f"seed {seed}")
    bf16 = jnp.asarray(values).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(e2m1_encode(bf16)),
                                  _reference_codes(np.asarray(bf16, np.float32)),
                                  err_msg=f"seed {seed}")


def test_negative_mask_overrides_sign():
    values = jnp.asarray([-0.1, -0.1, 0.0, 1.0], jnp.float32)
    codes = e2m1_encode(values, negative=jnp.asarray([True, False, True, False]))
    np.testing.assert_array_equal(np.asarray(codes), [8, 0, 8, 2])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_all_codes(dtype):
    codes = np.arange(16, dtype=np.uint8)
    expected = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(e2m1_decode(jnp.asarray(codes), dtype),
                                             np.float32), expected)
    np.testing.assert_array_equal(e2m1_decode_numpy(codes), expected)
    np.testing.assert_array_equal(np.asarray(jax.jit(e2m1_decode)(jnp.asarray(codes))),
                                  expected)


def test_pack_order_and_round_trip():
    codes = jnp.asarray([[1, 2, 3, 4]], jnp.uint8)
    np.testing.assert_array_equal(np.asarray(pack_nibbles(codes)), [[0x21, 0x43]])
    np.testing.assert_array_equal(np.asarray(pack_nibbles(codes, first_in_high_nibble=True)),
                                  [[0x12, 0x34]])
    seed = secrets.randbits(32)
    random_codes = jnp.asarray(np.random.default_rng(seed).integers(0, 16, (5, 3, 64)),
                               jnp.uint8)
    for high_first in (False, True):
        packed = pack_nibbles(random_codes, first_in_high_nibble=high_first)
        assert packed.shape == (5, 3, 32) and packed.dtype == jnp.uint8
        np.testing.assert_array_equal(
            np.asarray(unpack_nibbles(packed, first_in_high_nibble=high_first)),
            np.asarray(random_codes), err_msg=f"seed {seed}")


def test_pack_rejects_odd_length():
    with pytest.raises(ValueError, match="even"):
        pack_nibbles(jnp.zeros((2, 3), jnp.uint8))
