"""Run a pipeline schedule on real ranks: the table of :mod:`.schedule`, action by action, timed.

Each rank walks its own row of the table in order (the idle slots are not waited out: a rank simply blocks
until an action's input arrives).  One action is one pass of one of its stages over one micro-batch:

========  ============================================================================================
``F``     receive the previous stage's activation (the first stage slices its micro-batch of token ids),
          run the stage forward, send the output on (the last stage keeps the loss instead)
``B``     receive the next stage's gradient (the last stage starts from its loss), run the whole backward,
          send the input's gradient back (the first stage has no one to send it to)
``I``     the same for the input gradient only (:meth:`~.stage.PipelineStage.backward_input`)
``W``     the weight gradients deferred by ``I`` (:meth:`~.stage.PipelineStage.backward_weight`); no message
========  ============================================================================================

**Receives are posted ahead.**  Before blocking on the input of action ``k``, the rank posts the receive for
action ``k + 1`` as well (``irecv``), so that a message that arrives while the rank computes lands in its
buffer at once instead of waiting for the receiver to ask.  Sends are ``isend``: a rank never waits for its
neighbour to take a message, only (at the end of the step) for every send to complete.  On gloo, messages are
matched by tag (one per boundary, direction and micro-batch), so the order of posting does not matter; NCCL
matches the messages between two ranks in the order they are posted, and a valid table posts them in the order
they are sent.

**What is timed.**  Every action is a span from the moment its input was in hand to the moment its output was
handed to the backend; the time a rank spends blocked on a receive is its *bubble* (with ``labkit.trace``
recording, the actions are ``"compute"`` spans named like ``1F0`` and the waits ``"bubble"`` spans).  Times are
measured on each rank from a barrier at the start of the step, and gathered: the result is a
:class:`~.simulate.Timeline`, the same type the simulator returns, so a measured step and a simulated one are
drawn, and their bubbles computed, the same way.  ``peak_activations`` is measured too: per stage, the most
micro-batches whose forward had run and whose backward (``B`` or ``I``) had not.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from labkit import trace
from labkit.dist import require_group
from labkit.mesh import Mesh
from labkit.models import GPTConfig
from labkit.parallel.pipeline.schedule import Action, Schedule, validate
from labkit.parallel.pipeline.simulate import Timeline
from labkit.parallel.pipeline.stage import PipelineStage, build_stage


@dataclass(frozen=True)
class PipelineRun:
    """One step of a schedule, as it ran.

    ``losses``: the mean loss of each micro-batch, on the rank that holds the last stage (``None`` on the others).
    ``timeline``: what every rank did when, gathered to every rank (``None`` when not asked for).
    """

    losses: list[float] | None
    timeline: Timeline | None

    @property
    def loss(self) -> float | None:
        """The batch's mean loss (the mean over equal micro-batches), where the last stage lives."""
        return None if self.losses is None else sum(self.losses) / len(self.losses)


def build_pipeline(config: GPTConfig, seed: int, schedule: Schedule, group: Any = None, *, micro_batch_size: int,
                   seq_len: int) -> list[PipelineStage]:
    """This rank's stages of ``TinyGPT(config, seed)`` for ``schedule``: stages ``r, r + p, ...`` of ``p v``
    (``r`` and ``2p - 1 - r`` under the V placement), where ``r`` is this rank's place in ``group`` (a
    :class:`~labkit.mesh.Mesh`'s ``"pp"`` group, a process group, or every rank)."""
    pp = require_group(group.group("pp") if isinstance(group, Mesh) else group)
    if dist.get_world_size(pp) != schedule.p:
        raise ValueError(f"the schedule is for p={schedule.p} ranks, but the pipeline group has "
                         f"{dist.get_world_size(pp)}")
    here = dist.get_rank(pp)
    return [PipelineStage(build_stage(config, seed, stage, schedule.stages), stage, schedule.stages, group,
                          micro_batch_size=micro_batch_size, seq_len=seq_len, num_microbatches=schedule.m,
                          placement=schedule.placement)
            for stage in schedule.stages_of(here)]


def _check(schedule: Schedule, stages: Sequence[PipelineStage], ids: torch.Tensor | None,
           targets: torch.Tensor | None) -> tuple[int, dict[int, PipelineStage]]:
    """Everything that can be wrong before the first message: ``ValueError`` naming it."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a labkit.parallel.pipeline.Schedule, got {type(schedule).__name__}")
    validate(schedule)
    if not stages or not all(isinstance(stage, PipelineStage) for stage in stages):
        raise TypeError("stages must be this rank's PipelineStage objects (see build_pipeline), at least one")
    group = stages[0].group
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    if p != schedule.p:
        raise ValueError(f"the schedule is for p={schedule.p} ranks, but the stages' pipeline group has {p}")
    by_stage = {stage.stage: stage for stage in stages}
    expected = schedule.stages_of(rank)
    if sorted(by_stage) != expected:
        raise ValueError(f"pp-rank {rank} of {schedule.name} (p={schedule.p}, v={schedule.v}, {schedule.placement} "
                         f"placement) runs stages {expected}, but was given stages {sorted(by_stage)}")
    for stage in stages:
        if stage.num_stages != schedule.stages or stage.num_microbatches != schedule.m:
            raise ValueError(f"stage {stage.stage} was built for {stage.num_stages} stages and "
                             f"{stage.num_microbatches} micro-batches, but {schedule.name} has p*v="
                             f"{schedule.stages} stages and m={schedule.m} micro-batches")
    b, s = stages[0].activation_shape[:2]
    for tensor, name, needed in ((ids, "ids", 0 in by_stage), (targets, "targets", schedule.stages - 1 in by_stage)):
        # Checked wherever given, so that every rank passed the same wrong batch refuses it, not only the one
        # that needs it (the others would wait for it forever).
        if (needed or tensor is not None) and (not isinstance(tensor, torch.Tensor)
                                               or tuple(tensor.shape) != (schedule.m * b, s)):
            got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{name} must have shape (m * micro_batch_size, seq_len) = {(schedule.m * b, s)}"
                             f"{' on the rank of the first stage' if name == 'ids' else ' on the rank of the last stage'}"
                             f", got {got}")
    return rank, by_stage


def run_schedule(schedule: Schedule, stages: Sequence[PipelineStage], ids: torch.Tensor | None = None,
                 targets: torch.Tensor | None = None, *, timeline: bool = True,
                 before_last_backward: Callable[[], None] | None = None) -> PipelineRun:
    """Run one step of ``schedule`` on this rank's ``stages``: every rank of the pipeline calls it.

    ``ids`` and ``targets`` (``[m * micro_batch_size, seq_len]``) are the whole batch, cut into ``m``
    micro-batches in order; the rank of the first stage needs ``ids``, the rank of the last ``targets`` (the
    others may pass them or not).  Gradients accumulate into the stages' ``.grad`` (the mean loss's, as one
    process with gradient accumulation computes them); the caller steps its optimizer and zeroes them.  With
    ``timeline``, every rank's timings are gathered into a measured :class:`~.simulate.Timeline`.
    ``before_last_backward`` runs just before this rank's last ``B`` (where no ``W`` follows it): a data-parallel
    wrapper can turn its gradient sync on there, so its reduction overlaps that backward.
    """
    rank, by_stage = _check(schedule, stages, ids, targets)
    order = schedule.orders()[rank]
    split = {(a.stage, a.microbatch) for a in order if a.kind == "I"}
    micro_ids = None if ids is None else ids.chunk(schedule.m)
    micro_targets = None if targets is None else targets.chunk(schedule.m)
    posted: dict[tuple[str, int, int], tuple[Any, torch.Tensor]] = {}
    # Under the V placement rank p - 1 holds stages p - 1 and p: what one hands the other stays in this process.
    handed: dict[tuple[str, int, int], torch.Tensor] = {}
    follows = dict(schedule.pairs)  # an overlapped pair: its forward -> its backward

    def source(action: Action) -> int:  # the stage whose output this action's input is
        return action.stage - 1 if action.kind == "F" else action.stage + 1

    def post(action: Action) -> None:
        stage = by_stage[action.stage]
        key = (action.kind, action.stage, action.microbatch)
        if key in posted or action.kind == "W" or (action.kind == "F" and stage.is_first) \
                or (action.kind != "F" and stage.is_last) or source(action) in by_stage:
            return
        posted[key] = (stage.irecv_activation if action.kind == "F" else stage.irecv_gradient)(action.microbatch)

    def take(action: Action) -> torch.Tensor | None:
        key = (action.kind, action.stage, action.microbatch)
        if key in handed:
            return handed.pop(key).requires_grad_(action.kind == "F")
        post(action)
        entry = posted.pop(key, None)
        if entry is None:
            return None
        work, buffer = entry
        work.wait()
        return buffer.requires_grad_(action.kind == "F")

    def hand_on(action: Action, tensor: torch.Tensor) -> None:  # the output of an F, or the input gradient of a B/I
        stage, forward = by_stage[action.stage], action.kind == "F"
        target = action.stage + 1 if forward else action.stage - 1
        if target in by_stage:
            kind = "F" if forward else "I" if (target, action.microbatch) in split else "B"
            handed[(kind, target, action.microbatch)] = tensor.detach()
        elif forward:
            stage.send_activation(action.microbatch, tensor)
        else:
            stage.send_gradient(action.microbatch, tensor)

    losses: list[torch.Tensor] = []
    events: list[tuple[float, float, Action]] = []
    peak = {stage: 0 for stage in by_stage}
    if timeline:  # one clock origin for the gathered timeline; without one the ranks need not wait for each other
        dist.barrier(group=stages[0].group)
    origin = time.perf_counter()
    backwards = [index for index, action in enumerate(order) if action.kind == "B"]
    last_backward = backwards[-1] if backwards and not any(a.kind == "W" for a in order) else None
    early: dict[Action, torch.Tensor | None] = {}  # the second action's input of an overlapped pair, in hand
    rank_peak = 0
    for index, action in enumerate(order):
        if index + 1 < len(order):
            post(order[index + 1])
        if index == last_backward and before_last_backward is not None:
            before_last_backward()
        stage, mb = by_stage[action.stage], action.microbatch
        waited = time.perf_counter()
        received = early.pop(action) if action in early else take(action)
        if action in follows:  # an overlapped F&B starts once both inputs are in (DualPipe's rule)
            early[follows[action]] = take(follows[action])
        start = time.perf_counter()
        if action.kind == "F":
            inputs = micro_ids[mb] if stage.is_first else received
            out = stage.forward(mb, inputs, micro_targets[mb] if stage.is_last else None,
                                split_backward=(action.stage, mb) in split)
            if stage.is_last:
                losses.append(out.detach())
            else:
                hand_on(action, out)
        elif action.kind == "W":
            stage.backward_weight(mb)
        else:
            backward = stage.backward if action.kind == "B" else stage.backward_input
            grad_input = backward(mb, received)
            if not stage.is_first:
                hand_on(action, grad_input)
        end = time.perf_counter()
        peak[action.stage] = max(peak[action.stage], len(stage.pending_microbatches))
        rank_peak = max(rank_peak, sum(len(s.pending_microbatches) for s in stages))
        events.append((start, end, action))
        if trace.is_enabled():
            shift = trace.now() - end  # perf_counter -> this rank's trace clock
            if start > waited:
                trace.add(f"wait {action}", "bubble", waited + shift, start + shift)
            trace.add(str(action), "compute", start + shift, end + shift)
    for stage in stages:
        stage.wait_sends()
    values = [loss.item() for loss in losses] if any(s.is_last for s in stages) else None
    return PipelineRun(values, _gather(schedule, stages[0].group, events, peak, rank_peak, origin)
                       if timeline else None)


def _gather(schedule: Schedule, group: Any, events: list, peak: dict[int, int], rank_peak: int, origin: float
            ) -> Timeline:
    """Every rank's events on one clock.  On one machine ``perf_counter`` reads the same monotonic clock in every
    process, so times compare as they are; across machines each rank's times count from its barrier exit."""
    everyone: list[Any] = [None] * schedule.p
    dist.all_gather_object(everyone, (socket.gethostname(), origin, events, rank_peak, peak), group=group)
    one_host = len({host for host, *_ in everyone}) == 1
    rows = [[(s - (0.0 if one_host else start), e - (0.0 if one_host else start), action)
             for s, e, action in row] for _, start, row, _, _ in everyone]
    first = min((row[0][0] for row in rows if row), default=0.0)
    rows = [[(s - first, e - first, action) for s, e, action in row] for row in rows]
    peaks = [0] * schedule.stages
    for *_, of_rank in everyone:
        for stage, value in of_rank.items():
            peaks[stage] = value
    total = max((row[-1][1] for row in rows if row), default=0.0)
    return Timeline(schedule, rows, total, peaks, [entry[3] for entry in everyone])
