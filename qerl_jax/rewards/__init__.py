"""Reward functions (pure Python, never raise), registered by name, and bounded-time scoring
(`score_completions`: a worker process, at most `time_limit_seconds` per completion)."""

from qerl_jax.rewards.registry import (REWARDS, RewardFunction, get_reward_functions,
                                       register_reward, reward_names)
# the built-in rewards register themselves on import (in this order: REWARDS.names())
from qerl_jax.rewards import answer_format, gsm8k, math_answers, arithmetic  # noqa: F401,E402
from qerl_jax.rewards.scoring import (DEFAULT_TIME_LIMIT_SECONDS, RewardScorer, default_scorer,
                                      score_completions)

__all__ = ["DEFAULT_TIME_LIMIT_SECONDS", "REWARDS", "RewardFunction", "RewardScorer",
           "default_scorer", "get_reward_functions", "register_reward", "reward_names",
           "score_completions"]
