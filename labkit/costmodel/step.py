"""The time of one training step: compute, plus the communication that compute did not hide.

Lesson 02's model of a data-parallel step (:func:`ddp_step_time`): gradients leave in buckets during the
backward pass, each bucket's ring all-reduce (``labkit.costmodel.collectives``) starts when it is ready and the
one before it is done, and what is still running when backward ends is *exposed* communication.  Tensor- and
pipeline-parallel terms (the bubble, per-layer all-reduces) join it in their lessons.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from labkit.costmodel.collectives import (
    LinkModel,
    ring_all_gather_cost,
    ring_all_reduce_cost,
    ring_reduce_scatter_cost,
)
from labkit.costmodel.compute import model_flops_per_step
from labkit.costmodel.memory import num_parameters
from labkit.parallel.pipeline import schedule as schedules  # pure data and arithmetic (tests/test_layout.py)
from labkit.parallel.pipeline.simulate import simulate


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
class Layout:
    """A 3D configuration: ``dp x tp x pp`` ranks, ZeRO stage over dp, micro-batch size, recomputation and the
    pipeline schedule (``virtual_stages``: the interleaved schedule's stages per rank)."""

    dp: int
    tp: int
    pp: int
    zero: int = 0
    micro_batch: int = 1
    recompute: bool = False
    schedule: str = "1f1b"
    virtual_stages: int = 1

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    def label(self) -> str:
        extra = f" v={self.virtual_stages}" if self.schedule == "interleaved" else ""
        return (f"dp={self.dp} tp={self.tp} pp={self.pp} ZeRO-{self.zero} b={self.micro_batch}"
                f"{' recompute' if self.recompute else ''} {self.schedule}{extra}")


@dataclass(frozen=True)
class Hardware:
    """What a step runs on: FLOP/s one GPU (or rank) achieves on the model's matrices, its links inside a node and
    across nodes, and how many GPUs a node holds (ranks are numbered node by node, as ``torchrun`` does).
    ``cores``: where ranks share a node's processor cores (gloo ranks on a CPU), how many — or, measured, a
    curve: ``cores[n - 1]`` the cores' worth of compute that ``n`` busy ranks get together (8 ranks on 2 cores
    may get less than 2, evicting each other's caches); ``None`` (GPUs): each rank computes on its own device.
    Only :mod:`labkit.costmodel.simulator` models the sharing.
    ``layer_overhead_s``: a fixed cost per layer and forward pass (twice that per backward) beside the FLOPs —
    the framework's own time per operation, which dominates tiny models on a CPU and is ~0 for large ones on
    GPUs (:class:`labkit.costmodel.calibration.Calibration` measures both on this machine);
    ``pass_overhead_s`` the same per pass whatever its layers (embedding, loss, the autograd engine's start).
    ``straggle``: where ranks share cores, ``straggle[g - 1]`` is how many times their mean the slowest of ``g``
    ranks takes for the same work started together (the scheduler's time slices are not shared fairly over
    tens of milliseconds); a synchronisation of ``g`` ranks waits for that one (only the simulator models it:
    :func:`labkit.costmodel.simulator.straggle_factor`).  Empty: every rank keeps pace."""

    flops: float
    intra_node: LinkModel
    inter_node: LinkModel
    gpus_per_node: int = 8
    cores: float | tuple[float, ...] | None = None
    layer_overhead_s: float = 0.0
    straggle: tuple[float, ...] = ()
    pass_overhead_s: float = 0.0


@dataclass(frozen=True)
class StepTime:
    """One predicted step, each term apart (seconds).  ``forward_s`` and ``backward_s`` are one micro-batch on
    one stage, tensor-parallel all-reduces included; ``pipeline_s`` the schedule's makespan with them."""

    layout: Layout
    microbatches: int
    compute_s: float  # every micro-batch's forward and backward on one stage, without communication
    tp_s: float  # the all-reduces inside them (on the critical path)
    bubble_s: float  # the stage's idle time in the schedule
    pp_send_s: float  # the sends on the critical path (one per boundary and micro-batch, each way)
    dp_s: float  # the data-parallel reduction left after the last backward (exposed)
    zero_s: float  # ZeRO-1/2's all-gather of updated weights, FSDP's exposed gathers
    forward_s: float
    backward_s: float

    @property
    def step_s(self) -> float:
        return self.compute_s + self.tp_s + self.bubble_s + self.pp_send_s + self.dp_s + self.zero_s

    def parts(self) -> dict[str, float]:
        return {"compute": self.compute_s, "tp": self.tp_s, "bubble": self.bubble_s, "pp send": self.pp_send_s,
                "dp": self.dp_s, "zero": self.zero_s}


def _link(hardware: Hardware, stride: int, size: int) -> LinkModel:
    """The link of a group of ``size`` ranks ``stride`` apart in the (pp, dp, tp) grid: its ranks span
    ``stride * size`` consecutive ranks from a multiple of that, so it lies inside one node of ``G`` GPUs when
    that span divides ``G``; else it crosses nodes."""
    span = stride * size
    inside = span <= hardware.gpus_per_node and hardware.gpus_per_node % span == 0
    return hardware.intra_node if inside else hardware.inter_node


_TABLES: dict[str, Callable[[int, int, int], schedules.Schedule]] = {
    "gpipe": lambda p, m, v: schedules.gpipe(p, m), "1f1b": lambda p, m, v: schedules.one_f_one_b(p, m),
    "zb-h1": lambda p, m, v: schedules.zb_h1(p, m), "interleaved": schedules.interleaved_1f1b}


@functools.lru_cache(maxsize=64)
def schedule_table(schedule: str, p: int, m: int, v: int = 1) -> schedules.Schedule:
    """The schedule's table (``"gpipe"``, ``"1f1b"``, ``"zb-h1"``, ``"interleaved"``), built once per
    ``(p, m, v)``: the planner prices hundreds of layouts that share one, and building one of thousands of
    passes takes a while."""
    if schedule not in _TABLES:
        raise ValueError(f"schedule must be one of {tuple(_TABLES)}, got {schedule!r}")
    return _TABLES[schedule](p, m, v)


def closed_form_makespan(schedule: str, p: int, m: int, forward_s: float, backward_s: float, v: int = 1) -> float:
    """A schedule's makespan for uniform stages and free sends: ``m (F + B)`` plus its bubble, ``(p - 1)(F + B)``
    for GPipe and 1F1B, ``(p - 1)(F + B) / v`` interleaved (``F``, ``B``: a whole stage's, per micro-batch),
    ``(p - 1) F`` for ZB-H1 (``W = B / 2``: Qi et al. 2023's ``(p - 1)(F + B - 2W)``).  The simulator gives
    exactly these (tested); with sends it can only be longer, so this bounds a layout's step from below."""
    bubble = {"gpipe": (p - 1) * (forward_s + backward_s), "1f1b": (p - 1) * (forward_s + backward_s),
              "interleaved": (p - 1) * (forward_s + backward_s) / v, "zb-h1": (p - 1) * forward_s}
    if schedule not in bubble:
        raise ValueError(f"schedule must be one of {tuple(bubble)}, got {schedule!r}")
    return m * (forward_s + backward_s) + bubble[schedule]


def stage_times(shape: Any, layout: Layout, global_batch: int, hardware: Hardware, value_bytes: int = 2
                ) -> tuple[int, int, float, float, float, float]:
    """``(m, v, forward, backward, tp_forward, tp_backward)``: micro-batches per step, stages per rank, and one
    micro-batch's compute and TP all-reduce seconds on one rank's stages (see :func:`predict_step`)."""
    d, t, p, b = layout.dp, layout.tp, layout.pp, layout.micro_batch
    if global_batch % (d * b):
        raise ValueError(f"the global batch {global_batch} must split into dp={d} replicas of micro-batches of "
                         f"b={b} sequences (global_batch % (dp * b) == 0)")
    v = layout.virtual_stages if layout.schedule == "interleaved" else 1
    if shape.num_layers % (p * v):
        raise ValueError(f"{p * v} pipeline stages do not divide the {shape.num_layers} layers")
    flops = model_flops_per_step(shape, b, recompute=layout.recompute) / (t * p)
    passes = 4 if layout.recompute else 3  # forward, backward (2x), and the forward again when recomputing
    layers = shape.num_layers // p
    forward = flops / passes / hardware.flops + hardware.layer_overhead_s * layers + hardware.pass_overhead_s
    one = ring_all_reduce_cost(b * shape.seq_len * shape.hidden_size * value_bytes, t,
                               _link(hardware, 1, t)).time_s if t > 1 else 0.0
    return (global_batch // (d * b), v, forward, forward * (passes - 1), 2 * layers * one,
            (2 + 2 * layout.recompute) * layers * one)


def predict_step(shape: Any, layout: Layout, global_batch: int, hardware: Hardware, value_bytes: int = 2,
                 gradient_bytes: int | None = None, overlap_dp: bool = True, overlap_gather: bool = False
                 ) -> StepTime:
    """One training step of ``shape`` (a :class:`labkit.costmodel.memory.TransformerShape`) under ``layout`` on
    ``hardware``, each term apart (:class:`StepTime`).

    - **compute**: the model's FLOPs (:func:`labkit.costmodel.compute.model_flops_per_step`, recomputation
      included when ``layout.recompute``) split evenly over the ``t p`` model-parallel ranks, at
      ``hardware.flops``; backward twice the forward (three times with recomputation).
    - **TP**: per layer and micro-batch, two ring all-reduces of ``b s h`` values in the forward and two in the
      backward (two more with recomputation: the forward runs again), over the intra-node link while a TP
      group fits in a node (ranks ``1`` apart), else the inter-node one; on the critical path.
    - **PP**: the schedule's own table (:mod:`labkit.parallel.pipeline.schedule`), placed in time by the
      pipeline simulator with each stage's forward and backward (TP included) and one send of ``b s h`` values
      per boundary crossing (stages are ``d t`` ranks apart); the bubble is the schedule's idle time.
    - **DP**: one ring all-reduce (ZeRO-2, FSDP: a reduce-scatter) of the stage's ``Psi / (t p)`` gradients
      over the ``d`` replicas (``t`` ranks apart), started as the last backward runs: with ``overlap_dp`` only
      what outlasts one micro-batch's backward is exposed.  ZeRO-1/2 then all-gather the updated weights
      (exposed; with ``overlap_gather``, as Megatron's ``--overlap-param-gather``, hidden behind the next
      step's first forward but for what outlasts it); FSDP gathers each stage's weights before every forward and backward, hidden behind the compute
      it prefetches for, exposed where it is longer.
    """
    d, t, p, b = layout.dp, layout.tp, layout.pp, layout.micro_batch
    m, v, forward, backward, tp_forward, tp_backward = stage_times(shape, layout, global_batch, hardware, value_bytes)
    gradient_bytes = value_bytes if gradient_bytes is None else gradient_bytes
    # the pipeline: the schedule's table, placed in time
    send = 0.0
    if p > 1:
        link = _link(hardware, d * t, p)
        send = link.alpha_s + b * shape.seq_len * shape.hidden_size * value_bytes * link.beta_s_per_byte
    if layout.schedule not in _TABLES:
        raise ValueError(f"schedule must be one of {tuple(_TABLES)}, got {layout.schedule!r}")
    whole_f, whole_b = forward + tp_forward, backward + tp_backward
    without_sends = closed_form_makespan(layout.schedule, p, m, whole_f, whole_b, v)  # the simulator's, exactly
    total = simulate(schedule_table(layout.schedule, p, m, v), whole_f / v, whole_b / v, send_s=send).total if send \
        else without_sends
    pp_send = total - without_sends
    bubble = without_sends - m * (whole_f + whole_b)
    # DP, and ZeRO's gathers
    local = num_parameters(shape) / (t * p)
    dp_link = _link(hardware, t, d)
    dp_s = zero_s = 0.0
    if d > 1:
        reduce = (ring_reduce_scatter_cost if layout.zero >= 2 else ring_all_reduce_cost)(
            int(local) * gradient_bytes, d, dp_link, element_size=gradient_bytes).time_s
        dp_s = max(0.0, reduce - (backward + tp_backward if overlap_dp else 0.0))
        gather = ring_all_gather_cost(int(local) * value_bytes, d, dp_link, element_size=value_bytes).time_s
        if layout.zero in (1, 2):  # the updated weights, before the next step (behind its first forward)
            zero_s = max(0.0, gather - (forward + tp_forward)) if overlap_gather else gather
        elif layout.zero == 3:  # every micro-batch's forward and backward gather the stage, prefetched
            zero_s = m * (max(0.0, gather - forward) + max(0.0, gather - backward))
    return StepTime(layout, m, m * (forward + backward), m * (tp_forward + tp_backward), bubble, pp_send, dp_s,
                    zero_s, forward + tp_forward, backward + tp_backward)
