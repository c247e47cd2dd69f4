"""Lesson 12's plots and explorer: every rank's curves from TensorBoard's event files, the divergence alarm's
deviations against its band, the DataLoader's timeline and the stall against the number of workers.

The conventions are ``labkit.viz.plots``': ``matplotlib.figure.Figure`` rather than ``pyplot``, nothing run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import ipywidgets as widgets
from matplotlib.figure import Figure

from labkit import loader
from labkit.viz.plots import RANK_COLORS, figure_to_png
from labkit.viz.widgets import ROW, connect

TAG_LABELS = {"loss": "loss (nats)", "lr": "learning rate", "grad_norm": "gradient norm", "tokens_per_s": "tokens/s",
              "step_ms": "step time (ms)", "busy_ms": "own work (ms of CPU a step)", "data_wait_ms": "data wait (ms)",
              "comm_bytes": "bytes sent per step", "tflops": "model TFLOP/s", "peak_memory_bytes": "peak memory (bytes)",
              "memory_reserved_bytes": "memory reserved (bytes)", "mfu": "MFU"}


def plot_rank_scalars(runs: dict[str, dict[int, dict[str, list[tuple[int, float]]]]], tag: str = "loss",
                      alarms: dict[str, list[tuple[int, str]]] | None = None) -> Figure:
    """One panel per run (``{title: labkit.monitor.read_scalars(folder)}``): every rank's ``tag`` against the step,
    a line per rank as TensorBoard overlays them, and each alarm (``{title: [(step, label), ...]}``) as a dashed
    line at its step with its label."""
    figure = Figure(figsize=(4.0 * len(runs), 3.7))
    axes = figure.subplots(1, len(runs), sharey=True, squeeze=False)[0]
    for axis, (title, ranks) in zip(axes, runs.items(), strict=True):
        for rank, scalars in sorted(ranks.items()):
            steps, values = zip(*scalars[tag], strict=True)
            axis.plot(steps, values, color=RANK_COLORS[rank % len(RANK_COLORS)], linewidth=1.2, label=f"rank {rank}")
        for step, label in (alarms or {}).get(title, []):
            axis.axvline(step, color="#B00000", linestyle="--", linewidth=1)
            axis.text(step, 0.98, f" {label}", transform=axis.get_xaxis_transform(), color="#B00000", fontsize=8,
                      va="top", rotation=90)
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("step")
    axes[0].set_ylabel(TAG_LABELS.get(tag, tag))
    handles, labels = axes[0].get_legend_handles_labels()  # below the panels: no curve is hidden behind it
    figure.legend(handles, labels, fontsize=8, loc="lower center", ncols=len(labels), frameon=False)
    figure.tight_layout(rect=(0, 0.07, 1, 1))
    return figure


def plot_deviations(deviations: Sequence[Sequence[float]], ranks: Sequence[int], limit: float, window: int,
                    title: str) -> Figure:
    """Each rank's loss minus the other ranks' mean, check by check (thin), its mean over the last ``window``
    checks (thick), and the alarm's band ``+-limit`` (grey)."""
    figure = Figure(figsize=(10.5, 3.4))
    axis = figure.subplots()
    checks = range(1, len(deviations) + 1)
    for column, rank in enumerate(ranks):
        color = RANK_COLORS[rank % len(RANK_COLORS)]
        values = [row[column] for row in deviations]
        axis.plot(checks, values, color=color, linewidth=0.6, alpha=0.5)
        means = [sum(values[max(0, end - window): end]) / min(end, window) for end in checks]
        axis.plot(checks, means, color=color, linewidth=2, label=f"rank {rank}, mean of the last {window}")
    axis.axhspan(-limit, limit, color="0.85", zorder=0, label=f"band: +-{limit:.3f} nats")
    axis.axhline(0, color="0.4", linewidth=0.6)
    axis.set_xlabel("check (step)")
    axis.set_ylabel("loss - other ranks' mean (nats)")
    axis.set_title(title, fontsize=10)
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)  # beside: no line hidden
    figure.tight_layout()
    return figure


def plot_band_margins(margins: dict[str, float], title: str) -> Figure:
    """How close each run came to the loss alarm's band: ``{run: the largest |mean deviation| / limit over the checks
    it judged}``, one bar each on a log scale, the band's edge (1) drawn; a bar past it is an alarm."""
    figure = Figure(figsize=(8.5, 0.45 * len(margins) + 1.4))
    axis = figure.subplots()
    names = list(margins)
    values = [margins[name] for name in names]
    colors = ["#C44E52" if value > 1 else "#4C72B0" for value in values]
    axis.barh(range(len(names)), values, color=colors)
    for row, value in enumerate(values):
        axis.text(value * 1.08, row, f"{value:.2f}", va="center", fontsize=8)
    axis.axvline(1.0, color="#B00000", linestyle="--", linewidth=1)
    axis.text(1.0, len(names) - 0.4, " the band's edge: an alarm past it", color="#B00000", fontsize=8)
    axis.set_yticks(range(len(names)), names, fontsize=8)
    axis.invert_yaxis()
    axis.set_xscale("log")
    axis.set_xlim(min(values + [0.1]) / 1.5, max(values + [1.0]) * 2.5)
    axis.set_xlabel("largest |mean deviation over 16 checks| / the band's half-width (log scale)")
    axis.set_title(title, fontsize=10)
    figure.tight_layout()
    return figure


def plot_summary(summary: dict[str, dict[str, list[tuple[int, float]]]], tags: Sequence[str],
                 alarms: Sequence[tuple[int, str]] = (), title: str = "", from_step: int = 1) -> Figure:
    """Rank 0's summary of every rank (``labkit.monitor.read_scalars(folder, runs="summary")``): for each tag a panel
    with the band from the minimum to the maximum over the ranks, the mean and the maximum, from ``from_step`` on,
    and the alarms as dashed lines."""
    figure = Figure(figsize=(4.6 * len(tags), 3.4))
    axes = figure.subplots(1, len(tags), squeeze=False)[0]
    for axis, tag in zip(axes, tags, strict=True):
        kept = {name: [(step, value) for step, value in summary[name][tag] if step >= from_step]
                for name in ("min", "mean", "max")}
        steps = [step for step, _ in kept["mean"]]
        low, mean, high = ([value for _, value in kept[name]] for name in ("min", "mean", "max"))
        axis.fill_between(steps, low, high, color="#4C72B0", alpha=0.25, linewidth=0, label="min to max over the ranks")
        axis.plot(steps, mean, color="#4C72B0", linewidth=1.4, label="mean over the ranks")
        axis.plot(steps, high, color="#C44E52", linewidth=1, label="max over the ranks")
        for step, label in alarms:
            axis.axvline(step, color="#B00000", linestyle="--", linewidth=1)
            axis.text(step, 0.98, f" {label}", transform=axis.get_xaxis_transform(), color="#B00000", fontsize=8,
                      va="top", rotation=90)
        axis.set_xlabel("step")
        axis.set_ylabel(TAG_LABELS.get(tag, tag))
        axis.set_ylim(bottom=0)
    handles, labels = axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, fontsize=8, loc="lower center", ncols=3, frameon=False)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout(rect=(0, 0.07, 1, 1))
    return figure


def plot_loader_timeline(timeline: loader.LoaderTimeline, workers: int, t_compute: float, title: str) -> Figure:
    """The simulated DataLoader: a row per worker (each batch it makes, numbered) and the training loop's row
    (waiting for data in red, computing in blue), in milliseconds."""
    rows = max(workers, 1) + 1
    figure = Figure(figsize=(11, 0.55 * rows + 1.6))
    axis = figure.subplots()
    for batch, (worker, start, end) in enumerate(timeline.batches):
        row = rows - 1 if worker < 0 else worker + 1  # no workers: the loop makes the batch itself
        axis.broken_barh([(1e3 * start, 1e3 * (end - start))], (row - 0.4, 0.8), facecolors="#55A868",
                         edgecolors="black", linewidth=0.4)
        axis.text(1e3 * (start + end) / 2, row, str(batch), ha="center", va="center", fontsize=7)
    for start, wait, end in zip(timeline.step_starts, timeline.waits, timeline.step_ends, strict=True):
        if wait > 0 and workers:
            axis.broken_barh([(1e3 * start, 1e3 * wait)], (-0.4, 0.8), facecolors="#C44E52")
        axis.broken_barh([(1e3 * (end - t_compute), 1e3 * t_compute)], (-0.4, 0.8), facecolors="#4C72B0",
                         edgecolors="black", linewidth=0.4)
    labels = ["loop"] + [f"worker {worker}" for worker in range(workers)] + ([] if workers else ["loop (data)"])
    axis.set_yticks(range(len(labels)), labels)
    axis.set_ylim(-0.7, len(labels) - 0.3)
    axis.set_xlabel("time (ms)")
    axis.set_title(title + "  (green: a batch made; red: the loop waits; blue: the loop computes)", fontsize=9)
    figure.tight_layout()
    return figure


def plot_stall(workers: Sequence[int], measured_step: Sequence[float], measured_wait: Sequence[float],
               model_step: Sequence[float], cores_step: Sequence[float], cores: int, title: str) -> Figure:
    """Measured step time and data wait (ms) against the number of workers, beside the model without a core limit
    and with ``cores``."""
    figure = Figure(figsize=(9.5, 3.6))
    axis = figure.subplots()
    axis.plot(workers, [1e3 * value for value in measured_step], "o-", color="#4C72B0", label="measured step")
    axis.plot(workers, [1e3 * value for value in measured_wait], "o-", color="#C44E52", label="measured data wait")
    axis.plot(workers, [1e3 * value for value in model_step], "s--", color="0.5", label="model step, cores unlimited")
    axis.plot(workers, [1e3 * value for value in cores_step], "^--", color="#55A868",
              label=f"model step, {cores} cores")
    axis.set_xticks(list(workers))
    axis.set_xlabel("DataLoader workers")
    axis.set_ylabel("ms per step")
    axis.set_ylim(bottom=0)
    axis.set_title(title, fontsize=10)
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)  # beside: nothing hidden
    figure.tight_layout()
    return figure


def loader_picture(t_data: float, t_compute: float, workers: int, prefetch_factor: int, steps: int = 16
                   ) -> tuple[Figure, str]:
    """The loader explorer's picture and caption for these settings (seconds): the DataLoader's first ``steps``
    simulated (:func:`labkit.loader.simulate_loader`) and the steady-state stall of
    :func:`labkit.loader.stall_model`."""
    timeline = loader.simulate_loader(t_data, t_compute, workers, prefetch_factor, steps=steps)
    wait = loader.stall_model(t_data, t_compute, workers)
    need = math.ceil(t_data / t_compute) if t_compute else 0
    caption = (f"steady state: the loop waits {1e3 * wait:.1f} ms a step (max(0, t_data / W - t_compute)"
               f"{'; with no workers, all of t_data' if workers == 0 else ''}), a step every "
               f"{1e3 * (t_compute + wait):.1f} ms; {need} worker(s) hide the data entirely (with a core each); the "
               "first batch is always waited for in full.")
    figure = plot_loader_timeline(timeline, workers, t_compute,
                                  f"{workers} workers, prefetch_factor {prefetch_factor}: the first {steps} steps")
    return figure, caption


def loader_explorer(t_data_ms: float = 60.0, t_compute_ms: float = 20.0, workers: int = 2,
                    prefetch_factor: int = 2) -> widgets.VBox:
    """Choose the time to make a batch, the time to compute a step, the workers and the prefetch factor: the picture
    and caption of :func:`loader_picture`."""
    data_slider = widgets.IntSlider(value=t_data_ms, min=5, max=200, step=5, description="t_data (ms a batch)")
    compute_slider = widgets.IntSlider(value=t_compute_ms, min=5, max=200, step=5,
                                       description="t_compute (ms a step)")
    worker_slider = widgets.IntSlider(value=workers, min=0, max=8, description="workers W")
    prefetch_slider = widgets.IntSlider(value=prefetch_factor, min=1, max=4, description="prefetch_factor")
    picture, summary = widgets.Image(format="png"), widgets.HTML()

    def redraw() -> None:
        figure, caption = loader_picture(data_slider.value / 1e3, compute_slider.value / 1e3, worker_slider.value,
                                         prefetch_slider.value)
        summary.value = f"<small>{caption}</small>"
        picture.value = figure_to_png(figure)

    controls = (data_slider, compute_slider, worker_slider, prefetch_slider)
    connect(controls, redraw)
    return widgets.VBox([widgets.HBox([widgets.VBox(list(controls[:2])), widgets.VBox(list(controls[2:]))],
                                      layout=ROW), summary, picture])
