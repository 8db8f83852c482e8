"""Training-curves figure: written for 1 and 100 steps, with nulls, without AQN, with held-out
pass@1; the rolling mean against a plain numpy loop; the title and run.json helpers."""

import json
import math
import os

import matplotlib.image
import numpy as np
import pytest

from qerl_jax.aqn import AQNSchedule, aqn_sigma
from qerl_jax.plots import (centred_rolling_mean, current_config, plot_training_curves,
                            run_title, smoothing_window, training_curves_figure)

CONFIG = {"seed": 7, "quant": {"format": "nvfp4"}, "aqn": {"enabled": True},
          "model": {"preset": "qwen2p5_7b", "hf_path": ""}}


def synthetic_metrics(steps: int, aqn: bool = True, seed: int = 0) -> list[dict]:
    """Rows shaped like Trainer.train_step's: noisy rising reward, falling entropy, the
    released AQN schedule and a warm-up + linear-decay learning rate."""
    rng = np.random.default_rng(seed)
    schedule = AQNSchedule(total_steps=max(steps, 1))
    warmup = max(1, steps // 10)
    rows = []
    for step in range(steps):
        accuracy = float(np.clip(0.2 + 0.5 * (1 - math.exp(-step / 30))
                                 + rng.normal(0, 0.06), 0, 1))
        format_reward = float(np.clip(0.6 + 0.35 * (1 - math.exp(-step / 15))
                                      + rng.normal(0, 0.04), 0, 1))
        rows.append({
            "step": step, "reward": accuracy + format_reward, "reward/format": format_reward,
            "reward/gsm8k_exact": accuracy, "accuracy": accuracy,
            "entropy": 0.9 * math.exp(-step / 60) + 0.25 + float(rng.normal(0, 0.03)),
            "kl": 0.0, "loss": float(rng.normal()),
            "aqn_sigma": float(aqn_sigma(step, schedule)) if aqn else 0.0,
            "learning_rate": 1e-5 * min(1.0, step / warmup),
        })
    return rows


def _written_png(tmp_path, metrics, **kwargs) -> np.ndarray:
    path = tmp_path / "curves.png"
    plot_training_curves(metrics, str(path), title=kwargs.pop("title", "run"), **kwargs)
    assert os.listdir(tmp_path) == ["curves.png"]          # nothing else written
    image = matplotlib.image.imread(str(path))
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 400
    return image


def _axes_by_ylabel(figure) -> dict:
    return {axis.get_ylabel(): axis for axis in figure.axes}


def test_figure_for_100_steps(tmp_path):
    import matplotlib.pyplot as plt
    open_before = plt.get_fignums()
    metrics = synthetic_metrics(100)
    _written_png(tmp_path, metrics, title=run_title(CONFIG, "gsm8k_qerl"))
    assert plt.get_fignums() == open_before                 # no pyplot figure left open

    figure = training_curves_figure(metrics, title="run")
    axes = _axes_by_ylabel(figure)
    assert set(axes) == {"reward (mean per completion)", "accuracy (fraction correct)",
                         "entropy (nats / token)", "AQN sigma", "learning rate"}
    assert all(axis.get_xlabel() == "step" for axis in figure.axes
               if axis.get_ylabel() != "learning rate")     # the twin shares the x axis
    assert axes["AQN sigma"].get_yscale() == "log"          # 1e-2 .. 1e-4
    key = [text.get_text() for legend in figure.legends for text in legend.get_texts()]
    assert key == ["per step", f"mean of {smoothing_window(100)} steps, centred"]
    reward_legend = [text.get_text() for text in
                     axes["reward (mean per completion)"].get_legend().get_texts()]
    assert reward_legend == ["total", "format", "gsm8k_exact"]
    sigma_legend = [text.get_text() for text in axes["AQN sigma"].get_legend().get_texts()]
    assert sigma_legend == ["AQN sigma (0 at steps 0–9)", "learning rate"]


def test_figure_for_one_step(tmp_path):
    _written_png(tmp_path, synthetic_metrics(1))
    figure = training_curves_figure(synthetic_metrics(1), title="run")
    key = [text.get_text() for legend in figure.legends for text in legend.get_texts()]
    assert key == ["per step (too few steps to smooth)"]


def test_figure_with_nulls_and_missing_keys(tmp_path):
    metrics = synthetic_metrics(60)
    for row in metrics[::7]:
        row["entropy"] = None                                # non-finite values land as null
    metrics[3]["reward"] = float("nan")
    metrics[4]["learning_rate"] = None
    for row in metrics:
        row["accuracy"] = None                               # no finite value: panel omitted
        del row["aqn_sigma"]
    _written_png(tmp_path, metrics)
    figure = training_curves_figure(metrics, title="run")
    axes = _axes_by_ylabel(figure)
    assert set(axes) == {"reward (mean per completion)", "entropy (nats / token)",
                         "learning rate"}
    assert axes["learning rate"].get_title() == "no AQN sigma logged"
    entropy_line = axes["entropy (nats / token)"].get_lines()[0].get_ydata()
    assert np.isfinite(entropy_line).sum() > 40               # nulls skipped, not fatal


def test_figure_without_aqn(tmp_path):
    metrics = synthetic_metrics(100, aqn=False)
    _written_png(tmp_path, metrics)
    figure = training_curves_figure(metrics, title="run")
    axes = _axes_by_ylabel(figure)
    assert "AQN sigma" not in axes and len(figure.axes) == 4     # no twin axis
    assert axes["learning rate"].get_title() == "AQN sigma = 0 at every step"


def test_held_out_pass_at_1_panel_when_the_run_evaluated(tmp_path):
    """eval/pass@1 at every 10th step and in a final eval-only row: its own panel, the points
    as logged (no smoothing); five panels fill a 2 x 3 grid with no empty axis left."""
    metrics = synthetic_metrics(40)
    for row in metrics[::10]:
        row.update({"eval/pass@1": 0.1 + row["step"] / 100, "eval/num_examples": 128})
    metrics.append({"step": 40, "eval/pass@1": 0.55, "eval/num_examples": 128})
    _written_png(tmp_path, metrics)
    figure = training_curves_figure(metrics, title="run")
    axes = _axes_by_ylabel(figure)
    assert set(axes) == {"reward (mean per completion)", "accuracy (fraction correct)",
                         "held-out pass@1", "entropy (nats / token)", "AQN sigma",
                         "learning rate"}
    assert len(figure.axes) == 6                              # 5 panels + the twin axis
    [line] = axes["held-out pass@1"].get_lines()
    np.testing.assert_array_equal(line.get_xdata(), [0, 10, 20, 30, 40])
    np.testing.assert_allclose(line.get_ydata(), [0.1, 0.2, 0.3, 0.4, 0.55])
    assert axes["held-out pass@1"].get_title() == "greedy, 128 problems"
    assert "held-out pass@1" not in _axes_by_ylabel(
        training_curves_figure(synthetic_metrics(40), title="run"))


def test_sigma_within_a_decade_is_linear():
    metrics = synthetic_metrics(30)
    for row in metrics:
        row["aqn_sigma"] = 1e-3 + 1e-4 * (row["step"] % 3)
    figure = training_curves_figure(metrics, title="run")
    assert _axes_by_ylabel(figure)["AQN sigma"].get_yscale() == "linear"


def test_no_plottable_metric_and_bad_step():
    with pytest.raises(ValueError, match="no plottable metric"):
        training_curves_figure([{"step": 0, "loss": 1.0}], title="run")
    with pytest.raises(ValueError, match="metrics row 1: 'step'"):
        training_curves_figure([{"step": 0, "reward": 1.0}, {"reward": 1.0}], title="run")
    with pytest.raises(ValueError, match="odd"):
        training_curves_figure(synthetic_metrics(20), title="run", window=4)


def _rolling_mean_reference(values: np.ndarray, window: int) -> np.ndarray:
    """Plain loop: nanmean of the full centred window; NaN where it does not fit or is empty."""
    half = window // 2
    out = np.full(values.size, np.nan)
    for i in range(half, values.size - half):
        chunk = values[i - half:i + half + 1]
        if np.isfinite(chunk).any():
            out[i] = np.nanmean(chunk)
    return out


@pytest.mark.parametrize("size, window", [(1, 1), (5, 1), (4, 5), (100, 11), (257, 27)])
def test_rolling_mean_matches_numpy_loop(size, window):
    rng = np.random.default_rng(size * 1000 + window)
    values = rng.normal(1.0, 0.5, size)
    values[rng.random(size) < 0.15] = np.nan
    if size > 30:
        values[10:10 + window] = np.nan                      # a whole window of nulls
    np.testing.assert_allclose(centred_rolling_mean(values, window),
                               _rolling_mean_reference(values, window),
                               rtol=1e-12, atol=1e-12, equal_nan=True)


def test_smoothing_window_is_odd_tenth():
    assert [smoothing_window(n) for n in (1, 9, 10, 30, 100, 400)] == [1, 1, 3, 3, 11, 41]
    assert all(smoothing_window(n) % 2 == 1 for n in range(1, 2000))


def test_run_title_names_run_format_and_seed():
    title = run_title(CONFIG, "gsm8k_qerl")
    assert title == "gsm8k_qerl · qwen2p5_7b · nvfp4+AQN · seed 7"
    plain = run_title({**CONFIG, "aqn": {"enabled": False}, "seed": 0,
                       "model": {"preset": "", "hf_path": "/models/Qwen2.5-3B/"}})
    assert plain == "Qwen2.5-3B · nvfp4 · seed 0"
    gguf = run_title({**CONFIG, "aqn": {"enabled": False}, "seed": 0,
                      "model": {"preset": "", "hf_path": "",
                                "gguf_path": "/x/SmolLM2-135M-Instruct.Q4_1.gguf"}})
    assert gguf == "SmolLM2-135M-Instruct.Q4_1 · nvfp4 · seed 0"


def test_current_config_reads_both_run_json_forms():
    older = {"seed": 1, "config": {"seed": 1}}
    starts = {"starts": [{"config": {"seed": 1}}, {"config": {"seed": 2}}]}
    assert current_config(older) == {"seed": 1}
    assert current_config(json.loads(json.dumps(starts))) == {"seed": 2}
    with pytest.raises(ValueError, match="neither"):
        current_config({"seed": 1})


def test_a_step_without_an_entropy_is_not_drawn():
    """A step whose completions had no valid token logs entropy and loss as null: the raw line
    of a short run skips that step instead of drawing it at 0."""
    metrics = synthetic_metrics(6)
    metrics[2]["entropy"] = metrics[2]["loss"] = None
    axes = _axes_by_ylabel(training_curves_figure(metrics, title="run"))
    [line] = axes["entropy (nats / token)"].get_lines()
    assert list(line.get_xdata()) == [0, 1, 3, 4, 5]
    np.testing.assert_array_equal(line.get_ydata(),
                                  [metrics[step]["entropy"] for step in (0, 1, 3, 4, 5)])
