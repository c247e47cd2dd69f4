"""Plot functions for the course: each takes data and returns a matplotlib ``Figure``; none runs training.

Figures are made with ``matplotlib.figure.Figure`` rather than ``pyplot``, so nothing is registered with
pyplot's global state: a notebook shows the figure a cell returns (once), a widget renders it to an image, and
nothing leaks between calls.
"""

from __future__ import annotations

import io
import textwrap
from collections.abc import Sequence

from matplotlib import patches as matplotlib_patches
from matplotlib.figure import Figure

from labkit.costmodel import compute

GIB = 1024**3


def plot_why_distributed(parameters: float, tokens: float, gpus: int, gpu: compute.GPU,
                         utilization: float) -> Figure:
    """Two panels: model-state memory per GPU (replicated vs sharded) and training days against GPU count."""
    figure = Figure(figsize=(11, 3.8))
    memory_axis, time_axis = figure.subplots(1, 2)
    state = compute.model_state_bytes(parameters)
    bars = {"one GPU holds\nall of it": state, f"sharded over\n{gpus} GPUs": state / gpus}
    colors = ["tab:red" if value > gpu.memory_bytes else "tab:green" for value in bars.values()]
    memory_axis.bar(list(bars), [value / 1e9 for value in bars.values()], color=colors)
    memory_axis.axhline(gpu.memory_bytes / 1e9, color="black", linestyle="--", label=f"{gpu.name} memory")
    memory_axis.set_ylabel("weights + grads + Adam state (GB)")
    memory_axis.set_title(f"{parameters / 1e9:.1f}B parameters x 16 bytes")
    memory_axis.set_ylim(0, 1.3 * max(*bars.values(), gpu.memory_bytes) / 1e9)  # room for the legend
    memory_axis.legend(loc="upper right")
    counts = [2**k for k in range(0, 15)]
    days = [compute.training_time_seconds(parameters, tokens, n, gpu.peak_bf16_flops, utilization)
            / compute.SECONDS_PER_DAY for n in counts]
    time_axis.loglog(counts, days, marker=".", label="6ND / (GPUs x peak x MFU)")
    chosen = compute.training_time_seconds(parameters, tokens, gpus, gpu.peak_bf16_flops, utilization)
    time_axis.scatter([gpus], [chosen / compute.SECONDS_PER_DAY], color="tab:red", zorder=3,
                      label=f"{gpus} GPUs: {chosen / compute.SECONDS_PER_DAY:,.1f} days")
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


def error_panels(axes: dict, error: object, main: str, other: str, other_text: str) -> None:
    """An explorer's answer to impossible controls: the library's ``ValueError`` in panel ``main`` (red, wrapped)
    and ``other_text`` in panel ``other`` (grey), both without ticks."""
    for name, text, width, color in ((main, f"ValueError: {error}", 110, "#B00000"), (other, other_text, 40, "gray")):
        axes[name].text(0.5, 0.5, textwrap.fill(text, width), ha="center", va="center", fontsize=9, color=color,
                        transform=axes[name].transAxes)
        axes[name].set_xticks([])
        axes[name].set_yticks([])


# --------------------------------------------------------------------------------------------------------
# Lesson 01: collectives

RANK_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]


def cell(axis, x: float, y: float, text: str, color: str, alpha: float = 1.0) -> None:
    axis.add_patch(matplotlib_patches.Rectangle((x, y), 0.92, 0.8, facecolor=color, alpha=alpha,
                                                edgecolor="black", linewidth=0.6))
    axis.text(x + 0.46, y + 0.4, text, ha="center", va="center", fontsize=8)


def plot_collective_states(world_size: int = 4) -> Figure:
    """Who holds what before and after all-reduce, reduce-scatter, all-gather and broadcast.

    Rows are ranks, columns are the ``world_size`` chunks of one tensor.  ``a2`` is chunk ``a`` of rank 2's
    input; ``Σa`` is chunk ``a`` summed over every rank; an empty cell holds nothing useful.
    """
    letters = "abcdefgh"[:world_size]
    summed = "#B0B0B0"
    layouts = {
        "all-reduce": (lambda r, c: (f"{letters[c]}{r}", RANK_COLORS[r]),
                       lambda r, c: (f"Σ{letters[c]}", summed)),
        "reduce-scatter": (lambda r, c: (f"{letters[c]}{r}", RANK_COLORS[r]),
                           lambda r, c: (f"Σ{letters[c]}", summed) if r == c else ("", "white")),
        "all-gather": (lambda r, c: (f"{letters[c]}{r}", RANK_COLORS[r]) if r == c else ("", "white"),
                       lambda r, c: (f"{letters[c]}{c}", RANK_COLORS[c])),
        "broadcast (from rank 0)": (lambda r, c: (f"{letters[c]}0", RANK_COLORS[0]) if r == 0 else ("", "white"),
                                    lambda r, c: (f"{letters[c]}0", RANK_COLORS[0])),
    }
    figure = Figure(figsize=(10, 1.0 + 0.45 * world_size * len(layouts)))
    axes = figure.subplots(len(layouts), 2)
    for row, (name, (before, after)) in enumerate(layouts.items()):
        for column, (label, layout) in enumerate((("before", before), ("after", after))):
            axis = axes[row][column]
            for rank in range(world_size):
                for chunk in range(world_size):
                    text, color = layout(rank, chunk)
                    cell(axis, chunk, world_size - 1 - rank, text, color, 0.75 if color != "white" else 1.0)
            axis.set_xlim(-0.1, world_size)
            axis.set_ylim(-0.1, world_size)
            axis.set_yticks([world_size - 1 - rank + 0.4 for rank in range(world_size)],
                            [f"rank {rank}" for rank in range(world_size)], fontsize=8)
            axis.set_xticks([])
            axis.set_title(f"{name}: {label}", fontsize=9)
            for side in ("top", "right", "bottom", "left"):
                axis.spines[side].set_visible(False)
    figure.tight_layout()
    return figure


def ring_states(records: Sequence[dict], world_size: int) -> tuple[list[dict], list[list[dict]]]:
    """Replay recorded sends of a ring all-reduce: the state of every rank's chunks after each step.

    Returns ``(states, sends)``: ``states[t][(rank, chunk, segment)]`` is the set of ranks whose data that piece
    of that rank's buffer contains after ``t`` steps, and ``sends[t]`` the records sent during step ``t``.  Steps
    count reduce-scatter steps first, then all-gather steps.  In reduce-scatter the receiver *adds* what it gets;
    in all-gather it *overwrites*.
    """
    ring_records = [r for r in records if r["phase"] in ("reduce-scatter", "all-gather")]
    offset = world_size - 1
    steps = 2 * (world_size - 1)
    sends: list[list[dict]] = [[] for _ in range(steps)]
    pieces = set()
    for record in ring_records:
        global_step = record["step"] + (offset if record["phase"] == "all-gather" else 0)
        sends[global_step].append(record)
        pieces.add((record["chunk"], record.get("segment", 0)))
    state = {(rank, chunk, segment): frozenset([rank]) for rank in range(world_size) for chunk, segment in pieces}
    states = [dict(state)]
    for step_sends in sends:
        before = states[-1]
        after = dict(before)
        for record in step_sends:
            piece = (record["chunk"], record.get("segment", 0))
            incoming = before[(record["src"], *piece)]
            key = (record["dst"], *piece)
            after[key] = incoming if record["phase"] == "all-gather" else after[key] | incoming
        states.append(after)
    return states, sends


def plot_ring_step(states: Sequence[dict], sends: Sequence[Sequence[dict]], world_size: int, step: int) -> Figure:
    """One frame of the ring all-reduce animation: every rank's chunks after ``step`` steps, and the sends of
    the next step as arrows (from the recorded run).  A cell's label lists the ranks whose data it holds
    (``Σ``: all of them); its colour is its chunk's, deeper as contributions accumulate."""
    if not 0 <= step < len(states):
        raise ValueError(f"step must be in 0..{len(states) - 1}, got {step}")
    state = states[step]
    pieces = sorted({(chunk, segment) for (_rank, chunk, segment) in state})
    figure = Figure(figsize=(9, 0.9 + 0.75 * world_size))
    axis = figure.subplots()
    for rank in range(world_size):
        y = world_size - 1 - rank
        for column, (chunk, segment) in enumerate(pieces):
            owners = state[(rank, chunk, segment)]
            complete = len(owners) == world_size
            label = "Σ" if complete else "+".join(str(owner) for owner in sorted(owners))
            # hue: the chunk (rank c finishes chunk c); depth: how many ranks' data it already holds
            cell(axis, column, y, label, RANK_COLORS[chunk % len(RANK_COLORS)], 0.12 + 0.88 * len(owners) / world_size)
    upcoming = sends[step] if step < len(sends) else []
    for record in upcoming:
        column = pieces.index((record["chunk"], record.get("segment", 0)))
        y_from = world_size - 1 - record["src"] + 0.4
        y_to = world_size - 1 - record["dst"] + 0.4
        bend = 0.25 if record["dst"] == (record["src"] + 1) % world_size else -0.4
        axis.annotate("", xy=(column + 0.8, y_to), xytext=(column + 0.8, y_from),
                      arrowprops={"arrowstyle": "->", "color": "black", "connectionstyle": f"arc3,rad={bend}"})
    axis.set_xlim(-0.1, len(pieces) + 0.3)
    axis.set_ylim(-0.2, world_size)
    axis.set_yticks([world_size - 1 - rank + 0.4 for rank in range(world_size)],
                    [f"rank {rank}" for rank in range(world_size)])
    segments = len({segment for _chunk, segment in pieces})
    axis.set_xticks([column + 0.46 for column in range(len(pieces))],
                    [f"c{chunk}" + (f".{segment}" if segments > 1 else "") for chunk, segment in pieces], fontsize=8)
    phase = "start" if step == 0 else ("reduce-scatter" if step <= world_size - 1 else "all-gather")
    total = len(states) - 1
    sent = sum(record["bytes"] for record in upcoming)
    axis.set_title(f"after step {step}/{total} ({phase}); arrows: the {len(upcoming)} sends of the next step "
                   f"({sent} bytes)" if upcoming else f"after step {step}/{total} ({phase}): done", fontsize=10)
    for side in ("top", "right"):
        axis.spines[side].set_visible(False)
    figure.tight_layout()
    return figure


def plot_bandwidth(sizes_bytes: Sequence[int], measured: dict[str, Sequence[float]],
                   predicted: dict[str, Sequence[float]] | None = None,
                   title: str = "Bus bandwidth against message size") -> Figure:
    """Bus bandwidth (GB/s) against message size, measured (solid, dots) beside the model (dashed)."""
    return _measured_beside_model(sizes_bytes, measured, predicted, 1e-9, "message size (bytes)",
                                  "bus bandwidth (GB/s)", title, log_x=True)


def plot_time_against_ranks(ranks: Sequence[int], measured: dict[str, Sequence[float]],
                            predicted: dict[str, Sequence[float]] | None = None,
                            title: str = "All-reduce time against the number of ranks") -> Figure:
    """Seconds per collective against the number of ranks, measured (solid) beside the model (dashed)."""
    return _measured_beside_model(ranks, measured, predicted, 1e3, "ranks (N)", "time per all-reduce (ms)", title,
                                  xticks=list(ranks))


def _measured_beside_model(x: Sequence[float], measured: dict[str, Sequence[float]],
                           predicted: dict[str, Sequence[float]] | None, scale: float, xlabel: str, ylabel: str,
                           title: str, log_x: bool = False, xticks: list | None = None) -> Figure:
    """Curves of ``measured`` (solid, dots) and ``predicted`` (dashed), the same colour for the same index."""
    figure = Figure(figsize=(7, 4))
    axis = figure.subplots()
    plot = axis.semilogx if log_x else axis.plot
    for index, (label, values) in enumerate(measured.items()):
        plot(x, [v * scale for v in values], marker="o", color=RANK_COLORS[index], label=label)
    for index, (label, values) in enumerate((predicted or {}).items()):
        plot(x, [v * scale for v in values], linestyle="--", color=RANK_COLORS[index], label=label)
    if xticks is not None:
        axis.set_xticks(xticks)
    finish(axis, xlabel, ylabel, title)
    return figure


def finish(axis, xlabel: str, ylabel: str, title: str) -> None:
    """Label the axes, title them, show the legend small and tighten the figure's layout."""
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    axis.set_title(title)
    axis.legend(fontsize=8)
    axis.figure.tight_layout()


# --------------------------------------------------------------------------------------------------------
# Lesson 02: timelines and scaling

KIND_COLORS = {"compute": "#4C72B0", "comm": "#DD8452", "idle": "#B0B0B0", "bubble": "#CCB974"}


def plot_timeline(spans: Sequence, title: str = "What each rank was doing", ax=None) -> Figure:
    """Per-rank timeline from ``labkit.trace`` spans: a compute lane and a communication lane per rank, so
    overlap (a bucket all-reduce running while backward computes) shows as bars stacked in time."""
    if not spans:
        raise ValueError("no spans to draw: enable labkit.trace and run something first")
    figure = Figure(figsize=(10, 0.6 + 0.9 * len({s.rank for s in spans}))) if ax is None else ax.figure
    axis = figure.subplots() if ax is None else ax
    ranks = sorted({s.rank for s in spans})
    lanes = {"compute": 0.45, "idle": 0.45, "bubble": 0.45, "comm": 0.0}
    for position, rank in enumerate(ranks):
        base = (len(ranks) - 1 - position) * 1.2
        for span in (s for s in spans if s.rank == rank):
            axis.broken_barh([(span.start_s * 1e3, max(span.seconds * 1e3, 0.02))], (base + lanes[span.kind], 0.4),
                             facecolors=KIND_COLORS[span.kind], edgecolor="black", linewidth=0.3)
    axis.set_yticks([(len(ranks) - 1 - position) * 1.2 + 0.425 for position in range(len(ranks))],
                    [f"rank {rank}" for rank in ranks])
    axis.set_ylim(-0.2, (len(ranks) - 1) * 1.2 + 1.6)  # headroom for the legend above the top rank
    axis.set_xlabel("time (ms)")
    axis.set_title(title)
    handles = [matplotlib_patches.Patch(color=color, label=kind) for kind, color in KIND_COLORS.items()
               if any(s.kind == kind for s in spans)]
    axis.legend(handles=handles, loc="upper right", fontsize=8, ncols=len(handles))
    if ax is None:
        figure.tight_layout()
    return figure


def plot_scaling(ranks: Sequence[int], throughput: Sequence[float], predicted: Sequence[float] | None = None,
                 unit: str = "samples/s", title: str = "Throughput and scaling efficiency") -> Figure:
    """Measured throughput against ranks (and the model's), with scaling efficiency = T(N) / (N T(1))."""
    figure = Figure(figsize=(10, 3.8))
    throughput_axis, efficiency_axis = figure.subplots(1, 2)
    throughput_axis.plot(ranks, throughput, marker="o", label="measured")
    throughput_axis.plot(ranks, [throughput[0] * n / ranks[0] for n in ranks], linestyle="--", color="gray",
                         label="perfect scaling")
    if predicted is not None:
        throughput_axis.plot(ranks, predicted, linestyle=":", marker="x", label="cost model")
    throughput_axis.set_xlabel("ranks (N)")
    throughput_axis.set_ylabel(f"throughput ({unit})")
    throughput_axis.set_xticks(list(ranks))
    throughput_axis.legend(fontsize=8)
    efficiency = [t / (throughput[0] * n / ranks[0]) for n, t in zip(ranks, throughput, strict=True)]
    efficiency_axis.bar([str(n) for n in ranks], [100 * e for e in efficiency], color="#55A868")
    efficiency_axis.axhline(100, color="gray", linestyle="--")
    efficiency_axis.set_xlabel("ranks (N)")
    efficiency_axis.set_ylabel("scaling efficiency (%)")
    figure.suptitle(title)
    figure.tight_layout()
    return figure


def plot_step_breakdown(steps: dict, title: str = "Where a data-parallel step's time goes") -> Figure:
    """Stacked bars (ms) of forward, backward, exposed communication and optimizer per labelled
    ``labkit.costmodel.step.DataParallelStep``; the hidden (overlapped) communication is drawn hatched beside them."""
    figure = Figure(figsize=(11, 1.2 + 0.55 * len(steps)))
    axis = figure.subplots()
    parts = [("forward", "forward_s", "#4C72B0"), ("backward", "backward_s", "#55A868"),
             ("exposed communication", "exposed_communication_s", "#DD8452"), ("optimizer", "optimizer_s", "#8172B3")]
    labels = list(steps)
    hidden_labelled = False  # the first row may hide nothing (one rank): label the first hatched bar drawn
    for row, label in enumerate(labels):
        step, left = steps[label], 0.0
        for name, attribute, color in parts:
            width = getattr(step, attribute) * 1e3
            axis.barh(row, width, left=left, color=color, label=name if row == 0 else None)
            left += width
        hidden = (step.communication_s - step.exposed_communication_s) * 1e3
        if hidden > 0:
            start = (step.forward_s + step.backward_s) * 1e3 - hidden
            axis.barh(row, hidden, left=start, height=0.25, color="none", edgecolor="#DD8452", hatch="///",
                      label=None if hidden_labelled else "hidden communication")
            hidden_labelled = True
    axis.set_yticks(range(len(labels)), labels)
    axis.invert_yaxis()
    axis.set_xlabel("time per step (ms)")
    axis.set_title(title)
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    return figure


LINE_STYLES = ["-", "--", ":", "-."]
MARKERS = ["o", "s", "^", "D", "v"]


def plot_loss_curves(curves: dict[str, Sequence[float]], floor: float | None = None,
                     title: str = "Training loss", ylabel: str = "training loss (nats/token)") -> Figure:
    """Loss against step, one line per label, and the entropy floor when given.

    Runs that agree (fp16 or bf16 compression against none, say) would be drawn exactly on top of one another
    and read as one line: a curve within 0.5% of the axis' range of an earlier one everywhere is drawn dashed
    or dotted, with markers staggered so each shows, and its legend entry says which curve it coincides with.
    """
    figure = Figure(figsize=(7, 4))
    axis = figure.subplots()
    values = [value for losses in curves.values() for value in losses]
    tolerance = 0.005 * (max(values) - min(values) or 1.0)
    drawn: list[tuple[str, Sequence[float]]] = []  # curves not on top of an earlier one
    coinciding: dict[str, int] = {}  # how many curves already lie on each drawn one
    for index, (label, losses) in enumerate(curves.items()):
        under = next((name for name, other in drawn if len(other) == len(losses) and
                      max(abs(a - b) for a, b in zip(other, losses, strict=True)) <= tolerance), None)
        style, legend = "-", label
        if under is None:
            drawn.append((label, losses))
        else:
            coinciding[under] = coinciding.get(under, 0) + 1
            style, legend = LINE_STYLES[coinciding[under] % len(LINE_STYLES)], f"{label} (on top of {under})"
        every = max(1, len(losses) // 8)
        axis.plot(range(1, len(losses) + 1), losses, color=RANK_COLORS[index % len(RANK_COLORS)], linestyle=style,
                  marker=MARKERS[index % len(MARKERS)], markersize=4,
                  markevery=(index * every // max(1, len(curves)), every), label=legend)
    if floor is not None:
        axis.axhline(floor, color="black", linestyle=":", label=f"entropy floor {floor:.2f}")
    finish(axis, "step", ylabel, title)
    return figure
