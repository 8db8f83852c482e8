"""E2M1 (FP4) element codes shared by NVFP4 and MXFP4: encode, decode, nibble packing.

An E2M1 code is 4 bits, sign << 3 | index, where index points into
E2M1_MAGNITUDES = [0, 0.5, 1, 1.5, 2, 3, 4, 6]; that index is exactly the E2M1 bit pattern
(2 exponent bits, 1 mantissa bit, exponent bias 1).

Encoding is computed explicitly on the codes (threshold counting on |x|), never through a
float4 cast round trip: XLA on the GPU was observed to fold `x.astype(float4).astype(f32)`
away inside jit, which silently skips the rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
SIGN_BIT = 0x8


def e2m1_encode(scaled: jax.Array, negative: jax.Array | None = None) -> jax.Array:
    """Rounds to the nearest E2M1 value (ties to even), saturating at +-6; returns 4-bit codes.

    Args:
      scaled: values already divided by their block scale [...] (any float dtype).
      negative: optional bool mask [...] for the sign bit. Defaults to the sign bit of
        `scaled` (IEEE conversion: -0.0 and small negatives give code 0x8, "-0"). The
        quantizers pass their own mask to reproduce a reference's convention for zeros.
    Returns:
      uint8 codes in [0, 15], same shape as `scaled`.
    """
    magnitude = jnp.abs(scaled.astype(jnp.float32))
    # Midpoints between neighbouring magnitudes; '>' where the lower neighbour has the even
    # index (a tie rounds down), '>=' where the upper one does (a tie rounds up). Anything
    # above 5 (including inf) saturates to index 7 = 6.0.
    index = ((magnitude > 0.25).astype(jnp.uint8)
             + (magnitude >= 0.75).astype(jnp.uint8)
             + (magnitude > 1.25).astype(jnp.uint8)
             + (magnitude >= 1.75).astype(jnp.uint8)
             + (magnitude > 2.5).astype(jnp.uint8)
             + (magnitude >= 3.5).astype(jnp.uint8)
             + (magnitude > 5.0).astype(jnp.uint8))
    if negative is None:
        negative = jnp.signbit(scaled)
    return index | jnp.where(negative, jnp.uint8(SIGN_BIT), jnp.uint8(0))


def e2m1_decode(codes: jax.Array, dtype=jnp.float32) -> jax.Array:
    """4-bit codes [...] (uint8, values 0..15) -> float values [...] in `dtype` (exact).

    Table-free: the code's sign/exponent/mantissa bits are moved into an FP8 E4M3 bit pattern
    ((c & 8) << 4 | (c & 7) << 2), which is the E2M1 value / 64 (E2M1 subnormals land on E4M3
    subnormals), then converted and multiplied by 64. No subnormal float32 appears.
    """
    codes = codes.astype(jnp.uint8)
    fp8_bits = ((codes & 0x8) << 4) | ((codes & 0x7) << 2)
    fp8 = jax.lax.bitcast_convert_type(fp8_bits, jnp.float8_e4m3fn)
    return (fp8.astype(jnp.float32) * 64.0).astype(dtype)


def pack_nibbles(codes: jax.Array, *, first_in_high_nibble: bool = False) -> jax.Array:
    """Packs 4-bit codes [..., 2n] into bytes [..., n] (uint8).

    By default element 2j goes to the LOW nibble of byte j and element 2j+1 to the high nibble
    (compressed-tensors / vLLM NVFP4 and MXFP4). `first_in_high_nibble=True` is the
    bitsandbytes order (element 2j in the high nibble).
    """
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles needs an even last dimension, got shape {codes.shape}")
    codes = codes.astype(jnp.uint8)
    even, odd = codes[..., 0::2], codes[..., 1::2]
    if first_in_high_nibble:
        return (even << 4) | (odd & 0xF)
    return (even & 0xF) | (odd << 4)


def unpack_nibbles(packed: jax.Array, *, first_in_high_nibble: bool = False) -> jax.Array:
    """Bytes [..., n] (uint8) -> 4-bit codes [..., 2n] (uint8); inverse of pack_nibbles."""
    packed = packed.astype(jnp.uint8)
    low, high = packed & 0xF, packed >> 4
    first, second = (high, low) if first_in_high_nibble else (low, high)
    return jnp.stack([first, second], axis=-1).reshape(*packed.shape[:-1],
                                                        2 * packed.shape[-1])


def e2m1_decode_numpy(codes: np.ndarray) -> np.ndarray:
    """Reference decode in numpy (float32), for tests and host-side tools."""
    codes = np.asarray(codes, np.uint8)
    magnitude = np.asarray(E2M1_MAGNITUDES, np.float32)[codes & 0x7]
    return np.where(codes & SIGN_BIT, -magnitude, magnitude).astype(np.float32)
