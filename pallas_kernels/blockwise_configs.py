"""Tilings of the blockwise Pallas kernels (`MatmulConfig`, `TransposedConfig`,
`DequantizeConfig`), the decode tuning a config can override (`DecodeTuning`), and the
default tiling per M and weight shape.
"""

from __future__ import annotations

import dataclasses


from pallas_kernels.blockwise_layout import TILE_ROWS, PackedWeight, cdiv
from pallas_kernels.e2m1_decode import E2M1_DECODERS


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """Tiling of y = x @ W^T. path: "fused" (one kernel) or "dequantize" (bf16 W + XLA dot).

    group_dots: one dot per scale block (K = block size) on unscaled values, the block scale
    applied to its f32 result (no per-weight scale multiply, no scale broadcast).
    clamp_rows: when M is not a multiple of block_m, read activation rows min(r, M-1) (a gather
    with no mask; the extra rows repeat the last one and are not stored) instead of masked
    loads. Off by default: masked rows were as fast or faster on most layer shapes measured
    (docs/decisions.md).
    """
    block_m: int = 16
    block_n: int = 64
    split_k: int = 1
    weight_as_lhs: bool = True
    num_warps: int = 4
    num_stages: int = 3
    decoder: str | None = None  # None: the format's interpret/GPU default
    path: str = "fused"
    group_dots: bool = False
    clamp_rows: bool = False


@dataclasses.dataclass(frozen=True)
class TransposedConfig:
    """Tiling of dx = dy @ W: block_m rows of dy, one layout K tile per program, block_n steps."""
    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    decoder: str | None = None
    path: str = "fused"


@dataclasses.dataclass(frozen=True)
class DequantizeConfig:
    block_n: int = 64
    tiles_per_program: int = 1
    num_warps: int = 4
    num_stages: int = 1


def next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def valid_split(split: int, k_tiles: int) -> bool:
    """Every one of `split` splits of ceil(k_tiles / split) K tiles gets at least one tile."""
    return split >= 1 and (split - 1) * cdiv(k_tiles, split) < k_tiles


@dataclasses.dataclass(frozen=True)
class DecodeTuning:
    """What default_matmul_config picks at decode M (M <= 16); a caller passes it (the model's
    from config.quant.kernels.decode_matmul, qerl_jax.quant.kernel_options).

    target_programs: split-K is chosen so the launch has about this many programs (about 5
      waves of a 132-SM Hopper GPU; the sweep behind the value is in docs/decisions.md);
      min_tiles_per_split: the fewest K tiles a split-K program keeps (from the decode-shape
      sweep: benchmarks/kernels.py --decode-sweep). no_split_programs: N tiles
      alone at or above this many programs: no split.
    block_n (a power of two from 16 to TILE_ROWS = 64: a row tile lies in one block of the
      tile-major layout), num_warps, num_stages, weight_as_lhs (None: per format, see
      default_matmul_config), decoder (None: the format's GPU default): as in MatmulConfig.
    """
    target_programs: int = 640
    min_tiles_per_split: int = 4
    no_split_programs: int = 264
    max_split: int = 8
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    weight_as_lhs: bool | None = None
    decoder: str | None = None

    def __post_init__(self):
        if self.block_n < 16 or self.block_n > TILE_ROWS or self.block_n & (self.block_n - 1):
            raise ValueError(f"DecodeTuning.block_n={self.block_n}: a power of two from 16 to "
                             f"{TILE_ROWS} (the kernel layout's row blocks)")
        if self.max_split < 1 or self.min_tiles_per_split < 1:
            raise ValueError(f"DecodeTuning {self}: max_split and min_tiles_per_split must be "
                             ">= 1")


def parse_tuning(text: str) -> dict:
    """'block_n=32,num_warps=8,weight_as_lhs=true' -> DecodeTuning fields (benchmark command
    lines); names and values are checked."""
    names = {f.name: f for f in dataclasses.fields(DecodeTuning)}
    fields = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        if name not in names or not value:
            raise ValueError(f"decode tuning {item!r}: expected name=value with name in "
                             f"{sorted(names)}")
        if name == "weight_as_lhs":
            if value.lower() not in ("true", "false", "none"):
                raise ValueError(f"decode tuning {item!r}: true, false or none")
            fields[name] = None if value.lower() == "none" else value.lower() == "true"
        elif name == "decoder":
            fields[name] = None if value.lower() == "none" else value
        else:
            fields[name] = int(value)
    return fields


def default_matmul_config(m: int, packed: PackedWeight,
                          tuning: DecodeTuning | None = None) -> MatmulConfig:
    """Heuristic tiling for y = x @ W^T, from the kernel sweeps (benchmarks/kernels.py --sweep
    and --decode-sweep).

    M <= 64: the fused kernel, 16/32/64-row tiles, 64 output columns per program (at M <= 16
    the block_n, warps and stages of `tuning`, default DecodeTuning()). Split-K: none when the N tiles
    alone fill the GPU (>= 264 programs); else at M <= 16 enough splits for ~640 programs (at
    most 8, each >= 4 K tiles; uneven splits allowed), and above 16 rows 2 (4 for narrow
    weights of < 32 N tiles, e.g. k/v projections). E2M1 formats: inline-asm decode,
    activations as the left dot operand at M <= 16 and the weights as the left one above. NF4:
    bf16 table lookup, weights as the left operand. M > 64: Pallas dequantize kernel + XLA
    (cuBLAS) matmul.
    """
    return default_config(m, (packed.n_pad,), 2 * packed.codes.shape[1] // packed.tile_k,
                           packed.fmt, max_block_n=packed.max_block_n, tuning=tuning)


def _decoder_fits(decoder: str | None, fmt: str) -> bool:
    """A DecodeTuning decoder applies to the formats it decodes: the E2M1 decoders to NVFP4 and
    MXFP4 ("ptx_paired_scales", which reads NVFP4's canonical scale codes, to NVFP4 only), the others
    (NF4's) to NF4."""
    if decoder == "ptx_paired_scales":
        return fmt == "nvfp4"
    return decoder is not None and (decoder in E2M1_DECODERS) == (fmt in ("nvfp4", "mxfp4"))


def default_config(m: int, n_pads: tuple[int, ...], k_tiles: int, fmt: str,
                    max_block_n: int | None = None,
                    tuning: DecodeTuning | None = None) -> MatmulConfig:
    """default_matmul_config for one launch over weights of padded N `n_pads` (one weight, or
    a group sharing the launch) and `k_tiles` K tiles: block_n divides every n_pad (and is at
    most max_block_n: a pair view's half_block), and split-K is chosen for the programs of
    all of them together."""
    if m > 64:
        return MatmulConfig(path="dequantize")
    block_m = max(16, next_pow2(m))
    tuning = tuning or DecodeTuning()
    decode = block_m <= 16
    block_n = min(tuning.block_n, *n_pads) if decode else 64
    if max_block_n is not None:
        block_n = min(block_n, max_block_n)
    while any(n_pad % block_n for n_pad in n_pads):
        block_n //= 2
    n_tiles = sum(n_pads) // block_n
    most = max(1, k_tiles // (tuning.min_tiles_per_split if decode else 4))
    if n_tiles >= (tuning.no_split_programs if decode else 264):
        split = 1
    elif decode:
        split = min(tuning.max_split, most, cdiv(tuning.target_programs, n_tiles))
    else:
        split = min(4 if n_tiles < 32 else 2, most)
    while not valid_split(split, k_tiles):
        split -= 1
    weight_as_lhs = fmt == "nf4" or not decode
    if decode and tuning.weight_as_lhs is not None:
        weight_as_lhs = tuning.weight_as_lhs
    return MatmulConfig(block_m=block_m, block_n=block_n, split_k=split,
                        weight_as_lhs=weight_as_lhs,
                        num_warps=tuning.num_warps if decode else 4,
                        num_stages=tuning.num_stages if decode else 3,
                        decoder=tuning.decoder if decode and _decoder_fits(tuning.decoder, fmt)
                        else None)


def default_transposed_config(m: int, packed: PackedWeight) -> TransposedConfig:
    if m <= 64:
        return TransposedConfig(block_m=64, block_n=min(64, packed.max_block_n or 64),
                                num_warps=4, num_stages=3)
    return TransposedConfig(path="dequantize")
