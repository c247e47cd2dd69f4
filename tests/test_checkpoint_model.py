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
    assert any(label.startswith("Young: τ* = √(2CM) = 18.3 min") for label in labels), labels
    assert "simulated failures (Poisson)" in labels and any("your interval: 8.33 min" in x for x in labels)
    assert axis.get_xscale() == "log" and "hours" in axis.get_xlabel() and "%" in axis.get_ylabel()


def _move(control) -> None:
    if isinstance(control, ipywidgets.Dropdown):
        control.value = next(option for option in control.options if option != control.value)
    elif isinstance(control, ipywidgets.FloatLogSlider):
        control.value = control.value * control.base ** (10 * control.step) \
            if control.value * control.base ** (10 * control.step) <= control.base ** control.max \
            else control.value / control.base ** (10 * control.step)
    else:
        control.value = control.value + control.step if control.value + control.step <= control.max \
            else control.value - control.step


def test_the_checkpoint_explorer_redraws_on_release_for_every_control():
    # 7 controls: parameters, GPUs, one GPU's MTBF, one writer's and the storage's bandwidth, restart, layout
    explorer = checkpoint_plots.checkpoint_explorer()
    check_every_control_redraws(explorer, 7, _move)
    summary = explorer.children[1].value
    assert "GB per checkpoint" in summary and "(Young)" in summary


def test_the_explorers_defaults_are_llama_3s_failure_rate():
    summary = checkpoint_plots.checkpoint_explorer(layout="sharded").children[1].value
    assert "the job fails every 2.78 h" in summary  # 5.2 GPU-years / 16,384 GPUs (466 in 54 days)
    assert "4,860 GB per checkpoint" in summary  # 405e9 x 12 bytes


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
