"""Exercise 07 — Pipeline parallelism: the 1F1B order of one rank.

A pipeline cuts the model into ``p`` stages, one per rank: rank ``r`` holds stage ``r``, receives activations
from rank ``r - 1`` and sends its own to rank ``r + 1``; backward runs the other way.  To keep more than one
rank busy the batch is cut into ``m`` *micro-batches*, which follow each other through the stages.  A
*schedule* is, per rank, the order of its passes: ``("F", k)`` the forward of micro-batch ``k`` through this
rank's stage, ``("B", k)`` its backward.  A rank runs them in that order, each as soon as its input has arrived
(the previous stage's forward of ``k`` for ``("F", k)``, the next stage's backward of ``k`` for ``("B", k)``).

**GPipe** (Huang et al. 2019) runs every forward, then every backward.  While the first micro-batch travels to
the last stage and its gradient comes back, ranks wait: the *bubble*.  With a forward of 1 time unit and a
backward of 2, a step takes ``3 (m + p - 1)`` units against ``3 m`` of work, so the idle fraction of rank-time
is ``(p - 1) / (m + p - 1)``: more micro-batches, smaller bubble.  But a stage keeps each micro-batch's
activations from its forward until its backward, and under GPipe all ``m`` of them are alive at once.

**1F1B** (PipeDream-Flush, Narayanan et al. 2021) starts each backward as early as it can:

1. *warm-up*: before its first backward, rank ``r`` runs the forwards that keep the stages downstream of it
   busy while micro-batch 0 travels to the last stage and its gradient comes back (the last stage needs none:
   its backward can follow its forward), and never more than there are micro-batches;
2. *steady state*: one forward, then one backward, the oldest micro-batch first, until every forward ran;
3. *cool-down*: the remaining backwards.

Rank 1 of ``p = 4``, ``m = 8``: ``F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7``.  The bubble is
GPipe's, ``(p - 1) / (m + p - 1)``, but rank ``r`` never holds more than ``min(p - r, m)`` micro-batches
instead of ``m``: the memory of ``p`` micro-batches on the first stage, however many ``m`` there are, which is
what lets ``m`` grow until the bubble is small.

Complete the function, then run the grading cell of ``notebooks/07_pipeline_parallel.ipynb`` (or ``labkit
grade``).  The checks build the orders of every rank for ``p`` from 1 to 16, and two drawn at random up to
24, and many ``m`` (fewer micro-batches than stages, as many, not a multiple of ``p``, many more), check that
each forward and backward runs once, in micro-batch order, and that the ranks can run their orders together, then time them (forward 1, backward 2) and hold
the step time and the activations each rank keeps at once to 1F1B's.  While they run, labkit's own schedules
(``labkit.parallel``) and the 1F1B schedules of ``torch.distributed.pipelining`` are switched off.
"""


def one_f_one_b_order(rank: int, p: int, m: int) -> list[tuple[str, int]]:
    """The passes pipeline rank ``rank`` of ``p`` (stage ``rank``) runs over ``m`` micro-batches under 1F1B,
    in order: ``("F", k)`` the forward of micro-batch ``k``, ``("B", k)`` its backward.  Each of the ``m``
    micro-batches has one of each.  Any ``p >= 1`` and ``m >= 1``, ``m`` smaller than ``p`` included."""
    # TODO: the three phases of the module docstring.  How many warm-up forwards keep the stages after this
    #       rank busy until micro-batch 0's gradient can come back?  Count those stages, and mind an m smaller
    #       than that count.  In the steady state, which backward comes next each time?  Try rank 1 of p=4, m=8
    #       against the docstring's example, then the last rank, then m < p, before the grading cell.
    raise NotImplementedError("one_f_one_b_order")
