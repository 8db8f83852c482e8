"""experiments/format_ablation.py and experiments/ablation_analysis.py: the summary numbers on
synthetic metrics files against plain numpy, the claims' paired t-intervals against numpy and
scipy, the final evaluation row, the plots, the claims of objective / correction / estimator
parts, skipping finished runs and one very short real ablation (2 formats, 1 seed, 2 GRPO
steps, held-out eval on)."""

import json
import math
import os

import numpy as np
import pytest
from scipy import stats

from experiments import ablation_analysis as analysis
from experiments import ablation_plots
from experiments import format_ablation
from experiments import study_variants as variants
from qerl_jax.infra.run_record import read_starts

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.py")


def _write_run(directory, name, seed, total_steps, entropy, reward, accuracy, columns=None,
               final_row=None, loss=None):
    """A run directory as the trainer writes it (only the fields the analysis reads).

    columns: {step: {key: value}} joined to the training rows (e.g. eval/pass@1, rollout/kl);
    final_row: the eval-only row written after the last step (at step total_steps);
    loss: the recorded loss section (default: the rollout_is_cap of the committed studies).
    """
    os.makedirs(directory, exist_ok=True)
    fmt, *extras = name.split("+")
    if loss is None:
        loss = {"rollout_is_cap": 2.0 if "tis" in extras else 0.0}
    config = {"quant": {"format": fmt}, "aqn": {"enabled": "aqn" in extras}, "loss": loss,
              "train": {"total_steps": total_steps}, "seed": seed}
    with open(os.path.join(directory, "run.json"), "w") as handle:
        json.dump({"seed": seed, "config": config, "git_revision": "x", "versions": {}}, handle)
    rows = [{"step": step, "entropy": entropy[step], "reward": reward[step],
             "accuracy": accuracy[step], **(columns or {}).get(step, {})}
            for step in range(len(entropy))]
    if final_row is not None:
        rows.append({"step": total_steps, **final_row})
    with open(os.path.join(directory, "metrics.jsonl"), "w") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)


def _synthetic(root, rng, total_steps=17, seeds=(0, 1, 2), formats=analysis.FORMATS,
               entropy_offset=None):
    data = {}
    for name in formats:
        for seed in seeds:
            entropy = rng.uniform(0.5, 2.0, total_steps) + (entropy_offset or {}).get(name, 0.0)
            reward = rng.uniform(0.0, 2.2, total_steps)
            accuracy = rng.uniform(0.0, 1.0, total_steps)
            _write_run(os.path.join(root, variants.format_directory_name(name), f"seed{seed}"),
                       name, seed, total_steps, entropy, reward, accuracy)
            data[name, seed] = (entropy, reward, accuracy)
    return data


def test_trapezoid_area_matches_numpy():
    rng = np.random.default_rng()
    x = np.sort(rng.uniform(0, 50, 23))
    y = rng.normal(size=23)
    np.testing.assert_allclose(analysis.trapezoid_area(x, y), np.trapezoid(y, x), rtol=1e-12)
    assert analysis.trapezoid_area([3], [1.0]) == 0.0


def test_summary_matches_numpy(tmp_path):
    rng = np.random.default_rng()
    total, seeds = 17, (0, 1, 2)
    data = _synthetic(str(tmp_path), rng, total, seeds)
    summary = analysis.summarize_runs(analysis.load_runs(str(tmp_path)), early_fraction=0.2,
                                      final_fraction=0.1)
    early, final = math.ceil(0.2 * total), math.ceil(0.1 * total)   # 4 and 2 steps
    steps = np.arange(total)
    for name in analysis.FORMATS:
        per_seed = {
            "early_entropy": [data[name, s][0][:early].mean() for s in seeds],
            "reward_auc": [np.trapezoid(data[name, s][1], steps) for s in seeds],
            "final_accuracy": [data[name, s][2][-final:].mean() for s in seeds],
        }
        for metric, values in per_seed.items():
            got = summary["table"][name][metric]
            assert got.n == 3
            np.testing.assert_allclose(got.mean, np.mean(values), rtol=1e-12)
            np.testing.assert_allclose(got.std, np.std(values, ddof=1), rtol=1e-10)
    assert summary["seeds"]["nvfp4+aqn"] == [0, 1, 2]
    assert not summary["incomplete"]


def test_checks_report_what_is_observed(tmp_path):
    rng = np.random.default_rng()
    # Quantized formats get +5 entropy except mxfp4, which gets -5: its claim must fail.
    offsets = {"nf4": 5.0, "mxfp4": -5.0, "nvfp4": 5.0, "nvfp4+aqn": 5.0}
    _synthetic(str(tmp_path), rng, entropy_offset=offsets)
    summary = analysis.summarize_runs(analysis.load_runs(str(tmp_path)))
    checks = {check["claim"].split(" ")[0]: check for check in summary["checks"]}
    assert checks["nf4"]["holds"] is True and checks["nvfp4"]["holds"] is True
    assert checks["mxfp4"]["holds"] is False
    assert checks["mxfp4"]["beyond_two_standard_errors"] is True
    table = summary["table"]
    auc = checks["nvfp4+aqn's"]
    assert auc["holds"] == (table["nvfp4+aqn"]["reward_auc"].mean
                            >= table["nvfp4"]["reward_auc"].mean)
    np.testing.assert_allclose(auc["difference"], table["nvfp4+aqn"]["reward_auc"].mean
                               - table["nvfp4"]["reward_auc"].mean, atol=1e-12)
    text = analysis.summary_markdown(summary)
    assert "does NOT hold" in text and "| mxfp4 | 0,1,2 |" in text


def test_paired_differences_by_seed(tmp_path):
    """Formats of one seed share its warm-up and problems: the checks also report the per-seed
    differences (numpy), which the unpaired standard error cannot see."""
    rng = np.random.default_rng()
    data = _synthetic(str(tmp_path), rng, seeds=(0, 1, 3))
    summary = analysis.summarize_runs(analysis.load_runs(str(tmp_path)))
    early = math.ceil(0.2 * 17)
    checks = {check["claim"].split(" ")[0]: check for check in summary["checks"]}
    differences = [data["nf4", s][0][:early].mean() - data["bf16", s][0][:early].mean()
                   for s in (0, 1, 3)]
    nf4 = checks["nf4"]
    assert nf4["paired_seeds"] == [0, 1, 3]
    np.testing.assert_allclose(nf4["paired_differences"], differences, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(nf4["paired_mean"], np.mean(differences), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(nf4["paired_std"], np.std(differences, ddof=1), rtol=1e-10)
    assert nf4["seeds_a_greater"] == sum(d > 0 for d in differences)
    auc = checks["nvfp4+aqn's"]
    auc_differences = [np.trapezoid(data["nvfp4+aqn", s][1]) - np.trapezoid(data["nvfp4", s][1])
                       for s in (0, 1, 3)]
    np.testing.assert_allclose(auc["paired_differences"], auc_differences, rtol=1e-10,
                               atol=1e-10)   # differences of two float64 sums of ~17
    assert "paired by seed" in analysis.summary_markdown(summary)


def _t_interval(differences):
    """Hand computation: mean +- t_{0.975, n-1} * sample std / sqrt(n)."""
    differences = np.asarray(differences, np.float64)
    n = differences.size
    half = stats.t.ppf(0.975, n - 1) * differences.std(ddof=1) / np.sqrt(n)
    return differences.mean(), differences.mean() - half, differences.mean() + half


def test_paired_interval_matches_hand_computation():
    rng = np.random.default_rng()
    seeds = [0, 1, 2, 3, 5]
    a = analysis.aggregate(rng.normal(1.0, 0.5, 5), seeds)
    b = analysis.aggregate(rng.normal(0.0, 0.5, 4), [5, 3, 1, 0])   # no seed 2; other order
    by_seed = dict(zip(b.seeds, b.values))
    differences = [value - by_seed[seed] for seed, value in zip(a.seeds, a.values)
                   if seed in by_seed]
    result = analysis.paired_interval(a, b)
    mean, low, high = _t_interval(differences)
    assert result["seeds"] == [0, 1, 3, 5] and result["n"] == 4
    np.testing.assert_allclose(result["differences"], differences, rtol=1e-12)
    np.testing.assert_allclose([result["mean_difference"], result["ci_low"], result["ci_high"]],
                               [mean, low, high], rtol=1e-12)
    np.testing.assert_allclose(result["std"], np.std(differences, ddof=1), rtol=1e-12)


def test_claims_against_hand_computation(tmp_path):
    """summary['claims']: initial (step 0) and early entropy (quantized - bf16) and reward growth (last 20% minus
    first 10% of the steps; nvfp4 - nf4), paired by seed, from the raw synthetic rows."""
    rng = np.random.default_rng()
    total, seeds = 23, (0, 1, 2, 4)
    data = _synthetic(str(tmp_path), rng, total, seeds, formats=analysis.KNOWN_FORMATS)
    summary = analysis.summarize_runs(analysis.load_runs(str(tmp_path)))
    early, first, last = math.ceil(0.2 * total), math.ceil(0.1 * total), math.ceil(0.2 * total)

    def growth(name, seed):
        reward = data[name, seed][1]
        return reward[-last:].mean() - reward[:first].mean()

    claims = {(claim["a"], claim["b"], claim["metric"]): claim for claim in summary["claims"]}
    for name in analysis.QUANTIZED_FORMATS:
        claim = claims[name, "bf16", "early_entropy"]
        differences = [data[name, s][0][:early].mean() - data["bf16", s][0][:early].mean()
                       for s in seeds]
        np.testing.assert_allclose([claim["mean_difference"], claim["ci_low"],
                                    claim["ci_high"]], _t_interval(differences), rtol=1e-12)
        assert claim["n"] == 4 and claim["seeds"] == list(seeds)
        claim = claims[name, "bf16", "initial_entropy"]   # step 0 alone
        differences = [data[name, s][0][0] - data["bf16", s][0][0] for s in seeds]
        np.testing.assert_allclose([claim["mean_difference"], claim["ci_low"],
                                    claim["ci_high"]], _t_interval(differences), rtol=1e-12)
    for a, b in (("nvfp4", "nf4"), ("mxfp4", "nf4"), ("nvfp4+aqn", "nvfp4"),
                 ("nvfp4+aqn+tis", "nvfp4+aqn")):
        claim = claims[a, b, "reward_growth"]
        differences = [growth(a, s) - growth(b, s) for s in seeds]
        np.testing.assert_allclose([claim["mean_difference"], claim["ci_low"],
                                    claim["ci_high"]], _t_interval(differences), rtol=1e-12)
    for a, b in (("nvfp4+aqn", "nvfp4"), ("nvfp4+aqn+tis", "nvfp4+aqn")):
        claim = claims[a, b, "pass_at_1_after"]   # no eval logged
        assert claim["n"] == 0 and claim["verdict"] == "not resolved"
        assert "final pass@1" in claim["note"]
    saved = analysis._json_ready(summary)
    assert saved["claims"][0]["ci_low"] == summary["claims"][0]["ci_low"]
    text = analysis.summary_markdown(summary)
    assert "95% CI" in text and "nvfp4+aqn+tis - nvfp4+aqn: reward growth" in text


def test_claim_verdicts():
    """holds: interval above 0; contradicted: below; not resolved: spans 0, or n < 2."""
    seeds = [0, 1, 2]

    def table(differences):
        return {"bf16": {"early_entropy": analysis.aggregate([0.0, 0.0, 0.0], seeds)},
                "nf4": {"early_entropy": analysis.aggregate(differences, seeds)}}

    def verdict(differences):
        claims = analysis.claim_intervals(table(differences))
        return next(claim for claim in claims
                    if claim["a"] == "nf4" and claim["metric"] == "early_entropy")

    assert verdict([1.0, 1.1, 0.9])["verdict"] == "holds"
    assert verdict([-1.0, -1.1, -0.9])["verdict"] == "contradicted"
    spans = verdict([1.0, -1.0, 0.5])
    assert spans["verdict"] == "not resolved" and spans["ci_low"] < 0 < spans["ci_high"]
    assert spans["note"] == ""
    one = next(claim for claim in analysis.claim_intervals({
        "bf16": {"early_entropy": analysis.aggregate([0.0], [0])},
        "nf4": {"early_entropy": analysis.aggregate([5.0], [0])}})
        if claim["metric"] == "early_entropy")
    assert one["verdict"] == "not resolved" and one["n"] == 1 and math.isnan(one["ci_low"])
    assert "one paired seed" in one["note"]
    missing = next(claim for claim in analysis.claim_intervals(table([1.0, 1.0, 1.0]))
                   if claim["a"] == "mxfp4")
    assert missing["verdict"] == "not resolved" and missing["note"] == "no complete mxfp4 runs"


def test_entropy_shift_verdicts(tmp_path):
    """+5 early entropy for nf4, -5 for mxfp4 (uniform(0.5, 2) noise cannot flip either)."""
    rng = np.random.default_rng()
    _synthetic(str(tmp_path), rng, entropy_offset={"nf4": 5.0, "mxfp4": -5.0})
    claims = {claim["a"]: claim for claim in analysis.summarize_runs(
        analysis.load_runs(str(tmp_path)))["claims"] if claim["metric"] == "early_entropy"}
    assert claims["nf4"]["verdict"] == "holds"
    assert claims["mxfp4"]["verdict"] == "contradicted"
    assert claims["nvfp4+aqn+tis"]["n"] == 0


def test_final_eval_row(tmp_path):
    """With eval on, metrics.jsonl ends with an eval-only row at step T: the run is complete,
    the training numbers ignore that row, pass@1 before = step 0's, after = the last row's,
    rollout KL is the mean over the training steps, and the pass@1 curve is drawn."""
    rng = np.random.default_rng()
    total, seeds = 12, (0, 1, 2)
    passes, kls, data = {}, {}, {}
    for name in ("nvfp4", "nvfp4+aqn"):
        for seed in seeds:
            series = [rng.uniform(size=total) for _ in range(3)]
            evaluated = {step: rng.uniform() for step in (0, 4, 8, 12)}
            kl = rng.uniform(0, 1e-3, total)
            columns = {step: {"rollout/kl": kl[step]} for step in range(total)}
            for step in (0, 4, 8):
                columns[step].update({"eval/pass@1": evaluated[step], "eval/mean_length": 9.0,
                                      "eval/num_examples": 16})
            final = {"eval/pass@1": evaluated[12], "eval/mean_length": 9.0,
                     "eval/num_examples": 16, "time/eval_s": 0.1}
            _write_run(str(tmp_path / variants.format_directory_name(name) / f"seed{seed}"),
                       name, seed, total, *series, columns=columns, final_row=final)
            passes[name, seed], kls[name, seed], data[name, seed] = evaluated, kl, series
    runs = analysis.load_runs(str(tmp_path))
    assert all(run.complete for run in runs) and len(runs[0].rows) == total + 1
    np.testing.assert_array_equal(runs[0].steps, np.arange(total))
    summary = analysis.summarize_runs(runs)
    assert not summary["incomplete"]
    for name in ("nvfp4", "nvfp4+aqn"):
        row = summary["table"][name]
        np.testing.assert_allclose(row["pass_at_1_before"].values,
                                   [passes[name, s][0] for s in seeds], rtol=1e-12)
        np.testing.assert_allclose(row["pass_at_1_after"].values,
                                   [passes[name, s][12] for s in seeds], rtol=1e-12)
        np.testing.assert_allclose(row["rollout_kl"].values,
                                   [kls[name, s].mean() for s in seeds], rtol=1e-12)
        np.testing.assert_allclose(row["reward_auc"].values,
                                   [np.trapezoid(data[name, s][1]) for s in seeds], rtol=1e-12)
        np.testing.assert_allclose(row["final_accuracy"].values,
                                   [data[name, s][2][-2:].mean() for s in seeds], rtol=1e-12)
    claim = next(claim for claim in summary["claims"]
                 if claim["a"] == "nvfp4+aqn" and claim["metric"] == "pass_at_1_after")
    np.testing.assert_allclose(
        [claim["mean_difference"], claim["ci_low"], claim["ci_high"]],
        _t_interval([passes["nvfp4+aqn", s][12] - passes["nvfp4", s][12] for s in seeds]),
        rtol=1e-12)
    text = analysis.summary_markdown(summary)
    assert "| pass@1 before | final pass@1 | rollout KL |" in text
    paths = ablation_plots.plot_format_curves(runs, str(tmp_path / "out"))
    assert os.path.join(str(tmp_path / "out"), "eval_pass_at_1_vs_step.png") in paths
    steps, mean, _ = ablation_plots.seed_band([run for run in runs if run.format == "nvfp4"],
                                              "eval/pass@1")
    np.testing.assert_array_equal(steps, [0, 4, 8, 12])
    np.testing.assert_allclose(mean, [np.mean([passes["nvfp4", s][k] for s in seeds])
                                      for k in (0, 4, 8, 12)], rtol=1e-12)


def test_complete_only_with_every_training_step(tmp_path):
    """A run missing a training step, or holding a row past step T, is incomplete."""
    rng = np.random.default_rng()
    series = [rng.uniform(size=6) for _ in range(3)]
    _write_run(str(tmp_path / "a"), "nvfp4", 0, 6, *series,
               final_row={"eval/pass@1": 0.5})
    _write_run(str(tmp_path / "b"), "nvfp4", 1, 7, *series,
               final_row={"eval/pass@1": 0.5})      # 6 training rows + a row at step 7
    with open(tmp_path / "a" / "metrics.jsonl", "a") as handle:
        handle.write(json.dumps({"step": 9, "eval/pass@1": 0.1}) + "\n")
    runs = analysis.load_runs(str(tmp_path))
    assert [run.complete for run in runs] == [False, False]
    summary = analysis.summarize_runs(runs)
    assert [item["steps_logged"] for item in summary["incomplete"]] == [6, 6]


def test_first_steps_compares_runs_cut_short_over_their_common_prefix(tmp_path):
    """Runs of 10 steps cut at 7 and 9 (and one complete) read as 6-step runs: all complete,
    the numbers those of steps 0-5 alone, the final pass@1 the last evaluation before step 6;
    a run shorter than the prefix stays incomplete."""
    rng = np.random.default_rng()
    series = {}
    for seed, logged in ((0, 7), (1, 9), (2, 10)):
        series[seed] = [rng.uniform(size=logged) for _ in range(3)]
        columns = {step: {"eval/pass@1": float(step) / 10} for step in (0, 4, 8) if step < logged}
        _write_run(str(tmp_path / "nvfp4" / f"seed{seed}"), "nvfp4", seed, 10, *series[seed],
                   columns=columns)
    _write_run(str(tmp_path / "nvfp4" / "seed3"), "nvfp4", 3, 10,
               *(rng.uniform(size=5) for _ in range(3)))
    runs = [run.first_steps(6) for run in analysis.load_runs(str(tmp_path))]
    assert [run.complete for run in runs] == [True, True, True, False]
    summary = analysis.summarize_runs(runs)
    row = summary["table"]["nvfp4"]
    np.testing.assert_allclose(row["reward_auc"].values,
                               [np.trapezoid(series[s][1][:6]) for s in (0, 1, 2)], rtol=1e-12)
    np.testing.assert_allclose(row["pass_at_1_after"].values, [0.4] * 3, rtol=1e-12)
    assert summary["incomplete"][0]["seed"] == 3
    out = tmp_path / "out"
    text = analysis.analyze(str(tmp_path), str(out), first_steps=6)["markdown"]
    assert text.startswith("Runs of 6 steps")


def test_missing_formats_and_incomplete_runs(tmp_path):
    rng = np.random.default_rng()
    _synthetic(str(tmp_path), rng, total_steps=10, seeds=(0,), formats=("bf16", "nvfp4"))
    # A partial nvfp4+aqn run: 4 of 10 steps logged.
    _write_run(str(tmp_path / "nvfp4_aqn" / "seed0"), "nvfp4+aqn", 0, 10,
               *(rng.uniform(size=4) for _ in range(3)))
    summary = analysis.summarize_runs(analysis.load_runs(str(tmp_path)))
    assert set(summary["table"]) == {"bf16", "nvfp4"}
    assert math.isnan(summary["table"]["bf16"]["early_entropy"].std)   # one seed
    assert summary["incomplete"][0]["format"] == "nvfp4+aqn"
    verdicts = {check["claim"].split(" ")[0]: check["holds"] for check in summary["checks"]}
    assert verdicts["nf4"] is None and verdicts["nvfp4+aqn's"] is None
    assert verdicts["nvfp4"] in (True, False)


def test_analyze_writes_summary_and_plots(tmp_path):
    rng = np.random.default_rng()
    _synthetic(str(tmp_path / "runs"), rng, total_steps=8, seeds=(0, 1))
    summary = analysis.analyze(str(tmp_path / "runs"), str(tmp_path / "out"), smooth=3)
    names = sorted(os.path.basename(path) for path in summary["files"]["plots"])
    assert names == ["accuracy_vs_step.png", "accuracy_vs_step.svg", "entropy_vs_step.png",
                     "entropy_vs_step.svg", "reward_vs_step.png", "reward_vs_step.svg"]
    for path in summary["files"]["plots"] + [summary["files"]["json"]]:
        assert os.path.getsize(path) > 1000
    with open(summary["files"]["json"]) as handle:
        saved = json.load(handle)
    assert saved["table"]["nf4"]["reward_auc"]["n"] == 2


def test_seed_band_smoothing():
    rng = np.random.default_rng()
    values = rng.normal(size=(2, 9))
    runs = [analysis.Run(path="", format="nvfp4", seed=seed, total_steps=9,
                         rows=[{"step": step, "reward": values[seed, step]} for step in range(9)])
            for seed in range(2)]
    steps, mean, std = ablation_plots.seed_band(runs, "reward", smooth=3)
    smoothed = np.stack([[row[max(0, i - 2):i + 1].mean() for i in range(9)] for row in values])
    np.testing.assert_allclose(mean, smoothed.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(std, smoothed.std(axis=0, ddof=1), rtol=1e-12)
    np.testing.assert_array_equal(steps, np.arange(9))


def test_claims_generated_for_variant_parts(tmp_path):
    """Each objective / correction / estimator part of a format present is tested against the
    same format without it (reward growth, final pass@1), from the raw rows; a pair already in
    CLAIMS (tis) is listed once; a missing base says so."""
    rng = np.random.default_rng()
    total, seeds = 10, (0, 1, 2)
    losses = {"nvfp4+aqn": {}, "nvfp4+aqn+gspo": {"policy_objective": "gspo"},
              "nvfp4+aqn+cispo": {"policy_objective": "cispo"},
              "nvfp4+aqn+tis": {"rollout_correction": "token_truncate",
                                "rollout_correction_cap": 2.0},
              "nvfp4+aqn+gspo+rloo": {"policy_objective": "gspo",
                                      "advantage_estimator": "rloo"}}
    growth, after = {}, {}
    for name, loss in losses.items():
        for seed in seeds:
            series = [rng.uniform(size=total) for _ in range(3)]
            final = {"eval/pass@1": rng.uniform()}
            _write_run(str(tmp_path / variants.format_directory_name(name) / f"seed{seed}"),
                       name, seed, total, *series, final_row=final, loss=loss)
            growth[name, seed] = series[1][-2:].mean() - series[1][:1].mean()
            after[name, seed] = final["eval/pass@1"]
    summary = analysis.summarize_runs(analysis.load_runs(str(tmp_path)))
    assert set(summary["table"]) == set(losses)
    claims = [(claim["group"], claim["a"], claim["b"], claim["metric"])
              for claim in summary["claims"]]
    static = [claim for claim in claims if claim in analysis.CLAIMS]
    assert static == [claim for claim in analysis.CLAIMS
                      if claim[1] in losses or claim[2] in losses]   # another study's: left out
    assert ("reward growth", "nvfp4", "nf4", "reward_growth") not in static
    generated = claims[len(static):]
    assert sorted(generated) == sorted(
        (group, a, b, metric) for group, a, b in (
            ("GSPO", "nvfp4+aqn+gspo", "nvfp4+aqn"), ("CISPO", "nvfp4+aqn+cispo", "nvfp4+aqn"),
            ("GSPO", "nvfp4+aqn+gspo+rloo", "nvfp4+aqn+rloo"),
            ("RLOO", "nvfp4+aqn+gspo+rloo", "nvfp4+aqn+gspo"))
        for metric in ("reward_growth", "pass_at_1_after"))
    assert claims.count(("TIS", "nvfp4+aqn+tis", "nvfp4+aqn", "reward_growth")) == 1
    by_key = {(claim["a"], claim["b"], claim["metric"]): claim for claim in summary["claims"]}
    for a, b in (("nvfp4+aqn+gspo", "nvfp4+aqn"), ("nvfp4+aqn+cispo", "nvfp4+aqn"),
                 ("nvfp4+aqn+gspo+rloo", "nvfp4+aqn+gspo")):
        for metric, values in (("reward_growth", growth), ("pass_at_1_after", after)):
            claim = by_key[a, b, metric]
            np.testing.assert_allclose(
                [claim["mean_difference"], claim["ci_low"], claim["ci_high"]],
                _t_interval([values[a, s] - values[b, s] for s in seeds]), rtol=1e-12)
    missing = by_key["nvfp4+aqn+gspo+rloo", "nvfp4+aqn+rloo", "reward_growth"]
    assert missing["n"] == 0 and missing["note"] == "no complete nvfp4+aqn+rloo runs"
    text = analysis.summary_markdown(summary)
    assert "| GSPO | nvfp4+aqn+gspo - nvfp4+aqn: reward growth | 3 |" in text
    assert "| CISPO | nvfp4+aqn+cispo - nvfp4+aqn: final pass@1 | 3 |" in text
    checks = [check["claim"].split(" ")[0] for check in summary["checks"]]
    assert checks == ["nvfp4+aqn", "nvfp4+aqn+tis", "nvfp4+aqn's"]   # no bf16, nf4, ... runs


def test_finished_runs_are_skipped(tmp_path, monkeypatch):
    """A run marked done with the same config is not started again; another config stops."""
    out = str(tmp_path)
    specs = format_ablation.plan_runs(os.path.abspath(CONFIG), ["bf16", "nvfp4"], [0],
                                      ["train.total_steps=3"], out)
    assert specs[0].config_json["quant"]["format"] == "bf16"
    assert specs[1].config_json["aqn"]["enabled"] is False
    assert specs[0].config_json["train"]["total_steps"] == 3
    assert specs[0].warmup_directory == specs[1].warmup_directory   # one warm-up per seed
    os.makedirs(specs[0].directory)
    with open(os.path.join(specs[0].directory, format_ablation.STATUS_FILE), "w") as handle:
        json.dump({"status": "done", "config_fingerprint": specs[0].config_fingerprint}, handle)
    started = []

    def fake_execute(spec, config_path, state, env=None):
        started.append((spec.format, state))
        return {"status": "done"}

    monkeypatch.setattr(format_ablation, "execute_run", fake_execute)
    report = format_ablation.run_ablation(CONFIG, ["bf16", "nvfp4"], [0],
                                          ["train.total_steps=3"], out)
    assert started == [("nvfp4", "new")]
    assert report["skipped"] == [specs[0].directory]
    with pytest.raises(RuntimeError, match="another config"):
        format_ablation.run_ablation(CONFIG, ["bf16"], [0], ["train.total_steps=4"], out)
    with pytest.raises(ValueError, match="micro_batch_size"):   # validated before any run
        format_ablation.run_ablation(CONFIG, ["bf16"], [0], ["train.micro_batch_size=7"], out)


@pytest.mark.slow
def test_short_real_ablation(tmp_path):
    """Two formats (bf16+gspo, nvfp4+aqn+tis), one seed, 2 GRPO steps of a shrunken tiny model
    with held-out eval every step: run dirs, shared warm-up, the final eval-only row, summary
    and plots; the second invocation trains nothing."""
    out = str(tmp_path / "ablation")
    overrides = ["train.total_steps=2", "warmup.steps=5", "model.overrides.num_hidden_layers=2",
                 "train.prompts_per_step=4", "rollout.num_generations=4",
                 "train.micro_batch_size=16",
                 "rollout.max_new_tokens=8", "eval.every_steps=1", "eval.num_examples=4",
                 "eval.batch_size=4"]
    formats = ["bf16+gspo", "nvfp4+aqn+tis"]
    argv = ["--config", CONFIG, "--formats", ",".join(formats), "--seeds", "0", "--out", out]
    for override in overrides:
        argv += ["--set", override]
    assert format_ablation.main(argv) == 0
    for name, directory in (("bf16+gspo", "bf16_gspo"), ("nvfp4+aqn+tis", "nvfp4_aqn_tis")):
        run_dir = os.path.join(out, directory, "seed0")
        meta = read_starts(run_dir)[-1]
        assert meta["seed"] == 0 and meta["git_revision"] and "jax" in meta["versions"]
        assert variants.format_of_config(meta["config"]) == name
        assert meta["config"]["model"]["overrides"]["num_hidden_layers"] == 2
        assert meta["config"]["loss"]["rollout_correction"] == (
            "token_truncate" if name.endswith("tis") else "none")
        assert meta["config"]["loss"]["policy_objective"] == (
            "gspo" if name.endswith("gspo") else "clipped_surrogate")
        rows = analysis.read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
        assert [row["step"] for row in rows] == [0, 1, 2]   # 2: the final policy's eval row
        assert all(np.isfinite(row["entropy"]) for row in rows[:2])
        assert "entropy" not in rows[2]
        assert all(0 <= row["eval/pass@1"] <= 1 for row in rows)
        assert os.path.islink(os.path.join(run_dir, "warmup"))
    bf16_status = format_ablation.read_status(os.path.join(out, "bf16_gspo", "seed0"))
    aqn_status = format_ablation.read_status(os.path.join(out, "nvfp4_aqn_tis", "seed0"))
    assert bf16_status["status"] == aqn_status["status"] == "done"
    assert not bf16_status["warmup_reused"] and aqn_status["warmup_reused"]
    assert (os.path.realpath(os.path.join(out, "bf16_gspo", "seed0", "warmup"))
            == os.path.realpath(os.path.join(out, "nvfp4_aqn_tis", "seed0", "warmup")))
    for name in ("summary.md", "summary.json", "entropy_vs_step.png", "reward_vs_step.svg",
                 "accuracy_vs_step.png", "eval_pass_at_1_vs_step.png"):
        assert os.path.isfile(os.path.join(out, name))
    with open(os.path.join(out, "summary.json")) as handle:
        saved = json.load(handle)
    assert not saved["incomplete"]
    assert saved["table"]["nvfp4+aqn+tis"]["pass_at_1_after"]["n"] == 1
    assert saved["table"]["nvfp4+aqn+tis"]["rollout_kl"]["n"] == 1
    assert any(claim["a"] == "bf16+gspo" and claim["b"] == "bf16" for claim in saved["claims"])
    report = format_ablation.run_ablation(CONFIG, formats, [0], overrides, out)
    assert len(report["skipped"]) == 2 and not report["done"] and not report["failed"]
