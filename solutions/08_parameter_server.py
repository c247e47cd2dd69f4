"""Exercise 08 — A parameter server: the rule for applying gradients under a bounded delay (solution).

A *parameter server* (rank 0) holds the weights and counts the updates it has applied: the *version*.  Each of
``N`` workers pulls the weights at some version, computes a gradient on its own batch, and sends it back with the
version it *pulled*.  As each gradient arrives the server decides which gradients to *apply* now (summed into one
update, after which ``version += 1``) and which workers to *release* (send the new weights, so that they compute
again).  A worker that is not released waits, idle.  The *staleness* of a gradient is the version it is applied
at minus the version it was computed on: how many updates landed on the weights in between.

- *synchronous*: hold every gradient until all ``N`` have arrived, apply them together, release everyone.  No
  staleness, but every update waits for the slowest worker;
- *asynchronous* (Downpour SGD, Dean et al. 2012): apply each gradient on arrival and release its worker at once.
  Nobody waits, but ``N`` equal workers average about ``N - 1`` staleness, and a straggler's is unbounded;
- *bounded delay* ``tau`` (the rule of this exercise; Li et al. 2014 bound the delay of a computation, here it is
  counted in updates): asynchronous, except that no gradient is ever applied more than ``tau`` updates stale.
  ``tau = 0`` is synchronous; a bound larger than any run is asynchronous.

Do not confuse it with Ho et al. (2013)'s *Stale Synchronous Parallel* (labkit's ``Gate("ssp", ...)``, lesson 08):
SSP bounds how many *gradients* a worker may run ahead of the slowest (its clock), applies every gradient on
arrival and holds only the worker; a gradient's staleness is not bounded there.  Here the bound is on staleness.

**The rule.**  Hold each gradient as it arrives.  Apply *everything held*, as one update, unless that would
make a gradient still being computed staler than ``tau``; otherwise hold on: the held gradients are applied, and
their workers released, at the first arrival that allows it.  A worker released after version ``v`` computes on
``v``.  (Why is there always such an arrival?  While anything is held there is no update and no release, so the
workers still computing arrive one by one.)

Three workers, ``tau = 1``, worker 0 slow, all computing on version 0.  Worker 1 arrives: applying makes version 1,
and worker 0's gradient would be 1 stale, allowed: apply ``[1]``, release ``[1]`` (it computes on version 1).
Worker 2 arrives (on version 0): applying would make version 2, and worker 0's would be 2 stale: hold.  Worker 1
arrives (on version 1): still 2: hold.  Worker 0 arrives: nobody computes, so apply and release ``[2, 1, 0]``:
version 2; the gradients of workers 2 and 0 are 1 stale, worker 1's 0.
"""

from __future__ import annotations


class BoundedDelay:
    """The server's rule under a bounded delay ``tau`` (no gradient applied more than ``tau`` updates stale), over
    ``workers`` workers numbered ``0 .. workers - 1``.  Pure bookkeeping: the server calls :meth:`arrive` and sends
    messages accordingly."""

    def __init__(self, workers: int, tau: int):
        self.workers, self.tau = workers, tau
        self.version = 0  # updates applied so far
        self.computing: dict[int, int] = dict.fromkeys(range(workers), 0)  # worker -> the version it computes on
        self.held: list[int] = []  # workers whose gradients arrived and are not applied yet, in arrival order

    def arrive(self, worker: int, pulled: int) -> tuple[list[int], list[int]]:
        """``worker``'s gradient, computed on version ``pulled``, arrived.  Return ``(apply, release)``: the
        workers whose gradients are applied now, as one update (then ``version`` is one more), and the workers
        sent the new weights (who then compute on the new version).  ``([], [])`` holds the gradient."""
        del self.computing[worker]
        self.held.append(worker)
        # Applying now makes version + 1: a gradient still being computed on version v arrives at least
        # version + 1 - v stale.  Hold while the oldest of them would break the bound.
        if self.computing and self.version + 1 - min(self.computing.values()) > self.tau:
            return [], []
        applied, self.held = self.held, []
        self.version += 1
        for index in applied:
            self.computing[index] = self.version
        return applied, list(applied)
