"""Plots of lesson 11 (planning a training run): the planner's best layouts, scaling curves, and predictions
held to measurements.

Three pictures answer the three questions a plan raises.  **Which layout, and why?**  :func:`plot_plan` draws
the ranked candidates of :func:`labkit.costmodel.planner.plan`, one row each: on the left what a GPU holds (GB,
against the device's memory), on the right where the predicted step goes (seconds, by term of
:meth:`labkit.costmodel.step.StepTime.parts`), so that the fastest layout's price in memory and the next one's
loss in time read off one row apart.  **What happens with more GPUs?**  :func:`plot_scaling` draws MFU against
the GPU count (log scale) for the simulator's points (:func:`labkit.costmodel.simulator.scaling`) beside
published ones (:mod:`labkit.costmodel.published`).  **Can the model be trusted?**
:func:`plot_predicted_vs_measured` puts each predicted step against the measured one (ms), with the line where
they are equal and a band of ``±30 %`` around it.

The conventions are ``labkit.viz.plots``': data in, ``matplotlib.figure.Figure`` out, nothing run.  Memory is in
GB (1e9 bytes), as the planner reports it and as vendors quote devices: an "80 GB" GPU is a line at 80.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullLocator

from labkit.viz.mesh_plots import MEMORY_PARTS

GB = 1e9
# The terms of StepTime.parts(), in the order a step is drawn (colours apart from the memory parts beside them).
STEP_PARTS = {"compute": ("compute", "#1F4E79"), "tp": ("TP all-reduces", "#E69F00"),
              "bubble": ("pipeline bubble", "#CCB974"), "pp send": ("pipeline sends", "#C44E52"),
              "dp": ("DP reduction (exposed, and slowing compute)", "#17BECF"), "zero": ("ZeRO gathers", "#8C564B"),
              "cp": ("CP exchange (exposed)", "#9467BD"), "ep": ("EP all-to-alls", "#E377C2"),
              "optimizer": ("optimizer step", "#7F7F7F")}
PREDICTED_COLOR, PUBLISHED_COLOR = "#0072B2", "#D55E00"  # Okabe & Ito: blue, vermillion


def _check_positive(name: str, value: object, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be {'None or ' if allow_none else ''}a positive number, got {value!r}")


def _message(figure: Figure, text: str, color: str = "#B00000") -> None:
    figure.text(0.5, 0.5, textwrap.fill(text, 110), ha="center", va="center", fontsize=10, color=color,
                gid="message")


def plot_plan(result: Any, device_memory_bytes: float | None = None,
              title: str = "The planner's best configurations") -> Figure:
    """One row per candidate of ``result`` (a :class:`~labkit.costmodel.planner.PlanResult`, fastest on top),
    labelled with its layout.  Left: the memory of the fullest GPU stacked in GB (weights, gradients, optimizer
    states, activations), a dashed line at ``device_memory_bytes`` and, where the plan kept a margin free
    (``result.usable_bytes``), a dotted one at what it could fill.  Right: the predicted step stacked in seconds by
    term (:data:`STEP_PARTS`), its total and MFU written at its end.  A plan with no candidate is drawn as its
    :meth:`~labkit.costmodel.planner.PlanResult.reason`, in red."""
    _check_positive("device_memory_bytes", device_memory_bytes)
    rows = list(result.candidates)
    if not rows:
        figure = Figure(figsize=(12, 1.6))
        figure.suptitle(title, fontsize=10)
        _message(figure, result.reason())
        return figure
    figure = Figure(figsize=(12, 1.9 + 0.42 * len(rows)))
    memory_axis, time_axis = figure.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": (1.0, 1.5)})
    positions = list(range(len(rows)))

    def stack(axis, values_of, parts) -> list[float]:
        left = [0.0] * len(rows)
        for key, (name, color) in parts.items():
            values = [values_of(row, key) for row in rows]
            if not any(values):  # a term no candidate has (cp, ep): no bar, no legend entry
                continue
            axis.barh(positions, values, left=left, height=0.62, color=color, edgecolor="white", linewidth=0.5,
                      label=name)
            left = [start + value for start, value in zip(left, values, strict=True)]
        return left

    totals = stack(memory_axis, lambda row, key: row.memory[key] / GB, MEMORY_PARTS)
    right = max(totals)
    if device_memory_bytes is not None:
        limit = device_memory_bytes / GB
        memory_axis.axvline(limit, color="black", linestyle="--", linewidth=1.3, gid="device memory",
                            label=f"device memory: {limit:g} GB")
        right = max(right, limit)
    usable = getattr(result, "usable_bytes", None)
    if usable is not None and (device_memory_bytes is None or usable < device_memory_bytes):
        memory_axis.axvline(usable / GB, color="black", linestyle=":", linewidth=1.3, gid="usable memory",
                            label=f"planned up to: {usable / GB:g} GB")
    for position, total in zip(positions, totals, strict=True):
        memory_axis.text(total, position, f" {total:.1f}", va="center", fontsize=7,
                         bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 0.4})
    memory_axis.set_xlim(0, 1.25 * right)
    memory_axis.set_xlabel("memory per GPU (GB)")
    memory_axis.set_yticks(positions, [row.layout.label() for row in rows], fontsize=8)
    memory_axis.invert_yaxis()
    memory_axis.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.5 / (1 + 0.3 * len(rows))),
                       ncol=2, frameon=False)

    steps = stack(time_axis, lambda row, key: row.step.parts().get(key, 0.0), STEP_PARTS)
    for position, row, total in zip(positions, rows, steps, strict=True):
        time_axis.text(total, position, f" {total:.3g} s, MFU {row.mfu:.1%}", va="center", fontsize=7)
    time_axis.set_xlim(0, 1.3 * max(steps))
    time_axis.set_xlabel("predicted time per step (s)")
    time_axis.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.5 / (1 + 0.3 * len(rows))),
                     ncol=3, frameon=False)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    return figure


def _gpus_and_mfu(point: Any) -> tuple[int, float]:
    """``(gpus, mfu)`` of a scaling point, a published figure point (anything with ``.gpus`` and ``.mfu``), or a
    ``(gpus, mfu)`` pair."""
    if hasattr(point, "gpus") and hasattr(point, "mfu"):
        gpus, value = point.gpus, point.mfu
    elif isinstance(point, Sequence) and not isinstance(point, (str, bytes)) and len(point) == 2:
        gpus, value = point
    else:
        raise ValueError(f"a point has .gpus and .mfu, or is a (gpus, mfu) pair; got {point!r}")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1 or not 0 <= value <= 1:
        raise ValueError(f"a point needs gpus >= 1 and an MFU between 0 and 1, got {point!r}")
    return gpus, value


def plot_scaling(points: Sequence[Any], published: Sequence[Any] | None = None,
                 label: str = "labkit's simulator", published_label: str = "published",
                 title: str = "MFU against the number of GPUs") -> Figure:
    """MFU (%) against GPUs on a log axis: ``points`` (e.g. :func:`labkit.costmodel.simulator.scaling`'s) as a
    line, ``published`` (e.g. :data:`labkit.costmodel.published.MEGATRON_STRONG_SCALING`) as markers; each
    point's MFU written beside it.  Every GPU count drawn is a tick."""
    if not points:
        raise ValueError("points is empty: give scaling points (.gpus, .mfu) to draw")
    ours = sorted(_gpus_and_mfu(point) for point in points)
    theirs = sorted(_gpus_and_mfu(point) for point in published or ())
    figure = Figure(figsize=(9, 4.6))
    axis = figure.subplots()
    axis.plot([g for g, _ in ours], [100 * v for _, v in ours], "o-", color=PREDICTED_COLOR, label=label,
              gid="predicted")
    for gpus, value in ours:
        axis.annotate(f"{100 * value:.1f}", (gpus, 100 * value), xytext=(0, 7), textcoords="offset points",
                      ha="center", fontsize=7, color=PREDICTED_COLOR)
    if theirs:
        axis.plot([g for g, _ in theirs], [100 * v for _, v in theirs], "s--", color=PUBLISHED_COLOR,
                  label=published_label, gid="published", markersize=6)
        for gpus, value in theirs:
            axis.annotate(f"{100 * value:.1f}", (gpus, 100 * value), xytext=(0, -12), textcoords="offset points",
                          ha="center", fontsize=7, color=PUBLISHED_COLOR)
    counts = sorted({g for g, _ in ours + theirs})
    axis.set_xscale("log")
    axis.set_xticks(counts)
    axis.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))
    axis.xaxis.set_minor_locator(NullLocator())
    axis.tick_params(axis="x", labelsize=8, labelrotation=45)
    low = min(v for _, v in ours + theirs)
    high = max(v for _, v in ours + theirs)
    axis.set_ylim(max(0.0, 100 * low - 6), 100 * high + 6)
    axis.set_xlabel("GPUs (log scale)")
    axis.set_ylabel("MFU (% of the GPUs' bf16 peak)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    axis.set_title(title, fontsize=10)
    figure.tight_layout()
    return figure


def plot_predicted_vs_measured(measured_s: Sequence[float], predicted_s: Sequence[float], labels: Sequence[str],
                               band: float = 0.30, title: str = "Predicted against measured step time") -> Figure:
    """Each step's prediction (y) against its measurement (x), both in ms, labelled; the line ``y = x`` and the
    band ``(1 ± band) x`` around it (shaded), so a point outside the band misses by more than ``band``."""
    if not measured_s or not len(measured_s) == len(predicted_s) == len(labels):
        raise ValueError(f"measured_s, predicted_s and labels must be equally long and not empty, got "
                         f"{len(measured_s)}, {len(predicted_s)} and {len(labels)}")
    for value in (*measured_s, *predicted_s):
        _check_positive("a step time", value, allow_none=False)
    if not 0 < band < 1:
        raise ValueError(f"band must be a fraction between 0 and 1, got {band!r}")
    measured = [1e3 * value for value in measured_s]
    predicted = [1e3 * value for value in predicted_s]
    top = 1.15 * max(measured + predicted)
    figure = Figure(figsize=(6.4, 6.0))
    axis = figure.subplots()
    axis.fill_between([0, top], [0, (1 - band) * top], [0, (1 + band) * top], color="#DDDDDD", alpha=0.7,
                      label=f"within ±{band:.0%}", gid="band")
    axis.plot([0, top], [0, top], color="black", linewidth=1.0, label="predicted = measured", gid="equal")
    axis.scatter(measured, predicted, color=PREDICTED_COLOR, zorder=3, gid="steps")
    for x, y, text in zip(measured, predicted, labels, strict=True):
        axis.annotate(text, (x, y), xytext=(5, 4), textcoords="offset points", fontsize=8)
    axis.set_xlim(0, top)
    axis.set_ylim(0, top)
    axis.set_aspect("equal")
    axis.set_xlabel("measured step (ms)")
    axis.set_ylabel("predicted step (ms)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8, loc="upper left")
    axis.set_title(title, fontsize=10)
    figure.tight_layout()
    return figure
