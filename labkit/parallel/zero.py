"""ZeRO from scratch: shard optimizer states (stage 1) and gradients (stage 2); stage 3 is ``labkit.parallel.fsdp``.

Under data parallelism each of ``N`` ranks holds every *model state*: ``Psi`` weights, ``Psi`` gradients and
``K Psi`` bytes of optimizer state (fp32 Adam: 16 bytes per parameter).  ZeRO (Rajbhandari et al., "ZeRO:
Memory Optimizations Toward Training Trillion Parameter Models", SC 2020) keeps one copy in all, split over
the ranks, stage by stage.  Per rank, fp32 Adam:

==========  ========================  ========================  =====================================
stage       what is sharded           bytes per rank            bytes entering collectives per step
==========  ========================  ========================  =====================================
DDP         nothing                   ``16 Psi``                all-reduce ``4 Psi``
ZeRO-1      optimizer states          ``8 Psi + 8 Psi / N``     DDP's all-reduce + broadcast ``4 Psi``
ZeRO-2      + gradients               ``4 Psi + 12 Psi / N``    reduce-scatter + all-gather ``4 Psi`` each
ZeRO-3      + parameters              ``16 Psi / N``            2 all-gathers + 1 reduce-scatter, ``4 Psi`` each
==========  ========================  ========================  =====================================

A ring all-reduce *is* a reduce-scatter and an all-gather, so ZeRO-2 moves what DDP moves; our ZeRO-1 is
``torch.distributed.optim.ZeroRedundancyOptimizer``'s (DDP's all-reduce, then a broadcast of the updated
parameters).  ``communication_per_step()`` counts the bytes that entered each collective in the last step;
``predicted_communication()`` is the same from the shards, and the tests hold the two equal.

**Layouts.**  Stage 1 gives each rank *whole parameters*, balanced greedily (largest first, to the least loaded
rank), so any optimizer works, also LAMB or Adafactor.  Stage 2 uses ``fully_shard``'s ``FlatShards`` (as
ZeRO-3 does): each parameter is cut along dim 0 into ``N`` chunks of ``ceil(rows / N)`` rows, rank ``r`` steps
its chunk (a *piece*, a view of the parameter's rows; element-wise optimizers only: SGD, Adam, AdamW, ...),
and for one collective per bucket each rank's chunks, padded, lie end to end in a flat shard.

**ZeRO-2 in backward.**  Gradients are bucketed as in DDP.  A post-accumulate-grad hook copies each gradient
into its chunks of the bucket's padded buffer and *drops* ``.grad``; a complete bucket is reduce-scattered
asynchronously, buckets in index order (every rank must issue collectives in the same order), launching one
first waiting for the previous one and freeing its buffer.  Each rank keeps its shard of the sum, divided by
``N`` afterwards (FSDP2's order), as its pieces' ``.grad``.  ``step()`` steps the pieces, then all-gathers each
bucket's shards into every replica.  With gradient sync off the hooks step aside and full ``.grad`` accumulate
on the parameters (as under DDP) until ``reduce_gradients()`` reduce-scatters them.

:class:`ZeroDataParallel` puts either stage behind the contract of ``labkit.parallel.base``: it wraps the module
(through labkit's DDP at stage 1, plain at stage 2) and its ``make_optimizer`` builds the ``ShardedOptimizer``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labkit.dist import global_rank, require_group
from labkit.measure import model_state_bytes
from labkit.parallel.base import (
    ParallelWrapper,
    all_gather_tensor,
    broadcast_from_first_rank,
    by_dtype,
    check_optimizer_class,
    check_same_model,
    queue_end_of_backward,
    reduce_scatter_tensor,
)
from labkit.parallel.ddp import DistributedDataParallel, MiB, assign_buckets
from labkit.parallel.flat_shards import FlatShards, add_shard_gradients


@dataclass
class _GradientBucket:
    """Stage 2: parameters whose gradients are reduce-scattered together, and this pass's progress."""

    parameters: list[nn.Parameter]
    shards: FlatShards
    pieces: list[torch.Tensor | None]  # this rank's rows of each parameter (None: it has none here)
    ready: list[bool] | None = None
    flat: torch.Tensor | None = None  # the padded full gradient buffer while it fills and is reduce-scattered
    shard: torch.Tensor | None = None  # the reduce-scatter's output
    handle: Any = None

    def reset(self) -> None:
        self.ready, self.flat, self.shard, self.handle = [False] * len(self.parameters), None, None, None


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1/2: ``optimizer_cls`` keeping state only for this rank's shard of ``params``; used like the
    optimizer it wraps (``step``, ``zero_grad``, ``param_groups``, LR schedulers)::

        optimizer = ShardedOptimizer(ddp_model.parameters(), torch.optim.AdamW, lr=1e-3)   # stage 1
        optimizer = ShardedOptimizer(plain_model.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)

    ``stage`` 1: whole parameters per rank, the gradients already the mean (DDP's); 2: row shards, the gradients
    reduce-scattered here (``bucket_cap_mb`` MiB per bucket, 0: one per parameter).  ``group``: ``None`` (every
    rank), a ``ProcessGroup`` or a 1-D ``DeviceMesh``.  ``state_dict()`` is *consolidated* (what
    ``optimizer_cls`` over all of ``params`` would return; a collective); ``load_state_dict`` takes such a dict.
    """

    def __init__(self, params: Iterable[Any], optimizer_cls: type[torch.optim.Optimizer], *, stage: int = 1,
                 bucket_cap_mb: float = 25.0, group: Any = None, **optimizer_kwargs: Any):
        _check_arguments(stage, bucket_cap_mb, optimizer_cls)
        self.stage, self.group, self._constructed = stage, require_group(group), False
        super().__init__(params, optimizer_kwargs)
        self.world_size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.all_parameters = [p for group in self.param_groups for p in group["params"]]
        self.require_gradient_sync = True  # stage 2, False: backward passes leave full .grad accumulating
        self._traffic, self._step_finished = Counter(), False  # bytes entering each collective in this step
        check_same_model([(str(index), p) for index, p in enumerate(self.all_parameters)], self.group)
        broadcast_from_first_rank(self.all_parameters, self.group)
        index_of = {id(p): index for index, p in enumerate(self.all_parameters)}
        self.piece_of: dict[int, torch.Tensor] = {}  # id(parameter) -> what this rank steps of it
        self._origin: dict[int, tuple[int, int]] = {}  # id(that) -> (parameter index, its first element)
        if stage == 1:
            owner = _partition_by_size(self.param_groups, self.world_size)
            self.owned = [[p for p in self.all_parameters if owner[id(p)] == rank and p.requires_grad]
                          for rank in range(self.world_size)]
            self.piece_of = {id(p): p for p in self.owned[self.rank]}
            self._origin = {id(p): (index_of[id(p)], 0) for p in self.all_parameters}
        else:
            self._buckets = self._make_buckets(bucket_cap_mb)
            for bucket in self._buckets:
                for index, (p, piece) in enumerate(zip(bucket.parameters, bucket.pieces, strict=True)):
                    if piece is not None:
                        first = bucket.shards.local_rows(index)[0] * bucket.shards.row_numel[index]
                        self.piece_of[id(p)], self._origin[id(piece)] = piece, (index_of[id(p)], first)
            self._pass_started, self._next_bucket = False, 0
        self.local_optimizer = optimizer_cls(
            [{**_hyperparameters(group), "params": [self.piece_of[id(p)] for p in group["params"]
                                                     if id(p) in self.piece_of]} for group in self.param_groups],
            **optimizer_kwargs)
        for group, local in zip(self.param_groups, self.local_optimizer.param_groups, strict=True):
            for key, value in _hyperparameters(local).items():
                group.setdefault(key, value)  # so param_groups show optimizer_cls's defaults too
        self._constructed = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._constructed:
            raise NotImplementedError("ShardedOptimizer partitions its parameters at construction: build another")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Step this rank's shard (hyperparameters taken from ``param_groups``), then share the new values."""
        for group, local in zip(self.param_groups, self.local_optimizer.param_groups, strict=True):
            local.update(_hyperparameters(group))  # an LR scheduler changed param_groups, not the local ones
        loss = self.local_optimizer.step(closure) if closure is not None else self.local_optimizer.step()
        if self.stage == 1:  # each rank broadcasts what it updated, one message per (owner, dtype)
            for owner, owned in enumerate(self.owned):
                for same_dtype in by_dtype(owned):
                    shards = FlatShards([p.shape for p in same_dtype], 1, 0)  # over one rank: concatenation
                    flat = same_dtype[0].new_empty(shards.padded_numel)
                    if owner == self.rank:
                        shards.pack(same_dtype, flat)
                    self._count("broadcast", flat)
                    dist.broadcast(flat, src=global_rank(self.group, owner), group=self.group)
                    if owner != self.rank:
                        shards.unpack(flat, same_dtype)
        else:  # every rank's updated shard of every bucket, to everyone
            for bucket in self._buckets:
                full = bucket.parameters[0].new_empty(bucket.shards.padded_numel)
                self._count("all_gather", full)
                all_gather_tensor(full, bucket.shards.pack_shard(bucket.parameters), group=self.group)
                bucket.shards.unpack(full, bucket.parameters)
        self._step_finished = True
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)  # the full parameters
        self.local_optimizer.zero_grad(set_to_none)  # stage 2's pieces

    def _count(self, kind: str, tensor: torch.Tensor) -> None:
        self._start_step()
        self._traffic[kind] += tensor.numel() * tensor.element_size()

    def _start_step(self) -> None:
        """The first communication (or, under ZeroDataParallel, forward) after a ``step()`` begins the next."""
        if self._step_finished:
            self._traffic.clear()
            self._step_finished = False

    def _make_buckets(self, bucket_cap_mb: float) -> list[_GradientBucket]:
        trainable = [(str(index), p) for index, p in enumerate(self.all_parameters) if p.requires_grad]
        if not trainable:
            raise ValueError("stage 2 got no parameter that requires a gradient: there is nothing to reduce")
        if any(not p.is_contiguous() for _, p in trainable):
            raise ValueError("stage 2 steps views of the parameters' rows and needs them contiguous")
        buckets = []
        for positions in assign_buckets(trainable, int(bucket_cap_mb * MiB)):
            parameters = [trainable[position][1] for position in positions]
            shards = FlatShards([p.shape for p in parameters], self.world_size, self.rank)
            pieces = shards.pieces_of([p.detach() for p in parameters])
            buckets.append(_GradientBucket(parameters, shards, [piece if piece.numel() else None for piece in pieces]))
            buckets[-1].reset()
            for position, p in enumerate(parameters):
                p.register_post_accumulate_grad_hook(partial(self._on_gradient_ready, buckets[-1], position))
        return buckets

    def _on_gradient_ready(self, bucket: _GradientBucket, position: int, param: torch.Tensor) -> None:
        if not self.require_gradient_sync:
            return  # autograd has accumulated into param.grad: reduce_gradients() sends it
        if not self._pass_started:
            self._pass_started = True
            queue_end_of_backward(self._finish_gradient_reduction)
        if bucket.flat is None:
            bucket.flat = param.new_zeros(bucket.shards.padded_numel)
        with torch.no_grad():
            bucket.shards.copy_in(position, param.grad, bucket.flat)
        param.grad = None  # the full gradient is not kept: that is stage 2's saving
        bucket.ready[position] = True
        while self._next_bucket < len(self._buckets) and all(self._buckets[self._next_bucket].ready):
            self._launch(self._next_bucket)
            self._next_bucket += 1

    def _launch(self, index: int) -> None:
        if index > 0:
            self._deliver(self._buckets[index - 1])  # and free its buffer
        bucket = self._buckets[index]
        if bucket.flat is None:  # no gradient arrived in this pass: contribute zeros
            bucket.flat = bucket.parameters[0].new_zeros(bucket.shards.padded_numel)
        bucket.shard = bucket.flat.new_empty(bucket.shards.shard_numel)
        self._count("reduce_scatter", bucket.flat)
        bucket.handle = reduce_scatter_tensor(bucket.shard, bucket.flat, group=self.group, async_op=True)

    def _deliver(self, bucket: _GradientBucket) -> None:
        """Wait for a bucket's reduce-scatter; its shard becomes (or is added to) the pieces' gradients."""
        if bucket.handle is not None:
            bucket.handle.wait()
            add_shard_gradients(bucket.shard.div_(self.world_size), bucket.pieces, bucket.shards)
            bucket.flat, bucket.handle = None, None

    def _finish_gradient_reduction(self) -> None:
        try:
            while self._next_bucket < len(self._buckets):
                self._launch(self._next_bucket)
                self._next_bucket += 1
            self._deliver(self._buckets[-1])
        finally:
            self._pass_started, self._next_bucket = False, 0
            for bucket in self._buckets:
                bucket.reset()

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Stage 2: reduce-scatter the full ``.grad`` that backward passes with sync off left on the parameters
        into the pieces' ``.grad`` (the mean over ranks) and drop them.  A collective: call it on every rank."""
        if self.stage != 2 or self._pass_started:
            raise RuntimeError("ShardedOptimizer.reduce_gradients() is stage 2's, after backward passes with "
                               f"sync off (stage {self.stage}; stage 1 leaves the gradients to DDP)")
        if all(p.grad is None for bucket in self._buckets for p in bucket.parameters):
            return  # nothing was accumulated (every rank ran the same backward passes)
        for bucket in self._buckets:
            bucket.flat = bucket.shards.pack([p.grad for p in bucket.parameters],
                                             bucket.parameters[0].new_empty(bucket.shards.padded_numel))
            for p in bucket.parameters:
                p.grad = None
        self._finish_gradient_reduction()

    def state_dict(self) -> dict[str, Any]:
        """The state ``optimizer_cls`` over all parameters would have (tensors on the CPU), on every rank."""
        mine: dict[int, tuple[int, dict[str, Any]]] = {}  # parameter index -> (first element, its state here)
        for tensor, state in self.local_optimizer.state.items():
            index, begin = self._origin[id(tensor)]
            mine[index] = (begin, {key: value.detach().cpu() if torch.is_tensor(value) else value
                                   for key, value in state.items()})
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.group)
        state = {}
        for index, p in enumerate(self.all_parameters):
            parts = sorted((part[index] for part in everyone if index in part), key=lambda part: part[0])
            if parts:  # stage 2: pieces are rows, in rank order
                state[index] = {key: torch.cat([entry[key] for _, entry in parts]).view(p.shape)
                                if self.stage == 2 and torch.is_tensor(value) and value.dim() else value
                                for key, value in parts[0][1].items()}
        sizes = [len(group["params"]) for group in self.param_groups]
        return {"state": state, "param_groups": [{**_hyperparameters(group), "params": list(range(
            sum(sizes[:index]), sum(sizes[:index + 1])))} for index, group in enumerate(self.param_groups)]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a consolidated state dict (from :meth:`state_dict` or a plain ``optimizer_cls``)."""
        saved_groups = state_dict["param_groups"]
        if [len(group["params"]) for group in saved_groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("the state dict's parameter groups do not match this optimizer's in number or size")
        local_state, local_groups, position = {}, [], 0
        for group, saved, local in zip(self.param_groups, saved_groups, self.local_optimizer.param_groups,
                                       strict=True):
            group.update(_hyperparameters(saved))
            local_groups.append({**_hyperparameters(saved), "params": []})
            for tensor in local["params"]:
                index, begin = self._origin[id(tensor)]
                saved_state = state_dict["state"].get(index, state_dict["state"].get(str(index)))
                if saved_state is not None:  # copies: the caller's tensors must not step with ours
                    local_state[position] = {key: (value.reshape(-1)[begin:begin + tensor.numel()].view(
                        tensor.shape) if value.shape == self.all_parameters[index].shape else value).clone()
                        if torch.is_tensor(value) else value for key, value in saved_state.items()}
                local_groups[-1]["params"].append(position)
                position += 1
        self.local_optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds, measured: ``labkit.measure.model_state_bytes`` of the full parameters and
        this rank's optimizer (stage 2's pieces are views of the parameters, so count nothing more)."""
        return model_state_bytes(nn.ParameterList(self.all_parameters), self.local_optimizer)

    def communication_per_step(self) -> dict[str, int]:
        """Bytes that entered each collective in the last step, measured (stage 1 leaves the all-reduce to DDP)."""
        return dict(self._traffic)

    def predicted_communication(self) -> dict[str, int]:
        """The same, from the shards: stage 1 broadcasts every trainable parameter once; stage 2
        reduce-scatters and all-gathers every bucket's padded buffer once."""
        if self.stage == 1:
            return {"broadcast": sum(p.numel() * p.element_size() for p in self.all_parameters if p.requires_grad)}
        volume = sum(b.shards.padded_numel * b.parameters[0].element_size() for b in self._buckets)
        return {"reduce_scatter": volume, "all_gather": volume}


class ZeroDataParallel(ParallelWrapper):
    """ZeRO-1 or ZeRO-2 behind the contract: the module replicated (run through labkit's DDP at stage 1, plain
    at stage 2), the optimizer states (and at stage 2 the gradients) sharded by the :class:`ShardedOptimizer`
    that :meth:`make_optimizer` builds; calls that need it raise ``RuntimeError`` before it exists.
    ``gradients()`` are the full mean (stage 1) or this rank's pieces (stage 2)."""

    def __init__(self, module: nn.Module, stage: int = 1, bucket_cap_mb: float = 25.0, group: Any = None):
        _check_arguments(stage, bucket_cap_mb)
        super().__init__(module, group)
        self.stage, self.bucket_cap_mb = stage, float(bucket_cap_mb)
        # Not registered as a submodule: it wraps the same module, which state_dict() would then list twice.
        ddp = DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb, group=self.group) if stage == 1 else None
        object.__setattr__(self, "ddp", ddp)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._start_forward()
        if self.optimizer is not None:
            self.optimizer._start_step()
        return (self.ddp if self.ddp is not None else self.module)(*args, **kwargs)

    def make_optimizer(self, optimizer_cls: type[torch.optim.Optimizer], params: Iterable[Any] | None = None,
                       **kwargs: Any) -> ShardedOptimizer:
        """A :class:`ShardedOptimizer` of this stage over ``params`` (the module's parameters or groups of them;
        default: all).  It registers stage 2's reduction hooks: build it once."""
        if self.optimizer is not None:
            raise RuntimeError("make_optimizer() was already called (a second optimizer would hook in twice)")
        params = [dict(entry, params=list(entry["params"])) if isinstance(entry, dict) else entry
                  for entry in (self.module.parameters() if params is None else params)]
        chosen = {id(p) for entry in params for p in (entry["params"] if isinstance(entry, dict) else [entry])}
        if not chosen <= {id(p) for p in self.module.parameters()}:
            raise ValueError("params must be the module's parameters (or groups of them); got another tensor")
        self.optimizer = ShardedOptimizer(params, optimizer_cls, stage=self.stage,
                                          bucket_cap_mb=self.bucket_cap_mb, group=self.group, **kwargs)
        self.optimizer.require_gradient_sync = self.require_gradient_sync
        return self.optimizer

    def _sharded_optimizer(self) -> ShardedOptimizer:
        if self.optimizer is None:
            raise RuntimeError("call make_optimizer(optimizer_cls, ...) first: its ShardedOptimizer holds the shard")
        return self.optimizer

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        super().set_requires_gradient_sync(requires_gradient_sync)
        if self.ddp is not None:
            self.ddp.set_requires_gradient_sync(requires_gradient_sync)
        if self.optimizer is not None:
            self.optimizer.require_gradient_sync = requires_gradient_sync

    def reduce_gradients(self) -> None:
        (self.ddp if self.ddp is not None else self._sharded_optimizer()).reduce_gradients()
        self._reduction_done()

    def gradients(self) -> dict[str, torch.Tensor | None]:
        if self.stage == 1:
            return super().gradients()
        pieces = self._sharded_optimizer().piece_of
        return {name: pieces[id(p)].grad if id(p) in pieces else None for name, p in self.module.named_parameters()}

    def _sharded(self) -> bool:
        return self.stage == 2

    def communication_per_step(self) -> dict[str, int]:
        """Bytes that entered each collective in the last step: DDP's (stage 1) and the optimizer's."""
        found = Counter(self.ddp.communication_per_step() if self.ddp is not None else {})
        return dict(found + Counter(self.optimizer.communication_per_step() if self.optimizer is not None else {}))

    def predicted_communication(self) -> dict[str, int]:
        found = Counter(self.ddp.predicted_communication() if self.ddp is not None else {})
        return dict(found + Counter(self._sharded_optimizer().predicted_communication()))

    def memory_breakdown(self, optimizer: ShardedOptimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds, measured by the optimizer (default: the one :meth:`make_optimizer` built)."""
        return (optimizer if optimizer is not None else self._sharded_optimizer()).memory_breakdown()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.module.state_dict()  # the weights are replicated: nothing to communicate


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != "params"}


def _partition_by_size(param_groups: list[dict[str, Any]], world_size: int) -> dict[int, int]:
    """``id(parameter) -> rank``: within each group largest first, each to the rank with the fewest elements."""
    load, owner = [0] * world_size, {}
    for group in param_groups:
        for p in sorted(group["params"], key=lambda t: t.numel(), reverse=True):
            rank = load.index(min(load))
            owner[id(p)], load[rank] = rank, load[rank] + p.numel()
    return owner


def _check_arguments(stage: Any, bucket_cap_mb: Any, optimizer_cls: Any = None) -> None:
    if optimizer_cls is not None:
        check_optimizer_class(optimizer_cls)
        if issubclass(optimizer_cls, ShardedOptimizer):
            raise TypeError("optimizer_cls cannot be ShardedOptimizer itself")
    if stage not in (1, 2) or isinstance(stage, bool):
        raise ValueError(f"stage must be 1 (optimizer states) or 2 (and gradients), got {stage!r}; for stage 3 "
                         "wrap the model in FullyShardedDataParallel")
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or \
            not 0 <= bucket_cap_mb < math.inf:
        raise ValueError(f"bucket_cap_mb must be a finite number >= 0 (MiB per bucket), got {bucket_cap_mb!r}")
