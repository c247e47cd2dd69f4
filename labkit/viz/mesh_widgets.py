"""Lesson 10's explorer: a 3D layout's mesh on its nodes above BERT-large's memory per GPU (ipywidgets)."""

from __future__ import annotations

import ipywidgets as widgets
from matplotlib.figure import Figure

from labkit.costmodel import compute
from labkit.viz import mesh_plots
from labkit.viz.plots import figure_to_png
from labkit.viz.widgets import ROW, connect


def layout_explorer(gpus: int = 32, tp: int = 4, pp: int = 2, zero: int = 1, micro_batch: int = 8,
                    gpus_per_node: int = 8, device: str = "V100 32GB") -> widgets.VBox:
    """Choose ``N`` GPUs, ``t``, ``p`` (then ``d = N / (t p)``), the ZeRO stage over ``d``, BERT-large's
    micro-batch, the GPUs per node, the device and a rank to highlight: the mesh with that rank's groups
    (:func:`~labkit.viz.mesh_plots.plot_layout`), and the memory per GPU beside data parallelism alone."""
    gpu_choice = widgets.Dropdown(options=[8, 16, 32, 64], value=gpus, description="GPUs N")
    tp_choice = widgets.Dropdown(options=[1, 2, 4, 8, 16], value=tp, description="tensor parallel t")
    pp_choice = widgets.Dropdown(options=[1, 2, 4, 8], value=pp, description="pipeline stages p")
    zero_slider = widgets.IntSlider(value=zero, min=0, max=3, description="ZeRO stage")
    micro_slider = widgets.IntSlider(value=micro_batch, min=1, max=64, description="micro-batch b")
    node_choice = widgets.Dropdown(options=[8, 4], value=gpus_per_node, description="GPUs per node")
    device_choice = widgets.Dropdown(options=list(compute.GPUS), value=device, description="device")
    rank_slider = widgets.IntSlider(value=0, min=0, max=63, description="highlighted rank")  # at most N - 1 shown
    picture, summary = widgets.Image(format="png"), widgets.HTML()

    def redraw() -> None:
        n, t, p, stage, b = gpu_choice.value, tp_choice.value, pp_choice.value, zero_slider.value, micro_slider.value
        rank = min(rank_slider.value, n - 1)  # the figure is a function of the controls alone: none moves another
        if t * p > n:
            summary.value = f"<small><b>t p = {t * p} ranks for {n} GPUs</b>: choose fewer, or more GPUs.</small>"
            figure = Figure(figsize=(11, 1.5))
            figure.text(0.5, 0.5, f"t = {t} times p = {p} is {t * p} ranks per replica, more than the {n} GPUs",
                        ha="center", va="center", color="#B00000")
        else:
            d, gpu = n // (t * p), compute.GPUS[device_choice.value]
            layouts = list(dict.fromkeys([(d, t, p, stage), (n, 1, 1, stage)]))  # the choice, then DP alone
            rows = mesh_plots.memory_choices(mesh_plots.BERT_LARGE, n, layouts, micro_batch=b)
            links = mesh_plots.group_links(d, t, p, node_choice.value)
            summary.value = (f"<small>d = {d}, t = {t}, p = {p}, ZeRO-{stage}: {rows[0]['total'] / 2**30:.1f} GiB "
                             f"per GPU of the {gpu.name}'s {gpu.memory_bytes / 2**30:.1f} GiB; TP {links['tp']}, "
                             f"DP {links['dp']}, PP {links['pp']}.</small>")
            figure = mesh_plots.plot_layout(d, t, p, rows, node_choice.value, rank, gpu.memory_bytes,
                                            title=f"BERT-large, micro-batch {b} x 512 tokens, mixed precision and "
                                                  "Adam: memory per GPU (1F1B, sequence parallelism)")
        picture.value = figure_to_png(figure)

    controls = (gpu_choice, tp_choice, pp_choice, zero_slider, micro_slider, node_choice, device_choice, rank_slider)
    connect(controls, redraw)
    return widgets.VBox([widgets.HBox([widgets.VBox(list(controls[:4])), widgets.VBox(list(controls[4:]))],
                                      layout=ROW), summary, picture])
