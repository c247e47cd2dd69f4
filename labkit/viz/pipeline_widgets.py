"""Lesson 07's explorer: a pipeline schedule, its size and its pass durations -> its simulated timeline, its
bubble beside the closed form and every other schedule's, and the activations each rank holds.

It lives apart from ``labkit.viz.widgets`` (which would pass the 420-line limit with it) and is wired the same
way, by ``widgets.connect``: sliders redraw when released, the last state wins, the figure is an image.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import ipywidgets as widgets
from matplotlib.figure import Figure

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


MAX_P, MAX_M = 8, 32
SLIDER_TRACK = 28  # ch: a slider's track, beside its description and readout (ipywidgets' 300 px left 14 px)


def widen_sliders(controls) -> None:
    """Make each slider of ``controls`` (after ``widgets.connect`` set their description widths) wide enough
    for its description, a track of :data:`SLIDER_TRACK` characters and its readout: ipywidgets gives a slider
    300 px in all, which the descriptions this explorer needs squeezed to a 14 px track."""
    for control in controls:
        if isinstance(control, (widgets.IntSlider, widgets.FloatSlider)):
            description = int(control.style.description_width.removesuffix("ch"))
            control.layout.width = f"{description + SLIDER_TRACK + 8}ch"  # + the readout


def _closed_form(name: str, p: int, m: int, v: int) -> float:
    return pipeline_plots.closed_form_bubble(p, m, {"Interleaved 1F1B": v, "ZB-H1": 3}.get(name, 1))


def explore(name: str, p: int, m: int, v: int, forward_ms: float, backward_ms: float, weight_ms: float
            ) -> tuple[Figure, str]:
    """What :func:`pipeline_explorer` shows for its controls' values: the figure and the summary (HTML)."""
    ms = sorted({2**k for k in range(6)} | {p * 2**k for k in range(3) if p * 2**k <= MAX_M} | {m})
    durations = (forward_ms, backward_ms, weight_ms)
    weight_too_long = weight_ms > backward_ms
    rows = [simulate_schedule(other, p, count, v, *durations) for other in SCHEDULES for count in ms
            if not (other == "ZB-H1" and weight_too_long) and not (other == "Interleaved 1F1B" and count % p)]
    notes = {"Interleaved 1F1B": f"only where p = {p} divides m"}  # labkit's (Megatron's original) order
    if weight_too_long:  # nothing to draw, said in the legend: a missing series reads as a forgotten one
        notes["ZB-H1"] = "none: W > B"
    timeline, error = None, None
    if name == "ZB-H1" and weight_too_long:
        error = (f"ZB-H1 splits each backward B into I = B − W and W, so W = {weight_ms:g} ms cannot exceed "
                 f"B = {backward_ms:g} ms: lower W or raise B")
    else:
        try:
            timeline = simulate_schedule(name, p, m, v, *durations)
        except ValueError as invalid:
            error = str(invalid)
    shown_v = f", v = {v}" if name == "Interleaved 1F1B" else ""
    if timeline is None:
        summary = f"<small><b>{name}, p = {p}, m = {m}{shown_v} cannot run</b>: {error}</small>"
    else:
        peaks = pipeline_plots.peak_per_rank(timeline)
        summary = (f"<small>{name}, p = {p}, m = {m}{shown_v}: bubble {timeline.bubble_fraction:.1%} of rank-time "
                   f"simulated; closed form {CLOSED_FORMS[name]} = {_closed_form(name, p, m, v):.1%}; step "
                   f"{timeline.total:.3g} ms; at most {max(peaks):g} micro-batch{'' if max(peaks) == 1 else 'es'} of "
                   f"activations held (rank {peaks.index(max(peaks))}).  v is read by interleaved 1F1B only, W by ZB-H1 only "
                   "(I = B − W).</small>")
    caption = (f"F = {forward_ms:g} ms, B = {backward_ms:g} ms per rank's layers; W = {weight_ms:g} ms (ZB-H1's "
               f"share of B); v = {v} (interleaved).  Markers: each schedule simulated with these durations")
    figure = pipeline_plots.plot_pipeline_overview(timeline, rows, ms, p, v, m=m, time_unit="ms", error=error,
                                                   caption=caption, notes=notes)
    return figure, summary


def pipeline_explorer(schedule: str = "1F1B", p: int = 4, m: int = 8, v: int = 2, forward_ms: float = 1.0,
                      backward_ms: float = 2.0, weight_ms: float = 1.0) -> widgets.VBox:
    """Pipeline schedules on ``p`` ranks (lesson 07): schedule, p, m, v, and the forward, backward and weight-
    gradient durations -> the chosen schedule's simulated timeline; the bubble against ``m`` of all four
    schedules simulated with the same durations, beside the closed forms (the chosen ``m`` dotted); and the
    peak activations per rank beside their model.  ``v`` is used by interleaved 1F1B (its timeline, its markers
    and the dashed closed form), W by ZB-H1 (its timeline and markers).  An invalid combination shows why in
    the figure: interleaved with ``m`` not a multiple of ``p`` (the library's message: labkit keeps Megatron's
    original order), W longer than B (ZB-H1's I would take B − W < 0).  The bubble panel's legend says which
    markers are missing and why (interleaved off the multiples of ``p``; ZB-H1 when W > B)."""
    schedule_choice = widgets.Dropdown(options=list(SCHEDULES), value=schedule, description="schedule")
    rank_slider = widgets.IntSlider(value=p, min=2, max=MAX_P, description="ranks p")
    micro_slider = widgets.IntSlider(value=m, min=1, max=MAX_M, description="micro-batches m")
    chunk_slider = widgets.IntSlider(value=v, min=1, max=4, description="v (interleaved)")
    forward_slider = widgets.FloatSlider(value=forward_ms, min=0.25, max=4.0, step=0.25, description="forward F (ms)")
    backward_slider = widgets.FloatSlider(value=backward_ms, min=0.25, max=8.0, step=0.25,
                                          description="backward B (ms)")
    weight_slider = widgets.FloatSlider(value=weight_ms, min=0.0, max=4.0, step=0.25, description="ZB-H1's W (ms)")
    picture = widgets.Image(format="png")
    summary = widgets.HTML()

    def redraw() -> None:
        figure, summary.value = explore(schedule_choice.value, rank_slider.value, micro_slider.value,
                                        chunk_slider.value, forward_slider.value, backward_slider.value,
                                        weight_slider.value)
        picture.value = plots.figure_to_png(figure)

    controls = (schedule_choice, rank_slider, micro_slider, chunk_slider, forward_slider, backward_slider,
                weight_slider)
    connect(controls, redraw)
    widen_sliders(controls)
    return widgets.VBox([widgets.HBox([widgets.VBox(list(controls[:4])), widgets.VBox(list(controls[4:]))],
                                      layout=ROW), summary, picture])
