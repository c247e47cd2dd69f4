"""Stages whose compute is a timed wait: the schedule's bubble measured without the CPU's noise.

Four pipeline ranks on a 2-core laptop share two cores, so a real stage's forward takes longer whenever another
rank computes at the same time: the timeline then measures CPU contention, not the schedule.  A
:class:`TimedStage` *sleeps* instead of computing, for exactly the durations given: a sleeping process needs no
core, so ``p = 4`` or ``8`` ranks keep the durations they were given on any machine, and the bubble that the
runtime measures is the schedule's own.  Everything else is real: the stages run under the same runtime,
exchange real ``[b, s, h]`` messages and run real autograd, so a split backward (``I``, ``W``) splits here too.

The waits sit where autograd runs them.  ``_Wait``, an autograd function, sleeps ``forward_s`` in its forward and
``backward_s - weight_s`` in its backward (the input-gradient part, ``I``); the stage's one weight (a scalar)
carries a gradient hook that sleeps ``weight_s``, and autograd runs it only when it computes that weight's
gradient (``W``).  A full ``B`` runs both; a split backward runs the first in ``I`` and the second in ``W``.  ``time.sleep`` oversleeps by tens of
microseconds, so keep durations in milliseconds.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labkit.dist import require_group
from labkit.mesh import Mesh
from labkit.parallel.pipeline.schedule import Schedule
from labkit.parallel.pipeline.stage import PipelineStage


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, input_s: float) -> torch.Tensor:
        ctx.input_s = input_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.input_s)
        return grad, None, None


class _Scale(nn.Module):
    """The stage's one weight (a scalar, 1.0): the layer whose weight gradient a split backward defers.  The
    wait is a hook on the weight, which autograd runs only when it computes that weight's gradient."""

    def __init__(self, weight_s: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))
        self.weight_s = weight_s
        self.weight.register_hook(self._wait)

    def _wait(self, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(self.weight_s)
        return grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class TimedStage(nn.Module):
    """A pipeline stage that waits ``forward_s`` in forward and ``backward_s`` in backward (``weight_s`` of it
    in ``W`` when split), shaped like a TinyGPT stage for :class:`~.stage.PipelineStage`.

    ``forward(x, targets) -> (output, loss)``: the first stage (``first=True``) takes token ids ``[b, s]`` and
    starts from zeros ``[b, s, n_embd]``; the last (``last=True``) returns the output's mean as its loss.
    """

    def __init__(self, forward_s: float, backward_s: float, weight_s: float | None = None, *, first: bool = False,
                 last: bool = False, n_embd: int = 8):
        super().__init__()
        weight_s = backward_s / 2 if weight_s is None else weight_s
        for name, value in (("forward_s", forward_s), ("backward_s", backward_s), ("weight_s", weight_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
        if weight_s > backward_s:
            raise ValueError(f"weight_s={weight_s} must not exceed backward_s={backward_s}: W is part of B")
        self.forward_s, self.backward_s, self.weight_s = float(forward_s), float(backward_s), float(weight_s)
        self.first, self.last = first, last
        self.config = SimpleNamespace(n_embd=n_embd)  # what PipelineStage reads: the width of a message
        self.scale = _Scale(self.weight_s)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        if self.first:
            x = torch.zeros(*x.shape, self.config.n_embd)
        output = _Wait.apply(self.scale(x), self.forward_s, self.backward_s - self.weight_s)
        return output, (output.mean() if self.last else None)


def timed_pipeline(schedule: Schedule, forward_s: float, backward_s: float, weight_s: float | None = None,
                   group: Any = None, *, micro_batch_size: int = 1, seq_len: int = 4) -> list[PipelineStage]:
    """This rank's stages for ``schedule``, each a :class:`TimedStage` with the given durations per stage (per
    chunk when ``v > 1``: pass ``1/v`` of a rank's share to compare with ``v = 1``); ``group`` as in
    :func:`~.runtime.build_pipeline`.  Messages are ``[micro_batch_size, seq_len, 8]`` floats."""
    pp = require_group(group.group("pp") if isinstance(group, Mesh) else group)
    if dist.get_world_size(pp) != schedule.p:
        raise ValueError(f"the schedule is for p={schedule.p} ranks, but the pipeline group has "
                         f"{dist.get_world_size(pp)}")
    return [PipelineStage(TimedStage(forward_s, backward_s, weight_s, first=stage == 0,
                                     last=stage == schedule.stages - 1),
                          stage, schedule.stages, group, micro_batch_size=micro_batch_size, seq_len=seq_len,
                          num_microbatches=schedule.m, placement=schedule.placement)
            for stage in schedule.stages_of(dist.get_rank(pp))]
