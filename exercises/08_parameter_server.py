"""Exercise 08 — A parameter server: the rule for applying gradients under bounded staleness.

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
- *bounded staleness* (Stale Synchronous Parallel, Ho et al. 2013): asynchronous, except that no gradient is ever
  staler than a bound ``s``.  ``s = 0`` is synchronous; a bound larger than any run is asynchronous.

**The rule.**  Hold each gradient as it arrives; then apply *everything held*, as one update, unless that would
make a gradient still being computed staler than ``s``: applying makes the version ``version + 1``, and a worker
computing on version ``v`` will arrive at least ``version + 1 - v`` updates stale.  So apply now if no worker is
computing, or if ``version + 1 - (the oldest version a worker computes on) <= s``.  Otherwise the held workers
wait; they are applied, and released, at the first arrival that lets them.  There always is one: while anything
is held there is no update and no release, so the workers still computing arrive one by one, and when the last
has arrived nobody computes.

Three workers, ``s = 1``, worker 0 slow, all computing on version 0.  Worker 1 arrives: applying makes version 1,
and worker 0's gradient would be 1 stale, allowed: apply ``[1]``, release ``[1]`` (it computes on version 1).
Worker 2 arrives (on version 0): applying would make version 2, and worker 0's would be 2 stale: hold.  Worker 1
arrives (on version 1): still 2: hold.  Worker 0 arrives: nobody computes, so apply and release ``[2, 1, 0]``:
version 2; the gradients of workers 2 and 0 are 1 stale, worker 1's 0.

Complete ``arrive``, then run the grading cell of ``notebooks/08_async_parameter_server.ipynb`` (or ``labkit grade``).
The checks play your rule through many random arrival orders (1 to 6 workers, bounds 0 to 4): every gradient is
applied once, none staler than ``s``, and some worker is always computing (a rule under which every worker waits
would stop the training for ever); then they compare each of its decisions with the rule above, bound 0 and a
huge bound included; then labkit's parameter server (``run_parameter_server``) trains a small model with your
rule on launched ranks, one worker slow.  While they run, labkit's own rule (``labkit.parallel``) is switched off.
"""

from __future__ import annotations


class BoundedStaleness:
    """The server's rule under bounded staleness ``bound`` (Ho et al. 2013), over ``workers`` workers numbered
    ``0 .. workers - 1``.  Pure bookkeeping: the server calls :meth:`arrive` and sends messages accordingly."""

    def __init__(self, workers: int, bound: int):
        self.workers, self.bound = workers, bound
        self.version = 0  # updates applied so far
        self.computing: dict[int, int] = dict.fromkeys(range(workers), 0)  # worker -> the version it computes on
        self.held: list[int] = []  # workers whose gradients arrived and are not applied yet, in arrival order

    def arrive(self, worker: int, pulled: int) -> tuple[list[int], list[int]]:
        """``worker``'s gradient, computed on version ``pulled``, arrived.  Return ``(apply, release)``: the
        workers whose gradients are applied now, as one update (then ``version`` is one more), and the workers
        sent the new weights (who then compute on the new version).  ``([], [])`` holds the gradient."""
        # TODO: the worker no longer computes (self.computing), its gradient is held (self.held).  If some worker
        #       still computes and self.version + 1 - (the oldest version in self.computing) is more than
        #       self.bound, hold: return [], [].  Otherwise apply everything held: empty self.held, count the
        #       update in self.version, and every applied worker computes on the new version; return the applied
        #       workers twice (applied, and released).  Play the docstring's example by hand to check.
        raise NotImplementedError("BoundedStaleness.arrive")
