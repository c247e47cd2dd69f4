"""The same stages run by PyTorch's own pipeline runtime, ``torch.distributed.pipelining``: the reference that
labkit's runtime is held to (the same losses and gradients; :mod:`benchmarks.bench_pp` compares step times).

:func:`torch_pipeline` builds this rank's stages of ``TinyGPT(config, seed)`` exactly as
:func:`~.runtime.build_pipeline` does (the same blocks, weights and names), wraps each in torch's
``PipelineStage`` and returns torch's schedule for them: ``ScheduleGPipe`` or ``Schedule1F1B`` (one stage per
rank) or ``ScheduleInterleaved1F1B`` (``v`` per rank).  torch computes the loss itself, from the last stage's
logits and a ``loss_fn``, and divides every gradient by the number of micro-batches (``scale_grads``), which is
the same as labkit's ``loss / m``.  Run one step with :func:`torch_step`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labkit.dist import require_group
from labkit.mesh import Mesh
from labkit.models import GPTConfig, TinyGPT
from labkit.parallel.pipeline.stage import build_stage

TORCH_SCHEDULES = ("GPipe", "1F1B", "Interleaved 1F1B")


class _Logits(nn.Module):
    """A TinyGPT stage as torch's runtime wants it: one tensor in, one tensor out (the logits on the last)."""

    def __init__(self, stage: TinyGPT):
        super().__init__()
        self.stage = stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stage(x)[0]


def torch_pipeline(config: GPTConfig, seed: int, name: str, p: int, m: int, v: int = 1, group: Any = None
                   ) -> tuple[Any, list[TinyGPT]]:
    """torch's schedule ``name`` (one of :data:`TORCH_SCHEDULES`) over this rank's stages, and those stages'
    TinyGPT modules (``v`` stages per rank, ``r, r + p, ...``), for ``m`` micro-batches."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    if name not in TORCH_SCHEDULES:
        raise ValueError(f"torch's schedule must be one of {TORCH_SCHEDULES}, got {name!r}")
    if (v != 1) != (name == "Interleaved 1F1B"):
        raise ValueError(f"{name} runs {'v >= 2' if name == 'Interleaved 1F1B' else 'one'} stage(s) per rank, "
                         f"got v={v}")
    pp = require_group(group.group("pp") if isinstance(group, Mesh) else group)
    if dist.get_world_size(pp) != p:
        raise ValueError(f"p={p}, but the pipeline group has {dist.get_world_size(pp)} ranks")
    here, total = dist.get_rank(pp), p * v
    modules = [build_stage(config, seed, stage, total) for stage in range(here, total, p)]
    device = next(modules[0].parameters()).device
    stages = [PipelineStage(_Logits(module), stage, total, device, group=pp)
              for module, stage in zip(modules, range(here, total, p), strict=True)]
    if name == "Interleaved 1F1B":
        return ScheduleInterleaved1F1B(stages, m, loss_fn=TinyGPT.loss), modules
    return (ScheduleGPipe if name == "GPipe" else Schedule1F1B)(stages[0], m, loss_fn=TinyGPT.loss), modules


def torch_step(schedule: Any, modules: list[TinyGPT], ids: torch.Tensor, targets: torch.Tensor
               ) -> list[float] | None:
    """One step of torch's ``schedule`` on the whole batch; the micro-batch losses where the last stage lives."""
    first = modules[0].token_embedding is not None
    last = any(module.lm_head is not None for module in modules)
    losses: list[torch.Tensor] = []
    args = (ids,) if first else ()
    schedule.step(*args, target=targets if last else None, losses=losses if last else None)
    return [loss.item() for loss in losses] if last else None
