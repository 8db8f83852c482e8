"""The main job's committed reference: the metrics of `configs/tiny.py` (seed 0) as the current
code computes them, and the figures the README quotes from them.

    python -m experiments.main_job_reference --run runs/tiny      # after the README's command

reads the run directory (it must be a complete, single-start run of configs/tiny.py with the
default seed) and writes experiments/results/main_job/metrics.jsonl (every step, timing fields
left out: they vary from machine to machine) and summary.json (means over the first and last
10 steps), with the platform it was made on: this machine's CPU (run it where the job ran)
and the CPU pins of the run's config (cpu_threads, xla_flags) that make the numbers the same on
other x86 CPUs. tests/test_main_job.py reruns the first steps and compares them exactly with
this file, and checks that the README quotes summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import numpy as np

from qerl_jax.infra.atomic_io import write_json_atomic
from qerl_jax.infra.metrics import read_metrics
from qerl_jax.infra.run_record import read_starts

REFERENCE_DIRECTORY = os.path.join(os.path.dirname(__file__), "results", "main_job")
METRICS_FILE = os.path.join(REFERENCE_DIRECTORY, "metrics.jsonl")
SUMMARY_FILE = os.path.join(REFERENCE_DIRECTORY, "summary.json")
# vary with the machine and its load: never part of the reference
TIMING_KEYS = ("time/rollout_s", "time/train_s", "time/sampler_compile_s",
               "rollout_tokens_per_s", "peak_memory_bytes")
WINDOW = 10


def comparable(rows: list[dict]) -> list[dict]:
    """Rows without the timing fields."""
    return [{key: value for key, value in row.items() if key not in TIMING_KEYS}
            for row in rows]


def read_reference() -> list[dict]:
    with open(METRICS_FILE) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def summarize(rows: list[dict]) -> dict:
    """Means of reward, accuracy and entropy over the first and the last WINDOW steps."""
    first, last = rows[:WINDOW], rows[-WINDOW:]

    def mean(part, key):
        return round(float(np.mean([row[key] for row in part])), 3)

    return {"steps": len(rows), "window": WINDOW,
            "first_steps": [first[0]["step"], first[-1]["step"]],
            "last_steps": [last[0]["step"], last[-1]["step"]],
            **{f"{key}_first": mean(first, key) for key in ("reward", "accuracy", "entropy")},
            **{f"{key}_last": mean(last, key) for key in ("reward", "accuracy", "entropy")}}


# the instruction-set extensions that select XLA's and its libraries' CPU kernels
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16",
             "avx_vnni", "amx_bf16", "amx_tile")


def cpu_description(cpuinfo: str) -> dict:
    """Vendor, model name, family/model and the ISA_FLAGS present, from /proc/cpuinfo text."""
    fields = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    present = set(fields.get("flags", "").split())
    return {"vendor": fields.get("vendor_id", "unknown"),
            "model_name": fields.get("model name", "unknown"),
            "family_model": f"{fields.get('cpu family', '?')}/{fields.get('model', '?')}",
            "isa": [flag for flag in ISA_FLAGS if flag in present]}


def platform_record(config: dict) -> dict:
    """The CPU this process runs on, its CPU count, and the run's CPU pins."""
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = cpu_description(handle.read())
    except OSError:
        cpu = {"model_name": platform.processor() or "unknown"}
    return {"cpu": cpu, "machine": platform.machine(), "cpus_available": os.cpu_count(),
            "cpu_threads": config.get("cpu_threads", 0), "xla_flags": config.get("xla_flags", "")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="the main job's run directory")
    args = parser.parse_args(argv)
    starts = read_starts(args.run)
    if len(starts) != 1 or starts[0]["config"]["seed"] != 0:
        print(f"error: {args.run}: expected one uninterrupted start with seed 0, found "
              f"{len(starts)} start(s)", file=sys.stderr)
        return 2
    rows = read_metrics(args.run)
    total = starts[0]["config"]["train"]["total_steps"]
    if [row["step"] for row in rows] != list(range(total)):
        print(f"error: {args.run}: metrics.jsonl does not hold steps 0..{total - 1}",
              file=sys.stderr)
        return 2
    os.makedirs(REFERENCE_DIRECTORY, exist_ok=True)
    temporary = METRICS_FILE + ".tmp"
    with open(temporary, "w") as handle:
        for row in comparable(rows):
            handle.write(json.dumps(row, sort_keys=True, allow_nan=False) + "\n")
    os.replace(temporary, METRICS_FILE)
    summary = summarize(rows)
    summary["git_revision"] = starts[0].get("git_revision", "unknown")
    summary["versions"] = starts[0].get("versions", {})
    summary["platform"] = platform_record(starts[0]["config"])
    write_json_atomic(SUMMARY_FILE, summary, indent=1, sort_keys=True)
    print(json.dumps(summary, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
