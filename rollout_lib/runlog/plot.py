"""A run's curves as one PNG (matplotlib, no display needed): the loss, the entry point's key metric and any
held-out metric, one panel each, against the optimizer step. Used by `rollout runs plot` and by the flows, which
attach the image to the run's summary in the Prefect UI."""

from __future__ import annotations

import io
import math

# Panels in this order when the history has them; a held-out metric (eval/...) gets a panel of its own.
PANELS = (("loss", "loss"), ("accuracy", "accuracy (train)"), ("reward_mean", "mean reward"),
          ("eval/loss", "held-out loss"), ("eval/accuracy", "held-out accuracy"))
HELD_OUT_SUFFIXES = ("/reward_mean", "/pass_rate")


def panels_of(history: list[dict]) -> list[tuple[str, str]]:
    """(metric, title) of each panel the history can fill, in a fixed order."""
    present = {name for record in history for name, value in record.items() if _number(value) is not None}
    found = [(name, title) for name, title in PANELS if name in present]
    found += [(name, f"held-out {name.removeprefix('eval/')}") for name in sorted(present)
              if name.startswith("eval/") and name.endswith(HELD_OUT_SUFFIXES)]
    return found


def plot_curves(history: list[dict], title: str) -> bytes:
    """The PNG of `history` (one dict per step, with "step"); a ValueError when there is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")  # no display; never the user's interactive backend
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = panels_of(history)
    if not panels:
        raise ValueError(f"{title}: no metric to plot (steps without loss, accuracy or reward)")
    figure = Figure(figsize=(4.2 * len(panels), 3.2), dpi=100, layout="constrained")
    for axes, (name, panel_title) in zip(figure.subplots(1, len(panels), squeeze=False)[0], panels):
        points = [(record["step"], _number(record.get(name))) for record in history if "step" in record]
        points = [(step, value) for step, value in points if value is not None]
        axes.plot([step for step, _ in points], [value for _, value in points],
                  marker="o" if len(points) <= 30 else None, markersize=3, linewidth=1.4)
        axes.set_title(panel_title, fontsize=10)
        axes.set_xlabel("step")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.grid(alpha=0.3)
    figure.suptitle(title, fontsize=11)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None
