"""The tiny end-to-end default: a char-level Qwen2-architecture model trained from scratch on
synthetic arithmetic (supervised warm-up, cached in the workdir), quantized to NVFP4, then
GRPO/DAPO with LoRA and AQN. Runs on a 2-core CPU in minutes.

    python -m qerl_jax.train --config configs/tiny.py --workdir runs/tiny

Tuned so that the reward rises measurably: single-digit operands; the warm-up leaves the NVFP4
model with room for RL between its greedy and its sampled (T=1) accuracy; a fixed set of 64
problems is revisited every 4 steps, so each problem's group signal accumulates; larger learning
rates were noise-dominated (accuracy fell, entropy rose). Truncated completions are not masked:
with a 16-token limit, masking them lets a policy drift into truncation without any penalty.
"""

from qerl_jax.experiment_config import base_config


def get_config():
    config = base_config()
    config.seed = 0
    # the reference's numbers on any x86 CPU: XLA:CPU's rounding depends on its thread count
    config.cpu_threads = 2
    config.xla_flags = "--xla_cpu_enable_platform_dependent_math=false"   # ISA-independent dots
    model = config.model
    model.preset = "tiny_qwen2"
    model.overrides = dict(vocab_size=104, hidden_size=128, intermediate_size=256,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=256)
    model.param_dtype = "float32"
    model.compute_dtype = "float32"
    model.remat = False
    config.warmup.steps = 250
    config.warmup.learning_rate = 3e-3
    config.warmup.batch_size = 64
    config.quant.format = "nvfp4"
    config.lora.rank = 8
    config.lora.alpha = 16.0
    config.lora.train_norms = True
    config.aqn.enabled = True
    config.aqn.sigma_start = 1e-2
    config.aqn.sigma_end = 1e-4
    config.aqn.stages = 5
    data = config.data
    data.task = "arithmetic"
    data.arithmetic_count = 64
    data.arithmetic_max_operand = 9
    data.prompt_style = "plain"
    data.max_prompt_length = 48
    rollout = config.rollout
    rollout.num_generations = 8
    rollout.max_new_tokens = 16
    rollout.prompt_bucket = 16
    train = config.train
    train.total_steps = 100
    train.prompts_per_step = 16
    train.micro_batch_size = 64
    train.learning_rate = 2e-3
    train.max_grad_norm = 1.0
    config.loss.loss_type = "micro_batch_token_mean"   # TRL's "bnpo"
    config.loss.mask_truncated_completions = False
    config.rewards.names = ("arithmetic", "format")
    config.checkpoint.every_steps = 25
    return config
