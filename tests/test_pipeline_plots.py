"""Lesson 07's pictures: a pipeline timeline (simulated or measured), the bubble against m, the activations held
per rank, and the explorer that composes them."""

from __future__ import annotations

import itertools

import ipywidgets
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from labkit.parallel.pipeline import (
    Action,
    Schedule,
    Timeline,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    simulate,
    zb_h1,
)
from labkit.viz import pipeline_plots, pipeline_widgets
from tests.conftest import check_every_control_redraws, explorer_controls

BUILDERS = {"GPipe": gpipe, "1F1B": one_f_one_b, "Interleaved 1F1B": lambda p, m: interleaved_1f1b(p, m, 2),
            "ZB-H1": zb_h1}
SCHEDULES = {"GPipe": lambda: gpipe(3, 4), "1F1B": lambda: one_f_one_b(3, 4),
             "Interleaved 1F1B": lambda: interleaved_1f1b(2, 4, 2), "ZB-H1": lambda: zb_h1(3, 4)}


def _boxes(axis, prefix: str = "") -> list[tuple[float, float, float]]:
    """``(start, end, row centre)`` of every box drawn in collections whose gid starts with ``prefix``."""
    found = []
    for collection in axis.collections:
        gid = collection.get_gid() or ""
        if gid != "idle" and gid.startswith(prefix):
            for path in collection.get_paths():
                xs, ys = path.vertices[:, 0], path.vertices[:, 1]
                found.append((round(float(xs.min()), 9), round(float(xs.max()), 9), round(float(ys.min() + ys.max()) / 2, 9)))
    return sorted(found)


def _labels(axis) -> list[str]:
    return sorted(text.get_text() for text in axis.texts if text.get_gid() == "microbatch")


def _legend(axis) -> list[str]:
    return [text.get_text() for text in axis.get_legend().get_texts()]


def _measured() -> Timeline:
    """What a runtime returns for 1F1B on 2 ranks, 2 micro-batches: seconds from a common origin, uneven."""
    schedule = one_f_one_b(2, 2)
    f, b = Action(0, "F", 0), Action(0, "B", 0)
    events = [[(0.0012, 0.0031, f), (0.0033, 0.0049, Action(0, "F", 1)), (0.0092, 0.0131, b),
               (0.0135, 0.0170, Action(0, "B", 1))],
              [(0.0034, 0.0052, Action(1, "F", 0)), (0.0053, 0.0090, Action(1, "B", 0)),
               (0.0091, 0.0110, Action(1, "F", 1)), (0.0111, 0.0133, Action(1, "B", 1))]]
    return Timeline(schedule, events, total=0.0170, peak_activations=[2, 1])


# ---------------------------------------------------------------------------------------------------------
# The timeline


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_timeline_draws_each_action_where_it_ran_with_its_micro_batch_written_in_it(name):
    timeline = simulate(SCHEDULES[name]())
    axis = pipeline_plots.plot_timeline(timeline)
    p = timeline.schedule.p
    expected = sorted((float(start), float(end), float(p - 1 - rank)) for rank, row in enumerate(timeline.events)
                      for start, end, _ in row)
    assert _boxes(axis) == expected  # rank 0 on top: the highest row
    assert _labels(axis) == sorted(str(action.microbatch) for row in timeline.events for *_, action in row)
    kinds = {action.kind for row in timeline.events for *_, action in row}
    legend = _legend(axis)
    assert [entry for entry in legend if entry[1] == ":"] == [pipeline_plots.KIND_NAMES[k] for k in "FBIW"
                                                             if k in kinds]
    assert "idle (bubble)" in legend and axis.get_xlabel() == "time (units)"
    idle = [c for c in axis.collections if c.get_gid() == "idle"]
    assert len(idle) == p and all(c.get_paths()[0].vertices[:, 0].max() == timeline.total for c in idle)
    title = axis.get_title()
    assert name in title and f"p = {p}" in title and f"m = {timeline.schedule.m}" in title
    assert f"v = {timeline.schedule.v}" in title and f"bubble {100 * timeline.bubble_fraction:.1f}%" in title
    assert isinstance(axis.figure, Figure)


def test_timeline_colours_kinds_apart_and_shows_an_interleaved_ranks_second_chunk():
    colours = list(pipeline_plots.KIND_COLORS.values())
    assert len(set(colours)) == 4
    axis = pipeline_plots.plot_timeline(simulate(interleaved_1f1b(2, 4, 2)))
    first, second = ([c for c in axis.collections if c.get_gid() == f"F chunk {chunk}"] for chunk in (0, 1))
    assert first and second and all(c.get_hatch() == "" for c in first) and all(c.get_hatch() for c in second)
    assert tuple(second[0].get_facecolor()[0][:3]) > tuple(first[0].get_facecolor()[0][:3])  # lighter
    assert _boxes(axis, "F chunk 1") and all(box[0] >= 1 for box in _boxes(axis, "F chunk 1"))  # after stage 0
    assert "chunk 1: stages 2–3" in _legend(axis)
    assert not any(entry.startswith("chunk") for entry in _legend(pipeline_plots.plot_timeline(simulate(
        one_f_one_b(2, 4)))))


def test_timeline_of_a_measured_run_is_drawn_in_milliseconds():
    timeline = _measured()
    axis = pipeline_plots.plot_timeline(timeline, time_unit="s", title="measured")
    assert axis.get_xlabel() == "time (ms)" and axis.get_title().startswith("measured: p = 2, m = 2, v = 1")
    assert _boxes(axis)[0] == (1.2, 3.1, 1.0) and _boxes(axis)[-1] == (13.5, 17.0, 1.0)
    assert axis.get_xlim() == pytest.approx((0.0, 17.0))
    assert f"bubble {100 * timeline.bubble_fraction:.1f}%" in axis.get_title()
    assert _labels(axis) == ["0", "0", "0", "0", "1", "1", "1", "1"]
    shuffled = Timeline(timeline.schedule, [list(reversed(row)) for row in timeline.events], timeline.total, [2, 1])
    assert pipeline_plots.peak_per_rank(timeline) == pipeline_plots.peak_per_rank(shuffled) == [2, 1]
    assert pipeline_plots.plot_timeline(simulate(one_f_one_b(2, 2), 1e-3, 2e-3), time_unit="ms").get_xlabel() \
        == "time (ms)"
    with pytest.raises(ValueError, match="time_unit"):
        pipeline_plots.plot_timeline(timeline, time_unit="minutes")
    with pytest.raises(ValueError, match="no events"):
        pipeline_plots.plot_timeline(Timeline(one_f_one_b(2, 2), [[], []], 0.0, [0, 0]))


def test_micro_batch_labels_shrink_in_narrow_boxes_and_vanish_in_the_narrowest():
    wide = pipeline_plots.plot_timeline(simulate(one_f_one_b(2, 2)))
    assert {text.get_fontsize() for text in wide.texts if text.get_gid() == "microbatch"} == {8.0}
    narrow_axis = Figure(figsize=(5.0, 2.0)).subplots()
    timeline = simulate(one_f_one_b(2, 16))
    pipeline_plots.plot_timeline(timeline, ax=narrow_axis)
    sizes = [text.get_fontsize() for text in narrow_axis.texts if text.get_gid() == "microbatch"]
    actions = sum(len(row) for row in timeline.events)
    assert 0 < len(sizes) < actions and 4 <= min(sizes) < 8  # some shrunk, the two-digit F's dropped


def test_timelines_stack_over_one_time_axis():
    timelines = [simulate(make()) for make in SCHEDULES.values()]
    figure = pipeline_plots.plot_timelines(timelines)
    assert len(figure.axes) == 4
    assert len({axis.get_xlim() for axis in figure.axes}) == 1
    assert figure.axes[0].get_xlim()[1] == max(timeline.total for timeline in timelines)
    assert [axis.get_xlabel() for axis in figure.axes] == ["", "", "", "time (units)"]
    assert [axis.get_title().split(":")[0] for axis in figure.axes] == list(SCHEDULES)
    compared = pipeline_plots.plot_timelines([simulate(one_f_one_b(2, 2), 2e-3, 4e-3), _measured()],
                                             titles=["simulated", "measured"], time_unit="s")
    assert [axis.get_title().split(":")[0] for axis in compared.axes] == ["simulated", "measured"]
    assert compared.axes[1].get_xlabel() == "time (ms)" and compared.axes[0].get_xlim()[1] == pytest.approx(18.0)
    with pytest.raises(ValueError, match="titles"):
        pipeline_plots.plot_timelines(timelines, titles=["one"])


# ---------------------------------------------------------------------------------------------------------
# The bubble and the activations


def test_bubble_plot_puts_simulated_and_measured_points_on_the_closed_forms():
    ms = [1, 2, 4, 8, 16]
    rows = [simulate(make(4, m)) for make in (gpipe, one_f_one_b, zb_h1) for m in ms]
    rows += [simulate(interleaved_1f1b(4, m, 2), 0.5, 1.0) for m in (4, 8, 16)]
    rows.append({"label": "1F1B measured", "m": 8, "bubble_fraction": 0.31, "measured": True})
    axis = pipeline_plots.plot_bubble(ms, rows, p=4, v=2)
    solid, dashed, *markers = axis.lines
    assert solid.get_ydata()[0] == pytest.approx(100 * 3 / 4) and solid.get_ydata()[-1] == pytest.approx(100 * 3 / 19)
    assert dashed.get_linestyle() == "--" and dashed.get_ydata()[-1] == pytest.approx(100 * 3 / 35)
    series = {line.get_label(): line for line in markers}
    assert list(series) == ["GPipe", "1F1B", "ZB-H1", "Interleaved 1F1B", "1F1B measured"]
    for name in ("GPipe", "1F1B"):  # on the solid line at every m
        assert list(series[name].get_ydata()) == pytest.approx([100 * 3 / (m + 3) for m in ms])
    assert list(series["Interleaved 1F1B"].get_ydata()) == pytest.approx([100 * 3 / (2 * m + 3) for m in (4, 8, 16)])
    assert all(y < 100 * 3 / (m + 3) for m, y in zip(ms, series["ZB-H1"].get_ydata(), strict=True))
    assert series["1F1B measured"].get_markerfacecolor() != "none" and series["1F1B"].get_markerfacecolor() == "none"
    assert axis.get_xscale() == "log" and "log₂" in axis.get_xlabel() and "%" in axis.get_ylabel()
    assert _legend(axis)[:2] == ["(p−1)/(m+p−1)", "(p−1)/(vm+p−1), v = 2"]
    assert len(pipeline_plots.plot_bubble(ms, rows, p=4).lines) == len(axis.lines) - 1  # no v: no dashed line
    with pytest.raises(ValueError, match="bubble_fraction"):
        pipeline_plots.plot_bubble(ms, [{"label": "x", "m": 2}], p=4)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_activations_counted_from_the_events_match_the_model_and_the_simulator(name):
    for p, m in ((2, 4), (3, 6), (4, 8), (4, 2)):
        if name == "Interleaved 1F1B" and m % p:
            continue
        schedule = BUILDERS[name](p, m)
        timeline = simulate(schedule)
        counted = pipeline_plots.peak_per_rank(timeline)
        model, _ = pipeline_plots.model_peak_activations(name, p, m, schedule.v)
        assert counted == model
        if schedule.v == 1:
            assert counted == timeline.peak_activations
    axis = pipeline_plots.plot_peak_activations(simulate(SCHEDULES[name]()))
    held, model = axis.containers[0], axis.containers[1]
    assert [bar.get_height() for bar in held] == [bar.get_height() for bar in model]
    assert _legend(axis)[1].startswith("model: ") and "micro-batches" in axis.get_ylabel()
    assert axis.get_xlabel().startswith("rank") and name in axis.get_title()


def test_activation_count_tells_gpipe_order_from_1f1b_order_and_rejects_a_wrong_model():
    schedule = Schedule(1, 2, 1, "hand", [[None]])
    forwards_first = [[(0, 1, Action(0, "F", 0)), (1, 2, Action(0, "F", 1)), (2, 4, Action(0, "B", 0)),
                       (4, 6, Action(0, "B", 1))]]
    alternating = [[(0, 1, Action(0, "F", 0)), (1, 3, Action(0, "B", 0)), (3, 4, Action(0, "F", 1)),
                    (4, 6, Action(0, "B", 1))]]
    assert pipeline_plots.peak_per_rank(Timeline(schedule, forwards_first, 6, [2])) == [2]
    assert pipeline_plots.peak_per_rank(Timeline(schedule, alternating, 6, [1])) == [1]
    assert pipeline_plots.model_peak_activations("GPipe", 4, 8) != pipeline_plots.model_peak_activations("1F1B", 4, 8)
    assert pipeline_plots.model_peak_activations("made up", 4, 8) is None
    axis = pipeline_plots.plot_peak_activations([3, 2.5], model=[3, 2], label="measured")
    assert [bar.get_height() for bar in axis.containers[0]] == [3, 2.5] and _legend(axis) == ["measured", "model"]
    assert len(pipeline_plots.plot_peak_activations([1, 1]).containers) == 1  # no model: one set of bars
    with pytest.raises(ValueError, match="ranks"):
        pipeline_plots.plot_peak_activations([1, 2, 3], model=[1, 2])


# ---------------------------------------------------------------------------------------------------------
# The explorer


def _move(control) -> None:
    """The smallest move: the next option, or one step of a slider (up, or down at the top)."""
    if isinstance(control, ipywidgets.Dropdown):
        control.value = next(option for option in control.options if option != control.value)
    else:
        step = getattr(control, "step", 1)
        control.value = control.value + step if control.value + step <= control.max else control.value - step


@pytest.mark.parametrize("schedule", ["1F1B", "ZB-H1", "DualPipeV"])
def test_pipeline_explorer_redraws_on_release_for_every_control(schedule):
    # 8 controls: schedule, p, m, v, forward, backward, weight, overlap (tests/test_browser.py's count)
    check_every_control_redraws(pipeline_widgets.pipeline_explorer(schedule=schedule), 8, _move)


def test_lesson_07s_explorer_draws_its_four_schedules_without_the_overlap(monkeypatch):
    drawn = _record_figures(monkeypatch)
    explorer = pipeline_widgets.pipeline_explorer(schedules=pipeline_widgets.CLASSIC)
    controls = explorer_controls(explorer)
    # 7 controls: no overlap slider without DualPipeV (tests/test_browser.py's count for lesson 07)
    check_every_control_redraws(pipeline_widgets.pipeline_explorer(schedules=pipeline_widgets.CLASSIC), 7, _move)
    assert [control.description for control in controls if "overlap" in control.description] == []
    assert list(controls[0].options) == list(pipeline_widgets.CLASSIC)
    series = _series(drawn[-1])
    assert {"GPipe", "1F1B", "Interleaved 1F1B", "ZB-H1"} <= set(series)
    assert not {"ZB-V", "Interleaved ZB", "DualPipeV"} & set(series)
    assert "overlap" not in explorer.children[1].value and "overlap" not in drawn[-1].get_suptitle()
    whole, _ = pipeline_widgets.explore("ZB-V", 4, 8, 2, 1.0, 2.0, 1.0)  # lesson 15's: all seven
    assert {"ZB-V", "Interleaved ZB", "DualPipeV"} <= set(_series(whole))
    with pytest.raises(ValueError, match="'ZB-V' is not among"):
        pipeline_widgets.pipeline_explorer(schedule="ZB-V", schedules=pipeline_widgets.CLASSIC)
    with pytest.raises(ValueError, match="schedules must name some of"):
        pipeline_widgets.explore("1F1B", 4, 8, 2, 1.0, 2.0, 1.0, schedules=("1F1B", "ZB-X"))


def _record_figures(monkeypatch) -> list[Figure]:
    """Every figure the explorer draws, kept (the explorer itself keeps only its PNG)."""
    drawn: list[Figure] = []
    overview = pipeline_plots.plot_pipeline_overview
    monkeypatch.setattr(pipeline_plots, "plot_pipeline_overview", lambda *a, **k: drawn.append(overview(*a, **k))
                        or drawn[-1])
    return drawn


def _series(figure: Figure) -> dict[str, list[float]]:
    """The bubble panel's lines and markers, by series (a schedule's markers carry its name as gid, its legend
    label may carry a note under it)."""
    return {line.get_gid() or line.get_label(): list(line.get_ydata()) for line in figure.axes[1].lines}


def test_v_and_w_move_the_bubble_panel_even_when_the_chosen_schedule_ignores_them(monkeypatch):
    drawn = _record_figures(monkeypatch)
    explorer = pipeline_widgets.pipeline_explorer(schedule="1F1B", p=4, m=8, v=2)
    controls = {control.description: control for control in explorer_controls(explorer)}
    timeline_boxes, before = _boxes(drawn[-1].axes[0]), _series(drawn[-1])
    controls["v (interleaved)"].value = 3
    after = _series(drawn[-1])
    assert _boxes(drawn[-1].axes[0]) == timeline_boxes  # 1F1B's timeline does not read v
    assert "(p−1)/(vm+p−1), v = 3" in after and after["Interleaved 1F1B"] != before["Interleaved 1F1B"]
    assert after["ZB-H1"] == before["ZB-H1"]
    controls["split: W (ms)"].value = 0.5
    assert _boxes(drawn[-1].axes[0]) == timeline_boxes  # nor W
    assert _series(drawn[-1])["ZB-H1"] != after["ZB-H1"] and _series(drawn[-1])["1F1B"] == after["1F1B"]
    before = _series(drawn[-1])
    controls["DualPipeV: overlap"].value = 1.0  # DualPipeV's markers only
    after = _series(drawn[-1])
    assert _boxes(drawn[-1].axes[0]) == timeline_boxes
    assert all((after[name] != before[name]) == (name == "DualPipeV") for name in pipeline_widgets.SCHEDULES)


def test_pipeline_explorer_shows_the_librarys_message_for_an_invalid_combination(monkeypatch):
    drawn = _record_figures(monkeypatch)
    explorer = pipeline_widgets.pipeline_explorer(schedule="Interleaved 1F1B", p=4, m=8)
    summary = explorer.children[1]
    assert "closed form (p−1)/(v·m+p−1) = 15.8%" in summary.value and "bubble 15.8%" in summary.value
    assert not any("ValueError" in text.get_text() for text in drawn[-1].axes[0].texts)
    controls = {control.description: control for control in explorer_controls(explorer)}
    controls["ranks p"].value = 3
    message = "m must be a multiple of p: got m=8, p=3"
    assert message in summary.value
    assert any(text.get_text().startswith("ValueError: ") and message in text.get_text().replace("\n", " ")
               for text in drawn[-1].axes[0].texts)
    controls["ranks p"].value, controls["schedule"].value = 4, "ZB-H1"
    controls["split: W (ms)"].value = 3.0  # longer than B = 2 ms
    assert "W = 3 ms cannot exceed B = 2 ms" in summary.value
    controls["backward B (ms)"].value = 4.0
    assert "cannot run" not in summary.value and "exact when F = I = W" in summary.value


def test_explorer_gives_an_interleaved_chunk_one_vth_of_the_work():
    plain = pipeline_widgets.simulate_schedule("1F1B", 2, 4, 3, 1.0, 2.0, 1.0)
    interleaved = pipeline_widgets.simulate_schedule("Interleaved 1F1B", 2, 4, 3, 1.0, 2.0, 1.0)
    assert interleaved.busy == pytest.approx(plain.busy) and interleaved.schedule.v == 3
    assert interleaved.bubble_fraction < plain.bubble_fraction
    assert pipeline_widgets.simulate_schedule("GPipe", 2, 4, 3, 1.0, 2.0, 5.0).schedule.v == 1  # v, W unread


# ---------------------------------------------------------------------------------------------------------
# Readable at every setting: no colliding tick labels, nothing outside the figure, no schedule missing unsaid


def _collisions(figure: Figure) -> list[str]:
    """Every pair of tick labels of one axis that overlap, and every legend or tick label that leaves the
    figure, as drawn (Agg)."""
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    found = []
    whole = figure.bbox
    for index, axis in enumerate(figure.axes):
        for name, ticks, limits in (("x", axis.xaxis.get_major_ticks(), axis.get_xlim()),
                                    ("y", axis.yaxis.get_major_ticks(), axis.get_ylim())):
            low, high = sorted(limits)
            shown = [(tick.label1.get_text(), tick.label1.get_window_extent(renderer)) for tick in ticks
                     if tick.label1.get_visible() and tick.label1.get_text()
                     and low <= tick.get_loc() <= high]  # those matplotlib draws
            for (text_a, a), (text_b, b) in itertools.combinations(shown, 2):
                if a.overlaps(b):
                    found.append(f"axes {index}: {name} tick labels {text_a!r} and {text_b!r} overlap")
            found += [f"axes {index}: {name} tick label {text!r} leaves the figure" for text, box in shown
                      if box.x0 < whole.x0 - 1 or box.x1 > whole.x1 + 1]
        legend = axis.get_legend()
        if legend is not None and legend.get_window_extent(renderer).x1 > whole.x1 + 1:
            found.append(f"axes {index}: its legend leaves the figure")
    for legend in figure.legends:
        box = legend.get_window_extent(renderer)
        if box.x0 < whole.x0 - 1 or box.x1 > whole.x1 + 1 or box.y1 > whole.y1 + 1:
            found.append("the figure's legend leaves it")
    return found


def test_stacked_timelines_at_p_8_interleaved_are_readable():
    p, m = 8, 8
    timelines = [simulate(gpipe(p, m), 0.03, 0.06), simulate(one_f_one_b(p, m), 0.03, 0.06),
                 simulate(interleaved_1f1b(p, m, 2), 0.015, 0.03), simulate(zb_h1(p, m), 0.03, 0.06, 0.03)]
    figure = pipeline_plots.plot_timelines(timelines, time_unit="s")
    assert _collisions(figure) == []
    assert all(axis.get_legend() is None for axis in figure.axes) and len(figure.legends) == 1  # one legend above
    entries = [text.get_text() for text in figure.legends[0].get_texts()]
    assert entries[:4] == [pipeline_plots.KIND_NAMES[kind] for kind in "FBIW"] and entries[-1] == "idle (bubble)"
    assert "chunk 1: stages 8–15" in entries
    interleaved = figure.axes[2]
    sizes = [text.get_fontsize() for text in interleaved.texts if text.get_gid() == "microbatch"]
    assert len(sizes) == sum(len(row) for row in timelines[2].events)  # every box numbered, none unreadably small
    assert min(sizes) >= pipeline_plots.LABEL_MIN_POINTS
    hatched = [c for c in interleaved.collections if (c.get_gid() or "").endswith("chunk 1")]
    assert hatched and all(tuple(c.get_hatchcolor()[0][:3]) != (0.0, 0.0, 0.0) for c in hatched)  # not black


def test_rank_labels_drop_to_one_line_when_two_would_collide():
    tall = pipeline_plots.plot_timeline(simulate(interleaved_1f1b(2, 4, 2)))
    assert [tick.get_text() for tick in tall.get_yticklabels()] == ["rank 1\nstages 1, 3", "rank 0\nstages 0, 2"]
    squat = Figure(figsize=(11, 2.5)).subplots()
    squat.figure.subplots_adjust(right=0.75)  # room for the legend
    pipeline_plots.plot_timeline(simulate(interleaved_1f1b(8, 8, 2)), ax=squat)
    assert [tick.get_text() for tick in squat.get_yticklabels()] == [f"rank {r}" for r in reversed(range(8))]
    assert _collisions(squat.figure) == []


# Every schedule at the largest p, m and v, the tightest timelines; m beside other labelled m's (p = 7, m = 31:
# 28, 31 and 32 on the log axis); m < p; an interleaved m that p does not divide.
EXPLORER_SETTINGS = [(name, p, m, v) for name in pipeline_widgets.SCHEDULES
                     for p, m, v in ((8, 32, 4), (8, 8, 2), (7, 31, 3))] + [("1F1B", 2, 1, 1),
                                                                              ("Interleaved 1F1B", 8, 3, 2)]


@pytest.mark.parametrize(("name", "p", "m", "v"), EXPLORER_SETTINGS)
def test_explorer_figure_has_no_colliding_labels_at_any_setting(name, p, m, v):
    figure, _ = pipeline_widgets.explore(name, p, m, v, 4.0, 8.0, 4.0)  # the longest durations: widest labels
    assert _collisions(figure) == []
    ticks = [int(tick.get_text()) for tick in figure.axes[1].get_xticklabels()]
    assert {1, 32} <= set(ticks) and len(ticks) >= 5  # the ends of the m axis, and the octaves between
    assert any(text.get_gid() == "mark" and text.get_text().strip() == f"m = {m}" for text in figure.axes[1].texts)


@pytest.mark.parametrize("schedule", list(pipeline_widgets.SCHEDULES))
def test_a_split_schedule_is_never_silently_absent_when_w_exceeds_b(monkeypatch, schedule):
    drawn = _record_figures(monkeypatch)
    explorer = pipeline_widgets.pipeline_explorer(schedule=schedule, p=4, m=8, backward_ms=1.0, weight_ms=1.0)
    legend = " ".join(_legend(drawn[-1].axes[1]))
    assert "ZB-H1" in legend and "W > B" not in legend and _series(drawn[-1])["ZB-H1"]
    controls = {control.description: control for control in explorer_controls(explorer)}
    controls["split: W (ms)"].value = 1.5
    legend = _legend(drawn[-1].axes[1])
    for split in pipeline_widgets.SPLIT:
        assert f"{split}\n(none: W > B)" in legend and _series(drawn[-1])[split] == []
    assert "Interleaved 1F1B\n(only where p = 4 divides m)" in legend
    if schedule in pipeline_widgets.SPLIT:  # the chosen schedule: the reason in the timeline's place and summary
        message = "W = 1.5 ms cannot exceed B = 1 ms"
        assert message in explorer.children[1].value
        assert any(message in text.get_text().replace("\n", " ") for text in drawn[-1].axes[0].texts)
    else:
        assert "cannot run" not in explorer.children[1].value


def test_explorer_sliders_have_room_for_a_track():
    explorer = pipeline_widgets.pipeline_explorer()
    sliders = [control for control in explorer_controls(explorer) if isinstance(control, ipywidgets.widgets.
                                                                                  widget_int._Int | ipywidgets.FloatSlider)]
    assert len(sliders) == 7
    for slider in sliders:
        description = int(slider.style.description_width.removesuffix("ch"))
        total = int(slider.layout.width.removesuffix("ch"))
        assert total - description - 8 >= pipeline_widgets.SLIDER_TRACK >= 20  # ch for the track, past the readout


@pytest.mark.parametrize(("m", "at_top"), [(1, False), (3, False), (32, True)])
def test_the_chosen_m_is_written_where_the_bubble_markers_are_not(m, at_top):
    # The bubble falls with m: the markers crowd the top on the left and the bottom on the right.
    figure, _ = pipeline_widgets.explore("GPipe", 2, m, 1, 4.0, 0.25, 0.0)
    (mark,) = [text for text in figure.axes[1].texts if text.get_gid() == "mark"]
    assert (mark.get_position()[1] > 0.5) == at_top and mark.get_va() == ("top" if at_top else "bottom")
