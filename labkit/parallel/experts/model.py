"""Expert parallelism in a 3D (or 4D) layout: what :func:`labkit.parallel.parallelize.parallelize` adds for
MoE blocks when the mesh has ``ep > 1``.

- every stage's MoE layers keep this rank's ``E / ep`` experts and route over ``Mesh.group("ep")``
  (:func:`apply_expert_parallel`);
- the data-parallel wrapper, over dp x cp, averages every other parameter and leaves the experts alone (they
  differ between its ranks); after the schedule their gradients are summed over ``Mesh.group("edp")`` (the
  ranks holding the same experts) and divided by ``dp * cp`` (:func:`reduce_expert_gradients`): the gradient
  of the mean loss over all the data-parallel ranks, as for the rest;
- only DDP is built around experts here: ZeRO and FSDP would need a second sharded optimizer over the edp
  group (torchtitan shards experts with FSDP over ``dp_shard_mod_ep``), refused by :func:`check_expert_layout`.

The MoE layers are not split by tensor parallelism: each tp rank runs them whole on the same tokens, its
all-to-alls within the ep group of its own tp coordinate.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labkit.costmodel.experts import ep_messages
from labkit.degrees import check_ep
from labkit.parallel.experts.dispatch import ExpertParallelGroup, check_expert_parallel
from labkit.parallel.experts.layer import is_expert_parallel, moe_layers


def apply_expert_parallel(model: nn.Module, ep: ExpertParallelGroup) -> nn.Module:
    """Keep only this rank's experts of every MoE layer of ``model`` (in place; the others' slots become
    ``None``, so parameter names stay the whole model's) and route over ``ep``; returns ``model``.  The
    experts' parameters are marked ``expert_parallel`` so that data parallelism leaves them to
    :func:`reduce_expert_gradients`."""
    for layer in moe_layers(model):
        check_expert_parallel(len(layer.experts), ep.size)
        mine = ep.experts(len(layer.experts))
        for index in range(len(layer.experts)):
            if index not in mine:
                layer.experts[index] = None
            else:
                for parameter in layer.experts[index].parameters():
                    parameter.expert_parallel = True
        layer.ep = ep
    return model


@torch.no_grad()
def reduce_expert_gradients(model: nn.Module, group: Any, divide_by: int) -> int:
    """Sum the expert-parallel gradients over ``group`` (the ranks holding the same experts: the data-parallel
    ranks divided by ep), divided by ``divide_by`` (all the data-parallel ranks, as DDP divides the others);
    returns the bytes sent into the all-reduce.  An expert's gradient on its rank already sums every ep rank's
    tokens (they came back through the combine's backward), so only the replicas remain to be added."""
    grads = [p.grad for p in model.parameters() if is_expert_parallel(p) and p.grad is not None]
    if not grads:
        return 0
    flat = torch.cat([g.reshape(-1) for g in grads])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(flat, group=group)
    flat /= divide_by
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    return flat.numel() * flat.element_size()


@torch.no_grad()
def balance_experts(model: nn.Module, rate: float, group: Any = None) -> list[torch.Tensor]:
    """DeepSeek-V3's bias update for every MoE layer of ``model``, from the load accumulated since the last call
    summed over ``group`` (every rank that routes different tokens); returns each layer's load and resets it."""
    loads = []
    for layer in moe_layers(model):
        load = layer.load if layer.load is not None else torch.zeros(len(layer.experts), dtype=torch.long)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(load, group=group)
        if rate:
            layer.router.update_bias(load, rate)
        layer.load = None
        loads.append(load)
    return loads


def check_expert_layout(config: Any, ep: int, dp: int, cp: int = 1, zero: int = 0) -> None:
    """Every check of expert parallelism in a layout that needs no process group; ``ValueError`` naming it."""
    check_ep(ep, dp, cp)
    if ep == 1:
        return
    if not config.n_experts:
        raise ValueError(f"ep={ep} needs MoE blocks to split: the config has n_experts=0 (a dense MLP)")
    check_expert_parallel(config.n_experts, ep)
    if zero:
        raise ValueError(f"expert parallelism is built here with DDP only (zero=0), got zero={zero}: ZeRO and FSDP "
                         "would need a second sharded optimizer over the ranks that hold the same experts")


class ExpertsIn3D:
    """This rank's share of the experts of ``modules`` (its stages) over ``mesh``; see the module docstring."""

    def __init__(self, mesh: Any, modules: list[nn.Module]):
        self.mesh = mesh
        self.group = ExpertParallelGroup(mesh.group("ep"))
        for module in modules:
            apply_expert_parallel(module, self.group)
        self.replicas = mesh.group("edp")
        self._reduced = 0

    def start_step(self) -> None:
        self.group.clear()

    def reduce_gradients(self, module: nn.Module) -> None:
        self._reduced = reduce_expert_gradients(module, self.replicas, self.mesh.dp * self.mesh.cp)

    def copies(self) -> int:
        """Ranks holding each expert's gradient whole: its ``dp cp / ep`` replicas times the tp ranks."""
        return self.mesh.dp * self.mesh.cp // self.mesh.ep * self.mesh.tp

    def communication(self) -> Counter:
        """This rank's bytes of the last step: the all-to-alls by kind, the replicas' all-reduce."""
        found: Counter = Counter()
        for _, kind, n in self.group.log:
            found[f"ep {kind}"] += n
        if self._reduced and self.mesh.dp * self.mesh.cp > self.mesh.ep:
            found["edp all_reduce"] += self._reduced
        return found

    def predicted(self, row_bytes: int, n_experts: int) -> Counter:
        """The bytes the cost model gives for the splits this rank sent (``labkit.costmodel.experts``)."""
        found: Counter = Counter()
        for send, receive in self.group.splits:
            for _, kind, n in ep_messages(send, receive, self.group.rank, row_bytes):
                found[f"ep {kind}"] += n
            found["ep counts"] += (n_experts - n_experts // self.group.size) * 8
        if self._reduced and self.mesh.dp * self.mesh.cp > self.mesh.ep:
            found["edp all_reduce"] += self._reduced
        return found
