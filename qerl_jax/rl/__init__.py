"""RL objectives: advantage estimators, policy objectives and loss normalizers (each a
registry: qerl_jax.registry), and the policy loss."""

from qerl_jax.rl.advantages import advantages, group_advantages, register_advantage_estimator
from qerl_jax.rl.losses import (LossConfig, loss_types, policy_loss_terms,
                                register_loss_normalizer)
from qerl_jax.rl.objectives import register_policy_objective

__all__ = ["advantages", "group_advantages", "register_advantage_estimator", "LossConfig",
           "loss_types", "policy_loss_terms", "register_loss_normalizer",
           "register_policy_objective"]
