"""Reward functions by name: f(completion: str, gold: str) -> float, summed with weight 1.

A reward is registered where it is defined, with `@register_reward("name")`; the built-ins are
registered when `qerl_jax.rewards` is imported (pure Python: no JAX, and math-verify only on a
reward's first call). Every entry is a module-level function, so that it pickles by reference
into the scoring worker (`scoring.py`); a user's own reward must be one too, in an importable
module.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

from qerl_jax.registry import REWARDS

RewardFunction = Callable[[str, str], float]

def register_reward(name: str, *, aliases: Iterable[str] = ()):
    """Decorator registering a module-level f(completion, gold) -> float under `name`."""
    def decorator(function: RewardFunction) -> RewardFunction:
        if "<locals>" in getattr(function, "__qualname__", "<locals>"):
            raise ValueError(f"reward {name!r}: {function!r} is not a module-level function "
                             "(the scoring worker loads rewards by reference)")
        return REWARDS.register(name, function, aliases=aliases)
    return decorator


def reward_names() -> tuple[str, ...]:
    """The registered reward names, in registration order."""
    return REWARDS.names()


def get_reward_functions(names: Sequence[str]) -> dict[str, RewardFunction]:
    """name -> function for each of `names`; ValueError (one line, listing the known names) for
    an unknown name or an empty list."""
    unknown = [name for name in names if name not in REWARDS]
    if unknown or not names:
        raise ValueError(f"unknown reward function(s) {unknown or '(none given)'}; known: "
                         f"{', '.join(REWARDS.names(with_aliases=True))}")
    return {name: REWARDS.get(name) for name in names}
