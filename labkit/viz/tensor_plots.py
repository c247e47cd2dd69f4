"""Plots of lesson 06 (tensor and sequence parallelism): data in, ``Figure`` out.

The conventions are ``labkit.viz.plots``': ``matplotlib.figure.Figure`` rather than ``pyplot``, nothing run.
Matrices are drawn as the Megatron-LM paper writes them (Shoeybi et al. 2019, ``Y = GeLU(X A)``, ``Z = Y B``,
``A`` of shape ``[h, 4h]``): ``nn.Linear`` stores the transpose, so a *column*-parallel layer holds rows of its
``.weight`` and a *row*-parallel layer columns of it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from matplotlib import patches as matplotlib_patches
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

from labkit.viz.plots import RANK_COLORS

KIND_COLORS = {"all_reduce": "#DD8452", "all_gather": "#4C72B0", "reduce_scatter": "#55A868"}
WHOLE = "#D9D9D9"  # what every rank holds whole


def _box(axis, x: float, y: float, text: str, color: str = "white", width: float = 1.5,
         height: float = 0.62, fontsize: int = 8) -> None:
    """A labelled box centred on ``(x, y)``."""
    axis.add_patch(matplotlib_patches.FancyBboxPatch((x - width / 2, y - height / 2), width, height,
                                                     boxstyle="round,pad=0.02", facecolor=color,
                                                     edgecolor="black", linewidth=0.7))
    axis.text(x, y, text, ha="center", va="center", fontsize=fontsize)


def _arrow(axis, start: tuple[float, float], end: tuple[float, float]) -> None:
    axis.annotate("", xy=end, xytext=start, arrowprops={"arrowstyle": "->", "color": "black", "linewidth": 0.8})


def _bare(axis) -> None:
    axis.set_xticks([])
    axis.set_yticks([])
    for side in ("top", "right", "bottom", "left"):
        axis.spines[side].set_visible(False)


def _split_matrix(axis, tp_degree: int, by_columns: bool, name: str, width: float, height: float) -> None:
    """A ``height x width`` matrix cut into ``tp_degree`` strips (side by side or stacked), one colour per rank."""
    for rank in range(tp_degree):
        if by_columns:
            x, y, w, h = rank * width / tp_degree, 0.0, width / tp_degree, height
        else:
            x, y, w, h = 0.0, height - (rank + 1) * height / tp_degree, width, height / tp_degree
        axis.add_patch(matplotlib_patches.Rectangle((x, y), w, h, facecolor=RANK_COLORS[rank % len(RANK_COLORS)],
                                                    alpha=0.75, edgecolor="black", linewidth=0.8))
        axis.text(x + w / 2, y + h / 2, f"{name}$_{rank}$\nrank {rank}", ha="center", va="center", fontsize=8)
    axis.set_xlim(-0.1, width + 0.1)
    axis.set_ylim(-0.1, height + 0.1)
    axis.set_aspect("equal")
    axis.set_xticks([])
    axis.set_yticks([])


def plot_tensor_parallel_split(tp_degree: int = 2) -> Figure:
    """Megatron's MLP over ``tp_degree`` ranks: where ``A`` (``[h, 4h]``) is cut by columns and ``B``
    (``[4h, h]``) by rows, and what each rank computes between ``f`` and ``g``::

        X -> f -> X A_r -> GeLU -> Y_r B_r -> g -> Z = sum_r Y_r B_r
    """
    if isinstance(tp_degree, bool) or not isinstance(tp_degree, int) or not 1 <= tp_degree <= len(RANK_COLORS):
        raise ValueError(f"tp_degree must be an integer in 1..{len(RANK_COLORS)}, got {tp_degree!r}")
    t = tp_degree
    figure = Figure(figsize=(12, 3.6 + 0.55 * t))
    axes = figure.subplot_mosaic([["column", "row"], ["flow", "flow"]], height_ratios=[1.0, 0.55 + 0.3 * t])
    _split_matrix(axes["column"], t, True, "A", width=8.0, height=2.0)
    axes["column"].set_xlabel(f"4h output features: {t} blocks of 4h/{t}")
    axes["column"].set_ylabel("h input features\n(whole on every rank)")
    axes["column"].set_title("column-parallel A [h, 4h]: rank r holds columns r·4h/t … (r+1)·4h/t\n"
                             "(nn.Linear stores Aᵀ: rows of .weight, and the same slice of the bias)", fontsize=9)
    _split_matrix(axes["row"], t, False, "B", width=2.0, height=4.0)
    axes["row"].set_xlabel("h output features (whole)")
    axes["row"].set_ylabel(f"4h input features:\n{t} blocks of 4h/{t}")
    axes["row"].set_title("row-parallel B [4h, h]: rank r holds rows r·4h/t … (r+1)·4h/t\n"
                          "(columns of .weight; the bias whole, added once after g)", fontsize=9)

    flow = axes["flow"]
    columns = {"X": 0.0, "f": 1.7, "XA": 3.5, "gelu": 5.4, "YB": 7.3, "g": 9.2, "Z": 11.0}
    top = t - 1
    for rank in range(t):
        y, color = top - rank, RANK_COLORS[rank % len(RANK_COLORS)]
        _box(flow, columns["X"], y, f"X  [bs, h]\n(rank {rank}: whole)", WHOLE)
        _box(flow, columns["XA"], y, f"X A$_{rank}$\n[bs, 4h/{t}]", color)
        _box(flow, columns["gelu"], y, f"Y$_{rank}$ = GeLU(X A$_{rank}$)\n[bs, 4h/{t}]", color, width=1.7)
        _box(flow, columns["YB"], y, f"Y$_{rank}$ B$_{rank}$  [bs, h]\npartial sum", color)
        _box(flow, columns["Z"], y, "Z = Σ$_r$ Y$_r$ B$_r$\n[bs, h] (whole)", WHOLE, width=1.6)
        for left, right, width_left, width_right in (("X", "f", 1.5, 0.9), ("f", "XA", 0.9, 1.5),
                                                     ("XA", "gelu", 1.5, 1.7), ("gelu", "YB", 1.7, 1.5),
                                                     ("YB", "g", 1.5, 0.9), ("g", "Z", 0.9, 1.6)):
            _arrow(flow, (columns[left] + width_left / 2, y), (columns[right] - width_right / 2, y))
    span = t - 1 + 0.62
    for name, text in (("f", "f\nforward:\nidentity\n\nbackward:\nall-reduce"),
                       ("g", "g\nforward:\nall-reduce\n\nbackward:\nidentity")):
        _box(flow, columns[name], top / 2, text, "#FFF2CC", width=0.9, height=max(span, 1.6), fontsize=7)
    flow.text(columns["gelu"], top + 0.55, "no communication between f and g: GeLU acts on each rank's own columns",
              ha="center", va="bottom", fontsize=8, style="italic")
    flow.set_xlim(-0.9, 12.0)
    flow.set_ylim(min(-0.5, top / 2 - 0.85), top + 0.85)
    _bare(flow)
    flow.set_title(f"the MLP on {t} ranks: one all-reduce forward (g), one backward (f), of b·s·h values each",
                   fontsize=10)
    figure.tight_layout()
    return figure


def plot_communication_bytes(measured: dict[str, dict[str, float]],
                             predicted: dict[str, dict[str, float]] | None = None, unit: float = 2**20,
                             unit_name: str = "MiB",
                             title: str = "Bytes per rank per step, by collective") -> Figure:
    """Bars of the bytes each labelled configuration sent per collective kind (``{"all_reduce": bytes, ...}``,
    as ``communication_per_step()`` counts them), the model's bytes as a black tick on each bar."""
    kinds = [kind for kind in KIND_COLORS if any(kind in parts for parts in measured.values())]
    figure = Figure(figsize=(max(6.0, 1.5 * len(measured) + 3.0), 4.0))
    axis = figure.subplots()
    width = 0.8 / max(1, len(kinds))
    tick_labelled = False
    for index, kind in enumerate(kinds):
        positions = [column + (index - (len(kinds) - 1) / 2) * width for column in range(len(measured))]
        heights = [parts.get(kind, 0) / unit for parts in measured.values()]
        axis.bar(positions, heights, width=width * 0.95, color=KIND_COLORS[kind], label=kind.replace("_", "-"))
        for position, label in zip(positions, measured, strict=True):
            if predicted and label in predicted and kind in predicted[label]:
                value = predicted[label][kind] / unit
                axis.plot([position - width / 2, position + width / 2], [value, value], color="black", linewidth=2,
                          label=None if tick_labelled else "model")
                tick_labelled = True
    axis.set_xticks(range(len(measured)), list(measured))
    axis.set_ylabel(f"sent per rank per step ({unit_name})")
    axis.set_title(title)
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    return figure


def plot_tensor_parallel_run(degrees: Sequence[int], measured_bytes: dict[str, Sequence[float]],
                             predicted_bytes: dict[str, Sequence[float]] | None = None,
                             step_seconds: Sequence[float] | None = None,
                             predicted_step_seconds: Sequence[float] | None = None, unit: float = 2**20,
                             unit_name: str = "MiB", title: str = "Tensor parallelism, measured") -> Figure:
    """Memory per rank against the tensor-parallel degree, one line per category (measured: solid with dots;
    the model: dashed, the same colour); beside it, when given, the step time (ms) measured and modelled."""
    panels = 2 if step_seconds is not None else 1
    figure = Figure(figsize=(5.5 * panels + 1.0, 3.8))
    axes = figure.subplots(1, panels, squeeze=False)[0]
    memory_axis = axes[0]
    for index, (label, values) in enumerate(measured_bytes.items()):
        color = RANK_COLORS[index % len(RANK_COLORS)]
        memory_axis.plot(degrees, [value / unit for value in values], marker="o", color=color,
                         label=f"{label}, measured")
        if predicted_bytes and label in predicted_bytes:
            memory_axis.plot(degrees, [value / unit for value in predicted_bytes[label]], linestyle="--",
                             color=color, label=f"{label}, model")
    memory_axis.set_xticks(list(degrees))
    memory_axis.set_xlabel("tensor-parallel degree t (ranks)")
    memory_axis.set_ylabel(f"per rank ({unit_name})")
    memory_axis.set_title("memory per rank")
    memory_axis.legend(fontsize=7)
    if step_seconds is not None:
        time_axis = axes[1]
        time_axis.plot(degrees, [value * 1e3 for value in step_seconds], marker="o", color="#C44E52",
                       label="measured")
        if predicted_step_seconds is not None:
            time_axis.plot(degrees, [value * 1e3 for value in predicted_step_seconds], linestyle="--",
                           color="#C44E52", label="model")
        time_axis.set_xticks(list(degrees))
        time_axis.set_ylim(bottom=0)
        time_axis.set_xlabel("tensor-parallel degree t (ranks)")
        time_axis.set_ylabel("time per step (ms)")
        time_axis.set_title("training step")
        time_axis.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    return figure


def plot_layer_time(degrees: Sequence[int], compute_s: Sequence[float], communication_s: dict[str, Sequence[float]],
                    chosen_degree: int, chosen_link: str, node_size: int | None = 8,
                    title: str = "One layer's forward and backward pass on one rank") -> Figure:
    """Left: per-layer compute time and each link's communication time against the tensor-parallel degree
    (log-log), the chosen link drawn thick, ``node_size`` (the GPUs of one node) marked.  Right: at
    ``chosen_degree``, compute beside communication for each link, with the share spent communicating."""
    if chosen_link not in communication_s:
        raise ValueError(f"chosen_link must be one of {list(communication_s)}, got {chosen_link!r}")
    if chosen_degree not in degrees:
        raise ValueError(f"chosen_degree={chosen_degree} is not among the degrees drawn")
    figure = Figure(figsize=(12, 4.8))
    curve_axis, bar_axis = figure.subplots(1, 2, width_ratios=[1.3, 1.0])
    curve_axis.loglog(degrees, [value * 1e3 for value in compute_s], color="black", label="compute / t (at peak)")
    for index, (label, values) in enumerate(communication_s.items()):
        chosen = label == chosen_link
        shown = [(t, value * 1e3) for t, value in zip(degrees, values, strict=True) if value > 0]
        curve_axis.loglog([t for t, _ in shown], [value for _, value in shown],
                          color=KIND_COLORS["all_reduce"] if chosen else RANK_COLORS[(index + 4) % len(RANK_COLORS)],
                          linewidth=2.5 if chosen else 1.2, linestyle="-" if chosen else "--",
                          label=f"communication: {label}")
    position = list(degrees).index(chosen_degree)
    curve_axis.scatter([chosen_degree], [compute_s[position] * 1e3], color="black", zorder=3)
    if communication_s[chosen_link][position] > 0:
        curve_axis.scatter([chosen_degree], [communication_s[chosen_link][position] * 1e3],
                           color=KIND_COLORS["all_reduce"], zorder=3, label=f"t = {chosen_degree}")
    if node_size is not None and node_size <= max(degrees):  # the node's edge, where the degrees reach it
        curve_axis.axvline(node_size, color="gray", linestyle=":", label=f"one node: {node_size} GPUs")
    ticks = [t for t in (1, 2, 4, 8, 16, 32, 64, 128, 256) if min(degrees) <= t <= max(degrees)]
    curve_axis.set_xticks(ticks, [str(t) for t in ticks])
    curve_axis.minorticks_off()
    # The time axis: labelled numbers at 1, 2 and 5 per decade when the curves span few decades (a single
    # "10^2" otherwise), fewer as the span grows, so that the labels never crowd.
    drawn = [value * 1e3 for value in compute_s] + [value * 1e3 for values in communication_s.values()
                                                     for value in values if value > 0]
    decades = math.log10(max(drawn) / min(drawn)) if drawn and min(drawn) > 0 else 0.0
    subs = (1.0, 2.0, 5.0) if decades <= 2.5 else (1.0, 3.0) if decades <= 4 else (1.0,)
    curve_axis.yaxis.set_major_locator(LogLocator(base=10, subs=subs))
    curve_axis.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    curve_axis.yaxis.set_minor_locator(NullLocator())
    curve_axis.set_xlabel("tensor-parallel degree t (GPUs)")
    curve_axis.set_ylabel("time per layer (ms)")
    curve_axis.set_title(title, fontsize=10)
    curve_axis.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=2)
    labels = list(communication_s)
    for row, label in enumerate(labels):
        compute_ms = compute_s[position] * 1e3
        communication_ms = communication_s[label][position] * 1e3
        bar_axis.barh(row, compute_ms, color="#4C72B0", label="compute" if row == 0 else None)
        bar_axis.barh(row, communication_ms, left=compute_ms, color=KIND_COLORS["all_reduce"],
                      alpha=1.0 if label == chosen_link else 0.5, label="communication" if row == 0 else None)
        share = communication_ms / (compute_ms + communication_ms) if compute_ms + communication_ms else 0.0
        bar_axis.text(compute_ms + communication_ms, row, f" {share:.0%} communicating", va="center", fontsize=8,
                      fontweight="bold" if label == chosen_link else "normal")
    bar_axis.set_yticks(range(len(labels)), [label.split(",")[0].replace(" (", "\n(") for label in labels],
                        fontsize=8)
    bar_axis.invert_yaxis()
    right = max(compute_s[position] + communication_s[label][position] for label in labels) * 1e3
    bar_axis.set_xlim(0, 1.6 * right if right else 1.0)  # room for the share written after each bar
    bar_axis.set_xlabel("time per layer (ms)")
    bar_axis.set_title(f"at t = {chosen_degree}, none of it overlapped", fontsize=10)
    bar_axis.legend(fontsize=8, loc="lower right")
    figure.tight_layout()
    return figure
