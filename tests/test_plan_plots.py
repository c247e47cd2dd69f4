"""Lesson 11's figures: the planner's ranked layouts, scaling curves, predictions against measurements, and the
plan explorer (no process group)."""

from __future__ import annotations

import pytest
from matplotlib.figure import Figure

from labkit.costmodel.compute import GPUS
from labkit.costmodel.planner import Cluster, plan
from labkit.costmodel.published import MEGATRON_STRONG_SCALING
from labkit.costmodel.shapes import TransformerShape
from labkit.viz.mesh_plots import MEMORY_PARTS
from labkit.viz.plan_plots import GB, STEP_PARTS, plot_plan, plot_predicted_vs_measured, plot_scaling

H100 = GPUS["H100 80GB"]


@pytest.fixture(scope="module")
def gpt2_plan():
    """GPT-2 on 16 H100s: a plan of four candidates that takes a fraction of a second."""
    return plan(TransformerShape.preset("gpt2"), Cluster(H100, 16), 256, top=4, micro_batches=(1, 2))


def _stacks(axis, count: int) -> list[list]:
    """The bars of each container, checked to be ``count`` rows each."""
    stacks = [list(container) for container in axis.containers]
    assert all(len(bars) == count for bars in stacks)
    return stacks


def _check_stacked(stacks: list[list], expected: list[list[float]]) -> None:
    """Each container's bars have the expected widths and start where the previous part ended."""
    left = [0.0] * len(expected[0])
    for bars, widths in zip(stacks, expected, strict=True):
        for row, (bar, width) in enumerate(zip(bars, widths, strict=True)):
            assert bar.get_width() == pytest.approx(width)
            assert bar.get_x() == pytest.approx(left[row])
            left[row] += width


# ---------------------------------------------------------------------------------------------------------
# plot_plan


def test_plot_plan_stacks_each_candidates_memory_in_gb_and_its_step_by_term(gpt2_plan):
    rows = gpt2_plan.candidates
    assert len(rows) == 4
    figure = plot_plan(gpt2_plan, H100.memory_bytes, title="GPT-2 on 16 H100s")
    assert isinstance(figure, Figure)
    memory_axis, time_axis = figure.axes
    _check_stacked(_stacks(memory_axis, 4), [[row.memory[key] / GB for row in rows] for key in MEMORY_PARTS])
    drawn = [[row.step.parts().get(key, 0.0) for row in rows] for key in STEP_PARTS]
    _check_stacked(_stacks(time_axis, 4), [values for values in drawn if any(values)])
    assert [label.get_text() for label in memory_axis.get_yticklabels()] == [row.layout.label() for row in rows]
    (line,) = [line for line in memory_axis.lines if line.get_gid() == "device memory"]
    assert line.get_xdata()[0] == pytest.approx(80.0)
    (usable,) = [line for line in memory_axis.lines if line.get_gid() == "usable memory"]  # the margin kept
    assert usable.get_xdata()[0] == pytest.approx(72.0)
    assert memory_axis.get_xlabel() == "memory per GPU (GB)"
    assert time_axis.get_xlabel() == "predicted time per step (s)"
    texts = [text.get_text() for text in time_axis.texts]
    for row in rows:
        assert f" {row.step.step_s:.3g} s, MFU {row.mfu:.1%}" in texts
    # the fastest on top: the first row is drawn highest
    assert memory_axis.yaxis_inverted()
    legend = [text.get_text() for text in time_axis.get_legend().get_texts()]
    assert legend == [name for (name, _), values in zip(STEP_PARTS.values(), drawn, strict=True) if any(values)]


def test_plot_plan_draws_no_device_line_without_a_device_and_refuses_a_bad_one(gpt2_plan):
    figure = plot_plan(gpt2_plan)
    assert not [line for line in figure.axes[0].lines if line.get_gid() == "device memory"]
    with pytest.raises(ValueError, match="device_memory_bytes.*got -1"):
        plot_plan(gpt2_plan, device_memory_bytes=-1)
    with pytest.raises(ValueError, match="device_memory_bytes.*got True"):
        plot_plan(gpt2_plan, device_memory_bytes=True)


def test_plot_plan_of_an_empty_plan_shows_why_nothing_fits():
    empty = plan(TransformerShape.preset("gpt3-175b"), Cluster(H100, 8, 0.5), 1536, top=4)
    assert not empty.candidates
    figure = plot_plan(empty, H100.memory_bytes)
    (message,) = [text for text in figure.texts if text.get_gid() == "message"]
    assert message.get_text().replace("\n", " ") == empty.reason()
    assert "nothing fits" in message.get_text() and not figure.axes


# ---------------------------------------------------------------------------------------------------------
# plot_scaling


def test_plot_scaling_draws_mfu_in_percent_against_gpus_on_a_log_axis():
    points = [(64, 0.52), (512, 0.50), (4096, 0.41)]
    figure = plot_scaling(points, MEGATRON_STRONG_SCALING, published_label="Megatron-LM")
    axis = figure.axes[0]
    (predicted,) = [line for line in axis.lines if line.get_gid() == "predicted"]
    (published,) = [line for line in axis.lines if line.get_gid() == "published"]
    assert list(predicted.get_xdata()) == [64, 512, 4096]
    assert list(predicted.get_ydata()) == pytest.approx([52.0, 50.0, 41.0])
    assert list(published.get_xdata()) == [point.gpus for point in MEGATRON_STRONG_SCALING]
    assert list(published.get_ydata()) == pytest.approx([100 * point.mfu for point in MEGATRON_STRONG_SCALING])
    assert axis.get_xscale() == "log"
    assert sorted(axis.get_xticks()) == sorted({64, 512, 4096} | {p.gpus for p in MEGATRON_STRONG_SCALING})
    assert axis.get_xlabel() == "GPUs (log scale)" and axis.get_ylabel().startswith("MFU (%")
    assert [text.get_text() for text in axis.get_legend().get_texts()] == ["labkit's simulator", "Megatron-LM"]


def test_plot_scaling_sorts_its_points_and_draws_without_published_ones():
    class Point:  # anything with .gpus and .mfu, as simulator.scaling's points
        def __init__(self, gpus, mfu):
            self.gpus, self.mfu = gpus, mfu

    axis = plot_scaling([Point(1024, 0.4), Point(128, 0.5)]).axes[0]
    (line,) = axis.lines
    assert list(line.get_xdata()) == [128, 1024] and list(line.get_ydata()) == pytest.approx([50.0, 40.0])


@pytest.mark.parametrize(("points", "message"), [([], "points is empty"), ([(0, 0.5)], r"got \(0, 0.5\)"),
                                                 ([(8, 1.5)], r"got \(8, 1.5\)"), (["8"], "got '8'")])
def test_plot_scaling_rejects_bad_points(points, message):
    with pytest.raises(ValueError, match=message):
        plot_scaling(points)


# ---------------------------------------------------------------------------------------------------------
# plot_predicted_vs_measured


def test_plot_predicted_vs_measured_places_each_step_in_ms_beside_the_equal_line_and_the_band():
    measured, predicted, labels = [0.30, 0.26, 0.45], [0.25, 0.31, 0.40], ["8x1x1", "4x2x1", "2x2x2"]
    figure = plot_predicted_vs_measured(measured, predicted, labels, band=0.3)
    axis = figure.axes[0]
    (steps,) = [collection for collection in axis.collections if collection.get_gid() == "steps"]
    offsets = steps.get_offsets()
    assert list(offsets[:, 0]) == pytest.approx([300.0, 260.0, 450.0])
    assert list(offsets[:, 1]) == pytest.approx([250.0, 310.0, 400.0])
    (equal,) = [line for line in axis.lines if line.get_gid() == "equal"]
    assert list(equal.get_xdata()) == list(equal.get_ydata())
    (band,) = [collection for collection in axis.collections if collection.get_gid() == "band"]
    top = axis.get_xlim()[1]
    at_top = sorted(y for x, y in band.get_paths()[0].vertices if x == pytest.approx(top))
    assert at_top[0] == pytest.approx(0.7 * top) and at_top[-1] == pytest.approx(1.3 * top)
    assert top >= 450.0 and axis.get_ylim()[1] == top
    assert [text.get_text() for text in axis.texts] == labels
    assert (axis.get_xlabel(), axis.get_ylabel()) == ("measured step (ms)", "predicted step (ms)")
    assert "within ±30%" in [text.get_text() for text in axis.get_legend().get_texts()]


@pytest.mark.parametrize(("arguments", "message"), [
    (([0.1, 0.2], [0.1], ["a", "b"]), "equally long"),
    (([], [], []), "not empty"),
    (([0.1], [-0.2], ["a"]), "a step time must be a positive number, got -0.2"),
    (([0.1], [0.2], ["a"], 1.5), "band must be a fraction"),
])
def test_plot_predicted_vs_measured_rejects_bad_input(arguments, message):
    with pytest.raises(ValueError, match=message):
        plot_predicted_vs_measured(*arguments)


# ---------------------------------------------------------------------------------------------------------
# plan_explorer


def _move(control) -> None:
    import ipywidgets

    options = list(control.options)
    values = [option[1] if isinstance(option, tuple) else option for option in options]
    index = values.index(control.value)
    if isinstance(control, ipywidgets.Dropdown):
        control.value = values[(index + 1) % len(values)]
    else:  # a selection slider: one stop along, back at the end
        control.value = values[index + 1] if index + 1 < len(values) else values[index - 1]


def test_the_plan_explorer_redraws_on_release_for_every_control():
    from labkit.viz.plan_widgets import plan_explorer
    from tests.conftest import check_every_control_redraws

    # 5 controls: model, device, GPUs, global batch, sequence length (tests/test_browser.py); GPT-2 keeps it quick
    check_every_control_redraws(plan_explorer(model="gpt2", gpus=64, global_batch=512, seq_len=1024), 5, _move)


def test_the_plan_explorer_shows_the_planners_result_and_why_nothing_fits():
    import ipywidgets

    from labkit.viz.plan_widgets import CHOICES, RUN_AS, TOP, plan_explorer
    from labkit.viz.plots import figure_to_png

    explorer = plan_explorer(model="gpt2", device="A100 80GB", gpus=64, global_batch=512, seq_len=1024)
    summary = next(child for child in explorer.children if isinstance(child, ipywidgets.HTML))
    picture = next(child for child in explorer.children if isinstance(child, ipywidgets.Image))
    result = plan(TransformerShape.preset("gpt2"), Cluster(GPUS["A100 80GB"], 64), 512, top=TOP,
                  **CHOICES, **RUN_AS)
    assert result.best.layout.label() in summary.value and result.reason() in summary.value
    title = ("gpt2, 512 sequences of 1024 tokens a step, on 64 A100 80GB GPUs: the fastest layouts that fit "
             "(the kernel model fitted to published runs)")
    assert bytes(picture.value) == figure_to_png(plot_plan(result, 80e9, title=title))

    nowhere = plan_explorer(model="gpt3-175b", gpus=8)
    summary = next(child for child in nowhere.children if isinstance(child, ipywidgets.HTML))
    assert "nothing fits: the least memory" in summary.value

