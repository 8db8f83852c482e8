"""The training-curves figure of one run: reward, accuracy, held-out pass@1 (when the run
evaluated), entropy and the AQN sigma / learning rate schedules against step, from the rows of
its metrics.jsonl.

Noisy per-step metrics are drawn as faint raw points under a centred rolling mean whose window
grows with the number of logged steps (`smoothing_window`); the legend states the window. The
schedules (AQN sigma, learning rate) are exact values, not estimates, so they are drawn as they
are, without smoothing; so is the held-out pass@1, measured every few steps on a fixed set.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

REWARD_COMPONENT_PREFIX = "reward/"
NOT_REWARDS = ("reward/timeouts",)   # a count of completions whose scoring timed out
# Colours of the Tableau palette, matching matplotlib's default cycle.
_METRIC_COLOR = "#1f77b4"
_SIGMA_COLOR = "#d62728"
_LEARNING_RATE_COLOR = "#2ca02c"
_EVAL_COLOR = "#9467bd"
EVAL_PASS_AT_1 = "eval/pass@1"   # Trainer.evaluate's column
_COMPONENT_COLORS = ("#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
                     "#17becf")


# ------------------------------------------------------------------------------ run records
def current_config(run_record: dict) -> dict:
    """The config of a run.json dict: the last start's config in the {"starts": [...]} form,
    else the top-level "config" of older runs."""
    starts = run_record.get("starts")
    if starts:
        return starts[-1]["config"]
    if "config" in run_record:
        return run_record["config"]
    raise ValueError("run.json holds neither 'starts' nor 'config'")


def run_title(config: dict, run_name: str = "") -> str:
    """'<run name> · <model> · <format>[+AQN] · seed <seed>' for a recorded config dict.

    Args:
      config: the config dict of run.json (`current_config`), or `json.loads(config.to_json())`.
      run_name: usually the basename of the run's workdir; left out when empty.
    Fields the config lacks are left out (format and seed show as '?').
    """
    quant_format = config.get("quant", {}).get("format", "?")
    if config.get("aqn", {}).get("enabled"):
        quant_format += "+AQN"
    model = config.get("model", {})
    model_name = (model.get("preset")
                  or os.path.basename(str(model.get("hf_path", "")).rstrip("/"))
                  or os.path.basename(str(model.get("gguf_path", ""))).removesuffix(".gguf"))
    parts = [run_name, model_name, quant_format, f"seed {config.get('seed', '?')}"]
    return " · ".join(part for part in parts if part)


# ------------------------------------------------------------------------------ smoothing
def smoothing_window(count: int) -> int:
    """Rolling-mean window for `count` logged steps: about a tenth of them, odd so the window
    is centred on a step; 1 (no smoothing) below 10 steps."""
    if count < 10:
        return 1
    window = max(3, round(count / 10))
    return window if window % 2 else window + 1


def centred_rolling_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Mean of the finite values among the `window` (odd) points centred on each point.

    The first and last window // 2 points, whose window does not fit, are NaN: a window cut
    at an end is either one-sided (a trend pulls it off the data) or narrow (noisy), and the
    raw points show the ends anyway. A point whose window holds no finite value is NaN too.
    Args:
      values: [N] float; NaN marks a missing value.
    Returns:
      [N] float64.
    """
    if window < 1 or window % 2 == 0:
        raise ValueError(f"rolling-mean window must be a positive odd number, got {window}")
    values = np.asarray(values, np.float64)
    mean = np.full(values.size, np.nan)
    if values.size < window:
        return mean
    finite = np.isfinite(values)
    # [N - window + 1, window]: row i is the window of points i .. i + window - 1.
    window_sum = sliding_window_view(np.where(finite, values, 0.0), window).sum(axis=-1)
    window_count = sliding_window_view(finite, window).sum(axis=-1)
    half = window // 2
    with np.errstate(invalid="ignore", divide="ignore"):
        mean[half:values.size - half] = np.where(window_count > 0, window_sum / window_count,
                                                 np.nan)
    return mean


# ------------------------------------------------------------------------------ columns
def _as_float(value) -> float:
    """A metrics value as float; null (None) and anything non-numeric as NaN."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return math.nan


def _rows_by_step(metrics: Sequence[dict]) -> list[dict]:
    """Rows sorted by step; a repeated step keeps its last row."""
    by_step = {}
    for index, row in enumerate(metrics):
        step = row.get("step")
        if not isinstance(step, (int, float)) or isinstance(step, bool) or not math.isfinite(step):
            raise ValueError(f"metrics row {index}: 'step' must be a number, got {step!r}")
        by_step[step] = row
    return [by_step[step] for step in sorted(by_step)]


def _column(rows: Sequence[dict], key: str) -> np.ndarray | None:
    """[N] float64 of `key` over the rows (NaN where missing or null); None if no finite value."""
    values = np.array([_as_float(row.get(key)) for row in rows], np.float64)
    return values if np.isfinite(values).any() else None


# ------------------------------------------------------------------------------ panels
def _plot_noisy_metric(axis, steps: np.ndarray, values: np.ndarray, window: int,
                       color: str = _METRIC_COLOR, label: str | None = None) -> None:
    """Faint raw points and their centred rolling mean (the raw line when window is 1)."""
    finite = np.isfinite(values)
    if window == 1:
        axis.plot(steps[finite], values[finite], color=color, marker="o", markersize=3.5,
                  linewidth=1.2, label=label)
        return
    axis.scatter(steps[finite], values[finite], s=7, color=color, alpha=0.28, linewidths=0)
    axis.plot(steps, centred_rolling_mean(values, window), color=color, linewidth=1.8,
              label=label)


def _reward_panel(axis, steps, rows, window) -> None:
    """Total reward, and each reward/<name> component as a faint dashed (smoothed) line."""
    names = sorted({key for row in rows for key in row
                    if key.startswith(REWARD_COMPONENT_PREFIX) and key not in NOT_REWARDS})
    components = [(name, values) for name in names
                  if (values := _column(rows, name)) is not None]
    _plot_noisy_metric(axis, steps, _column(rows, "reward"), window,
                       label="total" if components else None)
    for (name, values), color in zip(components, itertools.cycle(_COMPONENT_COLORS)):
        line = values if window == 1 else centred_rolling_mean(values, window)
        finite = np.isfinite(line)
        axis.plot(steps[finite], line[finite], color=color, linewidth=1.1, alpha=0.6,
                  linestyle="--", marker="o" if window == 1 else None, markersize=2.5,
                  label=name[len(REWARD_COMPONENT_PREFIX):])
    if components:
        axis.legend(loc="best", fontsize=7.5, framealpha=0.85)
    axis.set_ylabel("reward (mean per completion)")


def _eval_panel(axis, steps, pass_at_1: np.ndarray, rows) -> None:
    """Held-out greedy pass@1 at the steps that evaluated, joined by lines, not smoothed."""
    evaluated = np.isfinite(pass_at_1)
    axis.plot(steps[evaluated], pass_at_1[evaluated], color=_EVAL_COLOR, marker="o",
              markersize=3.5, linewidth=1.4)
    sizes = {row.get("eval/num_examples") for row, used in zip(rows, evaluated) if used}
    size = f", {sizes.pop()} problems" if len(sizes) == 1 else ""
    axis.set_title(f"greedy{size}", fontsize=9, color="#555555")
    axis.set_ylabel("held-out pass@1")


def _schedule_panel(axis, steps, sigma, learning_rate) -> None:
    """AQN sigma on the left axis, the learning rate on a right twin axis; with AQN off (no
    positive sigma) the learning rate takes the left axis and a note says AQN is off."""
    marker = "o" if steps.size < 10 else None
    positive = sigma is not None and bool((sigma > 0).any())
    handles = []
    if positive:
        finite_positive = sigma[np.isfinite(sigma) & (sigma > 0)]
        log_scale = finite_positive.max() / finite_positive.min() >= 10
        label = "AQN sigma"
        zero_rows = np.flatnonzero(sigma == 0)
        if log_scale:
            axis.set_yscale("log")
            if zero_rows.size:
                # A log axis cannot show sigma = 0 (the first AQN stage): the legend names
                # those steps instead.
                first, last = steps[zero_rows[0]], steps[zero_rows[-1]]
                if zero_rows.size == 1:
                    span = f"step {first:g}"
                elif zero_rows[-1] - zero_rows[0] + 1 == zero_rows.size:
                    span = f"steps {first:g}–{last:g}"
                else:
                    span = f"{zero_rows.size} steps"
                label += f" (0 at {span})"
        shown = np.where(sigma > 0, sigma, np.nan) if log_scale else sigma
        handles += axis.plot(steps, shown, color=_SIGMA_COLOR, drawstyle="steps-post",
                             marker=marker, markersize=3.5, linewidth=1.6, label=label)
        axis.set_ylabel("AQN sigma", color=_SIGMA_COLOR)
        axis.tick_params(axis="y", colors=_SIGMA_COLOR, which="both")
        learning_rate_axis = axis.twinx() if learning_rate is not None else None
    else:
        # All-zero sigma is AQN off, or a run still in AQN's first stage (sigma = 0).
        axis.set_title("AQN sigma = 0 at every step" if sigma is not None
                       else "no AQN sigma logged",
                       fontsize=9, color="#555555")
        learning_rate_axis = axis if learning_rate is not None else None
    if learning_rate_axis is not None:
        handles += learning_rate_axis.plot(steps, learning_rate, color=_LEARNING_RATE_COLOR,
                                           marker=marker, markersize=3.5, linewidth=1.6,
                                           label="learning rate")
        learning_rate_axis.set_ylabel("learning rate", color=_LEARNING_RATE_COLOR)
        learning_rate_axis.tick_params(axis="y", colors=_LEARNING_RATE_COLOR, which="both")
        learning_rate_axis.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        learning_rate_axis.set_ylim(bottom=0)
    if len(handles) > 1:
        axis.legend(handles=handles, loc="upper right", fontsize=7.5, framealpha=0.85)


# ------------------------------------------------------------------------------ the figure
def _smoothing_key(window: int) -> list:
    """Legend entries saying how the noisy panels are drawn (shared by all of them)."""
    from matplotlib.lines import Line2D

    if window == 1:
        return [Line2D([], [], color="#555555", marker="o", markersize=3.5, linewidth=1.2,
                       label="per step (too few steps to smooth)")]
    return [Line2D([], [], color="#555555", marker="o", markersize=3, alpha=0.4,
                   linestyle="none", label="per step"),
            Line2D([], [], color="#555555", linewidth=1.8,
                   label=f"mean of {window} steps, centred")]


def training_curves_figure(metrics: Sequence[dict], *, title: str, window: int | None = None):
    """The matplotlib Figure of one run's curves (not saved; a notebook can show it).

    Panels, each omitted when its metric has no finite value: reward (total, plus each
    reward/<name> component as a faint dashed line), accuracy, held-out pass@1 (eval/pass@1,
    at the steps that have it), entropy, and AQN sigma with the learning rate. Null or NaN
    values are skipped.
    Args:
      metrics: metrics.jsonl rows, one dict per step with at least 'step'.
      title: the figure's suptitle (`run_title`).
      window: rolling-mean window (odd); default `smoothing_window(number of rows)`.
    Returns:
      a matplotlib.figure.Figure on an Agg canvas, outside pyplot (nothing to close).
    Raises:
      ValueError: a row without a numeric 'step', an even window, or no plottable metric.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # no pyplot: no global figure state to leak
    from matplotlib.ticker import MaxNLocator

    rows = _rows_by_step(metrics)
    steps = np.array([row["step"] for row in rows], np.float64)
    window = smoothing_window(len(rows)) if window is None else window
    if window < 1 or window % 2 == 0:
        raise ValueError(f"rolling-mean window must be a positive odd number, got {window}")

    panels = []
    if _column(rows, "reward") is not None:
        panels.append(lambda axis: _reward_panel(axis, steps, rows, window))
    def noisy_panel(values, label):
        def draw(axis):
            _plot_noisy_metric(axis, steps, values, window)
            axis.set_ylabel(label)
        return draw

    if (accuracy := _column(rows, "accuracy")) is not None:
        panels.append(noisy_panel(accuracy, "accuracy (fraction correct)"))
    if (pass_at_1 := _column(rows, EVAL_PASS_AT_1)) is not None:
        panels.append(lambda axis: _eval_panel(axis, steps, pass_at_1, rows))
    if (entropy := _column(rows, "entropy")) is not None:
        panels.append(noisy_panel(entropy, "entropy (nats / token)"))
    sigma, learning_rate = _column(rows, "aqn_sigma"), _column(rows, "learning_rate")
    if learning_rate is not None or (sigma is not None and (sigma > 0).any()):
        panels.append(lambda axis: _schedule_panel(axis, steps, sigma, learning_rate))
    if not panels:
        raise ValueError(f"no plottable metric (reward, accuracy, {EVAL_PASS_AT_1}, entropy, "
                         f"aqn_sigma, learning_rate) in {len(rows)} metrics rows")

    row_count = 1 if len(panels) <= 3 else 2
    column_count = math.ceil(len(panels) / row_count)
    figure = Figure(figsize=(min(12.5, 4.4 * column_count + 1.0), 3.2 * row_count + 0.8),
                    layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(row_count, column_count, squeeze=False).ravel()
    for axis in axes[len(panels):]:   # a grid cell without a panel
        axis.remove()
    for axis, draw in zip(axes, panels):
        draw(axis)
        axis.set_xlabel("step")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10],
                                                 min_n_ticks=1))
        if steps[-1] - steps[0] < 2:   # one or two steps: whole-step ticks around them
            axis.set_xlim(steps[0] - 0.5, steps[-1] + 0.5)
        axis.grid(alpha=0.3)
    figure.suptitle(title, fontsize=11)
    figure.legend(handles=_smoothing_key(window), loc="outside lower center", ncol=2,
                  fontsize=8, frameon=False)
    return figure


def plot_training_curves(metrics: Sequence[dict], path: str, *, title: str,
                         window: int | None = None) -> None:
    """Writes `training_curves_figure(metrics, title=title, window=window)` to the PNG `path`
    (replaced atomically; nothing else is written)."""
    figure = training_curves_figure(metrics, title=title, window=window)
    temporary = f"{path}.tmp-{os.getpid()}"
    try:
        with open(temporary, "wb") as handle:
            figure.savefig(handle, format="png", dpi=120)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def write_run_curves(metrics: Sequence[dict], workdir: str, config: dict) -> None:
    """A run's curves.png in its workdir (nothing without metrics rows); a failed write is one
    warning, never an error: the run's results are its metrics and checkpoints."""
    if not metrics:
        return
    path = os.path.join(workdir, "curves.png")
    try:
        plot_training_curves(metrics, path, title=run_title(config, os.path.basename(
            os.path.normpath(workdir))))
    except OSError as error:
        logging.getLogger(__name__).warning("could not write %s: %s", path, error)
