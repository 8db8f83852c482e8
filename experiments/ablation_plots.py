"""The format ablation's curves: a line per format (mean over seeds) with a +-1 std band, one
figure per metric, as a palette PNG and an SVG (experiments/ablation_analysis.py loads the runs and calls it;
this module never imports it).
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence

import numpy as np

# one color per study arm; curves of other arms take matplotlib's cycle
FORMAT_COLORS = {"bf16": "#444444", "nf4": "#1f77b4", "mxfp4": "#2ca02c", "nvfp4": "#ff7f0e",
                 "nvfp4+aqn": "#d62728", "nvfp4+aqn+tis": "#9467bd"}
PASS_AT_1 = "eval/pass@1"

CURVE_KEYS = ("entropy", "reward", "accuracy")
CURVE_LABELS = {PASS_AT_1: "held-out pass@1 (greedy)"}


def seed_band(runs: Sequence["ablation_analysis.Run"], key: str, smooth: int = 1):
    """(steps, mean, std) over the steps every run logged `key` at; std 0 with one run;
    empty arrays when the runs share no such step.

    smooth > 1 applies a trailing moving average of that many points to each run first.
    """
    series = [dict(zip(*(array.tolist() for array in run.series(key)))) for run in runs]
    common = sorted(set.intersection(*(set(by_step) for by_step in series)))
    if not common:
        return np.zeros(0, np.int64), np.zeros(0), np.zeros(0)
    curves = []
    for by_step in series:
        curve = np.array([by_step[step] for step in common], np.float64)
        if smooth > 1:
            curve = np.array([curve[max(0, i - smooth + 1):i + 1].mean()
                              for i in range(curve.size)])
        curves.append(curve)
    stacked = np.stack(curves)
    std = stacked.std(axis=0, ddof=1) if len(curves) > 1 else np.zeros(stacked.shape[1])
    return np.array(common), stacked.mean(axis=0), std


def curve_file_stem(key: str) -> str:
    """'eval/pass@1' -> 'eval_pass_at_1_vs_step'."""
    return key.replace("@", "_at_").replace("/", "_") + "_vs_step"


def _save_png(figure, path: str, dpi: int) -> None:
    """The figure as a 256-colour palette PNG (about a third of the RGBA file's size: the
    committed results stay small)."""
    from PIL import Image

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    buffer.seek(0)
    with Image.open(buffer) as image:
        image.convert("RGB").quantize(256).save(path, optimize=True)


def plot_format_curves(runs: Sequence["ablation_analysis.Run"], out_dir: str, smooth: int = 1,
                       keys: Sequence[str] | None = None) -> list[str]:
    """One figure per metric: a line per format (mean over seeds) with a +-1 std band.

    keys: default CURVE_KEYS, plus eval/pass@1 when a run logged it (not smoothed: one point
    per evaluation). Writes {curve_file_stem(key)}.png and .svg into `out_dir`; returns the
    paths.
    """
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    if keys is None:
        keys = CURVE_KEYS + ((PASS_AT_1,) if any(run.has(PASS_AT_1) for run in runs) else ())
    os.makedirs(out_dir, exist_ok=True)
    formats = list(dict.fromkeys(run.format for run in runs))
    paths = []
    for key in keys:
        window = 1 if key.startswith("eval/") else smooth
        figure = Figure(figsize=(6.4, 4.0))
        axis = figure.add_subplot()
        for name in formats:
            group = [run for run in runs if run.format == name]
            steps, mean, std = seed_band(group, key, window)
            if not steps.size:
                continue
            color = FORMAT_COLORS.get(name)
            axis.plot(steps, mean, color=color, label=f"{name} (n={len(group)})",
                      marker="o" if key.startswith("eval/") else None, markersize=3)
            if len(group) > 1:
                axis.fill_between(steps, mean - std, mean + std, color=color, alpha=0.2,
                                  linewidth=0)
        label = CURVE_LABELS.get(key, key)
        axis.set_xlabel("step")
        axis.set_ylabel(label)
        title = f"{label} vs step (mean ± std over seeds"
        axis.set_title(title + (f", {window}-step moving average)" if window > 1 else ")"))
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
        figure.tight_layout()
        stem = os.path.join(out_dir, curve_file_stem(key))
        _save_png(figure, stem + ".png", dpi=120)
        figure.savefig(stem + ".svg")
        paths += [stem + ".png", stem + ".svg"]
    return paths
