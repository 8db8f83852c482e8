"""The scoring worker: `python -m qerl_jax.rewards.scoring_worker PARENT_PID`, run by
`scoring.RewardScorer`.

Reads messages from stdin and answers each on the original stdout (anything the reward functions
print goes to stderr instead):
  ("load", sys_path, ((name, pickled function), ...)) -> ("ready",) or ("error", "name: why")
  ("score", completion, gold) -> [one reward per loaded function]
It exits at the end of its input, and (on Linux) when its parent dies, even mid-computation.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys

from qerl_jax.rewards.scoring import WARM_UP_PAIR, read_message, reward_values, write_message

_PR_SET_PDEATHSIG = 1


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


def main(argv: list[str]) -> None:
    protocol_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the parent's to handle
    _exit_with_parent(int(argv[1]))
    protocol_in = sys.stdin.buffer
    functions: list = []
    while True:
        try:
            message = read_message(protocol_in)
        except EOFError:
            return
        if message[0] == "score":
            write_message(protocol_out, reward_values(message[1], message[2], functions))
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
