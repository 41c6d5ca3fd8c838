"""A run's curves as one PNG (matplotlib, no display needed), used by `rollout runs plot` and by the flows, which
attach the image to the run in the Prefect UI.

Every panel shares the step axis. A training metric is drawn as TensorBoard draws it: each step's (one batch's)
value faint, a smoothed curve on top; its held-out counterpart sits on the same panel as markers, from the
evaluation before training (step 0) on. Then the learning rate and the gradient norm, when the steps report them.
`curve_panels` says what is drawn (tests read it); `plot_curves` draws it, sized for the ~900-1000 px wide content
column of the UI's artifact view."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

# A training metric's panel: (its name, the panel's title, its held-out counterpart). RL's held-out reward is per
# env (`eval/<env>/reward_mean`), on the mean reward's panel.
TRAINING_PANELS = (("loss", "loss", "eval/loss"), ("accuracy", "pair accuracy", "eval/accuracy"),
                   ("mean_margin", "mean margin", "eval/mean_margin"), ("reward_mean", "mean reward", "/reward_mean"))
# RL's held-out pass rates have no training counterpart: a panel of their own, one series per env.
PASS_RATE_SUFFIX = "/pass_rate"
# Optimizer panels: (name, title, smoothed); the learning rate is a schedule, not a noisy measurement.
OPTIMIZER_PANELS = (("lr", "learning rate", False), ("grad_norm", "gradient norm", True))
# Sampler-trainer mismatch panels (rl_losses/correction.py), drawn where a run's correction reports them.
MISMATCH_PANELS = (("mismatch/kl", "sampler-trainer mismatch KL", True),
                   ("mismatch/ratio_max", "mismatch ratio max", True),
                   ("mismatch/masked_fraction", "mismatch masked fraction", True))


@dataclass(frozen=True)
class Series:
    label: str
    steps: list[int]
    values: list[float]
    held_out: bool = False  # evaluations: markers joined by a line, never smoothed
    smoothed: list[float] | None = None  # drawn on top of the faint raw values; None: the raw values alone


@dataclass(frozen=True)
class Panel:
    title: str
    series: list[Series]
    from_zero: bool = False  # a quantity >= 0 whose size matters (a constant lr: a flat line, not 5-digit ticks)


def smoothing_weight(points: int) -> float:
    """The EMA weight for a curve of `points` steps: none under 10 (every point shows), 0.6 (TensorBoard's default)
    up to 37, then 1 - 15 / points up to 0.9 from 150 on: the average spans ~7% of the run, or at most ~10 steps, so
    the smoothed curve lags a falling loss by a few steps, not by a fifth of the run."""
    if points < 10:
        return 0.0
    return min(0.9, max(0.6, 1.0 - 15.0 / points))


def smooth(values: list[float], weight: float) -> list[float]:
    """TensorBoard's debiased exponential moving average: ema = weight * ema + (1 - weight) * value from 0, divided
    by 1 - weight**n so the first points are not pulled towards 0."""
    ema, smoothed = 0.0, []
    for count, value in enumerate(values, start=1):
        ema = weight * ema + (1.0 - weight) * value
        smoothed.append(ema / (1.0 - weight ** count))
    return smoothed


def curve_panels(history: list[dict]) -> list[Panel]:
    """The panels `history` (one dict per step, with "step"; step 0: the evaluation before training) can fill, in a
    fixed order: the training metrics with their held-out counterparts, held-out pass rates, then the optimizer."""
    present = {name for record in history for name, value in record.items() if _number(value) is not None}
    panels = []
    for name, title, held_out in TRAINING_PANELS:
        if held_out.startswith("eval/"):
            evaluations = [(held_out, "held-out")] if held_out in present else []
        else:  # per env: eval/<env><suffix>
            evaluations = [(metric, "held-out" if len(envs) == 1 else f"held-out {env}")
                           for envs in [_envs(present, held_out)] for env, metric in envs]
        series = ([_training_series(history, name, "train", smoothed=True)] if name in present else []) + \
            [_series(history, metric, label, held_out=True) for metric, label in evaluations]
        if series:
            panels.append(Panel(title, series))
    pass_rates = _envs(present, PASS_RATE_SUFFIX)
    if pass_rates:
        panels.append(Panel("held-out pass rate", [_series(history, metric, env if len(pass_rates) > 1 else "held-out",
                                                           held_out=True) for env, metric in pass_rates]))
    for name, title, smoothed in OPTIMIZER_PANELS + MISMATCH_PANELS:
        if name in present:
            panels.append(Panel(title, [_training_series(history, name, name, smoothed)], from_zero=True))
    return panels


def plot_curves(history: list[dict], title: str) -> bytes:
    """The PNG of `history` (see curve_panels); a ValueError when there is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")  # no display; never the user's interactive backend
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = curve_panels(history)
    if not panels:
        raise ValueError(f"{title}: no metric to plot (steps without loss, accuracy or reward)")
    columns = 1 if len(panels) == 1 else 3 if len(panels) in (3, 5, 6) else 2
    rows = math.ceil(len(panels) / columns)
    # 9.6 in at 100 dpi: 960 px, shown unscaled (or nearly) in the UI's content column; fonts of 9-10 pt read there.
    figure = Figure(figsize=(9.6, 0.6 + 2.7 * rows), dpi=100, layout="constrained")
    grid = figure.subplots(rows, columns, squeeze=False, sharex=True)
    steps = [record["step"] for record in history if isinstance(record.get("step"), int)]
    for index, axes in enumerate(grid.flat):
        if index >= len(panels):
            axes.set_visible(False)
            continue
        _draw(axes, panels[index])
        first, last = min(0, *steps), max(1, *steps)
        axes.set_xlim(first - 0.02 * (last - first), last + 0.02 * (last - first))  # step 0's marker whole
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.tick_params(labelsize=8, labelbottom=True)
        axes.grid(alpha=0.3)
        if index + columns >= len(panels):  # the lowest panel of its column
            axes.set_xlabel("step", fontsize=9)
    figure.suptitle(title, fontsize=11)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return _palette_png(buffer.getvalue())


def _palette_png(png: bytes) -> bytes:
    """The image with at most 256 colours (a few lines on white use far fewer): a third of the size, which matters
    because the UI's server keeps every version of the curves artifact (flows/common.py CurvesArtifact)."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    buffer = io.BytesIO()
    image.save(buffer, format="png", optimize=True)
    return buffer.getvalue()


def _draw(axes, panel: Panel) -> None:
    held_out_colors = iter(["C1", "C3", "C2", "C4", "C5", "C6"])
    for series in panel.series:
        if series.held_out:
            color = next(held_out_colors)
            # dashed: between two evaluations nothing was measured; the legend says first -> last
            ends = series.values[:1] if len(series.values) == 1 else [series.values[0], series.values[-1]]
            shown = " \u2192 ".join(map(_short, ends))
            axes.plot(series.steps, series.values, color=color, marker="o", markersize=4.5, linewidth=1.1,
                      linestyle="--", label=f"{series.label} {shown}", zorder=3)
        elif series.smoothed is not None:
            axes.plot(series.steps, series.values, color="C0", alpha=0.25, linewidth=1.0)
            axes.plot(series.steps, series.smoothed, color="C0", linewidth=1.6, label=series.label)
        else:
            axes.plot(series.steps, series.values, color="C0", linewidth=1.4, label=series.label,
                      marker="o" if len(series.steps) < 10 else None, markersize=3)
    axes.set_title(panel.title, fontsize=10)
    if panel.from_zero:
        axes.set_ylim(bottom=0, top=1.1 * max(max(series.values, default=0.0) for series in panel.series) or 1.0)
    if len(panel.series) > 1 or panel.series[0].held_out:
        axes.legend(fontsize=8, loc="best", framealpha=0.8, edgecolor="none")


def _training_series(history: list[dict], name: str, label: str, smoothed: bool) -> Series:
    series = _series(history, name, label)
    weight = smoothing_weight(len(series.values)) if smoothed else 0.0
    return Series(series.label, series.steps, series.values,
                  smoothed=smooth(series.values, weight) if weight else None)


def _series(history: list[dict], name: str, label: str, held_out: bool = False) -> Series:
    points = [(record["step"], _number(record.get(name))) for record in history if isinstance(record.get("step"), int)]
    points = [(step, value) for step, value in points if value is not None]
    return Series(label, [step for step, _ in points], [value for _, value in points], held_out=held_out)


def _envs(present: set[str], suffix: str) -> list[tuple[str, str]]:
    """(env, metric) of each `eval/<env><suffix>` present, by env."""
    return [(name.removeprefix("eval/").removesuffix(suffix), name) for name in sorted(present)
            if name.startswith("eval/") and name.endswith(suffix) and name.count("/") == 2]


def _short(value: float) -> str:
    return f"{value:.3f}" if abs(value) < 1000 else f"{value:.4g}"


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None
