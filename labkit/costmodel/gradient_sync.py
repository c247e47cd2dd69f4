"""The data-parallel terms of a 3D step (lesson 11): the gradients' reduction over the replicas and ZeRO's
gathers of the weights, placed on the pipeline schedule's timeline (:func:`data_parallel_terms`, which
:func:`labkit.costmodel.step.predict_step` and :func:`~labkit.costmodel.step.lower_bound` call; their
docstrings say what each term holds)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

from labkit.costmodel.collectives import (
    LinkModel,
    ring_all_gather_cost,
    ring_all_reduce_cost,
    ring_reduce_scatter_cost,
)
from labkit.costmodel.shapes import expert_parameters, num_parameters
from labkit.costmodel.stages import (
    Hardware,
    Layout,
    chunk_layers,
    chunk_moe_layers,
    chunk_parameters,
    link_of,
)
from labkit.parallel.pipeline.engine import Placement


def overlapped(communication: float, compute: float, slowdown: float) -> float:
    """What ``communication`` hidden behind ``compute`` costs: the part that outlasts it, and the slowdown of the
    part it hid (:data:`labkit.costmodel.hardware.OVERLAP_SLOWDOWN`)."""
    return max(0.0, communication - compute) + slowdown * min(communication, compute)


def queue(ready: list[float], cost: float) -> float:
    """When a link that sends one message of ``cost`` seconds at a time, each once it is ready, is done."""
    finished = 0.0
    for when in sorted(ready):
        finished = max(finished, when) + cost
    return finished


@functools.lru_cache(maxsize=4096)
def ring_time(cost: Callable[..., Any], nbytes: int, ranks: int, link: LinkModel, element_size: int) -> float:
    """``cost``'s seconds (a ring cost of :mod:`labkit.costmodel.collectives`), once per distinct message."""
    return cost(nbytes, ranks, link, element_size=element_size).time_s


def whole_elements(nbytes: float, element_size: int) -> int:
    """Bytes rounded down to whole elements (the ring cost models count elements)."""
    return int(nbytes) - int(nbytes) % element_size


def last_gradients(placed: Placement | None, rank: int, layout: Layout, total: float,
                    backward: list[float]) -> dict[int, tuple[float, float]]:
    """``chunk -> (start, end)`` of the pass that completes each of ``rank``'s chunks' gradients (its last B, or
    W where the backward is split)."""
    if placed is None:  # one stage: its last backward closes the step
        return {0: (total - backward[0], total)}
    return {chunk: placed.last_gradient(chunk) for chunk in layout.chunks_of(rank)}


def data_parallel_terms(shape: Any, layout: Layout, hardware: Hardware, m: int, forward: list[float],
                   backward: list[float], ranks: list[tuple[float, float]], placed: Placement | None,
                   total: float, value_bytes: int, gradient_bytes: int, overlap_dp: bool, overlap_gather: bool,
                   stage_layers: tuple[int, ...] | None, costs: Any, balanced: bool,
                   floor: bool = False, reshard: bool = True) -> tuple[float, float]:
    """The DP reduction and ZeRO's gathers of :func:`predict_step`, each the worst over the pipeline ranks
    (``balanced``: every chunk holds an equal share of the parameters, as the balanced pipeline assumes).
    ``floor``: without a placed schedule, the least the two can be (the planner's bound): the hidden parts' slowdown,
    and the bucket the last pass of the schedule leaves, or the weights' first bucket before any forward."""
    d, t, p, chunks = layout.replicas, layout.tp, layout.pp, layout.chunks  # dp x cp hold the same weights
    link, slowdown, latency = link_of(hardware, t, d), hardware.overlap_slowdown, hardware.call_latency_s
    reduce = ring_reduce_scatter_cost if layout.zero >= 1 else ring_all_reduce_cost
    parameters = ([num_parameters(shape) / (t * chunks)] * chunks if balanced  # per GPU
                  else [count / t for count in chunk_parameters(shape, layout, stage_layers)])
    if getattr(shape, "moe_layers", 0):  # the routed experts: 1/ep a GPU, reduced over the d/ep holding the same
        experts = ([expert_parameters(shape) / chunks] * chunks if balanced else
                   [n * expert_parameters(shape) / shape.moe_layers for n in chunk_moe_layers(shape, layout, stage_layers)])
        d_e, link_e = d // layout.ep, link_of(hardware, t * layout.ep, d // layout.ep)
        # as elements on the dense ring of the same time: (d_e - 1) / d_e of them over link_e's bandwidth
        same = (d_e - 1) / d_e * link_e.beta_s_per_byte / ((d - 1) / d * link.beta_s_per_byte)
        parameters = [dense - e / t + e / layout.ep * same for dense, e in zip(parameters, experts, strict=True)]
    bucket = None if hardware.dp_bucket_elements is None else max(hardware.dp_bucket_elements, 1_000_000 * d)

    def pieces(elements: float) -> tuple[int, float]:  # how many buckets, and the elements of each
        count = 1 if bucket is None else max(1, math.ceil(elements / bucket))
        return count, elements / count

    def reduction(elements: float) -> float:
        return ring_time(reduce, whole_elements(elements * gradient_bytes, gradient_bytes), d, link, gradient_bytes) + latency

    def gather(elements: float) -> float:
        return ring_time(ring_all_gather_cost, whole_elements(elements * value_bytes, value_bytes), d, link,
                          value_bytes) + latency

    dp_worst = zero_worst = 0.0
    dp_floors, zero_floors, sents = [], [], []
    for rank in range(p):
        own = layout.chunks_of(rank)
        elements = sum(parameters[c] for c in own)
        # the gradients' reduction
        if bucket is None:  # the ideal stream, beside the rank's last (whole) backward
            sent = reduction(elements)
            exposed = max(0.0, sent - (ranks[rank][1] if overlap_dp else 0.0))
            dp_floors.append(exposed + slowdown * (sent - exposed))
        else:
            split = [(pieces(parameters[chunk]), chunk) for chunk in own]
            ones = [(count, reduction(size), chunk) for (count, size), chunk in split]
            sent = sum(count * one for count, one, _ in ones)
            sents.append(sent)
            least = sent if not overlap_dp else min(one for _, one, _ in ones)
            dp_floors.append(least + slowdown * (sent - least))
            if floor:
                continue
            closing = last_gradients(placed, rank, layout, total, backward)
            ready = []
            for count, _, chunk in ones:
                start, end = closing[chunk]
                ready += ([start + (end - start) * (k + 1) / count for k in range(count)] if overlap_dp
                          else [max(e for _, e in closing.values())] * count)
            exposed = max(0.0, queue(ready, sent / len(ready)) - total)
        dp_worst = max(dp_worst, exposed + slowdown * (sent - exposed))
        # ZeRO's gathers
        if layout.zero in (1, 2):
            count, size = pieces(elements)
            one = gather(size)
            if not overlap_gather:
                exposed = count * one
            elif floor:  # the first rank's first forward waits for its first bucket
                zero_floors.append(slowdown * count * one + (one * (1 - slowdown) if rank == 0 else 0.0))
                continue
            else:  # behind the next step's first forward on this rank, bucket by bucket
                first = first_forward(placed, rank, forward)
                exposed = max(0.0, max((k + 1) * one - (first[0] + first[1] * k / count) for k in range(count)))
            zero_worst = max(zero_worst, exposed + slowdown * (count * one - exposed))
        elif layout.zero == 3:  # each chunk gathered before every forward and backward, prefetched
            spent = 0.0
            for chunk in own:
                units = max(1, chunk_layers(shape, layout, stage_layers)[chunk])  # FSDP wraps each layer
                whole = units * gather(parameters[chunk] / units)
                passes = (costs.compute_forward[chunk], costs.compute_backward[chunk])
                for compute in (passes if reshard else passes[:1]):
                    spent += m * overlapped(whole, compute, slowdown)
            zero_worst = max(zero_worst, spent)
    if floor:  # the last pass of the schedule is some rank's: at least the least of the ranks' floors
        dp_low = max([min(dp_floors)] + [slowdown * f for f in sents]) if bucket is not None else max(dp_floors)
        return dp_low, max([zero_worst] + zero_floors)
    return dp_worst, zero_worst


def first_forward(placed: Placement | None, rank: int, forward: list[float]) -> tuple[float, float]:
    """``(start, length)`` of ``rank``'s first forward in the step."""
    if placed is None:
        return 0.0, forward[0]
    start, end = placed.first_pass(rank)
    return start, end - start
