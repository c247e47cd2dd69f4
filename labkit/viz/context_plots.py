"""Lesson 13's plots: attention's memory against the sequence length, the tiles of blockwise attention as the
ring's ranks compute them, a ring's steps on the trace, the causal work per rank and the step it sets, the three
ways of context parallelism, and the Playbook's 8B memory figure beside labkit's model (the explorers that draw
them: :mod:`labkit.viz.context_widgets`).

The conventions are ``labkit.viz.plots``': ``matplotlib.figure.Figure`` rather than ``pyplot``, nothing run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from labkit import trace
from labkit.costmodel import context
from labkit.costmodel.collectives import LinkModel
from labkit.costmodel.compute import GPUS
from labkit.costmodel.planner import Cluster
from labkit.costmodel.shapes import TransformerShape
from labkit.costmodel.step import Hardware
from labkit.parallel.context.sequence import block_slices, chunk_positions, padded_length, tile_kind
from labkit.viz.plots import RANK_COLORS

GiB = 2 ** 30
H100 = GPUS["H100 80GB"]  # the device lesson 13's figures price (labkit.costmodel.hardware)
STRATEGY_COLORS = {"ring": "#4C72B0", "all_gather": "#DD8452", "ulysses": "#55A868"}
TILE_COLORS = {"full": "#4D4D4D", "masked": "#ABABAB", "skip": "#F2F2F2"}  # greys: the ranks have the colours
TILE_CODES = {"skip": 0, "masked": 1, "full": 2}  # split_tile_grid's values
PADDING_COLOR = "#B00000"
LAYOUT_COLORS = {"contiguous": "#C44E52", "zigzag": "#4C72B0"}


def plot_attention_memory(seq_lens: Sequence[int], saved: Mapping[str, Sequence[float]],
                          model: Mapping[str, Sequence[float]], largest: Mapping[str, Sequence[float]]) -> Figure:
    """Left: bytes each kernel keeps for backward against the sequence length (``saved``: measured points,
    ``model``: lines), log-log; right: the largest tensor each forms while it runs."""
    figure = Figure(figsize=(10.5, 3.6))
    left, right = figure.subplots(1, 2)
    colors = {"scores": "#C44E52", "blockwise": "#4C72B0"}
    for name in saved:
        label = f"{name}: model" + (" (q, k, v, probabilities, mask)" if name == "scores" else "")
        left.plot(seq_lens, model[name], color=colors.get(name), linewidth=1.2, label=label)
        left.plot(seq_lens, saved[name], "o", color=colors.get(name), label=f"{name}: measured")
        right.plot(seq_lens, largest[name], "o-", color=colors.get(name), label=name)
    for axis, title, unit in ((left, "kept for the backward pass", "bytes"),
                              (right, "largest tensor formed while it runs", "elements")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("sequence length s (tokens)")
        axis.set_ylabel(unit)
        axis.set_title(title, fontsize=10)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    return figure


def split_tile_grid(seq_len: int, block_size: int, cp: int = 1, layout: str = "zigzag"
                    ) -> tuple[np.ndarray, list[int], np.ndarray]:
    """The tiles the ring's kernel computes, as :func:`~labkit.parallel.context.ring_tiles` counts them: ``(grid,
    counts, order)``.  ``grid[i, j]`` is 0 (skipped), 1 (computed under the mask) or 2 (computed) for the ``i``-th
    query and ``j``-th key *as the ranks hold them* (rank 0's tokens first, in its order; ``order`` gives each
    one's position in the sequence, padding included); each rank cuts its own tokens into blocks, so a tile is
    one block of a rank's queries against one block of a rank's keys.  ``counts``: each rank's computed tiles."""
    if cp == 1:
        positions = [torch.arange(seq_len)]
    else:
        padded = padded_length(seq_len, cp, layout)
        positions = [chunk_positions(padded, cp, rank, layout) for rank in range(cp)]
    local = len(positions[0])
    grid = np.zeros((local * cp, local * cp), dtype=int)
    counts = [0] * cp
    for rank, mine in enumerate(positions):
        for source, theirs in enumerate(positions):
            for rows in block_slices(local, block_size):
                for cols in block_slices(local, block_size):
                    kind = tile_kind(mine[rows], theirs[cols], True)
                    grid[rank * local + rows.start:rank * local + rows.stop,
                         source * local + cols.start:source * local + cols.stop] = TILE_CODES[kind]
                    counts[rank] += kind != "skip"
    return grid, counts, torch.cat(positions).numpy()


def _runs(indices: np.ndarray) -> list[tuple[int, int]]:
    """``(start, stop)`` of each run of consecutive integers in the sorted ``indices``."""
    runs: list[tuple[int, int]] = []
    for index in indices.tolist():
        if runs and runs[-1][1] == index:
            runs[-1] = (runs[-1][0], index + 1)
        else:
            runs.append((index, index + 1))
    return runs


def tile_legend(cp: int, padding: bool) -> list[Patch]:
    """The legend of :func:`plot_tiles`: the three kinds of tile, the padding's hatch, the ranks' colours."""
    handles = [Patch(color=TILE_COLORS[kind], label=label) for kind, label in
               (("full", "computed"), ("masked", "computed, masked inside"), ("skip", "skipped"))]
    if padding:
        handles.append(Patch(facecolor="none", edgecolor=PADDING_COLOR, hatch="////", label="padding tokens"))
    return handles + [Patch(color=RANK_COLORS[rank % len(RANK_COLORS)], label=f"rank {rank}")
                      for rank in range(cp if cp > 1 else 0)]


def plot_tiles(seq_len: int, block_size: int, cp: int = 1, layout: str = "zigzag", ax=None) -> Figure:
    """The causal score matrix as the ring's kernel tiles it (:func:`split_tile_grid`): rows are queries and
    columns keys as the ranks hold them, rank 0's first (ticks: the sequence position where each chunk starts),
    the strips on the left and top the rank holding each; each rank cuts its own tokens into ``block_size``
    blocks (thin lines).  The title counts each rank's tiles, which sum to the total; padding (a sequence the
    split does not cut evenly is padded at its end) is hatched.  Without ``ax``, a figure with its legend."""
    figure = Figure(figsize=(4.8, 5.2)) if ax is None else ax.figure
    axis = figure.subplots() if ax is None else ax
    grid, counts, order = split_tile_grid(seq_len, block_size, cp, layout)
    size, local = len(order), len(order) // cp
    axis.imshow(grid, cmap=ListedColormap([TILE_COLORS[k] for k in ("skip", "masked", "full")]), vmin=0, vmax=2,
                extent=(0, size, size, 0), interpolation="nearest")
    for rank in range(cp):
        for start in range(0, local, block_size):
            for line in (axis.axhline, axis.axvline):
                line(rank * local + start, color="white", linewidth=0.5 if start else 1.6)
        if cp > 1:
            color = RANK_COLORS[rank % len(RANK_COLORS)]
            axis.add_patch(Rectangle((-0.07 * size, rank * local), 0.05 * size, local, facecolor=color,
                                     clip_on=False))
            axis.add_patch(Rectangle((rank * local, -0.07 * size), local, 0.05 * size, facecolor=color,
                                     clip_on=False))
    padding = np.flatnonzero(order >= seq_len)
    for start, stop in _runs(padding):
        for span in (axis.axhspan, axis.axvspan):
            span(start, stop, facecolor="none", edgecolor=PADDING_COLOR, hatch="////", linewidth=0)
    if cp > 1:
        chunk = size // (cp * (2 if layout == "zigzag" else 1))
        ticks = list(range(0, size, chunk))
        axis.set_xticks(ticks, [str(order[t]) for t in ticks])
        axis.set_yticks(ticks, [str(order[t]) for t in ticks])
    axis.set_xlim(-0.08 * size if cp > 1 else 0, size)
    axis.set_ylim(size, -0.08 * size if cp > 1 else 0)
    axis.set_aspect("equal")
    held = " as the ranks hold them" if cp > 1 else ""
    axis.set_xlabel(f"keys{held} (position)", fontsize=9)
    axis.set_ylabel(f"queries{held} (position)", fontsize=9)
    title = f"s = {seq_len}" + (f", padded to {size}" if size > seq_len else "") + f", blocks of {block_size}"
    if cp > 1:
        title += f"\n{layout}, cp = {cp}: tiles per rank {counts}, {sum(counts)} in all"
    else:
        title += f": {sum(counts)} tiles computed"
    axis.set_title(title, fontsize=9)
    if ax is None:
        figure.legend(handles=tile_legend(cp, len(padding) > 0), loc="lower center", ncol=4, fontsize=7)
        figure.tight_layout(rect=(0, 0.12, 1, 1))
    return figure


def plot_ring_trace(spans: Sequence[trace.Span], title: str = "ring attention, forward and backward") -> Figure:
    """One row per rank: its attention on each block of keys (compute, labelled with the block's owner) above the
    receives running meanwhile (comm), in ms from the first span."""
    ranks = sorted({span.rank for span in spans})
    start = min(span.start_s for span in spans)
    figure = Figure(figsize=(10.5, 0.75 * len(ranks) + 1.3))
    axis = figure.subplots()
    for row, rank in enumerate(ranks):
        for span in (s for s in spans if s.rank == rank and s.kind in ("compute", "comm", "idle")):
            compute = span.kind == "compute"
            y = row - (0.18 if compute else -0.22)
            owner = span.name.split("kv")[-1]
            color = (RANK_COLORS[int(owner) % len(RANK_COLORS)] if compute and owner.isdigit()
                     else "#333333" if span.kind == "idle" else "#BBBBBB")
            axis.broken_barh([(1e3 * (span.start_s - start), 1e3 * span.seconds)], (y - 0.16, 0.32),
                             facecolors=color, edgecolor="black", linewidth=0.3)
            if compute and owner.isdigit():
                axis.text(1e3 * (span.start_s - start + span.seconds / 2), y, span.name.split()[-1], ha="center",
                          va="center", fontsize=6)
    axis.set_yticks(range(len(ranks)), [f"rank {rank}" for rank in ranks])
    axis.set_ylim(len(ranks) - 0.5, -0.5)
    axis.set_xlabel("time (ms)")
    axis.set_title(title + "\nupper bars: attention on the keys of the rank named; lower: the next block in flight "
                           "(grey), waited for (black)", fontsize=9)
    axis.grid(True, axis="x", alpha=0.3)
    figure.tight_layout()
    return figure


def plot_work_per_rank(tiles: Mapping[str, Sequence[int]], seconds: Mapping[str, Sequence[float]]) -> Figure:
    """Each rank's causal work (tiles its kernel computed) and its process's measured CPU time, per layout."""
    figure = Figure(figsize=(10.5, 3.3))
    left, right = figure.subplots(1, 2)
    width = 0.8 / len(tiles)
    for index, name in enumerate(tiles):
        x = np.arange(len(tiles[name])) + (index - (len(tiles) - 1) / 2) * width
        left.bar(x, tiles[name], width, label=name)
        right.bar(x, [1e3 * s for s in seconds[name]], width, label=name)
    for axis, label in ((left, "tiles computed (forward and backward)"),
                        (right, "CPU time of the rank's process (ms)")):
        axis.set_xticks(range(len(next(iter(tiles.values())))),
                        [f"rank {r}" for r in range(len(next(iter(tiles.values()))))])
        axis.set_ylabel(label)
        axis.legend(fontsize=8)
        axis.grid(True, axis="y", alpha=0.3)
    left.set_title("the work each rank's queries have", fontsize=10)
    right.set_title("what it took", fontsize=10)
    figure.tight_layout()
    return figure


def plot_strategies(rows: Mapping[str, Mapping[str, float]]) -> Figure:
    """Per strategy (``{name: {"sent": bytes, "model": bytes, "total": bytes, "buffer": bytes, "ms": time}}``):
    the bytes that left each rank (measured bars, model marks; ``total``, optional, the collectives' whole size,
    what enters a reduce-scatter or an all-to-all or leaves an all-gather, drawn as an outline), the largest
    buffer of others' K/V it held, and the measured step time."""
    figure = Figure(figsize=(10.5, 3.2))
    axes = figure.subplots(1, 3)
    names = list(rows)
    colors = [STRATEGY_COLORS.get(name, "#777777") for name in names]
    if all("total" in rows[n] for n in names):
        axes[0].bar(names, [rows[n]["total"] / 1024 for n in names], facecolor="none", edgecolor="#555555",
                    linestyle="--", label="the collectives' whole size")
    axes[0].bar(names, [rows[n]["sent"] / 1024 for n in names], color=colors, label="left the rank: measured")
    axes[0].plot(names, [rows[n]["model"] / 1024 for n in names], "k_", markersize=28, markeredgewidth=2,
                 label="left the rank: model")
    tallest = max(max(rows[n].get("total", 0), rows[n]["sent"], rows[n]["model"]) for n in names) / 1024
    axes[0].set_ylim(0, 1.45 * tallest)  # room for the legend above the bars
    axes[0].set_ylabel("KiB that left a rank, one attention")
    axes[0].legend(fontsize=7, loc="upper right")
    axes[1].bar(names, [rows[n]["buffer"] / 1024 for n in names], color=colors)
    axes[1].set_ylabel("KiB: largest tensor formed")
    axes[2].bar(names, [rows[n]["ms"] for n in names], color=colors)
    axes[2].set_ylabel("ms: forward + backward (median)")
    for axis in axes:
        axis.grid(True, axis="y", alpha=0.3)
    figure.tight_layout()
    return figure


def plot_playbook_memory(shape: TransformerShape, seq_lens: Sequence[int],
                         settings: Sequence[tuple[int, int]]) -> Figure:
    """The Ultra-Scale Playbook's "Memory Usage for 8B Model" redrawn from labkit's model
    (:func:`labkit.costmodel.context.playbook_memory`): a panel per ``(tp, cp)``, stacked parts per sequence length,
    the 80 GB of an H100 dashed."""
    figure = Figure(figsize=(10.5, 3.4))
    axes = figure.subplots(1, len(settings), sharey=True, squeeze=False)[0]
    parts = ("parameters", "gradients", "optimizer_states", "activations")
    colors = ("#4C72B0", "#DD8452", "#55A868", "#C44E52")
    for axis, (tp, cp) in zip(axes, settings, strict=True):
        bottom = np.zeros(len(seq_lens))
        values = [context.playbook_memory(shape, s, tp, cp) for s in seq_lens]
        for part, color in zip(parts, colors, strict=True):
            heights = np.array([v[part] for v in values])
            axis.bar(range(len(seq_lens)), heights, bottom=bottom, color=color, label=part.replace("_", " "))
            bottom += heights
        axis.axhline(H100.memory_bytes / GiB, color="#B00000", linestyle="--", linewidth=1,
                     label=f"an H100: {H100.memory_bytes / 1e9:.0f} GB = {H100.memory_bytes / GiB:.1f} GiB")
        axis.set_xticks(range(len(seq_lens)), [f"{s // 1024}k" for s in seq_lens])
        axis.set_title("no parallelism" if (tp, cp) == (1, 1) else f"TP = {tp}, CP = {cp}", fontsize=10)
        axis.set_xlabel("sequence length (tokens)")
        axis.set_ylim(0, 150)
    axes[0].set_ylabel("GiB per GPU (clipped at 150)")
    handles, labels = axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)  # below: the bars fill the panels
    figure.tight_layout(rect=(0, 0.08, 1, 1))
    return figure


def plot_split_tiles(seq_len: int, block_size: int, cp: int) -> Figure:
    """The causal tiles of ``seq_len`` tokens in blocks of ``block_size`` over ``cp`` ranks, contiguous beside
    zig-zag (:func:`plot_tiles` each), one legend below: what the tile explorer draws."""
    figure = Figure(figsize=(9.2, 5.4))
    left, right = figure.subplots(1, 2)
    plot_tiles(seq_len, block_size, cp, "contiguous", ax=left)
    plot_tiles(seq_len, block_size, cp, "zigzag", ax=right)
    padding = cp > 1 and padded_length(seq_len, cp, "zigzag") > seq_len
    handles = tile_legend(cp, padding)
    figure.legend(handles=handles, loc="lower center", ncol=min(len(handles), 8), fontsize=8)
    figure.tight_layout(rect=(0, 0.07, 1, 1))
    return figure


def plot_cp_costs(shape: TransformerShape, seq_lens: Sequence[int], cp: int, tp: int, hardware: Hardware,
                  link: LinkModel | None = None) -> Figure:
    """Per strategy, the communication one layer's attention leaves exposed (forward and backward) against the
    sequence length, beside the rank's causal attention itself, all from
    :func:`labkit.costmodel.context.cp_strategy_costs` (on ``link`` or, ``None``, on the links the cp group's
    place on the nodes gives it).  An exposed time of 0 (all hidden) has no place on a log axis: it is drawn on
    the dotted line at the bottom, "0".  A strategy the heads rule out is named in the legend, not drawn."""
    costs = context.cp_strategy_costs(shape, list(seq_lens), cp, tp, hardware, link)
    figure = Figure(figsize=(6.8, 4.2))
    axis = figure.subplots()
    values = [1e3 * v for line in costs["exposed"].values() for v in line] + [1e3 * v for v in costs["attention"]]
    floor = min(v for v in values if v > 0) / 4  # where a 0 is drawn
    handles = []
    for strategy, color in STRATEGY_COLORS.items():
        if strategy in costs["refused"]:
            handles.append(Line2D([], [], color=color, linestyle="none", marker="x",
                                  label=f"{strategy}: not possible, cp x tp > K/V heads"))
            continue
        exposed = [1e3 * e for e in costs["exposed"][strategy]]
        handles += axis.plot(seq_lens, [max(e, floor) for e in exposed], "o-", color=color, label=f"{strategy}: exposed")
        zeros = [s for s, e in zip(seq_lens, exposed, strict=True) if e <= 0]
        if zeros:
            axis.plot(zeros, [floor] * len(zeros), "o", color="white", markeredgecolor=color, zorder=3)
    handles += axis.plot(seq_lens, [1e3 * c for c in costs["attention"]], "k--",
                         label="the rank's causal attention (fwd + bwd)")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    if any(e <= 0 for line in costs["exposed"].values() for e in line):
        axis.axhline(floor, color="gray", linestyle=":", linewidth=1)
        axis.text(seq_lens[0], floor, " 0: all hidden (hollow)", va="bottom", fontsize=7, color="gray")
        axis.set_ylim(bottom=floor / 2)
    axis.set_xlabel("sequence length s (tokens)")
    axis.set_ylabel("ms per layer and sequence")
    where = (f"link {1 / link.beta_s_per_byte / 1e9:.0f} GB/s" if link is not None else
             f"{cp * tp} GPUs on nodes of {hardware.gpus_per_node}")
    axis.set_title(f"cp = {cp}, tp = {tp}, {shape.num_kv_heads} K/V heads, {where}", fontsize=10)
    axis.grid(True, which="both", alpha=0.3)
    figure.legend(handles=handles, loc="lower center", ncol=2, fontsize=8)  # below: the lines cross the plot
    figure.tight_layout(rect=(0, 0.13, 1, 1))
    return figure


LINKS = ("InfiniBand", "NVLink", "as placed")  # the cp group's link in lesson 13's figure and explorer


def lesson_cluster() -> Cluster:
    """The H100s lesson 13 prices, figure and table alike: one node of the planner's cluster at the efficiencies
    fitted on published runs (:data:`labkit.costmodel.validation.EFFICIENCIES`)."""
    return Cluster(H100, H100.gpus_per_node)


def lesson_link(link: str, hardware: Hardware) -> LinkModel | None:
    """The cp group's link named in lesson 13: ``"InfiniBand"`` (one GPU's adapter), ``"NVLink"``, or ``"as
    placed"`` (``None``: ``cp x tp`` ranks on the cluster's nodes, each kind of message on its own link)."""
    if link not in LINKS:
        raise ValueError(f"link must be one of {LINKS}, got {link!r}")
    return {"InfiniBand": hardware.inter_node, "NVLink": hardware.intra_node, "as placed": None}[link]


def plot_strategy_costs(cp: int = 8, tp: int = 1, link: str = "InfiniBand", kv_heads: int = 8,
                        cluster: Cluster | None = None) -> Figure:
    """:func:`plot_cp_costs` for a Llama 3 8B layer (``kv_heads`` key/value heads) on ``cluster``'s hardware
    (:meth:`labkit.costmodel.planner.Cluster.hardware`; default :func:`lesson_cluster`, what the lesson's table
    prices), every message of the cp group over :func:`lesson_link`: what the strategy explorer draws."""
    shape = dataclasses.replace(TransformerShape.preset("llama-3-8b"), num_kv_heads=kv_heads)
    hardware = (cluster or lesson_cluster()).hardware()
    chosen = lesson_link(link, hardware)
    lengths = [2 ** k for k in range(12, 21) if 2 ** k % (2 * cp) == 0]
    return plot_cp_costs(shape, lengths, cp, tp, hardware, chosen)


def plot_timed_ring(work: Mapping[str, Sequence[float]], step: Mapping[str, float]) -> Figure:
    """Per layout, each rank's own work (``work``: seconds, its tiles' timed waits) as bars and the measured
    step (``step``: the slowest rank's median forward and backward) as a line of the layout's colour."""
    figure = Figure(figsize=(7.6, 3.4))
    axis = figure.subplots()
    width = 0.8 / len(work)
    for index, (name, seconds) in enumerate(work.items()):
        color = LAYOUT_COLORS.get(name, "#777777")
        x = np.arange(len(seconds)) + (index - (len(work) - 1) / 2) * width
        axis.bar(x, [1e3 * s for s in seconds], width, color=color, alpha=0.55, label=f"{name}: the rank's tiles")
        axis.axhline(1e3 * step[name], color=color, linewidth=2, label=f"{name}: measured step")
    ranks = len(next(iter(work.values())))
    axis.set_xticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    axis.set_ylabel("ms, forward + backward")
    tallest = max(max(step.values()), max(max(seconds) for seconds in work.values()))
    axis.set_ylim(0, 1.45e3 * tallest)  # room for the legend above the bars
    axis.set_title("ring attention, every tile a timed wait: the step follows the busiest rank", fontsize=10)
    axis.legend(fontsize=8, ncol=2, loc="upper left")
    axis.grid(True, axis="y", alpha=0.3)
    figure.tight_layout()
    return figure
