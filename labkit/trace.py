"""Per-rank timelines: what each rank was doing when — computing, communicating, idle, or in a pipeline bubble.

Overlap is the central trick of fast distributed training (all-reduce one bucket of gradients while the
backward pass computes the next), and it is invisible in a loss curve.  This module records *spans* — a name, a
kind and start/end times — on every rank, and gathers them to one rank of any process group, where
``labkit.viz.plots`` draws them as a timeline or :func:`write_chrome_trace` saves them for Perfetto.  The kinds:
``"compute"``, ``"comm"`` (communication), ``"idle"`` (waiting for another rank, e.g. for gradients) and
``"bubble"`` (a pipeline stage idle because the schedule has no work for it yet: the pipeline bubble,
``(p - 1) / (m + p - 1)`` of the step for GPipe and 1F1B with ``p`` stages and ``m`` micro-batches).

**Mesh coordinates.**  Under 3D parallelism "rank 5" says little; "pipeline stage 1, data-parallel replica 0,
tensor-parallel rank 1" says where it sits.  ``enable(coords=mesh.coords())`` (or :func:`set_coords`) tags every
span this rank records with its coordinates, e.g. ``{"pp": 1, "dp": 0, "tp": 1}``.

**Chrome / Perfetto traces.**  :func:`to_chrome_trace` turns spans into the Trace Event Format that
``chrome://tracing`` and https://ui.perfetto.dev open: one *complete* event (``"ph": "X"``, ``ts`` and ``dur`` in
microseconds) per span, a process per rank (``pid`` = rank, named with its coordinates) and a thread per kind of
work (``tid`` = lane; spans of one kind that overlap, like two buckets' all-reduces in flight, get a lane each,
since the format expects the events of one thread to nest).

Recording is off by default and then costs one boolean test per call.  Times are ``time.perf_counter()``
seconds relative to the moment recording was enabled on that rank; the ranks' clocks are aligned by having each
enable right after a barrier, so they agree to within the barrier's skew (tens of microseconds on one
machine).

Asynchronous communication (an all-reduce handed to the backend while Python carries on) is recorded from the
moment it is launched to the moment the backend reports it done, with :func:`record_async`::

    work = dist.all_reduce(bucket, async_op=True)
    trace.record_async(work, "all-reduce bucket 3")
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as torch_dist

from labkit.dist import global_rank, is_initialized, require_group

KINDS = ("compute", "comm", "idle", "bubble")


@dataclass(frozen=True)
class Span:
    rank: int  # global rank
    name: str
    kind: str
    start_s: float
    end_s: float
    coords: dict[str, int] | None = field(default=None, hash=False)  # mesh coordinates, e.g. {"pp": 0, "dp": 1}

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s


_lock = threading.Lock()
_spans: list[Span] = []
_origin: float | None = None  # None: recording is off
_coords: dict[str, int] | None = None
_pending = 0  # asynchronous collectives recorded whose completion callback has not run yet
_settled = threading.Condition(_lock)


def enable(barrier: bool = True, coords: Mapping[str, int] | Any | None = None, group: Any = None) -> None:
    """Start recording on this rank (clearing earlier spans).

    With ``barrier``, the ranks of ``group`` (default: all) start together.  ``coords``: this rank's mesh
    coordinates, tagged on every span (see :func:`set_coords`); ``None`` leaves spans untagged.
    """
    global _origin, _pending
    set_coords(coords)
    if barrier and is_initialized():
        torch_dist.barrier(group=require_group(group))
    with _lock:
        _spans.clear()
        _pending = 0
        _origin = time.perf_counter()


def set_coords(coords: Mapping[str, int] | Any | None) -> None:
    """Tag the spans this rank records from now on with ``coords``: a mapping such as ``{"pp": 0, "dp": 1,
    "tp": 0}``, or anything with a ``coords()`` method returning one (a ``Mesh``); ``None`` removes the tag."""
    global _coords
    if coords is not None and callable(getattr(coords, "coords", None)):
        coords = coords.coords()
    if coords is not None:
        if not isinstance(coords, Mapping) or not all(
                isinstance(name, str) and isinstance(value, int) and not isinstance(value, bool) and value >= 0
                for name, value in coords.items()):
            raise ValueError(f"coords must map dimension names to integers >= 0, e.g. {{'pp': 0, 'dp': 1}}, "
                             f"got {coords!r}")
        coords = dict(coords)
    _coords = coords


def disable() -> None:
    """Stop recording (the spans recorded so far are kept until :func:`enable` or :func:`clear`)."""
    global _origin
    _origin = None


def is_enabled() -> bool:
    return _origin is not None


def clear() -> None:
    with _lock:
        _spans.clear()


def now() -> float:
    """Seconds since recording was enabled on this rank (0.0 when it is off)."""
    return 0.0 if _origin is None else time.perf_counter() - _origin


def _rank() -> int:
    return torch_dist.get_rank() if is_initialized() else 0


def add(name: str, kind: str, start_s: float, end_s: float) -> None:
    """Record a span whose times (from :func:`now`) are already known.  No-op when recording is off."""
    if _origin is None:
        return
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    with _lock:
        _spans.append(Span(_rank(), name, kind, start_s, end_s, _coords))


@contextmanager
def span(name: str, kind: str = "compute") -> Iterator[None]:
    """Record the time spent in a ``with`` block."""
    if _origin is None:
        yield
        return
    start = now()
    try:
        yield
    finally:
        add(name, kind, start, now())


def record_async(work, name: str, kind: str = "comm") -> None:
    """Record an asynchronous collective from now until the backend completes it.

    ``work`` is what ``torch.distributed`` returns with ``async_op=True``; its future's callback runs when the
    backend finishes, on the backend's thread, which is what makes overlap visible.
    """
    if _origin is None or work is None:
        return
    global _pending
    start = now()
    future = work.get_future()
    with _lock:
        _pending += 1

    def finished(_future):
        global _pending
        add(name, kind, start, now())
        with _lock:
            _pending -= 1
            _settled.notify_all()
        return None

    future.then(finished)


def spans(settle_timeout_s: float = 5.0) -> list[Span]:
    """This rank's spans so far, in the order they ended.

    Completion callbacks of asynchronous collectives run on the backend's thread and may lag behind the
    ``wait()`` that returned; this waits (up to ``settle_timeout_s``) until every recorded one has reported.
    """
    with _lock:
        _settled.wait_for(lambda: _pending == 0, timeout=settle_timeout_s)
        return list(_spans)


def gather(group: Any = None) -> list[Span] | None:
    """Every rank's spans, gathered over ``group`` (default: all ranks) to the group's first rank.

    Returns them there, sorted by rank, then start time, and ``None`` on the other ranks.  Any group works,
    also one without global rank 0: its first rank is found with ``labkit.dist.global_rank``.  Every member must
    call it; without a process group this rank's own spans are returned.
    """
    mine = spans()
    if not is_initialized():
        return sorted(mine, key=lambda s: (s.rank, s.start_s))
    group = require_group(group)
    first = torch_dist.get_rank(group) == 0
    everyone: list[list[Span]] | None = [[] for _ in range(torch_dist.get_world_size(group))] if first else None
    torch_dist.gather_object(mine, everyone, dst=global_rank(group, 0), group=group)
    if everyone is None:
        return None
    return sorted((s for spans_of_rank in everyone for s in spans_of_rank), key=lambda s: (s.rank, s.start_s))


# --------------------------------------------------------------------------------------------------------
# Chrome / Perfetto export


def _lanes(spans_of_rank: Sequence[Span]) -> list[tuple[str, list[Span]]]:
    """Per kind (in ``KINDS`` order), the fewest lanes in which no two spans overlap: greedy interval
    partitioning, by start time."""
    lanes: list[tuple[str, list[Span]]] = []
    for kind in KINDS:
        ends: list[float] = []
        of_kind: list[list[Span]] = []
        for span in sorted((s for s in spans_of_rank if s.kind == kind), key=lambda s: (s.start_s, s.end_s)):
            lane = next((index for index, end in enumerate(ends) if end <= span.start_s), len(ends))
            if lane == len(ends):
                ends.append(span.end_s)
                of_kind.append([])
            ends[lane] = span.end_s
            of_kind[lane].append(span)
        lanes += [(kind if index == 0 else f"{kind} {index + 1}", lane) for index, lane in enumerate(of_kind)]
    return lanes


def _describe(coords: Mapping[str, int] | None) -> str:
    return "" if not coords else " (" + ", ".join(f"{name} {value}" for name, value in coords.items()) + ")"


def to_chrome_trace(spans: Sequence[Span]) -> dict:
    """Spans as a Chrome / Perfetto trace (the Trace Event Format's ``{"traceEvents": [...]}``).

    Each span is one complete event (``"ph": "X"``) with ``ts`` and ``dur`` in microseconds, ``pid`` its rank,
    ``tid`` a lane of its kind, ``cat`` its kind and its mesh coordinates in ``args``; metadata events
    (``"ph": "M"``) name each rank's process (``"rank 3 (pp 1, dp 0, tp 1)"``) and lanes, and sort them.
    """
    events: list[dict] = []
    for rank in sorted({s.rank for s in spans}):
        of_rank = [s for s in spans if s.rank == rank]
        coords = next((s.coords for s in of_rank if s.coords), None)
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}{_describe(coords)}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for tid, (lane, lane_spans) in enumerate(_lanes(of_rank)):
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": lane}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid,
                           "args": {"sort_index": tid}})
            events += [{"name": s.name, "cat": s.kind, "ph": "X", "pid": rank, "tid": tid, "ts": s.start_s * 1e6,
                        "dur": s.seconds * 1e6, "args": {"kind": s.kind, **(s.coords or {})}} for s in lane_spans]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(spans: Sequence[Span], path: str | os.PathLike) -> Path:
    """Write :func:`to_chrome_trace` as JSON to ``path`` (open it in https://ui.perfetto.dev); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_chrome_trace(spans)))
    return path
