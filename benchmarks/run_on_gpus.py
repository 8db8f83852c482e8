"""Runs independent benchmark commands side by side, one GPU each, on a multi-GPU host.

    python benchmarks/run_on_gpus.py --jobs jobs.txt --out $OUT [--gpus 4]

jobs.txt holds one shell command per line (blank lines and '#' comments skipped); '{out}' in a
command is replaced by its own output folder $OUT/job<i>, '{flags}' by --flags, and '{budget}' by
the seconds left until --total-s (minus a 15 s margin) when the job starts; a job is not started
when fewer than --min-start-s are left (recorded as skipped). Each GPU runs the next job not yet
started, with CUDA_VISIBLE_DEVICES set to that GPU alone, so the jobs do not share a device
(timings stay those of one GPU; the host's CPUs and PCIe are shared). A job's stdout and stderr
go to $OUT/job<i>/log.txt; a summary (command, GPU, exit code, wall seconds) to
$OUT/jobs_summary.md. Jobs are started in file order: put the longest first.
"""

from __future__ import annotations

import argparse
import os
import queue
import subprocess
import threading
import time


def gpu_count() -> int:
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                 check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0
    return sum(line.startswith("GPU ") for line in listing.splitlines())


def read_jobs(path: str) -> list[str]:
    with open(path) as handle:
        return [line.strip() for line in handle
                if line.strip() and not line.strip().startswith("#")]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", required=True, help="file of shell commands, one per line")
    parser.add_argument("--out", required=True)
    parser.add_argument("--gpus", type=int, default=0, help="default: all that nvidia-smi lists")
    parser.add_argument("--flags", default="", help="replaces '{flags}' in every command")
    parser.add_argument("--total-s", type=float, default=0.0,
                        help="wall-clock budget of all jobs together (0: none)")
    parser.add_argument("--min-start-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    jobs = read_jobs(args.jobs)
    gpus = args.gpus or gpu_count()
    if gpus <= 0:
        raise SystemExit("no GPU found (nvidia-smi -L); pass --gpus")
    pending: queue.Queue = queue.Queue()
    for index, command in enumerate(jobs):
        pending.put((index, command))
    results: dict[int, dict] = {}
    begin = time.time()

    def worker(gpu: int):
        while True:
            try:
                index, command = pending.get_nowait()
            except queue.Empty:
                return
            out = os.path.join(args.out, f"job{index}")
            os.makedirs(out, exist_ok=True)
            left = args.total_s - (time.time() - begin) - 15 if args.total_s else 1e9
            if left < args.min_start_s:
                results[index] = {"command": command, "gpu": gpu, "code": "skipped",
                                  "wall_s": 0.0}
                print(f"[gpu {gpu}] job{index}: skipped, {left:.0f} s left", flush=True)
                continue
            command = command.replace("{budget}", f"{left:.0f}")
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpu))
            started = time.time()
            print(f"[gpu {gpu}] job{index}: {command}", flush=True)
            with open(os.path.join(out, "log.txt"), "w") as log:
                code = subprocess.call(command.replace("{out}", out).replace("{flags}", args.flags),
                                       shell=True, env=env,
                                       stdout=log, stderr=subprocess.STDOUT)
            wall = time.time() - started
            results[index] = {"command": command, "gpu": gpu, "code": code, "wall_s": wall}
            print(f"[gpu {gpu}] job{index} exited {code} after {wall:.0f} s", flush=True)

    threads = [threading.Thread(target=worker, args=(gpu,)) for gpu in range(gpus)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lines = ["| job | GPU | exit | wall s | command |", "|---|---|---|---|---|"]
    for index in sorted(results):
        row = results[index]
        lines.append(f"| job{index} | {row['gpu']} | {row['code']} | {row['wall_s']:.0f} | "
                     f"`{row['command']}` |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "jobs_summary.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
