"""The full experiment config (ml_collections) with defaults from QeRL's released scripts, and
its validation. configs/*.py start from `base_config()` and override fields.
"""

from __future__ import annotations

import ml_collections

from qerl_jax.aqn import SCHEDULES
from qerl_jax.data.sources import TASKS
from qerl_jax.device_offload import METHODS as OFFLOAD_METHODS
from qerl_jax.lora import ALL_PROJECTIONS
from qerl_jax.models.config import PRESETS
from qerl_jax.rewards import REWARD_FUNCTIONS
from qerl_jax.rl.losses import LOSS_TYPES

FORMATS = ("bf16", "nf4", "mxfp4", "nvfp4")


def base_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.seed = 0
    # JAX's persistent compilation cache ("" = off): runs of the same shapes (seeds and formats
    # of an ablation, resumes) load the compiled programs instead of compiling them again
    # (qerl_jax.compilation_cache).
    config.compilation_cache_dir = ""
    # XLA's GPU autotuning results in this file ("" = off): loaded when it exists and rewritten
    # after each compilation, so every process picks the same kernels and a run reproduces
    # token for token from its seed (qerl_jax.xla_autotuning; without it or a warm compilation
    # cache, two GPU processes can sample different tokens from the same seed).
    config.xla_autotune_results = ""
    # attention_implementation of the training attention: 'auto' (cuDNN's fused flash attention
    # on an NVIDIA GPU with bf16/fp16 compute, XLA's einsums elsewhere), 'cudnn' or 'xla'.
    config.model = ml_collections.ConfigDict(dict(
        preset="", hf_path="", tokenizer_path="", overrides={}, param_dtype="bfloat16",
        compute_dtype="bfloat16", remat=True, attention_query_chunk=0,
        attention_implementation="auto"))
    # Supervised warm-up from scratch (only for the tiny CPU default; 0 steps = off).
    config.warmup = ml_collections.ConfigDict(dict(steps=0, learning_rate=1e-3, batch_size=64))
    # gate_up_pairs: with the kernels, each MLP's gate and up weights are one interleaved copy
    # that decode runs in one launch with the SwiGLU fused (kernel_dispatch.pair_mlp_weights)
    config.quant = ml_collections.ConfigDict(dict(format="nvfp4", kernels=True,
                                                  gate_up_pairs=True))
    config.lora = ml_collections.ConfigDict(dict(rank=16, alpha=16.0,
                                                 target_modules=ALL_PROJECTIONS,
                                                 train_norms=True))
    config.aqn = ml_collections.ConfigDict(dict(enabled=False, schedule="released_code",
                                                sigma_start=1e-2, sigma_end=1e-4, stages=10,
                                                apply_in_training=False))
    config.data = ml_collections.ConfigDict(dict(
        task="gsm8k", path="", split="train", subset="", limit=0, arithmetic_count=1000,
        arithmetic_max_operand=20,
        prompt_style="paper", use_chat_template=True, max_prompt_length=256))
    # offload_weights_for_compile: each new sampler program (one per prompt-length bucket) is
    # compiled while the frozen weights wait in host memory, so XLA's GPU autotuner's scratch
    # buffers (+3.1 GiB at 7B) do not add to them. 'auto' (on a GPU, off elsewhere), 'on', 'off'.
    # offload_method: where they wait (qerl_jax.device_offload): 'auto' = 'numpy', 'pinned_host'.
    config.rollout = ml_collections.ConfigDict(dict(
        num_generations=8, max_new_tokens=2048, temperature=1.0, top_p=1.0, top_k=0,
        prompt_bucket=64, offload_weights_for_compile="auto", offload_method="auto"))
    config.train = ml_collections.ConfigDict(dict(
        total_steps=100, prompts_per_step=16, micro_batch_size=8, num_iterations=1,
        learning_rate=1e-5, warmup_ratio=0.1, weight_decay=0.1, adam_b1=0.9, adam_b2=0.99,
        max_grad_norm=0.2, max_consecutive_nonfinite=5, dynamic_sampling=False,
        dynamic_sampling_max_tries=4, logits_chunk_size=256))
    config.loss = ml_collections.ConfigDict(dict(
        loss_type="bnpo", epsilon_low=0.2, epsilon_high=0.28, beta=0.0,
        top_entropy_quantile=1.0, mask_truncated_completions=True))
    config.rewards = ml_collections.ConfigDict(dict(names=("format", "gsm8k_exact")))
    config.checkpoint = ml_collections.ConfigDict(dict(every_steps=50, max_to_keep=2))
    config.logging = ml_collections.ConfigDict(dict(tensorboard=False, progress_bar=True))
    return config


RELEASED_SIZES = {"3b": "qwen2p5_3b", "7b": "qwen2p5_7b", "14b": "qwen2p5_14b",
                  "32b": "qwen2p5_32b"}
RELEASED_VARIANTS = {
    # variant: (weight format, learning rate, AQN) -- QeRL facts section 5
    "qerl": ("nvfp4", 1e-5, True),
    "nvfp4": ("nvfp4", 1e-5, False),
    "mxfp4": ("mxfp4", 1e-5, False),
    "qlora": ("nf4", 1e-5, False),
    "lora": ("bf16", 5e-6, False),
}
DATASETS = {
    # dataset: (task, hub name, subset, rewards, prompt style, prompt len, completion len, G)
    "gsm8k": ("gsm8k", "openai/gsm8k", "main", ("format", "gsm8k_exact"), "paper", 256, 2048,
              8),
    "bigmath": ("math", "open-r1/Big-Math-RL-Verified-Processed", "level_3_4_5",
                ("format", "math_verify"), "system", 1024, 4096, 16),
}


def released_script_config(variant: str, spec: str) -> ml_collections.ConfigDict:
    """The released scripts' hyperparameters for `variant` on spec 'SIZE,DATASET' (e.g.
    '7b,gsm8k'): Qwen2.5-{3,7,14,32}B-Instruct, GSM8K or BigMath. model.hf_path must point at
    a local checkpoint directory (set it with --config.model.hf_path=...)."""
    if variant not in RELEASED_VARIANTS:
        raise ValueError(f"variant {variant!r} not in {sorted(RELEASED_VARIANTS)}")
    parts = [part.strip().lower() for part in (spec or "7b,gsm8k").split(",")]
    if len(parts) != 2 or parts[0] not in RELEASED_SIZES or parts[1] not in DATASETS:
        raise ValueError(f"config spec {spec!r}: expected 'SIZE,DATASET' with SIZE in "
                         f"{sorted(RELEASED_SIZES)} and DATASET in {sorted(DATASETS)}")
    size, dataset = parts
    fmt, learning_rate, aqn = RELEASED_VARIANTS[variant]
    task, hub, subset, rewards, style, prompt_len, completion_len, group = DATASETS[dataset]
    config = base_config()
    config.model.hf_path = f"Qwen/Qwen2.5-{size.upper()}-Instruct"  # replace with a local dir
    config.model.param_dtype = "bfloat16"
    config.model.remat = True
    config.quant.format = fmt
    config.lora.rank, config.lora.alpha, config.lora.train_norms = 16, 16.0, True
    config.aqn.enabled = aqn
    config.aqn.sigma_start, config.aqn.sigma_end, config.aqn.stages = 1e-2, 1e-4, 10
    config.data.task, config.data.path, config.data.subset = task, hub, subset
    config.data.prompt_style = style
    config.data.max_prompt_length = prompt_len
    config.rollout.max_new_tokens = completion_len
    config.rollout.num_generations = group
    config.rollout.temperature, config.rollout.top_p = 1.0, 1.0
    config.train.prompts_per_step = 128 // group          # paper: 128 completions per step
    config.train.micro_batch_size = 4
    config.train.learning_rate = learning_rate
    config.train.warmup_ratio = 0.1
    config.train.weight_decay = 0.1
    config.train.max_grad_norm = 0.2
    config.train.total_steps = 7473 // config.train.prompts_per_step if dataset == "gsm8k" else 500
    config.loss.loss_type, config.loss.beta = "bnpo", 0.0
    config.loss.epsilon_low, config.loss.epsilon_high = 0.2, 0.28
    config.rewards.names = rewards
    config.checkpoint.every_steps = 50
    return config


def _check(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise ValueError(f"config.{field}: {message}")


def validate_config(config: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the first bad field."""
    model = config.model
    _check(isinstance(config.get("xla_autotune_results", ""), str), "xla_autotune_results",
           f"{config.get('xla_autotune_results')!r} must be a file path string ('' = off)")
    _check(bool(model.preset) != bool(model.hf_path), "model.preset / model.hf_path",
           "set exactly one of them")
    _check(not model.preset or model.preset in PRESETS, "model.preset",
           f"{model.preset!r} not in {sorted(PRESETS)}")
    _check(model.param_dtype in ("bfloat16", "float32"), "model.param_dtype",
           f"{model.param_dtype!r} not in ('bfloat16', 'float32')")
    _check(config.quant.format in FORMATS, "quant.format",
           f"{config.quant.format!r} not in {FORMATS}")
    _check(isinstance(config.quant.get("kernels", True), bool), "quant.kernels",
           f"{config.quant.get('kernels')!r} must be True or False")
    _check(isinstance(config.quant.get("gate_up_pairs", True), bool), "quant.gate_up_pairs",
           f"{config.quant.get('gate_up_pairs')!r} must be True or False")
    _check(config.lora.rank > 0, "lora.rank", "must be positive")
    _check(set(config.lora.target_modules) <= set(ALL_PROJECTIONS), "lora.target_modules",
           f"must be a subset of {ALL_PROJECTIONS}")
    _check(config.aqn.schedule in SCHEDULES, "aqn.schedule", f"not in {SCHEDULES}")
    _check(not config.aqn.enabled or config.quant.format != "bf16", "aqn.enabled",
           "AQN is defined for quantized bases only (QeRL); use a quantized quant.format")
    _check(config.data.task in TASKS, "data.task", f"{config.data.task!r} not in {TASKS}")
    _check(config.data.task == "arithmetic" or bool(config.data.path), "data.path",
           f"task {config.data.task!r} needs a .jsonl/.parquet path or hub dataset name")
    _check(config.data.max_prompt_length > 0, "data.max_prompt_length", "must be positive")
    _check(config.rollout.num_generations >= 2, "rollout.num_generations",
           "group advantages need G >= 2")
    _check(config.rollout.max_new_tokens > 0, "rollout.max_new_tokens", "must be positive")
    offload = config.rollout.get("offload_weights_for_compile", "auto")
    _check(offload in ("auto", "on", "off"), "rollout.offload_weights_for_compile",
           f"{offload!r} not in ('auto', 'on', 'off')")
    method = config.rollout.get("offload_method", "auto")
    _check(method in OFFLOAD_METHODS, "rollout.offload_method",
           f"{method!r} not in {OFFLOAD_METHODS}")
    train = config.train
    _check(train.total_steps > 0, "train.total_steps", "must be positive")
    _check(train.prompts_per_step > 0, "train.prompts_per_step", "must be positive")
    rows = train.prompts_per_step * config.rollout.num_generations
    _check(train.micro_batch_size > 0 and rows % train.micro_batch_size == 0,
           "train.micro_batch_size",
           f"must divide prompts_per_step * num_generations = {rows}")
    _check(train.num_iterations >= 1, "train.num_iterations", "must be >= 1")
    _check(train.logits_chunk_size >= 0, "train.logits_chunk_size",
           "must be >= 0 (0 = whole completion at once)")
    _check(train.learning_rate > 0, "train.learning_rate", "must be positive")
    _check(0 <= train.warmup_ratio < 1, "train.warmup_ratio", "must be in [0, 1)")
    _check(config.loss.loss_type in LOSS_TYPES, "loss.loss_type",
           f"{config.loss.loss_type!r} not in {LOSS_TYPES}")
    unknown = [name for name in config.rewards.names if name not in REWARD_FUNCTIONS]
    _check(bool(config.rewards.names) and not unknown, "rewards.names",
           f"unknown {unknown}; known {sorted(REWARD_FUNCTIONS)}")
    _check(config.checkpoint.every_steps > 0, "checkpoint.every_steps", "must be positive")
