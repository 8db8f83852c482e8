"""The kernel choices and tunings of the quantized linear layers and the decode attention: one
frozen dataclass, carried in the config as `config.quant.kernels.*` (qerl_jax/experiment_config.py
describes and validates each field; run.json records them with the config).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from pallas_kernels.blockwise_configs import DecodeTuning
from pallas_kernels.decode_attention import DecodeAttentionConfig
from qerl_jax import registry

MOSAIC_CHOICES = registry.SWITCH.names()
MOSAIC_SCHEDULES = registry.MOSAIC_SCHEDULES.names()  # pallas_kernels.mgpu_nvfp4.SCHEDULES
WEIGHT_AS_LHS = dict(registry.WEIGHT_AS_LHS.items())


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """Which Pallas kernels run, and their tunings."""

    # the Pallas kernels on a GPU (False: the XLA path everywhere)
    enabled: bool = True
    # each MLP's gate and up weights as one interleaved copy, run at decode in one launch with
    # the SwiGLU in its epilogue
    gate_up_pairs: bool = True
    # NVFP4 decode launches on the Mosaic GPU kernel: 'auto' where it runs (Hopper), 'on' the
    # same but a warning where it cannot, 'off' the Triton kernels
    mosaic_nvfp4: str = "auto"
    # K tiles per program of the next Mosaic launch that each launch prefetches into L2 (0: none)
    mosaic_prefetch_tiles: int = 1
    # schedule of the Mosaic launches: 'auto' warp-specialized (two compute warpgroups sharing
    # each x tile, one issuing the copies) from 33 rows where only one split-K program would fit
    # an SM's shared memory (wide LoRA operands), split-K programs elsewhere; 'split_k' always
    # split-K; 'warp_specialized' wherever the launch's 64-row tiles pair up
    mosaic_schedule: str = "auto"
    # the most rows at which a Mosaic gate|up launch computes the SwiGLU (and the next LoRA
    # x @ A) in its epilogue; with more, XLA computes them from the launch's output (0: never)
    mosaic_swiglu_epilogue_max_m: int = 16
    # the Pallas decode-attention kernel for one-token decode steps
    decode_attention: bool = True
    # tiling of the Triton fused kernel at decode M (M <= 16)
    decode_matmul: DecodeTuning = DecodeTuning()
    # tiling of the decode-attention kernel
    decode_attention_tiling: DecodeAttentionConfig = DecodeAttentionConfig()

    def __post_init__(self):
        if self.mosaic_nvfp4 not in MOSAIC_CHOICES:
            raise ValueError(f"KernelOptions.mosaic_nvfp4={self.mosaic_nvfp4!r}: one of "
                             f"{MOSAIC_CHOICES}")
        if self.mosaic_schedule not in MOSAIC_SCHEDULES:
            raise ValueError(f"KernelOptions.mosaic_schedule={self.mosaic_schedule!r}: one of "
                             f"{MOSAIC_SCHEDULES}")
        if not 0 <= self.mosaic_swiglu_epilogue_max_m <= 64:
            raise ValueError("KernelOptions.mosaic_swiglu_epilogue_max_m="
                             f"{self.mosaic_swiglu_epilogue_max_m}: 0 (never) to 64")
        if not 0 <= self.mosaic_prefetch_tiles <= 3:
            raise ValueError(f"KernelOptions.mosaic_prefetch_tiles={self.mosaic_prefetch_tiles}"
                             ": 0 (off) to 3")

    @property
    def mosaic(self) -> bool:
        """Whether NVFP4 decode launches may take the Mosaic GPU kernel (where it runs)."""
        return self.mosaic_nvfp4 != "off"

    @classmethod
    def from_config(cls, kernels: Mapping[str, Any]) -> KernelOptions:
        """The options of a validated `config.quant.kernels` section."""
        matmul, attention = kernels["decode_matmul"], kernels["decode_attention_tiling"]
        return cls(
            enabled=kernels["enabled"], gate_up_pairs=kernels["gate_up_pairs"],
            mosaic_nvfp4=kernels["mosaic_nvfp4"],
            mosaic_prefetch_tiles=kernels["mosaic_prefetch_tiles"],
            mosaic_schedule=kernels["mosaic_schedule"],
            mosaic_swiglu_epilogue_max_m=kernels["mosaic_swiglu_epilogue_max_m"],
            decode_attention=kernels["decode_attention"],
            decode_matmul=DecodeTuning(
                target_programs=matmul["target_programs"],
                min_tiles_per_split=matmul["min_tiles_per_split"],
                no_split_programs=matmul["no_split_programs"], max_split=matmul["max_split"],
                block_n=matmul["block_n"], num_warps=matmul["num_warps"],
                num_stages=matmul["num_stages"],
                weight_as_lhs=WEIGHT_AS_LHS[matmul["weight_as_lhs"]],
                decoder=None if matmul["decoder"] == "auto" else matmul["decoder"]),
            decode_attention_tiling=DecodeAttentionConfig(
                block_s=attention["block_s"], splits=attention["splits"] or None,
                balanced=int(attention["balanced"]), num_warps=attention["num_warps"],
                num_stages=attention["num_stages"]))
