"""experiments/format_ablation.py and experiments/ablation_analysis.py: the summary numbers on
synthetic metrics files against plain numpy, the claims, the plots, skipping finished runs and
one very short real ablation (2 formats, 1 seed, 2 GRPO steps)."""

import json
import math
import os

import numpy as np

from qerl_jax.run_record import read_starts
import pytest

from experiments import ablation_analysis as analysis
from experiments import format_ablation

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.py")


def _write_run(directory, name, seed, total_steps, entropy, reward, accuracy):
    """A run directory as the trainer writes it (only the fields the analysis reads)."""
    os.makedirs(directory, exist_ok=True)
    fmt, _, extra = name.partition("+")
    config = {"quant": {"format": fmt}, "aqn": {"enabled": extra == "aqn"},
              "train": {"total_steps": total_steps}, "seed": seed}
    with open(os.path.join(directory, "run.json"), "w") as handle:
        json.dump({"seed": seed, "config": config, "git_revision": "x", "versions": {}}, handle)
    with open(os.path.join(directory, "metrics.jsonl"), "w") as handle:
        handle.writelines(json.dumps({"step": step, "entropy": entropy[step],
                                     "reward": reward[step], "accuracy": accuracy[step]}) + "\n" for step in range(len(entropy)))


def _synthetic(root, rng, total_steps=17, seeds=(0, 1, 2), formats=analysis.FORMATS,
               entropy_offset=None):
    data = {}
    for name in formats:
        for seed in seeds:
            entropy = rng.uniform(0.5, 2.0, total_steps) + (entropy_offset or {}).get(name, 0.0)
            reward = rng.uniform(0.0, 2.2, total_steps)
            accuracy = rng.uniform(0.0, 1.0, total_steps)
            _write_run(os.path.join(root, analysis.format_directory_name(name), f"seed{seed}"),
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
    assert names == ["entropy_vs_step.png", "entropy_vs_step.svg", "reward_vs_step.png",
                     "reward_vs_step.svg"]
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
    steps, mean, std = analysis.seed_band(runs, "reward", smooth=3)
    smoothed = np.stack([[row[max(0, i - 2):i + 1].mean() for i in range(9)] for row in values])
    np.testing.assert_allclose(mean, smoothed.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(std, smoothed.std(axis=0, ddof=1), rtol=1e-12)
    np.testing.assert_array_equal(steps, np.arange(9))


def test_format_overrides():
    assert analysis.format_overrides("nvfp4+aqn") == {"quant.format": "nvfp4",
                                                      "aqn.enabled": True}
    assert analysis.format_overrides("bf16") == {"quant.format": "bf16", "aqn.enabled": False}
    with pytest.raises(ValueError, match="fp8"):
        analysis.format_overrides("fp8")


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


def test_short_real_ablation(tmp_path):
    """Two formats, one seed, 2 GRPO steps of a shrunken tiny model: run dirs, shared warm-up,
    summary and plots; the second invocation trains nothing."""
    out = str(tmp_path / "ablation")
    overrides = ["train.total_steps=2", "warmup.steps=5", "model.overrides.num_hidden_layers=2",
                 "train.prompts_per_step=4", "rollout.num_generations=4",
                 "train.micro_batch_size=16",
                 "rollout.max_new_tokens=8"]
    argv = ["--config", CONFIG, "--formats", "bf16,nvfp4+aqn", "--seeds", "0", "--out", out]
    for override in overrides:
        argv += ["--set", override]
    assert format_ablation.main(argv) == 0
    for name, directory in (("bf16", "bf16"), ("nvfp4+aqn", "nvfp4_aqn")):
        run_dir = os.path.join(out, directory, "seed0")
        meta = read_starts(run_dir)[-1]
        assert meta["seed"] == 0 and meta["git_revision"] and "jax" in meta["versions"]
        assert analysis.format_of_config(meta["config"]) == name
        assert meta["config"]["model"]["overrides"]["num_hidden_layers"] == 2
        rows = analysis.read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
        assert [row["step"] for row in rows] == [0, 1]
        assert all(np.isfinite(row["entropy"]) for row in rows)
        assert os.path.islink(os.path.join(run_dir, "warmup"))
    bf16_status = format_ablation.read_status(os.path.join(out, "bf16", "seed0"))
    aqn_status = format_ablation.read_status(os.path.join(out, "nvfp4_aqn", "seed0"))
    assert bf16_status["status"] == aqn_status["status"] == "done"
    assert not bf16_status["warmup_reused"] and aqn_status["warmup_reused"]
    assert (os.path.realpath(os.path.join(out, "bf16", "seed0", "warmup"))
            == os.path.realpath(os.path.join(out, "nvfp4_aqn", "seed0", "warmup")))
    for name in ("summary.md", "summary.json", "entropy_vs_step.png", "reward_vs_step.svg"):
        assert os.path.isfile(os.path.join(out, name))
    report = format_ablation.run_ablation(CONFIG, ["bf16", "nvfp4+aqn"], [0], overrides, out)
    assert len(report["skipped"]) == 2 and not report["done"] and not report["failed"]
