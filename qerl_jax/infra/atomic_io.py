"""Atomic file writes: a crash mid-write leaves the previous file (or none), never half of one."""

from __future__ import annotations

import json
import os


def write_json_atomic(path: str, payload, **dump_options) -> None:
    """json.dump(payload) to `path` through a temporary file and os.replace.

    dump_options go to json.dump (default indent=2)."""
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "w") as handle:
        json.dump(payload, handle, **{"indent": 2, **dump_options})
    os.replace(temporary, path)
