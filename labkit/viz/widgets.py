"""ipywidgets explorers: sliders feed an analytical model, the model feeds a plot function.

Each explorer renders its figure into an ``ipywidgets.Image``: moving a slider replaces the picture in place,
and executing the notebook headless (nbval, nbclient) stores no figure outputs that would differ run to run.
"""

from __future__ import annotations

import ipywidgets as widgets

from labkit import costmodel
from labkit.viz import plots


def why_distributed_explorer(parameters: float = 7e9, tokens: float = 2e12, gpus: int = 64,
                             gpu: str = "H100 80GB", utilization: float = 0.4) -> widgets.VBox:
    """Model size, tokens, GPUs, GPU type and MFU -> memory per GPU and training days (lesson 00)."""
    parameter_slider = widgets.FloatLogSlider(value=parameters, base=10, min=8, max=12, step=0.05,
                                              description="parameters", readout_format=".2g")
    token_slider = widgets.FloatLogSlider(value=tokens, base=10, min=9, max=13.5, step=0.05,
                                          description="tokens", readout_format=".2g")
    gpu_slider = widgets.IntSlider(value=gpus, min=1, max=4096, description="GPUs")
    gpu_choice = widgets.Dropdown(options=list(costmodel.GPUS), value=gpu, description="GPU")
    mfu_slider = widgets.FloatSlider(value=utilization, min=0.1, max=0.7, step=0.05, description="MFU")
    picture = widgets.Image(format="png")

    def redraw(_change=None) -> None:
        figure = plots.plot_why_distributed(parameter_slider.value, token_slider.value, gpu_slider.value,
                                            costmodel.GPUS[gpu_choice.value], mfu_slider.value)
        picture.value = plots.figure_to_png(figure)

    for control in (parameter_slider, token_slider, gpu_slider, gpu_choice, mfu_slider):
        control.observe(redraw, names="value")
    redraw()
    controls = widgets.HBox([widgets.VBox([parameter_slider, token_slider, gpu_slider]),
                             widgets.VBox([gpu_choice, mfu_slider])])
    return widgets.VBox([controls, picture])
