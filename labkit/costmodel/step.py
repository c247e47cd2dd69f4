"""The time of one training step: compute, plus the communication that compute did not hide.

Lesson 02's model of a data-parallel step (:func:`ddp_step_time`): gradients leave in buckets during the
backward pass, each bucket's ring all-reduce (``labkit.costmodel.collectives``) starts when it is ready and the
one before it is done, and what is still running when backward ends is *exposed* communication.  Tensor- and
pipeline-parallel terms (the bubble, per-layer all-reduces) join it in their lessons.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from labkit.costmodel.collectives import (
    LinkModel,
    ring_all_reduce_cost,
)
from labkit.costmodel.gradient_sync import data_parallel_terms, overlapped
from labkit.costmodel.kernels import optimizer_time
from labkit.costmodel.stages import (  # Layout, Hardware and stage_times are imported from here by many
    Hardware,
    Layout,
    check_divides,
    chunk_costs,
    link_of,
    rank_expert_parameters,
    rank_parameters,
    stage_times,
)
from labkit.parallel.pipeline import catalog  # pure data and arithmetic (tests/test_layout.py)
from labkit.parallel.pipeline.catalog import SCHEDULES, SPLIT_BACKWARD
from labkit.parallel.pipeline.engine import Placement, place

__all__ = ["DataParallelStep", "Hardware", "Layout", "StepTime", "closed_form_makespan", "ddp_step_time",
           "place_schedule", "predict_step", "stage_times"]


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


# --------------------------------------------------------------------------------------------------------
# A 3D step (lesson 11): compute, TP all-reduces, the pipeline's bubble and sends, the DP reduction, ZeRO's gathers


@dataclass(frozen=True)
class StepTime:
    """One predicted step, each term apart (seconds), on the pipeline rank that bounds it (the slowest: the last
    one, which holds the output layer).  ``forward_s`` and ``backward_s`` are one micro-batch on that rank's
    stages, tensor-parallel all-reduces included; ``bubble_s`` and ``pp_send_s`` what the schedule adds."""

    layout: Layout
    microbatches: int
    compute_s: float  # every micro-batch's forward and backward on the rank, without communication
    tp_s: float  # the all-reduces inside them (on the critical path; with overlap_tp what outlasts the compute)
    bubble_s: float  # the schedule's makespan with free sends, less the rank's own work
    pp_send_s: float  # what the sends add to the makespan (one per boundary and micro-batch, each way)
    dp_s: float  # the data-parallel reduction: what outlasts the backward, and what the hidden part slows
    zero_s: float  # ZeRO-1/2's all-gather of updated weights, FSDP's gathers: exposed, and the slowdown
    forward_s: float
    backward_s: float
    cp_s: float = 0.0  # context parallelism's communication in every attention: what is exposed, and the slowdown
    ep_s: float = 0.0  # expert parallelism's all-to-alls in every MoE layer
    optimizer_s: float = 0.0  # the optimizer's step through memory (priced only with hardware.kernels)

    @property
    def step_s(self) -> float:
        return (self.compute_s + self.tp_s + self.cp_s + self.ep_s + self.bubble_s + self.pp_send_s + self.dp_s
                + self.zero_s + self.optimizer_s)

    def parts(self) -> dict[str, float]:
        """Each term by name (``"cp"``, ``"ep"`` only for a layout with context or expert parallelism)."""
        parts = {"compute": self.compute_s, "tp": self.tp_s, "bubble": self.bubble_s, "pp send": self.pp_send_s,
                 "dp": self.dp_s, "zero": self.zero_s}
        return {**parts, **({"cp": self.cp_s} if self.layout.cp > 1 else {}),
                **({"ep": self.ep_s} if self.layout.ep > 1 else {}),
                **({"optimizer": self.optimizer_s} if self.optimizer_s else {})}


def place_schedule(schedule: str, p: int, m: int, v: int, forward_s: list[float], backward_s: list[float],
                   send_s: float = 0.0) -> Placement:
    """``schedule``'s orders (compiled once per ``(p, m, v)``, :func:`~labkit.parallel.pipeline.catalog.compiled`)
    placed with ``forward_s`` and ``backward_s`` per chunk, a split backward's ``I`` and ``W`` half the ``B``
    each, and ``send_s`` per hop between ranks.  (Placing a few micro-batches and extrapolating is not exact:
    with a heavier last stage a pipeline can take tens of micro-batches to settle into its periodic regime.)"""
    compiled = catalog.compiled(schedule, p, m, v)
    half = [b / 2 for b in backward_s]
    seconds = {"F": forward_s, "B": backward_s, "I": half, "W": half}
    return place(compiled, [seconds[action.kind][action.stage] for action in compiled.actions], send_s)


def closed_form_makespan(schedule: str, p: int, m: int, forward_s: float, backward_s: float, v: int = 1) -> float:
    """A schedule's makespan for uniform stages and free sends: ``m (F + B)`` plus its bubble, ``(p - 1)(F + B)``
    for GPipe and 1F1B, ``(p - 1)(F + B) / v`` interleaved (``F``, ``B``: a whole stage's, per micro-batch),
    ``(p - 1) max(F, B / 2)`` for ZB-H1, whose backward splits into ``I`` and ``W`` of ``B / 2`` each: the
    deferred ``W``'s fill the cool-down, and each stage downstream still costs the longer of a forward and an
    input gradient (Qi et al. 2023's ``(p - 1)(F + B - 2W)`` with their ``F = B = W``; ``(p - 1) F`` while
    ``B <= 2 F``, more with recomputation).  The simulator gives exactly these (tested); with sends it can only
    be longer, so this bounds a layout's step from below.  The split schedules on ``v`` chunks a rank (``v = 2``
    for ZB-V and DualPipeV) get ZB-H1's form on a chunk, ``(p - 1) max(F, B / 2) / v``: interleaved ZB's exactly,
    ZB-V's and DualPipeV's a bound from below (their ramps hold more idle at some ratios; tested)."""
    zb = (p - 1) * max(forward_s, backward_s / 2)
    bubble = {"gpipe": (p - 1) * (forward_s + backward_s), "1f1b": (p - 1) * (forward_s + backward_s),
              "interleaved": (p - 1) * (forward_s + backward_s) / v, "zb-h1": zb,
              "interleaved-zb": zb / v, "zb-v": zb / 2, "dualpipev": zb / 2}
    if schedule not in bubble:
        raise ValueError(f"schedule must be one of {tuple(bubble)}, got {schedule!r}")
    return m * (forward_s + backward_s) + bubble[schedule]


def _passes(costs: Any, overlap_tp: bool, slowdown: float) -> tuple[list[float], list[float], list[float]]:
    """TP's cost on each pass (forward passes, then backward; what outlasts the compute and the slowdown where
    ``overlap_tp``), and each chunk's forward and backward with it."""
    chunks = len(costs.compute_forward)
    tp_cost = [(overlapped(comm, compute, slowdown) if overlap_tp else comm)
               for comm, compute in zip(costs.tp_forward + costs.tp_backward,
                                        costs.compute_forward + costs.compute_backward, strict=True)]
    forward = [c + x for c, x in zip(costs.compute_forward, tp_cost[:chunks], strict=True)]
    backward = [c + x for c, x in zip(costs.compute_backward, tp_cost[chunks:], strict=True)]
    for extra_forward, extra_backward in ((costs.cp_forward, costs.cp_backward), (costs.ep_forward, costs.ep_backward)):
        if extra_forward:  # context parallelism's exposed communication, expert parallelism's all-to-alls
            forward = [f + x for f, x in zip(forward, extra_forward, strict=True)]
            backward = [bw + x for bw, x in zip(backward, extra_backward, strict=True)]
    return tp_cost, forward, backward


def tp_in_node(hardware: Hardware, t: int) -> bool:
    """Whether every TP group of ``t`` neighbouring ranks lies inside one node (``t`` divides the node)."""
    return t <= hardware.gpus_per_node and hardware.gpus_per_node % t == 0


def send_time(shape: Any, layout: Layout, hardware: Hardware, value_bytes: int = 2, sequence_parallel: bool = True
              ) -> float:
    """One pipeline send of a micro-batch's activations (or their gradients) between stages ``d cp t`` ranks
    apart: ``b (s / cp) h / t`` values per GPU (each TP rank sends its part), ``b (s / cp) h`` without sequence
    parallelism."""
    link = link_of(hardware, layout.dp * layout.cp * layout.tp, layout.pp)
    nbytes = layout.micro_batch * shape.seq_len // layout.cp * shape.hidden_size * value_bytes
    nbytes /= layout.tp if sequence_parallel else 1
    return link.alpha_s + nbytes * link.beta_s_per_byte + hardware.call_latency_s


def predict_step(shape: Any, layout: Layout, global_batch: int, hardware: Hardware, value_bytes: int = 2,
                 gradient_bytes: int | None = None, overlap_dp: bool = True, overlap_gather: bool = False,
                 overlap_tp: bool = False, stage_layers: tuple[int, ...] | None = None,
                 head_on_last_stage: bool = True, sequence_parallel: bool = True,
                 reshard_after_forward: bool = True, flash_attention: bool = True, dropout: bool = False
                 ) -> StepTime:
    """One training step of ``shape`` (a :class:`labkit.costmodel.shapes.TransformerShape`) under ``layout`` on
    ``hardware``, each term apart (:class:`StepTime`).

    - **compute and TP**, chunk by chunk (:func:`labkit.costmodel.stages.chunk_costs`): each chunk's layers,
      the output layer on the last (``head_on_last_stage=False``: the whole model spread evenly, a balanced
      pipeline), at ``hardware.flops`` over the ``t`` ranks of its TP group; two ring all-reduces of ``b s h``
      values per layer each way (two more backward when recomputing), on the intra-node link while a TP group
      fits in a node, on the critical path (``overlap_tp``: hidden behind the pass's own compute, as
      Megatron's ``--tp-comm-overlap``, but for what outlasts it and the slowdown it causes; only for a TP
      group inside one node: Transformer Engine's userbuffers, which do that overlap, need "tensor-parallel
      GPUs ... on a single node, and connected over NVLink/NVSwitch", ``examples/pytorch/comm_gemm_overlap``
      of NVIDIA/TransformerEngine; across nodes the all-reduces stay on the critical path).
    - **PP**: the schedule's own table (:mod:`labkit.parallel.pipeline.schedule`) placed in time by the
      pipeline simulator with each chunk's forward and backward and one send per boundary crossing (stages
      ``d t`` ranks apart) of ``b s h / t`` values per GPU (each TP rank sends its part: the sequence-parallel
      shard, or Megatron's scatter/gather; ``sequence_parallel=False``: ``b s h``).  The bubble is the
      makespan with free sends less the bounding rank's own work; the sends add the rest.
    - **DP**: each rank's gradients (``gradient_bytes`` a parameter, default ``value_bytes``) reduced over the
      ``d`` replicas (``t`` ranks apart), all-reduced; under ZeRO (1, 2 and FSDP) reduce-scattered, each rank
      keeping the share it updates, then the updated weights all-gathered: the same ``2 Psi`` volume as the
      all-reduce (Rajbhandari et al. 2020, "ZeRO", section 7.2.1; Megatron's distributed optimizer, ZeRO-1 by
      memory, reduce-scatters too), ``hardware.call_latency_s`` a collective.  With ``hardware.dp_bucket_elements`` set, in buckets that leave as the chunk's last
      backward produces them, one at a time, placed on the schedule's timeline: what outlasts the pipeline is
      exposed, and the hidden part slows the compute it hid behind by ``hardware.overlap_slowdown``.  Without
      it, the ideal stream (exercise 11's): only what outlasts the rank's last backward is exposed.
      ``overlap_dp=False``: all after the rank's schedule.
    - **ZeRO**: ZeRO-1/2 all-gather the updated weights (exposed; ``overlap_gather``, as Megatron's
      ``--overlap-param-gather``, bucket by bucket behind the next step's first forward on each rank); FSDP
      (ZeRO-3) gathers each layer's weights before every micro-batch's forward and again before its backward,
      prefetched behind the compute before (``reshard_after_forward=False``: once a micro-batch, before the
      forward, the weights kept until the backward, as Llama 3 runs it, Dubey et al. 2024, section 3.3.2).
    - **the optimizer** (only with ``hardware.kernels``): Adam's step over the parameters the busiest rank
      updates (its ZeRO shard), through memory (:func:`labkit.costmodel.kernels.optimizer_time`).

    With ``hardware.kernels`` the compute is priced kernel by kernel (``flash_attention``, ``dropout``:
    which kernels run; :func:`labkit.costmodel.stages.kernel_passes`).
    """
    d, p, b = layout.dp, layout.pp, layout.micro_batch
    if layout.schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {tuple(SCHEDULES)}, got {layout.schedule!r}")
    check_divides(shape, layout, global_batch, stage_layers)
    m, v, chunks = global_batch // (d * b), layout.chunks // p, layout.chunks
    gradient_bytes = value_bytes if gradient_bytes is None else gradient_bytes
    slowdown = hardware.overlap_slowdown
    costs = chunk_costs(shape, layout, hardware, value_bytes, stage_layers, head_on_last_stage, flash_attention,
                        dropout, sequence_parallel)
    tp_cost, forward, backward = _passes(costs, overlap_tp and tp_in_node(hardware, layout.tp), slowdown)
    ranks = [(sum(forward[c] for c in layout.chunks_of(r)), sum(backward[c] for c in layout.chunks_of(r)))
             for r in range(p)]
    bound = max(range(p), key=lambda r: (sum(ranks[r]), r))  # the rank with the most work a micro-batch
    # the pipeline: each rank's order placed in time, without and with its sends
    placed: Placement | None = None
    total = without_sends = m * sum(ranks[0])
    if p > 1:
        send = send_time(shape, layout, hardware, value_bytes, sequence_parallel)
        placed = place_schedule(layout.schedule, p, m, v, forward, backward, send)
        total = placed.makespan
        without_sends = place_schedule(layout.schedule, p, m, v, forward, backward).makespan if send else total
    own = m * sum(ranks[bound])
    mine = layout.chunks_of(bound)
    tp_s = m * (sum(tp_cost[c] for c in mine) + sum(tp_cost[chunks + c] for c in mine))
    cp_s = m * sum(costs.cp_forward[c] + costs.cp_backward[c] for c in mine) if costs.cp_forward else 0.0
    ep_s = m * sum(costs.ep_forward[c] + costs.ep_backward[c] for c in mine)
    compute_s = own - tp_s - cp_s - ep_s
    dp_s = zero_s = 0.0
    if layout.replicas > 1:
        dp_s, zero_s = data_parallel_terms(shape, layout, hardware, m, forward, backward, ranks, placed, total,
                                      value_bytes, gradient_bytes, overlap_dp, overlap_gather, stage_layers, costs,
                                      balanced=not head_on_last_stage, reshard=reshard_after_forward)
    optimizer_s = _optimizer_s(shape, layout, hardware, gradient_bytes, stage_layers)
    return StepTime(layout, m, compute_s, tp_s, without_sends - own, total - without_sends, dp_s, zero_s,
                    ranks[bound][0], ranks[bound][1], cp_s, ep_s, optimizer_s)


def _optimizer_s(shape: Any, layout: Layout, hardware: Hardware, gradient_bytes: int,
                 stage_layers: tuple[int, ...] | None) -> float:
    """Adam's step on the pipeline rank that updates the most parameters: its dense parameters over ``t`` (and
    over the ``dp x cp`` replicas under ZeRO), its routed experts over ``ep`` (and the ``dp cp / ep`` ranks
    holding the same ones); 0 without ``hardware.kernels``."""
    if hardware.kernels is None:
        return 0.0
    shards = layout.replicas if layout.zero >= 1 else 1
    expert_shards = layout.replicas // layout.ep if layout.zero >= 1 else 1
    experts = rank_expert_parameters(shape, layout, stage_layers)
    most = max((total - routed) / (layout.tp * shards) + routed / (layout.ep * expert_shards)
               for total, routed in zip(rank_parameters(shape, layout, stage_layers), experts, strict=True))
    return optimizer_time(hardware.kernels, most, gradient_bytes)


def lower_bound(shape: Any, layout: Layout, global_batch: int, hardware: Hardware, value_bytes: int = 2,
                gradient_bytes: int | None = None, overlap_dp: bool = True, overlap_gather: bool = False,
                overlap_tp: bool = False, sequence_parallel: bool = True,
                stage_layers: tuple[int, ...] | None = None, flash_attention: bool = True, dropout: bool = False
                ) -> float:
    """What :func:`predict_step` (same arguments) can give no less than, without placing the schedule: for each
    rank, the first micro-batch's forward through the ranks before it, its own work over the step, and the last
    micro-batch's backward back through them, each crossing a send (ZB-H1's weight gradients may wait: no way
    back); the schedule's closed form with every stage as light as the lightest (a makespan only grows with any
    pass), each pass with its TP all-reduces as :func:`predict_step` prices them; and the least the DP reduction
    and ZeRO's gathers can add.  The planner simulates only layouts whose bound beats its ``top``-th best step."""
    p, m = layout.pp, global_batch // (layout.dp * layout.micro_batch)
    costs = chunk_costs(shape, layout, hardware, value_bytes, stage_layers, True, flash_attention, dropout,
                        sequence_parallel)
    chunks = layout.chunks
    _, forward, backward = _passes(costs, overlap_tp and tp_in_node(hardware, layout.tp), hardware.overlap_slowdown)
    ranks = [(sum(forward[c] for c in layout.chunks_of(r)), sum(backward[c] for c in layout.chunks_of(r)))
             for r in range(p)]
    bound = m * sum(ranks[0])
    if p > 1:
        send = send_time(shape, layout, hardware, value_bytes, sequence_parallel)
        fill = back = 0.0
        for rank in range(p):  # chunk `rank` is each rank's first: micro-batch 0 reaches it through 0..rank-1
            bound = max(bound, fill + m * sum(ranks[rank]) + back)
            fill += forward[rank] + send
            back += 0.0 if layout.schedule in SPLIT_BACKWARD else backward[rank] + send
        bound = max(bound, closed_form_makespan(layout.schedule, p, m, *min(ranks, key=sum), chunks // p))
    if layout.replicas > 1:
        gradient_bytes = value_bytes if gradient_bytes is None else gradient_bytes
        bound += sum(data_parallel_terms(shape, layout, hardware, m, forward, backward, ranks, None, bound, value_bytes,
                                    gradient_bytes, overlap_dp, overlap_gather, stage_layers, costs, False,
                                    floor=True))
    return bound + _optimizer_s(shape, layout, hardware, value_bytes if gradient_bytes is None else gradient_bytes,
                                stage_layers)
