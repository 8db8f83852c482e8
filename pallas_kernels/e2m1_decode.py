"""E2M1 (FP4) decoding: a plain table for references, and in-kernel decoders for Pallas.

The in-kernel decoders take one tile of kernel-layout code bytes (uint8 [R, H]; the low nibble of
byte j is element j of the tile's low plane, the high nibble element j of its high plane, see
`pallas_kernels.blockwise_matmul`) and return the two planes as bf16 values, unscaled, times a
power of two that the caller folds into the block scale:

* "fp8":   build the float8_e4m3fn bit pattern ((c&8)<<4)|((c&7)<<2) and convert: value =
           e2m1/64. Exact everywhere, E2M1 subnormals (+-0.5) included (the fp8 conversion handles
           them), so it is the decoder used in interpret mode on CPU.
* "ptx_scaled": inline PTX on packed registers (4 code bytes at a time: prmt, and, imad, and per
           pair of weights) builds the bf16 bit pattern ((c&8)<<12)|((c&7)<<6) = e2m1 * 2^-126,
           and one packed bf16 fma per pair of weights applies their block scales in the same asm
           block (`e2m1_scaled_planes`), instead of a scalar bf16 multiply per weight (the
           kernel's PTX showed Triton multiplying separately decoded planes by their scales one
           weight at a time). Its unscaled planes (`e2m1_planes`) are the patterns alone. Codes
           +-0.5 are bf16 subnormals there, which the GPU multiplies exactly. GPU-only: inline
           asm cannot be interpreted.
* "ptx_paired_scales": "ptx_scaled" with the scales arriving as packed bf16x2 patterns (s, s),
           one 32-bit value per weight (`e2m1_paired_scaled_planes`): the caller builds each
           pattern from an integer scale code with one integer multiply-add on the compact scale
           tile (NVFP4's canonical UE5M3 codes, pallas_kernels/nvfp4_matmul.py), so the kernel
           neither converts scales through float32 nor packs scaled weights into pairs. The two
           weights of a pair (consecutive k, one mma register) share the first one's scale, which
           holds where the 4 weights of one asm instance lie in one scale block (the fused decode
           kernel's operand layout; checked on the GPU). GPU-only; emulated in jnp on a CPU
           backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# E2M1 code = sign<<3 | index into these magnitudes (the E2M1 bit pattern itself).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = np.array(E2M1_MAGNITUDES + tuple(-v for v in E2M1_MAGNITUDES), dtype=np.float32)

# Power of two that each decoder's output carries (value = e2m1 * 2^DECODE_EXPONENT).
DECODE_EXPONENT = {"fp8": -6, "ptx_scaled": -126, "ptx_paired_scales": -126}
E2M1_DECODERS = tuple(DECODE_EXPONENT)


def e2m1_decode_reference(codes: jax.Array) -> jax.Array:
    """Table decode of E2M1 codes (any integer dtype, values 0..15) to float32."""
    return jnp.asarray(E2M1_VALUES)[codes.astype(jnp.int32) & 15]


def _planes_fp8(c):
    lo = ((c & 0x08) << 4) | ((c & 0x07) << 2)
    hi = (c & 0x80) | ((c >> 2) & 0x1C)
    to_bf16 = lambda b: lax.bitcast_convert_type(b, jnp.float8_e4m3fn).astype(jnp.bfloat16)
    return to_bf16(lo), to_bf16(hi)


# One instance gets 4 code bytes b0..b3 in $2 and writes 4 bf16 (2 per register, element 0 in
# the low half). prmt spreads bytes (b0, b1) into the two 16-bit halves; the masked nibble times
# (1<<12 | 1<<6) puts its sign bit at bit 15 and its 3 magnitude bits at 8..6 in one imad.
_ASM_LO = """{
.reg .b32 x, y, z;
mov.b32 z, 0;
prmt.b32 x, $2, z, 0x4140;
and.b32 y, x, 0x000F000F;
mul.lo.u32 y, y, 0x1040;
and.b32 $0, y, 0x81C081C0;
prmt.b32 x, $2, z, 0x4342;
and.b32 y, x, 0x000F000F;
mul.lo.u32 y, y, 0x1040;
and.b32 $1, y, 0x81C081C0;
}"""
# Same for the high nibbles: (h<<4) * (1<<8 | 1<<2) = h<<12 | h<<6.
_ASM_HI = _ASM_LO.replace("0x000F000F", "0x00F000F0").replace("0x1040", "0x104")


# 4 code bytes ($2) and the bf16 scales of their 4 weights of one plane ($3, $4; 2 per register,
# element 0 in the low half) -> the 4 scaled weights ($0, $1): each nibble becomes the e2m1 * 2^-126 bit
# pattern (e2m1 * 2^-126), then one fma.rn.bf16x2 by the scales with a -0 addend (an exact
# product, also for the subnormal patterns of +-0.5; sm_80+) scales two weights. One asm per
# plane: Pallas lowers an inline asm with one result only.
_ASM_SCALED_LO = """{
.reg .b32 x, y, z, nz;
mov.b32 z, 0;
mov.b32 nz, 0x80008000;
prmt.b32 x, $2, z, 0x4140;
and.b32 y, x, 0x000F000F;
mul.lo.u32 y, y, 0x1040;
and.b32 y, y, 0x81C081C0;
fma.rn.bf16x2 $0, y, $3, nz;
prmt.b32 x, $2, z, 0x4342;
and.b32 y, x, 0x000F000F;
mul.lo.u32 y, y, 0x1040;
and.b32 y, y, 0x81C081C0;
fma.rn.bf16x2 $1, y, $4, nz;
}"""
_ASM_SCALED_HI = _ASM_SCALED_LO.replace("0x000F000F", "0x00F000F0").replace("0x1040", "0x104")


def e2m1_scaled_planes(codes_tile: jax.Array, scale_lo: jax.Array, scale_hi: jax.Array):
    """\"ptx_scaled\": both planes of a kernel-layout byte tile uint8 [R, H], each multiplied by its
    bf16 scale tile [R, H] (one scale per weight, e.g. block scales broadcast over their
    blocks): (e2m1 * 2^-126 * scale_lo, e2m1 * 2^-126 * scale_hi), bf16 [R, H] each, rounded
    once (exact when the product fits bf16, as e2m1 * e4m3 * 2^k does). GPU-only."""
    if scale_lo.dtype != jnp.bfloat16 or scale_hi.dtype != jnp.bfloat16:
        raise ValueError(f"e2m1_scaled_planes: bf16 scales, got {scale_lo.dtype}, "
                         f"{scale_hi.dtype}")
    return _scaled_planes_asm(codes_tile, (_ASM_SCALED_LO, _ASM_SCALED_HI),
                              (scale_lo, scale_hi), "=r,=r,r,r,r")


def _scaled_planes_asm(codes_tile, asms, scales, constraints):
    """Runs one single-result asm per plane over (codes, that plane's scale operand), 4 codes
    per instance: bf16 [R, H] per plane."""
    from jax.experimental.pallas import triton as plgpu

    shape = jax.ShapeDtypeStruct(codes_tile.shape, jnp.bfloat16)
    outs = []
    for asm, scale in zip(asms, scales):
        [out] = plgpu.elementwise_inline_asm(asm, args=[codes_tile, scale],
                                             constraints=constraints, pack=4,
                                             result_shape_dtypes=[shape])
        outs.append(out)
    return tuple(outs)


# "ptx_paired_scales": as _ASM_SCALED_LO, but the scales come as one packed (s, s) bf16x2 register per weight
# ($3..$6 for the 4 weights): weights 0 and 1 are scaled by $3, weights 2 and 3 by $5.
_ASM_PAIRED_LO = _ASM_SCALED_LO.replace("fma.rn.bf16x2 $1, y, $4, nz;",
                                        "fma.rn.bf16x2 $1, y, $5, nz;")
_ASM_PAIRED_HI = _ASM_SCALED_HI.replace("fma.rn.bf16x2 $1, y, $4, nz;",
                                        "fma.rn.bf16x2 $1, y, $5, nz;")


def _paired_pattern_values(pairs: jax.Array) -> jax.Array:
    """float32 value of the low bf16 half of packed (s, s) patterns (uint32)."""
    return lax.bitcast_convert_type((pairs & 0xFFFF) << 16, jnp.float32)


def e2m1_paired_scaled_planes(codes_tile: jax.Array, pairs_lo: jax.Array, pairs_hi: jax.Array):
    """\"ptx_paired_scales\": both planes of a kernel-layout byte tile uint8 [R, H], each weight multiplied by
    the bf16 scale in its packed (s, s) pattern (uint32 [R, H] per plane, one per weight):
    (e2m1 * 2^-126 * s_lo, e2m1 * 2^-126 * s_hi), bf16 [R, H] each, rounded once by the fma
    (exact when the product fits bf16; a product below bf16's subnormal range is 0).

    On a GPU backend one inline-asm instance decodes 4 weights and scales each pair with the
    pattern of its first weight. Elsewhere (Pallas interpret mode on a CPU) the same arithmetic
    runs in jnp, in float32 (each product is exact there), each weight with its own pattern.
    """
    for pairs in (pairs_lo, pairs_hi):
        if pairs.dtype != jnp.uint32 or pairs.shape != codes_tile.shape:
            raise ValueError(f"e2m1_paired_scaled_planes: uint32 pairs of shape "
                             f"{codes_tile.shape}, got {pairs.dtype} {pairs.shape}")
    if jax.default_backend() != "gpu":
        lo, hi = _planes_fp8(codes_tile)  # e2m1 / 64, exact
        factor = 2.0 ** (6 - 126)  # applied last: e2m1 * 2^-126 alone can be subnormal
        return tuple((plane.astype(jnp.float32) * _paired_pattern_values(pairs) * factor
                      ).astype(jnp.bfloat16)
                     for plane, pairs in ((lo, pairs_lo), (hi, pairs_hi)))
    return _scaled_planes_asm(codes_tile, (_ASM_PAIRED_LO, _ASM_PAIRED_HI),
                              (pairs_lo, pairs_hi), "=r,=r,r,r,r,r,r")


def _planes_asm(c):
    from jax.experimental.pallas import triton as plgpu

    def run(asm):
        [out] = plgpu.elementwise_inline_asm(
            asm, args=[c], constraints="=r,=r,r", pack=4,
            result_shape_dtypes=[jax.ShapeDtypeStruct(c.shape, jnp.bfloat16)])
        return out

    return run(_ASM_LO), run(_ASM_HI)


def e2m1_planes(codes_tile: jax.Array, decoder: str):
    """Decodes a kernel-layout byte tile uint8 [R, H] into its two planes (bf16 [R, H] each).

    Returns (low plane, high plane) with value = e2m1 * 2^DECODE_EXPONENT[decoder].
    """
    if decoder == "fp8":
        return _planes_fp8(codes_tile)
    if decoder in ("ptx_scaled", "ptx_paired_scales"):
        return _planes_asm(codes_tile)
    raise ValueError(f"unknown E2M1 decoder {decoder!r}; expected one of {E2M1_DECODERS}")


def e2m1_planes_times_scales(codes_tile: jax.Array, scale_lo: jax.Array, scale_hi: jax.Array,
                             decoder: str, out_dtype):
    """Both planes of a kernel-layout byte tile uint8 [R, H], each multiplied by its scale tile
    [R, H] (one scale per weight) in out_dtype: (e2m1 * 2^DECODE_EXPONENT[decoder] * scale_lo,
    ... * scale_hi). "ptx_scaled" at bf16 scales inside its decode asm (e2m1_scaled_planes); every
    other decoder multiplies its planes after decoding."""
    if decoder == "ptx_scaled" and out_dtype == jnp.bfloat16:
        return e2m1_scaled_planes(codes_tile, scale_lo, scale_hi)
    planes = e2m1_planes(codes_tile, decoder)
    return tuple(plane.astype(out_dtype) * scale
                 for plane, scale in zip(planes, (scale_lo, scale_hi)))


def e2m1_values(codes_tile: jax.Array, aux_refs, decoder: str):
    """Unscaled planes for the group-scaled matmul: e2m1 exactly (e2m1/64 for "fp8")."""
    del aux_refs
    lo, hi = e2m1_planes(codes_tile, decoder)
    if DECODE_EXPONENT[decoder] == -126:  # bf16 pattern: one multiply makes it a normal number
        two_126 = jnp.asarray(2.0 ** 126, jnp.bfloat16)
        lo, hi = lo * two_126, hi * two_126
    return lo, hi
