"""Run infrastructure: checkpoints, metrics, the run record, interrupts, atomic file writes,
the compilation cache, XLA autotuning results, host offload and the CLI's error types.

Imports nothing on import, so JAX-free callers (the config schema, `--help`) stay fast.
"""
