"""Reward functions for the scoring tests. Module-level, so they reach the scoring worker by
reference; each misbehaves only on completions that ask for it."""

from __future__ import annotations

import collections
import itertools
import os
import sys
import time


def sleeping_reward(completion: str, gold: str) -> float:
    """Sleeps 30 s (a hang in Python code) on a completion containing 'sleep'; else 1.0."""
    if "sleep" in completion:
        time.sleep(30)
    return 1.0


def int_power_reward(completion: str, gold: str) -> float:
    """Computes 10**10**10 (a hang inside one C call, where no signal handler runs) on a
    completion containing 'power'; else 1.0."""
    if "power" in completion:
        base = 10
        return float(base ** base ** base > 0)
    return 1.0


def c_loop_reward(completion: str, gold: str) -> float:
    """Runs a C loop that never checks for signals (about four minutes) on a completion
    containing 'c_loop'; else 1.0."""
    if "c_loop" in completion:
        collections.deque(itertools.repeat(0, 10**11), maxlen=0)
    return 1.0


def exiting_reward(completion: str, gold: str) -> float:
    """Ends its process at once (a crash) on a completion containing 'exit'; else 1.0."""
    if "exit" in completion:
        os._exit(3)
    return 1.0


def raising_reward(completion: str, gold: str) -> float:
    raise RuntimeError("a reward that always raises")


def none_reward(completion: str, gold: str):
    return None


def nan_reward(completion: str, gold: str) -> float:
    return float("nan")


def jax_imported_reward(completion: str, gold: str) -> float:
    """1.0 when the process scoring it has imported jax."""
    return float("jax" in sys.modules)


def process_id_reward(completion: str, gold: str) -> float:
    """The id of the process scoring it."""
    return float(os.getpid())
