"""Scoring completions with reward functions, in bounded time per completion.

`score_completions(completions, golds, functions, time_limit_seconds=5.0)` scores each completion
with every function in a worker process (one at a time), which may spend `time_limit_seconds`
of CPU time on it: CPU time, so that a busy host (other processes on the cores) slows a correct
answer down without failing it. A worker that holds a completion for WALL_CLOCK_FACTOR times
the limit in wall time (blocked, stopped, or starved of CPU) is killed. A completion that hits
either limit (or kills the worker) scores 0 for every function and counts as a timeout; a killed
worker is replaced by a fresh one for the rest. Only a process can be stopped inside C code (a
huge int power, the `re` engine), where signal handlers never run.

The worker is `python -m qerl_jax.rewards.scoring_worker`, started on first use and kept across
batches by a `RewardScorer` (the module-level default one serves `score_completions`); it stops
with `close()` or at exit. It is a subprocess of its own module rather than a multiprocessing
'spawn'/'forkserver' child because those import the parent's __main__ module again in the child
(a user's training script, JAX and all, at every worker start). Functions reach it by pickle,
i.e. by reference: module-level functions of importable modules (the registry's are).
`time_limit_seconds=None` (or 0) scores in the calling process with no bound (debugging).
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from typing import BinaryIO, Callable, Mapping, Sequence

DEFAULT_TIME_LIMIT_SECONDS = 5.0     # of the worker's CPU time, per completion
WALL_CLOCK_FACTOR = 4.0              # wall-time limit per completion, in CPU-time limits
WORKER_START_TIMEOUT_SECONDS = 60.0   # start, load the functions, import what they import
RESERVED_NAMES = ("total", "timeouts")
WARM_UP_PAIR = ("<think>1</think> <answer>1</answer>", "1")   # each function runs once on it

RewardFunction = Callable[[str, str], float]
logger = logging.getLogger(__name__)
# the limits a completion can hit: the worker's CPU time (its SIGPROF timer, or RLIMIT_CPU
# ending it), the parent's wall-clock wait, or the worker's death from the reward itself
LIMITS = ("cpu", "wall", "crash")
_SIGXCPU = getattr(signal, "SIGXCPU", 24)
_HEADER = struct.Struct(">Q")   # payload length in bytes, then the pickled message
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def reward_values(completion: str, gold: str,
                  functions: Sequence[RewardFunction]) -> list[float]:
    """Each function's reward for one completion; one that raises or returns None, NaN or an
    infinity gives 0."""
    values = []
    for function in functions:
        try:
            value = float(function(completion, gold))
        except Exception:
            value = 0.0
        values.append(value if math.isfinite(value) else 0.0)
    return values


def write_message(stream: BinaryIO, message) -> None:
    """Writes one length-prefixed pickled message to `stream` and flushes it."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(payload)) + payload)
    stream.flush()


def read_message(stream: BinaryIO):
    """Reads one message written by `write_message`; EOFError at the end of the stream."""
    def exactly(size: int) -> bytes:
        data = stream.read(size)
        if data is None or len(data) < size:
            raise EOFError("scoring stream ended")
        return data
    (size,) = _HEADER.unpack(exactly(_HEADER.size))
    return pickle.loads(exactly(size))


def _read_before(fd: int, size: int, deadline: float) -> bytes:
    """`size` bytes from `fd` before `deadline` (time.monotonic); TimeoutError, EOFError."""
    chunks, missing = [], size
    while missing:
        wait = deadline - time.monotonic()
        if wait <= 0 or not select.select([fd], [], [], wait)[0]:
            raise TimeoutError
        chunk = os.read(fd, missing)
        if not chunk:
            raise EOFError("the scoring worker exited")
        chunks.append(chunk)
        missing -= len(chunk)
    return b"".join(chunks)


def _pickled_functions(functions: Mapping[str, RewardFunction]) -> tuple[tuple[str, bytes], ...]:
    """(name, pickle) per function; one clear error for a function the worker cannot load."""
    payloads = []
    for name, function in functions.items():
        where = f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', '?')}"
        advice = (f"reward function {name!r} ({where}) cannot be sent to the scoring worker: "
                  "define it at module level in an importable module, or score in-process "
                  "with time_limit_seconds=None")
        if getattr(function, "__module__", None) == "__main__":
            raise ValueError(advice)
        try:
            payloads.append((name, pickle.dumps(function, protocol=pickle.HIGHEST_PROTOCOL)))
        except (pickle.PicklingError, AttributeError, TypeError):
            raise ValueError(advice) from None
    return tuple(payloads)


class _Worker:
    """One scoring worker process and its pipes."""

    def __init__(self):
        pythonpath = os.environ.get("PYTHONPATH")
        env = dict(os.environ, PYTHONPATH=_PACKAGE_ROOT + (os.pathsep + pythonpath
                                                           if pythonpath else ""))
        self.owner_pid = os.getpid()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "qerl_jax.rewards.scoring_worker", str(self.owner_pid)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.loaded: tuple[tuple[str, bytes], ...] | None = None

    def exit_status(self, wait_seconds: float = 1.0) -> int | None:
        """The worker's exit status once it has exited (None if it has not within the wait)."""
        try:
            return self.process.wait(timeout=wait_seconds)
        except subprocess.TimeoutExpired:
            return None

    def alive(self) -> bool:
        return self.owner_pid == os.getpid() and self.process.poll() is None

    def request(self, message, timeout_seconds: float):
        """The worker's reply to `message`; TimeoutError, EOFError or OSError when none comes."""
        deadline = time.monotonic() + timeout_seconds
        write_message(self.process.stdin, message)
        fd = self.process.stdout.fileno()
        (size,) = _HEADER.unpack(_read_before(fd, _HEADER.size, deadline))
        return pickle.loads(_read_before(fd, size, deadline))

    def load(self, payloads: tuple[tuple[str, bytes], ...], timeout_seconds: float) -> None:
        """Sends the functions (and this process's sys.path, to import their modules)."""
        try:
            reply = self.request(("load", list(sys.path), payloads), timeout_seconds)
        except (TimeoutError, EOFError, OSError) as error:
            self.stop(kill=True)
            raise RuntimeError(f"the reward scoring worker did not load the reward functions "
                               f"within {timeout_seconds:.0f} s ({type(error).__name__}; its "
                               "stderr is above)") from None
        if reply[0] == "error":
            self.stop(kill=True)
            raise ValueError(f"the scoring worker cannot load reward function {reply[1]}; define "
                             "it at module level in an importable module, or score in-process "
                             "with time_limit_seconds=None")
        self.loaded = payloads

    def stop(self, kill: bool = False) -> None:
        """Ends the worker: end of input and a moment to exit, else (or with `kill`) a kill."""
        if self.owner_pid != os.getpid():
            return   # a forked copy of the owner: the process is the owner's to stop
        if self.process.poll() is None:
            try:
                if kill:
                    raise subprocess.TimeoutExpired(self.process.args, 0)
                self.process.stdin.close()
                self.process.wait(timeout=0.5)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass


class _WorkerSlot:
    """Holds the current worker; the scorer's finalizer stops it without keeping the scorer."""

    def __init__(self):
        self.worker: _Worker | None = None

    def stop(self, kill: bool = False) -> None:
        worker, self.worker = self.worker, None
        if worker is not None:
            worker.stop(kill)


class RewardScorer:
    """Scores completions in a worker process, at most a time limit per completion.

    The worker starts on the first `score_completions` with a limit, is kept across batches and
    restarted after a timeout; `close()` (or leaving a `with` block, or exit) stops it.
    `wall_clock_factor`: the wall-time limit per completion, in CPU-time limits.

    Attributes:
      worker_starts: workers started so far (1 + restarts after timeouts or crashes).
      timeouts: completions that hit a limit so far.
      last_start_seconds: wall time of the latest worker's start, load and warm-up.
    """

    def __init__(self, start_timeout_seconds: float = WORKER_START_TIMEOUT_SECONDS,
                 wall_clock_factor: float = WALL_CLOCK_FACTOR):
        self.start_timeout_seconds = start_timeout_seconds
        self.wall_clock_factor = wall_clock_factor
        self.worker_starts = 0
        self.timeouts = 0
        self.last_start_seconds = math.nan
        self._slot = _WorkerSlot()
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, self._slot.stop)   # also runs at exit

    def score_completions(self, completions: Sequence[str], golds: Sequence[str],
                          functions: Mapping[str, RewardFunction], *,
                          time_limit_seconds: float | None = DEFAULT_TIME_LIMIT_SECONDS
                          ) -> dict[str, list[float]]:
        """Per-function rewards of each completion, plus 'total' (their sum) and 'timeouts'.

        Args:
          completions, golds: [N] texts, paired by position.
          functions: name -> f(completion, gold) -> float; 'total' and 'timeouts' are reserved.
          time_limit_seconds: the most CPU time one completion (all functions) may take in the
            worker (and wall_clock_factor times it in wall time); None or 0 scores in this
            process, unbounded.

        Returns:
          {name: [N] rewards, 'total': [N] sums over the functions, 'timeouts': [N] 1.0 where
          the completion hit a limit (then it scores 0 everywhere), else 0.0}.
        """
        _check_arguments(completions, golds, functions, time_limit_seconds)
        if not time_limit_seconds:
            return _score_in_process(completions, golds, functions)
        payloads = _pickled_functions(functions)
        with self._lock:
            rows, timeouts, hits = [], [], {}
            for completion, gold in zip(completions, golds):
                values, limit = self._score_in_worker(payloads, completion, gold,
                                                      time_limit_seconds)
                timeouts.append(0.0 if limit is None else 1.0)
                rows.append([0.0] * len(payloads) if limit is not None else values)
                if limit is not None:
                    hits.setdefault(limit, []).append(completion)
        if hits:
            self.timeouts += int(sum(timeouts))
            logger.warning("reward scoring: %d of %d completions scored 0 at a limit (%s)",
                           int(sum(timeouts)), len(timeouts), _describe_hits(
                               hits, time_limit_seconds, self.wall_clock_factor))
        return _scores_by_name(list(functions), rows, timeouts)

    def _score_in_worker(self, payloads, completion, gold, time_limit_seconds):
        """(the completion's rewards, None), or (None, the limit it hit: one of LIMITS)."""
        worker = self._ready_worker(payloads)
        try:
            reply = worker.request(("score", completion, gold, time_limit_seconds),
                                   time_limit_seconds * self.wall_clock_factor)
        except TimeoutError:
            self._slot.stop(kill=True)   # the next completion starts a fresh worker
            return None, "wall"
        except (EOFError, OSError):
            returncode = worker.exit_status()
            self._slot.stop(kill=True)
            return None, "cpu" if returncode == -_SIGXCPU else "crash"
        except BaseException:
            self._slot.stop(kill=True)   # e.g. KeyboardInterrupt: a reply may still come
            raise
        if reply[0] == "cpu_limit":
            return None, "cpu"
        return reply[1], None

    def _ready_worker(self, payloads) -> _Worker:
        worker = self._slot.worker
        if worker is None or not worker.alive():
            self._slot.stop(kill=True)
            started = time.perf_counter()
            worker = self._slot.worker = _Worker()
            self.worker_starts += 1
            try:
                worker.load(payloads, self.start_timeout_seconds)
            except BaseException:
                self._slot.worker = None
                raise
            self.last_start_seconds = time.perf_counter() - started
        elif worker.loaded != payloads:
            try:
                worker.load(payloads, self.start_timeout_seconds)
            except BaseException:
                self._slot.worker = None
                raise
        return worker

    def close(self) -> None:
        """Stops the worker (a later call starts a new one)."""
        with self._lock:
            self._slot.stop()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _describe_hits(hits: dict[str, list[str]], time_limit_seconds: float,
                   wall_clock_factor: float) -> str:
    """How many completions hit each limit, and the start of the first one."""
    what = {"cpu": f"over {time_limit_seconds:g} s of CPU",
            "wall": f"over {time_limit_seconds * wall_clock_factor:g} s of wall time",
            "crash": "the worker died"}
    return "; ".join(f"{len(completions)} {what[limit]}, the first starting "
                     f"{str(completions[0])[:80]!r}"
                     for limit, completions in hits.items())


def _check_arguments(completions, golds, functions, time_limit_seconds) -> None:
    if len(completions) != len(golds):
        raise ValueError(f"score_completions: {len(completions)} completions but "
                         f"{len(golds)} golds")
    reserved = [name for name in functions if name in RESERVED_NAMES]
    if reserved:
        raise ValueError(f"score_completions: reward names {reserved} are reserved for the "
                         "summary columns")
    if time_limit_seconds is not None and not time_limit_seconds >= 0:
        raise ValueError(f"score_completions: time_limit_seconds must be >= 0 or None, got "
                         f"{time_limit_seconds}")


def _scores_by_name(names: list[str], rows: list[list[float]],
                    timeouts: list[float]) -> dict[str, list[float]]:
    scores = {name: [row[index] for row in rows] for index, name in enumerate(names)}
    scores["total"] = [float(sum(row)) for row in rows]
    scores["timeouts"] = timeouts
    return scores


def _score_in_process(completions, golds, functions) -> dict[str, list[float]]:
    rows = [reward_values(completion, gold, list(functions.values()))
            for completion, gold in zip(completions, golds)]
    return _scores_by_name(list(functions), rows, [0.0] * len(rows))


_default_scorer: RewardScorer | None = None
_default_scorer_lock = threading.Lock()


def default_scorer() -> RewardScorer:
    """The process-wide scorer behind `score_completions` (created on first use)."""
    global _default_scorer
    with _default_scorer_lock:
        if _default_scorer is None:
            _default_scorer = RewardScorer()
        return _default_scorer


def score_completions(completions: Sequence[str], golds: Sequence[str],
                      functions: Mapping[str, RewardFunction], *,
                      time_limit_seconds: float | None = DEFAULT_TIME_LIMIT_SECONDS
                      ) -> dict[str, list[float]]:
    """`RewardScorer.score_completions` on the process-wide default scorer (see it for the
    arguments); with time_limit_seconds None or 0 no worker is started."""
    if not time_limit_seconds:
        _check_arguments(completions, golds, functions, time_limit_seconds)
        return _score_in_process(completions, golds, functions)
    return default_scorer().score_completions(completions, golds, functions,
                                              time_limit_seconds=time_limit_seconds)
