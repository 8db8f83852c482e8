"""Analysis of a format ablation: loads run directories, aggregates mean +- std over seeds,
tests the paper's claims with per-seed paired differences and 95% t-intervals, writes the
summary table and the curves.

A run directory is any directory holding the trainer's `metrics.jsonl` and `run.json`
(`qerl_jax.trainer.Trainer.train` writes both); its format is read from the recorded config
(study_variants.format_of_config: quant.format, aqn.enabled, the policy objective, rollout
correction and advantage estimator) and its seed from run.json, so GPU runs made by other
scripts load the same way as the ones `experiments/format_ablation.py` makes. A run is
complete when metrics.jsonl holds steps 0..T-1, optionally followed by the final held-out
evaluation's row at step T (eval columns only; qerl_jax/trainer.py).

Per run (T = config.train.total_steps, steps are 0-based; "first k" / "last k" steps below use
k = max(1, ceil(fraction * T))):
  initial entropy   `entropy` at step 0: the base model's sampling entropy before any update
  early entropy     mean of `entropy` over the first k steps (early_fraction, 0.2)
  reward AUC        trapezoid area under `reward` against `step` over all training steps
                    (reward x steps; the same T for every format makes them comparable)
  reward growth     mean `reward` over the last k steps (growth_late_fraction, 0.2) minus the
                    mean over the first k steps (growth_early_fraction, 0.1)
  final accuracy    mean of the rollout `accuracy` over the last k steps (final_fraction, 0.1;
                    one step's samples are noisy)
  pass@1 before     `eval/pass@1` (greedy, held-out) at step 0: the base model
  pass@1 after      `eval/pass@1` of the last row holding it (step T in a complete run)
  rollout KL        mean of `rollout/kl` over the training steps
The last three only where the runs logged them (config.eval.every_steps; the trainer's
rollout/trainer mismatch metrics).
Over seeds: mean and sample std (ddof=1; NaN with one seed).

Claims (arXiv 2510.11696 Fig. 5; TIS as in TRL / verl), tested on per-seed paired differences A - B
(the formats of one seed share its data order, problems and warm-up, so pairing by seed removes
the seed-to-seed spread): mean difference d and the t-interval d +- t_{0.975, n-1} s / sqrt(n)
over the n seeds both formats have (s: sample std of the differences). Verdict 'holds' when the
interval lies above 0, 'contradicted' when below, 'not resolved' when it spans 0 (or n < 2).
  a. initial entropy and early entropy: each quantized format minus bf16 > 0
  b. reward growth: nvfp4 minus nf4 > 0, mxfp4 minus nf4 > 0
  c. AQN: nvfp4+aqn minus nvfp4 > 0 on reward growth and on the final held-out pass@1
  d. TIS: nvfp4+aqn+tis minus nvfp4+aqn > 0 on reward growth and on the final held-out pass@1
  e. each objective / correction / estimator part of a format present (e.g. nvfp4+aqn+gspo)
     minus the same format without it (nvfp4+aqn) > 0 on the same two (variant_claims)
The point comparisons of the means (`checks`: the quantized formats' early entropy against
bf16, nvfp4+aqn's reward AUC against nvfp4's) are kept as observed, without an interval.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from experiments.ablation_plots import FORMAT_COLORS, PASS_AT_1, plot_format_curves
from experiments.study_variants import AQN, format_of_config
from qerl_jax.infra.run_record import read_starts

# The study's formats in table order; FORMATS (the first five) is the script's default set.
FORMATS = ("bf16", "nf4", "mxfp4", "nvfp4", "nvfp4+aqn")
KNOWN_FORMATS = FORMATS + ("nvfp4+aqn+tis",)
QUANTIZED_FORMATS = ("nf4", "mxfp4", "nvfp4", "nvfp4+aqn", "nvfp4+aqn+tis")
CONFIDENCE = 0.95
METRICS_FILE = "metrics.jsonl"
RUN_FILE = "run.json"
ROLLOUT_KL = "rollout/kl"


# ------------------------------------------------------------------------------ loading
@dataclasses.dataclass
class Run:
    """One finished or partial training run."""
    path: str
    format: str
    seed: int
    total_steps: int
    rows: list[dict]          # metrics.jsonl, sorted by step (the final eval row included)

    def first_steps(self, steps: int) -> "Run":
        """The run as if it had been `steps` steps long: its rows of steps 0..steps-1 (its
        last held-out evaluation before `steps` becomes the final pass@1)."""
        return dataclasses.replace(self, total_steps=steps,
                                   rows=[row for row in self.rows if row["step"] < steps])

    @property
    def training_rows(self) -> list[dict]:
        """The rows of training steps 0..T-1 (not the final evaluation's row at step T)."""
        return [row for row in self.rows if row["step"] < self.total_steps]

    @property
    def steps(self) -> np.ndarray:
        """Training steps [n]."""
        return np.array([row["step"] for row in self.training_rows], np.int64)

    def values(self, key: str) -> np.ndarray:
        """`key` at each training step [n] (NaN where a row lacks it)."""
        return np.array([row.get(key, math.nan) for row in self.training_rows], np.float64)

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of every row holding `key` (the final eval row included; a null
        value is NaN)."""
        rows = [row for row in self.rows if key in row]
        return (np.array([row["step"] for row in rows], np.int64),
                np.array([row[key] for row in rows], np.float64))

    def has(self, key: str) -> bool:
        return any(key in row for row in self.rows)

    @property
    def complete(self) -> bool:
        """Steps 0..T-1 logged, and nothing after them but the final eval row (step T)."""
        training = self.training_rows
        extra = [row["step"] for row in self.rows if row["step"] >= self.total_steps]
        return (len(training) == self.total_steps
                and (self.total_steps == 0 or int(training[-1]["step"]) == self.total_steps - 1)
                and extra in ([], [self.total_steps]))


def read_jsonl(path: str) -> list[dict]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def load_run(path: str) -> Run:
    """Reads one run directory (metrics.jsonl + run.json); a torn last line (a run being
    written) is left out."""
    from qerl_jax.infra.metrics import read_metrics

    meta = read_starts(path)[-1]   # run.json keeps every start; the last one's config rules
    rows = sorted(read_metrics(path), key=lambda row: row["step"])
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
    order = {name: i for i, name in enumerate(KNOWN_FORMATS)}
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


def _first_steps_mean(run: Run, key: str, fraction: float) -> float:
    return float(np.mean(run.values(key)[run.steps < step_count(fraction, run.total_steps)]))


def _last_steps_mean(run: Run, key: str, fraction: float) -> float:
    count = step_count(fraction, run.total_steps)
    return float(np.mean(run.values(key)[run.steps >= run.total_steps - count]))


def initial_entropy(run: Run) -> float:
    return float(run.values("entropy")[0])


def early_entropy(run: Run, early_fraction: float) -> float:
    return _first_steps_mean(run, "entropy", early_fraction)


def reward_auc(run: Run) -> float:
    return trapezoid_area(run.steps, run.values("reward"))


def reward_growth(run: Run, early_fraction: float = 0.1, late_fraction: float = 0.2) -> float:
    """Mean reward over the last ceil(late_fraction T) steps minus over the first
    ceil(early_fraction T)."""
    return (_last_steps_mean(run, "reward", late_fraction)
            - _first_steps_mean(run, "reward", early_fraction))


def final_accuracy(run: Run, final_fraction: float) -> float:
    return _last_steps_mean(run, "accuracy", final_fraction)


def pass_at_1_before(run: Run) -> float:
    """Held-out pass@1 at step 0 (the base model); NaN when not evaluated there."""
    steps, values = run.series(PASS_AT_1)
    return float(values[0]) if steps.size and steps[0] == 0 else math.nan


def pass_at_1_after(run: Run) -> float:
    """Held-out pass@1 of the last evaluation (step T in a complete run); NaN without one."""
    values = run.series(PASS_AT_1)[1]
    return float(values[-1]) if values.size else math.nan


def rollout_kl(run: Run) -> float:
    """Mean of rollout/kl over the training steps that logged it; NaN without any."""
    values = run.values(ROLLOUT_KL)
    values = values[np.isfinite(values)]
    return float(values.mean()) if values.size else math.nan


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


def paired_interval(a: Aggregate, b: Aggregate, confidence: float = CONFIDENCE) -> dict:
    """Per-seed differences a - b over the seeds where both are finite, with the t-interval of
    their mean: d +- t_{(1 + confidence) / 2, n - 1} * s / sqrt(n) (s: sample std).

    Returns {'seeds', 'differences', 'n', 'mean_difference', 'std', 'ci_low', 'ci_high',
    'verdict'}; verdict 'holds' (interval above 0), 'contradicted' (below 0) or 'not resolved'
    (spans 0, or n < 2: no interval, NaN bounds).
    """
    from scipy import stats

    a_by_seed = {s: v for s, v in zip(a.seeds, a.values) if math.isfinite(v)}
    b_by_seed = {s: v for s, v in zip(b.seeds, b.values) if math.isfinite(v)}
    seeds = sorted(set(a_by_seed) & set(b_by_seed))
    differences = np.array([a_by_seed[seed] - b_by_seed[seed] for seed in seeds], np.float64)
    n = len(seeds)
    mean = float(differences.mean()) if n else math.nan
    std = float(differences.std(ddof=1)) if n > 1 else math.nan
    low = high = math.nan
    if n > 1:
        half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * std / math.sqrt(n)
        low, high = mean - half, mean + half
    verdict = ("holds" if low > 0 else "contradicted" if high < 0 else "not resolved")
    return {"seeds": seeds, "differences": differences.tolist(), "n": n,
            "mean_difference": mean, "std": std, "ci_low": low, "ci_high": high,
            "verdict": verdict}


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


# ------------------------------------------------------------------------------ the claims
METRIC_LABELS = {"initial_entropy": "initial entropy", "early_entropy": "early entropy",
                 "reward_auc": "reward AUC", "reward_growth": "reward growth",
                 "final_accuracy": "final accuracy",
                 "pass_at_1_before": "pass@1 before", "pass_at_1_after": "final pass@1",
                 "rollout_kl": "rollout KL"}
# Left out of a format's aggregate for the runs that did not log them (eval off, older runs).
OPTIONAL_METRICS = ("pass_at_1_before", "pass_at_1_after", "rollout_kl")
# (claim group, A, B, table metric): the claim is A - B > 0 (module docstring, a-d).
CLAIMS = (
    *(("initial entropy", name, "bf16", "initial_entropy") for name in QUANTIZED_FORMATS),
    *(("early entropy", name, "bf16", "early_entropy") for name in QUANTIZED_FORMATS),
    ("reward growth", "nvfp4", "nf4", "reward_growth"),
    ("reward growth", "mxfp4", "nf4", "reward_growth"),
    ("AQN", "nvfp4+aqn", "nvfp4", "reward_growth"),
    ("AQN", "nvfp4+aqn", "nvfp4", "pass_at_1_after"),
    ("TIS", "nvfp4+aqn+tis", "nvfp4+aqn", "reward_growth"),
    ("TIS", "nvfp4+aqn+tis", "nvfp4+aqn", "pass_at_1_after"),
)
# What each objective / correction / estimator part of a study's formats is tested on (e.)
VARIANT_CLAIM_METRICS = ("reward_growth", "pass_at_1_after")


def variant_claims(names: Iterable[str]) -> list[tuple[str, str, str, str]]:
    """(claim group, A, B, table metric) for each '+' part other than aqn of each format in
    `names` against the same format without that part (A - B > 0: the part helps), on
    VARIANT_CLAIM_METRICS; pairs CLAIMS already holds are left out."""
    listed = {(a, b, metric) for _, a, b, metric in CLAIMS}
    claims = []
    for name in names:
        weight_format, *parts = name.split("+")
        for part in parts:
            if part == AQN:
                continue
            base = "+".join([weight_format, *(other for other in parts if other != part)])
            claims += [(part.upper().replace("_", "-"), name, base, metric)
                       for metric in VARIANT_CLAIM_METRICS if (name, base, metric) not in listed]
    return claims


def claim_intervals(table: dict[str, dict[str, Aggregate]],
                    confidence: float = CONFIDENCE) -> list[dict]:
    """Each of CLAIMS, then each of `variant_claims` of the table's formats, tested on the
    per-seed paired differences (paired_interval), with a 'note' saying why a claim is not
    resolved when it has fewer than two paired seeds; a claim about two formats the table
    does not hold (another study's) is left out."""
    rows = []
    empty = aggregate([])
    for group, a, b, metric in (*CLAIMS, *variant_claims(table)):
        if a not in table and b not in table:
            continue
        values = {name: table.get(name, {}).get(metric, empty) for name in (a, b)}
        result = paired_interval(values[a], values[b], confidence)
        missing = [name for name in (a, b) if name not in table]
        unlogged = [name for name in (a, b) if name in table and not values[name].n]
        if missing:
            note = f"no complete {' or '.join(missing)} runs"
        elif unlogged:
            note = f"no {METRIC_LABELS[metric]} in the {' or '.join(unlogged)} runs"
        elif result["n"] == 0:
            note = f"no seed with {METRIC_LABELS[metric]} for both"
        elif result["n"] == 1:
            note = "one paired seed: no interval"
        else:
            note = ""
        rows.append({"group": group, "claim": f"{a} - {b}: {METRIC_LABELS[metric]} > 0",
                     "a": a, "b": b, "metric": metric, "confidence": confidence, **result,
                     "note": note})
    return rows


def check_claims(table: dict[str, dict[str, Aggregate]]) -> list[dict]:
    """Point comparisons of the means, each reported as observed (no interval)."""
    checks = []
    bf16 = table.get("bf16")
    for name in QUANTIZED_FORMATS:
        if name not in table and (name not in FORMATS or bf16 is None):
            continue   # a format not in this study
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
    present = [name for name in ("nvfp4+aqn", "nvfp4") if name in table]
    if len(present) == 2:
        aqn, plain = table["nvfp4+aqn"]["reward_auc"], table["nvfp4"]["reward_auc"]
        checks.append({"claim": claim, "holds": bool(aqn.mean >= plain.mean),
                       **_difference(aqn, plain),
                       "observed": f"nvfp4+aqn {aqn.text(3)} vs nvfp4 {plain.text(3)}"})
    elif present:   # left out when neither format is in this study
        checks.append({"claim": claim, "holds": None,
                       "observed": "needs complete nvfp4 and nvfp4+aqn runs"})
    return checks


def summarize_runs(runs: Sequence[Run], early_fraction: float = 0.2,
                   final_fraction: float = 0.1, growth_early_fraction: float = 0.1,
                   growth_late_fraction: float = 0.2, confidence: float = CONFIDENCE) -> dict:
    """Table (format -> metric -> Aggregate over complete runs' seeds), the claims' paired
    intervals and the point checks.

    Incomplete runs are listed but left out of the numbers.
    """
    per_run: dict[str, Callable[[Run], float]] = {
        "initial_entropy": initial_entropy,
        "early_entropy": lambda run: early_entropy(run, early_fraction),
        "reward_auc": reward_auc,
        "reward_growth": lambda run: reward_growth(run, growth_early_fraction,
                                                   growth_late_fraction),
        "final_accuracy": lambda run: final_accuracy(run, final_fraction),
        "pass_at_1_before": pass_at_1_before,
        "pass_at_1_after": pass_at_1_after,
        "rollout_kl": rollout_kl,
    }
    complete = [run for run in runs if run.complete]
    table: dict[str, dict[str, Aggregate]] = {}
    for name in dict.fromkeys(run.format for run in complete):
        group = [run for run in complete if run.format == name]
        table[name] = {}
        for metric, function in per_run.items():
            pairs = [(function(run), run.seed) for run in group]
            if metric in OPTIONAL_METRICS:
                pairs = [(value, seed) for value, seed in pairs if math.isfinite(value)]
            table[name][metric] = aggregate([value for value, _ in pairs],
                                            [seed for _, seed in pairs])
    total_steps = sorted({run.total_steps for run in complete})
    return {"table": table, "claims": claim_intervals(table, confidence),
            "checks": check_claims(table),
            "seeds": {name: [run.seed for run in complete if run.format == name]
                      for name in table},
            "total_steps": total_steps, "early_fraction": early_fraction,
            "final_fraction": final_fraction, "growth_early_fraction": growth_early_fraction,
            "growth_late_fraction": growth_late_fraction, "confidence": confidence,
            "incomplete": [{"path": run.path, "format": run.format, "seed": run.seed,
                            "steps_logged": len(run.training_rows),
                            "total_steps": run.total_steps}
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


def _claims_markdown(claims: Sequence[dict]) -> list[str]:
    if not claims:
        return []
    confidence = claims[0]["confidence"]
    lines = [(f"Paper claims, per-seed paired differences A - B with {confidence:.0%} "
              "t-intervals (holds: interval above 0; contradicted: below 0):"), "",
             f"| claim | A - B | n | mean difference | {confidence:.0%} CI | verdict |",
             "|---|---|---|---|---|---|"]
    for claim in claims:
        interval = ("-" if math.isnan(claim["ci_low"])
                    else f"[{claim['ci_low']:+.4g}, {claim['ci_high']:+.4g}]")
        mean = "-" if claim["n"] == 0 else f"{claim['mean_difference']:+.4g}"
        verdict = f"**{claim['verdict']}**" + (f" ({claim['note']})" if claim["note"] else "")
        lines.append(f"| {claim['group']} | {claim['a']} - {claim['b']}: "
                     f"{METRIC_LABELS[claim['metric']]} | {claim['n']} | {mean} | {interval} | "
                     f"{verdict} |")
    return lines + [""]


def summary_markdown(summary: dict) -> str:
    """The table, the claims and the point checks as markdown."""
    lines = []
    steps = summary["total_steps"]
    table = summary["table"]
    columns = [("initial_entropy", 4), ("early_entropy", 4), ("reward_auc", 3), ("reward_growth", 3),
               ("final_accuracy", 3)]
    columns += [(metric, 4 if metric == "rollout_kl" else 3) for metric in OPTIONAL_METRICS
                if any(metric in row and row[metric].n for row in table.values())]
    if steps:
        def counts(fraction):
            return ", ".join(str(step_count(fraction, t)) for t in steps)
        pass_at_1 = ("; pass@1: greedy on the held-out subset, at step 0 (before) and at the "
                     "last evaluation (after)"
                     if any(metric == "pass_at_1_after" for metric, _ in columns) else "")
        lines.append(
            f"Runs of {', '.join(map(str, steps))} steps; initial entropy at step 0; early "
            f"entropy over the first "
            f"{counts(summary['early_fraction'])} step(s); reward growth = mean reward over "
            f"the last {counts(summary['growth_late_fraction'])} step(s) minus over the first "
            f"{counts(summary['growth_early_fraction'])}; final accuracy over the last "
            f"{counts(summary['final_fraction'])} step(s){pass_at_1}; mean ± sample std over "
            "seeds.")
        lines.append("")
    lines.append("| format | seeds | " + " | ".join(METRIC_LABELS[metric]
                                                    for metric, _ in columns) + " |")
    lines.append("|---|---|" + "---|" * len(columns))
    for name, row in table.items():
        seeds = ",".join(map(str, summary["seeds"][name]))
        cells = [row[metric].text(digits) if metric in row else "-"
                 for metric, digits in columns]
        lines.append(f"| {name} | {seeds} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += _claims_markdown(summary.get("claims", []))
    lines.append("Point comparisons of the means, as observed (no interval):")
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


def analyze(roots: str | Sequence[str], out_dir: str, early_fraction: float = 0.2,
            final_fraction: float = 0.1, smooth: int = 1, growth_early_fraction: float = 0.1,
            growth_late_fraction: float = 0.2, first_steps: int = 0) -> dict:
    """Loads the runs under `roots`, writes summary.{md,json} and the plots into `out_dir`.

    first_steps > 0: every run is read as its first `first_steps` steps (runs cut short
    compared over a common prefix; a run shorter than that stays incomplete).
    Returns the summary dict with 'files' (paths written) and 'markdown' added.
    """
    runs = load_runs(roots)
    if not runs:
        raise FileNotFoundError(f"no run directories (metrics.jsonl + run.json) under {roots}")
    if first_steps > 0:
        runs = [run.first_steps(min(first_steps, run.total_steps)) for run in runs]
    summary = summarize_runs(runs, early_fraction, final_fraction, growth_early_fraction,
                             growth_late_fraction)
    files = write_summary(summary, out_dir)
    complete = [run for run in runs if run.complete] or runs
    files["plots"] = plot_format_curves(complete, out_dir, smooth)
    summary["files"] = files
    summary["markdown"] = summary_markdown(summary)
    return summary
