"""Atomic file writes: a crash mid-write leaves the previous file (or none), never half of one;
a failed write is one StorageError naming the path."""

from __future__ import annotations

import contextlib
import json
import os

from qerl_jax.infra.errors import StorageError


def os_error_reason(error: OSError) -> str:
    """'no space left on device' and the like: the OS's reason in lower case."""
    reason = error.strerror or str(error) or type(error).__name__
    return reason[:1].lower() + reason[1:]


@contextlib.contextmanager
def storage_errors(path: str, action: str = "write"):
    """Turns an OSError inside the block into StorageError('could not {action} {path}: ...')."""
    try:
        yield
    except StorageError:
        raise
    except OSError as error:
        raise StorageError(f"could not {action} {path}: {os_error_reason(error)}") from error


def remove_quietly(path: str) -> None:
    """Removes `path` if it exists (a failed write's temporary file)."""
    with contextlib.suppress(OSError):
        os.remove(path)


def write_text_atomic(path: str, text: str) -> None:
    """`text` to `path` through a temporary file and os.replace; StorageError naming `path`."""
    temporary = f"{path}.tmp-{os.getpid()}"
    try:
        with storage_errors(path):
            with open(temporary, "w") as handle:
                handle.write(text)
            os.replace(temporary, path)
    finally:
        remove_quietly(temporary)


def write_json_atomic(path: str, payload, **dump_options) -> None:
    """json.dump(payload) to `path` through a temporary file and os.replace; StorageError
    naming `path` when it cannot be written.

    dump_options go to json.dumps (default indent=2)."""
    write_text_atomic(path, json.dumps(payload, **{"indent": 2, **dump_options}))
