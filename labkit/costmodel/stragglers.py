"""Stragglers: what waiting for the slowest worker costs synchronous training, and what not waiting costs
asynchronous training (lesson 08).  Pure arithmetic, no process group.

**The model.**  Each of ``N`` workers turns weights into a gradient in ``compute_s`` seconds plus a delay, and a
message (weights out, gradient back) takes ``message_s`` each way, so one round trip is ``compute_s + 2
message_s`` plus the delay.  Two kinds of delay, as ``labkit.parallel.parameter_server.Stragglers`` draws them:

- *random*: every gradient of every worker is late by an independent exponential delay of mean ``mu``;
- *fixed*: one worker is ``slow_s`` seconds slower on every gradient (a slower GPU, a busier host).

**Why the harmonic number.**  The minimum of ``k`` independent exponentials of mean ``mu`` is exponential of
mean ``mu / k``.  Sort ``N`` delays: the first to finish comes after ``Exp(mu / N)``; the other ``N - 1`` have
forgotten how long they ran (the exponential is memoryless), so the next comes ``Exp(mu / (N - 1))`` later, and
so on (Rényi 1953).  The ``k``-th fastest therefore finishes after ``mu (1/N + 1/(N-1) + ... + 1/(N-k+1)) = mu
(H_N - H_(N-k))`` on average, ``H_n = 1 + 1/2 + ... + 1/n`` the ``n``-th harmonic number, and the slowest
(``k = N``) after ``mu H_N``, about ``mu (ln N + 0.577)``: a synchronous step grows with the log of the number
of workers even when no worker is slow on average.

=============  =================================================  =========================  ======================
mode           seconds per update (expected)                      gradients applied per      staleness
                                                                  update
=============  =================================================  =========================  ======================
sync           ``compute + 2 message + mu H_N`` (``+ slow_s`` if  ``N``                      0
               fixed)
backup         ``compute + 2 message + mu (H_N - H_b)``; a fixed  ``N - b``                  0
               straggler is one of the ``b`` dropped
async          ``1 / sum_i 1 / c_i``, ``c_i = compute + 2         1                          ``N - 1``
               message + mu + slow_i`` the worker's round trip
ssp            a fixed straggler: ``c_slow / N`` in the long run  1                          not bounded by ``s``
               (no worker gets more than ``s`` clocks ahead of
               it, so all go at its pace); random delays: between
               sync (``s = 0``) and async, simulate it
bounded_delay  between sync (``tau = 0``) and async: simulate it  1 or more                   ``<= tau``
=============  =================================================  =========================  ======================

*Synchronous* training waits for the slowest gradient, so a fixed straggler sets every step.  Dean et al.
(2012, "Large Scale Distributed Deep Networks", Downpour SGD) took the other way out: *asynchronous* workers
never wait; each gradient is applied on arrival, so a worker's updates arrive at the rate ``1 / c_i`` whatever
the others do (a renewal process), and the server applies ``sum_i 1 / c_i`` per second.  The price is
*staleness*: between a worker's pull and its gradient's arrival every other worker's gradients land, ``c_i
sum_(j != i) 1 / c_j`` of them on average; averaged over all gradients that is exactly ``N - 1`` whatever the
speeds (the workers' round trips tile the server's time), and a slow worker's gradients are the stalest.

Chen et al. (2016, "Revisiting Distributed Synchronous SGD") kept synchronous updates and cut the tail: of ``N``
workers the first ``N - b`` gradients of each step make the update and the ``b`` *backup* workers' late ones are
dropped, so a step waits for the ``(N - b)``-th fastest, ``mu (H_N - H_b)``.  That assumes every worker starts
each step on the new weights.  The parameter server in ``labkit.parallel.parameter_server`` (like
TensorFlow's ``SyncReplicasOptimizer``, which drops a stale gradient when it arrives) lets a late worker finish
its gradient before it pulls the new weights, so it starts the next step behind: with random delays the
simulated step is slower than this formula by 0.25 to 0.45 ``mu`` (``N`` from 4 to 16, ``b`` from 1 to 4,
``compute`` from 1 to 10 ``mu``; 0.36 ``mu`` for ``N = 4, b = 1, compute = 5 mu``), still well under
synchronous training, which waits ``mu H_b`` longer than the formula (``tests/test_parameter_server_simulate.py`` measures
both).

The two bounded rules bound different things.  Ho et al. (2013)'s *Stale Synchronous Parallel* bounds how far
apart the workers' clocks (gradients sent) may drift: a worker ``s`` clocks ahead of the slowest waits, so over a
long run every worker sends as many gradients as the slowest, give or take ``s + 1``, and a persistent straggler
sets the pace of all; a transient one is absorbed.  A *bounded delay* ``tau`` (Li et al. 2014) bounds the
staleness of every applied gradient instead; the clocks may drift apart for ever.

Step sizes compare the modes fairly by *gradients per second*: the server moves the weights by ``lr / N`` per
applied gradient in every mode (``lr / (N - b)`` with backups), so ``N`` asynchronous updates travel as far as
one synchronous step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

MODES = ("sync", "async", "ssp", "bounded_delay", "backup")


def harmonic(n: int) -> float:
    """``H_n = 1 + 1/2 + ... + 1/n`` (``H_0 = 0``)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an integer >= 0, got {n!r}")
    return math.fsum(1.0 / k for k in range(1, n + 1))


def expected_kth_fastest_s(k: int, n: int, mean_s: float) -> float:
    """Expected ``k``-th smallest of ``n`` independent exponential delays of mean ``mean_s``: ``mean_s (H_n -
    H_(n-k))``; ``k = n`` is the slowest, ``mean_s H_n``."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise ValueError(f"k must be an integer in [1, n = {n}], got {k!r}")
    _non_negative(mean_s=mean_s)
    return mean_s * (harmonic(n) - harmonic(n - k))


def _non_negative(**values: float) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{name} must be a number >= 0 (seconds), got {value!r}")


def _check_workers(workers: int, backup_workers: int = 0) -> None:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    if isinstance(backup_workers, bool) or not isinstance(backup_workers, int) or not 0 <= backup_workers < workers:
        raise ValueError(f"backup_workers must be an integer in [0, {workers}) with {workers} workers (the others "
                         f"make each update), got {backup_workers!r}")


def sync_update_s(workers: int, compute_s: float, message_s: float = 0.0, exponential_mean_s: float = 0.0,
                  slow_s: float = 0.0, backup_workers: int = 0) -> float:
    """Expected seconds per synchronous update of ``workers`` workers, ``backup_workers`` of them backups (the
    update takes the first ``workers - backup_workers`` gradients): ``compute_s + 2 message_s`` plus the
    ``(N - b)``-th fastest delay, ``mu (H_N - H_b)`` for exponential delays of mean ``mu =
    exponential_mean_s``, or ``slow_s`` for one worker that much slower (nothing once ``b >= 1``: it is always
    among the dropped).  One kind of delay at a time: with both, the order statistic has no closed form here."""
    _check_workers(workers, backup_workers)
    _non_negative(compute_s=compute_s, message_s=message_s, exponential_mean_s=exponential_mean_s, slow_s=slow_s)
    if exponential_mean_s > 0 and slow_s > 0:
        raise ValueError(f"the closed form takes one kind of straggler at a time, got exponential_mean_s="
                         f"{exponential_mean_s} and slow_s={slow_s}; simulate both (labkit.parallel.parameter_server.simulate)")
    delay = expected_kth_fastest_s(workers - backup_workers, workers, exponential_mean_s)
    if backup_workers == 0:
        delay += slow_s
    return compute_s + 2 * message_s + delay


def async_update_s(round_trips_s: Sequence[float]) -> float:
    """Seconds per asynchronous update: ``1 / sum_i 1 / c_i`` for workers whose mean round trip (weights out,
    gradient computed and delayed, gradient back) is ``c_i``; ``c / N`` for ``N`` equal workers."""
    _check_round_trips(round_trips_s)
    return 1.0 / math.fsum(1.0 / c for c in round_trips_s)


def async_staleness(round_trips_s: Sequence[float]) -> list[float]:
    """Per worker, the mean staleness of its gradients under asynchronous training: ``c_i sum_(j != i) 1 / c_j``,
    the other workers' updates that land during its round trip.  Weighted by each worker's rate ``1 / c_i`` the
    mean over all gradients is ``N - 1``, for any round trips."""
    _check_round_trips(round_trips_s)
    rate = math.fsum(1.0 / c for c in round_trips_s)
    return [c * (rate - 1.0 / c) for c in round_trips_s]


def _check_round_trips(round_trips_s: Sequence[float]) -> None:
    if not round_trips_s or any(isinstance(c, bool) or not isinstance(c, (int, float)) or not c > 0
                                for c in round_trips_s):
        raise ValueError(f"round_trips_s must be one number > 0 (seconds) per worker, got {list(round_trips_s)!r}")


@dataclass(frozen=True)
class Throughput:
    """The model's answer for one mode: seconds per update, and gradients applied per update."""

    mode: str
    seconds_per_update: float
    gradients_per_update: int

    @property
    def updates_per_s(self) -> float:
        return 1.0 / self.seconds_per_update

    @property
    def gradients_per_s(self) -> float:
        """Applied gradients per second: the fair comparison across modes (each moves the weights ``lr / N``)."""
        return self.gradients_per_update / self.seconds_per_update


def throughput(mode: str, workers: int, compute_s: float, message_s: float = 0.0, exponential_mean_s: float = 0.0,
               slow_s: float = 0.0, backup_workers: int = 0) -> Throughput | None:
    """Updates and gradients per second of ``mode`` (the module docstring's table) with ``workers`` workers,
    ``exponential_mean_s`` of random delay on every gradient and/or one worker ``slow_s`` slower; None where the
    table has no closed form (``"bounded_delay"``, and ``"ssp"`` with random delays).  ``backup_workers`` belongs
    to ``"backup"``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode != "backup" and backup_workers:
        raise ValueError(f"backup_workers belongs to mode='backup', got mode={mode!r}, backup_workers={backup_workers}")
    _check_workers(workers, backup_workers)
    _non_negative(compute_s=compute_s, message_s=message_s, exponential_mean_s=exponential_mean_s, slow_s=slow_s)
    if mode == "bounded_delay" or (mode == "ssp" and exponential_mean_s > 0):
        return None
    if mode in ("async", "ssp"):
        fast = compute_s + 2 * message_s + exponential_mean_s
        if not fast > 0:
            raise ValueError(f"{mode} needs compute_s + 2 message_s + exponential_mean_s > 0: a worker whose round "
                             "trip takes no time would make infinitely many updates")
        if mode == "ssp":  # every worker at the slowest one's pace, N gradients per round trip of it
            return Throughput(mode, (fast + slow_s) / workers, 1)
        round_trips = [fast] * (workers - 1) + [fast + slow_s]
        return Throughput(mode, async_update_s(round_trips), 1)
    seconds = sync_update_s(workers, compute_s, message_s, exponential_mean_s, slow_s, backup_workers)
    return Throughput(mode, seconds, workers - backup_workers)
