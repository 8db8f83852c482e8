"""The scoring worker: `python -m qerl_jax.rewards.scoring_worker PARENT_PID`, run by
`scoring.RewardScorer`.

Reads messages from stdin and answers each on the original stdout (anything the reward functions
print goes to stderr instead):
  ("load", sys_path, ((name, pickled function), ...)) -> ("ready",) or ("error", "name: why")
  ("score", completion, gold, cpu_limit_seconds) -> ("scored", [one reward per function]) or
      ("cpu_limit",) when the functions used more than cpu_limit_seconds of this process's CPU
It exits at the end of its input, and (on Linux) when its parent dies, even mid-computation.

The limit counts CPU time, not wall time, so a busy host slows a completion down without
failing it. Python code is stopped by a SIGPROF timer (ITIMER_PROF counts this process's CPU
time); code that never returns to the interpreter (one huge C call) by RLIMIT_CPU, whose SIGXCPU
ends the worker a little later (the parent then counts the completion and starts a new worker).
"""

from __future__ import annotations

import math
import os
import pickle
import resource
import signal
import sys
import time

from qerl_jax.rewards.scoring import WARM_UP_PAIR, read_message, reward_values, write_message

_PR_SET_PDEATHSIG = 1
# RLIMIT_CPU counts whole seconds; the margin lets the SIGPROF timer, which stops the
# completion without ending the worker, fire first
_BACKSTOP_MARGIN_SECONDS = 0.5


class CPULimitExceeded(BaseException):
    """A completion used up its CPU time (a BaseException, so that no `except Exception` in a
    reward function or a library it calls swallows it)."""


def _raise_cpu_limit(signum, frame):
    raise CPULimitExceeded


def _exit_with_parent(parent_pid: int) -> None:
    """Asks Linux to kill this process when its parent exits (a no-op elsewhere)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:   # the parent exited before the request took effect
        os._exit(0)


def _load(sys_path: list[str], payloads) -> list:
    sys.path[:] = list(sys_path) + [entry for entry in sys.path if entry not in sys_path]
    functions = []
    for name, payload in payloads:
        try:
            functions.append(pickle.loads(payload))
        except Exception as error:
            raise LookupError(f"{name!r} ({type(error).__name__}: {error})") from None
    return functions


def _arm(cpu_limit_seconds: float) -> None:
    """Starts the completion's CPU-time limits: the SIGPROF timer and the RLIMIT_CPU backstop."""
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    backstop = math.ceil(time.process_time() + cpu_limit_seconds + _BACKSTOP_MARGIN_SECONDS)
    if hard != resource.RLIM_INFINITY:
        backstop = min(backstop, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (backstop, hard))
    signal.setitimer(signal.ITIMER_PROF, cpu_limit_seconds)


def _disarm() -> None:
    signal.setitimer(signal.ITIMER_PROF, 0)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(resource.RLIMIT_CPU, (hard, hard))


def score_within(completion, gold, functions, cpu_limit_seconds: float) -> tuple:
    """("scored", rewards), or ("cpu_limit",) when they took over `cpu_limit_seconds` of CPU."""
    try:
        try:
            _arm(cpu_limit_seconds)
            values = reward_values(completion, gold, functions)
        finally:
            _disarm()
    except CPULimitExceeded:   # also when the one-shot timer fires inside the finally
        _disarm()
        return ("cpu_limit",)
    return ("scored", values)


def main(argv: list[str]) -> None:
    protocol_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the parent's to handle
    signal.signal(signal.SIGPROF, _raise_cpu_limit)
    _exit_with_parent(int(argv[1]))
    protocol_in = sys.stdin.buffer
    functions: list = []
    while True:
        try:
            message = read_message(protocol_in)
        except EOFError:
            return
        if message[0] == "score":
            _, completion, gold, cpu_limit_seconds = message
            write_message(protocol_out, score_within(completion, gold, functions,
                                                     cpu_limit_seconds))
            continue
        try:
            functions = _load(message[1], message[2])
        except LookupError as error:
            write_message(protocol_out, ("error", str(error)))
            continue
        reward_values(*WARM_UP_PAIR, functions)   # the lazy imports (math-verify) happen here
        write_message(protocol_out, ("ready",))


if __name__ == "__main__":
    main(sys.argv)
