"""The dense states of a :class:`~labkit.parallel.parallelize.Parallel3D` model: gathered for a full checkpoint and
cut back into this rank's pieces on load (``labkit.checkpoint``, lesson 09's contract).

A rank holds, of the dense TinyGPT, the stages ``r, r + p, ...`` of its pp-rank ``r``; of each, its tensor-parallel
slices (rows or columns, :mod:`labkit.parallel.tensor.state`); and with FSDP only its dp shard of those.  Gathering
undoes the three cuts in the opposite order: FSDP's shards over dp (``full_state_dict`` of the FSDP wrapper),
the slices over tp (the all-gather along each split dimension, padding dropped), then the stages over pp (an
object all-gather, merged in stage order).  Adam's per-element moments have their parameter's shape and follow
the same path; its scalars (the step) are whole everywhere.  With expert parallelism each stage's experts are
gathered over the ep group first.  Loading reads the dense tensors on every rank and
keeps this rank's slice: no communication but FSDP's own.

The dense optimizer state lists the parameters in the dense model's order, stage by stage, whatever the data-
parallel wrapper's own order: so a checkpoint of one layout loads into another of the same world size (ZeRO-1
at 2x2x2 into FSDP at 2x2x2, say), and into the same model under any wrapper.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist

from labkit.parallel.tensor.state import local_part
from labkit.parallel.tensor.transformer import TensorParallel


def plain_name(name: str) -> str:
    """A parameter's name in the dense TinyGPT, from its name under the wrappers (``0.module.blocks.1...`` or
    ``module.blocks.1...``)."""
    head, _, rest = name.partition("module.")
    return rest if head == "" or head.rstrip(".").isdigit() else name


def _local_dense(model: Any) -> list[dict[str, torch.Tensor]]:
    """Per stage of this rank, its tensor-parallel slices, unsharded over dp (collective over dp with FSDP)."""
    if model.zero == 3:
        return [{plain_name(k): v for k, v in model.data_parallel.full_state_dict().items()}]
    return [tp.module.state_dict() for tp in model.tensor_parallel]


def _gather_tp(model: Any, tp: TensorParallel, name: str, tensor: torch.Tensor) -> torch.Tensor:
    return tp._gather(name, tensor) if name in model.split else tensor.clone()


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def _merge_experts(parts: list[Any]) -> Any:
    """The ep ranks' entries of one stage (dicts or lists by name) as one, in the dense model's order: the
    names outside the experts are every rank's, in the same order; each run of expert names is replaced by all
    the ranks' runs, in rank order (rank ``r`` holds experts ``r E / ep ..``)."""
    runs = [[list(group) for _, group in itertools.groupby(part, key=_is_expert)] for part in parts]
    names = [name for index, run in enumerate(runs[0])
             for name in (run if not _is_expert(run[0]) else [n for rank in runs for n in rank[index]])]
    if isinstance(parts[0], list):
        return names
    merged = {name: value for part in parts for name, value in part.items()}
    return {name: merged[name] for name in names}


def _gather_ep(model: Any, per_stage: dict[int, Any]) -> dict[int, Any]:
    """With expert parallelism, each stage's entries completed with the other ep ranks' experts."""
    if getattr(model, "experts", None) is None:
        return per_stage
    everyone: list[Any] = [None] * model.mesh.ep
    dist.all_gather_object(everyone, per_stage, group=model.mesh.group("ep"))
    return {stage: _merge_experts([part[stage] for part in everyone]) for stage in per_stage}


def _gather_pp(model: Any, per_stage: dict[int, Any]) -> list[Any]:
    """Every stage's entry, in stage order, on every rank (an object all-gather over the ep group, then the pp
    group)."""
    per_stage = _gather_ep(model, per_stage)
    everyone: list[Any] = [None] * model.mesh.pp
    dist.all_gather_object(everyone, per_stage, group=model.mesh.group("pp"))
    merged = {stage: entry for part in everyone for stage, entry in part.items()}
    return [merged[stage] for stage in sorted(merged)]


@torch.no_grad()
def full_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """Collective (every rank): the dense TinyGPT's ``state_dict()``."""
    mine = {s: {name: _gather_tp(model, tp, name, t).cpu() for name, t in local.items()}
            for s, tp, local in zip(model.stage_indices, model.tensor_parallel, _local_dense(model), strict=True)}
    device = model.stages[0].device
    return {name: t.to(device) for part in _gather_pp(model, mine) for name, t in part.items()}


def _tp_local_shapes(model: Any) -> list[dict[str, torch.Size]]:
    return [{name: t.shape for name, t in local.items()} for local in _local_dense(model)]


@torch.no_grad()
def load_full_state_dict(model: Any, state: dict[str, torch.Tensor]) -> None:
    shapes = _tp_local_shapes(model)
    local = [{name: local_part(tp, name, state[name], shape[name]) if name in model.split else state[name]
              for name in shape} for tp, shape in zip(model.tensor_parallel, shapes, strict=True)]
    if model.zero == 3:
        model.data_parallel.load_full_state_dict({f"module.{k}": v for k, v in local[0].items()})
    else:
        for tp, part in zip(model.tensor_parallel, local, strict=True):
            for name, tensor in tp.module.state_dict().items():
                tensor.copy_(part[name])


def _optimizer_names(model: Any) -> list[tuple[int, str]]:
    """``(local stage, dense name)`` of each parameter of the data-parallel optimizer, in its order."""
    if model.zero == 3:
        return [(0, plain_name(name)) for name, _ in model.data_parallel.module.named_parameters()]
    return [(int(name.split(".", 1)[0]), plain_name(name)) for name, _ in model.module.named_parameters()]


@torch.no_grad()
def full_optimizer_state_dict(model: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Collective: the optimizer's state as one process over the dense TinyGPT would hold it (its parameters
    in the dense model's order)."""
    saved = model.data_parallel.full_optimizer_state_dict(optimizer)
    if len(saved["param_groups"]) != 1:
        raise ValueError("a 3D model's optimizer has one parameter group")
    mine: dict[int, dict[str, Any]] = {s: {} for s in model.stage_indices}
    for position, (local, name) in enumerate(_optimizer_names(model)):
        entries = saved["state"].get(position, saved["state"].get(str(position)))
        if entries is not None:
            tp = model.tensor_parallel[local]
            mine[model.stage_indices[local]][name] = {
                key: _gather_tp(model, tp, name, value).cpu() if torch.is_tensor(value) and value.dim() else value
                for key, value in entries.items()}
    ordered = _dense_order(model)
    states = {name: entries for part in _gather_pp(model, mine) for name, entries in part.items()}
    hyper = {key: value for key, value in saved["param_groups"][0].items() if key != "params"}
    return {"state": {position: states[name] for position, name in enumerate(ordered) if name in states},
            "param_groups": [{**hyper, "params": list(range(len(ordered)))}]}


def _dense_order(model: Any) -> list[str]:
    """The dense model's parameter names in its own order: every stage's, in stage order (collective over pp)."""
    names = {s: [name for name, _ in tp.module.named_parameters()]
             for s, tp in zip(model.stage_indices, model.tensor_parallel, strict=True)}
    return [name for part in _gather_pp(model, names) for name in part]


@torch.no_grad()
def load_full_optimizer_state_dict(model: Any, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    ordered = _dense_order(model)
    dense = {name: state["state"].get(position, state["state"].get(str(position)))
             for position, name in enumerate(ordered)}
    shapes = _tp_local_shapes(model)
    local: dict[int, dict[str, Any]] = {}
    for position, (stage, name) in enumerate(_optimizer_names(model)):
        entries = dense[name]
        if entries is not None:
            local[position] = {key: (local_part(model.tensor_parallel[stage], name, value, shapes[stage][name])
                                     if name in model.split else value.clone())
                               if torch.is_tensor(value) and value.dim() else value
                               for key, value in entries.items()}
    hyper = {key: value for key, value in state["param_groups"][0].items() if key != "params"}
    model.data_parallel.load_full_optimizer_state_dict(optimizer, {
        "state": local, "param_groups": [{**hyper, "params": list(range(len(_optimizer_names(model))))}]})
