"""Time a pipeline schedule: place each rank's actions with real durations and measure the bubble.

Each rank runs its actions in the schedule's order; an action starts when its rank is free and its inputs are
done (the previous stage's ``F`` for a forward, the next stage's ``B`` or ``I`` for a backward), plus
``send_s`` when an input crosses ranks.  Nothing else is modelled: no compute/communication overlap, no memory
limit.  The placement is :mod:`.engine`'s, the one that gives a table its unit time slots.

**Bubble fraction** here is idle rank-time over total rank-time: ``idle / (p T)``, where ``T`` is the step's
makespan and ``idle = p T - busy``.  Narayanan et al. (2021) instead quote the bubble *over the ideal time*
``T_ideal = busy / p``: ``(p-1)/m`` for GPipe and 1F1B.  The two are linked by ``r = f / (1 - f)``, ``f = r /
(1 + r)``: with ``r = (p-1)/m``, ``f = (p-1)/(m+p-1)``.  :attr:`Timeline.bubble_over_ideal` gives ``r``.

**Activations held**: a stage stores one micro-batch's activations from its ``F`` until its ``B``, or, split,
until its ``I`` (which uses most of them; the deferred ``W`` keeps only each layer's input and output gradient,
as Qi et al. 2023 count).  :attr:`Timeline.peak_activations` is, per stage, the most micro-batches held at once,
and :attr:`Timeline.rank_peaks` per rank, over all its stages together (a micro-batch of a stage holding ``1/v``
of a rank's layers counts one, as DualPipe's README counts).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from labkit.parallel.pipeline.engine import Compiled, place
from labkit.parallel.pipeline.schedule import Action, Schedule, compile_schedule, validate

Seconds = float | Sequence[float]


@dataclass(frozen=True)
class Timeline:
    """What :func:`simulate` measured.  ``events[rank]`` is that rank's ``(start, end, action)``, in order."""

    schedule: Schedule
    events: list[list[tuple[float, float, Action]]]
    total: float  # the makespan: when the last action ends
    peak_activations: list[int]  # per stage: most micro-batches between F and B (or I) at once
    rank_peaks: list[int] | None = None  # per rank: most (stage, micro-batch) pairs held at once, all its stages

    def __post_init__(self) -> None:
        if self.rank_peaks is None:  # counted from the orders (a measured timeline brings its own count)
            object.__setattr__(self, "rank_peaks", _held(self.schedule)[1])

    @property
    def busy(self) -> float:
        return sum(end - start for row in self.events for start, end, _ in row)

    @property
    def idle(self) -> float:
        return self.schedule.p * self.total - self.busy

    @property
    def bubble_fraction(self) -> float:
        """Idle rank-time over total rank-time, ``idle / (p T)``."""
        return self.idle / (self.schedule.p * self.total)

    @property
    def bubble_over_ideal(self) -> float:
        """Idle over busy rank-time, Narayanan's convention: ``(p-1)/m`` for 1F1B with uniform stages."""
        return self.idle / self.busy


def _per_stage(name: str, value: Seconds, stages: int) -> list[float]:
    values = list(value) if isinstance(value, Sequence) else [value] * stages
    if len(values) != stages:
        raise ValueError(f"{name} needs one duration per stage: {stages} stages, got {len(values)} values")
    if any(x < 0 for x in values):
        raise ValueError(f"{name} must be >= 0, got {values}")
    return values  # type: ignore[return-value]


@functools.lru_cache(maxsize=64)
def _validated(schedule: Schedule) -> None:
    """:func:`validate`, once per schedule (a planner simulates one table with many durations)."""
    validate(schedule)


def simulate(schedule: Schedule, forward_s: Seconds = 1.0, backward_s: Seconds = 2.0,
             weight_s: Seconds | None = None, send_s: float = 0, overlap: float = 0) -> Timeline:
    """Place ``schedule``'s actions in time (after :func:`validate`).

    Durations are per stage (a list of ``p v`` values) or one for all.  ``backward_s`` is a full ``B``; a split
    backward costs the same in total: ``W`` takes ``weight_s`` (``backward_s / 2`` by default) and ``I`` the
    rest.  For interleaved schedules the durations are per chunk: pass ``1/v`` of a whole rank's share to
    compare with the same model on ``v = 1``.  Exact numbers (``int``, ``fractions.Fraction``) stay exact.
    An overlapped pair (DualPipeV's ``F&B``, ``schedule.pairs``) starts once both its inputs are in and takes
    ``F + B - overlap * min(F, B)``: ``overlap = 0`` runs them one after the other (torch's runtime and labkit's),
    ``1`` hides the shorter entirely.
    """
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap must be in [0, 1] (the share of the shorter action of a pair hidden), got {overlap}")
    _validated(schedule)
    stages = schedule.stages
    f = _per_stage("forward_s", forward_s, stages)
    b = _per_stage("backward_s", backward_s, stages)
    w = [x / 2 for x in b] if weight_s is None else _per_stage("weight_s", weight_s, stages)
    if any(wi > bi for wi, bi in zip(w, b, strict=True)):
        raise ValueError(f"weight_s {w} must not exceed backward_s {b}: I takes backward_s - weight_s")
    if send_s < 0:
        raise ValueError(f"send_s must be >= 0, got {send_s}")
    durations = {"F": f, "B": b, "I": [bi - wi for bi, wi in zip(b, w, strict=True)], "W": w}

    compiled = compile_schedule(schedule)
    lengths = [durations[action.kind][action.stage] for action in compiled.actions]
    return _timeline(schedule, place(compiled, _paired(compiled, lengths, overlap), send_s).events())


def replay(timeline: Timeline, send_s: float = 0) -> Timeline:
    """``timeline``'s actions placed again by the schedule's rules, each lasting what it lasted in ``timeline``:
    what the schedule alone makes of those durations (a simulation fed every action's own duration, where
    :func:`simulate` takes one per stage and kind).

    For a measured timeline (``run_schedule``), every action started once its rank was free and its inputs had
    been handed over, so the measured step exceeds its replay by the time the runtime spent between actions
    (messages, Python, other programs), which the simulator does not model.  It can fall a little short: an
    action's end is read after its output is sent, so a rank descheduled in between records an end later than
    the moment its neighbour could start (lesson 07 measures by how much on its reference machine).
    Raises ValueError if an action of the schedule is missing from ``timeline``."""
    schedule = timeline.schedule
    _validated(schedule)
    own = {action: end - start for row in timeline.events for start, end, action in row}
    missing = [action for order in schedule.orders() for action in order if action not in own]
    if missing:
        raise ValueError(f"{schedule.name}: the timeline has no duration for {missing[0]} "
                         f"({len(missing)} of the schedule's actions missing)")
    compiled = compile_schedule(schedule)
    lengths = [own[action] for action in compiled.actions]
    return _timeline(schedule, place(compiled, _paired(compiled, lengths, 0), send_s).events())


def _paired(compiled: Compiled, lengths: list[float], overlap: float) -> list[float]:
    """``lengths`` with each overlapped pair's time, ``F + B - overlap * min(F, B)``, shared by its two passes in
    proportion to their own."""
    for forward, backward in enumerate(compiled.pair_of):
        if backward >= 0:
            f, b = lengths[forward], lengths[backward]
            together = f + b - overlap * min(f, b)
            lengths[forward], lengths[backward] = (together * f / (f + b), together * b / (f + b)) if f + b else (0, 0)
    return lengths


def _timeline(schedule: Schedule, events: list[list[tuple[float, float, Action]]]) -> Timeline:
    total = max((row[-1][1] for row in events if row), default=0.0)
    return Timeline(schedule, events, total, *_held(schedule))


def _held(schedule: Schedule) -> tuple[list[int], list[int]]:
    """Per stage and per rank, the most micro-batches held at once, counted along each rank's order."""
    peak = [0] * schedule.stages
    held = [0] * schedule.stages
    rank_peaks = []
    for order in schedule.orders():
        most = on_rank = 0
        for action in order:  # a stage's actions all run on one rank, so that rank's order is their order
            change = {"F": 1, "B": -1, "I": -1}.get(action.kind, 0)
            held[action.stage] += change
            peak[action.stage] = max(peak[action.stage], held[action.stage])
            on_rank += change
            most = max(most, on_rank)
        rank_peaks.append(most)
    return peak, rank_peaks
