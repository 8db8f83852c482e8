"""RL objectives: group advantages and GRPO / BNPO / Dr. GRPO / DAPO policy losses."""

from qerl_jax.rl.advantages import group_advantages
from qerl_jax.rl.losses import LOSS_TYPES, LossConfig, policy_loss_terms

__all__ = ["group_advantages", "LOSS_TYPES", "LossConfig", "policy_loss_terms"]
