"""One training step at any scale, simulated event by event: the pipeline, its sends, the buckets, the gathers.

:func:`labkit.costmodel.step.predict_step` places the schedule, then prices the DP and ZeRO traffic beside it
(GPUs).  This module runs the step as a discrete-event simulation of uniform stages (the model spread evenly:
:func:`~labkit.costmodel.step.stage_times`, each pass's compute and TP all-reduces; the ring costs of
:mod:`labkit.costmodel.collectives`; the tables of :mod:`labkit.parallel.pipeline.schedule`), where ranks share
a CPU's cores (lesson 11's laptop) and the terms can interact the way they do on a cluster:

- each pipeline rank runs its schedule order; a pass starts when the rank is free, its input has *arrived*
  (the producer's pass ended and its send crossed the link; sends on one link queue behind each other) and,
  under FSDP, its stage's weights are gathered (each gather issued when the pass before it starts: one ahead);
- a pass is a compute segment (at the rank's share of its processor, below) then its tensor-parallel
  all-reduces;
- gradients leave in buckets (``bucket_bytes``, 25 MiB as DDP's default) as the last backward of each stage
  produces them, one bucket at a time on the rank's data-parallel link (``overlap_dp``; else all after the
  schedule); then the optimizer, then ZeRO-1/2's all-gather of the updated weights;
- when ``hardware.cores`` is set, the ranks share that many processor cores per node: a compute segment runs at
  ``min(1, cores / active)`` of full speed, ``active`` being the ranks computing at that moment (processor
  sharing, re-evaluated at every event) — how 8 gloo ranks on a 2-core laptop behave, where a rank waiting in a
  bubble or on a socket gives its core to the others.
  Nor is it fair over short times: with ``hardware.straggle``, a TP group waits after each pass for its slowest
  rank, ``straggle[t - 1] - 1`` times the pass, and a bucket leaves at ``straggle[d - 1]`` times its own time.

The data-parallel replicas (and the tensor-parallel ranks of a stage) run identical timelines, so one replica's
``p`` pipeline ranks are simulated, each standing for its ``d t`` twins: ``~3 m p`` passes, a second or less at
thousands of GPUs.  With uniform stages, free sends and no sharing, the makespan is the schedule's closed form
exactly (tests/test_costmodel_simulator.py); :func:`scaling` runs the step over GPU counts for weak- and
strong-scaling curves.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from labkit.costmodel.collectives import ring_all_gather_cost, ring_all_reduce_cost, ring_reduce_scatter_cost
from labkit.costmodel.compute import mfu, model_flops_per_step
from labkit.costmodel.hardware import link_of
from labkit.costmodel.shapes import num_parameters
from labkit.costmodel.step import SCHEDULES, Hardware, Layout, stage_times
from labkit.parallel.pipeline import catalog
from labkit.parallel.pipeline.schedule import Action

PARTS = ("compute", "tp", "bubble", "pp send", "dp", "zero", "optimizer")
DDP_BUCKET_BYTES = 25 * 2**20
@dataclass(frozen=True)
class SimulatedStep:
    """One simulated step.  ``parts`` splits the last rank to finish (they sum to ``step_s``); ``mean_parts``
    averages the ``p`` pipeline ranks; ``timeline[rank]`` holds ``(start, end, what)`` of every segment
    (``what``: an action such as ``"1F0"``, ``"tp 1F0"``, ``"dp bucket 3"``, ``"optimizer"``)."""

    layout: Layout
    microbatches: int
    step_s: float
    parts: dict[str, float]
    mean_parts: dict[str, float]
    timeline: list[list[tuple[float, float, str]]]
    events: int

    @property
    def pipeline_s(self) -> float:
        """When the last pass ends (the schedule's makespan, sends and gathers included)."""
        return max((end for row in self.timeline for _, end, what in row
                    if what[:1].isdigit() or what.startswith("tp ")), default=0.0)


@dataclass
class _Rank:
    """One pipeline rank's state while the simulation runs."""

    segments: list[tuple]  # (kind, ...): "wait", "gather", "compute", "comm", "straggle", "dp", "done"
    index: int = 0
    remaining: float = 0.0  # of the compute segment under way (seconds at full speed)
    started: float | None = None  # when the current segment began
    end: float | None = None  # of the fixed-length segment under way
    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    timeline: list[tuple[float, float, str]] = field(default_factory=list)
    finished_at: float = 0.0


def _words(nbytes: float) -> int:
    """Bytes rounded down to whole 4-byte words (the ring cost models count elements)."""
    return int(nbytes) - int(nbytes) % 4


def _kind_of_wait(label: str) -> str:
    return {"tp": "tp", "dp": "dp", "zero": "zero"}.get(label.split(" ")[0], "compute")


def simulate_step(shape: Any, layout: Layout, global_batch: int, hardware: Hardware, value_bytes: int = 2,
                  gradient_bytes: int | None = None, overlap_dp: bool = True, bucket_bytes: float = DDP_BUCKET_BYTES,
                  optimizer_s: float = 0.0) -> SimulatedStep:
    """Simulate one step of ``shape`` under ``layout`` on ``hardware`` (see the module docstring).

    ``optimizer_s`` is one rank's optimizer step at full speed for its whole stage (ZeRO-1 and up: divided by
    ``d``, each rank updating its shard).  Raises ``ValueError`` for degrees that do not divide (as
    :func:`~labkit.costmodel.step.stage_times`) and for an unknown schedule.
    """
    if layout.schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {tuple(SCHEDULES)}, got {layout.schedule!r}")
    if bucket_bytes <= 0 or optimizer_s < 0:
        raise ValueError(f"bucket_bytes must be > 0 and optimizer_s >= 0, got {bucket_bytes!r} and {optimizer_s!r}")
    d, t, p, b = layout.dp, layout.tp, layout.pp, layout.micro_batch
    m, v, forward, backward, tp_forward, tp_backward = stage_times(shape, layout, global_batch, hardware, value_bytes)
    gradient_bytes = value_bytes if gradient_bytes is None else gradient_bytes
    compiled = catalog.compiled(layout.schedule, p, m, v)  # the orders, and who waits for whom (the engine's)
    orders = [[compiled.actions[i] for i in compiled.rank_ids(rank)] for rank in range(p)]
    stages = len(compiled.stage_ranks)
    # one chunk's (1/v of a rank's layers) compute and TP seconds per pass
    compute = {"F": forward / v, "B": backward / v, "I": backward / v / 2, "W": backward / v / 2}
    comm = {"F": tp_forward / v, "B": tp_backward / v, "I": tp_backward / v, "W": 0.0}
    send_link = link_of(hardware, d * t, p)
    send_s = send_link.alpha_s + b * shape.seq_len * shape.hidden_size * value_bytes * send_link.beta_s_per_byte \
        if p > 1 else 0.0
    # data parallelism: this rank's gradients (v chunks), in buckets; ZeRO's gathers of its weights
    local = num_parameters(shape) / (t * p)
    dp_link = link_of(hardware, t, d)
    reduce_cost = ring_reduce_scatter_cost if layout.zero >= 1 else ring_all_reduce_cost  # ZeRO-1 too (ZeRO, 7.2.1)
    chunk_bytes = local * gradient_bytes / v
    buckets = max(1, math.ceil(chunk_bytes / bucket_bytes))
    bucket_s = reduce_cost(_words(chunk_bytes / buckets), d, dp_link).time_s if d > 1 else 0.0
    gather_s = ring_all_gather_cost(_words(local * value_bytes / v), d, dp_link).time_s if d > 1 else 0.0
    # stage -> its last gradient-producing pass (its last B, or W when split)
    last_gradient = {stage: compiled.actions[i] for stage, i in enumerate(compiled.last_gradient) if i >= 0}
    ids = {action: index for index, action in enumerate(compiled.actions)}
    shared = hardware.straggle if hardware.cores is not None else ()  # on GPUs every rank has its own device
    tp_straggle, dp_straggle = (straggle_factor(shared, n) for n in (t, d))
    ranks: list[_Rank] = []
    for order in orders:
        segments: list[tuple] = []
        for index, action in enumerate(order):
            # what it waits for on other ranks (an input on its own rank ran before it, in its order)
            needs = tuple((need, False) for need in compiled.inputs[ids[action]])
            segments.append(("wait", action, needs))
            if layout.zero == 3 and d > 1 and action.kind != "W":
                segments.append(("gather", index))
            segments.append(("compute", compute[action.kind], str(action)))
            if comm[action.kind]:
                if tp_straggle > 1:  # the TP group waits for its slowest rank's share of that compute
                    segments.append(("straggle", tp_straggle, f"tp wait {action}"))
                segments.append(("comm", comm[action.kind], f"tp {action}"))
            segments.append(("done", action))
        segments.append(("dp",))
        segments.append(("compute", optimizer_s / (d if layout.zero >= 1 else 1), "optimizer"))
        if layout.zero in (1, 2) and d > 1:
            segments.append(("comm", gather_s * v, "zero all-gather"))
        ranks.append(_Rank(segments))

    done: list[float | None] = [None] * len(ids)  # when each pass ended
    arrival: dict[tuple[int, int], float] = {}  # (pass, consuming rank) -> when its output is there
    passes_left = [len(order) for order in orders]
    link_free: dict[tuple[int, int], float] = {}
    dp_free = [0.0] * p  # each rank's data-parallel link
    dp_end = [0.0] * p
    gathers: list[dict[int, float]] = [{} for _ in range(p)]  # pass index -> when its weights are gathered
    if layout.zero == 3 and d > 1:
        for rank in range(p):
            gathers[rank][0] = dp_free[rank] = gather_s
    pending_buckets: list[list[float]] = [[] for _ in range(p)]  # ready times, for overlap_dp=False
    per_node = hardware.gpus_per_node
    replicas = d * t
    world = d * t * p
    now, events = 0.0, 0

    def issue_buckets(rank: int, ready_times: list[float]) -> None:
        for k, ready in enumerate(ready_times):  # each once the slowest replica has it too
            ready *= dp_straggle
            start = max(ready, dp_free[rank])
            dp_free[rank] = start + bucket_s
            ranks[rank].timeline.append((start, dp_free[rank], f"dp bucket {k}"))
        dp_end[rank] = dp_free[rank]

    def available(rank: int, segment: tuple) -> float | None:
        """When a waiting segment can proceed (None: not known yet)."""
        if segment[0] == "wait":
            ready = 0.0
            for need, local in segment[2]:
                if done[need] is None:
                    return None
                ready = max(ready, done[need] if local else arrival[(need, rank)])
            return ready
        if segment[0] == "gather":
            return gathers[rank].get(segment[1])
        if segment[0] == "dp":
            return dp_end[rank] if not passes_left[rank] else None
        return now

    def enter(rank: int) -> bool:
        """Move ``rank`` through every segment it can start or finish at ``now``; True if it moved."""
        state = ranks[rank]
        moved = False
        while state.index < len(state.segments):
            segment = state.segments[state.index]
            kind = segment[0]
            if kind in ("wait", "gather", "dp"):
                ready = available(rank, segment)
                if state.started is None:
                    state.started = now
                if ready is None or ready > now:
                    return moved
                waited = now - state.started
                if waited > 0:
                    if kind == "wait":  # the part spent waiting on sends in flight is "pp send"
                        produced = max([done[need] for need, local in segment[2] if not local], default=now)
                        sending = max(0.0, now - max(produced, state.started))
                        state.parts["pp send"] += sending
                        state.parts["bubble"] += waited - sending
                    else:
                        state.parts["zero" if kind == "gather" else "dp"] += waited
            elif kind in ("compute", "comm", "straggle"):
                if state.started is None:  # begin it
                    state.started = now
                    if kind == "straggle":  # (factor - 1) times the compute before it
                        last = state.timeline[-1] if state.timeline else (now, now)
                        state.end = now + (segment[1] - 1) * (last[1] - last[0])
                    elif kind == "compute" and sharing:
                        state.remaining = segment[1]
                    else:  # a fixed length: it ends when it ends
                        state.end = now + segment[1]
                    if kind == "compute" and segment[2][:1].isdigit() and layout.zero == 3 and d > 1:
                        issue_gather(rank, state)
                    moved = True
                finished = state.remaining <= 0 if kind == "compute" and sharing else state.end <= now
                if not finished:
                    return moved
                if now > state.started:
                    state.timeline.append((state.started, now, segment[2]))
                    part = "optimizer" if segment[2] == "optimizer" else (
                        "compute" if kind == "compute" else _kind_of_wait(segment[2]))
                    state.parts[part] += now - state.started
            elif kind == "done":
                finish(rank, segment[1])
            state.index += 1
            state.started, state.end, state.remaining = None, None, 0.0
            state.finished_at = now
            moved = True
        return moved

    def issue_gather(rank: int, state: _Rank) -> None:
        """FSDP's prefetch: when a pass starts, the gather for the next pass that needs one goes on the DP link."""
        following = next((s for s in state.segments[state.index:] if s[0] == "gather"), None)
        if following is not None and following[1] not in gathers[rank]:
            start = max(now, dp_free[rank])
            dp_free[rank] = start + gather_s
            gathers[rank][following[1]] = dp_free[rank]
            state.timeline.append((start, dp_free[rank], f"zero gather {following[1]}"))

    def finish(rank: int, action: Action) -> None:
        nonlocal events
        done[ids[action]] = now
        passes_left[rank] -= 1
        events += 1
        for consumer_stage in (action.stage + 1, action.stage - 1):
            if not 0 <= consumer_stage < stages:
                continue
            consumer = compiled.stage_ranks[consumer_stage]
            wanted = (action.kind == "F" and consumer_stage == action.stage + 1) or (
                action.kind in "BI" and consumer_stage == action.stage - 1)
            if not wanted:
                continue
            awake.add(consumer)
            if consumer == rank:
                arrival[(ids[action], consumer)] = now
            else:
                start = max(now, link_free.get((rank, consumer), 0.0))
                link_free[(rank, consumer)] = start + send_s
                arrival[(ids[action], consumer)] = start + send_s
        if d > 1 and last_gradient.get(action.stage) == action:
            state = ranks[rank]
            began = next((start for start, _, what in reversed(state.timeline) if what == str(action)), now)
            ready = [began + (now - began) * (k + 1) / buckets for k in range(buckets)]
            if overlap_dp:
                issue_buckets(rank, ready)
            else:
                pending_buckets[rank] += [now] * buckets
        if d > 1 and not overlap_dp and not passes_left[rank]:
            issue_buckets(rank, pending_buckets[rank])

    def rate() -> float:
        if hardware.cores is None:
            return 1.0
        active = replicas * sum(1 for state in ranks if state.index < len(state.segments)
                                and state.segments[state.index][0] == "compute" and state.started is not None)
        per_host = active * min(world, per_node) / world
        return min(1.0, effective_cores(hardware.cores, per_host) / per_host) if per_host else 1.0

    def due(rank: int) -> float | None:
        """When ``rank``'s current segment ends or can proceed (None: not known yet, or it is done)."""
        state = ranks[rank]
        if state.index >= len(state.segments):
            return None
        segment = state.segments[state.index]
        if segment[0] == "compute" and sharing:
            return now + state.remaining / speed
        if segment[0] in ("compute", "comm", "straggle"):
            return state.end
        return available(rank, segment)

    def stuck() -> RuntimeError:
        return RuntimeError("the simulation cannot progress (a schedule that deadlocks?): " + str(
            [state.segments[state.index][:2] for state in ranks if state.index < len(state.segments)]))

    sharing, speed = hardware.cores is not None, 1.0
    awake = set(range(p))  # ranks that may move at `now`: their own event is due, or an input just ended
    if not sharing:  # every segment has a fixed length: a queue of when each rank is next due
        queue: list[tuple[float, int, int]] = []
        version = [0] * p
        while True:
            moved = set()
            while awake:
                rank = awake.pop()
                enter(rank)
                moved.add(rank)
            for rank in moved:
                version[rank] += 1
                when = due(rank)
                if when is not None:
                    heapq.heappush(queue, (when, version[rank], rank))
            while queue and queue[0][1] != version[queue[0][2]]:
                heapq.heappop(queue)  # superseded
            if not queue:
                if any(state.index < len(state.segments) for state in ranks):
                    raise stuck()
                break
            now = queue[0][0]
            while queue and queue[0][0] <= now:
                _, seen, rank = heapq.heappop(queue)
                if seen == version[rank]:
                    awake.add(rank)
    while sharing:  # processor sharing: each compute segment's rate changes whenever the busy ranks do
        while awake:
            enter(awake.pop())
        if all(state.index >= len(state.segments) for state in ranks):
            break
        speed = rate()
        upcoming = {rank: when for rank in range(p) if (when := due(rank)) is not None}
        if not upcoming:
            raise stuck()
        following = min(upcoming.values())
        awake = {rank for rank, when in upcoming.items() if when <= following}
        elapsed = following - now
        for state in ranks:
            if state.index < len(state.segments) and state.segments[state.index][0] == "compute" \
                    and state.started is not None:
                state.remaining -= elapsed * speed
                if state.remaining <= 1e-12 * max(1.0, following):
                    state.remaining = 0.0
        now = following
    finishes = [state.finished_at for state in ranks]
    last = max(range(p), key=lambda rank: finishes[rank])
    step_s = finishes[last]
    parts = dict(ranks[last].parts)
    for state, end in zip(ranks, finishes, strict=True):  # a rank done early waits for the last one
        state.parts["bubble"] += step_s - end
    mean_parts = {part: sum(state.parts[part] for state in ranks) / p for part in PARTS}
    parts["bubble"] += step_s - sum(parts.values())  # rounding only
    for state in ranks:
        state.timeline.sort()
    return SimulatedStep(layout, m, step_s, parts, mean_parts, [state.timeline for state in ranks], events)


def straggle_factor(straggle: tuple[float, ...], ranks: int) -> float:
    """How many times their mean the slowest of ``ranks`` takes (``Hardware.straggle``, held at its last point;
    1 for one rank or none measured)."""
    return max(1.0, straggle[min(ranks, len(straggle)) - 1]) if ranks > 1 and straggle else 1.0


def effective_cores(cores: float | tuple[float, ...], active: float) -> float:
    """The cores' worth of compute ``active`` ranks get together: ``min(active, cores)`` for a number of cores;
    for a measured curve (``cores[n - 1]``: what ``n`` busy ranks get, :func:`labkit.calibrate.calibrate`),
    interpolated linearly between its points and held at its last."""
    if not isinstance(cores, tuple):
        return min(active, cores)
    if active <= 1:
        return min(active, cores[0])
    if active >= len(cores):
        return cores[-1]
    below = int(active)
    return cores[below - 1] + (active - below) * (cores[below] - cores[below - 1])


# --------------------------------------------------------------------------------------------------------
# Scaling curves


@dataclass(frozen=True)
class ScalingPoint:
    """One GPU count of a scaling curve: its layout, global batch, simulated step, MFU and tokens per second."""

    gpus: int
    global_batch: int
    layout: Layout
    step: SimulatedStep
    mfu: float
    tokens_per_s: float


def scaling(shape: Any, hardware: Hardware, peak_flops: float, gpu_counts: Sequence[int],
            global_batch: int | Callable[[int], int], layout_for: Callable[[int, int], Layout],
            **simulate_options) -> list[ScalingPoint]:
    """Simulate one step at each of ``gpu_counts``: **strong scaling** with a fixed ``global_batch`` (an int),
    **weak scaling** with one that grows with the GPUs (``global_batch(gpus)``).  ``layout_for(gpus, batch)``
    chooses each point's layout (a fixed TP and PP with ``dp = gpus / (tp pp)``, or the planner's best:
    ``lambda n, B: plan(shape, Cluster(gpu, n), B, top=1).best.layout``).  MFU is against ``peak_flops``."""
    points = []
    for gpus in gpu_counts:
        batch = global_batch(gpus) if callable(global_batch) else global_batch
        layout = layout_for(gpus, batch)
        if layout.gpus != gpus:
            raise ValueError(f"layout_for({gpus}, {batch}) gave {layout.label()}: {layout.gpus} GPUs, not {gpus}")
        step = simulate_step(shape, layout, batch, hardware, **simulate_options)
        flops = model_flops_per_step(shape, batch)
        points.append(ScalingPoint(gpus, batch, layout, step, mfu(flops, step.step_s, gpus, peak_flops),
                                   batch * shape.seq_len / step.step_s))
    return points
