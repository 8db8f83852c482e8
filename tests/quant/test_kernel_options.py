"""KernelOptions (qerl_jax/quant/kernel_options.py): config.quant.kernels' defaults are the
dataclass defaults, its choices are the sources', and bad values are refused naming the field."""

import pytest

from qerl_jax import experiment_config
from qerl_jax.infra.errors import ConfigError
from qerl_jax.quant import kernel_options
from qerl_jax.quant.kernel_options import KernelOptions


def test_experiment_config_are_the_dataclass_defaults():
    config = experiment_config.base_config()
    assert KernelOptions.from_config(config.quant.kernels) == KernelOptions()


def test_config_choices_equal_their_sources():
    from pallas_kernels.mxfp4_matmul import MXFP4
    from pallas_kernels.nf4_matmul import NF4
    from pallas_kernels.nvfp4_matmul import NVFP4
    from qerl_jax import registry
    assert registry.SWITCH.names() == kernel_options.MOSAIC_CHOICES
    assert registry.MOSAIC_SCHEDULES.names() == kernel_options.MOSAIC_SCHEDULES
    from pallas_kernels.mgpu_nvfp4_tuning import SCHEDULES
    assert kernel_options.MOSAIC_SCHEDULES == SCHEDULES
    assert registry.WEIGHT_AS_LHS.names() == tuple(kernel_options.WEIGHT_AS_LHS)
    decoders = set(NVFP4.decoders) | set(MXFP4.decoders) | set(NF4.decoders)
    assert set(registry.KERNEL_DECODERS.names()) == decoders


def test_every_option_reaches_the_dataclass():
    config = experiment_config.base_config()
    kernels = config.quant.kernels
    kernels.gate_up_pairs, kernels.mosaic_nvfp4, kernels.mosaic_prefetch_tiles = False, "off", 0
    kernels.mosaic_schedule, kernels.mosaic_swiglu_epilogue_max_m = "split_k", 0
    kernels.decode_attention = False
    kernels.decode_matmul.update(target_programs=320, min_tiles_per_split=2,
                                 no_split_programs=128, max_split=4, block_n=32, num_warps=8,
                                 num_stages=2, weight_as_lhs="weights", decoder="fp8")
    kernels.decode_attention_tiling.update(block_s=128, splits=2, balanced=False, num_warps=8,
                                           num_stages=2)
    options = KernelOptions.from_config(kernels)
    assert (options.gate_up_pairs, options.mosaic_nvfp4, options.mosaic_prefetch_tiles,
            options.decode_attention, options.mosaic) == (False, "off", 0, False, False)
    assert (options.mosaic_schedule, options.mosaic_swiglu_epilogue_max_m) == ("split_k", 0)
    tuning = options.decode_matmul
    assert (tuning.target_programs, tuning.min_tiles_per_split, tuning.no_split_programs,
            tuning.max_split, tuning.block_n, tuning.num_warps, tuning.num_stages,
            tuning.weight_as_lhs, tuning.decoder) == (320, 2, 128, 4, 32, 8, 2, True, "fp8")
    tiling = options.decode_attention_tiling
    assert (tiling.block_s, tiling.splits, tiling.balanced, tiling.num_warps,
            tiling.num_stages) == (128, 2, 0, 8, 2)
    kernels.decode_attention_tiling.splits = 0
    assert KernelOptions.from_config(kernels).decode_attention_tiling.splits is None


@pytest.mark.parametrize("path,value,message", [
    ("quant.kernels.mosaic_nvfp4", "1", "unknown switch '1'; known: auto, on, off"),
    ("quant.kernels.mosaic_prefetch_tiles", -1, "must be in [0, 3], got -1"),
    ("quant.kernels.mosaic_schedule", "stream_k", "unknown Mosaic schedule 'stream_k'"),
    ("quant.kernels.mosaic_swiglu_epilogue_max_m", 65, "must be in [0, 64], got 65"),
    ("quant.kernels.decode_matmul.weight_as_lhs", "x", "unknown left dot operand 'x'"),
    ("quant.kernels.decode_attention_tiling.block_s", 48, "48 not in"),
    ("quant.kernels.gate_up_pairs", "yes", "must be True or False"),
])
def test_bad_values_name_the_field(path, value, message):
    config = experiment_config.base_config().to_dict()
    node = config
    *sections, leaf = path.split(".")
    for section in sections:
        node = node[section]
    node[leaf] = value
    import ml_collections
    with pytest.raises(ConfigError, match=rf"^config\.{path}: " + message.replace("(", r"\(")
                       .replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        experiment_config._check_fields(ml_collections.ConfigDict(config))
    with pytest.raises(ValueError, match="mosaic_nvfp4"):
        KernelOptions(mosaic_nvfp4="1")
    with pytest.raises(ValueError, match="mosaic_swiglu_epilogue_max_m=-1"):
        KernelOptions(mosaic_swiglu_epilogue_max_m=-1)
