"""NF4 weights (QLoRA, Dettmers et al. 2023, sec. 3) exactly as bitsandbytes makes them.

Per block of 64 consecutive elements (along K: for K a multiple of 64 these are bitsandbytes'
blocks of the flattened row-major tensor) with absmax a = max |w|:

  code = number of NF4_MIDPOINTS below clamp(w * (1 / a), -1, 1)   (nearest level, ties to
         the lower one; bitsandbytes 0.50 quantize_4bit, backends/default/ops.py)
  w'   = NF4_LEVELS[code] * a, in float32, then rounded once to the output dtype.

Packing is bitsandbytes': element 2j in the HIGH nibble of byte j (opposite of NVFP4/MXFP4).

Double quantization (QLoRA sec. 3, "compress_statistics=True", default here): the float32
absmaxes [N*K/64] (flattened) get their mean subtracted (`offset`, tensor_scale), then are
quantized in runs of 256 to uint8 codes of bitsandbytes' signed dynamic 8-bit map
(create_dynamic_map(), stored below as float32 bit patterns) with one float32 absmax per run
(double_quant_scales). The 8-bit code is the nearest map entry, ties to the lower one:
bucketize(clamp(x * (1 / run_absmax), -1, 1), midpoints), as bitsandbytes' pure-PyTorch
default backend does. Known divergences from bitsandbytes' CPU C kernel, which
tests/quant/test_nf4.py measures instead of asserting equality: (1) that kernel finds the
8-bit code with an approximate table-driven binary search (BinSearch Direct2) that sometimes
returns a farther neighbour (about 1 code in 1000, and a few tiny values near 0); (2) the
offset is a float32 mean; torch's summation order depends on the CPU's vector width and
threads, ours is a fixed pairwise tree (identical on every backend), so the two may differ in
the last bits. All-zero runs get the code of 0.0 here (bitsandbytes computes 0/0 there).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from qerl_jax.quant.e2m1 import pack_nibbles, unpack_nibbles
from qerl_jax.quant.nvfp4 import exact_divide
from qerl_jax.quant.formats import Format, register_format, validate_weight
from qerl_jax.quant.qarray import QuantizedWeight

NF4_BLOCK_SIZE = 64
DOUBLE_QUANT_BLOCK_SIZE = 256

# bitsandbytes' NF4 levels as float32 bit patterns (exact constants of
# bitsandbytes/backends/utils.py _NF4_QUANT_TABLE and csrc dDequantizeNF4).
NF4_LEVEL_BITS = np.array([
    0xBF800000, 0xBF3239B1, 0xBF066B30, 0xBECA32A0, 0xBE91A24D, 0xBE3D353F, 0xBDBA7871,
    0x00000000, 0x3DA2FAFF, 0x3E24CAE3, 0x3E7C04DD, 0x3EAD033A, 0x3EE1A4B8, 0x3F1007AB,
    0x3F3913B3, 0x3F800000], np.uint32)
NF4_LEVELS = NF4_LEVEL_BITS.view(np.float32)
# Decision boundaries, (level[i] + level[i+1]) / 2 evaluated in float32 as bitsandbytes does.
NF4_MIDPOINTS = ((NF4_LEVELS[:-1] + NF4_LEVELS[1:]) / np.float32(2)).astype(np.float32)

# bitsandbytes.functional.create_dynamic_map(signed=True) (sorted, float32 bit patterns).
DYNAMIC_MAP_BITS = np.array([
    0xBF7E3333, 0xBF7A999A, 0xBF770000, 0xBF736666, 0xBF6FCCCD, 0xBF6C3333, 0xBF68999A, 0xBF650000,
    0xBF616666, 0xBF5DCCCD, 0xBF5A3333, 0xBF56999A, 0xBF530000, 0xBF4F6666, 0xBF4BCCCD, 0xBF483333,
    0xBF44999A, 0xBF410000, 0xBF3D6666, 0xBF39CCCD, 0xBF363334, 0xBF32999A, 0xBF2F0000, 0xBF2B6666,
    0xBF27CCCD, 0xBF243334, 0xBF20999A, 0xBF1D0000, 0xBF196666, 0xBF15CCCD, 0xBF123334, 0xBF0E999A,
    0xBF0B0000, 0xBF076666, 0xBF03CCCC, 0xBF003333, 0xBEF93332, 0xBEF20000, 0xBEEACCCC, 0xBEE3999A,
    0xBEDC6666, 0xBED53333, 0xBECE0000, 0xBEC6CCCC, 0xBEBF999A, 0xBEB86666, 0xBEB13333, 0xBEAA0000,
    0xBEA2CCCC, 0xBE9B999A, 0xBE946666, 0xBE8D3334, 0xBE860000, 0xBE7D9999, 0xBE6F3333, 0xBE60CCCD,
    0xBE526666, 0xBE440000, 0xBE35999A, 0xBE273333, 0xBE18CCCD, 0xBE0A6666, 0xBDF80000, 0xBDDB3334,
    0xBDC9EB85, 0xBDC428F7, 0xBDBE6667, 0xBDB8A3D7, 0xBDB2E148, 0xBDAD1EB8, 0xBDA75C2A, 0xBDA1999A,
    0xBD9BD70A, 0xBD96147B, 0xBD9051EB, 0xBD8A8F5D, 0xBD84CCCD, 0xBD7E147B, 0xBD728F5D, 0xBD670A3D,
    0xBD5B851F, 0xBD500000, 0xBD447AE1, 0xBD38F5C3, 0xBD2D70A3, 0xBD21EB85, 0xBD166667, 0xBD0AE148,
    0xBCFEB852, 0xBCE7AE15, 0xBCD0A3D7, 0xBCB9999A, 0xBCA28F5D, 0xBC8B851F, 0xBC68F5C3, 0xBC3AE148,
    0xBC1F3B64, 0xBC160418, 0xBC0CCCCD, 0xBC039581, 0xBBF4BC6A, 0xBBE24DD3, 0xBBCFDF3B, 0xBBBD70A4,
    0xBBAB020D, 0xBB989374, 0xBB8624DD, 0xBB676C8A, 0xBB428F5C, 0xBB1DB22D, 0xBAF1A9FC, 0xBAA7EF9D,
    0xBA7765FF, 0xBA59E83E, 0xBA3C6A80, 0xBA1EECC1, 0xBA016F01, 0xB9C7E283, 0xB98CE705, 0xB923D70B,
    0xB8BA1F4B, 0xB88AEFB3, 0xB8378034, 0xB7B24206, 0xB70205FF, 0xB65A1A94, 0xB513A3B7, 0x00000000,
    0x3513A3B7, 0x365A1A94, 0x370205FF, 0x37B24206, 0x38378034, 0x388AEFB3, 0x38BA1F4B, 0x3923D70B,
    0x398CE705, 0x39C7E283, 0x3A016F01, 0x3A1EECC1, 0x3A3C6A80, 0x3A59E83E, 0x3A7765FF, 0x3AA7EF9D,
    0x3AF1A9FC, 0x3B1DB22D, 0x3B428F5C, 0x3B676C8A, 0x3B8624DD, 0x3B989374, 0x3BAB020D, 0x3BBD70A4,
    0x3BCFDF3B, 0x3BE24DD3, 0x3BF4BC6A, 0x3C039581, 0x3C0CCCCD, 0x3C160418, 0x3C1F3B64, 0x3C3AE148,
    0x3C68F5C3, 0x3C8B851F, 0x3CA28F5D, 0x3CB9999A, 0x3CD0A3D7, 0x3CE7AE15, 0x3CFEB852, 0x3D0AE148,
    0x3D166667, 0x3D21EB85, 0x3D2D70A3, 0x3D38F5C3, 0x3D447AE1, 0x3D500000, 0x3D5B851F, 0x3D670A3D,
    0x3D728F5D, 0x3D7E147B, 0x3D84CCCD, 0x3D8A8F5D, 0x3D9051EB, 0x3D96147B, 0x3D9BD70A, 0x3DA1999A,
    0x3DA75C2A, 0x3DAD1EB8, 0x3DB2E148, 0x3DB8A3D7, 0x3DBE6667, 0x3DC428F7, 0x3DC9EB85, 0x3DDB3334,
    0x3DF80000, 0x3E0A6666, 0x3E18CCCD, 0x3E273333, 0x3E35999A, 0x3E440000, 0x3E526666, 0x3E60CCCD,
    0x3E6F3333, 0x3E7D9999, 0x3E860000, 0x3E8D3334, 0x3E946666, 0x3E9B999A, 0x3EA2CCCC, 0x3EAA0000,
    0x3EB13333, 0x3EB86666, 0x3EBF999A, 0x3EC6CCCC, 0x3ECE0000, 0x3ED53333, 0x3EDC6666, 0x3EE3999A,
    0x3EEACCCC, 0x3EF20000, 0x3EF93332, 0x3F003333, 0x3F03CCCC, 0x3F076666, 0x3F0B0000, 0x3F0E999A,
    0x3F123334, 0x3F15CCCD, 0x3F196666, 0x3F1D0000, 0x3F20999A, 0x3F243334, 0x3F27CCCD, 0x3F2B6666,
    0x3F2F0000, 0x3F32999A, 0x3F363334, 0x3F39CCCD, 0x3F3D6666, 0x3F410000, 0x3F44999A, 0x3F483333,
    0x3F4BCCCD, 0x3F4F6666, 0x3F530000, 0x3F56999A, 0x3F5A3333, 0x3F5DCCCD, 0x3F616666, 0x3F650000,
    0x3F68999A, 0x3F6C3333, 0x3F6FCCCD, 0x3F736666, 0x3F770000, 0x3F7A999A, 0x3F7E3333, 0x3F800000,
], np.uint32)
DYNAMIC_MAP = DYNAMIC_MAP_BITS.view(np.float32)
DYNAMIC_MAP_MIDPOINTS = ((DYNAMIC_MAP[:-1] + DYNAMIC_MAP[1:])
                         / np.float32(2)).astype(np.float32)


def _count_below(values: jax.Array, boundaries: np.ndarray) -> jax.Array:
    """torch.bucketize(values, boundaries, right=False): #boundaries strictly below, uint8."""
    boundaries = jnp.asarray(boundaries)
    return jnp.sum(values[..., None] > boundaries, axis=-1).astype(jnp.uint8)


def _normalize(values: jax.Array, absmax: jax.Array) -> jax.Array:
    """clamp(values * (1 / absmax), -1, 1) with 0 for all-zero blocks (bitsandbytes clamps
    absmax to 1e-38, which gives 0 as well)."""
    safe = jnp.where(absmax > 0, absmax, 1.0)
    reciprocal = jnp.where(absmax > 0, exact_divide(1.0, safe), 0.0)
    return jnp.clip(values * reciprocal, -1.0, 1.0)


def _chunk_count(flat_size: int) -> int:
    return -(-flat_size // DOUBLE_QUANT_BLOCK_SIZE)


def pairwise_mean(values: jax.Array) -> jax.Array:
    """Mean of float32 [M] by a fixed pairwise tree (explicit adds), then a true division.

    The tree is spelled out so every backend adds in the same order: the offset, and so the
    whole quantized weight, is identical on CPU and GPU (a jnp.mean reduction order is not).
    """
    size = values.shape[0]
    total = values.astype(jnp.float32)
    while total.shape[0] > 1:
        if total.shape[0] % 2:
            total = jnp.pad(total, (0, 1))
        total = total[0::2] + total[1::2]
    return exact_divide(total[0], size)


def quantize_block_scales(absmax: jax.Array, offset: jax.Array | None = None):
    """Double quantization of absmax [M] float32 -> (uint8 codes [M], run absmax [ceil(M/256)],
    offset float32 []). `offset` defaults to the mean of absmax (bitsandbytes' choice)."""
    size = absmax.shape[0]
    offset = pairwise_mean(absmax) if offset is None else jnp.asarray(offset, jnp.float32)
    centered = absmax - offset
    padded = jnp.pad(centered, (0, _chunk_count(size) * DOUBLE_QUANT_BLOCK_SIZE - size))
    runs = padded.reshape(-1, DOUBLE_QUANT_BLOCK_SIZE)
    run_absmax = jnp.max(jnp.abs(runs), axis=-1)
    codes = _count_below(_normalize(runs, run_absmax[:, None]), DYNAMIC_MAP_MIDPOINTS)
    return codes.reshape(-1)[:size], run_absmax, offset


def dequantize_block_scales(codes: jax.Array, run_absmax: jax.Array,
                            offset: jax.Array) -> jax.Array:
    """uint8 codes [M] -> absmax [M] float32: dynamic_map[code] * run_absmax + offset."""
    size = codes.shape[0]
    padded = jnp.pad(codes, (0, run_absmax.shape[0] * DOUBLE_QUANT_BLOCK_SIZE - size))
    values = jnp.asarray(DYNAMIC_MAP)[padded.astype(jnp.int32)].reshape(
        -1, DOUBLE_QUANT_BLOCK_SIZE)
    return (values * run_absmax[:, None]).reshape(-1)[:size] + offset


@functools.partial(jax.jit, static_argnames=("double_quant",))
def _nf4_codes_and_scales(weight: jax.Array, double_quant: bool):
    rows, columns = weight.shape
    blocks = weight.astype(jnp.float32).reshape(rows, columns // NF4_BLOCK_SIZE, NF4_BLOCK_SIZE)
    absmax = jnp.max(jnp.abs(blocks), axis=-1)
    codes = _count_below(_normalize(blocks, absmax[..., None]), NF4_MIDPOINTS)
    packed = pack_nibbles(codes.reshape(rows, columns), first_in_high_nibble=True)
    if not double_quant:
        return packed, absmax, None, None
    scale_codes, run_absmax, offset = quantize_block_scales(absmax.reshape(-1))
    return packed, scale_codes.reshape(absmax.shape), offset, run_absmax


def nf4_quantize(weight: jax.Array, *, double_quant: bool = True, name: str = "weight",
                 check_finite: bool = True, dtype=None) -> QuantizedWeight:
    """Quantizes W [N, K] = [out, in] to NF4 with blocks of 64 along K (bitsandbytes layout).

    Args:
      weight: float32 or bfloat16 [N, K]; K must be a multiple of 64.
      double_quant: quantize the absmaxes to 8 bits in runs of 256 (QLoRA default).
      name: layer name used in error messages.
      check_finite: reject NaN/Inf (eager; pass False inside jit, see validate_weight).
      dtype: dequantization dtype recorded in the result (default: weight.dtype).
    Returns:
      QuantizedWeight(format="nf4"): codes uint8 [N, K/2] (even k in the HIGH nibble);
      block_scales float32 absmax [N, K/64], or with double_quant uint8 [N, K/64] plus
      double_quant_scales float32 [ceil(N*K/64/256)] and tensor_scale (offset) float32 [].
    """
    validate_weight(weight, block_size=NF4_BLOCK_SIZE, format_name="nf4", name=name,
                    check_finite=check_finite)
    codes, block_scales, offset, run_absmax = _nf4_codes_and_scales(weight, double_quant)
    return QuantizedWeight(codes=codes, block_scales=block_scales, tensor_scale=offset,
                           double_quant_scales=run_absmax, format="nf4",
                           shape=tuple(weight.shape), dtype=jnp.dtype(dtype or weight.dtype).name)


@functools.partial(jax.jit, static_argnames=("dtype",))
def _nf4_dequantize(codes, block_scales, offset, run_absmax, dtype):
    rows = codes.shape[0]
    if run_absmax is None:
        absmax = block_scales.astype(jnp.float32)
    else:
        absmax = dequantize_block_scales(block_scales.reshape(-1), run_absmax,
                                         offset).reshape(block_scales.shape)
    indices = unpack_nibbles(codes, first_in_high_nibble=True).astype(jnp.int32)
    values = jnp.asarray(NF4_LEVELS)[indices].reshape(rows, absmax.shape[1], NF4_BLOCK_SIZE)
    return (values * absmax[..., None]).reshape(rows, -1).astype(dtype)


def nf4_dequantize(quantized: QuantizedWeight, dtype=None) -> jax.Array:
    """NF4 QuantizedWeight -> W [N, K] in `dtype`: level[code] * absmax (float32), rounded once."""
    if quantized.format != "nf4":
        raise ValueError(f"nf4_dequantize got a {quantized.format!r} QuantizedWeight")
    return _nf4_dequantize(quantized.codes, quantized.block_scales, quantized.tensor_scale,
                           quantized.double_quant_scales, jnp.dtype(dtype or quantized.dtype))


register_format(Format(
    name="nf4", bits=4, block_size=NF4_BLOCK_SIZE,
    bytes_per_parameter=0.5 + 1 / NF4_BLOCK_SIZE + 4 / (NF4_BLOCK_SIZE * DOUBLE_QUANT_BLOCK_SIZE),
    quantize=nf4_quantize, dequantize=nf4_dequantize,
    description="NormalFloat4 + absmax per 64, double-quantized (bitsandbytes / QLoRA)"))
