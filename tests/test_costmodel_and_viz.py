"""Back-of-the-envelope cost model, plot functions and the lesson-00 widget."""

from __future__ import annotations

import pytest
from matplotlib.figure import Figure

from labkit import costmodel
from labkit.viz import plots, widgets


def test_training_flops_is_six_n_d():
    assert costmodel.training_flops(175e9, 300e9) == pytest.approx(3.15e23)


def test_training_time_divides_by_gpus_peak_and_utilization():
    seconds = costmodel.training_time_seconds(1e9, 1e10, gpus=4, peak_flops_per_gpu=1e14, utilization=0.5)
    assert seconds == pytest.approx(6e19 / (4 * 1e14 * 0.5))


def test_mixed_precision_adam_holds_sixteen_bytes_per_parameter():
    assert costmodel.model_state_bytes(7e9) == pytest.approx(112e9)
    assert costmodel.model_state_bytes(10, bytes_per_parameter=4) == 40


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda: costmodel.training_flops(-1, 10), "parameters"),
        (lambda: costmodel.training_time_seconds(1e9, 1e9, 0, 1e12), "gpus"),
        (lambda: costmodel.training_time_seconds(1e9, 1e9, 1, 1e12, utilization=1.5), "utilization"),
        (lambda: costmodel.model_state_bytes(0), "parameters"),
    ],
)
def test_cost_model_rejects_bad_input(call, fragment):
    with pytest.raises(ValueError, match=fragment):
        call()


def test_plot_functions_return_labelled_figures():
    figure = plots.plot_why_distributed(7e9, 2e12, 64, costmodel.GPUS["H100 80GB"], 0.4)
    assert isinstance(figure, Figure) and len(figure.axes) == 2
    assert all(axis.get_xlabel() or axis.get_ylabel() for axis in figure.axes)
    assert "GB" in figure.axes[0].get_ylabel() and "days" in figure.axes[1].get_ylabel()
    speedup = plots.plot_speedup([1, 2, 4], [1.0, 0.5, 0.5], cores=2)
    assert speedup.axes[0].get_ylabel().startswith("speed-up")
    assert plots.figure_to_png(speedup).startswith(b"\x89PNG")


def test_why_distributed_explorer_redraws_when_a_slider_moves():
    explorer = widgets.why_distributed_explorer()
    picture = explorer.children[1]
    first = picture.value
    gpu_slider = explorer.children[0].children[0].children[2]
    gpu_slider.value = 1024
    assert bytes(picture.value).startswith(b"\x89PNG") and bytes(picture.value) != bytes(first)
