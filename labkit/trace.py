"""Per-rank timelines: what each rank was doing when — computing, communicating, or idle.

Overlap is the central trick of fast distributed training (all-reduce one bucket of gradients while the
backward pass computes the next), and it is invisible in a loss curve.  This module records *spans* — a name, a
kind (``"compute"``, ``"comm"`` or ``"idle"``) and start/end times — on every rank, and gathers them to rank 0,
where ``labkit.viz.plots`` draws them as a timeline.

Recording is off by default and then costs one boolean test per call.  Times are ``time.perf_counter()``
seconds relative to the moment recording was enabled on that rank; :func:`gather` aligns the ranks by having
each enable right after a barrier, so the clocks agree to within the barrier's skew (tens of microseconds on one
machine).

Asynchronous communication (an all-reduce handed to the backend while Python carries on) is recorded from the
moment it is launched to the moment the backend reports it done, with :func:`record_async`::

    work = dist.all_reduce(bucket, async_op=True)
    trace.record_async(work, "all-reduce bucket 3")
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch.distributed as torch_dist

KINDS = ("compute", "comm", "idle")


@dataclass(frozen=True)
class Span:
    rank: int
    name: str
    kind: str
    start_s: float
    end_s: float

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s


_lock = threading.Lock()
_spans: list[Span] = []
_origin: float | None = None  # None: recording is off
_pending = 0  # asynchronous collectives recorded whose completion callback has not run yet
_settled = threading.Condition(_lock)


def enable(barrier: bool = True) -> None:
    """Start recording on this rank (clearing earlier spans).  With ``barrier``, all ranks start together."""
    global _origin, _pending
    if barrier and torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.barrier()
    with _lock:
        _spans.clear()
        _pending = 0
        _origin = time.perf_counter()


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
    return torch_dist.get_rank() if torch_dist.is_available() and torch_dist.is_initialized() else 0


def add(name: str, kind: str, start_s: float, end_s: float) -> None:
    """Record a span whose times (from :func:`now`) are already known.  No-op when recording is off."""
    if _origin is None:
        return
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    with _lock:
        _spans.append(Span(_rank(), name, kind, start_s, end_s))


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


def gather(group=None) -> list[Span] | None:
    """Every rank's spans on rank 0 (``None`` elsewhere); sorted by rank, then start time."""
    mine = spans()
    if not (torch_dist.is_available() and torch_dist.is_initialized()):
        return sorted(mine, key=lambda s: (s.rank, s.start_s))
    everyone: list[list[Span]] | None = [[] for _ in range(torch_dist.get_world_size(group))] \
        if torch_dist.get_rank() == 0 else None
    torch_dist.gather_object(mine, everyone, dst=0, group=group)
    if everyone is None:
        return None
    return sorted((s for spans_of_rank in everyone for s in spans_of_rank), key=lambda s: (s.rank, s.start_s))
