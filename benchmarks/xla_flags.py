"""Lists the XLA flags (DebugOptions names) that the installed jaxlib and its GPU plugin know,
filtered by a regular expression: which switches a JAX version offers (XLA's documentation
lists only a few, and names change between releases).

    python benchmarks/xla_flags.py --pattern "pdl|command_buffer" --out $OUT/flags

Scans the shared objects under the jaxlib and jax plugin packages for strings `xla_[a-z0-9_]+`
(the flag names that XLA's parser and DebugOptions carry) and writes the sorted matches, one per
line, to stdout and to <out>/xla_flags.txt.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys

_FLAG = re.compile(rb"xla_[a-z0-9_]{4,}")


def package_dirs() -> list[str]:
    """Install folders of jaxlib and of the jax CUDA plugins present."""
    dirs = []
    for name in ("jaxlib", "jax_plugins", "jax_cuda13_plugin", "jax_cuda12_plugin",
                 "jax_cuda13_pjrt", "jax_cuda12_pjrt"):
        spec = importlib.util.find_spec(name)
        if spec is None:
            continue
        for location in (spec.submodule_search_locations or []):
            dirs.append(location)
    return dirs


def flag_names(dirs: list[str]) -> set[str]:
    names: set[str] = set()
    for root_dir in dirs:
        for root, _, files in os.walk(root_dir):
            for file in files:
                if ".so" not in file:
                    continue
                with open(os.path.join(root, file), "rb") as handle:
                    names.update(m.decode() for m in _FLAG.findall(handle.read()))
    return names


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pattern", default=".", help="regular expression on the flag names")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    dirs = package_dirs()
    if not dirs:
        raise SystemExit("xla_flags: no jaxlib found")
    pattern = re.compile(args.pattern)
    found = sorted(name for name in flag_names(dirs) if pattern.search(name))
    text = "\n".join(found) + "\n"
    sys.stdout.write(f"# scanned: {', '.join(dirs)}\n" + text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "xla_flags.txt"), "w") as handle:
            handle.write(text)


if __name__ == "__main__":
    main()
