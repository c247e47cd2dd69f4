"""Simulate a parameter server in time: the real rule, modelled durations (lesson 08).

The server's decisions are made by ``labkit.parallel.parameter_server.Gate`` itself, so the simulated rule is the
one that trains; only time is modelled.  A worker released at ``t`` receives the weights at ``t + message_s``,
computes for ``compute_s`` plus its delay (``Stragglers.delay``, drawn from the same seeded generator, in the same
order, as a launched worker sleeps it), and its gradient reaches the server ``message_s`` later.  The server
decides in no time; gradients arriving at the same instant are taken in the order they were sent.  As on the
real server, once ``updates`` updates are made each worker is stopped at its next message, and a gradient that
arrives after the last update is recorded as dropped.

What comes back (:class:`ServerTimeline`) is what :class:`~labkit.parallel.parameter_server.ParameterServerRun`
records, the same :class:`~labkit.parallel.parameter_server.Received` per gradient (with no loss: nothing is
trained), plus what a launched run cannot see: when each worker computed, on which version, and when the server
held its gradient (or, under ssp, held the worker after applying it).  :func:`clock_gap` reads SSP's promise from
either kind of record.  Against ``labkit.costmodel.stragglers``: with no delay a synchronous update takes exactly
``compute_s + 2 message_s`` and ``N`` equal asynchronous workers settle at staleness ``N - 1``; with exponential
delays the mean seconds per update approach ``compute_s + 2 message_s + mu H_N`` (sync) and the renewal rate
(async), while backup workers come out slower than ``mu (H_N - H_b)`` promises, because a late worker finishes
its dropped gradient before it pulls the new weights; ssp with a persistent straggler approaches its pace,
``c_slow / N`` per update.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from labkit.parallel.parameter_server.runtime import Gate, Received, Stragglers, check_arguments

__all__ = ["ServerTimeline", "clock_gap", "simulate_parameter_server"]


@dataclass(frozen=True)
class ServerTimeline:
    """One simulated run.  ``computes[w][step]`` is worker ``w``'s ``(start_s, end_s, pulled)``: the gradient of
    its ``step``, computed on version ``pulled`` (``end_s - start_s`` is ``compute_s`` plus its delay);
    ``holds[w]`` its ``(arrived_s, released_s)`` spans while the server held its gradient; ``received`` every
    gradient in the order the server took it (``received[i].time_s``: when the decision was made)."""

    mode: str
    workers: int
    staleness_bound: int | None
    backup_workers: int
    max_delay: int | None
    compute_s: float
    message_s: float
    computes: list[list[tuple[float, float, int]]]
    holds: list[list[tuple[float, float]]]
    received: list[Received]
    update_times_s: list[float]

    @property
    def applied(self) -> list[Received]:
        return [r for r in self.received if r.applied is not None]

    def staleness(self) -> list[int]:
        return [r.staleness for r in self.applied]

    @property
    def seconds_per_update(self) -> float:
        """Wall-clock per update: the last update's time over the number of updates."""
        return self.update_times_s[-1] / len(self.update_times_s)

    @property
    def total_s(self) -> float:
        """When the last gradient reached the server."""
        return max(r.time_s for r in self.received)


def _check_simulation(workers: object, compute_s: object, message_s: object, stragglers: object) -> None:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    for name, value in (("compute_s", compute_s), ("message_s", message_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
    if not isinstance(stragglers, Stragglers):
        raise ValueError(f"stragglers must be a labkit.parallel.parameter_server.Stragglers, got {stragglers!r}")
    outside = sorted(worker for worker in stragglers.slow if not (isinstance(worker, int) and 0 <= worker < workers))
    if outside:
        raise ValueError(f"stragglers.slow names workers {outside}, but the workers are 0..{workers - 1}")


def simulate_parameter_server(mode: str = "sync", workers: int = 4, updates: int = 20, *, compute_s: float = 1.0,
                              message_s: float = 0.0, staleness_bound: int | None = None, backup_workers: int = 0,
                              stragglers: Stragglers | None = None, max_delay: int | None = None) -> ServerTimeline:
    """Run ``mode``'s rule over ``workers`` workers until ``updates`` updates are made (the arguments of
    ``run_parameter_server``, checked the same way: ``staleness_bound`` for ``"ssp"``, ``max_delay`` for
    ``"bounded_delay"``, ``backup_workers`` of the ``workers`` for ``"backup"``), each gradient taking
    ``compute_s`` plus the ``stragglers``' delay and each message ``message_s`` seconds."""
    stragglers = Stragglers() if stragglers is None else stragglers
    _check_simulation(workers, compute_s, message_s, stragglers)
    check_arguments(mode, updates, 1.0, staleness_bound, backup_workers, workers, max_delay)  # the server's (lr unused)
    gate = Gate(mode, workers, staleness_bound, backup_workers, max_delay)
    generators = [stragglers.generator(worker) for worker in range(workers)]
    computes: list[list[tuple[float, float, int]]] = [[] for _ in range(workers)]
    holds: list[list[tuple[float, float]]] = [[] for _ in range(workers)]
    in_flight: list[tuple[float, int, int]] = []  # (arrival at the server, order sent, worker)
    order = itertools.count()

    def release(worker: int, version: int, now: float) -> None:
        start = now + message_s
        end = start + compute_s + stragglers.delay(worker, generators[worker])
        computes[worker].append((start, end, version))
        heapq.heappush(in_flight, (end + message_s, next(order), worker))

    for worker in range(workers):
        release(worker, 0, 0.0)
    arrived: dict[int, float] = {}  # worker -> when its gradient, not yet applied or dropped, arrived
    received: list[Received] = []
    update_times: list[float] = []

    def record(worker: int, applied: int | None, now: float) -> None:
        pulled = computes[worker][-1][2]
        received.append(Received(worker, len(computes[worker]) - 1, pulled, applied, now, math.nan))

    while in_flight:
        now, _, worker = heapq.heappop(in_flight)
        if len(update_times) >= updates:  # the budget is spent: dropped, and the worker stopped
            record(worker, None, now)
            continue
        arrived[worker] = now
        decision = gate.arrive(worker, computes[worker][-1][2])
        for index in decision.drop:
            record(index, None, now)
        if decision.apply:
            for index in decision.apply:
                record(index, gate.version - 1, now)
            update_times.append(now)
        for index in decision.release:
            since = arrived.pop(index)
            if now > since:
                holds[index].append((since, now))
            if len(update_times) < updates:
                release(index, gate.version, now)
        if not in_flight and arrived and len(update_times) < updates:
            raise RuntimeError(f"the {mode} rule holds workers {sorted(arrived)} while no gradient is in flight")
    return ServerTimeline(mode, workers, staleness_bound, backup_workers, max_delay, compute_s, message_s, computes,
                          holds, received, update_times)


def clock_gap(received: Sequence[Received], workers: int) -> int:
    """SSP's promise read from a run's records (launched or simulated): the most clocks by which a worker, pulling
    the weights for its gradient number ``c`` (its ``step``) at version ``v``, was ahead of the worker with the
    fewest gradients applied before ``v``.  SSP (Ho et al.) keeps it ``<= s``: the weights pulled hold every
    gradient of clocks ``<= c - s - 1``.  Under ssp every arrival is an update, so the count is each worker's
    clock at the pull; under other rules (held gradients are not counted yet) it can only read higher."""
    applied = [sorted(r.applied for r in received if r.worker == w and r.applied is not None) for w in range(workers)]
    return max(r.step - min(bisect.bisect_left(versions, r.pulled) for versions in applied) for r in received)
