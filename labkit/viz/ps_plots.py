"""Plots of lesson 08 (a parameter server: synchronous, asynchronous, SSP, bounded delay, backup workers).

:func:`plot_ps_timeline` draws a simulated run (``labkit.parallel.parameter_server.simulate``): what each worker computed, on
which version, and how long the server held it.  :func:`plot_staleness` and :func:`plot_loss_curves_ps` read
what a launched run records (``ParameterServerRun``) as well as a simulation; :func:`plot_seconds_per_update`
sets the simulated wall-clock per update beside ``labkit.costmodel.stragglers``' closed forms.  The functions
that draw one panel take ``ax=None`` and return the ``Axes`` (a notebook shows ``axis.figure``), the others a
``Figure``, as in ``labkit.viz.pipeline_plots``.  Times are drawn in milliseconds, except the loss curves'
wall-clock (a training run lasts seconds).
"""

from __future__ import annotations

import bisect
import math
import statistics
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

import ipywidgets as widgets
from matplotlib import colors as matplotlib_colors
from matplotlib import patches as matplotlib_patches
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from labkit.costmodel.stragglers import Throughput, harmonic, throughput
from labkit.parallel.parameter_server import MODES, Stragglers
from labkit.parallel.parameter_server.simulate import ServerTimeline, simulate_parameter_server
from labkit.viz import plots
from labkit.viz.training_plots import running_mean
from labkit.viz.widgets import ROW, connect

# Okabe & Ito's colour-blind-safe palette, one colour per mode.
MODE_COLORS = {"sync": "#0072B2", "async": "#D55E00", "ssp": "#009E73", "bounded_delay": "#E69F00",
               "backup": "#CC79A7"}
APPLIED, DROPPED, HELD = "#0072B2", "#BBBBBB", "#E69F00"
SERIES_COLORS = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00"]
ROW_HEIGHT = 0.7


def _lighter(color: str, white: float = 0.55) -> tuple[float, float, float]:
    return tuple(c + (1 - c) * white for c in matplotlib_colors.to_rgb(color))  # type: ignore[return-value]


def _write_labels(axis: Axes, labels: list[tuple[float, float, float, str]], gid: str) -> None:
    """Write each ``(x, y, width, text)`` centred in its box (data units) at 7 pt, if the box is wide enough
    at the axes' present size and its centre is in view."""
    left, right = axis.get_xlim()
    points_per_unit = axis.get_position().width * axis.figure.get_figwidth() * 72 / (right - left)
    for x, y, width, text in labels:
        if left <= x <= right and width * points_per_unit >= 0.62 * 7 * len(text) + 2:
            axis.text(x, y, text, ha="center", va="center", fontsize=7, gid=gid, clip_on=True)


def describe(mode: str, workers: int, backup_workers: int = 0, staleness_bound: int | None = None,
             max_delay: int | None = None) -> str:
    """``"backup: N = 5, b = 1"``: a mode and the numbers that define it (``s`` SSP's clock bound, ``τ``
    the bounded delay's)."""
    extra = {"backup": f", b = {backup_workers}", "ssp": f", s = {staleness_bound}",
             "bounded_delay": f", τ = {max_delay}"}.get(mode, "")
    return f"{mode}: N = {workers}{extra}"


def plot_ps_timeline(timeline: ServerTimeline, ax: Axes | None = None, until_s: float | None = None,
                     title: str | None = None) -> Axes:
    """The server on top, one row per worker below (worker 0 first): each gradient's computation a box
    labelled with the version it was computed on (blue when applied, grey when dropped), its straggler delay
    the lighter end of the box, and the time the server held it hatched; each update a tick on the server's
    row, with the version it made.  The gaps are messages in flight.  ``until_s``: the time shown (all of
    it by default)."""
    n = timeline.workers
    axis = Figure(figsize=(11, 1.4 + 0.38 * (n + 1))).subplots() if ax is None else ax
    end = timeline.total_s if until_s is None else until_s
    if not end > 0:
        raise ValueError(f"until_s must be > 0 seconds, got {until_s!r}")
    applied = {(r.worker, r.step) for r in timeline.applied}
    labels = []
    for worker, row in enumerate(timeline.computes):
        y = n - 1 - worker
        spans: dict[str, list[tuple[float, float]]] = {"applied": [], "dropped": [], "delay": []}
        for step, (start, finish, pulled) in enumerate(row):
            kind = "applied" if (worker, step) in applied else "dropped"
            spans[kind].append((1e3 * start, 1e3 * (finish - start)))
            if finish - start > timeline.compute_s:
                spans["delay"].append((1e3 * (start + timeline.compute_s), 1e3 * (finish - start - timeline.compute_s)))
            labels.append((1e3 * (start + finish) / 2, y, 1e3 * (finish - start), str(pulled)))
        for kind, color in (("applied", APPLIED), ("dropped", DROPPED)):
            axis.broken_barh(spans[kind], (y - ROW_HEIGHT / 2, ROW_HEIGHT), facecolor=_lighter(color, 0.35),
                             edgecolor="black", linewidth=0.4, gid=kind, zorder=2)
        axis.broken_barh(spans["delay"], (y - ROW_HEIGHT / 2, ROW_HEIGHT), facecolor=(1, 1, 1, 0.45),
                         linewidth=0, gid="delay", zorder=3)
        axis.broken_barh([(1e3 * start, 1e3 * (stop - start)) for start, stop in timeline.holds[worker]],
                         (y - ROW_HEIGHT / 4, ROW_HEIGHT / 2), facecolor="white", edgecolor=HELD, hatch="////",
                         linewidth=0.8, gid="held", zorder=2)
    times = [1e3 * t for t in timeline.update_times_s]
    axis.vlines(times, n - ROW_HEIGHT / 2, n, color="black", linewidth=1.2, gid="update")
    gaps = [b - a for a, b in zip([0.0] + times, times + [math.inf], strict=True)]
    update_labels = [(t, n + 0.22, min(gaps[i], gaps[i + 1]), str(i + 1)) for i, t in enumerate(times)]
    axis.set_xlim(0, 1e3 * end)
    axis.set_ylim(-0.6, n + 0.6)
    axis.set_yticks(range(n + 1), [f"worker {w}" for w in reversed(range(n))] + ["server\n(updates)"], fontsize=8)
    axis.set_xlabel("time (ms)")
    staleness = timeline.staleness()
    named = describe(timeline.mode, n, timeline.backup_workers, timeline.staleness_bound, timeline.max_delay)
    axis.set_title(title or f"{named}; "
                   f"{1e3 * timeline.seconds_per_update:.3g} ms per update, mean staleness "
                   f"{statistics.mean(staleness):.2f} (updates)", fontsize=10)
    handles = [matplotlib_patches.Patch(facecolor=_lighter(APPLIED, 0.35), edgecolor="black",
                                        label="gradient applied (number: version used)"),
               matplotlib_patches.Patch(facecolor=_lighter(DROPPED, 0.35), edgecolor="black",
                                        label="gradient dropped"),
               matplotlib_patches.Patch(facecolor=_lighter(APPLIED, 0.65), edgecolor="black",
                                        label="straggler delay (lighter end)"),
               matplotlib_patches.Patch(facecolor="white", edgecolor=HELD, hatch="////",
                                        label="held at the server (waiting)"),
               matplotlib_patches.Patch(facecolor="black", label="update (number: version made)")]
    axis.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8)
    if ax is None:
        axis.figure.tight_layout()
    _write_labels(axis, labels, "version")
    _write_labels(axis, update_labels, "update")
    return axis


def plot_staleness(staleness: Mapping[str, Sequence[int]], model_mean: float | None = None,
                   bound: int | None = None, ax: Axes | None = None, title: str | None = None) -> Axes:
    """Histogram of staleness (updates between a gradient's pull and its application) as % of the applied
    gradients, one set of bars per series side by side (e.g. ``{"measured": run.staleness(), "simulated":
    timeline.staleness()}``), each series' mean in its legend; ``model_mean`` a dashed line (``N - 1`` for
    asynchronous training, ``0`` synchronous) and ``bound`` (the bounded delay's ``τ``: SSP's ``s`` bounds clocks,
    not staleness) a dotted one.  Every integer is a tick while they fit, and the axis spans at least 0 to 1."""
    if not staleness or not all(staleness.values()):
        raise ValueError(f"every series needs at least one staleness value, got {dict(staleness)!r}")
    axis = Figure(figsize=(6.0, 4.0)).subplots() if ax is None else ax
    values = range(max(max(values) for values in staleness.values()) + 1)
    width = 0.8 / len(staleness)
    for index, (label, series) in enumerate(staleness.items()):
        counts = [100 * sum(1 for s in series if s == value) / len(series) for value in values]
        axis.bar([v - 0.4 + width * (index + 0.5) for v in values], counts, width=width,
                 color=SERIES_COLORS[index % len(SERIES_COLORS)], label=f"{label} (mean {statistics.mean(series):.2f})")
    if model_mean is not None:
        axis.axvline(model_mean, color="black", linestyle="--", linewidth=1.2, label=f"model mean {model_mean:.3g}")
    if bound is not None:
        axis.axvline(bound + 0.5, color="#B00000", linestyle=":", linewidth=1.5, label=f"bound τ = {bound}")
    right = max(len(values) - 1, bound if bound is not None else 0, math.ceil(model_mean or 0), 1)
    axis.set_xlim(-0.6, right + 0.6)
    if right <= 12:
        axis.set_xticks(range(right + 1))
    else:
        axis.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=12))
    axis.set_ylim(0, 1.3 * axis.get_ylim()[1])  # room for the legend above the bars
    axis.set_xlabel("staleness (updates between pull and apply)")
    axis.set_ylabel("applied gradients (%)")
    axis.set_title(title or "Staleness of the applied gradients", fontsize=10)
    axis.legend(fontsize=7)
    if ax is None:
        axis.figure.tight_layout()
    return axis


def loss_by_version(run: Any, x: str = "updates") -> tuple[list[int], list[float], list[float]]:
    """``(positions, losses, seconds)`` of a run (a ``ParameterServerRun``): for each version of the weights
    that gradients were computed on, their mean loss (the loss *of* that version) and when the server made it
    (0 for the initial weights).  ``x="updates"``: positions are the versions; ``x="gradients"``: the gradients
    applied to make that version, the fair axis across modes (a synchronous update applies ``N``).  A diverged
    run's losses may be ``inf`` or ``nan`` (drawn as gaps)."""
    if x not in ("updates", "gradients"):
        raise ValueError(f"x must be 'updates' or 'gradients', got {x!r}")
    by_version: dict[int, list[float]] = {}
    for record in run.received:
        by_version.setdefault(record.pulled, []).append(record.loss)
    versions = sorted(by_version)
    losses = [statistics.mean(by_version[v]) for v in versions]
    if all(math.isnan(loss) for loss in losses):
        raise ValueError("the run has no losses (a simulated run trains nothing): plot a launched run's records")
    positions = versions
    if x == "gradients":
        made = sorted(r.applied for r in run.applied)  # the version each applied gradient went into (made v + 1)
        positions = [bisect.bisect_left(made, v) for v in versions]
    return positions, losses, [0.0 if v == 0 else run.update_times_s[v - 1] for v in versions]


def plot_loss_curves_ps(runs: Mapping[str, Any], smooth: int = 1, title: str = "Training loss through a parameter "
                        "server", x: str = "updates", log: bool = False,
                        ylabel: str = "training loss (nats)") -> Figure:
    """Loss against updates (left) and against wall-clock seconds (right), one line per run (``label ->
    ParameterServerRun``, e.g. one per mode), each point the mean loss of the gradients computed on one version
    (:func:`loss_by_version`), averaged over ``smooth`` versions.  Asynchronous runs make more updates per
    second, each from one gradient: the left panel shows what an update is worth, the right what a second is.
    ``x="gradients"`` puts the gradients applied on the left panel's axis instead (what each gradient is
    worth); ``log`` draws the loss on a log scale (a diverging run); ``ylabel`` names the loss and its unit."""
    if not runs:
        raise ValueError("no runs to draw")
    figure = Figure(figsize=(11, 3.8))
    by_update, by_time = figure.subplots(1, 2, sharey=True)
    for index, (label, run) in enumerate(runs.items()):
        positions, losses, seconds = loss_by_version(run, x)
        color = MODE_COLORS.get(label, SERIES_COLORS[index % len(SERIES_COLORS)])
        smoothed = running_mean(losses, smooth) if smooth > 1 else losses
        by_update.plot(positions, smoothed, color=color, label=label)
        by_time.plot(seconds, smoothed, color=color, label=label)
    by_update.set_xlabel("updates applied (server version)" if x == "updates" else "gradients applied")
    by_update.set_ylabel(ylabel + (", log scale" if log else ""))
    by_update.set_title(title, fontsize=10)
    by_time.set_xlabel("wall-clock (s)")
    by_time.set_title("the same runs against time", fontsize=10)
    for axis in (by_update, by_time):
        axis.legend(fontsize=8)
        if log:
            axis.set_yscale("log")
    figure.tight_layout()
    return figure


def plot_sync_update_vs_workers(workers: Sequence[int], simulated_s: Mapping[str, Sequence[float]],
                                formula_s: Mapping[str, Sequence[float]], title: str = "What waiting for the "
                                "slowest costs") -> Axes:
    """Seconds per update (drawn in ms) against the number of workers: each simulated series (markers) beside
    its closed form (dashed, the same colour), e.g. ``{"sync": [...], "backup b = 1": [...]}``."""
    axis = Figure(figsize=(6.5, 4.0)).subplots()
    for index, (label, values) in enumerate(simulated_s.items()):
        color = SERIES_COLORS[index % len(SERIES_COLORS)]
        axis.plot(workers, [1e3 * v for v in values], "o-", color=color, label=f"{label}, simulated")
        if label in formula_s:
            axis.plot(workers, [1e3 * v for v in formula_s[label]], "--", color=color, label=f"{label}, formula")
    axis.set_xscale("log", base=2)
    axis.set_xticks(list(workers), [str(n) for n in workers])
    axis.set_xlabel("workers N")
    axis.set_ylabel("wall-clock per update (ms)")
    axis.set_title(title, fontsize=10)
    axis.legend(fontsize=8)
    axis.figure.tight_layout()
    return axis


def _tick(label: str) -> str:
    """A bar's label on lines of at most 12 characters, never breaking a word: ``"bounded_delay:\nN = 4, τ = 2"``."""
    return textwrap.fill(label, 12, break_long_words=False, break_on_hyphens=False)


def plot_seconds_per_update(simulated: Mapping[str, ServerTimeline], model: Mapping[str, Throughput | None],
                            ax: Axes | None = None, title: str | None = None) -> Axes:
    """Wall-clock per update (ms) of each simulated run (solid bars, labelled with their mean staleness) beside
    the closed form of ``labkit.costmodel.stragglers`` (hatched; none for SSP).  ``simulated`` and ``model``
    are keyed by the bar's label, e.g. ``describe(...)``."""
    axis = Figure(figsize=(6.0, 4.0)).subplots() if ax is None else ax
    labels = list(simulated)
    said: set[str] = set()

    def once(entry: str) -> str | None:
        """The legend entry the first time, None after: one entry however many bars."""
        if entry in said:
            return None
        said.add(entry)
        return entry

    for index, label in enumerate(labels):
        timeline = simulated[label]
        color = MODE_COLORS.get(timeline.mode, SERIES_COLORS[index % len(SERIES_COLORS)])
        bar = axis.bar(index - 0.2, 1e3 * timeline.seconds_per_update, width=0.4, color=color,
                       label=once("simulated"))
        axis.bar_label(bar, [f"staleness\n{statistics.mean(timeline.staleness()):.2f}"], fontsize=7)
        predicted = model.get(label)
        if predicted is not None:
            axis.bar(index + 0.2, 1e3 * predicted.seconds_per_update, width=0.4, facecolor="white", edgecolor=color,
                     hatch="//", label=once("model (closed form)"))
        else:
            axis.text(index + 0.2, 0, " no closed form", ha="center", va="bottom", rotation=90, fontsize=7,
                      color="gray")
    axis.set_xticks(range(len(labels)), [_tick(label) for label in labels], fontsize=7)
    axis.set_xlim(-0.6, len(labels) - 0.4)
    axis.set_ylabel("wall-clock per update (ms)")
    axis.set_ylim(0, 1.3 * axis.get_ylim()[1])  # room for the labels and the legend
    axis.set_title(title or "Wall-clock per update (ms): simulated beside the model", fontsize=10)
    axis.legend(fontsize=7, loc="upper right")
    if ax is None:
        axis.figure.tight_layout()
    return axis


def plot_ps_overview(timeline: ServerTimeline | None, staleness: Mapping[str, Sequence[int]],
                     simulated: Mapping[str, ServerTimeline], model: Mapping[str, Throughput | None],
                     model_mean: float | None = None, bound: int | None = None, until_s: float | None = None,
                     error: str | None = None, caption: str = "") -> Figure:
    """The explorer's figure: ``timeline`` on top (or ``error``, a ValueError's message, in its place), below
    it :func:`plot_staleness` and :func:`plot_seconds_per_update`."""
    rows = timeline.workers + 1 if timeline is not None else 3
    figure = Figure(figsize=(12, 4.4 + 0.36 * rows))
    axes = figure.subplot_mosaic([["timeline"] * 2, ["staleness", "seconds"]], height_ratios=[0.6 + 0.36 * rows, 3.2],
                                 width_ratios=[1, 1.45])
    mean_height = (figure.get_figheight() - 0.7 - 0.75 - 1.0) / 2  # inches: margins, and 1 inch between the rows
    figure.subplots_adjust(left=0.08, right=0.75, top=1 - 0.7 / figure.get_figheight(),
                           bottom=0.75 / figure.get_figheight(), hspace=1.0 / mean_height, wspace=0.3)
    plot_seconds_per_update(simulated, model, ax=axes["seconds"])
    if timeline is not None and error is None:
        plot_staleness(staleness, model_mean, bound, ax=axes["staleness"])
        plot_ps_timeline(timeline, ax=axes["timeline"], until_s=until_s)
    else:
        plots.error_panels(axes, error, "timeline", "staleness", "no run: see the message above")
    figure.suptitle(caption, fontsize=9)
    return figure


# ---------------------------------------------------------------------------------------------------------
# The explorer

COMPUTE_MS = 10.0  # every gradient's computation, before its delay
STRAGGLERS = ("one slow worker (fixed)", "every worker (exponential)")


def _model_text(mode: str, n: int, b: int, fixed: bool, size_ms: float, message_ms: float,
                predicted: Throughput | None) -> str:
    """The closed form behind ``predicted``, with the numbers in it."""
    if predicted is None:
        return ("no closed form (between sync, s = 0, and async; with a fixed straggler, its pace)" if mode == "ssp"
                else "no closed form (between sync, τ = 0, and async)")
    base = f"{COMPUTE_MS:g} + 2·{message_ms:g}"
    if mode == "async":
        return f"1 / Σ 1/c_i (c_i: each worker's mean round trip) = {1e3 * predicted.seconds_per_update:.3g} ms"
    if mode == "ssp":
        return (f"the slowest worker's round trip / N = ({base} + {size_ms if fixed else 0:g}) / {n} = "
                f"{1e3 * predicted.seconds_per_update:.3g} ms (in the long run, all go at its pace)")
    b = b if mode == "backup" else 0
    if fixed:
        delay = f" + {size_ms:g} (the slow worker)" if b == 0 else " (the slow worker is among the dropped)"
    else:
        delay = (f" + μ·(H_N − H_b) = {size_ms:g}·({harmonic(n):.3f} − {harmonic(b):.3f})" if b else
                 f" + μ·H_N = {size_ms:g}·{harmonic(n):.3f}")
    return f"{base}{delay} = {1e3 * predicted.seconds_per_update:.3g} ms"


def ps_explorer(mode: str = "sync", workers: int = 4, backup_workers: int = 1, staleness_bound: int = 2,
                straggler: str = STRAGGLERS[1], straggler_ms: float = 4.0, message_ms: float = 0.5,
                updates: int = 300, max_delay: int = 2) -> widgets.VBox:
    """A parameter server in time (lesson 08): mode, workers ``N``, backup workers ``b``, SSP's clock bound ``s``,
    the bounded delay ``τ``, the kind and size of the stragglers, and the message time -> the chosen mode's
    simulated timeline (the first few steps), its staleness histogram beside the model's mean (``N - 1``
    asynchronous, 0 synchronous) or the bound ``τ``, and every mode's wall-clock per update over ``updates``
    simulated updates beside the closed form (``compute + 2 message + mu H_N`` for sync).  ``b``, ``s`` and
    ``τ`` are each read by one mode, whose bar moves whatever the chosen mode.  Compute is 10 ms per gradient;
    the slow worker is the last.  A combination no server can run (``b >= N``) is said in the figure."""
    mode_choice = widgets.Dropdown(options=list(MODES), value=mode, description="mode")
    worker_slider = widgets.IntSlider(value=workers, min=2, max=12, description="workers N")
    backup_slider = widgets.IntSlider(value=backup_workers, min=0, max=3, description="backup workers b")
    bound_slider = widgets.IntSlider(value=staleness_bound, min=0, max=6, description="ssp: clock bound s")
    delay_slider = widgets.IntSlider(value=max_delay, min=0, max=6, description="bounded delay τ")
    straggler_choice = widgets.Dropdown(options=list(STRAGGLERS), value=straggler, description="straggler")
    size_slider = widgets.FloatSlider(value=straggler_ms, min=0.5, max=20.0, step=0.5,
                                      description="straggler delay (ms)")
    message_slider = widgets.FloatSlider(value=message_ms, min=0.0, max=5.0, step=0.25, description="message (ms)")
    picture = widgets.Image(format="png")
    summary = widgets.HTML()

    def redraw() -> None:
        n, b, s, tau, chosen = (worker_slider.value, backup_slider.value, bound_slider.value, delay_slider.value,
                                mode_choice.value)
        size_ms, message_ms = size_slider.value, message_slider.value
        fixed = straggler_choice.value == STRAGGLERS[0]
        stragglers = Stragglers(slow={n - 1: size_ms / 1e3}) if fixed else Stragglers(exponential_mean_s=size_ms / 1e3)
        simulated, model, errors = {}, {}, {}
        for name in MODES:
            options = {"ssp": {"staleness_bound": s}, "bounded_delay": {"max_delay": tau},
                       "backup": {"backup_workers": b}}.get(name, {})
            try:
                timeline = simulate_parameter_server(name, n, updates, compute_s=COMPUTE_MS / 1e3,
                                                     message_s=message_ms / 1e3, stragglers=stragglers, **options)
            except ValueError as invalid:  # b must be < N
                errors[name] = str(invalid)
                continue
            label = describe(name, n, b, s, tau)
            simulated[label] = timeline
            model[label] = throughput(name, n, COMPUTE_MS / 1e3, message_ms / 1e3, 0.0 if fixed else size_ms / 1e3,
                                      size_ms / 1e3 if fixed else 0.0, b if name == "backup" else 0)
        label = describe(chosen, n, b, s, tau)
        timeline, error = simulated.get(label), errors.get(chosen)
        if timeline is None:
            summary.value = f"<small><b>{label} cannot run</b>: {error}</small>"
        else:
            gradients = [sum(1 for r in timeline.applied if r.worker == w) for w in range(n)]
            summary.value = (f"<small>{label}: {1e3 * timeline.seconds_per_update:.3g} ms per update simulated, "
                             f"{len(timeline.applied) / timeline.update_times_s[-1]:.0f} gradients/s applied "
                             f"(per worker: {', '.join(map(str, gradients))}); model: "
                             f"{_model_text(chosen, n, b, fixed, size_ms, message_ms, model[label])}.  b is read "
                             "by backup only, s by ssp only, τ by bounded_delay only.</small>")
        caption = (f"compute {COMPUTE_MS:g} ms per gradient, messages {message_ms:g} ms each way; straggler: "
                   f"{straggler_choice.value}, {size_ms:g} ms; {updates} updates simulated per mode")
        figure = plot_ps_overview(timeline, {"simulated": timeline.staleness()} if timeline else {}, simulated, model,
                                  model_mean={"sync": 0, "backup": 0, "async": n - 1}.get(chosen),
                                  bound=tau if chosen == "bounded_delay" else None,
                                  until_s=6 * (COMPUTE_MS + 2 * message_ms + size_ms) / 1e3, error=error,
                                  caption=caption)
        picture.value = plots.figure_to_png(figure)

    controls = (mode_choice, worker_slider, backup_slider, bound_slider, delay_slider, straggler_choice, size_slider,
                message_slider)
    connect(controls, redraw)
    return widgets.VBox([widgets.HBox([widgets.VBox(list(controls[:5])), widgets.VBox(list(controls[5:]))],
                                      layout=ROW), summary, picture])
