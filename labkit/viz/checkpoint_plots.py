"""Lesson 09's figure and explorer: how often to checkpoint a run that fails at random.

:func:`plot_checkpoint_interval` draws the share of a run's wall-clock time lost to checkpoints and failures
against the checkpoint interval (``labkit.costmodel.checkpointing``): the cost of writing, the work a failure
throws away, their sum with Young's optimum marked, the exact expectation for Poisson failures, and, when given,
the same share measured in a simulation of failures.  :func:`checkpoint_explorer` feeds it from sliders (model size, GPUs, their reliability, the
layout and the bandwidths), wired by ``labkit.viz.widgets.connect``.
"""

from __future__ import annotations

import math

import ipywidgets as widgets
from matplotlib.figure import Figure

from labkit.costmodel import checkpointing as model
from labkit.viz import plots
from labkit.viz.widgets import ROW, connect

HOUR = 3600.0


def interval_grid(optimum_s: float, points: int = 60) -> list[float]:
    """Intervals from ``optimum / 30`` to ``30 x optimum``, evenly spaced on a log scale."""
    return [optimum_s * 30 ** (2 * k / (points - 1) - 1) for k in range(points)]


def plot_checkpoint_interval(write_s: float, mtbf_s: float, restart_s: float = 0.0,
                             simulated: dict[float, float] | None = None, chosen_s: float | None = None,
                             title: str = "How often to checkpoint", ax=None) -> Figure:
    """The lost share of wall-clock time (%) against the checkpoint interval (hours, log scale): writing
    ``C / tau``, lost work and restarts ``(tau / 2 + R) / M``, their sum, and the exact expectation for Poisson
    failures; Young's ``sqrt(2 C M)`` dotted; ``simulated`` (interval -> measured share) as markers;
    ``chosen_s`` as a dashed line."""
    optimum = model.young_interval(write_s, mtbf_s)
    grid = interval_grid(optimum)
    figure = Figure(figsize=(8, 4.2)) if ax is None else ax.figure
    axis = figure.subplots() if ax is None else ax
    hours = [tau / HOUR for tau in grid]
    writing = [100 * write_s / tau for tau in grid]
    failing = [100 * (tau / 2 + restart_s) / mtbf_s for tau in grid]
    axis.plot(hours, writing, color="#4C72B0", linestyle="--", label="writing checkpoints, C / τ")
    axis.plot(hours, failing, color="#DD8452", linestyle="--", label="work lost to failures, (τ/2 + R) / M")
    axis.plot(hours, [a + b for a, b in zip(writing, failing, strict=True)], color="black",
              label="together (Young, first order)")
    axis.plot(hours, [100 * model.expected_lost_fraction(tau, write_s, mtbf_s, restart_s) for tau in grid],
              color="#8172B2", linestyle="-.", label="expected for Poisson failures (Daly, exact)")
    best = 100 * model.lost_fraction(optimum, write_s, mtbf_s, restart_s)
    axis.axvline(optimum / HOUR, color="gray", linestyle=":",
                 label=f"Young: τ* = √(2CM) = {_duration(optimum)}, {best:.2g} % lost")
    if simulated:
        axis.plot([tau / HOUR for tau in simulated], [100 * share for share in simulated.values()], "o",
                  color="#55A868", markersize=5, label="simulated failures (Poisson)")
    if chosen_s is not None:
        axis.axvline(chosen_s / HOUR, color="#C44E52", linestyle="--", label=f"your interval: {_duration(chosen_s)}")
    axis.set_xscale("log")
    axis.set_ylim(0, min(100.0, 3 * best + 1))
    plots.finish(axis, "checkpoint interval τ (hours of training, log scale)", "wall-clock time lost (%)", title)
    return figure


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 2 * HOUR:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / HOUR:.3g} h"


def checkpoint_explorer(parameters_b: float = 405.0, gpus: int = 16384, gpu_mtbf_years: float = 5.2,
                        layout: str = "sharded", writer_gb_s: float = 2.0, storage_gb_s: float = 1000.0,
                        restart_min: float = 10.0) -> widgets.VBox:
    """Checkpointing a large run (lesson 09): model size, GPUs, one GPU's mean time between failures, one
    writer's and the storage's bandwidth, restart time, layout -> the checkpoint's size and write time, the job's
    MTBF, Young's interval and the lost share of time against the interval.  The defaults are Llama 3 405B's
    scale: 16,384 GPUs with one interruption every 2.8 hours (466 in 54 days; Dubey et al. 2024)."""
    size = widgets.FloatLogSlider(value=parameters_b, base=10, min=-1, max=3.3, step=0.05,
                                  description="parameters (billions)")
    ranks = widgets.IntSlider(value=int(round(math.log2(gpus))), min=3, max=16, description="GPUs (log2)")
    reliability = widgets.FloatSlider(value=gpu_mtbf_years, min=0.5, max=20.0, step=0.1,
                                      description="one GPU's MTBF (years)")
    layouts = widgets.Dropdown(options=list(model.LAYOUTS), value=layout, description="layout")
    writer = widgets.FloatLogSlider(value=writer_gb_s, base=10, min=-1, max=1.5, step=0.05,
                                    description="one writer (GB/s)")
    storage = widgets.FloatLogSlider(value=storage_gb_s, base=10, min=1, max=4, step=0.05,
                                     description="storage in all (GB/s)")
    restart = widgets.FloatSlider(value=restart_min, min=0.0, max=60.0, step=1.0, description="restart R (min)")
    picture = widgets.Image(format="png")
    summary = widgets.HTML()

    def redraw() -> None:
        count = 2 ** ranks.value
        size_bytes = model.checkpoint_bytes(size.value * 1e9)
        write_s = model.write_seconds(size_bytes, writer.value * 1e9, layouts.value, count, storage.value * 1e9)
        mtbf_s = reliability.value * 365.25 * 24 * HOUR / count
        restart_s = restart.value * 60
        optimum = model.young_interval(write_s, mtbf_s)
        lost = model.lost_fraction(optimum, write_s, mtbf_s, restart_s)
        summary.value = (f"<small>{size_bytes / 1e9:,.0f} GB per checkpoint (12 bytes per parameter: fp32 weights "
                         f"and Adam's two moments), written in {_duration(write_s)} ({layouts.value}, "
                         f"{count:,} GPUs); the job fails every {_duration(mtbf_s)} on average; checkpoint every "
                         f"{_duration(optimum)} (Young) and lose {100 * lost:.2g} % of the time.</small>")
        writers = count if layouts.value == "sharded" else 1
        limit = "the storage's limit" if writers * writer.value > storage.value else "the writers' limit"
        figure = plot_checkpoint_interval(write_s, mtbf_s, restart_s, title=(
            f"{size.value:.3g}B parameters on {count:,} GPUs: C = {_duration(write_s)}, M = {_duration(mtbf_s)}\n"
            f"{layouts.value}: {writers:,} writer(s) at {writer.value:.3g} GB/s, storage {storage.value:,.0f} GB/s "
            f"({limit})"))
        picture.value = plots.figure_to_png(figure)

    controls = (size, ranks, reliability, writer, storage, restart, layouts)  # the storage matters when sharded
    connect(controls, redraw)
    return widgets.VBox([widgets.HBox([widgets.VBox(list(controls[:4])), widgets.VBox(list(controls[4:]))],
                                      layout=ROW), summary, picture])
