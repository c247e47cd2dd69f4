"""The time of one training step: compute, plus the communication that compute did not hide.

Lesson 02's model of a data-parallel step (:func:`ddp_step_time`): gradients leave in buckets during the
backward pass, each bucket's ring all-reduce (``labkit.costmodel.collectives``) starts when it is ready and the
one before it is done, and what is still running when backward ends is *exposed* communication.  Tensor- and
pipeline-parallel terms (the bubble, per-layer all-reduces) join it in their lessons.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.costmodel.collectives import LinkModel, ring_all_reduce_cost


@dataclass(frozen=True)
class DataParallelStep:
    """Predicted timeline of one data-parallel step (seconds)."""

    forward_s: float
    backward_s: float
    communication_s: float  # total all-reduce time, overlapped or not
    exposed_communication_s: float  # the part nobody hid behind backward
    optimizer_s: float

    @property
    def step_s(self) -> float:
        return self.forward_s + self.backward_s + self.exposed_communication_s + self.optimizer_s


def ddp_step_time(forward_s: float, backward_s: float, optimizer_s: float, bucket_bytes: list[int],
                  world_size: int, link: LinkModel, overlap: bool = True) -> DataParallelStep:
    """Predict a DDP step: compute, then the bucket all-reduces, overlapped with backward or not.

    Buckets are filled in backward order, so bucket ``k`` of ``B`` (equal-sized here for simplicity) is ready
    after ``(k+1)/B`` of the backward pass.  With ``overlap`` its ring all-reduce (``link``: a
    ``labkit.costmodel.collectives.LinkModel``) starts when it is ready *and* the previous one has finished (one network);
    without, they all start after backward.  What is left after backward ends is *exposed* communication:

        step = forward + backward + exposed communication + optimizer

    Two consequences the lesson measures: communication that takes longer than backward can never be hidden,
    and the last bucket never overlaps anything — so smaller buckets hide more, until ``alpha`` per bucket bites.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    if min(forward_s, backward_s, optimizer_s) < 0:
        raise ValueError("forward_s, backward_s and optimizer_s must be >= 0")
    # One cost per distinct bucket size (equal buckets and a remainder): a 10B-parameter model in 0.1 MiB
    # buckets has 400k buckets, and the ring model priced once each would take seconds.
    cost_of = {size: ring_all_reduce_cost(int(size) - int(size) % 4, world_size, link).time_s if world_size > 1
               else 0.0 for size in set(bucket_bytes)}
    costs = [cost_of[size] for size in bucket_bytes]
    finished = 0.0
    for index, cost in enumerate(costs):
        ready = backward_s * (index + 1) / len(costs) if overlap else backward_s
        finished = max(finished, ready) + cost
    exposed = max(0.0, finished - backward_s) if costs else 0.0
    return DataParallelStep(forward_s, backward_s, sum(costs), exposed, optimizer_s)
