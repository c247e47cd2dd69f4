"""Plot functions for the course: each takes data and returns a matplotlib ``Figure``; none runs training.

Figures are made with ``matplotlib.figure.Figure`` rather than ``pyplot``, so nothing is registered with
pyplot's global state: a notebook shows the figure a cell returns (once), a widget renders it to an image, and
nothing leaks between calls.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

from matplotlib.figure import Figure

from labkit import costmodel

GIB = 1024**3


def plot_why_distributed(parameters: float, tokens: float, gpus: int, gpu: costmodel.GPU,
                         utilization: float) -> Figure:
    """Two panels: model-state memory per GPU (replicated vs sharded) and training days against GPU count."""
    figure = Figure(figsize=(11, 3.8))
    memory_axis, time_axis = figure.subplots(1, 2)
    state = costmodel.model_state_bytes(parameters)
    bars = {"one GPU holds\nall of it": state, f"sharded over\n{gpus} GPUs": state / gpus}
    colors = ["tab:red" if value > gpu.memory_bytes else "tab:green" for value in bars.values()]
    memory_axis.bar(list(bars), [value / 1e9 for value in bars.values()], color=colors)
    memory_axis.axhline(gpu.memory_bytes / 1e9, color="black", linestyle="--", label=f"{gpu.name} memory")
    memory_axis.set_ylabel("weights + grads + Adam state (GB)")
    memory_axis.set_title(f"{parameters / 1e9:.1f}B parameters x 16 bytes")
    memory_axis.legend(loc="upper right")
    counts = [2**k for k in range(0, 15)]
    days = [costmodel.training_time_seconds(parameters, tokens, n, gpu.peak_bf16_flops, utilization)
            / costmodel.SECONDS_PER_DAY for n in counts]
    time_axis.loglog(counts, days, marker=".", label="6ND / (GPUs x peak x MFU)")
    chosen = costmodel.training_time_seconds(parameters, tokens, gpus, gpu.peak_bf16_flops, utilization)
    time_axis.scatter([gpus], [chosen / costmodel.SECONDS_PER_DAY], color="tab:red", zorder=3,
                      label=f"{gpus} GPUs: {chosen / costmodel.SECONDS_PER_DAY:,.1f} days")
    time_axis.axhline(30, color="gray", linestyle=":", label="one month")
    time_axis.set_xlabel("number of GPUs")
    time_axis.set_ylabel("training time (days)")
    time_axis.set_title(f"{tokens / 1e9:,.0f}B tokens at {utilization:.0%} MFU on {gpu.name}")
    time_axis.legend(loc="upper right", fontsize=8)
    figure.tight_layout()
    return figure


def plot_speedup(ranks: Sequence[int], seconds: Sequence[float], cores: int,
                 title: str = "Splitting a fixed amount of work over ranks") -> Figure:
    """Measured speed-up (t1 / tN) against the ideal N, with the machine's core count marked."""
    figure = Figure(figsize=(6, 3.8))
    axis = figure.subplots()
    speedup = [seconds[0] / value for value in seconds]
    axis.plot(ranks, ranks, linestyle="--", color="gray", label="ideal: N ranks, N x faster")
    axis.plot(ranks, speedup, marker="o", label="measured here")
    axis.axvline(cores, color="tab:red", linestyle=":", label=f"{cores} CPU cores on this machine")
    axis.set_xlabel("ranks (processes)")
    axis.set_ylabel("speed-up over 1 rank (x)")
    axis.set_title(title)
    axis.legend()
    figure.tight_layout()
    return figure


def figure_to_png(figure: Figure, dpi: int = 90) -> bytes:
    """PNG bytes of a figure (for ipywidgets.Image, which redraws without notebook output churn)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()
