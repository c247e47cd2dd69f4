"""Lesson 07's explorer: a pipeline schedule, its size and its pass durations -> its simulated timeline, its
bubble beside the closed form and every other schedule's, and the activations each rank holds.

It lives apart from ``labkit.viz.widgets`` (which would pass the 420-line limit with it) and is wired the same
way, by ``widgets.connect``: sliders redraw when released, the last state wins, the figure is an image.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import ipywidgets as widgets

from labkit.parallel import pipeline
from labkit.viz import pipeline_plots, plots
from labkit.viz.widgets import ROW, connect

SCHEDULES: dict[str, Callable[[int, int, int], pipeline.Schedule]] = {
    "GPipe": lambda p, m, v: pipeline.gpipe(p, m),
    "1F1B": lambda p, m, v: pipeline.one_f_one_b(p, m),
    "Interleaved 1F1B": pipeline.interleaved_1f1b,
    "ZB-H1": lambda p, m, v: pipeline.zb_h1(p, m),
}
CLOSED_FORMS = {"GPipe": "(p−1)/(m+p−1)", "1F1B": "(p−1)/(m+p−1)", "Interleaved 1F1B": "(p−1)/(v·m+p−1)",
                "ZB-H1": "(p−1)/(3m+p−1), exact when F = I = W"}


@functools.lru_cache(maxsize=512)
def _schedule(name: str, p: int, m: int, v: int) -> pipeline.Schedule:
    """The tables do not depend on the durations: a duration slider re-times them without rebuilding them."""
    return SCHEDULES[name](p, m, v)


def simulate_schedule(name: str, p: int, m: int, v: int, forward_ms: float, backward_ms: float,
                      weight_ms: float) -> pipeline.Timeline:
    """Build schedule ``name`` and simulate it with the explorer's conventions: the durations are one rank's
    whole share of layers (an interleaved chunk takes ``1/v`` of them, so that ``v`` changes the schedule, not
    the model); ``v`` is read by interleaved 1F1B only and ``weight_ms`` (W, with I = B - W) by ZB-H1 only.
    Raises the library's ValueError for an invalid combination."""
    schedule = _schedule(name, p, m, v)
    chunks = schedule.v
    return pipeline.simulate(schedule, forward_ms / chunks, backward_ms / chunks,
                             weight_ms if name == "ZB-H1" else None)


def _closed_form(name: str, p: int, m: int, v: int) -> float:
    return pipeline_plots.closed_form_bubble(p, m, {"Interleaved 1F1B": v, "ZB-H1": 3}.get(name, 1))


def pipeline_explorer(schedule: str = "1F1B", p: int = 4, m: int = 8, v: int = 2, forward_ms: float = 1.0,
                      backward_ms: float = 2.0, weight_ms: float = 1.0) -> widgets.VBox:
    """Pipeline schedules on ``p`` ranks (lesson 07): schedule, p, m, v, and the forward, backward and weight-
    gradient durations -> the chosen schedule's simulated timeline; the bubble against ``m`` of all four
    schedules simulated with the same durations, beside the closed forms (the chosen ``m`` dotted); and the
    peak activations per rank beside their model.  ``v`` is used by interleaved 1F1B (its timeline, its markers
    and the dashed closed form), W by ZB-H1 (its timeline and markers).  An invalid combination (interleaved
    with ``m`` not a multiple of ``p``, W longer than B) shows the library's message in the figure."""
    schedule_choice = widgets.Dropdown(options=list(SCHEDULES), value=schedule, description="schedule")
    rank_slider = widgets.IntSlider(value=p, min=2, max=8, description="ranks p")
    micro_slider = widgets.IntSlider(value=m, min=1, max=32, description="micro-batches m")
    chunk_slider = widgets.IntSlider(value=v, min=1, max=4, description="chunks v (interleaved)")
    forward_slider = widgets.FloatSlider(value=forward_ms, min=0.25, max=4.0, step=0.25, description="forward F (ms)")
    backward_slider = widgets.FloatSlider(value=backward_ms, min=0.25, max=8.0, step=0.25,
                                          description="backward B (ms)")
    weight_slider = widgets.FloatSlider(value=weight_ms, min=0.0, max=4.0, step=0.25,
                                        description="W of B, ZB-H1 (ms)")
    picture = widgets.Image(format="png")
    summary = widgets.HTML()

    def redraw() -> None:
        name, p, m, v = schedule_choice.value, rank_slider.value, micro_slider.value, chunk_slider.value
        durations = (forward_slider.value, backward_slider.value, weight_slider.value)
        ms = sorted({2**k for k in range(6)} | {p * 2**k for k in range(3) if p * 2**k <= 32} | {m})
        rows = []
        for other in SCHEDULES:
            for count in ms:
                try:
                    rows.append(simulate_schedule(other, p, count, v, *durations))
                except ValueError:  # interleaved needs m a multiple of p; W must not exceed B
                    continue
        timeline, error = None, None
        try:
            timeline = simulate_schedule(name, p, m, v, *durations)
        except ValueError as invalid:
            error = str(invalid)
        shown_v = f", v = {v}" if name == "Interleaved 1F1B" else ""
        if timeline is None:
            summary.value = f"<small><b>{name}, p = {p}, m = {m}{shown_v} cannot run</b>: {error}</small>"
        else:
            peaks = pipeline_plots.peak_per_rank(timeline)
            summary.value = (f"<small>{name}, p = {p}, m = {m}{shown_v}: bubble "
                             f"{timeline.bubble_fraction:.1%} of rank-time simulated; closed form "
                             f"{CLOSED_FORMS[name]} = {_closed_form(name, p, m, v):.1%}; step {timeline.total:.3g} "
                             f"ms; at most {max(peaks):g} micro-batches of activations held (rank "
                             f"{peaks.index(max(peaks))}).  v is read by interleaved 1F1B only, W by ZB-H1 only "
                             "(I = B − W).</small>")
        caption = (f"F = {durations[0]:g} ms, B = {durations[1]:g} ms per rank's layers; W = {durations[2]:g} ms "
                   f"(ZB-H1's share of B); v = {v} (interleaved).  Markers: each schedule simulated with these "
                   "durations")
        figure = pipeline_plots.plot_pipeline_overview(timeline, rows, ms, p, v, m=m, time_unit="ms", error=error,
                                                       caption=caption)
        picture.value = plots.figure_to_png(figure)

    controls = (schedule_choice, rank_slider, micro_slider, chunk_slider, forward_slider, backward_slider,
                weight_slider)
    connect(controls, redraw)
    return widgets.VBox([widgets.HBox([widgets.VBox(list(controls[:4])), widgets.VBox(list(controls[4:]))],
                                      layout=ROW), summary, picture])
