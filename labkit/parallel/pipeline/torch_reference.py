"""The same stages run by PyTorch's own pipeline runtime, ``torch.distributed.pipelining``: the reference that
labkit's runtime is held to (the same losses and gradients; :mod:`benchmarks.bench_pp` compares step times).

:func:`torch_pipeline` builds this rank's stages of ``TinyGPT(config, seed)`` exactly as
:func:`~.runtime.build_pipeline` does (the same blocks, weights and names), wraps each in torch's
``PipelineStage`` and returns torch's schedule for them: ``ScheduleGPipe`` or ``Schedule1F1B`` (one stage per
rank), ``ScheduleInterleaved1F1B`` or ``ScheduleInterleavedZeroBubble`` (``v`` per rank), ``ScheduleZBVZeroBubble``
or ``ScheduleDualPipeV`` (two per rank, in a V).  torch computes the loss itself, from the last stage's
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
from labkit.parallel.pipeline.schedule import stage_rank
from labkit.parallel.pipeline.stage import build_stage

TORCH_SCHEDULES = ("GPipe", "1F1B", "Interleaved 1F1B", "Interleaved ZB", "ZB-V", "DualPipeV")
_MULTI = {"Interleaved 1F1B": "ScheduleInterleaved1F1B", "Interleaved ZB": "ScheduleInterleavedZeroBubble",
          "ZB-V": "ScheduleZBVZeroBubble", "DualPipeV": "ScheduleDualPipeV"}  # v stages a rank, the last two in a V
_STAGES_PER_RANK = {"GPipe": "1", "1F1B": "1", "Interleaved 1F1B": ">= 2", "Interleaved ZB": ">= 1", "ZB-V": "2",
                    "DualPipeV": "2"}


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
    TinyGPT modules (``v`` stages per rank: ``r, r + p, ...``, or ``r, 2p - 1 - r`` for ZB-V and DualPipeV), for
    ``m`` micro-batches."""
    from torch.distributed import pipelining

    if name not in TORCH_SCHEDULES:
        raise ValueError(f"torch's schedule must be one of {TORCH_SCHEDULES}, got {name!r}")
    wanted = _STAGES_PER_RANK[name]
    if not {"1": v == 1, ">= 1": v >= 1, ">= 2": v >= 2, "2": v == 2}[wanted]:
        raise ValueError(f"{name} runs v {wanted} stage(s) per rank, got v={v}")
    pp = require_group(group.group("pp") if isinstance(group, Mesh) else group)
    if dist.get_world_size(pp) != p:
        raise ValueError(f"p={p}, but the pipeline group has {dist.get_world_size(pp)} ranks")
    here, total = dist.get_rank(pp), p * v
    mine = [stage for stage in range(total) if stage_rank(stage, p, "v" if wanted == "2" else "loop") == here]
    modules = [build_stage(config, seed, stage, total) for stage in mine]
    device = next(modules[0].parameters()).device
    stages = [pipelining.PipelineStage(_Logits(module), stage, total, device, group=pp)
              for module, stage in zip(modules, mine, strict=True)]
    if name in _MULTI:
        return getattr(pipelining.schedules, _MULTI[name])(stages, m, loss_fn=TinyGPT.loss), modules
    return (pipelining.ScheduleGPipe if name == "GPipe" else pipelining.Schedule1F1B)(stages[0], m,
                                                                                     loss_fn=TinyGPT.loss), modules


def torch_step(schedule: Any, modules: list[TinyGPT], ids: torch.Tensor, targets: torch.Tensor
               ) -> list[float] | None:
    """One step of torch's ``schedule`` on the whole batch; the micro-batch losses where the last stage lives."""
    first = modules[0].token_embedding is not None
    last = any(module.lm_head is not None for module in modules)
    losses: list[torch.Tensor] = []
    args = (ids,) if first else ()
    schedule.step(*args, target=targets if last else None, losses=losses if last else None)
    return [loss.item() for loss in losses] if last else None


def _torch_operations(name: str, p: int, m: int, v: int) -> list[list[Any]]:
    """torch's per-rank actions for its schedule ``name``, idle slots dropped.  The class's
    ``_calculate_single_rank_operations`` reads a handful of attributes, so a namespace stands in for the schedule
    object and no process group is needed."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules

    if name not in ("Interleaved ZB", "ZB-V", "DualPipeV"):
        raise ValueError(f"torch's tables are read for Interleaved ZB, ZB-V or DualPipeV, got {name!r}")
    rounds = max(1, m // p)
    fake = SimpleNamespace(pp_group_size=p, num_stages=v * p, _num_stages=v * p, _n_microbatches=m,
                           n_local_stages=v, number_of_rounds=rounds, microbatches_per_round=m // rounds)
    operations = getattr(schedules, _MULTI[name])._calculate_single_rank_operations
    return [[action for action in operations(fake, rank) if action is not None] for rank in range(p)]


def torch_orders(name: str, p: int, m: int, v: int = 2) -> list[list[str]]:
    """torch's own per-rank compute order for its schedule ``name`` (``"Interleaved ZB"``, ``"ZB-V"`` or
    ``"DualPipeV"``), as labkit writes actions (``"1F0"``), an overlapped ``F&B`` read as its two passes."""
    return [[repr(part) for action in row for part in (action.sub_actions or (action,))]
            for row in _torch_operations(name, p, m, v)]


def torch_pairs(name: str, p: int, m: int, v: int = 2) -> set[tuple[str, str]]:
    """torch's overlapped ``F&B`` actions of schedule ``name``, each as its two passes (``("0F5", "7B0")``)."""
    return {tuple(repr(part) for part in action.sub_actions) for row in _torch_operations(name, p, m, v)
            for action in row if action.sub_actions}
