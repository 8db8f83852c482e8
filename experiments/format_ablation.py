"""Format ablation: one config trained with each weight format x seed, then the summary table,
the paper's claims tested on per-seed paired differences (95% t-intervals), and the entropy /
reward / accuracy (and held-out pass@1) curves.

    python -m experiments.format_ablation                        # tiny config, 5 formats x 3 seeds
    python -m experiments.format_ablation --config configs/tiny.py --seeds 0,1,2 \\
        --formats bf16,nf4,mxfp4,nvfp4,nvfp4+aqn --set train.total_steps=40 --jobs 1 \\
        --out experiments/results/tiny_format_ablation
    python -m experiments.format_ablation --config configs/smollm2.py --seeds 0,1,2 \\
        --formats bf16,nf4,mxfp4,nvfp4,nvfp4+aqn,nvfp4+aqn+tis --jobs 2 \\
        --out experiments/results/smollm2_format_study
    python -m experiments.format_ablation --summarize-only --out DIR   # read existing runs only

Each run goes into OUT/<format>/seed<k>/ (nvfp4+aqn -> nvfp4_aqn; the format as the analysis
reads it back from the run's config) through the trainer's CLI
(`python -m qerl_jax.train`), which writes run.json (config, seed, versions, git revision),
metrics.jsonl, checkpoints and train.log. ablation_run.json records the command, the config
fingerprint, the status and the wall time. A run whose status is 'done' with the same config
fingerprint is skipped; one with another fingerprint stops the script (use another --out);
an unfinished one resumes from its last checkpoint.

Formats (experiments/study_variants.py): <weight format>[+aqn][+<objective>][+<correction>]
[+<estimator>], each '+' part a name of the registry that holds it (policy objectives, rollout
corrections, advantage estimators), e.g. nvfp4+aqn+gspo; `tis` is token_truncate with the cap at
2. Every part a format does not name is set to the schema's default (AQN off, the clipped
objective, no rollout correction, group-normalized advantages) whatever the config says, so the
columns differ only in what they name; everything else comes from the config and --set
overrides, identical for all formats. The default set is bf16, nf4, mxfp4, nvfp4, nvfp4+aqn.

The supervised warm-up (tiny config) depends on the seed and the model / warm-up / data fields,
not on the format: it is trained once per seed into OUT/warmup/seed<k>-<hash>/ and each run's
`warmup` is a relative symlink to it (the trainer's cache reuses it when warmup_done.txt is
there). With --jobs > 1, the first run of each seed builds its warm-up before the others of
that seed start.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from experiments import ablation_analysis
from experiments.ablation_analysis import FORMATS
from experiments.study_variants import (
    GRAMMAR,
    format_directory_name,
    format_of_config,
    format_overrides,
    parse_variant,
)
from qerl_jax.infra.atomic_io import write_json_atomic
from qerl_jax.infra.errors import ConfigError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join("configs", "tiny.py")
DEFAULT_OUT = os.path.join("experiments", "results", "tiny_format_ablation")
STATUS_FILE = "ablation_run.json"
# Config sections the supervised warm-up reads (qerl_jax.trainer.build_model, qerl_jax.warmup).
WARMUP_SECTIONS = ("seed", "model", "warmup", "data")


def resolve_config(config_path: str, overrides: Sequence[str]):
    """The ConfigDict that `python -m qerl_jax.train --config PATH --config.F=V ...` would see.

    overrides: 'field=value' strings, applied in order (absl's config_flags parses them, so
    types follow the config's fields exactly as the trainer CLI does).
    """
    from absl import flags
    from ml_collections import config_flags

    argv = ["format_ablation", f"--config={config_path}"]
    argv += [f"--config.{override}" for override in overrides]
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=flag_values,
                                    lock_config=True, sys_argv=argv)
    flag_values(argv)
    return flag_values.config


def check_formats(config_path: str, formats: Sequence[str], overrides: Sequence[str] = ()):
    """Parses each study format after importing the config's plug-ins (config.imports), whose
    registered names are parts too; ValueError (one line) for a bad one."""
    from qerl_jax.experiment_config import import_config_plugins

    import_config_plugins(resolve_config(config_path, overrides))
    for name in formats:
        parse_variant(name)


def fingerprint(data: object) -> str:
    text = json.dumps(data, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclasses.dataclass
class RunSpec:
    format: str
    seed: int
    directory: str
    overrides: list[str]          # field=value, the user's --set then format and seed
    config_json: dict             # the resolved config the trainer will record
    warmup_directory: str | None  # shared warm-up cache (None when config.warmup.steps == 0)

    @property
    def config_fingerprint(self) -> str:
        return fingerprint(self.config_json)

    def command(self, config_path: str, resume: bool) -> list[str]:
        command = [sys.executable, "-m", "qerl_jax.train", f"--config={config_path}",
                   f"--workdir={self.directory}"]
        command += [f"--config.{override}" for override in self.overrides]
        return command + (["--resume"] if resume else [])


def plan_runs(config_path: str, formats: Sequence[str], seeds: Sequence[int],
              overrides: Sequence[str], out_dir: str) -> list[RunSpec]:
    """One RunSpec per (seed, format), seeds outermost (formats of a seed share a warm-up)."""
    from qerl_jax.experiment_config import validate_config

    specs = []
    # The progress bar writes carriage returns into train.log; the user's --set can turn it on.
    base = ["logging.progress_bar=False", *overrides]
    for seed in seeds:
        directories = {}
        for name in formats:
            run_overrides = base + [f"{field}={value}" for field, value in
                                    format_overrides(name).items()] + [f"seed={seed}"]
            config = resolve_config(config_path, run_overrides)
            validate_config(config)   # a bad override stops here, before any training
            config_json = json.loads(config.to_json())
            # the name the analysis reads back from run.json names the directory
            recorded = format_of_config(config_json)
            if recorded in directories:
                raise ValueError(f"formats {directories[recorded]!r} and {name!r} select the "
                                 f"same runs ({recorded})")
            directories[recorded] = name
            warmup = None
            if config.warmup.steps > 0 and not config.model.hf_path:
                key = fingerprint({section: config_json[section]
                                   for section in WARMUP_SECTIONS})
                warmup = os.path.join(out_dir, "warmup", f"seed{seed}-{key}")
            specs.append(RunSpec(format=recorded, seed=seed,
                                 directory=os.path.join(out_dir, format_directory_name(recorded),
                                                        f"seed{seed}"),
                                 overrides=run_overrides, config_json=config_json,
                                 warmup_directory=warmup))
    return specs


def read_status(directory: str) -> dict | None:
    path = os.path.join(directory, STATUS_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as handle:
        return json.load(handle)


def run_state(spec: RunSpec) -> str:
    """'done' (skip), 'new' or 'partial' (resume); raises on a finished run of another config."""
    status = read_status(spec.directory)
    if status is None:
        return "partial" if os.path.isfile(os.path.join(spec.directory, "metrics.jsonl")) \
            else "new"
    if status.get("config_fingerprint") != spec.config_fingerprint:
        raise RuntimeError(
            f"{spec.directory} holds a run of another config (fingerprint "
            f"{status.get('config_fingerprint')} != {spec.config_fingerprint}); use another "
            "--out or delete that directory")
    return "done" if status.get("status") == "done" else "partial"


def _link_warmup(spec: RunSpec) -> None:
    """Points the run's warmup/ at the shared per-seed cache (a relative symlink)."""
    if spec.warmup_directory is None:
        return
    os.makedirs(spec.warmup_directory, exist_ok=True)
    link = os.path.join(spec.directory, "warmup")
    target = os.path.relpath(spec.warmup_directory, spec.directory)
    if os.path.islink(link):
        if os.readlink(link) == target:
            return
        os.unlink(link)
    elif os.path.exists(link):
        return   # a run-private warm-up from an earlier layout: keep using it
    os.symlink(target, link)


def _write_status(spec: RunSpec, **fields) -> None:
    path = os.path.join(spec.directory, STATUS_FILE)
    status = read_status(spec.directory) or {}
    status.update(fields)
    write_json_atomic(path, status, indent=1, sort_keys=True)


def _has_checkpoint(directory: str) -> bool:
    checkpoints = os.path.join(directory, "checkpoints")
    return os.path.isdir(checkpoints) and any(name.isdigit() for name in os.listdir(checkpoints))


_print_lock = threading.Lock()


def _say(message: str) -> None:
    with _print_lock:
        print(message, flush=True)


def execute_run(spec: RunSpec, config_path: str, state: str, env: dict | None = None) -> dict:
    """Runs one training run as a subprocess (log in DIR/train.log); returns its status."""
    os.makedirs(spec.directory, exist_ok=True)
    _link_warmup(spec)
    # a started run resumes (from step 0 when it has no checkpoint yet: the trainer cuts
    # metrics.jsonl back to the step it resumes from)
    resume = state == "partial"
    warmup_cached = spec.warmup_directory is not None and os.path.isfile(
        os.path.join(spec.warmup_directory, "warmup_done.txt"))
    command = spec.command(config_path, resume)
    _write_status(spec, format=spec.format, seed=spec.seed, status="running",
                  config_fingerprint=spec.config_fingerprint, command=command,
                  overrides=spec.overrides, resumed=resume, warmup_reused=warmup_cached,
                  warmup_directory=spec.warmup_directory,
                  started=time.strftime("%Y-%m-%dT%H:%M:%S"))
    _say(f"[{spec.format} seed {spec.seed}] {'resuming' if resume else 'starting'} in "
         f"{spec.directory}" + ("" if spec.warmup_directory is None else
                                f" (warm-up {'cached' if warmup_cached else 'to train'})"))
    started = time.perf_counter()
    with open(os.path.join(spec.directory, "train.log"), "a") as log:
        result = subprocess.run(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env=env, check=False)   # a failure is recorded, others go on
    seconds = time.perf_counter() - started
    status = "done" if result.returncode == 0 else "failed"
    _write_status(spec, status=status, return_code=result.returncode,
                  wall_seconds=round(seconds, 1), finished=time.strftime("%Y-%m-%dT%H:%M:%S"))
    _say(f"[{spec.format} seed {spec.seed}] {status} in {seconds:.0f} s"
         + ("" if status == "done" else
            f" (exit {result.returncode}; see {spec.directory}/train.log)"))
    return read_status(spec.directory)


def run_ablation(config_path: str = DEFAULT_CONFIG, formats: Sequence[str] = FORMATS,
                 seeds: Sequence[int] = (0, 1, 2), overrides: Sequence[str] = (),
                 out_dir: str = DEFAULT_OUT, jobs: int = 1) -> dict:
    """Runs every (format, seed) not yet done into `out_dir`; returns
    {'planned', 'skipped', 'done', 'failed'} (lists of run directories) and 'seconds'."""
    config_path = os.path.abspath(config_path)
    check_formats(config_path, formats, overrides)   # before anything starts
    out_dir = os.path.abspath(out_dir)
    specs = plan_runs(config_path, formats, seeds, overrides, out_dir)
    states = {spec.directory: run_state(spec) for spec in specs}
    pending = [spec for spec in specs if states[spec.directory] != "done"]
    skipped = [spec.directory for spec in specs if states[spec.directory] == "done"]
    for directory in skipped:
        _say(f"skipping finished run {directory}")
    env = dict(os.environ)
    if jobs > 1:
        # Processes share one GPU: each gets a fixed share of its memory (growing pools of 9
        # SmolLM2 runs on one H100 ran out, in CUDA graph instantiation), 15% left to the driver.
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.85 / jobs:.3f}")
    # Phase 1: one run per warm-up cache that is not built yet; phase 2: all the others.
    first, seen = [], set()
    for spec in pending:
        directory = spec.warmup_directory
        if directory and directory not in seen and not os.path.isfile(
                os.path.join(directory, "warmup_done.txt")):
            first.append(spec)
        seen.add(directory)
    rest = [spec for spec in pending if spec not in first]
    started = time.perf_counter()
    results = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for phase in (first, rest):
            results += list(pool.map(
                lambda spec: execute_run(spec, config_path, states[spec.directory], env),
                phase))
    by_status = {"done": [], "failed": []}
    for spec, status in zip(first + rest, results):
        by_status["done" if status["status"] == "done" else "failed"].append(spec.directory)
    return {"planned": [spec.directory for spec in specs], "skipped": skipped, **by_status,
            "seconds": round(time.perf_counter() - started, 1)}


def _parse_args(argv: Sequence[str] | None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="config file (configs/*.py)")
    parser.add_argument("--formats", default=",".join(FORMATS),
                        help=f"comma-separated study formats, each {GRAMMAR} (e.g. "
                             f"nvfp4+aqn+gspo; default {','.join(FORMATS)})")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="FIELD=VALUE",
                        help="config override for every run (repeatable), e.g. "
                             "train.total_steps=4")
    parser.add_argument("--out", default=DEFAULT_OUT, help="results directory")
    parser.add_argument("--jobs", type=int, default=1, help="training processes at once")
    parser.add_argument("--summarize-only", action="store_true",
                        help="only read the runs already under --out (and --runs)")
    parser.add_argument("--runs", action="append", default=[],
                        help="extra directories of runs to include in the summary "
                             "(repeatable; e.g. GPU run directories)")
    parser.add_argument("--early-fraction", type=float, default=0.2,
                        help="early entropy = mean over the first ceil(f * total_steps) steps")
    parser.add_argument("--final-fraction", type=float, default=0.1,
                        help="final accuracy = mean over the last ceil(f * total_steps) steps")
    parser.add_argument("--growth-early-fraction", type=float, default=0.1,
                        help="reward growth = mean reward over the last ceil(late * "
                             "total_steps) steps minus over the first ceil(early * total_steps)")
    parser.add_argument("--growth-late-fraction", type=float, default=0.2,
                        help="see --growth-early-fraction")
    parser.add_argument("--first-steps", type=int, default=0,
                        help="summarize every run's first N steps only (runs cut short, "
                             "compared over a common prefix; 0 = all)")
    parser.add_argument("--smooth", type=int, default=1,
                        help="moving-average window (steps) of the plotted curves")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    formats = [name.strip() for name in args.formats.split(",") if name.strip()]
    seeds = [int(seed) for seed in args.seeds.split(",") if seed.strip()]
    return_code = 0
    if not args.summarize_only:
        try:
            check_formats(args.config, formats, args.overrides)
        except ConfigError as error:   # a plug-in of config.imports that does not import
            print(error, file=sys.stderr)
            return 2
        except ValueError as error:
            print(f"--formats: {error}", file=sys.stderr)
            return 2
        report = run_ablation(args.config, formats, seeds, args.overrides, args.out, args.jobs)
        print(f"{len(report['done'])} run(s) trained, {len(report['skipped'])} skipped, "
              f"{len(report['failed'])} failed in {report['seconds']:.0f} s")
        if report["failed"]:
            print("failed:\n  " + "\n  ".join(report["failed"]), file=sys.stderr)
            return_code = 1
    if return_code and not ablation_analysis.find_run_directories(args.out):
        return return_code   # nothing finished to summarize
    summary = ablation_analysis.analyze([args.out, *args.runs], args.out, args.early_fraction,
                                        args.final_fraction, args.smooth,
                                        args.growth_early_fraction, args.growth_late_fraction,
                                        args.first_steps)
    print(summary["markdown"])
    print("wrote " + ", ".join([summary["files"]["markdown"], summary["files"]["json"],
                                *summary["files"]["plots"]]))
    return return_code


if __name__ == "__main__":
    sys.exit(main())
