"""Lesson 11's explorer: a model, a device, a number of GPUs and a batch in; the planner's best layouts out."""

from __future__ import annotations

import dataclasses

import ipywidgets as widgets
from matplotlib.figure import Figure

from labkit.costmodel import compute
from labkit.costmodel.planner import Cluster, plan
from labkit.costmodel.published import MEGATRON_WEAK_SCALING
from labkit.costmodel.shapes import MODEL_SHAPES, num_parameters
from labkit.viz import plan_plots
from labkit.viz.plots import figure_to_png
from labkit.viz.widgets import ROW, connect

GPU_COUNTS = tuple(2**k for k in range(3, 13))  # 8 ... 4096
GLOBAL_BATCHES = (64, 128, 256, 512, 1024, 1536, 2048)
SEQUENCE_LENGTHS = (512, 1024, 2048, 4096, 8192)
# The explorer's search, narrowed so that a redraw takes a second or two on 2 cores (the whole search takes
# several at 512 GPUs, and each of a step's micro-batches is simulated: hence no batch above 2048 either):
# micro-batches of 1 and 2 sequences, no GPipe (1F1B's bubble, with more activations held), ZeRO 0, 2 and 3
# (ZeRO-2 holds less than ZeRO-1 and reduce-scatters instead of all-reducing); recomputation or not.
CHOICES = {"micro_batches": (1, 2), "schedules": ("1f1b", "interleaved", "zb-h1"), "zero_stages": (0, 2, 3)}
# How the plans are run: as the efficiency's fit set was (flash attention, fp32 gradients, TP and the weights'
# gather overlapped: labkit.costmodel.published)
RUN_AS = MEGATRON_WEAK_SCALING[0].plan_options()
TOP = 4


def plan_explorer(model: str = "gpt3-175b", device: str = "H100 80GB", gpus: int = 512, global_batch: int = 1536,
                  seq_len: int = 2048) -> widgets.VBox:
    """Choose a model (:data:`labkit.costmodel.shapes.MODEL_SHAPES`), a device
    (:data:`labkit.costmodel.compute.GPUS`), the number of GPUs, the global batch (sequences) and the sequence
    length: the planner's :data:`TOP` fastest layouts that fit (:func:`~labkit.viz.plan_plots.plot_plan`),
    each layer priced kernel by kernel at the efficiencies fitted to published runs
    (:data:`labkit.costmodel.validation.EFFICIENCIES`),
    run as Megatron-LM's README runs were (:data:`RUN_AS`), searched over :data:`CHOICES`."""
    model_choice = widgets.Dropdown(options=[(f"{name} ({num_parameters(shape) / 1e9:.3g}B)", name)
                                             for name, shape in MODEL_SHAPES.items()], value=model, description="model")
    device_choice = widgets.Dropdown(options=list(compute.GPUS), value=device, description="device")
    gpu_choice = widgets.Dropdown(options=GPU_COUNTS, value=gpus, description="GPUs N")
    wide = {"width": "460px"}  # room for the track beside the description and the readout
    batch_slider = widgets.SelectionSlider(options=GLOBAL_BATCHES, value=global_batch, description="global batch",
                                           layout=wide)  # sequences a step
    length_slider = widgets.SelectionSlider(options=SEQUENCE_LENGTHS, value=seq_len, description="sequence length",
                                            layout=wide)
    picture, summary = widgets.Image(format="png"), widgets.HTML()

    def redraw() -> None:
        name, n, batch, length = model_choice.value, gpu_choice.value, batch_slider.value, length_slider.value
        gpu = compute.GPUS[device_choice.value]
        shape = dataclasses.replace(MODEL_SHAPES[name], seq_len=length)
        title = (f"{name}, {batch} sequences of {length} tokens a step, on {n} {gpu.name} GPUs: the fastest "
                 f"layouts that fit (the kernel model fitted to published runs)")
        try:
            result = plan(shape, Cluster(gpu, n), batch, top=TOP, **CHOICES, **RUN_AS)
        except ValueError as error:  # the library's refusal, named
            summary.value = f"<small><b>ValueError</b>: {error}</small>"
            figure = Figure(figsize=(12, 1.6))
            figure.suptitle(title, fontsize=10)
            figure.text(0.5, 0.5, f"ValueError: {error}", ha="center", va="center", fontsize=9, color="#B00000",
                        wrap=True)
            picture.value = figure_to_png(figure)
            return
        best = result.best
        if best is None:
            summary.value = f"<small><b>{result.reason()}</b>: more GPUs, or a smaller model or batch.</small>"
        else:
            days = 300e9 / best.tokens_per_s / compute.SECONDS_PER_DAY
            summary.value = (f"<small>best: <b>{best.layout.label()}</b>, {best.step.step_s:.3g} s a step, MFU "
                             f"{best.mfu:.1%}, {best.tokens_per_s:,.0f} tokens/s ({days:,.1f} days for 300B tokens); "
                             f"{result.reason()} (searched: micro-batches of 1 and 2, 1F1B, interleaved and ZB-H1, "
                             "ZeRO 0, 2 and 3, with and without recomputation).</small>")
        picture.value = figure_to_png(plan_plots.plot_plan(result, gpu.memory_bytes, title=title))

    controls = (model_choice, device_choice, gpu_choice, batch_slider, length_slider)
    connect(controls, redraw)
    return widgets.VBox([widgets.HBox([widgets.VBox(list(controls[:3])), widgets.VBox(list(controls[3:]))],
                                      layout=ROW), summary, picture])
