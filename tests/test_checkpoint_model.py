"""labkit.costmodel.checkpointing (how often to checkpoint: Young, Daly, a simulation of failures), its figure and
explorer (lesson 09), and the backend probe of labkit.pitfalls."""

from __future__ import annotations

import math

import ipywidgets
import pytest

from labkit import pitfalls
from labkit.costmodel import checkpointing as model
from labkit.launch import launch
from labkit.viz import checkpoint_plots
from tests.conftest import check_every_control_redraws

C, M, R = 60.0, 10_000.0, 600.0


def test_a_checkpoint_holds_twelve_bytes_per_adam_parameter_and_the_sharded_layout_divides_the_write():
    assert model.checkpoint_bytes(1e9) == 12e9 and model.checkpoint_bytes(10, "sgd") == 40
    size = model.checkpoint_bytes(70e9)
    assert model.write_seconds(size, 2e9) == pytest.approx(420.0)  # one writer at 2 GB/s: 7 minutes
    assert model.write_seconds(size, 2e9, "sharded", 1000) == pytest.approx(0.42)
    assert model.write_seconds(size, 2e9, "sharded", 1000, storage_bandwidth=100e9) == pytest.approx(8.4)
    assert model.write_seconds(size, 2e9, "full", 1000, storage_bandwidth=100e9) == pytest.approx(420.0)


def test_youngs_interval_minimises_the_first_order_loss():
    optimum = model.young_interval(C, M)
    assert optimum == pytest.approx(math.sqrt(2 * C * M))
    best = model.lost_fraction(optimum, C, M, R)
    assert best == pytest.approx(math.sqrt(2 * C / M) + R / M)
    assert all(model.lost_fraction(optimum * f, C, M, R) > best for f in (0.5, 0.9, 1.1, 2.0))


@pytest.mark.parametrize("factor", [0.25, 1.0, 4.0])
def test_simulated_failures_lose_what_dalys_exact_expectation_says(factor):
    tau = factor * model.young_interval(C, M)
    expected = model.expected_lost_fraction(tau, C, M, R)
    simulated = [model.simulate_lost_fraction(tau, C, M, R, seed=seed) for seed in range(3)]
    assert all(abs(s - expected) < 0.01 for s in simulated), (simulated, expected)
    # Young's first-order terms approach the exact expectation when C, tau and R are small beside M.
    small = model.young_interval(1.0, 1e6)
    assert model.lost_fraction(factor * small, 1.0, 1e6, 10.0) == pytest.approx(
        model.expected_lost_fraction(factor * small, 1.0, 1e6, 10.0), rel=0.02)


def test_llama_3s_failure_rate_and_storage_leave_the_reported_ninety_percent_for_restarts_up_to_14_minutes():
    # Dubey et al. 2024: 419 unexpected interruptions and 47 planned ones in 54 days on 16,384 GPUs, >90 % effective
    # training time, 2 TB/s storage
    mtbf, planned = model.LLAMA3_MTBF_S, model.LLAMA3_PLANNED_PER_S
    assert mtbf / 3600 == pytest.approx(3.09, abs=0.005) and planned * model.LLAMA3_SECONDS == 47
    assert model.LLAMA3_GPU_YEARS_PER_FAILURE == pytest.approx(5.78, abs=0.005)
    write = model.write_seconds(model.checkpoint_bytes(405e9), 2e9, "sharded", model.LLAMA3_GPUS,
                                storage_bandwidth=model.LLAMA3_STORAGE_BYTES_S)
    assert write == pytest.approx(2.43)  # the storage is the limit, not 16,384 writers at 2 GB/s
    kept = model.kept_share(write, mtbf, 600.0, planned)
    assert kept == pytest.approx(1 - model.expected_lost_fraction(model.young_interval(write, mtbf), write, mtbf, 600)
                                 - 47 * 600 / model.LLAMA3_SECONDS)
    assert kept == pytest.approx(0.922, abs=0.001) and kept > model.LLAMA3_EFFECTIVE_TIME  # Meta: "higher than 90 %"
    longest = model.longest_restart(write, mtbf, 0.9, planned)
    assert longest / 60 == pytest.approx(13.9, abs=0.05)
    assert model.kept_share(write, mtbf, longest, planned) == pytest.approx(0.9, abs=1e-9)
    assert model.longest_write(600.0, mtbf, 0.9, planned) == pytest.approx(11.0, abs=0.05)
    assert model.longest_write(0.0, mtbf, 0.9, planned) == pytest.approx(59.6, abs=0.05)
    assert model.longest_restart(write, mtbf, 0.999) == 0.0  # not even instant restarts keep 99.9 %
    with pytest.raises(ValueError, match="share must lie in"):
        model.longest_write(0.0, mtbf, 1.0)


def test_a_simulation_without_failures_loses_only_the_writes():
    lost = model.simulate_lost_fraction(100.0, 10.0, 1e12, work_s=1000.0)
    assert lost == pytest.approx(90 / 1090)  # 9 writes: the last interval ends the run, unwritten


@pytest.mark.parametrize("call, message", [
    (lambda: model.checkpoint_bytes(0), "num_parameters must be a number > 0"),
    (lambda: model.checkpoint_bytes(1, "lion"), "optimizer must be one of"),
    (lambda: model.write_seconds(1, 1, "striped"), "layout must be one of"),
    (lambda: model.write_seconds(1, 1, "sharded", 0), "ranks must be an integer >= 1"),
    (lambda: model.young_interval(-1, 1), "write_s must be a number > 0"),
    (lambda: model.lost_fraction(1, 1, 1, -1), "restart_s must be >= 0"),
    (lambda: model.simulate_lost_fraction(0, 1, 1), "interval_s must be a number > 0"),
])
def test_bad_input_is_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_the_interval_figure_marks_youngs_optimum_and_the_simulated_points():
    figure = checkpoint_plots.plot_checkpoint_interval(C, M, R, simulated={1000.0: 0.2, 2000.0: 0.25},
                                                       chosen_s=500.0)
    axis = figure.axes[0]
    labels = [line.get_label() for line in axis.get_lines()]
    assert any(label.startswith("Young: τ* = √(2CM) = 18.3 min") and label.endswith("% lost (Daly)")
               for label in labels), labels
    assert "simulated failures (Poisson)" in labels and any("your interval: 8.33 min" in x for x in labels)
    assert axis.get_xscale() == "log" and "minutes" in axis.get_xlabel() and "%" in axis.get_ylabel()
    assert axis.get_lines()[-1].get_xdata()[0] == pytest.approx(500.0 / 60)  # in minutes, as the label says
    hours = checkpoint_plots.plot_checkpoint_interval(600.0, 1e6).axes[0]  # Young's interval: 9.6 h
    assert "hours" in hours.get_xlabel()


def _move(control) -> None:
    if isinstance(control, ipywidgets.Dropdown):
        control.value = next(option for option in control.options if option != control.value)
    elif isinstance(control, ipywidgets.SelectionSlider):
        values = [value for _, value in control.options]
        index = values.index(control.value)
        control.value = values[index + 1 if index + 1 < len(values) else index - 1]
    elif isinstance(control, ipywidgets.FloatLogSlider):
        control.value = control.value * control.base ** (10 * control.step) \
            if control.value * control.base ** (10 * control.step) <= control.base ** control.max \
            else control.value / control.base ** (10 * control.step)
    else:
        control.value = control.value + control.step if control.value + control.step <= control.max \
            else control.value - control.step


def test_the_checkpoint_explorer_redraws_on_release_for_every_control():
    # 7 controls: parameters, GPUs, GPU-years per failure, one writer's and the storage's bandwidth, restart, layout
    explorer = checkpoint_plots.checkpoint_explorer()
    check_every_control_redraws(explorer, 7, _move)
    summary = explorer.children[1].value
    assert "GB per checkpoint" in summary and "(Young)" in summary


def test_the_explorer_survives_its_extremes_and_says_when_failures_outpace_the_checkpoints():
    # 2 trillion parameters written by one writer at 0.1 GB/s, a failure every 4 minutes: e^(tau + C)/M overflows
    assert model.expected_lost_fraction(1e4, 2.4e5, 240.0, 3600.0) == 1.0
    summary = checkpoint_plots.checkpoint_explorer(parameters_b=1995, gpus=65536, gpu_years_per_failure=0.5,
                                                   layout="full", writer_gb_s=0.1, restart_min=60).children[1].value
    assert "lose 100 % of the time" in summary and "over 100 %" in summary and "Failures come too often" in summary
    assert "Impossible as set: the full layout gathers 23.9 TB into rank 0's host" in summary


def test_the_explorer_flags_a_full_checkpoint_no_host_can_gather_and_shows_the_gpu_count():
    explorer = checkpoint_plots.checkpoint_explorer(layout="full")  # 4.86 TB into one host
    assert "Impossible as set" in explorer.children[1].value
    assert "Impossible" not in checkpoint_plots.checkpoint_explorer(parameters_b=70, layout="full").children[1].value
    assert "Impossible" not in checkpoint_plots.checkpoint_explorer(layout="sharded").children[1].value
    gpus = explorer.children[0].children[0].children[1]
    assert gpus.description == "GPUs" and gpus.label == "16,384" and gpus.value == 16_384


def test_the_checkpoint_explorers_sliders_are_as_wide_as_their_description_and_a_track():
    # The squeezed 14 px tracks: a 23-character description inside ipywidgets' default 300 px slider.
    controls = [control for box in checkpoint_plots.checkpoint_explorer().children[0].children
                for control in box.children]
    sliders = [control for control in controls if not isinstance(control, ipywidgets.Dropdown)]
    assert len(sliders) == 6
    for slider in sliders:
        assert slider.layout.width == (f"calc({slider.style.description_width} + "
                                       f"{checkpoint_plots.SLIDER_ROOM})"), slider.description
    assert int(checkpoint_plots.SLIDER_ROOM.removesuffix("px")) >= 200


def test_the_explorers_defaults_are_llama_3s_failure_rate():
    summary = checkpoint_plots.checkpoint_explorer(layout="sharded").children[1].value
    assert "the job fails every 3.09 h" in summary  # 5.78 GPU-years / 16,384 GPUs (419 in 54 days)
    assert "4,860 GB per checkpoint" in summary  # 405e9 x 12 bytes
    assert "written in 2.43 s" in summary  # at the 2 TB/s Llama 3's storage sustains


def test_probing_gloo_finds_every_collective_and_refuses_premul_sum():
    for ranks in (2, 3):
        found = launch(pitfalls.probe_collectives, nprocs=ranks, rank_output="none")
        assert all(probe == found[0] for probe in found)  # the same answer on every rank
        refused = {name for name, why in found[0].items() if why}
        assert refused == {"all_reduce (PREMUL_SUM)"}, found[0]
        assert "Gloo" in found[0]["all_reduce (PREMUL_SUM)"]
        assert {"send / recv", "reduce_scatter", "all_to_all", "all_reduce (AVG)"} <= set(found[0])
    with pytest.raises(Exception, match="needs at least 2 ranks"):
        launch(pitfalls.probe_collectives, nprocs=1, rank_output="none")
