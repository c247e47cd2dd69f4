"""Lesson 10's explorer: a 3D layout's mesh on its nodes above Llama 2 70B's memory per GPU (ipywidgets).

Wired by ``widgets.connect`` like every explorer: controls redraw on release, the last state wins, the figure is
an image.  The figure is a function of the controls alone (no control moves another), and its first line
repeats every control's value, so that each move shows, even where the layout cannot be priced: ``t p`` above
``N``, a ``t`` that does not divide Llama 2's 8 key/value heads.  A highlighted rank above ``N - 1`` is replaced
by ``N - 1``, the last rank, and the caption says so.  The memory bars: the layout, the same layout with full
activation recomputation, and data parallelism alone with the same ZeRO stage.
"""

from __future__ import annotations

import ipywidgets as widgets
from matplotlib.figure import Figure

from labkit.costmodel import compute
from labkit.viz import mesh_memory, mesh_plots
from labkit.viz.plots import figure_to_png
from labkit.viz.widgets import ROW, connect

SLIDER_TRACK = 30  # ch: a slider's track beside its description and readout (ipywidgets' 300 px squeeze it)
MODEL, GLOBAL_BATCH = mesh_memory.LLAMA_2_70B, mesh_memory.LLAMA_2_GLOBAL_BATCH


def _caption(text: str, color: str = "black", lines: int = 1) -> Figure:
    figure = Figure(figsize=(11, 0.3 + 0.22 * lines))
    figure.text(0.01, 0.5, text, ha="left", va="center", fontsize=9, color=color, wrap=True)
    return figure


def layout_explorer(gpus: int = 64, tp: int = 8, pp: int = 4, zero: int = 1, micro_batch: int = 1,
                    gpus_per_node: int = 8, device: str = "A100 80GB", rank: int = 37) -> widgets.VBox:
    """Choose ``N`` GPUs, ``t``, ``p`` (then ``d = N / (t p)``), the ZeRO stage over ``d``, the micro-batch
    ``b`` of Llama 2 70B's 4096-token sequences (each replica runs ``m = 1024 / (d b)`` of them a step), the
    GPUs per node, the device and a rank to highlight: the mesh with that rank's groups
    (:func:`~labkit.viz.mesh_plots.plot_mesh`), and the memory per GPU, with and without recomputation, beside
    data parallelism alone (:func:`~labkit.viz.mesh_memory.memory_choices`)."""
    gpu_choice = widgets.Dropdown(options=[8, 16, 32, 64], value=gpus, description="GPUs N")
    tp_choice = widgets.Dropdown(options=[1, 2, 4, 8, 16], value=tp, description="tensor parallel t")
    pp_choice = widgets.Dropdown(options=[1, 2, 4, 8], value=pp, description="pipeline stages p")
    zero_slider = widgets.IntSlider(value=zero, min=0, max=3, description="ZeRO stage")
    micro_choice = widgets.Dropdown(options=[1, 2, 4, 8, 16], value=micro_batch, description="micro-batch b")
    node_choice = widgets.Dropdown(options=[8, 4], value=gpus_per_node, description="GPUs per node")
    device_choice = widgets.Dropdown(options=list(compute.GPUS), value=device, description="device")
    rank_slider = widgets.IntSlider(value=rank, min=0, max=63, description="highlighted rank")
    picture, summary = widgets.Image(format="png"), widgets.HTML()

    def redraw() -> None:
        n, t, p, stage, b = gpu_choice.value, tp_choice.value, pp_choice.value, zero_slider.value, micro_choice.value
        gpu, per_node = compute.GPUS[device_choice.value], node_choice.value
        half = mesh_memory.half_precision(gpu.name)
        shown = min(rank_slider.value, n - 1)
        controls = (f"N = {n} GPUs, t = {t}, p = {p}, ZeRO-{stage}, b = {b}, nodes of {per_node} GPUs, {gpu.name} "
                    f"({half}), highlighted rank {rank_slider.value}"
                    + (f", above N - 1: rank {shown}, the last, is shown" if shown != rank_slider.value else ""))
        parts, problem = [_caption(controls)], None
        if t * p > n:
            problem = f"t p = {t * p} ranks for one replica, more than the {n} GPUs: choose a smaller t or p"
        else:
            d = n // (t * p)
            bars = [((d, t, p, stage), False), ((d, t, p, stage), True)]  # the layout, without and with recomputation
            if t * p > 1:
                bars.append(((n, 1, 1, stage), False))  # the same GPUs as data parallelism alone
            try:
                rows = [mesh_memory.memory_choices(MODEL, n, [choice], micro_batch=b, global_batch=GLOBAL_BATCH,
                                                   recompute=recompute, **mesh_memory.LLAMA_2_ACTIVATIONS)[0]
                        for choice, recompute in bars]
            except ValueError as error:
                rows, problem = None, f"d = {d}, t = {t}, p = {p}: ValueError: {error}"
            parts.append(mesh_plots.plot_mesh(d, t, p, per_node, shown))
            if rows is not None:
                links = mesh_plots.group_links(d, t, p, per_node)
                m = rows[0]["microbatches"]
                whole = stage >= 2 and rows[0]["accumulating"]
                summary.value = (
                    f"<small>d = {d}, t = {t}, p = {p}, ZeRO-{stage}: {rows[0]['total'] / 2**30:.1f} GiB per GPU "
                    f"({rows[1]['total'] / 2**30:.1f} GiB with full recomputation) of the {gpu.name}'s "
                    f"{gpu.memory_bytes / 2**30:.1f} GiB; m = {m} micro-batch{'es' if m > 1 else ''} of {b} a replica"
                    + ("; ZeRO-2/3 hold whole gradients while they accumulate (reduced once, after the last "
                       "micro-batch)" if whole else "")
                    + (f"; FSDP gathers each unit's weights before every micro-batch's forward and backward: "
                       f"{2 * m} all-gathers a step" if stage == 3 and d > 1 else "")
                    + "".join(f"; {dim.upper()} {links[dim]}" for dim, size in (("tp", t), ("dp", d), ("pp", p))
                              if size > 1) + ".</small>")
                parts.append(mesh_memory.plot_memory_choices(
                    rows, gpu.memory_bytes, title=f"Llama 2 70B, {half} mixed precision and Adam, m = {m} "
                    f"micro-batches of {b} x 4096 tokens a replica (global batch {GLOBAL_BATCH}): memory per GPU\n"
                    "1F1B's first stage, sequence parallelism; the bars: the layout, with full recomputation, "
                    + ("and data parallelism alone" if len(rows) > 2 else "(t = p = 1: data parallelism alone)")))
        if problem is not None:
            summary.value = f"<small><b>cannot price this layout</b>: {problem}</small>"
            parts.append(_caption(problem, color="#B00000", lines=2))
        picture.value = figure_to_png(mesh_memory.stack_figures(parts))

    controls = (gpu_choice, tp_choice, pp_choice, zero_slider, micro_choice, node_choice, device_choice, rank_slider)
    connect(controls, redraw)
    for slider in (zero_slider, rank_slider):  # room for the track beside the description and the readout
        slider.layout.width = f"{int(slider.style.description_width.removesuffix('ch')) + SLIDER_TRACK}ch"
    return widgets.VBox([widgets.HBox([widgets.VBox(list(controls[:4])), widgets.VBox(list(controls[4:]))],
                                      layout=ROW), summary, picture])
