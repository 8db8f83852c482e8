"""The CPU settings a run's numbers depend on (config.cpu_threads, config.xla_flags), applied
before JAX starts its backend.

XLA:CPU sizes its intra-op thread pool from the process's CPU affinity, and how a program's
work is split over that pool changes the rounding of its results: the same float32 program
gives other bits on a machine with another number of cores (neither
--xla_cpu_multi_thread_eigen=false nor turning the XNNPACK/YNNPACK dots off removes that).
`pin_cpu_numerics(threads, flags)` restricts the process to `threads` CPUs of its affinity mask
and adds `flags` to XLA_FLAGS (e.g. --xla_cpu_enable_platform_dependent_math=false, which asks
the dot libraries for results that do not depend on the CPU's instruction set). Both are read
once, when the backend starts: after that the settings cannot take effect and it raises.
"""

from __future__ import annotations

import logging
import os
import shlex

from qerl_jax.infra.xla_autotuning import _backend_started

logger = logging.getLogger(__name__)


def pinned_cpus(available: set[int], threads: int, start: int = 0) -> set[int]:
    """`threads` CPU ids of `available` (all of them when there are fewer): the sorted ids from
    position `start` on, wrapping around."""
    ids = sorted(available)
    return {ids[(start + i) % len(ids)] for i in range(min(threads, len(ids)))}


def merged_xla_flags(existing: str, flags: str) -> str:
    """XLA_FLAGS `existing` with `flags` added; an earlier value of the same flag is replaced."""
    added = shlex.split(flags)
    names = {flag.split("=", 1)[0] for flag in added}
    kept = [flag for flag in shlex.split(existing) if flag.split("=", 1)[0] not in names]
    return " ".join(shlex.quote(flag) for flag in kept + added)


def pin_cpu_numerics(threads: int, flags: str, *, fields: tuple[str, str] = (
        "config.cpu_threads", "config.xla_flags")) -> None:
    """Restricts this process to `threads` CPUs (0: unchanged) and adds `flags` to XLA_FLAGS
    ("" : unchanged). Raises ValueError naming the field when JAX's backend has already
    started and the setting is not in effect; warns when fewer CPUs than `threads` exist."""
    if threads:
        available = os.sched_getaffinity(0)
        # which CPUs does not change the numbers, only how many: processes started side by
        # side (an ablation's jobs) spread over the machine by their process id
        wanted = pinned_cpus(available, threads, start=os.getpid() * threads)
        if available != wanted:
            if _backend_started():
                raise ValueError(f"{fields[0]}={threads}: JAX has already started its backend "
                                 f"with {len(available)} CPUs; set it before the first JAX "
                                 "computation (a fresh process)")
            os.sched_setaffinity(0, wanted)
        if len(wanted) < threads:
            logger.warning("%s=%d: only %d CPUs available; the numbers will differ from a "
                           "run with %d", fields[0], threads, len(wanted), threads)
    if flags:
        current = os.environ.get("XLA_FLAGS", "")
        merged = merged_xla_flags(current, flags)
        if not set(shlex.split(flags)) <= set(shlex.split(current)):
            if _backend_started():
                raise ValueError(f"{fields[1]}={flags!r}: JAX has already started its backend, "
                                 "so XLA would ignore these flags; set it before the first JAX "
                                 f"computation (a fresh process), or set XLA_FLAGS={merged!r}")
            os.environ["XLA_FLAGS"] = merged
