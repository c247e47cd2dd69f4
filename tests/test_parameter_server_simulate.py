"""Lesson 08's analytical side: the parameter-server simulator (``labkit.parallel.parameter_server.simulate``), the straggler
model (``labkit.costmodel.stragglers``) held to it, and the plots and explorer (``labkit.viz.ps_plots``).

The simulator runs the server's own rule (``Gate``): with no delay its times are exact (a synchronous update is
compute + 2 messages; equal asynchronous workers settle at staleness N - 1); SSP keeps every worker within s clocks
of the slowest and, with a persistent straggler, goes at its pace (the closed form), while with random delays it
is nearly as fast as async; the bounded delay never passes tau; backup workers make each update from the first N -
b.  The closed forms are then held to a Monte Carlo of 2000 updates.
No process is launched.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import Counter

import ipywidgets
import pytest
from matplotlib.figure import Figure

from labkit.costmodel import stragglers as model
from labkit.parallel.parameter_server import ParameterServerRun, Received, Stragglers
from labkit.parallel.parameter_server.simulate import clock_gap
from labkit.parallel.parameter_server.simulate import simulate_parameter_server as simulate
from labkit.viz import ps_plots
from tests.conftest import check_every_control_redraws, explorer_controls

OPTIONS = {"sync": {}, "async": {}, "ssp": {"staleness_bound": 2}, "bounded_delay": {"max_delay": 2},
           "backup": {"backup_workers": 1}}


def _records_match_computes(timeline) -> None:
    """Every gradient a worker computed is recorded once, in its step order, applied or dropped."""
    for worker, row in enumerate(timeline.computes):
        mine = [r for r in timeline.received if r.worker == worker]
        assert [r.step for r in mine] == list(range(len(row)))
        assert [r.pulled for r in mine] == [pulled for *_, pulled in row]


# ---------------------------------------------------------------------------------------------------------
# The simulator, exactly


def test_sync_without_delay_makes_every_update_in_compute_plus_two_messages():
    timeline = simulate("sync", 3, 10, compute_s=1.0, message_s=0.25)
    assert timeline.update_times_s == [1.5 * (k + 1) for k in range(10)]
    assert timeline.seconds_per_update == 1.5 == model.sync_update_s(3, 1.0, 0.25)
    assert timeline.computes[2][:2] == [(0.25, 1.25, 0), (1.75, 2.75, 1)]
    assert set(timeline.staleness()) == {0} and Counter(r.applied for r in timeline.applied) == {k: 3 for k in range(10)}
    _records_match_computes(timeline)
    slowed = simulate("sync", 3, 10, compute_s=1.0, message_s=0.25, stragglers=Stragglers(slow={1: 0.5}))
    assert slowed.seconds_per_update == 2.0 == model.sync_update_s(3, 1.0, 0.25, slow_s=0.5)  # waits every step
    assert slowed.holds[0] == [(1.5 + 2 * k, 2.0 + 2 * k) for k in range(10)] and slowed.holds[1] == []


def test_async_with_equal_workers_settles_at_staleness_n_minus_one_and_ignores_a_straggler():
    timeline = simulate("async", 4, 40, compute_s=1.0, message_s=0.25)
    assert timeline.staleness() == [0, 1, 2, 3] + [3] * 36  # the first round starts together
    assert timeline.seconds_per_update == 1.5 / 4 and all(not holds for holds in timeline.holds)
    assert statistics.mean(simulate("async", 4, 400, compute_s=1.0).staleness()) == pytest.approx(3, abs=0.02)
    slowed = simulate("async", 4, 400, compute_s=1.0, stragglers=Stragglers(slow={3: 1.0}))
    per_worker = [statistics.mean(r.staleness for r in slowed.applied if r.worker == w) for w in range(4)]
    assert per_worker == pytest.approx(model.async_staleness([1.0, 1.0, 1.0, 2.0]), rel=0.02)  # 2.5 and 6
    assert statistics.mean(slowed.staleness()) == pytest.approx(3, abs=0.05)
    assert slowed.seconds_per_update == pytest.approx(model.throughput("async", 4, 1.0, slow_s=1.0).seconds_per_update,
                                                      rel=0.01)


@pytest.mark.parametrize("seed", range(3))
def test_the_bounded_delay_is_never_staler_than_tau_and_reaches_it(seed):
    delays = Stragglers(exponential_mean_s=0.5, seed=seed)
    for tau in (0, 1, 3):
        timeline = simulate("bounded_delay", 4, 300, compute_s=1.0, max_delay=tau, stragglers=delays)
        assert max(timeline.staleness()) == tau  # never above, and the bound is what binds
        _records_match_computes(timeline)
    assert simulate("bounded_delay", 4, 50, max_delay=0, stragglers=delays).received == \
        simulate("sync", 4, 50, stragglers=delays).received  # tau = 0 is sync, gradient for gradient
    assert max(simulate("async", 4, 300, stragglers=delays).staleness()) > 3  # what the bound prevents


@pytest.mark.parametrize("seed", range(3))
def test_ssp_keeps_every_worker_within_s_clocks_and_a_persistent_straggler_sets_the_pace(seed):
    delays = Stragglers(slow={3: 1.5}, exponential_mean_s=0.5, seed=seed)
    for s in (0, 1, 3):
        timeline = simulate("ssp", 4, 400, compute_s=1.0, message_s=0.1, staleness_bound=s, stragglers=delays)
        assert clock_gap(timeline.received, 4) == s  # never more, and the slow worker makes it bind
        assert max(timeline.staleness()) > s  # a bound on clocks, not on staleness
        _records_match_computes(timeline)
        counts = Counter(r.worker for r in timeline.applied)
        assert max(counts.values()) - min(counts.values()) <= s + 1
    fixed = Stragglers(slow={3: 1.5})
    pace = model.throughput("ssp", 4, 1.0, 0.1, slow_s=1.5).seconds_per_update  # (1.2 + 1.5) / 4
    assert pace == pytest.approx(2.7 / 4)
    for s in (0, 2):
        timeline = simulate("ssp", 4, 2000, compute_s=1.0, message_s=0.1, staleness_bound=s, stragglers=fixed)
        assert timeline.seconds_per_update == pytest.approx(pace, rel=0.01)  # as slow as sync, per gradient
    random_delays = Stragglers(exponential_mean_s=0.5, seed=seed)  # transient stragglers: ssp absorbs most
    ssp = [simulate("ssp", 4, 2000, compute_s=1.0, staleness_bound=s, stragglers=random_delays).seconds_per_update
           for s in (1, 3)]
    asynchronous = simulate("async", 4, 2000, compute_s=1.0, stragglers=random_delays).seconds_per_update
    sync = model.sync_update_s(4, 1.0, exponential_mean_s=0.5) / 4  # per gradient
    assert asynchronous < ssp[1] < ssp[0] < (asynchronous + sync) / 2


@pytest.mark.parametrize("seed", range(3))
def test_backup_makes_each_update_from_the_first_n_minus_b_and_drops_the_late(seed):
    timeline = simulate("backup", 5, 200, compute_s=1.0, backup_workers=2,
                        stragglers=Stragglers(exponential_mean_s=0.5, seed=seed))
    assert Counter(r.applied for r in timeline.applied) == {k: 3 for k in range(200)}
    assert set(timeline.staleness()) == {0}
    for version in range(200):  # the dropped gradients of a version arrived after its update
        update = timeline.update_times_s[version]
        late = [r.time_s for r in timeline.received if r.pulled == version and r.applied is None]
        assert all(time > update for time in late) or version == 199
    assert sum(r.applied is None for r in timeline.received) >= 2 * 200 * 0.9
    _records_match_computes(timeline)
    straggler = simulate("backup", 4, 50, compute_s=1.0, message_s=0.25, backup_workers=1,
                         stragglers=Stragglers(slow={2: 0.3}))
    assert straggler.seconds_per_update == pytest.approx(1.5) == model.sync_update_s(4, 1.0, 0.25, slow_s=0.3,
                                                                                     backup_workers=1)
    assert not any(r.worker == 2 for r in straggler.applied)  # always among the dropped


@pytest.mark.parametrize("mode", list(OPTIONS))
def test_every_gradient_is_recorded_once_and_the_budget_is_kept(mode):
    timeline = simulate(mode, 4, 30, compute_s=1.0, message_s=0.1,
                        stragglers=Stragglers(slow={1: 0.4}, exponential_mean_s=0.3, seed=7), **OPTIONS[mode])
    _records_match_computes(timeline)
    assert len(timeline.update_times_s) == 30 and sorted({r.applied for r in timeline.applied}) == list(range(30))
    assert [r.time_s for r in timeline.received] == sorted(r.time_s for r in timeline.received)
    assert all(r.time_s > timeline.update_times_s[-1] for r in timeline.received if r.pulled == 30)
    assert all(isinstance(r, Received) and math.isnan(r.loss) for r in timeline.received)
    with pytest.raises(AssertionError):  # the check sees a gradient gone missing
        _records_match_computes(dataclasses.replace(timeline, received=timeline.received[1:]))


# ---------------------------------------------------------------------------------------------------------
# The model against a Monte Carlo of the simulator


def test_harmonic_numbers_and_order_statistics():
    assert model.harmonic(0) == 0 and model.harmonic(1) == 1 and model.harmonic(4) == pytest.approx(25 / 12)
    assert model.expected_kth_fastest_s(4, 4, 2.0) == pytest.approx(2 * 25 / 12)  # the slowest: mu H_N
    assert model.expected_kth_fastest_s(1, 4, 2.0) == pytest.approx(0.5)  # the fastest: mu / N
    assert model.sync_update_s(8, 1.0, 0.1, 0.5, backup_workers=2) == pytest.approx(1.2 + 0.5 * (model.harmonic(8)
                                                                                                  - 1.5))


@pytest.mark.parametrize("workers", [2, 4, 8])
def test_sync_step_matches_mu_times_h_n_over_2000_steps(workers):
    timeline = simulate("sync", workers, 2000, compute_s=1.0, message_s=0.1,
                        stragglers=Stragglers(exponential_mean_s=0.5, seed=workers))
    predicted = model.throughput("sync", workers, 1.0, 0.1, exponential_mean_s=0.5)
    assert timeline.seconds_per_update == pytest.approx(predicted.seconds_per_update, rel=0.02)
    assert len(timeline.applied) / timeline.update_times_s[-1] == pytest.approx(predicted.gradients_per_s, rel=0.02)
    without_tail = model.sync_update_s(workers, 1.0, 0.1) + 0.5  # a mean delay, not the slowest one
    assert workers == 2 or timeline.seconds_per_update > 1.05 * without_tail


@pytest.mark.parametrize("workers", [2, 4, 8])
def test_async_rate_matches_the_renewal_model_over_2000_updates(workers):
    delays = Stragglers(slow={workers - 1: 0.7}, exponential_mean_s=0.5, seed=workers)
    timeline = simulate("async", workers, 2000, compute_s=1.0, message_s=0.1, stragglers=delays)
    round_trips = [1.7] * (workers - 1) + [2.4]
    assert timeline.seconds_per_update == pytest.approx(model.async_update_s(round_trips), rel=0.03)
    assert statistics.mean(timeline.staleness()) == pytest.approx(workers - 1, abs=0.05 * workers)


def test_backup_formula_is_a_lower_bound_when_late_workers_finish_first():
    for workers, backups in ((4, 1), (8, 2)):
        timeline = simulate("backup", workers, 2000, compute_s=1.0, backup_workers=backups,
                            stragglers=Stragglers(exponential_mean_s=0.2, seed=1))
        ideal = model.sync_update_s(workers, 1.0, exponential_mean_s=0.2, backup_workers=backups)
        sync = model.sync_update_s(workers, 1.0, exponential_mean_s=0.2)
        assert ideal < timeline.seconds_per_update < sync  # backups help, less than the formula promises
        assert 0.25 * 0.2 < timeline.seconds_per_update - ideal < 0.45 * 0.2  # the docstring's 0.25 to 0.45 mu


def test_model_modes_and_bad_inputs():
    assert model.throughput("bounded_delay", 4, 1.0) is None and model.throughput("ssp", 4, 1.0, 0, 0.5) is None
    assert model.throughput("ssp", 4, 1.0).seconds_per_update == 0.25  # equal workers: async's rate
    backup = model.throughput("backup", 4, 1.0, exponential_mean_s=0.5, backup_workers=1)
    assert backup.gradients_per_update == 3 and backup.gradients_per_s == pytest.approx(3 / backup.seconds_per_update)
    assert model.throughput("async", 4, 1.0).updates_per_s == pytest.approx(4.0)
    for call, message in ((lambda: model.throughput("bsp", 4, 1.0), "mode"),
                          (lambda: model.throughput("sync", 0, 1.0), "workers"),
                          (lambda: model.throughput("sync", 4, 1.0, backup_workers=1), "backup_workers"),
                          (lambda: model.throughput("backup", 4, 1.0, backup_workers=4), r"backup_workers.*\[0, 4\)"),
                          (lambda: model.throughput("sync", 4, -1.0), "compute_s"),
                          (lambda: model.sync_update_s(4, 1.0, exponential_mean_s=0.1, slow_s=0.2), "one kind"),
                          (lambda: model.throughput("async", 4, 0.0), "round trip"),
                          (lambda: model.async_update_s([1.0, 0.0]), "round_trips_s"),
                          (lambda: model.harmonic(-1), "n must"),
                          (lambda: model.expected_kth_fastest_s(5, 4, 1.0), "k must")):
        with pytest.raises(ValueError, match=message):
            call()


@pytest.mark.parametrize("arguments, message", [
    ({"mode": "bsp"}, "mode must be one of"),
    ({"workers": 0}, "workers must be an integer >= 1, got 0"),
    ({"workers": 2.5}, "workers must be an integer"),
    ({"updates": 0}, "updates"),
    ({"compute_s": -1.0}, "compute_s must be a number of seconds >= 0, got -1.0"),
    ({"message_s": "fast"}, "message_s"),
    ({"mode": "ssp"}, "staleness_bound"),
    ({"mode": "ssp", "staleness_bound": -1}, "staleness_bound must be an integer >= 0"),
    ({"mode": "bounded_delay"}, "max_delay belongs to mode='bounded_delay'"),
    ({"mode": "bounded_delay", "max_delay": -1}, "max_delay must be an integer >= 0"),
    ({"max_delay": 2}, "max_delay belongs to mode='bounded_delay'"),
    ({"backup_workers": 1}, "backup_workers belongs to mode='backup'"),
    ({"mode": "backup", "backup_workers": 4}, r"backup_workers must be an integer in \[0, 4\)"),
    ({"stragglers": Stragglers(slow={4: 0.1})}, r"names workers \[4\], but the workers are 0..3"),
    ({"stragglers": {"slow": {0: 1.0}}}, "stragglers must be"),
])
def test_simulator_rejects_bad_input_naming_the_value(arguments, message):
    with pytest.raises(ValueError, match=message):
        simulate(**{"workers": 4, **arguments})


# ---------------------------------------------------------------------------------------------------------
# The plots


def _boxes(axis, gid: str) -> list[tuple[float, float, float]]:
    """``(start, end, row centre)`` of every box in the collections called ``gid``."""
    return sorted((round(float(path.vertices[:, 0].min()), 6), round(float(path.vertices[:, 0].max()), 6),
                   round(float(path.vertices[:, 1].min() + path.vertices[:, 1].max()) / 2, 6))
                  for collection in axis.collections if collection.get_gid() == gid for path in collection.get_paths())


def test_timeline_draws_each_gradient_where_it_was_computed_labelled_with_its_version():
    timeline = simulate("backup", 4, 6, compute_s=0.01, message_s=0.001, backup_workers=1,
                        stragglers=Stragglers(exponential_mean_s=0.004, seed=2))
    axis = ps_plots.plot_ps_timeline(timeline)
    applied = {(r.worker, r.step) for r in timeline.applied}
    for gid, keep in (("applied", True), ("dropped", False)):
        expected = sorted((round(1e3 * start, 6), round(1e3 * end, 6), float(3 - worker))
                          for worker, row in enumerate(timeline.computes) for step, (start, end, _) in enumerate(row)
                          if ((worker, step) in applied) == keep)
        assert _boxes(axis, gid) == expected and expected  # worker 0 on top, under the server's row
    assert len(_boxes(axis, "delay")) == sum(len(row) for row in timeline.computes)
    assert len(_boxes(axis, "held")) == sum(len(holds) for holds in timeline.holds) > 0
    versions = sorted(text.get_text() for text in axis.texts if text.get_gid() == "version")
    assert versions == sorted(str(pulled) for row in timeline.computes for *_, pulled in row)
    updates = next(c for c in axis.collections if c.get_gid() == "update")
    assert len(updates.get_segments()) == 6
    assert axis.get_xlabel() == "time (ms)" and axis.get_title().startswith("backup: N = 4, b = 1;")
    assert "ms per update" in axis.get_title() and isinstance(axis.figure, Figure)
    legend = [text.get_text() for text in axis.get_legend().get_texts()]
    assert "held at the server (waiting)" in legend and "gradient dropped" in legend
    assert axis.get_xlim()[1] == pytest.approx(1e3 * timeline.total_s)
    assert ps_plots.plot_ps_timeline(timeline, until_s=0.02).get_xlim() == pytest.approx((0, 20))
    with pytest.raises(ValueError, match="until_s"):
        ps_plots.plot_ps_timeline(timeline, until_s=0)


def test_staleness_histogram_puts_measured_beside_simulated_and_the_model():
    axis = ps_plots.plot_staleness({"measured": [3, 3, 2, 3], "simulated": [0, 1, 2, 3, 3, 3, 3, 3]}, model_mean=3,
                                   bound=3)
    measured, simulated = axis.containers
    assert [bar.get_height() for bar in measured] == [0, 0, 25, 75]
    assert [bar.get_height() for bar in simulated] == [12.5, 12.5, 12.5, 62.5]
    assert measured[3].get_x() < simulated[3].get_x()  # side by side
    legend = [text.get_text() for text in axis.get_legend().get_texts()]
    assert legend == ["model mean 3", "bound τ = 3", "measured (mean 2.75)", "simulated (mean 2.25)"]
    assert [tick.get_text() for tick in axis.get_xticklabels()] == ["0", "1", "2", "3"]
    synchronous = ps_plots.plot_staleness({"simulated": [0] * 40}, model_mean=0)  # one bar: ticks stay integers
    assert [tick.get_text() for tick in synchronous.get_xticklabels()] == ["0", "1"]
    assert synchronous.get_xlim() == pytest.approx((-0.6, 1.6))
    long_tail = ps_plots.plot_staleness({"measured": list(range(30))})
    assert len(long_tail.get_xticks()) <= 13 and all(tick == int(tick) for tick in long_tail.get_xticks())
    assert "%" in axis.get_ylabel() and "updates" in axis.get_xlabel()
    with pytest.raises(ValueError, match="staleness"):
        ps_plots.plot_staleness({"measured": []})


def test_loss_curves_read_a_launched_runs_records_against_updates_and_seconds():
    def run(losses_by_version: list[list[float]], times: list[float]) -> ParameterServerRun:
        received = [Received(worker, version, version, version, 0.0, loss)
                    for version, losses in enumerate(losses_by_version) for worker, loss in enumerate(losses)]
        return ParameterServerRun("sync", 2, received, times, {})

    runs = {"sync": run([[2.0, 1.0], [1.0, 0.5], [0.5, 0.5]], [1.0, 2.0, 3.0]),
            "async": run([[2.0], [1.6], [1.2], [0.8]], [0.5, 1.0, 1.5, 2.0])}
    figure = ps_plots.plot_loss_curves_ps(runs)
    by_update, by_time = figure.axes
    assert list(by_update.lines[0].get_ydata()) == [1.5, 0.75, 0.5] and list(by_update.lines[0].get_xdata()) == [0, 1, 2]
    assert list(by_time.lines[0].get_xdata()) == [0.0, 1.0, 2.0] and list(by_time.lines[1].get_xdata()) == [0, .5, 1, 1.5]
    assert by_update.lines[0].get_color() == ps_plots.MODE_COLORS["sync"]
    assert "updates" in by_update.get_xlabel() and by_time.get_xlabel() == "wall-clock (s)"
    assert "nats" in by_update.get_ylabel()
    by_gradient = ps_plots.plot_loss_curves_ps(runs, x="gradients", log=True, ylabel="squared error").axes[0]
    assert list(by_gradient.lines[0].get_xdata()) == [0, 2, 4]  # a synchronous update applies both gradients
    assert list(by_gradient.lines[1].get_xdata()) == [0, 1, 2, 3] and by_gradient.get_yscale() == "log"
    assert by_gradient.get_xlabel() == "gradients applied" and by_gradient.get_ylabel() == "squared error, log scale"
    with pytest.raises(ValueError, match="'updates' or 'gradients'"):
        ps_plots.plot_loss_curves_ps(runs, x="versions")
    smoothed = ps_plots.plot_loss_curves_ps(runs, smooth=2).axes[0]
    assert list(smoothed.lines[1].get_ydata()) == pytest.approx([2.0, 1.8, 1.4, 1.0])
    with pytest.raises(ValueError, match="no losses"):
        ps_plots.plot_loss_curves_ps({"simulated": simulate("sync", 2, 3)})


def test_seconds_per_update_sets_each_simulated_mode_beside_its_closed_form():
    simulated = {ps_plots.describe(mode, 4, 1, 2, 2): simulate(mode, 4, 20, compute_s=0.01, **OPTIONS[mode])
                 for mode in OPTIONS}
    models = {label: model.throughput(t.mode, 4, 0.01, backup_workers=t.backup_workers)
              for label, t in simulated.items()}
    axis = ps_plots.plot_seconds_per_update(simulated, models)
    heights = [container[0].get_height() for container in axis.containers]
    bounded = 1e3 * simulated["bounded_delay: N = 4, τ = 2"].seconds_per_update
    assert heights == pytest.approx([10, 10, 2.5, 2.5, 2.5, 2.5, bounded, 10, 10]) and 2.5 < bounded < 10
    assert sum("no closed form" in text.get_text() for text in axis.texts) == 1  # the bounded delay's
    assert axis.get_ylabel() == "wall-clock per update (ms)" and "(ms)" in axis.get_title()
    assert [text.get_text() for text in axis.get_legend().get_texts()] == ["simulated", "model (closed form)"]
    assert [tick.get_text() for tick in axis.get_xticklabels()][3:] == ["bounded_delay:\nN = 4, τ = 2",
                                                                        "backup: N =\n4, b = 1"]


# ---------------------------------------------------------------------------------------------------------
# The explorer


def _move(control) -> None:
    if isinstance(control, ipywidgets.Dropdown):
        control.value = next(option for option in control.options if option != control.value)
    else:
        control.value = control.value + control.step if control.value + control.step <= control.max \
            else control.value - control.step


@pytest.mark.parametrize("mode", ["sync", "bounded_delay"])
def test_ps_explorer_redraws_on_release_for_every_control(mode):
    # 8 controls: mode, N, b, s, tau, straggler kind, straggler delay, message time
    check_every_control_redraws(ps_plots.ps_explorer(mode=mode, updates=60), 8, _move)


def test_explorer_moves_the_backup_ssp_and_delay_bars_whatever_the_mode_and_shows_bad_combinations(monkeypatch):
    drawn: list[Figure] = []
    overview = ps_plots.plot_ps_overview
    monkeypatch.setattr(ps_plots, "plot_ps_overview", lambda *a, **k: drawn.append(overview(*a, **k)) or drawn[-1])
    explorer = ps_plots.ps_explorer(mode="sync", updates=60)
    controls = {control.description: control for control in explorer_controls(explorer)}
    summary = explorer.children[1]
    assert "μ·H_N = 4·2.083" in summary.value

    def bars() -> list[float]:
        return [container[0].get_height() for container in drawn[-1].axes[2].containers]

    before = bars()  # sync 2, async 2, ssp 1 (random delays: no closed form), bounded_delay 1, backup 2
    controls["backup workers b"].value = 2
    after = bars()
    assert after[:6] == before[:6] and after[6:] != before[6:]  # only backup's bars moved
    controls["straggler"].value = ps_plots.STRAGGLERS[0]
    controls["ssp: clock bound s"].value = 0
    assert bars()[4] == pytest.approx(bars()[0] / 4)  # ssp with s = 0 is sync, one gradient an update
    assert bars()[5] == pytest.approx(bars()[0] / 4)  # and its closed form, the slow worker's pace
    controls["bounded delay τ"].value = 0
    assert bars()[6] == pytest.approx(bars()[0])  # and so is tau = 0, update for update
    controls["workers N"].value, controls["mode"].value = 2, "backup"
    assert "cannot run" in summary.value and "backup_workers must be an integer in [0, 2)" in summary.value
    assert any(text.get_text().startswith("ValueError: ") for text in drawn[-1].axes[0].texts)
