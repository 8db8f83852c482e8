"""qerl-jax: QeRL (arXiv 2510.11696) in JAX/Flax/Pallas.

The names a notebook needs, imported on first use (so `import qerl_jax` and the config
schema stay free of JAX until something runs):

    import qerl_jax
    config = qerl_jax.base_config()            # or a configs/*.py get_config()
    history = qerl_jax.Trainer(config, "runs/x").train()

(`qerl_jax.train` is the training CLI's module: `python -m qerl_jax.train`.)
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    # configs and runs
    "base_config": "qerl_jax.experiment_config",
    "validate_config": "qerl_jax.experiment_config",
    "Trainer": "qerl_jax.trainer",
    "ConfigError": "qerl_jax.infra.errors",
    "TrainingStopped": "qerl_jax.infra.errors",
    "read_metrics": "qerl_jax.infra.metrics",
    "read_starts": "qerl_jax.infra.run_record",
    "plot_training_curves": "qerl_jax.plots",
    # models and formats
    "build_model": "qerl_jax.model_setup",
    "load_hf_model": "qerl_jax.models.hf_io",
    "save_hf_model": "qerl_jax.models.hf_io",
    "quantize_model": "qerl_jax.model_quant.quantize",
    "enable_kernels": "qerl_jax.model_quant.kernel_setup",
    "KernelOptions": "qerl_jax.quant.kernel_options",
    "get_format": "qerl_jax.quant.formats",
    "register_format": "qerl_jax.quant.formats",
    # LoRA, AQN, sampling
    "LoRAConfig": "qerl_jax.lora",
    "add_lora": "qerl_jax.lora",
    "export_peft_adapter": "qerl_jax.lora",
    "AQNSchedule": "qerl_jax.aqn",
    "aqn_sigma": "qerl_jax.aqn",
    "SamplingConfig": "qerl_jax.sampling",
    "generate": "qerl_jax.sampling",
    # RL
    "group_advantages": "qerl_jax.rl.advantages",
    "LossConfig": "qerl_jax.rl.losses",
    "policy_loss_terms": "qerl_jax.rl.losses",
    "register_loss_normalizer": "qerl_jax.rl.losses",
    "score_completions": "qerl_jax.rewards",
    "REWARDS": "qerl_jax.rewards",
    "register_reward": "qerl_jax.rewards",
    # tasks and evaluation
    "Task": "qerl_jax.tasks",
    "register_task": "qerl_jax.tasks",
    "get_task": "qerl_jax.tasks",
    "pass_at_1": "qerl_jax.evaluation",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'qerl_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
