"""XLA's GPU autotuning results kept in a file (config.xla_autotune_results), so that every
process compiles a program into the same kernels and a run reproduces token for token.

Why it is needed: while XLA compiles a program for the GPU it times candidate kernels for its
matrix products (tilings, split-K factors) and keeps the fastest. Timing noise can make two
compilations of the same program pick different candidates, whose float32 sums differ in the
last bits; a sampled rollout then diverges after a few tokens. In the GPU check of
benchmarks/RESULTS.md ("Reproducible GPU rollouts") the same 7B batch-8 rollout, same seed
and code, gave different tokens in two processes (NVFP4 and bf16), while a compiled program
called twice with
one key gave the same tokens, and two processes gave the same tokens when the second loaded
the first's autotuning results (or its compiled program from the persistent compilation
cache, config.compilation_cache_dir).

`persist_autotuning(path)` adds to XLA_FLAGS, before JAX starts its backend:
  --xla_gpu_load_autotune_results_from=path   (only when the file exists)
  --xla_gpu_dump_autotune_results_to=path
The first run writes the file (XLA rewrites it after each compilation with every result the
process holds); later runs load it, so their programs pick the recorded kernels, and the file
gains the results of programs the earlier runs did not compile. The flags concern the GPU
backend only; on a CPU they are accepted and change nothing. XLA_FLAGS is read once, when JAX
starts its backend, so this must run before the first JAX computation of the process (the
trainer calls it first thing).
"""

from __future__ import annotations

import logging
import os
import shlex

logger = logging.getLogger(__name__)

LOAD_FLAG = "--xla_gpu_load_autotune_results_from"
DUMP_FLAG = "--xla_gpu_dump_autotune_results_to"


def autotune_xla_flags(existing: str, path: str, *, exists: bool) -> str:
    """XLA_FLAGS `existing` with the load (if `exists`) and dump flags for `path`; earlier
    values of the two flags are replaced. A pure function of its arguments."""
    kept = [flag for flag in shlex.split(existing)
            if not flag.startswith((LOAD_FLAG + "=", DUMP_FLAG + "="))]
    if exists:
        kept.append(f"{LOAD_FLAG}={path}")
    kept.append(f"{DUMP_FLAG}={path}")
    return " ".join(shlex.quote(flag) for flag in kept)


def _backend_started() -> bool:
    try:
        from jax._src import xla_bridge
    except ImportError:  # private module moved: cannot tell, assume not started
        return False
    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started()) if started is not None else False


def persist_autotuning(path: str, *, field: str = "config.xla_autotune_results") -> str | None:
    """Points XLA's GPU autotuning at the file `path` (loaded if it exists, rewritten after
    each compilation) and returns its absolute path; "" changes nothing and returns None.

    Raises ValueError naming `field` when the file's directory cannot be created or written,
    when `path` is a directory, or when JAX has already started its backend in this process
    (XLA_FLAGS would be ignored: the run would not be reproducible, silently).
    """
    if not path:
        return None
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(path):
        raise ValueError(f"{field}: {path!r} is a directory; expected a file path "
                         "(e.g. runs/autotune_h100.textproto)")
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as error:
        raise ValueError(f"{field}: cannot create {directory!r}: {error}") from error
    if not os.access(directory, os.W_OK):
        raise ValueError(f"{field}: {directory!r} is not writable")
    exists = os.path.isfile(path) and os.path.getsize(path) > 0
    current = os.environ.get("XLA_FLAGS", "")
    if f"{DUMP_FLAG}={path}" in shlex.split(current):
        return path  # this process already records to the file (a second trainer)
    flags = autotune_xla_flags(current, path, exists=exists)
    if _backend_started():
        raise ValueError(
            f"{field}={path!r}: JAX has already started its backend in this process, so XLA "
            "would ignore the autotuning flags. Set it before the first JAX computation (a "
            "fresh process or notebook kernel), or set XLA_FLAGS yourself: "
            f"{flags!r}")
    os.environ["XLA_FLAGS"] = flags
    logger.info("XLA autotuning results %s %s", "loaded from and written to" if exists
                else "written to", path)
    return path
