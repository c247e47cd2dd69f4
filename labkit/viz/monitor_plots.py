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
              "step_ms": "step time (ms)", "data_wait_ms": "data wait (ms)", "comm_bytes": "bytes sent per step",
              "peak_memory_bytes": "peak memory (bytes)"}


def plot_rank_scalars(runs: dict[str, dict[int, dict[str, list[tuple[int, float]]]]], tag: str = "loss",
                      alarms: dict[str, list[tuple[int, str]]] | None = None) -> Figure:
    """One panel per run (``{title: labkit.monitor.read_scalars(folder)}``): every rank's ``tag`` against the step,
    a line per rank as TensorBoard overlays them, and each alarm (``{title: [(step, label), ...]}``) as a dashed
    line at its step with its label."""
    figure = Figure(figsize=(4.0 * len(runs), 3.4))
    axes = figure.subplots(1, len(runs), sharey=True, squeeze=False)[0]
    for axis, (title, ranks) in zip(axes, runs.items(), strict=True):
        for rank, scalars in sorted(ranks.items()):
            steps, values = zip(*scalars[tag], strict=True)
            axis.plot(steps, values, color=RANK_COLORS[rank % len(RANK_COLORS)], linewidth=1.2, label=f"rank {rank}")
        for step, label in (alarms or {}).get(title, []):
            axis.axvline(step, color="#B00000", linestyle="--", linewidth=1)
            axis.text(step, 0.97, f" {label}", transform=axis.get_xaxis_transform(), color="#B00000", fontsize=8,
                      va="top")
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("step")
    axes[0].set_ylabel(TAG_LABELS.get(tag, tag))
    axes[-1].legend(fontsize=8, loc="upper right")
    figure.tight_layout()
    return figure


def plot_deviations(deviations: Sequence[Sequence[float]], ranks: Sequence[int], limit: float, window: int,
                    title: str) -> Figure:
    """Each rank's loss minus the other ranks' mean, check by check (thin), its mean over the last ``window``
    checks (thick), and the alarm's band ``+-limit`` (grey)."""
    figure = Figure(figsize=(8.5, 3.4))
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
    axis.legend(fontsize=7, loc="upper left", ncols=2)
    figure.tight_layout()
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
    figure = Figure(figsize=(7.5, 3.6))
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
    axis.legend(fontsize=8)
    figure.tight_layout()
    return figure


def loader_explorer(t_data_ms: float = 60.0, t_compute_ms: float = 20.0, workers: int = 2,
                    prefetch_factor: int = 2) -> widgets.VBox:
    """Choose the time to make a batch, the time to compute a step, the workers and the prefetch factor: the
    DataLoader's first steps simulated (:func:`labkit.loader.simulate_loader`) and the steady-state stall of
    :func:`labkit.loader.stall_model`."""
    data_slider = widgets.IntSlider(value=t_data_ms, min=5, max=200, step=5, description="t_data (ms a batch)")
    compute_slider = widgets.IntSlider(value=t_compute_ms, min=5, max=200, step=5,
                                       description="t_compute (ms a step)")
    worker_slider = widgets.IntSlider(value=workers, min=0, max=8, description="workers W")
    prefetch_slider = widgets.IntSlider(value=prefetch_factor, min=1, max=4, description="prefetch_factor")
    picture, summary = widgets.Image(format="png"), widgets.HTML()

    def redraw() -> None:
        t_data, t_compute = data_slider.value / 1e3, compute_slider.value / 1e3
        count, prefetch = worker_slider.value, prefetch_slider.value
        steps = 16
        timeline = loader.simulate_loader(t_data, t_compute, count, prefetch, steps=steps)
        wait = loader.stall_model(t_data, t_compute, count)
        need = math.ceil(t_data / t_compute) if t_compute else 0
        summary.value = (f"<small>steady state: the loop waits <b>{1e3 * wait:.1f} ms</b> a step "
                         f"(max(0, t_data / W - t_compute){' ; with no workers, all of t_data' if count == 0 else ''}), "
                         f"a step every {1e3 * (t_compute + wait):.1f} ms; {need} worker(s) hide the data entirely "
                         f"(with a core each); the first batch is always waited for in full.</small>")
        picture.value = figure_to_png(plot_loader_timeline(
            timeline, count, t_compute, f"{count} workers, prefetch_factor {prefetch}: the first {steps} steps"))

    controls = (data_slider, compute_slider, worker_slider, prefetch_slider)
    connect(controls, redraw)
    return widgets.VBox([widgets.HBox([widgets.VBox(list(controls[:2])), widgets.VBox(list(controls[2:]))],
                                      layout=ROW), summary, picture])
