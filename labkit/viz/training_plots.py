"""Plots of lessons 03-05 (learning rates, mixed precision and memory, ZeRO): data in, ``Figure`` out.

The conventions are ``labkit.viz.plots``': ``matplotlib.figure.Figure`` rather than ``pyplot``, nothing run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from matplotlib import patches as matplotlib_patches
from matplotlib.figure import Figure

from labkit.viz.plots import RANK_COLORS, finish

# --------------------------------------------------------------------------------------------------------
# Lesson 03: learning rates and batch sizes


def plot_lr_schedules(schedules: dict[str, Sequence[float]], samples_per_step: dict[str, int] | None = None,
                      title: str = "Learning-rate schedules") -> Figure:
    """Learning rate against step (left) and against samples seen (right, when ``samples_per_step`` is
    given: a larger global batch takes fewer, bigger steps through the same data)."""
    figure = Figure(figsize=(11, 3.8))
    step_axis, sample_axis = figure.subplots(1, 2)
    for index, (label, values) in enumerate(schedules.items()):
        color = RANK_COLORS[index % len(RANK_COLORS)]
        step_axis.plot(range(1, len(values) + 1), values, color=color, label=label)
        if samples_per_step:
            per_step = samples_per_step[label]
            sample_axis.plot([per_step * step for step in range(len(values))], values, color=color, label=label)
    step_axis.set_xscale("log")
    step_axis.set_xlabel("optimizer step (log scale)")
    step_axis.set_ylabel("learning rate")
    step_axis.set_title(title)
    step_axis.legend(fontsize=8)
    sample_axis.set_xlabel("samples seen")
    sample_axis.set_ylabel("learning rate")
    sample_axis.set_title("the same schedules against samples seen")
    figure.tight_layout()
    return figure


def running_mean(values: Sequence[float], window: int) -> list[float]:
    """The running mean of ``values`` over the last ``window`` of them (fewer at the start)."""
    window = max(1, window)
    smoothed, total = [], 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        smoothed.append(total / min(index + 1, window))
    return smoothed


def plot_lr_experiment(results: dict[tuple[str, int], Sequence[float]], base_batch: int,
                       floor: float | None = None) -> Figure:
    """Training loss of the scaling experiment: one column per LR recipe, one line per batch multiple ``k``;
    top row against samples seen, bottom row against optimizer steps (moving average over ~1/20 of a run).
    The loss axis stops at 3.5 nats, so a diverging run leaves through the top of its panel."""
    recipes = list(dict.fromkeys(recipe for recipe, _ in results))
    multiples = sorted({k for _, k in results})
    figure = Figure(figsize=(4 * len(recipes), 7))
    axes = figure.subplots(2, len(recipes), squeeze=False)
    for column, recipe in enumerate(recipes):
        for index, k in enumerate(multiples):
            losses = results.get((recipe, k))
            if losses is None:
                continue
            smoothed = running_mean(losses, len(losses) // 20)
            color = RANK_COLORS[index % len(RANK_COLORS)]
            label = f"global batch {k * base_batch} ({k}x)"
            axes[0][column].plot([(step + 1) * k * base_batch for step in range(len(losses))], smoothed,
                                 color=color, label=label)
            axes[1][column].plot(range(1, len(losses) + 1), smoothed, color=color, label=label)
        for row, xlabel in enumerate(("samples seen", "optimizer step")):
            axis = axes[row][column]
            if floor is not None:
                axis.axhline(floor, color="black", linestyle=":", linewidth=1)
            axis.set_xlabel(xlabel)
            axis.set_ylabel("training loss (nats)")
            axis.set_ylim(0.0, max(3.5, (floor or 0.0) * 2))  # a diverging run leaves through the top
            if row == 1:
                axis.set_xscale("log")
            axis.set_title(recipe if row == 0 else f"{recipe}, against steps", fontsize=10)
        axes[0][column].legend(fontsize=7)
    figure.tight_layout()
    return figure


# --------------------------------------------------------------------------------------------------------
# Lesson 04: precision and memory

MEMORY_COLORS = {"weights": "#4C72B0", "gradients": "#55A868", "optimizer_states": "#DD8452",
                 "optimizer_other": "#937860", "activations": "#8172B3"}


def plot_gradient_magnitudes(gradients, thresholds: dict[str, float], title: str = "Gradient magnitudes") -> Figure:
    """Histogram of ``log2 |g|`` over a model's nonzero gradient values, with each format's smallest
    representable magnitude drawn as a vertical line: everything left of a line is rounded to zero there."""

    values = gradients[gradients != 0].abs().double().log2()
    figure = Figure(figsize=(8, 3.8))
    axis = figure.subplots()
    axis.hist(values.numpy(), bins=80, color="#4C72B0", alpha=0.8)
    for index, (label, threshold) in enumerate(thresholds.items()):
        axis.axvline(math.log2(threshold), color=RANK_COLORS[(index + 1) % len(RANK_COLORS)], linestyle="--",
                     label=f"{label}: 2^{math.log2(threshold):.0f}")
    finish(axis, "log2 |gradient value|", "number of values", title)
    return figure


def plot_memory_breakdown(measured: dict[str, dict[str, float]],
                          predicted: dict[str, dict[str, float]] | None = None,
                          capacity_bytes: float | None = None, unit: float = 2**20, unit_name: str = "MiB",
                          title: str = "Memory per category", highlight: str | None = None) -> Figure:
    """Stacked bars per labelled configuration (weights, gradients, optimizer states, activations...);
    the prediction, when given, is drawn as a black tick on top of each bar; ``capacity_bytes`` as a line.
    ``highlight`` names the configuration chosen: its bar is drawn solid, outlined and totalled, the others
    faded."""
    if highlight is not None and highlight not in measured:
        raise ValueError(f"highlight must be one of {list(measured)}, got {highlight!r}")
    figure = Figure(figsize=(max(6, 1.6 * len(measured) + 3), 4))
    axis = figure.subplots()
    labels = list(measured)
    categories = [c for c in MEMORY_COLORS if any(c in parts for parts in measured.values())]
    bottoms = [0.0] * len(labels)
    for category in categories:
        heights = [measured[label].get(category, 0.0) / unit for label in labels]
        bars = axis.bar(labels, heights, bottom=bottoms, color=MEMORY_COLORS[category],
                        label=category.replace("_", " "))
        for label, bar in zip(labels, bars, strict=True):
            bar.set_alpha(0.3 if highlight not in (None, label) else 1.0)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    if highlight is not None:
        index = labels.index(highlight)
        axis.bar([highlight], [bottoms[index]], fill=False, edgecolor="black", linewidth=2.5, label="chosen")
        axis.annotate(f"{bottoms[index]:,.1f} {unit_name}", (index, bottoms[index]), xytext=(0, 3),
                      textcoords="offset points", ha="center", va="bottom", fontsize=9, fontweight="bold")
        axis.set_xticks(range(len(labels)), labels)
        axis.get_xticklabels()[index].set_fontweight("bold")
    if predicted:
        for index, label in enumerate(labels):
            if label in predicted:
                total = sum(predicted[label].values()) / unit
                axis.plot([index - 0.4, index + 0.4], [total, total], color="black", linewidth=2,
                          label="model" if index == 0 else None)
    if capacity_bytes:
        axis.axhline(capacity_bytes / unit, color="tab:red", linestyle="--", label="device memory")
    axis.set_ylabel(f"memory ({unit_name})")
    axis.set_title(title)
    legend = axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    for handle in legend.legend_handles:
        handle.set_alpha(1.0)  # a category's colour, not the faded look of the bars not chosen
    figure.tight_layout()
    return figure


def plot_checkpointing(blocks_checkpointed: Sequence[int], activation_bytes: Sequence[float],
                       step_seconds: Sequence[float], title: str = "Activation checkpointing") -> Figure:
    """Activation memory (MiB) and step time (ms) against the number of blocks checkpointed."""
    figure = Figure(figsize=(10, 3.6))
    memory_axis, time_axis = figure.subplots(1, 2)
    memory_axis.plot(blocks_checkpointed, [b / 2**20 for b in activation_bytes], marker="o", color="#8172B3")
    memory_axis.set_xlabel("blocks checkpointed")
    memory_axis.set_ylabel("activations saved for backward (MiB)")
    memory_axis.set_xticks(list(blocks_checkpointed))
    time_axis.plot(blocks_checkpointed, [s * 1e3 for s in step_seconds], marker="o", color="#C44E52")
    time_axis.set_xlabel("blocks checkpointed")
    time_axis.set_ylabel("forward + backward (ms)")
    time_axis.set_xticks(list(blocks_checkpointed))
    figure.suptitle(title)
    figure.tight_layout()
    return figure


# --------------------------------------------------------------------------------------------------------
# Lesson 05: ZeRO


def plot_zero_stages(world_size: int = 4) -> Figure:
    """Who holds what under DP and ZeRO 1-3: one row per rank, one column per state (parameters, gradients,
    optimizer states), each split into ``world_size`` shards; a filled cell is held by that rank."""
    stages = {"DP": 0, "ZeRO-1": 1, "ZeRO-2": 2, "ZeRO-3": 3}
    states = [("parameters", "#4C72B0", 3), ("gradients", "#55A868", 2), ("optimizer states", "#DD8452", 1)]
    figure = Figure(figsize=(12, 0.8 + 0.42 * world_size))
    axes = figure.subplots(1, len(stages))
    for axis, (name, stage) in zip(axes, stages.items(), strict=True):
        for column, (_state, color, sharded_from) in enumerate(states):
            for rank in range(world_size):
                for shard in range(world_size):
                    held = stage < sharded_from or shard == rank
                    x = column * (world_size + 1) + shard
                    axis.add_patch(matplotlib_patches.Rectangle(
                        (x, world_size - 1 - rank), 0.9, 0.8, facecolor=color if held else "white",
                        edgecolor="black", linewidth=0.4))
        axis.set_xlim(-0.2, len(states) * (world_size + 1))
        axis.set_ylim(-0.2, world_size)
        axis.set_xticks([column * (world_size + 1) + world_size / 2 for column in range(len(states))],
                        [state for state, _, _ in states], fontsize=7)
        axis.set_yticks([world_size - 1 - rank + 0.4 for rank in range(world_size)],
                        [f"rank {rank}" for rank in range(world_size)], fontsize=8)
        axis.set_title(name)
        for side in ("top", "right", "bottom", "left"):
            axis.spines[side].set_visible(False)
    figure.tight_layout()
    return figure
