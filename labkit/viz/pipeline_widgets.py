"""The pipeline explorer of lessons 07 and 15: a pipeline schedule, its size and its pass durations -> its simulated
timeline, its bubble beside the closed form and every other schedule's, and the activations each rank holds.
Lesson 07 opens it on the four schedules it builds (:data:`CLASSIC`), lesson 15 on all seven.

It lives apart from ``labkit.viz.widgets`` (which would pass the 420-line limit with it) and is wired the same
way, by ``widgets.connect``: sliders redraw when released, the last state wins, the figure is an image.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import ipywidgets as widgets
from matplotlib.figure import Figure

from labkit.parallel import pipeline
from labkit.parallel.pipeline import catalog
from labkit.viz import pipeline_plots, plots
from labkit.viz.widgets import ROW, connect

# The catalog's generators under the names their tables carry (the explorer's dropdown and legends).
SCHEDULES: dict[str, Callable[[int, int, int], pipeline.Schedule]] = {
    shown: catalog.SCHEDULES[name] for shown, name in (
        ("GPipe", "gpipe"), ("1F1B", "1f1b"), ("Interleaved 1F1B", "interleaved"), ("ZB-H1", "zb-h1"),
        ("Interleaved ZB", "interleaved-zb"), ("ZB-V", "zb-v"), ("DualPipeV", "dualpipev"))}
CLOSED_FORMS = {"GPipe": "(p−1)/(m+p−1)", "1F1B": "(p−1)/(m+p−1)", "Interleaved 1F1B": "(p−1)/(v·m+p−1)",
                "ZB-H1": "(p−1)/(3m+p−1), exact when F = I = W",
                "Interleaved ZB": "(p−1)/(3vm+p−1), exact when F = I = W",
                "ZB-V": "(p−1)/(6m+p−1), exact when F = I = W and m ≥ 2p−1",
                "DualPipeV": "(p−1)/(3m+p−1), exact when F = I = W and F&B = F + B"}
SPLIT = ("ZB-H1", "Interleaved ZB", "ZB-V", "DualPipeV")  # W is read by these
CLASSIC = ("GPipe", "1F1B", "Interleaved 1F1B", "ZB-H1")  # lesson 07's; the other three are lesson 15's
_PER_MICRO_BATCH = {"GPipe": 1, "1F1B": 1, "ZB-H1": 3, "ZB-V": 6, "DualPipeV": 3}  # k in (p-1)/(k m + p-1)


@functools.lru_cache(maxsize=512)
def _schedule(name: str, p: int, m: int, v: int) -> pipeline.Schedule:
    """The tables do not depend on the durations: a duration slider re-times them without rebuilding them."""
    return SCHEDULES[name](p, m, v)


def simulate_schedule(name: str, p: int, m: int, v: int, forward_ms: float, backward_ms: float,
                      weight_ms: float, overlap: float = 0.0) -> pipeline.Timeline:
    """Build schedule ``name`` and simulate it with the explorer's conventions: the durations are one rank's
    whole share of layers (a chunk takes ``1/v`` of them, half in a V, so that ``v`` changes the schedule, not
    the model); ``v`` is read by the interleaved schedules only, ``weight_ms`` (W, with I = B - W) by the split
    ones and ``overlap`` (the share of an F&B pair's shorter pass hidden) by DualPipeV.  Raises the library's
    ValueError for an invalid combination."""
    schedule = _schedule(name, p, m, v)
    chunks = schedule.v
    return pipeline.simulate(schedule, forward_ms / chunks, backward_ms / chunks,
                             weight_ms / chunks if name in SPLIT else None, overlap=overlap)


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
    k = {"Interleaved 1F1B": v, "Interleaved ZB": 3 * v}.get(name) or _PER_MICRO_BATCH[name]
    return pipeline_plots.closed_form_bubble(p, m, k)


def _runs(name: str, p: int, m: int, v: int) -> bool:
    """Whether the explorer draws ``name`` at ``m`` (the others are named in the legend's notes)."""
    return not ((name == "Interleaved 1F1B" and m % p) or (name == "DualPipeV" and m < 2 * p)
                or (name == "Interleaved ZB" and m % max(1, m // p)))


def _chosen(schedules: Sequence[str]) -> tuple[str, ...]:
    unknown = [name for name in schedules if name not in SCHEDULES]
    if unknown or not schedules:
        raise ValueError(f"schedules must name some of {tuple(SCHEDULES)}, got {tuple(schedules)!r}")
    return tuple(name for name in SCHEDULES if name in schedules)  # the dropdown's order, whatever was given


def explore(name: str, p: int, m: int, v: int, forward_ms: float, backward_ms: float, weight_ms: float,
            overlap: float = 0.0, schedules: Sequence[str] = tuple(SCHEDULES)) -> tuple[Figure, str]:
    """What :func:`pipeline_explorer` shows for its controls' values: the figure and the summary (HTML).
    ``schedules``: those drawn in the bubble panel (``name`` among them)."""
    schedules = _chosen(schedules)
    if name not in schedules:
        raise ValueError(f"schedule {name!r} is not among the explorer's schedules {schedules}")
    ms = sorted({2**k for k in range(6)} | {p * 2**k for k in range(3) if p * 2**k <= MAX_M} | {m})
    durations = (forward_ms, backward_ms, weight_ms, overlap)
    weight_too_long = weight_ms > backward_ms
    rows = [simulate_schedule(other, p, count, v, *durations) for other in schedules for count in ms
            if not (other in SPLIT and weight_too_long) and _runs(other, p, count, v)]
    notes = {"Interleaved 1F1B": f"only where p = {p} divides m", "DualPipeV": f"only m ≥ 2p = {2 * p}",
             "Interleaved ZB": "only where its rounds divide m"}
    if weight_too_long:  # nothing to draw, said in the legend: a missing series reads as a forgotten one
        notes |= {other: "none: W > B" for other in SPLIT}
    notes = {other: note for other, note in notes.items() if other in schedules}
    timeline, error = None, None
    if name in SPLIT and weight_too_long:
        error = (f"{name} splits each backward B into I = B − W and W, so W = {weight_ms:g} ms cannot exceed "
                 f"B = {backward_ms:g} ms: lower W or raise B")
    else:
        try:
            timeline = simulate_schedule(name, p, m, v, *durations)
        except ValueError as invalid:
            error = str(invalid)
    shown_v = f", v = {v}" if name.startswith("Interleaved") else ""
    if timeline is None:
        summary = f"<small><b>{name}, p = {p}, m = {m}{shown_v} cannot run</b>: {error}</small>"
    else:
        peaks = pipeline_plots.peak_per_rank(timeline)
        chunk = timeline.schedule.v
        pair = None if name != "DualPipeV" else (forward_ms + backward_ms - overlap * min(forward_ms, backward_ms)) / 2
        paper = pipeline.closed_form_idle(name, p, forward_ms / chunk, backward_ms / chunk,
                                          weight_ms / chunk if name in SPLIT else None, pair)
        summary = (f"<small>{name}, p = {p}, m = {m}{shown_v}: bubble {timeline.bubble_fraction:.1%} of rank-time "
                   f"simulated; closed form {CLOSED_FORMS[name]} = {_closed_form(name, p, m, v):.1%}.  Idle per "
                   f"rank {timeline.idle / p:.3g} ms simulated, {paper:.3g} ms by the paper's form (F, B, W apart); "
                   f"step {timeline.total:.3g} ms; at most {max(peaks):g} micro-batch{'' if max(peaks) == 1 else 'es'} "
                   f"of the rank's layers' activations held (rank {peaks.index(max(peaks))}).  v is read by the "
                   "interleaved schedules, W by the split ones (I = B − W)"
                   f"{', the overlap by DualPipeV' if 'DualPipeV' in schedules else ''}.</small>")
    paired = f"; F&B overlap {overlap:g}" if "DualPipeV" in schedules else ""
    caption = (f"F = {forward_ms:g}, B = {backward_ms:g}, W = {weight_ms:g} ms per rank's layers (W: the split "
               f"schedules' share of B); v = {v}{paired}.  Markers: simulated with these durations")
    figure = pipeline_plots.plot_pipeline_overview(timeline, rows, ms, p, v, m=m, time_unit="ms", error=error,
                                                   caption=caption, notes=notes)
    return figure, summary


def pipeline_explorer(schedule: str = "1F1B", p: int = 4, m: int = 8, v: int = 2, forward_ms: float = 1.0,
                      backward_ms: float = 2.0, weight_ms: float = 1.0, overlap: float = 0.0,
                      schedules: Sequence[str] = tuple(SCHEDULES)) -> widgets.VBox:
    """Pipeline schedules on ``p`` ranks (lessons 07 and 15): schedule, p, m, v, the forward, backward and weight-
    gradient durations and DualPipeV's F&B overlap -> the chosen schedule's simulated timeline; the bubble
    against ``m`` of ``schedules`` (default: all seven) simulated with the same durations, beside the closed
    forms (the chosen ``m`` dotted); and the peak activations per rank beside their model.  Without DualPipeV
    among ``schedules`` there is no overlap slider (lesson 07's :data:`CLASSIC`: 7 controls, else 8).  ``v`` is
    used by the interleaved
    schedules (their timelines, markers and the dashed closed form), W by the split ones (ZB-H1, interleaved ZB,
    ZB-V, DualPipeV), the overlap by DualPipeV.  An invalid combination shows why in the figure: interleaved
    1F1B with ``m`` not a multiple of ``p`` (the library's message: labkit keeps Megatron's original order),
    DualPipeV with ``m < 2p``, W longer than B (I would take B − W < 0).  The bubble panel's legend says which
    markers are missing and why."""
    schedules = _chosen(schedules)
    if schedule not in schedules:
        raise ValueError(f"schedule {schedule!r} is not among the explorer's schedules {schedules}")
    schedule_choice = widgets.Dropdown(options=list(schedules), value=schedule, description="schedule")
    rank_slider = widgets.IntSlider(value=p, min=2, max=MAX_P, description="ranks p")
    micro_slider = widgets.IntSlider(value=m, min=1, max=MAX_M, description="micro-batches m")
    chunk_slider = widgets.IntSlider(value=v, min=1, max=4, description="v (interleaved)")
    forward_slider = widgets.FloatSlider(value=forward_ms, min=0.25, max=4.0, step=0.25, description="forward F (ms)")
    backward_slider = widgets.FloatSlider(value=backward_ms, min=0.25, max=8.0, step=0.25,
                                          description="backward B (ms)")
    weight_slider = widgets.FloatSlider(value=weight_ms, min=0.0, max=4.0, step=0.25, description="split: W (ms)")
    overlap_slider = widgets.FloatSlider(value=overlap, min=0.0, max=1.0, step=0.25, description="DualPipeV: overlap")
    picture = widgets.Image(format="png")
    summary = widgets.HTML()

    def redraw() -> None:
        figure, summary.value = explore(schedule_choice.value, rank_slider.value, micro_slider.value,
                                        chunk_slider.value, forward_slider.value, backward_slider.value,
                                        weight_slider.value, overlap_slider.value, schedules)
        picture.value = plots.figure_to_png(figure)

    controls = (schedule_choice, rank_slider, micro_slider, chunk_slider, forward_slider, backward_slider,
                weight_slider) + ((overlap_slider,) if "DualPipeV" in schedules else ())
    connect(controls, redraw)
    widen_sliders(controls)
    return widgets.VBox([widgets.HBox([widgets.VBox(list(controls[:4])), widgets.VBox(list(controls[4:]))],
                                      layout=ROW), summary, picture])
