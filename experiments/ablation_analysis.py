"""Analysis of a format ablation: loads run directories, aggregates mean +- std over seeds,
checks the paper's claims as observed, writes the summary table and the curves.

A run directory is any directory holding the trainer's `metrics.jsonl` and `run.json`
(`qerl_jax.trainer.Trainer.train` writes both); its format is read from the recorded config
(quant.format, aqn.enabled) and its seed from run.json, so GPU runs made by other scripts load
the same way as the ones `experiments/format_ablation.py` makes.

Per run (T = config.train.total_steps, steps are 0-based):
  early entropy   mean of `entropy` over steps < max(1, ceil(early_fraction * T))
  reward AUC      trapezoid area under `reward` against `step` over all logged steps
                  (reward x steps; the same T for every format makes them comparable)
  final accuracy  mean of the rollout `accuracy` over the last max(1, ceil(final_fraction * T))
                  steps (one step's 128 samples are noisy)
Over seeds: mean and sample std (ddof=1; NaN with one seed).

Claims (QeRL facts section 6, paper Fig. 5), reported as observed whatever the outcome:
  1. each quantized format (nf4, mxfp4, nvfp4, nvfp4+aqn) starts with a higher entropy than bf16
  2. NVFP4+AQN's reward AUC >= NVFP4's
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable, Sequence

import numpy as np

from qerl_jax.run_record import read_starts

FORMATS = ("bf16", "nf4", "mxfp4", "nvfp4", "nvfp4+aqn")
QUANTIZED_FORMATS = ("nf4", "mxfp4", "nvfp4", "nvfp4+aqn")
FORMAT_COLORS = {"bf16": "#444444", "nf4": "#1f77b4", "mxfp4": "#2ca02c", "nvfp4": "#ff7f0e",
                 "nvfp4+aqn": "#d62728"}
METRICS_FILE = "metrics.jsonl"
RUN_FILE = "run.json"


def format_overrides(name: str) -> dict[str, object]:
    """Config fields that select ablation format `name` ('nvfp4+aqn' = NVFP4 with AQN)."""
    if name not in FORMATS:
        raise ValueError(f"format {name!r} not in {FORMATS}")
    quant_format, _, extra = name.partition("+")
    return {"quant.format": quant_format, "aqn.enabled": extra == "aqn"}


def format_of_config(config: dict) -> str:
    """The ablation format name of a recorded config dict (run.json's 'config')."""
    name = config["quant"]["format"]
    return f"{name}+aqn" if config.get("aqn", {}).get("enabled") else name


def format_directory_name(name: str) -> str:
    """File-system name of a format: 'nvfp4+aqn' -> 'nvfp4_aqn'."""
    return name.replace("+", "_")


# ------------------------------------------------------------------------------ loading
@dataclasses.dataclass
class Run:
    """One finished or partial training run."""
    path: str
    format: str
    seed: int
    total_steps: int
    rows: list[dict]          # metrics.jsonl, sorted by step

    @property
    def steps(self) -> np.ndarray:
        return np.array([row["step"] for row in self.rows], np.int64)

    def values(self, key: str) -> np.ndarray:
        return np.array([row.get(key, math.nan) for row in self.rows], np.float64)

    @property
    def complete(self) -> bool:
        return len(self.rows) == self.total_steps and (
            self.total_steps == 0 or int(self.rows[-1]["step"]) == self.total_steps - 1)


def read_jsonl(path: str) -> list[dict]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def load_run(path: str) -> Run:
    """Reads one run directory (metrics.jsonl + run.json)."""
    meta = read_starts(path)[-1]   # run.json keeps every start; the last one's config rules
    rows = sorted(read_jsonl(os.path.join(path, METRICS_FILE)), key=lambda row: row["step"])
    # metrics.jsonl is strict JSON: a non-finite value (e.g. accuracy without a correctness
    # reward) is null there
    rows = [{key: math.nan if value is None else value for key, value in row.items()}
            for row in rows]
    steps = [row["step"] for row in rows]
    if len(set(steps)) != len(steps):
        raise ValueError(f"{path}/{METRICS_FILE} repeats steps; the run was restarted without "
                         "resuming (delete the directory and run it again)")
    return Run(path=path, format=format_of_config(meta["config"]), seed=int(meta["seed"]),
               total_steps=int(meta["config"]["train"]["total_steps"]), rows=rows)


def find_run_directories(root: str) -> list[str]:
    """Directories under `root` (itself included) holding both metrics.jsonl and run.json;
    symlinked folders (the shared warm-up) are not followed."""
    found = []
    for directory, subdirectories, files in os.walk(root):
        if METRICS_FILE in files and RUN_FILE in files:
            found.append(directory)
        subdirectories[:] = sorted(name for name in subdirectories
                                   if name not in ("checkpoints", "warmup", "tensorboard"))
    return sorted(found)


def load_runs(roots: str | Sequence[str]) -> list[Run]:
    """All runs under one or several root directories, sorted by (format, seed)."""
    roots = [roots] if isinstance(roots, str) else list(roots)
    runs = []
    for root in roots:
        if not os.path.isdir(root):
            raise FileNotFoundError(f"no run directory {root!r}")
        runs.extend(load_run(path) for path in find_run_directories(root))
    order = {name: i for i, name in enumerate(FORMATS)}
    runs.sort(key=lambda run: (order.get(run.format, len(order)), run.format, run.seed))
    seen = {}
    for run in runs:
        if (run.format, run.seed) in seen:
            raise ValueError(f"two runs of format {run.format} seed {run.seed}: "
                             f"{seen[run.format, run.seed]} and {run.path}")
        seen[run.format, run.seed] = run.path
    return runs


# ------------------------------------------------------------------------------ per-run numbers
def step_count(fraction: float, total_steps: int) -> int:
    """max(1, ceil(fraction * total_steps))."""
    return max(1, math.ceil(fraction * total_steps))


def trapezoid_area(x: np.ndarray, y: np.ndarray) -> float:
    """Trapezoid-rule area under y(x); 0 for fewer than two points."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.size < 2:
        return 0.0
    return float(np.sum((x[1:] - x[:-1]) * (y[1:] + y[:-1]) / 2.0))


def early_entropy(run: Run, early_fraction: float) -> float:
    limit = step_count(early_fraction, run.total_steps)
    return float(np.mean(run.values("entropy")[run.steps < limit]))


def reward_auc(run: Run) -> float:
    return trapezoid_area(run.steps, run.values("reward"))


def final_accuracy(run: Run, final_fraction: float) -> float:
    count = step_count(final_fraction, run.total_steps)
    return float(np.mean(run.values("accuracy")[run.steps >= run.total_steps - count]))


# ------------------------------------------------------------------------------ over seeds
@dataclasses.dataclass
class Aggregate:
    mean: float
    std: float                # sample std (ddof=1); NaN for one value
    n: int
    values: list[float]
    seeds: list[int] = dataclasses.field(default_factory=list)   # seeds[i] gave values[i]

    def text(self, digits: int = 3) -> str:
        if self.n == 0:
            return "-"
        spread = "n/a" if math.isnan(self.std) else f"{self.std:.{digits}f}"
        return f"{self.mean:.{digits}f} ± {spread}"


def aggregate(values: Iterable[float], seeds: Iterable[int] = ()) -> Aggregate:
    values = [float(value) for value in values]
    n = len(values)
    return Aggregate(mean=float(np.mean(values)) if n else math.nan,
                     std=float(np.std(values, ddof=1)) if n > 1 else math.nan, n=n,
                     values=values, seeds=[int(seed) for seed in seeds])


def _paired(a: Aggregate, b: Aggregate) -> dict:
    """Per-seed differences a - b over the seeds both have (the formats of one seed share its
    warm-up model, problems and rollout keys, so the pairing removes the seed-to-seed spread):
    their mean, sample std, and how many seeds have a > b."""
    a_by_seed, b_by_seed = dict(zip(a.seeds, a.values)), dict(zip(b.seeds, b.values))
    common = sorted(set(a_by_seed) & set(b_by_seed))
    if not common:
        return {}
    differences = np.array([a_by_seed[seed] - b_by_seed[seed] for seed in common])
    return {"paired_seeds": common, "paired_differences": differences.tolist(),
            "paired_mean": float(differences.mean()),
            "paired_std": float(differences.std(ddof=1)) if len(common) > 1 else math.nan,
            "seeds_a_greater": int((differences > 0).sum())}


def _difference(a: Aggregate, b: Aggregate) -> dict:
    """a.mean - b.mean and its standard error (unequal variances); SE NaN with one seed."""
    difference = a.mean - b.mean
    if a.n > 1 and b.n > 1:
        error = math.sqrt(a.std ** 2 / a.n + b.std ** 2 / b.n)
    else:
        error = math.nan
    return {"difference": difference, "standard_error": error,
            "beyond_two_standard_errors": bool(error > 0 and abs(difference) > 2 * error)
            if not math.isnan(error) else None, **_paired(a, b)}


def check_claims(table: dict[str, dict[str, Aggregate]]) -> list[dict]:
    """The paper's claims on the aggregated table, each reported as observed."""
    checks = []
    bf16 = table.get("bf16")
    for name in QUANTIZED_FORMATS:
        claim = f"{name} starts with a higher entropy than bf16 (mean early entropy)"
        if bf16 is None or name not in table:
            checks.append({"claim": claim, "holds": None,
                           "observed": f"no complete {'bf16' if bf16 is None else name} runs"})
            continue
        quantized, base = table[name]["early_entropy"], bf16["early_entropy"]
        stats = _difference(quantized, base)
        holds = bool(quantized.mean > base.mean)
        checks.append({"claim": claim, "holds": holds, **stats,
                       "observed": f"{name} {quantized.text(4)} vs bf16 {base.text(4)}"})
    claim = "nvfp4+aqn's reward AUC >= nvfp4's"
    if "nvfp4+aqn" in table and "nvfp4" in table:
        aqn, plain = table["nvfp4+aqn"]["reward_auc"], table["nvfp4"]["reward_auc"]
        checks.append({"claim": claim, "holds": bool(aqn.mean >= plain.mean),
                       **_difference(aqn, plain),
                       "observed": f"nvfp4+aqn {aqn.text(3)} vs nvfp4 {plain.text(3)}"})
    else:
        checks.append({"claim": claim, "holds": None,
                       "observed": "needs complete nvfp4 and nvfp4+aqn runs"})
    return checks


def summarize_runs(runs: Sequence[Run], early_fraction: float = 0.2,
                   final_fraction: float = 0.1) -> dict:
    """Table (format -> metric -> Aggregate over complete runs' seeds) plus the checks.

    Incomplete runs are listed but left out of the numbers.
    """
    complete = [run for run in runs if run.complete]
    table: dict[str, dict[str, Aggregate]] = {}
    for name in dict.fromkeys(run.format for run in complete):
        group = [run for run in complete if run.format == name]
        seeds = [run.seed for run in group]
        table[name] = {
            "early_entropy": aggregate((early_entropy(run, early_fraction) for run in group),
                                       seeds),
            "reward_auc": aggregate((reward_auc(run) for run in group), seeds),
            "final_accuracy": aggregate((final_accuracy(run, final_fraction) for run in group),
                                        seeds),
        }
    total_steps = sorted({run.total_steps for run in complete})
    return {"table": table, "checks": check_claims(table),
            "seeds": {name: [run.seed for run in complete if run.format == name]
                      for name in table},
            "total_steps": total_steps, "early_fraction": early_fraction,
            "final_fraction": final_fraction,
            "incomplete": [{"path": run.path, "format": run.format, "seed": run.seed,
                            "steps_logged": len(run.rows), "total_steps": run.total_steps}
                           for run in runs if not run.complete]}


def _json_ready(summary: dict) -> dict:
    def convert(value):
        if isinstance(value, Aggregate):
            return {key: convert(item) for key, item in dataclasses.asdict(value).items()}
        if isinstance(value, dict):
            return {key: convert(item) for key, item in value.items()}
        if isinstance(value, list):
            return [convert(item) for item in value]
        if isinstance(value, float) and math.isnan(value):
            return None
        return value
    return convert(summary)


def summary_markdown(summary: dict) -> str:
    """The table and the checks as markdown."""
    lines = []
    steps = summary["total_steps"]
    if steps:
        early = ", ".join(str(step_count(summary["early_fraction"], t)) for t in steps)
        final = ", ".join(str(step_count(summary["final_fraction"], t)) for t in steps)
        lines.append(f"Runs of {', '.join(map(str, steps))} steps; early entropy over the first "
                     f"{early} step(s), final accuracy over the last {final} step(s); "
                     "mean ± sample std over seeds.")
        lines.append("")
    lines.append("| format | seeds | early entropy | reward AUC | final accuracy |")
    lines.append("|---|---|---|---|---|")
    for name, row in summary["table"].items():
        seeds = ",".join(map(str, summary["seeds"][name]))
        lines.append(f"| {name} | {seeds} | {row['early_entropy'].text(4)} | "
                     f"{row['reward_auc'].text(3)} | {row['final_accuracy'].text(3)} |")
    lines.append("")
    lines.append("Paper claims, as observed:")
    lines.append("")
    for check in summary["checks"]:
        verdict = {True: "holds", False: "does NOT hold", None: "not evaluated"}[check["holds"]]
        detail = check["observed"]
        if check.get("standard_error") is not None and not math.isnan(check["standard_error"]):
            detail += (f"; difference {check['difference']:+.4g}, "
                       f"standard error {check['standard_error']:.2g}")
        elif check["holds"] is not None:
            detail += f"; difference {check['difference']:+.4g} (one seed: no error estimate)"
        if check.get("paired_seeds"):
            spread = ("" if math.isnan(check["paired_std"])
                      else f" ± {check['paired_std']:.2g}")
            detail += (f"; paired by seed: {check['paired_mean']:+.4g}{spread}, higher in "
                       f"{check['seeds_a_greater']} of {len(check['paired_seeds'])} seeds")
        lines.append(f"- {check['claim']}: **{verdict}** ({detail})")
    if summary["incomplete"]:
        lines.append("")
        lines.append("Incomplete runs (left out): " + ", ".join(
            f"{item['format']} seed {item['seed']} ({item['steps_logged']}/"
            f"{item['total_steps']} steps)" for item in summary["incomplete"]))
    return "\n".join(lines) + "\n"


def write_summary(summary: dict, out_dir: str) -> dict[str, str]:
    """summary.md and summary.json in `out_dir`; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"markdown": os.path.join(out_dir, "summary.md"),
             "json": os.path.join(out_dir, "summary.json")}
    with open(paths["markdown"], "w") as handle:
        handle.write(summary_markdown(summary))
    with open(paths["json"], "w") as handle:
        json.dump(_json_ready(summary), handle, indent=1, sort_keys=True)
    return paths


# ------------------------------------------------------------------------------ curves
def seed_band(runs: Sequence[Run], key: str, smooth: int = 1):
    """(steps, mean, std) over the runs' common steps; std NaN-free (0) with one run.

    smooth > 1 applies a trailing moving average of that many steps to each run first.
    """
    common = sorted(set.intersection(*(set(run.steps.tolist()) for run in runs)))
    curves = []
    for run in runs:
        by_step = dict(zip(run.steps.tolist(), run.values(key)))
        curve = np.array([by_step[step] for step in common], np.float64)
        if smooth > 1:
            curve = np.array([curve[max(0, i - smooth + 1):i + 1].mean()
                              for i in range(curve.size)])
        curves.append(curve)
    stacked = np.stack(curves)
    std = stacked.std(axis=0, ddof=1) if len(curves) > 1 else np.zeros(stacked.shape[1])
    return np.array(common), stacked.mean(axis=0), std


def plot_format_curves(runs: Sequence[Run], out_dir: str, smooth: int = 1,
                       keys: Sequence[str] = ("entropy", "reward")) -> list[str]:
    """One figure per metric: a line per format (mean over seeds) with a +-1 std band.

    Writes {key}_vs_step.png and .svg into `out_dir`; returns the paths.
    """
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    os.makedirs(out_dir, exist_ok=True)
    formats = list(dict.fromkeys(run.format for run in runs))
    paths = []
    for key in keys:
        figure = Figure(figsize=(6.4, 4.0))
        axis = figure.add_subplot()
        for name in formats:
            group = [run for run in runs if run.format == name]
            steps, mean, std = seed_band(group, key, smooth)
            color = FORMAT_COLORS.get(name)
            axis.plot(steps, mean, color=color, label=f"{name} (n={len(group)})")
            if len(group) > 1:
                axis.fill_between(steps, mean - std, mean + std, color=color, alpha=0.2,
                                  linewidth=0)
        axis.set_xlabel("step")
        axis.set_ylabel(key)
        title = f"{key} vs step (mean ± std over seeds"
        axis.set_title(title + (f", {smooth}-step moving average)" if smooth > 1 else ")"))
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
        figure.tight_layout()
        for extension in ("png", "svg"):
            path = os.path.join(out_dir, f"{key}_vs_step.{extension}")
            figure.savefig(path, dpi=120)
            paths.append(path)
    return paths


def analyze(roots: str | Sequence[str], out_dir: str, early_fraction: float = 0.2,
            final_fraction: float = 0.1, smooth: int = 1) -> dict:
    """Loads the runs under `roots`, writes summary.{md,json} and the plots into `out_dir`.

    Returns the summary dict with 'files' (paths written) and 'markdown' added.
    """
    runs = load_runs(roots)
    if not runs:
        raise FileNotFoundError(f"no run directories (metrics.jsonl + run.json) under {roots}")
    summary = summarize_runs(runs, early_fraction, final_fraction)
    files = write_summary(summary, out_dir)
    complete = [run for run in runs if run.complete] or runs
    files["plots"] = plot_format_curves(complete, out_dir, smooth)
    summary["files"] = files
    summary["markdown"] = summary_markdown(summary)
    return summary
