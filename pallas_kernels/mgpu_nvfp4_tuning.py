"""Tuning of the Mosaic GPU NVFP4 decode matmul (pallas_kernels/mgpu_nvfp4.py): its TuningConfig,
the device facts it sizes launches by (read from the device), the schedule and split-K count of
a launch, the programs' shared-memory budgets and the L2 prefetch plans of a following launch.
Host-side only: no kernel."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.mgpu_nvfp4_layout import MAX_M, TILE_K, TILE_LINES, TILE_ROWS

SCHEDULES = ("auto", "split_k", "warp_specialized")
# the smallest M the "auto" schedule may run warp-specialized (two compute warpgroups sharing
# each x tile, a third issuing the TMA copies): from it, where a split-K program's shared memory
# (with its LoRA tiles) leaves room for only one per SM
WARP_SPECIALIZED_MIN_M = 33
WS_COMPUTE_WARPGROUPS = 2  # row tiles per warp-specialized program (one per compute warpgroup)
# registers per thread the split-K program is budgeted at (it uses 118-124; allocation rounds up)
_REGISTERS_PER_THREAD = 128
_THREADS_PER_PROGRAM = 128  # one warpgroup
# Shared memory one block may opt in to and registers per SM, by compute capability major, for
# jaxlib builds whose device object does not report them (CUDA C Programming Guide, "Technical
# Specifications per Compute Capability"; Mosaic GPU assumes the same 227 KiB).
_BY_COMPUTE_CAPABILITY = {9: (227 * 1024, 65536), 10: (227 * 1024, 65536)}


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    """What a launch is sized by: the GPU's SM count, the shared memory one block may use
    (bytes, the opt-in maximum) and its registers per SM."""
    sm_count: int
    smem_per_block: int
    registers_per_sm: int = 65536

    def __post_init__(self):
        if self.sm_count < 1 or self.smem_per_block < 1 or self.registers_per_sm < 1:
            raise ValueError(f"DeviceFacts: sm_count, smem_per_block and registers_per_sm must "
                             f"be positive, got {self}")


def device_facts(device=None) -> DeviceFacts:
    """The DeviceFacts of `device` (default jax.devices()[0]): its core_count (SMs) and, where
    the device object has it, shared_memory_per_block_optin, else the compute capability's."""
    device = jax.devices()[0] if device is None else device
    if device.platform != "gpu" or getattr(device, "core_count", None) is None:
        raise ValueError(f"mgpu_nvfp4: device {device.platform} has no SM count to size the "
                         "launch by; pass TuningConfig(device=DeviceFacts(sm_count=..., "
                         "smem_per_block=...))")
    capability = str(getattr(device, "compute_capability", ""))
    major = int(capability.split(".")[0]) if capability[:1].isdigit() else None
    smem, registers = _BY_COMPUTE_CAPABILITY.get(major, (None, 65536))
    smem = getattr(device, "shared_memory_per_block_optin", smem)
    if smem is None:
        raise ValueError(f"mgpu_nvfp4: compute capability {capability or 'unknown'} has no "
                         "known shared memory per block; pass TuningConfig(device=...)")
    return DeviceFacts(sm_count=int(device.core_count), smem_per_block=int(smem),
                       registers_per_sm=registers)


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """How a launch of the Mosaic GPU NVFP4 kernels runs (static: part of the jit key)."""
    schedule: str = "auto"  # SCHEDULES: "split_k", "warp_specialized" or "auto" (by M)
    splits: int | None = None  # split-K programs per row tile (None: launch_splits)
    stages: int | None = None  # pipeline depth (None: 2 split-K, ws_stages warp-specialized)
    # mgpu_nvfp4_swiglu: the SwiGLU (and next LoRA x @ A) in the kernel's epilogue up to this M
    # (where the launch has one split and blocks of 32 rows), in XLA above; 0: always in XLA
    swiglu_epilogue_max_m: int = MAX_M
    device: DeviceFacts | None = None  # None: device_facts() of the default device

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"mgpu_nvfp4: schedule {self.schedule!r}; one of {SCHEDULES}")
        if self.splits is not None and self.splits < 1:
            raise ValueError(f"TuningConfig.splits: must be >= 1 or None, got {self.splits}")
        if self.stages is not None and self.stages < 1:
            raise ValueError(f"TuningConfig.stages: must be >= 1 or None, got {self.stages}")
        if self.swiglu_epilogue_max_m < 0:
            raise ValueError("TuningConfig.swiglu_epilogue_max_m: must be >= 0, got "
                             f"{self.swiglu_epilogue_max_m}")

    def facts(self) -> DeviceFacts:
        """The device facts: the config's, else the default device's."""
        return self.device if self.device is not None else device_facts()


def _m_pad(m: int) -> int:
    return -(-m // 8) * 8


def split_k_smem_bytes(m: int, rank: int | None = None, stages: int = 2) -> int:
    """Shared memory of a split-K program: stages x (x tile [m_pad, 256] bf16 + weight tile),
    the transposed store's [m_pad, 64] float32, and the LoRA tiles of split 0 (x @ A [m_pad, r]
    and the operand's [64, r])."""
    m_pad = _m_pad(m)
    smem = stages * (m_pad * TILE_K * 2 + TILE_LINES * 128) + m_pad * TILE_ROWS * 4
    return smem + (0 if rank is None else (m_pad + TILE_ROWS) * rank * 2)


def resident_programs(m: int, device: DeviceFacts, stages: int = 2) -> int:
    """A model of the split-K programs one SM holds at once at M = m, for sizing the split
    count: as many as the registers allow (4 at 128 per thread), fewer where their shared
    memory (split_k_smem_bytes without LoRA) does not fit that often: at 2 stages 4 up to
    M = 24, 3 at M = 32-40, 2 at M = 48-64. It leaves out the LoRA tiles, which a grouped
    rank-96 launch adds (1 program at M = 64 by this count, whose 1 split was not the fastest);
    it was fitted to the 7B launches of docs/decisions.md (the split-K counts row)."""
    by_registers = device.registers_per_sm // (_THREADS_PER_PROGRAM * _REGISTERS_PER_THREAD)
    return max(1, min(by_registers, device.smem_per_block // split_k_smem_bytes(m, None, stages)))


def default_splits(row_tiles: int, k_tiles: int, *, device: DeviceFacts, m: int = 8,
                   stages: int = 2, slots: int | None = None) -> int:
    """Split-K count: the fewest pipeline steps per program (ceil(k_tiles / splits)) with at
    most `slots` programs (row tiles x splits; default SMs x resident_programs(m, stages)), and
    the fewest splits giving that many steps (fewer partials to sum), at least 1. Splits need
    not divide the K tiles: a program with one tile fewer skips its last step (7B's down
    projection has 74 K tiles = 2 x 37, whose dividing counts are 1, 2, 37, 74). At M = 64 the
    model gives 2 programs per SM, not 4; sizing the splits for 4 there was slower on every 7B
    launch (docs/decisions.md, the split-K counts row)."""
    if slots is None:
        slots = device.sm_count * resident_programs(m, device, stages)
    most = max(1, min(k_tiles, slots // row_tiles))
    steps = -(-k_tiles // most)
    return -(-k_tiles // steps)


def launch_schedule(m: int, row_tiles: int, *, rank: int | None = None,
                    config: TuningConfig = TuningConfig()) -> str:
    """The schedule a launch at M = m over `row_tiles` row tiles (LoRA operand width `rank`,
    None without) runs: "split_k" (one warpgroup per program, several programs per SM) or
    "warp_specialized" (one program per SM: WS_COMPUTE_WARPGROUPS compute warpgroups, each a
    row tile, sharing each x tile, and a warpgroup issuing the TMA copies), the latter only
    where the row tiles pair up (else split-K). config.schedule "auto": warp-specialized from
    WARP_SPECIALIZED_MIN_M rows where one split-K program per SM fits in shared memory
    (split_k_smem_bytes: at M = 64 the operands of a grouped q|k|v launch (r 96) and of a
    gate|up pair (r 64)). With two or more split-K programs per SM, split-K was faster on every
    7B launch at M = 64 and as fast summed over a layer at M = 33-40 (docs/decisions.md)."""
    schedule = config.schedule
    if row_tiles % WS_COMPUTE_WARPGROUPS or schedule == "split_k":
        return "split_k"
    if schedule == "auto" and (m < WARP_SPECIALIZED_MIN_M
                               or config.facts().smem_per_block
                               // split_k_smem_bytes(m, rank) >= 2):
        return "split_k"
    return "warp_specialized"


def launch_splits(row_tiles: int, k_tiles: int, *, m: int, rank: int | None = None,
                  stages: int = 2, config: TuningConfig = TuningConfig()) -> int:
    """The split-K count of a launch (default_splits) on config's schedule: for the
    warp-specialized schedule one program per SM, each over WS_COMPUTE_WARPGROUPS row tiles."""
    device = config.facts()
    if launch_schedule(m, row_tiles, rank=rank, config=config) == "warp_specialized":
        return default_splits(row_tiles // WS_COMPUTE_WARPGROUPS, k_tiles, device=device,
                              slots=device.sm_count)
    return default_splits(row_tiles, k_tiles, device=device, m=m, stages=stages)


def ws_smem_bytes(m: int, stages: int, rank: int | None = None, swiglu: bool = False) -> int:
    """Shared memory of a warp-specialized program: its pipeline (stages x (the row tiles'
    weight tiles + the x tile)), the transposed stores, the LoRA tiles (x @ A shared, the
    operand's rows of both row tiles) and the SwiGLU's h tiles."""
    m_pad = _m_pad(m)
    wgs = WS_COMPUTE_WARPGROUPS
    total = stages * (wgs * TILE_LINES * 128 + m_pad * TILE_K * 2) + wgs * m_pad * TILE_ROWS * 4
    if rank is not None:
        total += (m_pad + wgs * TILE_ROWS) * rank * 2
    if swiglu:
        total += wgs * m_pad * TILE_ROWS // 2 * 2
    return total


def ws_stages(m: int, device: DeviceFacts, rank: int | None = None, swiglu: bool = False) -> int:
    """Pipeline depth of a warp-specialized program: 3 where its shared memory fits with 2 KiB
    to spare (3 was faster than 2 at M = 64 on every 7B launch without LoRA), else 2."""
    return 3 if ws_smem_bytes(m, 3, rank, swiglu) <= device.smem_per_block - 2048 else 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class L2Prefetch:
    """Another launch's weights for a kernel to prefetch into L2 once its own K loop is done
    (`cp.async.bulk.prefetch.tensor`, a hint: results do not change), so that launch's first
    loads hit L2 while the small XLA kernels between the two run.

    buffer: that launch's permuted buffer; row_tiles, k_tiles, splits: its grid (its programs
    (b, s) start at K tile s * k_tiles // splits); ahead: tiles prefetched from each of its
    programs' first (1-3; at most its fewest steps, k_tiles // splits); contiguous_lines: if
    > 0, instead the buffer's first contiguous_lines lines (72 per tile) in boxes of 216.
    extra: another 2-D array to prefetch whole (the next launch's LoRA A, read by XLA's x @ A
    before that launch), in boxes of up to 256 rows, or None. The arrays are pytree leaves,
    the rest static."""
    buffer: jax.Array
    row_tiles: int = dataclasses.field(metadata=dict(static=True))
    k_tiles: int = dataclasses.field(metadata=dict(static=True))
    splits: int = dataclasses.field(metadata=dict(static=True))
    ahead: int = dataclasses.field(default=2, metadata=dict(static=True))
    contiguous_lines: int = dataclasses.field(default=0, metadata=dict(static=True))
    extra: jax.Array | None = None


def extra_prefetchable(array) -> bool:
    """Whether L2Prefetch.extra can take this array (whole rows in TMA boxes)."""
    return (array.ndim == 2 and array.shape[1] <= 256
            and array.shape[1] * jnp.dtype(array.dtype).itemsize % 16 == 0)


def l2_prefetch_for(permuted: jax.Array, *, k: int, m: int = 8, rank: int | None = None,
                    ahead: int = 2, contiguous_lines: int = 0, extra: jax.Array | None = None,
                    config: TuningConfig = TuningConfig()) -> L2Prefetch:
    """The L2Prefetch plan of a launch of matmul_unscaled over `permuted` (a [N, k] weight's
    buffer) at M = m, LoRA operand width `rank`, tuned by `config` (its splits, else
    launch_splits of its schedule), and `extra` ([rows, cols], a row of a multiple of 16 bytes
    and at most 256 columns: a TMA box) if given."""
    k_tiles = -(-k // TILE_K)
    row_tiles = permuted.shape[0] // (TILE_LINES * k_tiles)
    splits = (launch_splits(row_tiles, k_tiles, m=m, rank=rank, config=config)
              if config.splits is None else config.splits)
    if not 1 <= ahead <= 3:
        raise ValueError(f"l2_prefetch_for: ahead={ahead} (1-3 tiles: a TMA box has at most "
                         f"256 lines)")
    if contiguous_lines < 0 or contiguous_lines > permuted.shape[0]:
        raise ValueError(f"l2_prefetch_for: contiguous_lines={contiguous_lines} for a buffer "
                         f"of {permuted.shape[0]} lines")
    if extra is not None and not extra_prefetchable(extra):
        raise ValueError(f"l2_prefetch_for: extra {extra.shape} {extra.dtype} (a 2-D array with "
                         "rows of a multiple of 16 bytes and at most 256 columns)")
    return L2Prefetch(permuted, row_tiles, k_tiles, splits, min(ahead, k_tiles // splits),
                      contiguous_lines, extra)
