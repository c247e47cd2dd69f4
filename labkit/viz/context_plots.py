"""Lesson 13's plots and explorers: attention's memory against the sequence length, the tiles of blockwise
attention, a ring's steps on the trace, the causal work per rank, the three ways of context parallelism, and the
Playbook's 8B memory figure beside labkit's model.

The conventions are ``labkit.viz.plots``': ``matplotlib.figure.Figure`` rather than ``pyplot``, nothing run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import ipywidgets as widgets
import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from labkit import trace
from labkit.costmodel import context
from labkit.costmodel.collectives import LinkModel
from labkit.costmodel.compute import GPUS
from labkit.costmodel.planner import Cluster
from labkit.costmodel.shapes import TransformerShape
from labkit.costmodel.step import Hardware, Layout
from labkit.parallel.context.sequence import Tiles, block_slices, chunk_positions, tile_kind
from labkit.viz.plots import RANK_COLORS, figure_to_png
from labkit.viz.widgets import ROW, connect

GiB = 2 ** 30
H100 = GPUS["H100 80GB"]  # the device lesson 13's figures price (labkit.costmodel.hardware)
STRATEGY_COLORS = {"ring": "#4C72B0", "all_gather": "#DD8452", "ulysses": "#55A868"}
TILE_COLORS = {"full": "#4C72B0", "masked": "#8FB3E0", "skip": "#F2F2F2"}


def plot_attention_memory(seq_lens: Sequence[int], saved: Mapping[str, Sequence[float]],
                          model: Mapping[str, Sequence[float]], largest: Mapping[str, Sequence[float]]) -> Figure:
    """Left: bytes each kernel keeps for backward against the sequence length (``saved``: measured points,
    ``model``: lines), log-log; right: the largest tensor each forms while it runs."""
    figure = Figure(figsize=(10.5, 3.6))
    left, right = figure.subplots(1, 2)
    colors = {"scores": "#C44E52", "blockwise": "#4C72B0"}
    for name in saved:
        label = f"{name}: model" + (" (the probabilities alone)" if name == "scores" else "")
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


def plot_tiles(seq_len: int, block_size: int, cp: int = 1, layout: str = "zigzag", ax=None) -> Figure:
    """The causal score matrix as ``block x block`` tiles: computed (dark), computed under the mask (light),
    skipped (blank); with ``cp > 1`` each query row carries the colour of the rank that holds it, and the title
    counts each rank's tiles (the ring's causal work)."""
    figure = Figure(figsize=(4.6, 4.4)) if ax is None else ax.figure
    axis = figure.subplots() if ax is None else ax
    padded = -(-seq_len // (2 * cp)) * 2 * cp if cp > 1 else seq_len
    owner = np.zeros(padded, dtype=int)
    for rank in range(cp):
        owner[chunk_positions(padded, cp, rank, layout).numpy()] = rank
    positions = np.arange(padded)
    counts = [0] * cp
    for rows in block_slices(padded, block_size):
        for cols in block_slices(padded, block_size):
            kind = tile_kind(torch.from_numpy(positions[rows]), torch.from_numpy(positions[cols]), True)
            axis.add_patch(Rectangle((cols.start, rows.start), cols.stop - cols.start, rows.stop - rows.start,
                                     facecolor=TILE_COLORS[kind], edgecolor="white", linewidth=0.6))
            if kind != "skip":
                for rank in set(owner[rows].tolist()):
                    counts[rank] += 1
    if cp > 1:
        for row in range(padded):
            axis.add_patch(Rectangle((-padded * 0.06, row), padded * 0.04, 1,
                                     facecolor=RANK_COLORS[owner[row] % len(RANK_COLORS)], edgecolor="none"))
    axis.set_xlim(-padded * 0.08 if cp > 1 else 0, padded)
    axis.set_ylim(padded, 0)
    axis.set_aspect("equal")
    axis.set_xlabel("key position")
    axis.set_ylabel("query position")
    title = f"s = {seq_len}, blocks of {block_size}"
    if cp > 1:
        title += f"\n{layout}, cp = {cp}: tiles per rank {counts}"
    axis.set_title(title, fontsize=9)
    handles = [Patch(color=TILE_COLORS[k], label=label) for k, label in
               (("full", "computed"), ("masked", "computed, masked"), ("skip", "skipped"))]
    axis.legend(handles=handles, fontsize=7, loc="upper right")
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
    axes[0].legend(fontsize=7, loc="upper left")
    figure.tight_layout()
    return figure


def plot_split_tiles(seq_len: int, block_size: int, cp: int) -> Figure:
    """The causal tiles of ``seq_len`` tokens in blocks of ``block_size`` over ``cp`` ranks, contiguous beside
    zig-zag (:func:`plot_tiles` each): what :func:`attention_explorer` draws."""
    figure = Figure(figsize=(9.2, 4.4))
    left, right = figure.subplots(1, 2)
    plot_tiles(seq_len, block_size, cp, "contiguous", ax=left)
    plot_tiles(seq_len, block_size, cp, "zigzag", ax=right)
    figure.tight_layout()
    return figure


def attention_explorer(seq_len: int = 48, block_size: int = 8, cp: int = 2) -> widgets.VBox:
    """Choose the sequence length, the block and the cp ranks: the tiles blockwise attention computes, masks and
    skips (contiguous and zig-zag side by side), and the memory and FLOPs of the two kernels."""
    length = widgets.IntSlider(value=seq_len, min=8, max=128, step=4, description="s (tokens)")
    block = widgets.IntSlider(value=block_size, min=1, max=64, description="block")
    ranks = widgets.IntSlider(value=cp, min=1, max=4, description="cp ranks")
    picture, summary = widgets.Image(format="png"), widgets.HTML()

    def redraw() -> None:
        s, b, c = length.value, block.value, ranks.value
        picture.value = figure_to_png(plot_split_tiles(s, b, c))
        tiles = Tiles()
        n = -(-s // b)
        tiles.computed, tiles.skipped = n * (n + 1) // 2, n * (n - 1) // 2
        heads, dim = 32, 128  # one sequence of a Llama-like layer, bf16
        scores = context.attention_saved_bytes(1, heads, s, dim, 2, kernel="scores")
        blockwise = context.attention_saved_bytes(1, heads, s, dim, 2)
        summary.value = (f"<small>{tiles.computed} of {n * n} tiles computed, {tiles.skipped} skipped by the causal "
                         f"mask ({context.attention_flops(1, s, heads * dim):.3g} FLOPs forward instead of "
                         f"{context.attention_flops(1, s, heads * dim, causal=False):.3g}). For 32 heads of 128 in "
                         f"bf16, one layer keeps {scores / 2**20:.2f} MiB with the score matrix, "
                         f"{blockwise / 2**20:.2f} MiB blockwise, and forms a tile of "
                         f"{context.tile_bytes(1, heads, b, 2) / 2**10:.1f} KiB at a time.</small>")

    controls = (length, block, ranks)
    connect(controls, redraw)
    return widgets.VBox([widgets.HBox(list(controls), layout=ROW), summary, picture])


def plot_cp_costs(shape: TransformerShape, seq_lens: Sequence[int], cp: int, tp: int, hardware: Hardware,
                  link: LinkModel | None = None) -> Figure:
    """Per strategy, the communication one layer's attention leaves exposed (forward and backward) against the
    sequence length (:func:`labkit.costmodel.context.cp_layer_seconds`, on ``link`` or, ``None``, on the links the
    cp group's place on the nodes gives it), beside the attention compute itself."""
    figure = Figure(figsize=(6.8, 3.6))
    axis = figure.subplots()
    for strategy, color in STRATEGY_COLORS.items():
        exposed = [sum(context.cp_layer_seconds(dataclasses.replace(shape, seq_len=s),
                                                Layout(1, tp, 1, cp=cp, cp_strategy=strategy), hardware, link))
                   for s in seq_lens]
        axis.plot(seq_lens, [1e3 * e for e in exposed], "o-", color=color, label=f"{strategy}: exposed")
    compute = [3 * 2 * s / cp * s * shape.hidden_size / tp / hardware.flops for s in seq_lens]  # causal: half
    axis.plot(seq_lens, [1e3 * c for c in compute], "k--", label="the rank's causal attention (fwd + bwd)")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("sequence length s (tokens)")
    axis.set_ylabel("ms per layer and sequence")
    where = (f"link {1 / link.beta_s_per_byte / 1e9:.0f} GB/s" if link is not None else
             f"{cp * tp} GPUs on nodes of {hardware.gpus_per_node}")
    axis.set_title(f"cp = {cp}, tp = {tp}, {where}", fontsize=10)
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    return figure


LINKS = ("InfiniBand", "NVLink", "as placed")  # the cp group's link in lesson 13's figure and explorer


def lesson_cluster() -> Cluster:
    """The H100s lesson 13 prices, figure and table alike: one node of the planner's cluster at the efficiencies
    fitted on published runs (:data:`labkit.costmodel.validation.EFFICIENCIES`)."""
    return Cluster(H100, H100.gpus_per_node)


def plot_strategy_costs(cp: int = 8, tp: int = 1, link: str = "InfiniBand", kv_heads: int = 8,
                        cluster: Cluster | None = None) -> Figure:
    """:func:`plot_cp_costs` for a Llama 3 8B layer (``kv_heads`` key/value heads) on ``cluster``'s hardware
    (:meth:`labkit.costmodel.planner.Cluster.hardware`; default :func:`lesson_cluster`, what the lesson's table
    prices), every message of the cp group over ``link``: ``"InfiniBand"`` (one GPU's adapter), ``"NVLink"``, or
    ``"as placed"`` (``cp x tp`` ranks on the cluster's nodes, each kind of message on its own link):
    what :func:`strategy_explorer` draws."""
    if link not in LINKS:
        raise ValueError(f"link must be one of {LINKS}, got {link!r}")
    shape = dataclasses.replace(TransformerShape.preset("llama-3-8b"), num_kv_heads=kv_heads)
    hardware = (cluster or lesson_cluster()).hardware()
    chosen = {"InfiniBand": hardware.inter_node, "NVLink": hardware.intra_node, "as placed": None}[link]
    lengths = [2 ** k for k in range(12, 21) if 2 ** k % (2 * cp) == 0]
    return plot_cp_costs(shape, lengths, cp, tp, hardware, chosen)


def strategy_explorer(cp: int = 8, tp: int = 1, link: str = "InfiniBand", kv_heads: int = 8) -> widgets.VBox:
    """Choose cp, tp, the cp group's link and the key/value heads of a Llama 3 8B layer: each strategy's exposed
    communication per layer against the sequence length (the lesson's H100s, :func:`lesson_cluster`)."""
    ranks = widgets.Dropdown(options=[2, 4, 8, 16, 32], value=cp, description="cp")
    tensor = widgets.Dropdown(options=[1, 2, 4, 8], value=tp, description="tp")
    links = widgets.Dropdown(options=list(LINKS), value=link, description="link")
    heads = widgets.Dropdown(options=[8, 32], value=kv_heads, description="K/V heads")
    picture = widgets.Image(format="png")

    def redraw() -> None:
        picture.value = figure_to_png(plot_strategy_costs(ranks.value, tensor.value, links.value, heads.value))

    controls = (ranks, tensor, links, heads)
    connect(controls, redraw)
    return widgets.VBox([widgets.HBox(list(controls), layout=ROW), picture])
