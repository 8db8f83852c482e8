"""Reward functions (pure Python, never raise) and their registry by name."""

from qerl_jax.rewards.registry import REWARD_FUNCTIONS, get_reward_functions, score_completions

__all__ = ["REWARD_FUNCTIONS", "get_reward_functions", "score_completions"]
