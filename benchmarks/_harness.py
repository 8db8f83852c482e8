"""The benchmark scripts' harness: worker subprocesses under a wall-clock budget, their JSON
lines, markdown tables and output files (stdlib only: the parent process never imports jax),
the command line's `--config.FIELD=VALUE` arguments, and on the worker side the device facts
(versions, peak memory, OOM detection).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import subprocess
import sys
import time

# The benchmarks run as scripts (sys.path[0] = benchmarks/): make the repository's qerl_jax the
# one imported, whether or not the package is installed.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(1, REPO_ROOT)

# when this process started (the scripts import this module first): a command's budget counts
# from here, so the configs built and checked before any worker count against it too
STARTED = time.time()
DEFAULT_MEMORY_FRACTION = "0.95"
# on a mesh of several GPUs XLA also allocates collective memory outside its preallocated pool
# (cuda_device_allocator): with the single-device fraction a gradient all-reduce can fail to
# get its scratch buffer
MESH_MEMORY_FRACTION = "0.90"
OVERRIDE_PREFIX = "--config."
OVERRIDES_HELP = ("--config.FIELD=VALUE: any field of the trainer's config (python -m "
                  "qerl_jax.train --help lists them), parsed as the command line parses it, "
                  "e.g. --config.quant.kernels.mosaic_schedule=split_k")


# ============================================================================== parent side
def split_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def worker_env(devices: int = 1) -> dict:
    """Environment of a worker: XLA may preallocate DEFAULT_MEMORY_FRACTION of the GPU (JAX's
    own default leaves a quarter of it unused), MESH_MEMORY_FRACTION on several devices; an
    explicit setting of the caller wins."""
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION",
                   DEFAULT_MEMORY_FRACTION if devices == 1 else MESH_MEMORY_FRACTION)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    return env


def read_jsonl(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    rows = []
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut by a kill
                    pass
    return rows


def append_jsonl(path: str, row: dict) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps(row) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def tail(path: str, lines: int = 15) -> str:
    if not os.path.isfile(path):
        return ""
    with open(path, errors="replace") as handle:
        return "".join(handle.readlines()[-lines:])


def run_worker(command: list[str], log_path: str, timeout_s: float,
               devices: int = 1) -> tuple[int | None, float]:
    """Runs one worker subprocess (output to log_path) for at most timeout_s seconds, on
    `devices` devices (worker_env).

    Returns (exit code or None when it was killed at the budget, wall seconds). Only the
    worker this function started is killed (by its pid), never anything else.
    """
    started = time.perf_counter()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env=worker_env(devices))
        try:
            code = process.wait(timeout=max(timeout_s, 1.0))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            code = None
    return code, time.perf_counter() - started


class Budget:
    """Wall-clock budget of one benchmark command (the machine's time limit minus slack)."""

    def __init__(self, seconds: float, started: float = STARTED):
        self.seconds = seconds
        self.deadline = started + seconds

    def left(self) -> float:
        return self.deadline - time.time()


def fmt_number(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if abs(value) >= 100:
            return f"{value:.0f}"
        return f"{value:.{digits}g}"
    return str(value)


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """rows -> markdown; columns = [(key, header)]."""
    lines = ["| " + " | ".join(header for _, header in columns) + " |",
             "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(fmt_number(row.get(key)) for key, _ in columns) + " |")
    return "\n".join(lines)


def _memory_fraction(meta: dict) -> str:
    """The preallocation the rows' process ran with: as its worker recorded it (a process that
    set none ran at JAX's default), else what a worker of this command gets."""
    if "memory_fraction" in meta:
        return meta["memory_fraction"] or "unset (JAX's default 0.75)"
    return os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_MEMORY_FRACTION)


def header_line(title: str, rows: list[dict]) -> str:
    """Title, date, device, versions (as the workers reported them) and the command."""
    meta = next((row for row in rows if row.get("device")), {})
    return (f"{title}, {datetime.date.today()}, {meta.get('device', 'device unknown')}, JAX "
            f"{meta.get('jax', '?')}, flax {meta.get('flax', '?')}, git {meta.get('git', '?')}, "
            f"XLA_PYTHON_CLIENT_MEM_FRACTION={_memory_fraction(meta)}"
            + (f", XLA_FLAGS={os.environ['XLA_FLAGS']}" if os.environ.get("XLA_FLAGS") else "")
            + f". Command: python {' '.join(sys.argv)}")


def write_outputs(out_dir: str, name: str, text: str, payload: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name + ".md"), "w") as handle:
        handle.write(text + "\n")
    with open(os.path.join(out_dir, name + ".json"), "w") as handle:
        json.dump(payload, handle, indent=1)


# ============================================================================== command line
def add_worker_arguments(parser, script_name: str) -> None:
    """The options rollout.py and grpo_step.py share: --kernels-interpret, --out, --merge, and
    the internal ones a parent passes to its worker processes."""
    import argparse
    parser.add_argument("--kernels-interpret", action="store_true",
                        help="CPU check of the kernel path: the Pallas kernels in interpret "
                             "mode (qerl_jax.model_setup.build_model(interpret=True))")
    parser.add_argument("--out", default=".")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help=f"merge the rows of these runs' {script_name}_*.json into one table "
                             f"({script_name}_merged.md/.json in --out); runs nothing")
    # internal: one worker = one (size, format)
    for name in ("--size", "--format", "--results"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--spawned-at", type=float, help=argparse.SUPPRESS)


def parse_arguments(parser, argv=None):
    """parser.parse_args, with the --config.FIELD=VALUE arguments kept apart in args.overrides
    (in command-line order) for qerl_jax.train.apply_overrides; anything else unknown is the
    parser's one-line error."""
    args, rest = parser.parse_known_args(argv)
    overrides = [arg for arg in rest if arg.startswith(OVERRIDE_PREFIX)]
    unknown = [arg for arg in rest if not arg.startswith(OVERRIDE_PREFIX)]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    for arg in overrides:
        if "=" not in arg:
            parser.error(f"{arg}: write the value after '=' ({OVERRIDE_PREFIX}FIELD=VALUE)")
    args.overrides = overrides
    return args


def output_name(script_name: str, sizes: list[str], tag: str = "") -> str:
    """'rollout_7b-32b' + the tag of the run's non-default choices ('_no-kernels', ...)."""
    return f"{script_name}_" + "-".join(sizes) + tag


def read_lengths(path: str) -> list[int]:
    """The completion lengths of a lengths.json ({"lengths": [...]}) or a JSON list."""
    import json

    with open(path) as handle:
        data = json.load(handle)
    values = data.get("lengths") if isinstance(data, dict) else data
    if not isinstance(values, list) or not values or not all(
            isinstance(value, int) and value >= 1 for value in values):
        raise ValueError("expected a non-empty list of integers >= 1 (or {\"lengths\": [...]})")
    return values


def parsed_lengths(parser, path: str) -> list[int] | None:
    """read_lengths(path) for a --lengths option (None when empty); a bad file is the parser's
    one-line error naming it."""
    if not path:
        return None
    try:
        return read_lengths(path)
    except (OSError, ValueError) as error:
        parser.error(f"--lengths {path}: {error}")


def draw_lengths(values: list[int], batch: int, new_tokens: int, seed: int):
    """One stop length per row: drawn with replacement from `values` (seeded by seed and
    batch), clipped to [1, new_tokens]."""
    import numpy as np

    rng = np.random.default_rng([seed, batch])
    return np.clip(rng.choice(np.asarray(values), size=batch), 1, new_tokens).astype(np.int32)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    import argparse

    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def run_script(args, worker_main, parent_main, merge_main) -> None:
    """--merge, --worker or the parent, as the arguments say."""
    if args.merge:
        merge_main(args)
    elif args.worker:
        worker_main(args)
    else:
        parent_main(args)


def merged_rows(paths: list[str]) -> list[dict]:
    """The result rows of several runs' JSON outputs (write_outputs payloads), in order; a row
    whose status is not ok is dropped when another run has an ok row of the same case."""
    rows: list[dict] = []
    for path in paths:
        with open(path) as handle:
            payload = json.load(handle)
        for row in payload["rows"]:
            row.setdefault("source", os.path.basename(os.path.dirname(path)) or path)
            rows.append(row)

    def case(row):
        return (row.get("size"), row.get("format"), row.get("batch"))

    ok = {case(row) for row in rows if str(row.get("status", "")).startswith("ok")}
    return [row for row in rows
            if str(row.get("status", "")).startswith("ok") or case(row) not in ok]


# ============================================================================== worker side
def device_info() -> dict:
    """Device kind, versions and git revision for the result rows."""
    import flax
    import jax

    from qerl_jax.infra.metrics import git_revision
    return {"device": jax.devices()[0].device_kind, "platform": jax.default_backend(),
            "jax": jax.__version__, "flax": flax.__version__, "git": git_revision(),
            "memory_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")}


def peak_memory_gib() -> tuple[float, str]:
    """(peak bytes in use / 2**30, source): the device allocator's peak where the backend
    reports one (it cannot be reset: one process per case), else the process's peak RSS."""
    import resource

    import jax
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"] / 2**30, "device peak_bytes_in_use"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30, "host peak RSS"


def memory_limit_gib() -> float | None:
    import jax
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return None if limit is None else limit / 2**30


def is_out_of_memory(error: BaseException) -> bool:
    text = f"{type(error).__name__}: {error}"
    return any(marker in text for marker in ("RESOURCE_EXHAUSTED", "Out of memory",
                                              "out of memory", "OOM"))


def describe_error(error: BaseException) -> str:
    if is_out_of_memory(error):
        return "OOM"
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    return "error: " + text[:200]


def state_gib(tree) -> float:
    """GiB of the arrays in `tree`, each counted once (an MLP's gate/up pair views hold the
    same interleaved arrays)."""
    import jax
    unique = {id(leaf): leaf for leaf in jax.tree_util.tree_leaves(tree) if hasattr(leaf, "dtype")}
    return sum(leaf.size * leaf.dtype.itemsize for leaf in unique.values()) / 2**30
