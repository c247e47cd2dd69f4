"""Back-of-the-envelope cost model, plot functions and the lesson-00 widget."""

from __future__ import annotations

import ipywidgets
import pytest
from matplotlib.figure import Figure

from labkit.costmodel import compute
from labkit.costmodel import step as step_model
from labkit.viz import plots, training_plots, widgets
from tests.conftest import explorer_controls


def test_training_flops_is_six_n_d():
    assert compute.training_flops(175e9, 300e9) == pytest.approx(3.15e23)


def test_training_time_divides_by_gpus_peak_and_utilization():
    seconds = compute.training_time_seconds(1e9, 1e10, gpus=4, peak_flops_per_gpu=1e14, utilization=0.5)
    assert seconds == pytest.approx(6e19 / (4 * 1e14 * 0.5))


def test_mixed_precision_adam_holds_sixteen_bytes_per_parameter():
    assert compute.model_state_bytes(7e9) == pytest.approx(112e9)
    assert compute.model_state_bytes(10, bytes_per_parameter=4) == 40


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda: compute.training_flops(-1, 10), "parameters"),
        (lambda: compute.training_time_seconds(1e9, 1e9, 0, 1e12), "gpus"),
        (lambda: compute.training_time_seconds(1e9, 1e9, 1, 1e12, utilization=1.5), "utilization"),
        (lambda: compute.model_state_bytes(0), "parameters"),
    ],
)
def test_cost_model_rejects_bad_input(call, fragment):
    with pytest.raises(ValueError, match=fragment):
        call()


def test_plot_functions_return_labelled_figures():
    figure = plots.plot_why_distributed(7e9, 2e12, 64, compute.GPUS["H100 80GB"], 0.4)
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


# ---------------------------------------------------------------------------------------------------------
# Lesson 01 figures, fed by real recorded runs


def _record_ring(segment_bytes):
    import torch
    import torch.distributed as torch_dist

    from labkit.collectives import ring_all_reduce

    record = []
    ring_all_reduce(torch.arange(12.0) + torch_dist.get_rank(), record=record, segment_bytes=segment_bytes)
    return record


@pytest.fixture(scope="module")
def ring_records():
    from labkit.launch import launch

    return {(n, segments): [entry for rank in launch(_record_ring, 12 // n * 4 // segments, nprocs=n) for entry in rank]
            for n in (2, 3, 4) for segments in (1, 2)}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_replay_of_a_real_run_finishes_every_chunk_on_every_rank(ring_records, world_size):
    states, sends = plots.ring_states(ring_records[(world_size, 1)], world_size)
    assert len(states) == 2 * (world_size - 1) + 1 and len(sends) == 2 * (world_size - 1)
    assert all(owners == frozenset(range(world_size)) for owners in states[-1].values())
    after_reduce_scatter = states[world_size - 1]
    for (rank, chunk, _segment), owners in after_reduce_scatter.items():
        assert (len(owners) == world_size) == (rank == chunk), (rank, chunk, owners)


def test_ring_replay_with_segments_keeps_segments_apart(ring_records):
    states, _ = plots.ring_states(ring_records[(3, 2)], 3)
    assert {segment for (_r, _c, segment) in states[0]} == {0, 1}
    assert all(owners == frozenset(range(3)) for owners in states[-1].values())


def test_ring_step_figure_rejects_a_step_out_of_range(ring_records):
    states, sends = plots.ring_states(ring_records[(2, 1)], 2)
    assert isinstance(plots.plot_ring_step(states, sends, 2, 0), Figure)
    with pytest.raises(ValueError, match="step"):
        plots.plot_ring_step(states, sends, 2, len(states))


def test_collective_pictures_and_bandwidth_plots_are_labelled():
    assert len(plots.plot_collective_states(4).axes) == 8
    figure = plots.plot_bandwidth([1024, 4096], {"measured": [1e9, 2e9]}, {"model": [1.5e9, 2.5e9]})
    assert figure.axes[0].get_ylabel() == "bus bandwidth (GB/s)" and "bytes" in figure.axes[0].get_xlabel()
    timing = plots.plot_time_against_ranks([2, 4], {"ring": [0.001, 0.002]})
    assert "ms" in timing.axes[0].get_ylabel()


def test_ring_explorer_redraws_for_each_world_size_and_step(ring_records):
    explorer = widgets.ring_all_reduce_explorer(ring_records)
    world_choice, _segments, step_slider = explorer.children[0].children
    picture = explorer.children[2]
    seen = set()
    for world_size in (2, 4):
        world_choice.value = world_size
        assert step_slider.max == 2 * (world_size - 1)
        step_slider.value = step_slider.max
        seen.add(bytes(picture.value))
    assert len(seen) == 2
    with pytest.raises(ValueError, match="records"):
        widgets.ring_all_reduce_explorer({})


def test_alpha_beta_explorer_draws_every_link():
    from labkit.costmodel.collectives import LinkModel

    explorer = widgets.alpha_beta_explorer({"slow": LinkModel(50e-6, 1e-9), "fast": LinkModel(5e-6, 1e-11)})
    link_choice, _ranks = explorer.children[0].children
    first = bytes(explorer.children[1].value)
    link_choice.value = "fast"
    assert bytes(explorer.children[1].value) != first


# ---------------------------------------------------------------------------------------------------------
# Lesson 02: the data-parallel step model, timelines, scaling


def _link():
    from labkit.costmodel.collectives import LinkModel

    return LinkModel(alpha_s=100e-6, beta_s_per_byte=1 / 1.5e9)


def test_without_overlap_all_communication_is_exposed():
    step = step_model.ddp_step_time(0.02, 0.04, 0.005, [10_000_000] * 4, 2, _link(), overlap=False)
    assert step.exposed_communication_s == pytest.approx(step.communication_s)
    assert step.step_s == pytest.approx(0.065 + step.communication_s)


def test_overlap_hides_all_but_the_last_bucket_when_backward_is_long_enough():
    buckets = [10_000_000] * 4
    step = step_model.ddp_step_time(0.02, 1.0, 0.005, buckets, 2, _link(), overlap=True)
    last = step_model.ddp_step_time(0.0, 0.0, 0.0, buckets[-1:], 2, _link(), overlap=False).communication_s
    assert step.exposed_communication_s == pytest.approx(last)


def test_communication_longer_than_backward_cannot_be_hidden():
    step = step_model.ddp_step_time(0.0, 0.001, 0.0, [100_000_000] * 8, 4, _link(), overlap=True)
    assert step.exposed_communication_s >= step.communication_s - 0.001


def test_one_rank_communicates_nothing_and_bad_input_is_rejected():
    assert step_model.ddp_step_time(0.01, 0.02, 0.0, [1_000_000], 1, _link()).communication_s == 0.0
    with pytest.raises(ValueError, match="world_size"):
        step_model.ddp_step_time(0.01, 0.02, 0.0, [1_000_000], 0, _link())
    with pytest.raises(ValueError, match=">= 0"):
        step_model.ddp_step_time(-0.01, 0.02, 0.0, [1_000_000], 2, _link())


def test_timeline_and_scaling_plots_are_labelled():
    from labkit.trace import Span

    spans = [Span(0, "backward", "compute", 0.0, 0.01), Span(0, "all-reduce", "comm", 0.005, 0.012),
             Span(1, "backward", "compute", 0.0, 0.011)]
    figure = plots.plot_timeline(spans)
    assert figure.axes[0].get_xlabel() == "time (ms)"
    assert [label.get_text() for label in figure.axes[0].get_yticklabels()] == ["rank 0", "rank 1"]
    with pytest.raises(ValueError, match="no spans"):
        plots.plot_timeline([])
    scaling = plots.plot_scaling([1, 2, 4], [100.0, 180.0, 200.0], predicted=[100.0, 190.0, 300.0])
    assert "efficiency" in scaling.axes[1].get_ylabel()
    heights = [patch.get_height() for patch in scaling.axes[1].patches]
    assert heights == pytest.approx([100.0, 90.0, 50.0])


def test_ddp_step_explorer_redraws_and_reports_efficiency():
    from labkit.costmodel.collectives import LinkModel

    explorer = widgets.ddp_step_explorer({"slow": LinkModel(50e-6, 1 / 1.25e9), "fast": LinkModel(5e-6, 1 / 400e9)})
    summary, picture = explorer.children[1], explorer.children[2]
    assert "scaling efficiency" in summary.value
    first = bytes(picture.value)
    explorer.children[0].children[1].children[1].value = "fast"
    assert bytes(picture.value) != first


def test_step_breakdown_shows_hidden_communication():
    hidden = step_model.ddp_step_time(0.02, 1.0, 0.005, [10_000_000] * 4, 2, _link(), overlap=True)
    figure = plots.plot_step_breakdown({"overlap": hidden})
    labels = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    assert "hidden communication" in labels and figure.axes[0].get_xlabel() == "time per step (ms)"


# ---------------------------------------------------------------------------------------------------------
# Lessons 03 and 04


def test_lr_schedule_explorer_redraws_for_each_rule():
    explorer = widgets.lr_schedule_explorer()
    rule_choice = explorer.children[0].children[0].children[1]
    picture = explorer.children[1]
    first = bytes(picture.value)
    rule_choice.value = "sqrt"
    assert bytes(picture.value) != first and bytes(picture.value).startswith(b"\x89PNG")


def test_lr_experiment_plot_has_a_column_per_recipe_and_clips_divergence():
    results = {("unscaled", 1): [2.3, 1.0, 0.8], ("unscaled", 4): [2.3, 2.0], ("scaled", 1): [2.3, 50.0, 9.0]}
    figure = training_plots.plot_lr_experiment(results, base_batch=16, floor=0.5)
    assert len(figure.axes) == 4
    assert figure.axes[0].get_ylim()[1] == pytest.approx(3.5)
    assert figure.axes[2].get_xscale() == "log"  # steps on a log axis


def test_memory_breakdown_draws_prediction_ticks_and_capacity():
    measured = {"fp32": {"weights": 4e6, "gradients": 4e6, "optimizer_states": 8e6, "activations": 1e6}}
    figure = training_plots.plot_memory_breakdown(measured, {"fp32": {"weights": 4e6, "gradients": 4e6}}, capacity_bytes=2e7)
    labels = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    assert {"weights", "gradients", "optimizer states", "activations", "model", "device memory"} <= set(labels)


def test_gradient_magnitude_and_checkpointing_plots_are_labelled():
    import torch

    figure = training_plots.plot_gradient_magnitudes(torch.tensor([1e-3, 1e-6, 0.0, 2e-9]), {"fp16 normal": 6.1e-5})
    assert figure.axes[0].get_xlabel() == "log2 |gradient value|"
    figure = training_plots.plot_checkpointing([0, 1, 2], [3e6, 2e6, 1e6], [0.1, 0.11, 0.12])
    assert "MiB" in figure.axes[0].get_ylabel() and "ms" in figure.axes[1].get_ylabel()


def test_precision_memory_explorer_redraws_for_another_gpu():
    explorer = widgets.precision_memory_explorer()
    gpu_choice = explorer.children[0].children[1]
    first = bytes(explorer.children[1].value)
    gpu_choice.value = "H200 141GB"
    assert bytes(explorer.children[1].value) != first


# ---------------------------------------------------------------------------------------------------------
# Lesson 05


def test_zero_stage_pictures_shard_one_more_state_per_stage():
    figure = training_plots.plot_zero_stages(world_size=2)
    filled = [sum(1 for patch in axis.patches if patch.get_facecolor()[:3] != (1.0, 1.0, 1.0))
              for axis in figure.axes]
    # 2 ranks x 3 states x 2 shards = 12 cells per panel; each stage empties one state's other-rank shards
    assert filled == [12, 10, 8, 6]


def test_memory_explorer_says_whether_the_model_fits():
    explorer = widgets.memory_explorer(preset="llama-2-7b")
    verdict = explorer.children[1]
    stage_slider, dp_slider = explorer.children[0].children[0].children[2:4]
    stage_slider.value, dp_slider.value = 0, 8
    assert "does not fit" in verdict.value
    stage_slider.value = 3
    assert "<b>fits</b>" in verdict.value


# ---------------------------------------------------------------------------------------------------------
# Every explorer as a learner drives it: redraw on release, the latest state shown, nothing cut off


def _explorers(ring_records):
    from labkit.costmodel.collectives import LinkModel

    links = {"gloo, 10 Gb Ethernet (TCP)": LinkModel(50e-6, 1 / 1.25e9),
             "NCCL, NVLink 4 (H100, in a node)": LinkModel(5e-6, 1 / 400e9)}
    return {"why distributed": widgets.why_distributed_explorer(), "ring": widgets.ring_all_reduce_explorer(ring_records),
            "alpha-beta": widgets.alpha_beta_explorer(links), "ddp step": widgets.ddp_step_explorer(links),
            "lr schedule": widgets.lr_schedule_explorer(), "precision memory": widgets.precision_memory_explorer(),
            "memory": widgets.memory_explorer()}


def test_every_explorer_slider_redraws_on_release_and_no_description_is_cut(ring_records):
    explorers = _explorers(ring_records)
    controls = {name: explorer_controls(explorer) for name, explorer in explorers.items()}
    assert sum(map(len, controls.values())) == 31  # the lessons' explorers: 5 + 3 + 2 + 5 + 6 + 2 + 8
    for name, found in controls.items():
        sliders = [control for control in found if "continuous_update" in control.keys]
        assert sliders, name
        assert all(slider.continuous_update is False for slider in sliders), name
        for control in found:
            if not isinstance(control, ipywidgets.Checkbox):  # its description sits right of the box
                assert int(control.style.description_width.removesuffix("ch")) > len(control.description), name
        for dropdown in (control for control in found if isinstance(control, ipywidgets.Dropdown)):
            longest = max(len(label) for label in dropdown._options_labels)
            description = int(dropdown.style.description_width.removesuffix("ch"))
            assert int(dropdown.layout.width.removesuffix("ch")) >= description + longest + 4, name


def test_every_slider_keeps_a_track_as_wide_as_a_hand_can_drag_beside_its_description(ring_records):
    """ipywidgets gives a slider 300 px for its description, track and readout together: a long description left
    lesson 12's tracks 15-20 px wide.  ``connect`` widens each slider by its description, for every lesson."""
    from labkit.viz import monitor_plots

    explorers = {**_explorers(ring_records), "loader": monitor_plots.loader_explorer()}
    for name, explorer in explorers.items():
        for slider in (control for control in explorer_controls(explorer) if isinstance(control, widgets.SLIDERS)):
            description = slider.style.description_width
            assert slider.layout.width == (f"calc({description} + "
                                           f"{widgets.SLIDER_TRACK_PX + widgets.SLIDER_READOUT_PX}px)"), name
    assert widgets.SLIDER_TRACK_PX >= 200  # 0-200 ms in steps of 5: 5 px a step or more


def test_every_explorer_control_changes_its_figure(ring_records):
    for name, explorer in _explorers(ring_records).items():
        picture = next(child for child in explorer.children if isinstance(child, ipywidgets.Image))
        for control in explorer_controls(explorer):
            before = bytes(picture.value)
            if isinstance(control, ipywidgets.SelectMultiple):
                control.value = control.value[:-1]
            elif isinstance(control, ipywidgets.Checkbox):
                control.value = not control.value
            elif isinstance(control, ipywidgets.Dropdown):
                control.value = next(option for option in control.options if option != control.value)
            else:
                control.value = control.max if control.value != control.max else control.min
            assert bytes(picture.value) != before, f"{name}: moving {control.description!r} left the figure as it was"


def test_lr_schedule_multi_select_shows_every_option():
    explorer = widgets.lr_schedule_explorer()
    multiples = next(c for c in explorer_controls(explorer) if isinstance(c, ipywidgets.SelectMultiple))
    assert multiples.rows >= len(multiples.options)


def test_connect_draws_the_latest_state_once_a_draw_moves_another_control():
    """A draw that clamps another control (as the ring explorer's step slider is) must not nest a second draw
    whose figure the first would overwrite with older values: draws run one after another, the last one sees
    the controls as they end."""
    ranks = ipywidgets.IntSlider(value=4, min=2, max=8)
    step = ipywidgets.IntSlider(value=6, min=0, max=6)
    shown, active = [], []

    def draw():
        assert not active, "a draw started inside another"
        active.append(1)
        step.max = 2 * (ranks.value - 1)  # clamps step.value, which notifies the observers
        shown.append((ranks.value, step.value))
        active.pop()

    widgets.connect([ranks, step], draw)
    ranks.value = 2
    assert shown[-1] == (ranks.value, step.value) == (2, 2)
    assert ranks.continuous_update is False and step.continuous_update is False


def test_connect_without_the_guard_would_show_a_stale_figure():
    """The failure ``connect`` prevents, shown on plain ``observe``: the outer draw finishes last, with the
    step it read before the nested draw clamped it."""
    ranks = ipywidgets.IntSlider(value=4, min=2, max=8)
    step = ipywidgets.IntSlider(value=6, min=0, max=6)
    shown = []

    def draw(_change=None):
        seen = (ranks.value, step.value)
        step.max = 2 * (ranks.value - 1)
        shown.append(seen)

    for control in (ranks, step):
        control.observe(draw, names="value")
    ranks.value = 2
    assert shown[-1] != (ranks.value, step.value)


def test_memory_explorer_figure_shows_the_chosen_stage():
    explorer = widgets.memory_explorer(preset="llama-2-7b")
    stage_slider = explorer.children[0].children[0].children[2]
    pictures = set()
    for stage in range(4):
        stage_slider.value = stage
        pictures.add(bytes(explorer.children[2].value))
    assert len(pictures) == 4


def test_memory_breakdown_highlights_the_chosen_configuration():
    bars = {label: {"weights": 2e9 * (4 - i), "gradients": 1e9} for i, label in enumerate(["DP", "ZeRO-1", "ZeRO-2"])}
    figure = training_plots.plot_memory_breakdown(bars, unit=1e9, unit_name="GB", highlight="ZeRO-1")
    axis = figure.axes[0]
    alphas = [[patch.get_alpha() for patch in container] for container in axis.containers[:2]]
    assert alphas == [[0.3, 1.0, 0.3]] * 2
    assert [t.get_text() for t in axis.texts] == ["7.0 GB"]  # the chosen bar's total
    assert "chosen" in [t.get_text() for t in axis.get_legend().get_texts()]
    assert all(handle.get_alpha() == 1.0 for handle in axis.get_legend().legend_handles[:2])
    with pytest.raises(ValueError, match="highlight"):
        training_plots.plot_memory_breakdown(bars, highlight="ZeRO-3")


def test_step_breakdown_legend_has_hidden_communication_when_the_first_row_hides_none():
    steps = {"1 rank": step_model.ddp_step_time(0.02, 1.0, 0.005, [10_000_000] * 4, 1, _link()),
             "2 ranks, overlap": step_model.ddp_step_time(0.02, 1.0, 0.005, [10_000_000] * 4, 2, _link(), overlap=True)}
    labels = [text.get_text() for text in plots.plot_step_breakdown(steps).axes[0].get_legend().get_texts()]
    assert labels.count("hidden communication") == 1


def test_loss_curves_that_coincide_are_drawn_apart_and_named():
    base = [2.0 - 0.01 * step for step in range(60)]
    curves = {"none": base, "fp16": [v + 1e-4 for v in base], "bf16": list(base), "top-k": [v + 0.3 for v in base]}
    axis = plots.plot_loss_curves(curves, floor=0.5).axes[0]
    lines = {line.get_label(): line for line in axis.get_lines()}
    assert set(lines) == {"none", "fp16 (on top of none)", "bf16 (on top of none)", "top-k", "entropy floor 0.50"}
    coinciding = [lines[label] for label in ("none", "fp16 (on top of none)", "bf16 (on top of none)")]
    assert len({line.get_linestyle() for line in coinciding}) == 3
    assert len({line.get_markevery()[0] for line in coinciding}) == 3  # staggered markers
    assert lines["top-k"].get_linestyle() == "-"
