"""The released QeRL scripts' hyperparameters as configs (NVlabs/QeRL): the variants
qerl / nvfp4 / mxfp4 / qlora / lora on Qwen2.5-{3,7,14,32}B-Instruct with GSM8K or BigMath.
configs/{qerl,lora,qlora,mxfp4}.py call `released_script_config`.
"""

from __future__ import annotations

import ml_collections

from qerl_jax.infra.errors import ConfigError
from qerl_jax.experiment_config import base_config

RELEASED_SIZES = {"3b": "qwen2p5_3b", "7b": "qwen2p5_7b", "14b": "qwen2p5_14b",
                  "32b": "qwen2p5_32b"}
RELEASED_VARIANTS = {
    # variant: (weight format, learning rate, AQN) -- the released scripts
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
        raise ConfigError(f"variant {variant!r} not in {sorted(RELEASED_VARIANTS)}")
    parts = [part.strip().lower() for part in (spec or "7b,gsm8k").split(",")]
    if len(parts) != 2 or parts[0] not in RELEASED_SIZES or parts[1] not in DATASETS:
        raise ConfigError(f"config spec {spec!r}: expected 'SIZE,DATASET' with SIZE in "
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
    config.loss.loss_type, config.loss.beta = "micro_batch_token_mean", 0.0   # TRL's bnpo
    config.loss.epsilon_low, config.loss.epsilon_high = 0.2, 0.28
    config.rewards.names = rewards
    config.checkpoint.every_steps = 50
    return config
