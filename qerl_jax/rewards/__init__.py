"""Reward functions (pure Python, never raise), their registry by name, and bounded-time scoring
(`score_completions`: a worker process, at most `time_limit_seconds` per completion)."""

from qerl_jax.rewards.registry import REWARD_FUNCTIONS, RewardFunction, get_reward_functions
from qerl_jax.rewards.scoring import (DEFAULT_TIME_LIMIT_SECONDS, RewardScorer, default_scorer,
                                      score_completions)

__all__ = ["DEFAULT_TIME_LIMIT_SECONDS", "REWARD_FUNCTIONS", "RewardFunction", "RewardScorer",
           "default_scorer", "get_reward_functions", "score_completions"]
