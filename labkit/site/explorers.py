"""The lessons' ipywidgets explorers on a static page: a small grid of settings, drawn when the site is built.

A page has no kernel, so an explorer's sliders cannot call the model.  What the page can do is step through
pictures drawn beforehand.  Each explorer cell of a lesson is matched here with an :class:`Explorer`: how to
build the same widget without the notebook (the analytical models need no process group; lesson 01's ring is
recorded from real gloo ranks when the site is built), and which of its controls the page offers, with the
values each steps through.  :func:`draw_frames` builds the real widget and moves its controls through every
combination, in order, keeping the picture and the summary each combination shows; every other control stays
where the notebook opens it, and the page says so.  The page's script (``static/explorer.js``) then swaps
pictures as the reader moves a control: the same figures the notebook draws, for those settings only.

The grid is small on purpose (at most :data:`MAX_FRAMES` pictures an explorer): the whole site builds in well
under two minutes on two cores.  A notebook cell whose explorer has no entry here still gets a page, with a
note in place of the picture, and ``tests/test_site.py`` fails naming the lesson and the call to add.
"""

from __future__ import annotations

import ast
import functools
import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import product
from typing import Any

MAX_FRAMES = 48  # pictures per explorer: the build's time is about 0.3 s a picture, over the machine's cores


@dataclass(frozen=True)
class Explorer:
    """One explorer cell of a lesson, as the site draws it.

    ``lesson`` is the notebook's number (``"07"``) and ``call`` the function its cell calls
    (``"pipeline_explorer"``); ``make`` builds the widget as the cell does; ``steps`` maps a control's
    description to the values the page steps through (every other control keeps its opening value);
    ``inputs`` says where anything that is not an analytical model comes from.
    """

    lesson: str
    call: str
    make: Callable[[], Any]
    steps: dict[str, Sequence[Any]]
    inputs: str = ""
    labels: dict[str, Sequence[str]] = field(default_factory=dict)  # the page's words, where the widget's read badly
    notebook_only: str = ""  # what only the notebook offers, besides the controls the page keeps fixed
    seconds: float = 5.0  # about how long its pictures take to draw on one core (the build starts the longest first)
    key: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", f"{self.lesson}-{self.call}")
        frames = 1
        for description, values in self.steps.items():
            if not values:
                raise ValueError(f"explorer {self.key}: no values to step for {description!r}")
            frames *= len(values)
            if description in self.labels and len(self.labels[description]) != len(values):
                raise ValueError(f"explorer {self.key}: {len(self.labels[description])} labels for the "
                                 f"{len(values)} values of {description!r}")
        if not 1 <= len(self.steps) <= 3 or frames > MAX_FRAMES:
            raise ValueError(f"explorer {self.key}: {len(self.steps)} stepped controls and {frames} pictures; "
                             f"the page steps 1 to 3 controls and at most {MAX_FRAMES} pictures")


# ---------------------------------------------------------------------------------------------------------------
# The inputs that are not analytical models


def _links(names: dict[str, str]) -> dict:
    """Links by the lesson's labels, from the course's constants (labkit/costmodel/hardware.py)."""
    from labkit.costmodel import hardware

    return {label: hardware.LINKS[name].model() for label, name in names.items()}


def _record_ring(elements_per_chunk: int, segment_counts: Sequence[int]) -> dict[int, list[dict]]:
    """On every rank: one ring all-reduce per segment count, each send recorded (lesson 01's first cell)."""
    import torch
    import torch.distributed as dist

    from labkit.collectives import ring_all_reduce

    runs = {}
    for segments in segment_counts:
        record: list[dict] = []
        tensor = torch.arange(dist.get_world_size() * elements_per_chunk, dtype=torch.float32)
        ring_all_reduce(tensor, record=record, segment_bytes=-(-elements_per_chunk // segments) * 4)
        runs[segments] = record
    return runs


@functools.cache
def recorded_ring_runs(world_sizes: tuple[int, ...] = (2, 3, 4),
                       segment_counts: tuple[int, ...] = (1, 2, 3)) -> dict[tuple[int, int], list[dict]]:
    """Lesson 01's records: ``(world size, segments) -> every rank's sends``, from ring all-reduces run on real
    gloo ranks now (a few seconds, in the worker that draws the explorer; cached)."""
    from labkit.launch import launch

    records = {}
    for world_size in world_sizes:
        per_rank = launch(_record_ring, 6, segment_counts, nprocs=world_size)
        for segments in segment_counts:
            records[(world_size, segments)] = [entry for runs in per_rank for entry in runs[segments]]
    return records


def _lazy(module: str, name: str, *args: Any, **kwargs: Any) -> Callable[[], Any]:
    """A factory that imports ``module.name`` only when the site draws it (the site's import stays light)."""

    def make() -> Any:
        import importlib

        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    return make


def _with(make_arguments: Callable[[], tuple], module: str, name: str, **kwargs: Any) -> Callable[[], Any]:
    """A factory whose positional arguments are computed when it is drawn."""

    def make() -> Any:
        return _lazy(module, name, *make_arguments(), **kwargs)()

    return make


WIDGETS = "labkit.viz.widgets"
LESSON_01_LINKS = {"gloo, 10 Gb Ethernet (TCP)": "10 Gb Ethernet (TCP)", "NCCL, PCIe 4.0 x16": "PCIe 4.0 x16",
                   "NCCL, InfiniBand NDR 400 Gb/s": "InfiniBand NDR (across nodes)",
                   "NCCL, NVLink 4 (H100, in a node)": "NVLink 4 (H100, inside a node)"}
LESSON_02_LINKS = {"NCCL, NVLink 4 (in a node)": "NVLink 4 (H100, inside a node)",
                   "NCCL, InfiniBand NDR 400 Gb/s": "InfiniBand NDR (across nodes)",
                   "gloo, 10 Gb Ethernet": "10 Gb Ethernet (TCP)"}
CONSTANTS = "the course's link constants (labkit/costmodel/hardware.py)"

EXPLORERS: list[Explorer] = [
    Explorer("00", "why_distributed_explorer", _lazy(WIDGETS, "why_distributed_explorer"),
             {"parameters": (1e9, 7e9, 70e9, 405e9), "GPUs": (8, 64, 512, 4096)},
             labels={"parameters": ("1B", "7B", "70B", "405B")}, seconds=8),
    Explorer("01", "ring_all_reduce_explorer", _with(lambda: (recorded_ring_runs(),), WIDGETS,
                                                     "ring_all_reduce_explorer"),
             {"ranks N": (2, 3, 4), "segments": (1, 2), "step": tuple(range(7))},
             inputs="ring all-reduces recorded on real gloo ranks when this site was built", seconds=7),
    Explorer("01", "alpha_beta_explorer", _with(lambda: (_links(LESSON_01_LINKS),), WIDGETS, "alpha_beta_explorer",
                                                world_size=8),
             {"link": tuple(LESSON_01_LINKS), "ranks N": (2, 8, 64)},
             inputs=CONSTANTS, notebook_only="the link the notebook fits on your machine"),
    Explorer("02", "ddp_step_explorer", _with(lambda: (_links(LESSON_02_LINKS),), WIDGETS, "ddp_step_explorer",
                                              compute_ms=60.0, parameters_m=350.0),
             {"link": tuple(LESSON_02_LINKS), "ranks N": (2, 8, 64, 512)}, inputs=CONSTANTS),
    Explorer("03", "lr_schedule_explorer", _lazy(WIDGETS, "lr_schedule_explorer"),
             {"rule": ("linear", "sqrt", "none"), "decay": ("constant", "cosine", "linear", "step")}),
    Explorer("04", "precision_memory_explorer", _lazy(WIDGETS, "precision_memory_explorer"),
             {"params (B)": (1.0, 7.0, 70.0, 405.0), "GPU": ("V100 32GB", "H100 80GB", "H200 141GB")}),
    Explorer("05", "memory_explorer", _lazy(WIDGETS, "memory_explorer"),
             {"model": ("gpt2-xl", "llama-2-7b", "llama-2-70b", "llama-3-405b"), "ZeRO stage": (0, 1, 2, 3)}),
    Explorer("06", "tensor_parallel_explorer", _lazy(WIDGETS, "tensor_parallel_explorer"),
             {"TP degree t": (1, 2, 4, 8, 16),
              "link": ("NVLink 4 (inside a node)", "InfiniBand NDR (across nodes)")}),
    Explorer("07", "pipeline_explorer", _lazy("labkit.viz.pipeline_widgets", "pipeline_explorer",
                                              schedules=("GPipe", "1F1B", "Interleaved 1F1B", "ZB-H1")),
             {"schedule": ("GPipe", "1F1B", "Interleaved 1F1B", "ZB-H1"), "micro-batches m": (4, 8, 16)}),
    Explorer("08", "ps_explorer", _lazy("labkit.viz.ps_plots", "ps_explorer"),
             {"mode": ("sync", "async", "ssp", "bounded_delay", "backup"), "workers N": (4, 12)}, seconds=9),
    Explorer("09", "checkpoint_explorer", _lazy("labkit.viz.checkpoint_plots", "checkpoint_explorer"),
             {"parameters (billions)": (8.0, 70.0, 405.0), "layout": ("full", "sharded")}),
    Explorer("10", "layout_explorer", _lazy("labkit.viz.mesh_widgets", "layout_explorer"),
             {"tensor parallel t": (1, 2, 4, 8), "pipeline stages p": (1, 4, 8)}, seconds=9),
    Explorer("11", "plan_explorer", _lazy("labkit.viz.plan_widgets", "plan_explorer", gpus=4096),
             {"GPUs N": (64, 256, 1024, 4096)}, seconds=10),  # a planner's search: 2.4 s a picture
    Explorer("12", "loader_explorer", _lazy("labkit.viz.monitor_plots", "loader_explorer"),
             {"workers W": (0, 1, 2, 4, 8), "t_compute (ms a step)": (20, 60, 100)}),
    Explorer("13", "attention_explorer", _lazy("labkit.viz.context_widgets", "attention_explorer"),
             {"cp ranks": (1, 2, 4), "block": (4, 8, 16)}),
    Explorer("13", "strategy_explorer", _lazy("labkit.viz.context_widgets", "strategy_explorer"),
             {"cp": (2, 4, 8, 16, 32), "link": ("InfiniBand", "NVLink", "as placed")}, seconds=8),
    Explorer("14", "moe_explorer", _lazy("labkit.viz.experts_plots", "moe_explorer"),
             {"capacity": ("none", "0.5", "1.0", "1.25", "2.0"), "skew (Zipf)": (0.0, 0.5, 1.0, 2.0)}),
    Explorer("15", "pipeline_explorer", _lazy("labkit.viz.pipeline_widgets", "pipeline_explorer", "ZB-V"),
             {"schedule": ("1F1B", "ZB-H1", "Interleaved ZB", "ZB-V", "DualPipeV"),
              "DualPipeV: overlap": (0.0, 0.5, 1.0)}, seconds=8),
]


def find(lesson: str, call: str) -> Explorer | None:
    """The entry for lesson ``lesson``'s cell that calls ``call``, or ``None``."""
    return next((explorer for explorer in EXPLORERS if (explorer.lesson, explorer.call) == (lesson, call)), None)


def explorer_call(source: str) -> str | None:
    """The explorer a code cell shows: the name of the function its last expression calls when that name ends in
    ``explorer`` (``widgets.alpha_beta_explorer(links)`` -> ``"alpha_beta_explorer"``); else ``None``."""
    try:
        body = ast.parse(source).body
    except SyntaxError:  # IPython magics
        return None
    if not body or not isinstance(body[-1], ast.Expr) or not isinstance(body[-1].value, ast.Call):
        return None
    function = body[-1].value.func
    name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")
    return name if name.endswith("explorer") else None


# ---------------------------------------------------------------------------------------------------------------
# Drawing the frames


@dataclass
class Control:
    """A control the page offers: its description, kind (``"select"`` or ``"range"``) and the values' labels."""

    description: str
    kind: str
    labels: list[str]
    opening: int  # the index of the value the notebook opens with


@dataclass
class Frames:
    """What the page needs to step through an explorer: its controls, the fixed ones, and one picture (PNG
    bytes, by content hash) and summary (HTML) per combination of the controls' values, in row-major order.  A
    frame is ``clamped`` on a control when the widget moved that value (lesson 01's step, past the last step of
    a smaller ring): the page's range stops before it."""

    key: str
    controls: list[Control]
    fixed: list[tuple[str, str]]
    pictures: dict[str, bytes]
    frames: list[dict[str, Any]]

    @property
    def settings(self) -> int:
        """The settings the page can show: the frames no value of which the widget moved."""
        return sum(not any(frame["clamped"]) for frame in self.frames)


def _controls(widget: Any) -> list[Any]:
    import ipywidgets

    if isinstance(widget, ipywidgets.Box):
        return [control for child in widget.children for control in _controls(child)]
    return [widget] if isinstance(widget, ipywidgets.ValueWidget) and getattr(widget, "description", "") else []


def _outputs(widget: Any) -> tuple[list[Any], list[Any]]:
    """The explorer's pictures (``ipywidgets.Image``) and summaries (``ipywidgets.HTML``), in order."""
    import ipywidgets

    if isinstance(widget, ipywidgets.Box):
        found = [_outputs(child) for child in widget.children]
        return [p for pictures, _ in found for p in pictures], [s for _, summaries in found for s in summaries]
    if isinstance(widget, ipywidgets.Image):
        return [widget], []
    return [], [widget] if isinstance(widget, ipywidgets.HTML) else []


def label(control: Any, value: Any | None = None) -> str:
    """How the notebook's control shows ``value`` (default: its current one)."""
    import ipywidgets

    value = control.value if value is None else value
    if isinstance(control, ipywidgets.Checkbox):
        return "on" if value else "off"
    options = getattr(control, "options", None)
    if options and not isinstance(control, ipywidgets.SelectMultiple):
        labels = getattr(control, "_options_labels", None) or [str(option) for option in options]
        values = getattr(control, "_options_values", None) or list(options)
        return labels[values.index(value)] if value in values else str(value)
    if isinstance(value, tuple):
        return ", ".join(str(item) for item in value)
    if isinstance(value, float):
        return f"{value:,.0f}" if value.is_integer() and abs(value) < 1e7 else f"{value:.3g}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def draw_frames(explorer: Explorer) -> Frames:
    """Build ``explorer``'s widget and move its stepped controls through every combination of their values,
    keeping what it shows for each.  Raises ``ValueError`` naming a description the widget does not have, a
    control whose opening value is not among its steps (the page opens where the notebook does), or a control
    that another one moved (the page would show a setting the notebook cannot reach)."""
    import ipywidgets

    widget = explorer.make()
    controls = {control.description: control for control in _controls(widget)}
    missing = [description for description in explorer.steps if description not in controls]
    if missing:
        raise ValueError(f"explorer {explorer.key}: no control described {missing}; it has {sorted(controls)}")
    pictures, summaries = _outputs(widget)
    if not pictures:
        raise ValueError(f"explorer {explorer.key}: the widget has no ipywidgets.Image to show")
    stepped = [controls[description] for description in explorer.steps]
    fixed = {description: control.value for description, control in controls.items()
             if description not in explorer.steps}
    page_controls = []
    for description, values in explorer.steps.items():
        control = controls[description]
        kind = "range" if isinstance(control, (ipywidgets.IntSlider, ipywidgets.FloatSlider,
                                               ipywidgets.FloatLogSlider, ipywidgets.SelectionSlider)) else "select"
        if control.value not in values:  # the page opens on the notebook's first picture
            raise ValueError(f"explorer {explorer.key}: {description!r} opens at {control.value!r} in the notebook, "
                             f"which is not among the values stepped, {list(values)}")
        labels = list(explorer.labels.get(description, [label(control, value) for value in values]))
        page_controls.append(Control(description, kind, labels, list(values).index(control.value)))
    stored: dict[str, bytes] = {}
    frames = []
    for combination in product(*explorer.steps.values()):
        for control, value in zip(stepped, combination, strict=True):
            control.value = value  # connect() redraws at once; an equal value redraws nothing and needs nothing
        moved = [description for description, value in fixed.items() if controls[description].value != value]
        if moved:
            raise ValueError(f"explorer {explorer.key}: setting {dict(zip(explorer.steps, combination, strict=True))} moved "
                             f"{moved}; step other values")
        png = bytes(pictures[0].value)
        digest = hashlib.sha1(png).hexdigest()[:16]
        stored[digest] = png
        shown = [page.labels[list(values).index(control.value)] if control.value in values else label(control)
                 for page, values, control in zip(page_controls, explorer.steps.values(), stepped, strict=True)]
        frames.append({"picture": digest, "summary": "".join(summary.value for summary in summaries),
                       "shown": shown,  # a value the widget moved (a step past its range) reads as it moved
                       "clamped": [control.value != value for control, value in zip(stepped, combination,
                                                                                   strict=True)]})
    return Frames(explorer.key, page_controls, [(d, label(controls[d])) for d in fixed], stored, frames)


def draw_all(explorers: Sequence[Explorer], workers: int) -> Iterator[Frames]:
    """:func:`draw_frames` for each explorer, over ``workers`` processes, the largest grids first (forked: the
    entries' factories are closures; the workers are not daemons, so lesson 01's may launch its ranks)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    if workers <= 1 or "fork" not in mp.get_all_start_methods():
        yield from map(draw_frames, explorers)
        return
    from labkit.launch import prepare_to_fork

    prepare_to_fork()
    order = sorted(explorers, key=lambda explorer: -explorer.seconds)
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("fork")) as pool:
        futures = [pool.submit(_draw_by_index, EXPLORERS.index(explorer)) for explorer in order]
        for future in as_completed(futures):
            yield future.result()


def _draw_by_index(index: int) -> Frames:
    import matplotlib

    matplotlib.use("Agg")
    return draw_frames(EXPLORERS[index])
