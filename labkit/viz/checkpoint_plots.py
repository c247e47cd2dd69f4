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
    """The lost share of wall-clock time (%) against the checkpoint interval (log scale; in minutes when Young's
    interval is under an hour, the unit the lesson's tables use, else in hours): writing
    ``C / tau``, lost work and restarts ``(tau / 2 + R) / M``, their sum, and the exact expectation for Poisson
    failures; Young's ``sqrt(2 C M)`` dotted; ``simulated`` (interval -> measured share) as markers;
    ``chosen_s`` as a dashed line."""
    optimum = model.young_interval(write_s, mtbf_s)
    grid = interval_grid(optimum)
    figure = Figure(figsize=(8, 4.2)) if ax is None else ax.figure
    axis = figure.subplots() if ax is None else ax
    unit, per = ("minutes", 60.0) if optimum < HOUR else ("hours", HOUR)
    hours = [tau / per for tau in grid]
    writing = [100 * write_s / tau for tau in grid]
    failing = [100 * (tau / 2 + restart_s) / mtbf_s for tau in grid]
    axis.plot(hours, writing, color="#4C72B0", linestyle="--", label="writing checkpoints, C / τ")
    axis.plot(hours, failing, color="#DD8452", linestyle="--", label="work lost to failures, (τ/2 + R) / M")
    axis.plot(hours, [a + b for a, b in zip(writing, failing, strict=True)], color="black",
              label="together (Young, first order)")
    axis.plot(hours, [100 * model.expected_lost_fraction(tau, write_s, mtbf_s, restart_s) for tau in grid],
              color="#8172B2", linestyle="-.", label="expected for Poisson failures (Daly, exact)")
    best = 100 * model.lost_fraction(optimum, write_s, mtbf_s, restart_s)
    exact = model.expected_lost_fraction(optimum, write_s, mtbf_s, restart_s)
    axis.axvline(optimum / per, color="gray", linestyle=":",
                 label=f"Young: τ* = √(2CM) = {_duration(optimum)}, {_percent(exact)} % lost (Daly)")
    if simulated:
        axis.plot([tau / per for tau in simulated], [100 * share for share in simulated.values()], "o",
                  color="#55A868", markersize=5, label="simulated failures (Poisson)")
    if chosen_s is not None:
        axis.axvline(chosen_s / per, color="#C44E52", linestyle="--", label=f"your interval: {_duration(chosen_s)}")
    axis.set_xscale("log")
    axis.set_ylim(0, min(100.0, 3 * best + 1))
    plots.finish(axis, f"checkpoint interval τ ({unit} of training, log scale)", "wall-clock time lost (%)", title)
    return figure


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 2 * HOUR:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / HOUR:.3g} h"


SLIDER_ROOM = "260px"  # a slider's width beyond its description: the track and the readout, never squeezed


def _percent(share: float) -> str:
    return "over 100" if share > 1 else f"{100 * share:.3g}"  # a first-order sum can pass 100 %


def checkpoint_explorer(parameters_b: float = 405.0, gpus: int = model.LLAMA3_GPUS,
                        gpu_years_per_failure: float = round(model.LLAMA3_GPU_YEARS_PER_FAILURE, 2),
                        layout: str = "sharded", writer_gb_s: float = 2.0,
                        storage_gb_s: float = model.LLAMA3_STORAGE_BYTES_S / 1e9,
                        restart_min: float = 10.0) -> widgets.VBox:
    """Checkpointing a large run (lesson 09): model size, GPUs (a power of two), the failure rate in GPU-years
    per failure (the job's rate of unexpected interruptions spread over its GPUs: not one GPU's lifetime), one
    writer's and the storage's bandwidth, restart time, layout -> the checkpoint's size and write time, the job's
    MTBF, Young's interval and the lost share of time against the interval.  The defaults are Llama 3 405B's
    scale: 16,384 GPUs with one unexpected interruption every 3.1 hours (419 in 54 days: 5.78 GPU-years per
    failure) and storage that sustains 2 TB/s (Dubey et al. 2024, sections 3.3.4 and 3.3.1); the 10-minute
    restart is an assumption.  A full checkpoint larger than one host's memory is flagged: rank 0 cannot gather
    it."""
    size = widgets.FloatLogSlider(value=parameters_b, base=10, min=-1, max=3.3, step=0.05,
                                  description="parameters (billions)")
    counts = [2 ** k for k in range(3, 17)]
    ranks = widgets.SelectionSlider(options=[(f"{count:,}", count) for count in counts],
                                    value=min(counts, key=lambda count: abs(math.log2(count / gpus))),
                                    description="GPUs")
    reliability = widgets.FloatSlider(value=gpu_years_per_failure, min=0.5, max=20.0, step=0.01,
                                      description="GPU-years per failure")
    layouts = widgets.Dropdown(options=list(model.LAYOUTS), value=layout, description="layout")
    writer = widgets.FloatLogSlider(value=writer_gb_s, base=10, min=-1, max=1.5, step=0.05,
                                    description="one writer (GB/s)")
    storage = widgets.FloatLogSlider(value=storage_gb_s, base=10, min=1, max=4, step=0.05,
                                     description="storage in all (GB/s)")
    restart = widgets.FloatSlider(value=restart_min, min=0.0, max=60.0, step=1.0, description="restart R (min)")
    picture = widgets.Image(format="png")
    summary = widgets.HTML()

    def redraw() -> None:
        count = ranks.value
        size_bytes = model.checkpoint_bytes(size.value * 1e9)
        write_s = model.write_seconds(size_bytes, writer.value * 1e9, layouts.value, count, storage.value * 1e9)
        mtbf_s = reliability.value * 365.25 * 24 * HOUR / count
        restart_s = restart.value * 60
        optimum = model.young_interval(write_s, mtbf_s)
        first_order = model.lost_fraction(optimum, write_s, mtbf_s, restart_s)
        lost = model.expected_lost_fraction(optimum, write_s, mtbf_s, restart_s)
        summary.value = (f"<small>{size_bytes / 1e9:,.0f} GB per checkpoint (12 bytes per parameter: fp32 weights "
                         f"and Adam's two moments), written in {_duration(write_s)} ({layouts.value}, "
                         f"{count:,} GPUs); the job fails every {_duration(mtbf_s)} on average; checkpoint every "
                         f"{_duration(optimum)} (Young) and lose {_percent(lost)} % of the time (Daly's exact "
                         f"expectation; Young's first order says {_percent(first_order)} %)."
                         + (" Failures come too often for checkpoints this slow: write faster (sharded, more "
                            "storage) or fail less." if lost > 0.5 else "") + "</small>")
        unfit = layouts.value == "full" and size_bytes > model.HOST_MEMORY_BYTES
        if unfit:  # the full layout gathers every byte into rank 0's host before it writes
            summary.value += (f"<br><b style='color:#C44E52'>Impossible as set: the full layout gathers "
                              f"{size_bytes / 1e12:.3g} TB into rank 0's host, which holds "
                              f"{model.HOST_MEMORY_BYTES / 1e12:.0f} TB (a DGX H100): write sharded.</b>")
        writers = count if layouts.value == "sharded" else 1
        limit = "the storage's limit" if writers * writer.value > storage.value else "the writers' limit"
        figure = plot_checkpoint_interval(write_s, mtbf_s, restart_s, title=(
            f"{size.value:.3g}B parameters on {count:,} GPUs: C = {_duration(write_s)}, M = {_duration(mtbf_s)}\n"
            f"{layouts.value}: {writers:,} writer(s) at {writer.value:.3g} GB/s, storage {storage.value:,.0f} GB/s "
            f"({limit})" + ("\nIMPOSSIBLE: the full layout cannot gather this into one host: write sharded"
                            if unfit else "")))
        picture.value = plots.figure_to_png(figure)

    controls = (size, ranks, reliability, writer, storage, restart, layouts)  # the storage matters when sharded
    connect(controls, redraw)
    for control in controls[:-1]:  # the sliders: as wide as their description and a track of their own
        control.layout.width = f"calc({control.style.description_width} + {SLIDER_ROOM})"
    return widgets.VBox([widgets.HBox([widgets.VBox(list(controls[:4])), widgets.VBox(list(controls[4:]))],
                                      layout=ROW), summary, picture])
