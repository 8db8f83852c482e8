"""Which backend runs a quantized matmul: the registered backends of a (format, platform), asked
in order.

Backends (qerl_jax/quant/backends/: Mosaic GPU, Triton, registered by
qerl_jax.quant.kernel_registry.register_kernels) register with `register_backend` for a
(format, platform) and a range of M. For a launch, `first_taker` walks that list in order: a
backend whose M range covers the launch and that does not refuse it runs it; one that refuses
(its answer is a sentence: the weight's layout, the compute dtype, a LoRA rank, this machine)
hands the launch to the next. Past the end, the XLA reference backend runs (dequantize to the
compute dtype, then one dot with float32 accumulation). Which path runs and why each faster one
was not taken is logged once per distinct answer.
"""

from __future__ import annotations

import logging
from typing import Callable

from qerl_jax.quant.backends.base import MatmulBackend
from qerl_jax.quant.backends.xla import XLA

logger = logging.getLogger(__name__)

_BACKENDS: dict[tuple[str, str], list[MatmulBackend]] = {}
_LOGGED: set[tuple] = set()


def register_backend(format_name: str, platform: str, backend: MatmulBackend) -> MatmulBackend:
    """Registers a backend for (format, platform) ("gpu", "cpu", "tpu") over its M range.

    Backends registered first are asked first. Returns the backend.
    """
    if backend.max_m is not None and backend.max_m < backend.min_m:
        raise ValueError(f"backend {backend.name}: max_m={backend.max_m} < min_m="
                         f"{backend.min_m}")
    entries = _BACKENDS.setdefault((format_name, platform), [])
    if any(entry.name == backend.name for entry in entries):
        raise ValueError(f"a {format_name}/{platform} backend named {backend.name!r} is "
                         "already registered")
    entries.append(backend)
    return backend


def unregister_backend(format_name: str, platform: str, name: str) -> None:
    """Removes a registered backend (tests, benchmarks comparing paths)."""
    entries = _BACKENDS.get((format_name, platform), [])
    _BACKENDS[(format_name, platform)] = [entry for entry in entries if entry.name != name]


def unregister_backends(format_name: str, platform: str | None = None) -> list[str]:
    """Removes every backend of `format_name` (on `platform`, or on every platform); returns
    "name/platform" of each one removed."""
    removed = []
    for (fmt, where), entries in list(_BACKENDS.items()):
        if fmt == format_name and platform in (None, where):
            removed += [f"{entry.name}/{where}" for entry in entries]
            _BACKENDS[(fmt, where)] = []
    return removed


def registered_backends(format_name: str | None = None,
                        platform: str | None = None) -> list[tuple[str, str, str]]:
    """(format, platform, backend name) of every registered backend, in the order dispatch
    asks them; only those of `format_name` / `platform` where given."""
    return [(fmt, where, entry.name) for (fmt, where), entries in _BACKENDS.items()
            for entry in entries if format_name in (None, fmt) and platform in (None, where)]


def backends_for(format_name: str, platform: str) -> list[MatmulBackend]:
    """The backends registered for (format, platform), in the order dispatch asks them."""
    return list(_BACKENDS.get((format_name, platform), []))


def first_taker(format_name: str, m: int, platform: str,
                refusal: Callable[[MatmulBackend], str | None]
                ) -> tuple[MatmulBackend | None, list[str]]:
    """The first registered backend of (format, platform) whose M range covers m and for which
    `refusal(backend)` is None, and the refusals of those asked before it ("name: why")."""
    refusals = []
    for backend in _BACKENDS.get((format_name, platform), []):
        if not backend.accepts(m):
            continue
        reason = refusal(backend)
        if reason is None:
            return backend, refusals
        refusals.append(f"{backend.name} refused: {reason}")
    if not _BACKENDS.get((format_name, platform)):
        refusals.append(f"no compiled 4-bit kernel for {format_name} on {platform}")
    elif not any(b.accepts(m) for b in _BACKENDS[(format_name, platform)]):
        ranges = ", ".join(f"{b.name} takes M in {b.m_range()}"
                           for b in _BACKENDS[(format_name, platform)])
        refusals.append(f"no kernel takes M={m} ({ranges})")
    return None, refusals


def select_matmul_path(format_name: str, m: int, platform: str) -> str:
    """Name of the first backend that would be asked to run an M-row matmul with a
    `format_name` weight on `platform` (refusals need the weight), or "xla"."""
    for backend in _BACKENDS.get((format_name, platform), []):
        if backend.accepts(m):
            return backend.name
    return XLA.name


def log_path_once(launch: str, format_name: str, platform: str, m: int, path: str,
                  description: str, refusals: list[str]) -> None:
    """Logs once per distinct message which path a launch takes and why faster ones did not,
    e.g. "nvfp4 matmul on cpu at M=1: xla path (dequantize then XLA dot); no compiled 4-bit
    kernel for nvfp4 on cpu"."""
    message = (f"{format_name} {launch} on {platform} at M={m}: {path} path ({description})"
               + "".join(f"; {reason}" for reason in refusals))
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.info("%s", message)
