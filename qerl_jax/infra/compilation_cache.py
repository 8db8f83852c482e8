"""JAX's persistent compilation cache for training runs (config.compilation_cache_dir).

A run compiles a handful of programs (the sampler per prompt bucket, the loss gradient, the
optimizer update). With a cache directory, JAX writes each compiled program there, and a later
run of the same shapes (the next seed or format of an ablation, a resumed run) loads it instead
of compiling (benchmarks/RESULTS.md has what that saves at 7B).

A loaded program also skips XLA's GPU autotuner, whose scratch buffers are the largest transient
of a cold step (the 7B step's peak memory in benchmarks/RESULTS.md). So a run with a warm cache
peaks lower than a cold one; the benchmarks say which they measured.

JAX keeps one cache per process: the directory applies to every program compiled afterwards,
also outside the trainer. Programs that compile in under
jax.config.jax_persistent_cache_min_compile_time_secs (JAX's default 1 s) are not written.
"""

from __future__ import annotations

import logging
import os

import jax
from jax.experimental.compilation_cache import compilation_cache

logger = logging.getLogger(__name__)


def enable_compilation_cache(directory: str) -> str | None:
    """Points JAX's persistent compilation cache at `directory` (created if missing) and returns
    its absolute path; "" leaves the cache as it is and returns None.

    Raises ValueError naming config.compilation_cache_dir if the directory cannot be created or
    written.
    """
    if not directory:
        return None
    path = os.path.abspath(os.path.expanduser(directory))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        raise ValueError(f"config.compilation_cache_dir: cannot create {path!r}: {error}") \
            from error
    if not os.access(path, os.W_OK):
        raise ValueError(f"config.compilation_cache_dir: {path!r} is not writable")
    if jax.config.jax_compilation_cache_dir != path:
        jax.config.update("jax_compilation_cache_dir", path)
        # the cache is initialized once per process, at the first compile: start it again so
        # the new directory is used even if something compiled before
        compilation_cache.reset_cache()
        logger.info("persistent compilation cache at %s", path)
    return path


def cache_entries(directory: str) -> int:
    """Number of files in a cache directory (0 if it does not exist): cold (0) or warm."""
    if not directory or not os.path.isdir(directory):
        return 0
    return sum(len(files) for _, _, files in os.walk(directory))
