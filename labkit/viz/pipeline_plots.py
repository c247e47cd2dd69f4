"""Plots of lessons 07 and 15 (pipeline parallelism; the schedules of 2024-25): a schedule's timeline, its bubble
against ``m``, activations held.

Every function reads a :class:`~labkit.parallel.pipeline.Timeline`, whether :func:`~labkit.parallel.pipeline.simulate`
made it (in units of the durations given, or seconds) or a runtime measured it on real processes (seconds from a common origin,
``events`` of what really ran): nothing here assumes the durations are uniform or integer.  The functions that
draw one panel take ``ax=None`` and return the ``Axes`` (so the explorer composes them; a notebook shows
``axis.figure``); the others return a ``Figure``, made with ``matplotlib.figure.Figure`` as in ``labkit.viz.plots``.

The bubble fraction is the simulator's: idle rank-time over total rank-time, ``idle / (p T)``, whose closed form
for GPipe and 1F1B is ``(p-1)/(m+p-1)`` and for interleaved 1F1B ``(p-1)/(v m+p-1)`` (Narayanan et al. 2021
quote the same bubble over the ideal time instead: ``(p-1)/m``).  Activations are counted per *rank*, in
micro-batches of the rank's whole share of layers: an interleaved rank's ``v`` chunks each hold ``1/v`` of it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from matplotlib import colors as matplotlib_colors
from matplotlib import patches as matplotlib_patches
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from labkit.parallel.pipeline import Timeline
from labkit.viz import plots

# Okabe & Ito's colour-blind-safe palette: F blue, B vermillion, I reddish purple, W bluish green.
KIND_COLORS = {"F": "#0072B2", "B": "#D55E00", "I": "#CC79A7", "W": "#009E73"}
KIND_NAMES = {"F": "F: forward", "B": "B: backward", "I": "I: input gradient", "W": "W: weight gradient"}
CHUNK_HATCHES = ("", "//", "..", "xx")  # chunk c of an interleaved rank: lighter and hatched as c grows
IDLE_COLOR, IDLE_EDGE = "#F0F0F0", "#B8B8B8"
TIME_UNITS = {None: (1.0, "time (units)"), "s": (1e3, "time (ms)"), "ms": (1.0, "time (ms)")}
SCHEDULE_STYLES = {"GPipe": ("#0072B2", "s"), "1F1B": ("#E69F00", "o"), "Interleaved 1F1B": ("#009E73", "^"),
                   "ZB-H1": ("#CC79A7", "D"), "Interleaved ZB": ("#56B4E9", "v"), "ZB-V": ("#D55E00", "P"),
                   "DualPipeV": ("#000000", "X")}
OTHER_STYLES = [("#56B4E9", "v"), ("#D55E00", "P"), ("#000000", "X"), ("#F0E442", "*")]
ROW_HEIGHT = 0.8
TICK_POINTS = 8.0  # the rank labels' font size
LABEL_MIN_POINTS = 5.0  # a micro-batch number smaller than this is not written (its box is too narrow)


def closed_form_bubble(p: int, m: int | float, v: int = 1) -> float:
    """``(p-1)/(v m+p-1)``: GPipe's and 1F1B's bubble fraction (``v = 1``) or interleaved 1F1B's, for uniform
    stages and no send latency; ZB-H1 reaches ``(p-1)/(3m+p-1)`` only when F = I = W."""
    return (p - 1) / (v * m + p - 1)


def peak_per_rank(timeline: Timeline) -> list[float]:
    """Per rank, the most micro-batches whose activations it held at once (from an ``F`` until its ``B`` or
    ``I``), counted from the events' order, so the same for a simulated and a measured timeline.  An interleaved
    rank's chunk holds ``1/v`` of the rank's layers: its count is divided by ``v``."""
    peaks = []
    for row in timeline.events:
        held = peak = 0
        for _, _, action in sorted(row, key=lambda event: event[0]):  # a measured rank's events, in time order
            held += {"F": 1, "B": -1, "I": -1}.get(action.kind, 0)
            peak = max(peak, held)
        peaks.append(peak / timeline.schedule.v)
    return peaks


def model_peak_activations(name: str, p: int, m: int, v: int = 1) -> tuple[list[float], str] | None:
    """The closed form of :func:`peak_per_rank` for the library's schedules, and its formula as a label; None for
    a schedule it does not know.  GPipe holds ``m`` everywhere; 1F1B and ZB-H1 ``min(p - r, m)``; interleaved
    1F1B ``min((v-1)p + 2(p-1-r) + 1, m v)`` chunks, i.e. that over ``v`` micro-batches."""
    if name == "GPipe":
        return [float(m)] * p, "model: m"
    if name in ("1F1B", "ZB-H1"):
        return [float(min(p - r, m)) for r in range(p)], "model: min(p − r, m)"
    if name == "Interleaved 1F1B":
        return ([min((v - 1) * p + 2 * (p - 1 - r) + 1, m * v) / v for r in range(p)],
                "model: ((v−1)p + 2(p−1−r) + 1) / v")
    if name == "Interleaved ZB":
        rounds = m // max(1, m // p)
        return [min((v - 1) * rounds + p - r, m * v) / v for r in range(p)], "model: ((v−1)g + p − r) / v"
    if name == "ZB-V":
        return [min(2 * p, m + r + 1, 2 * m) / 2 for r in range(p)], "model: p (Qi et al.: 1F1B's)"
    if name == "DualPipeV":
        return [p + 0.5] * p, "model: (PP + 1) / 2 (DeepSeek)"
    return None


def _shade(color: str, chunk: int, v: int) -> tuple[float, float, float]:
    """``color`` for chunk 0, mixed with more white for each later chunk."""
    rgb = matplotlib_colors.to_rgb(color)
    white = 0.55 * chunk / max(v - 1, 1)
    return tuple(c + (1 - c) * white for c in rgb)  # type: ignore[return-value]


def _hatch_color(fill: Sequence[float]) -> tuple[float, float, float]:
    """A later chunk's hatch: a darker tone of its own fill, thin, so that the number written over it stays
    legible (black hatching over a narrow box hid it)."""
    return tuple(0.72 * c for c in fill[:3])  # type: ignore[return-value]


def _text_color(rgb: Sequence[float]) -> str:
    red, green, blue = rgb[:3]
    return "black" if 0.299 * red + 0.587 * green + 0.114 * blue > 0.55 else "white"


def _fit_labels(axis: Axes, labels: list[tuple[float, float, float, str, str]]) -> None:
    """Write each ``(x, y, width, text, color)`` in its box, the font shrunk to the box's width in points at
    the axes' present size, and dropped below :data:`LABEL_MIN_POINTS`."""
    left, right = axis.get_xlim()
    figure = axis.figure
    points_per_unit = axis.get_position().width * figure.get_figwidth() * 72 / (right - left)
    height_points = axis.get_position().height * figure.get_figheight() * 72 / abs(
        axis.get_ylim()[1] - axis.get_ylim()[0]) * ROW_HEIGHT
    for x, y, width, text, color in labels:
        size = min(8.0, width * points_per_unit / (0.62 * len(text) + 0.5), 0.7 * height_points)
        if size >= LABEL_MIN_POINTS:
            axis.text(x, y, text, ha="center", va="center", fontsize=size, color=color, gid="microbatch")


def plot_timeline(timeline: Timeline, ax: Axes | None = None, title: str | None = None,
                  time_unit: str | None = None) -> Axes:
    """One row per rank (rank 0 on top), a box per action from its start to its end, coloured by kind, the
    micro-batch number in it; for ``v > 1`` each later chunk lighter and hatched; the idle time (the bubble)
    a grey hatched band behind.

    ``time_unit``: None for unitless durations (the axis reads "time (units)": one unit of the durations given
    to ``simulate``), ``"s"`` for seconds (a measured run; drawn in ms) or ``"ms"``.  ``title`` replaces the
    schedule's name at the head of the title, which also gives p, m, v and the bubble fraction.
    """
    _check_unit(time_unit)
    axis = Figure(figsize=(11, 1.3 + 0.42 * timeline.schedule.p)).subplots() if ax is None else ax
    _draw_timeline(axis, timeline, title, time_unit, _span(timeline), tight=ax is None)
    return axis


def _check_unit(time_unit: str | None) -> None:
    if time_unit not in TIME_UNITS:
        raise ValueError(f"time_unit must be one of {list(TIME_UNITS)}, got {time_unit!r}")


def _span(timeline: Timeline) -> tuple[float, float]:
    """The time a timeline's axis covers: from 0 (or an earlier start) to its makespan (or a later end)."""
    if not any(timeline.events) or timeline.total <= 0:
        raise ValueError("the timeline has no events to draw")
    return (min([0.0] + [start for row in timeline.events for start, _, _ in row]),
            max([timeline.total] + [end for row in timeline.events for _, end, _ in row]))


def _draw_timeline(axis: Axes, timeline: Timeline, title: str | None, time_unit: str | None,
                   span: tuple[float, float], tight: bool, legend: bool = True,
                   ranks: Sequence[int] | None = None) -> list:
    """:func:`plot_timeline` on ``axis`` over ``span`` (in the timeline's time), the layout tightened first
    when ``tight``, the labels fitted last; returns the legend's handles (drawn beside the axes if ``legend``).
    ``ranks``: the rank each row ran on (default its pipeline rank), written in its tick."""
    scale, xlabel = TIME_UNITS[time_unit]
    schedule = timeline.schedule
    p, v = schedule.p, schedule.v
    kinds, labels = set(), []
    for rank, row in enumerate(timeline.events):
        y = p - 1 - rank
        axis.broken_barh([(0, timeline.total * scale)], (y - ROW_HEIGHT / 2, ROW_HEIGHT), facecolor=IDLE_COLOR,
                         edgecolor=IDLE_EDGE, hatch="////", linewidth=0, zorder=0, gid="idle")
        groups: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for start, end, action in row:
            chunk = action.stage // p
            groups.setdefault((action.kind, chunk), []).append((start * scale, (end - start) * scale))
            fill = _shade(KIND_COLORS[action.kind], chunk, v)
            labels.append(((start + end) / 2 * scale, y, (end - start) * scale, str(action.microbatch),
                           _text_color(fill)))
            kinds.add(action.kind)
        for (kind, chunk), spans in groups.items():
            fill = _shade(KIND_COLORS[kind], chunk, v)
            axis.broken_barh(spans, (y - ROW_HEIGHT / 2, ROW_HEIGHT), facecolor=fill, edgecolor="black",
                             linewidth=0.4, hatch=CHUNK_HATCHES[chunk % len(CHUNK_HATCHES)],
                             hatchcolor=_hatch_color(fill), hatch_linewidth=0.5, zorder=2, gid=f"{kind} chunk {chunk}")
    ends = {action: (start, end) for row in timeline.events for start, end, action in row}
    for forward, backward in schedule.pairs:  # DualPipeV's overlapped F&B: one frame around the two
        start, end = ends[forward][0], ends[backward][1]
        y = p - 1 - schedule.rank_of(forward.stage)
        axis.add_patch(matplotlib_patches.Rectangle((start * scale, y - 0.5), (end - start) * scale, 1.0, fill=False,
                                                    edgecolor="black", linewidth=1.6, zorder=3, gid="pair"))
    axis.set_xlim(span[0] * scale, span[1] * scale)
    axis.set_ylim(-0.6, p - 0.4)
    v_shaped = schedule.placement == "v"
    _rank_ticks(axis, p, v, two_lines=True, ranks=ranks, v_shaped=v_shaped)
    axis.set_xlabel(xlabel)
    axis.set_title(f"{title or schedule.name}: p = {p}, m = {schedule.m}, v = {v}; "
                   f"bubble {100 * float(timeline.bubble_fraction):.1f}% of rank-time", fontsize=10)
    handles = [matplotlib_patches.Patch(facecolor=KIND_COLORS[kind], edgecolor="black", label=KIND_NAMES[kind])
               for kind in KIND_COLORS if kind in kinds]
    handles += [matplotlib_patches.Patch(facecolor=_shade("#808080", chunk, v), edgecolor="black",
                                         hatch=CHUNK_HATCHES[chunk % len(CHUNK_HATCHES)],
                                         label=f"chunk {chunk}: stages {chunk * p}–{chunk * p + p - 1}")
                for chunk in range(v if v > 1 else 0)]
    if schedule.pairs:
        handles.append(matplotlib_patches.Patch(fill=False, edgecolor="black", linewidth=1.6,
                                                label="F&B: a pair (framed)"))
    handles.append(matplotlib_patches.Patch(facecolor=IDLE_COLOR, edgecolor=IDLE_EDGE, hatch="////",
                                            label="idle (bubble)"))
    if legend:
        axis.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, title="number = "
                    "micro-batch", title_fontsize=8)
    if tight:
        axis.figure.tight_layout()
    if not _rank_ticks(axis, p, v, two_lines=True, ranks=ranks, v_shaped=v_shaped):  # too tight for the stages
        _rank_ticks(axis, p, v, two_lines=False, ranks=ranks, v_shaped=v_shaped)
        if tight:
            axis.figure.tight_layout()
    _fit_labels(axis, labels)
    return handles


def _rank_ticks(axis: Axes, p: int, v: int, two_lines: bool, ranks: Sequence[int] | None = None,
                v_shaped: bool = False) -> bool:
    """Label each row with its rank, and under it the rank's stages when ``two_lines`` (on one line, the font
    shrinks to the pitch; the legend still names each chunk's stages); return whether two lines fit the rows'
    pitch at the axes' present size (2.8 times the font size)."""
    pitch = axis.get_position().height * axis.figure.get_figheight() * 72 / p  # points per rank
    def stages(r: int) -> str:
        if v_shaped:
            return f"stages {r}, {2 * p - 1 - r}"
        return f"stage {r}" if v == 1 else f"stages {r}, {r + p}" + (", …" if v > 2 else "")

    texts = [f"rank {rank if ranks is None else ranks[rank]}" + (f"\n{stages(rank)}" if two_lines else "")
             for rank in reversed(range(p))]
    axis.set_yticks(range(p), texts, fontsize=TICK_POINTS if two_lines else min(TICK_POINTS, pitch / 1.4))
    return pitch >= 2.8 * TICK_POINTS


def plot_timelines(timelines: Sequence[Timeline], titles: Sequence[str] | None = None,
                   time_unit: str | None = None, ranks: Sequence[Sequence[int] | None] | None = None) -> Figure:
    """Several timelines stacked over one shared time axis: GPipe, 1F1B, interleaved and ZB-H1 side by side, or
    a simulated step above a measured one (then simulate with seconds, as measured, and pass ``"s"``).  One
    legend above them all (every kind, chunk and the idle time drawn), so the panels use the figure's width.
    ``ranks``: for each timeline, the rank each of its rows ran on (``None``: its pipeline rank), e.g. a
    measured pipeline of a 3D run whose stage 1 is rank 4: ``[None, [0, 4]]``."""
    if not timelines:
        raise ValueError("no timelines to draw")
    if titles is not None and len(titles) != len(timelines):
        raise ValueError(f"{len(timelines)} timelines but {len(titles)} titles")
    if ranks is not None and (len(ranks) != len(timelines) or any(
            names is not None and len(names) != timeline.schedule.p
            for names, timeline in zip(ranks, timelines, strict=True))):
        raise ValueError(f"ranks must give, for each of the {len(timelines)} timelines, None or one rank per row")
    _check_unit(time_unit)
    heights = [1.0 + 0.42 * timeline.schedule.p for timeline in timelines]
    legend_height = 0.75  # inches: the legend's title and up to two rows of entries
    figure = Figure(figsize=(11, 0.4 + legend_height + sum(heights)))
    axes = figure.subplots(len(timelines), 1, sharex=True, height_ratios=heights, squeeze=False)[:, 0]
    figure.subplots_adjust(left=0.09, right=0.98, top=1 - (0.45 + legend_height) / figure.get_figheight(),
                           bottom=0.55 / figure.get_figheight(), hspace=0.75 / (sum(heights) / len(heights)))
    spans = [_span(timeline) for timeline in timelines]
    span = (min(low for low, _ in spans), max(high for _, high in spans))
    handles: dict[str, object] = {}
    for index, (axis, timeline) in enumerate(zip(axes, timelines, strict=True)):
        drawn = _draw_timeline(axis, timeline, None if titles is None else titles[index], time_unit, span,
                               tight=False, legend=False, ranks=None if ranks is None else ranks[index])
        handles.update((handle.get_label(), handle) for handle in drawn if handle.get_label() not in handles)
        if index < len(timelines) - 1:
            axis.set_xlabel("")
    order = sorted(handles.values(), key=lambda handle: (handle.get_label() == "idle (bubble)",  # idle last
                                                         handle.get_label().startswith("chunk")))
    figure.legend(handles=order, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.08 / figure.get_figheight()),
                  ncol=min(len(order), 5), fontsize=8, title="number = micro-batch", title_fontsize=8)
    return figure


def _bubble_row(row: Mapping | Timeline) -> dict:
    if isinstance(row, Timeline):
        return {"label": row.schedule.name, "m": row.schedule.m, "bubble_fraction": row.bubble_fraction}
    missing = {"label", "m", "bubble_fraction"} - set(row)
    if missing:
        raise ValueError(f"a bubble row needs 'label', 'm' and 'bubble_fraction', {sorted(missing)} missing: {row}")
    return dict(row)


def plot_bubble(ms: Sequence[int], rows: Sequence[Mapping | Timeline], p: int, v: int | None = None,
                ax: Axes | None = None, title: str | None = None, mark: int | None = None,
                notes: Mapping[str, str] | None = None) -> Axes:
    """Bubble fraction (% of rank-time idle) against the number of micro-batches ``m`` (log-2 axis): the closed
    form ``(p-1)/(m+p-1)`` as a solid line, ``(p-1)/(v m+p-1)`` dashed when ``v`` is given, and ``rows`` as
    markers, one series per label.

    Each row is a :class:`Timeline` (label: its schedule's name) or a mapping with ``"label"`` (the series),
    ``"m"`` and ``"bubble_fraction"`` (in 0..1, ``idle / (p T)`` as :attr:`Timeline.bubble_fraction`), and
    optionally ``"measured": True``, drawn filled (simulated points are hollow).  ``mark``: an ``m`` to mark
    with a dotted line, written beside it.  ``notes``: a word under a series' name in the legend, for series
    with points missing (``{"ZB-H1": "none: W > B"}``; a series named only there is listed with no point), since
    a schedule missing without a word reads as a schedule forgotten.  Each series' line has its label as ``gid``.  The ``m`` ticks are
    those of ``ms`` that do not collide, powers of two first."""
    if not ms:
        raise ValueError("ms is empty: give the micro-batch counts to draw the closed forms over")
    axis = Figure(figsize=(8.5, 4.0)).subplots() if ax is None else ax
    low, high = min(ms), max(ms)
    dense = [low * (high / low) ** (k / 99) for k in range(100)] if high > low else [low]
    axis.plot(dense, [100 * closed_form_bubble(p, m) for m in dense], color="black", linewidth=1.2,
              label="(p−1)/(m+p−1)")
    if v is not None:
        axis.plot(dense, [100 * closed_form_bubble(p, m, v) for m in dense], color="black", linestyle="--",
                  linewidth=1.2, label=f"(p−1)/(vm+p−1), v = {v}")
    series: dict[str, list[dict]] = {}
    for row in map(_bubble_row, rows):
        series.setdefault(row["label"], []).append(row)
    for label in notes or {}:
        series.setdefault(label, [])  # no point at all: its marker in the legend, with the reason
    for index, (label, points) in enumerate(series.items()):
        color, marker = next((style for name, style in SCHEDULE_STYLES.items() if label.startswith(name)),
                             OTHER_STYLES[index % len(OTHER_STYLES)])
        points.sort(key=lambda row: row["m"])
        measured = any(row.get("measured") for row in points)
        note = (notes or {}).get(label)
        axis.plot([row["m"] for row in points], [100 * row["bubble_fraction"] for row in points], linestyle="none",
                  marker=marker, markersize=9 if index == 0 else 6.5, markerfacecolor=color if measured else "none",
                  markeredgecolor=color, markeredgewidth=1.5, label=label if note is None else f"{label}\n({note})",
                  gid=label)
    axis.set_xscale("log", base=2)
    axis.minorticks_off()
    axis.set_ylim(bottom=0)
    ticks = sorted(set(ms))
    axis.set_xlim(low / 1.25, high * 1.25)
    if mark is not None:
        axis.axvline(mark, color="gray", linestyle=":", linewidth=1)
        right = math.log2(mark / low) > 0.6 * math.log2(high / low) if high > low else False
        # The bubble falls with m: a mark on the right is written at the top, one on the left at the bottom,
        # where the markers are not.
        axis.text(mark, 0.98 if right else 0.02, f"m = {mark} " if right else f" m = {mark}",
                  transform=axis.get_xaxis_transform(), ha="right" if right else "left",
                  va="top" if right else "bottom", fontsize=8, color="dimgray", gid="mark")
    axis.set_xlabel("micro-batches m (log₂ scale)")
    axis.set_ylabel("bubble (% of rank-time idle)")
    axis.set_title(title or f"Bubble against micro-batches, p = {p} ranks", fontsize=10)
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    if ax is None:
        axis.figure.tight_layout()
    ticks = _spaced_ticks(axis, ticks)
    axis.set_xticks(ticks, [str(m) for m in ticks])
    return axis


def _spaced_ticks(axis: Axes, ms: list[int], points: float = 10.0) -> list[int]:
    """The ``ms`` whose labels fit side by side on ``axis``'s log-2 axis at its present width, powers of two
    first, then the rest in order (a label is about 0.6 of the font size wide per digit, plus a gap)."""
    left, right = (math.log2(x) for x in axis.get_xlim())
    per_octave = axis.get_position().width * axis.figure.get_figwidth() * 72 / (right - left)
    kept: list[int] = []
    for m in sorted(ms, key=lambda m: (m & (m - 1) != 0, m)):  # powers of two first
        width = 0.6 * points * len(str(m))
        if all(abs(math.log2(m) - math.log2(k)) * per_octave >= (width + 0.6 * points * len(str(k))) / 2 + 4
               for k in kept):
            kept.append(m)
    return sorted(kept)


def plot_peak_activations(held: Timeline | Sequence[float], model: Sequence[float] | None = None,
                          label: str = "counted", model_label: str = "model", ax: Axes | None = None,
                          title: str | None = None) -> Axes:
    """Per rank, the most micro-batches of activations held at once: ``held`` (bars, the value written on
    each) beside ``model`` (hatched bars).  Given a :class:`Timeline`, ``held`` is :func:`peak_per_rank` of
    it and ``model`` defaults to :func:`model_peak_activations` of its schedule (GPipe ``m`` on every stage,
    1F1B ``p - r``)."""
    v = 1
    if isinstance(held, Timeline):
        schedule = held.schedule
        v = schedule.v
        known = model_peak_activations(schedule.name, schedule.p, schedule.m, v)
        if model is None and known is not None:
            model, model_label = known
        title = title or f"{schedule.name}: peak activations, p = {schedule.p}, m = {schedule.m}, v = {v}"
        held = peak_per_rank(held)
    if model is not None and len(model) != len(held):
        raise ValueError(f"model has {len(model)} values but there are {len(held)} ranks")
    axis = Figure(figsize=(6.0, 4.0)).subplots() if ax is None else ax
    ranks = range(len(held))
    width = 0.4 if model is not None else 0.7
    offset = -width / 2 if model is not None else 0.0
    bars = axis.bar([r + offset for r in ranks], held, width=width, color="#0072B2", label=label)
    axis.bar_label(bars, [f"{value:g}" for value in held], fontsize=7 if len(held) <= 6 else 6)
    if model is not None:
        axis.bar([r + width / 2 for r in ranks], model, width=width, facecolor="white", edgecolor="#D55E00",
                 hatch="//", label=model_label)
    axis.set_xticks(list(ranks), [str(r) for r in ranks])
    axis.set_xlabel("rank" if v == 1 else f"rank ({v} chunks each)")
    axis.set_ylabel("peak held (micro-batches\nof the rank's layers)")
    axis.set_title(title or "Peak activations held per rank", fontsize=10)
    axis.set_ylim(0, 1.4 * max(list(held) + list(model or []) + [1]))  # room for the legend
    axis.legend(fontsize=7, loc="upper right")
    if ax is None:
        axis.figure.tight_layout()
    return axis


def plot_pipeline_overview(timeline: Timeline | None, rows: Sequence[Mapping | Timeline], ms: Sequence[int],
                           p: int, v: int | None = None, m: int | None = None, time_unit: str | None = None,
                           error: str | None = None, caption: str = "", notes: Mapping[str, str] | None = None
                           ) -> Figure:
    """The explorer's figure: ``timeline`` on top, below it :func:`plot_bubble` (``m`` marked by a vertical
    line; ``notes``: why a series has points missing) and :func:`plot_peak_activations`.  With ``error``
    (a ValueError's message: an invalid combination) the top panel shows the message instead of a timeline."""
    figure = Figure(figsize=(12, 3.8 + 0.42 * p))
    axes = figure.subplot_mosaic([["timeline"] * 3, ["bubble", ".", "peaks"]], width_ratios=[1.0, 0.55, 1.0],
                                 height_ratios=[0.8 + 0.42 * p, 3.0])  # the bubble's legend in the "." gap
    figure.subplots_adjust(left=0.08, right=0.77, top=1 - 0.75 / figure.get_figheight(),
                           bottom=0.75 / figure.get_figheight(), hspace=0.7, wspace=0.3)
    plot_bubble(ms, rows, p, v, ax=axes["bubble"], mark=m, notes=notes)
    if timeline is not None and error is None:
        plot_timeline(timeline, ax=axes["timeline"], time_unit=time_unit)
        plot_peak_activations(timeline, ax=axes["peaks"], label="simulated")
    else:
        plots.error_panels(axes, error, "timeline", "peaks", "no timeline: see the message above")
    figure.suptitle(caption, fontsize=9)
    return figure
