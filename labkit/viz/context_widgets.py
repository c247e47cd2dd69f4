"""Lesson 13's explorers: the tiles each rank's kernel computes under the contiguous and zig-zag splits, and
what each way of context parallelism leaves exposed on a cluster.

Wired as every explorer is, by ``widgets.connect`` (sliders redraw when released, the last state wins).  The
picture keeps its own size (``align_self``): a flex column would otherwise stretch it to the notebook's width
and blur its text; it is drawn at 1.5 times its size for sharp text on high-density screens.
"""

from __future__ import annotations

import ipywidgets as widgets
from matplotlib.figure import Figure

from labkit.costmodel import context
from labkit.parallel.context.sequence import padded_length
from labkit.viz import context_plots
from labkit.viz.plots import figure_to_png
from labkit.viz.widgets import ROW, connect

CSS_DPI = 96  # a CSS pixel is 1/96 inch


def picture_widget() -> widgets.Image:
    """An image that keeps its own width (at most the notebook's) instead of stretching to the column's."""
    return widgets.Image(format="png", layout=widgets.Layout(align_self="flex-start", max_width="100%"))


def show(picture: widgets.Image, figure: Figure) -> None:
    """Draw ``figure`` into ``picture`` at 1.5 times its size, shown at its size in CSS pixels."""
    picture.value = figure_to_png(figure, dpi=int(1.5 * CSS_DPI))
    picture.layout.width = f"{round(figure.get_figwidth() * CSS_DPI)}px"


def padding_note(seq_len: int, cp: int) -> str:
    """What each split pads ``seq_len`` causal tokens to over ``cp`` ranks, said aloud ("" when neither pads)."""
    if cp == 1:
        return ""
    padded = {layout: padded_length(seq_len, cp, layout) for layout in ("contiguous", "zigzag")}
    if all(length == seq_len for length in padded.values()):
        return ""
    pieces = {"contiguous": cp, "zigzag": 2 * cp}
    said = "; ".join(f"{layout} pads to {length} ({length - seq_len} padding token{'s' * (length - seq_len > 1)} "
                     f"at the end, for {pieces[layout]} equal chunks)"
                     for layout, length in padded.items() if length > seq_len)
    return (f"<b>{seq_len} tokens do not cut evenly over cp = {cp}</b>: {said}. No real query attends to the "
            "padding (hatched: it comes after every real token), but the kernel computes its tiles. ")


def attention_explorer(seq_len: int = 64, block_size: int = 8, cp: int = 2) -> widgets.VBox:
    """Choose the sequence length, the block and the cp ranks: the tiles each rank's kernel computes, masks and
    skips (contiguous and zig-zag side by side, :func:`~labkit.viz.context_plots.plot_split_tiles`), any padding
    said aloud, and the memory and FLOPs of the two kernels."""
    length = widgets.IntSlider(value=seq_len, min=8, max=128, step=4, description="s (tokens)")
    block = widgets.IntSlider(value=block_size, min=1, max=64, description="block")
    ranks = widgets.IntSlider(value=cp, min=1, max=4, description="cp ranks")
    picture, summary = picture_widget(), widgets.HTML()

    def redraw() -> None:
        s, b, c = length.value, block.value, ranks.value
        show(picture, context_plots.plot_split_tiles(s, b, c))
        n = -(-s // b)
        heads, dim = 32, 128  # one sequence of a Llama-like layer, bf16
        scores = context.attention_saved_bytes(1, heads, s, dim, 2, kernel="scores")
        blockwise = context.attention_saved_bytes(1, heads, s, dim, 2)
        summary.value = (f"<small>{padding_note(s, c)}One process: {n * (n + 1) // 2} of {n * n} tiles computed, "
                         f"{n * (n - 1) // 2} skipped by the causal mask "
                         f"({context.attention_flops(1, s, heads * dim):.3g} FLOPs forward instead of "
                         f"{context.attention_flops(1, s, heads * dim, causal=False):.3g}). For 32 heads of 128 in "
                         f"bf16, one layer keeps {scores / 2**20:.2f} MiB with the score matrix, "
                         f"{blockwise / 2**20:.2f} MiB blockwise, and forms a tile of "
                         f"{context.tile_bytes(1, heads, b, 2) / 2**10:.1f} KiB at a time.</small>")

    controls = (length, block, ranks)
    connect(controls, redraw)
    return widgets.VBox([widgets.HBox(list(controls), layout=ROW), summary, picture])


def strategy_explorer(cp: int = 8, tp: int = 1, link: str = "InfiniBand", kv_heads: int = 8) -> widgets.VBox:
    """Choose cp, tp, the cp group's link and the key/value heads of a Llama 3 8B layer: each strategy's exposed
    communication per layer against the sequence length (the lesson's H100s,
    :func:`~labkit.viz.context_plots.lesson_cluster`)."""
    ranks = widgets.Dropdown(options=[2, 4, 8, 16, 32], value=cp, description="cp")
    tensor = widgets.Dropdown(options=[1, 2, 4, 8], value=tp, description="tp")
    links = widgets.Dropdown(options=list(context_plots.LINKS), value=link, description="link")
    heads = widgets.Dropdown(options=[8, 32], value=kv_heads, description="K/V heads")
    picture = picture_widget()

    def redraw() -> None:
        show(picture, context_plots.plot_strategy_costs(ranks.value, tensor.value, links.value, heads.value))

    controls = (ranks, tensor, links, heads)
    connect(controls, redraw)
    return widgets.VBox([widgets.HBox(list(controls), layout=ROW), picture])
