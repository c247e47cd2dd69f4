"""ZeRO from scratch: shard optimizer states (stage 1), gradients (stage 2) and parameters (stage 3).

**The redundancy.**  Under data parallelism each of ``N`` ranks holds every *model state*: ``Psi`` weights,
``Psi`` gradients and ``K Psi`` bytes of optimizer state (fp32 Adam: ``4 + 4 + 8 = 16`` bytes per parameter,
``labkit.memory``).  ZeRO (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020) keeps one copy in all, split over the ranks, stage by stage.  Per rank, fp32 Adam:

==========  ========================  ========================  =====================================
stage       what is sharded           bytes per rank            bytes entering collectives per step
==========  ========================  ========================  =====================================
DDP         nothing                   ``16 Psi``                all-reduce ``4 Psi``
ZeRO-1      optimizer states          ``8 Psi + 8 Psi / N``     DDP's all-reduce + broadcast ``4 Psi``
ZeRO-2      + gradients               ``4 Psi + 12 Psi / N``    reduce-scatter + all-gather ``4 Psi`` each
ZeRO-3      + parameters              ``16 Psi / N``            2 all-gathers + 1 reduce-scatter, ``4 Psi`` each
==========  ========================  ========================  =====================================

On a ring, a reduce-scatter or an all-gather of ``n`` bytes puts ``(N-1)/N n`` on each rank's link and an
all-reduce ``2 (N-1)/N n`` (it *is* a reduce-scatter followed by an all-gather).  So ZeRO-2 moves exactly what
DDP moves: each rank only needs the mean gradient of the shard it updates (reduce-scatter), updates it, and
hands the new values round (all-gather).  ZeRO-3 must also gather each layer's parameters before its forward
and again before its backward, having freed them in between: 1.5 times DDP's traffic.  Our ZeRO-1 follows
``torch.distributed.optim.ZeroRedundancyOptimizer``: it sits on top of DDP's all-reduce and adds a broadcast
of the updated parameters, ``Psi`` bytes more than the paper's ZeRO-1 (which is ZeRO-2's communication with
full gradients kept).  ``bytes_communicated`` counts what actually entered each collective (the full size:
a reduce-scatter's input, an all-gather's output, a broadcast's message); ``communication_per_step()`` is
the same figure from the layout, for a notebook to put the two side by side.

**Two shard layouts.**  :class:`ShardedOptimizer` stage 1 gives each rank *whole parameters*, balanced by size
greedily (largest first, to the rank holding the fewest elements so far: ``ZeroRedundancyOptimizer``'s rule).
Each rank runs ``optimizer_cls`` on its own parameters, so *any* optimizer works, also ones that look at a
whole tensor (LAMB's trust ratio, Adafactor's factored moments); the price is balance only to within one
parameter.  Stages 2 and 3 use a *flat* layout (DeepSpeed's and FSDP1's): the parameters of a bucket or unit
are laid end to end, zero-padded to a multiple of ``N`` and cut into ``N`` equal contiguous shards, so a
parameter may straddle two ranks.  Shards are exactly ``ceil(n/N)`` elements, which
``reduce_scatter_tensor``/``all_gather_into_tensor`` need (equal chunks; ``labkit.collectives.chunk_bounds``'
uneven chunks would not do).  Each rank's optimizer then steps *pieces* of parameters (1-D views), which gives
the unsharded result only for element-wise optimizers: SGD, momentum, Adam, AdamW, RMSprop, Adagrad.
Clipping by the global gradient norm would need an all-reduce of the pieces' squared norms (not provided).

**ZeRO-2 in backward** (``ShardedOptimizer(..., stage=2)``).  Gradients are bucketed as in ``labkit.ddp``
(``assign_buckets``: last parameter first, ``bucket_cap_mb``).  A ``register_post_accumulate_grad_hook``
copies each gradient into its bucket's flat buffer and then *drops* ``.grad``: the full gradient lives only
until it is copied.  A complete bucket is reduce-scattered asynchronously while autograd
works on, buckets strictly in index order (every rank must issue collectives in the same order).  Launching
a bucket first waits for the previous one and frees its buffer, so when gradients arrive in bucket order only
the bucket filling and the one in flight hold full-size buffers.  Each rank keeps the result, its shard of the summed gradient (``ceil(n/N)`` elements per bucket),
divided by ``N`` into the mean, as the ``.grad`` of its pieces.  (Both stages divide after the reduce-scatter,
on the ``1/N`` kept, as FSDP2 does in fp32 and bf16; ``labkit.ddp`` divides while copying in instead.  With
``N = 3`` the two orders round differently, and bf16 compute turns that last-bit difference into a visible
one.)  A callback queued on the autograd engine launches what is left at the end of
backward (parameters that got no gradient contribute zeros).  ``step()`` runs the optimizer on the pieces,
which are views into the parameters, then all-gathers each bucket's updated shards into every replica.
Stage 2 does its own reduction: use it *instead of* DDP, on a plain model.  Gradient accumulation (several
backward passes per step) adds into the shards; there is no ``no_sync``, which would need full gradients.

**ZeRO-3** (:class:`FullyShardedDataParallel`, FSDP; Zhao et al., "PyTorch FSDP", VLDB 2023).  The model is
cut into *units*: by default each child of a ``ModuleList``/``Sequential`` called ``blocks`` or ``layers``
(one transformer block each), or the modules passed as ``units``; the *root* unit holds every other parameter,
and any parameter shared by two units (a tied embedding and LM head).  Outside forward and backward each rank
holds only its flat shard of every unit: the module's parameters *are* the pieces, 1-D, so an optimizer built
on ``fsdp.parameters()`` updates shards and keeps ``1/N`` of the state.  Hooks do the rest:

- *before a unit's forward*: all-gather its shards into a full flat buffer, put the full parameters (views of
  that buffer) into the modules, and start the all-gather of the *next* unit (prefetch), so communication
  overlaps this unit's compute;
- *after its forward*: put the pieces back and free the full buffer (``untyped_storage().resize_(0)``; the
  tensors autograd saved keep their shape but hold no memory);
- *before its backward* (a hook on the unit's outputs): re-allocate and all-gather again, into the same
  storage, so what autograd saved is valid again; prefetch the unit whose backward comes next;
- *after its backward* (the backward of an identity ``autograd.Function`` applied to the unit's inputs: it
  runs once the unit's nodes are done, and autograd accumulates a leaf's gradient before running any node
  created earlier in the forward pass): reduce-scatter its gradients into each rank's shard and free the full
  parameters and gradients.  Units whose inputs need no gradient, and the root, do this in the callback
  that ends the backward pass.

The root unit is gathered once per step and kept until the end of backward (it is used first in forward and
last in backward).  Per rank this holds ``Psi/N`` of every model state plus, transiently, the full parameters
of the root and of about two units.  With ``compute_dtype`` (e.g. ``torch.bfloat16``) shards stay fp32
*master* weights and are cast down before the all-gather (half the bytes); floating inputs are cast too;
gradients are reduce-scattered in ``reduce_dtype`` (default: the shards' dtype), so the optimizer sees fp32.
All ranks must run the same units in the same order, each unit once per forward and one forward per
backward (activation checkpointing inside a unit would re-run its hooks: not supported).  Buffers (BatchNorm
statistics) stay replicated and are not synchronised after construction.  Rank 0's parameters and buffers
are broadcast at construction, as DDP does, by all three stages.
"""

from __future__ import annotations

import math
import zlib
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labkit.ddp import MiB, assign_buckets
from labkit.memory import model_state_bytes, storage_bytes

# torch 2.14 renamed the flat collectives (the old names still work, with a warning); we support torch >= 2.4.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# --------------------------------------------------------------------------------------------------------
# The flat layout of stages 2 and 3


@dataclass
class FlatLayout:
    """Tensors of ``numels`` elements laid end to end, padded to ``world_size * shard_numel``, cut into equal
    contiguous shards; rank ``r`` holds flat elements ``[r * shard_numel, (r + 1) * shard_numel)``."""

    numels: list[int]
    world_size: int
    rank: int
    offsets: list[int] = field(init=False)  # where each tensor starts in the flat vector
    shard_numel: int = field(init=False)

    def __post_init__(self) -> None:
        self.offsets = [sum(self.numels[:index]) for index in range(len(self.numels))]
        self.shard_numel = max(1, math.ceil(sum(self.numels) / self.world_size))

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    def pieces(self) -> list[tuple[int, int, int]]:
        """Per tensor, ``(begin, end, shard_offset)``: its flattened elements ``[begin, end)`` are at
        ``shard[shard_offset:shard_offset + end - begin]`` on this rank (``begin == end``: none are)."""
        first, last = self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel
        pieces = []
        for offset, numel in zip(self.offsets, self.numels, strict=True):
            begin, end = min(max(first - offset, 0), numel), min(max(last - offset, 0), numel)
            pieces.append((begin, end, offset + begin - first if end > begin else 0))
        return pieces

    def pack(self, tensors: list[torch.Tensor | None], out: torch.Tensor) -> torch.Tensor:
        """Write ``tensors`` (``None``: zeros) into the full flat buffer ``out``, converting the dtype."""
        out.zero_()
        for tensor, offset, numel in zip(tensors, self.offsets, self.numels, strict=True):
            if tensor is not None:
                out[offset:offset + numel].copy_(tensor.reshape(-1))
        return out

    def unpack(self, flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        """Copy the full flat buffer ``flat`` back into ``tensors``."""
        for tensor, offset, numel in zip(tensors, self.offsets, self.numels, strict=True):
            tensor.copy_(flat[offset:offset + numel].view(tensor.shape))

    def pack_shard(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """This rank's shard of ``tensors``, zero-padded to ``shard_numel``."""
        shard = tensors[0].new_zeros(self.shard_numel)
        for tensor, (begin, end, at) in zip(tensors, self.pieces(), strict=True):
            shard[at:at + end - begin] = tensor.reshape(-1)[begin:end]
        return shard


def _count(counter: Counter, kind: str, tensor: torch.Tensor) -> None:
    counter[kind] += tensor.numel() * tensor.element_size()


# --------------------------------------------------------------------------------------------------------
# ZeRO-1 and ZeRO-2: the optimizer


@dataclass
class _GradientBucket:
    """Stage 2: parameters whose gradients are reduce-scattered together, and this pass's progress."""

    parameters: list[nn.Parameter]
    layout: FlatLayout
    pieces: list[torch.Tensor | None]  # this rank's 1-D view of each parameter (None: it has no elements here)
    ready: list[bool] = field(default_factory=list)
    flat: torch.Tensor | None = None  # the full-size gradient buffer while it fills and is reduce-scattered
    shard: torch.Tensor | None = None  # the reduce-scatter's output
    handle: Any = None

    def reset(self) -> None:
        self.ready, self.flat, self.shard, self.handle = [False] * len(self.parameters), None, None, None


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1/2: wrap ``optimizer_cls`` so each rank keeps optimizer state for its shard of ``params`` only.

    Use like the optimizer it wraps (``step``, ``zero_grad``, ``param_groups``, LR schedulers)::

        model = DistributedDataParallel(model)                               # stage 1: DDP averages
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
        # or, on the plain model, without DDP: stage 2 reduce-scatters the gradients itself
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)

    Args:
        params: tensors or parameter-group dicts, as for any optimizer.
        optimizer_cls: a ``torch.optim.Optimizer`` subclass (element-wise for stage 2; see the module docstring).
        stage: 1 (whole parameters per rank; gradients must already be the same on every rank, by DDP or by
            each rank computing them on the same data) or 2 (flat shards; gradients reduce-scattered here).
        bucket_cap_mb: stage 2's bucket size in MiB (0: one bucket per parameter).
        process_group: the ranks to shard over (default: every rank).
        **optimizer_kwargs: passed to ``optimizer_cls``.

    ``state_dict()`` is *consolidated* (as ``optimizer_cls`` over all of ``params`` would return it) and is a
    collective: call it on every rank.  ``load_state_dict`` takes such a dict and keeps this rank's shard.
    """

    def __init__(self, params: Iterable[Any], optimizer_cls: type[torch.optim.Optimizer], *, stage: int = 1,
                 bucket_cap_mb: float = 25.0, process_group: dist.ProcessGroup | None = None,
                 **optimizer_kwargs: Any):
        _check_optimizer_arguments(optimizer_cls, stage, bucket_cap_mb, process_group)
        self._constructed = False
        super().__init__(params, optimizer_kwargs)
        self.stage, self.process_group = stage, process_group
        self.world_size, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        self.all_parameters = [p for group in self.param_groups for p in group["params"]]
        self.bytes_communicated: Counter = Counter()
        _check_same_everywhere([(str(index), p) for index, p in enumerate(self.all_parameters)], process_group)
        _broadcast_from_first_rank(self.all_parameters, process_group)
        index_of = {id(p): index for index, p in enumerate(self.all_parameters)}
        # Each local tensor's origin: (index of its parameter, first element), for the consolidated state dict.
        if stage == 1:
            self.owner = _partition_by_size(self.param_groups, self.world_size)
            local_groups = [[p for p in group["params"] if self.owner[id(p)] == self.rank]
                            for group in self.param_groups]
            self._origin = {id(p): (index_of[id(p)], 0) for p in self.all_parameters}
        else:
            self._buckets = self._make_buckets(bucket_cap_mb)
            piece_of, self._origin = {}, {}
            for bucket in self._buckets:
                for p, piece, (begin, _, _) in zip(bucket.parameters, bucket.pieces, bucket.layout.pieces(),
                                                   strict=True):
                    if piece is not None:
                        piece_of[id(p)], self._origin[id(piece)] = piece, (index_of[id(p)], begin)
            local_groups = [[piece_of[id(p)] for p in group["params"] if id(p) in piece_of]
                            for group in self.param_groups]
            self._pass_started, self._next_bucket = False, 0
        self.local_optimizer = optimizer_cls(
            [{**_hyperparameters(group), "params": params}
             for group, params in zip(self.param_groups, local_groups, strict=True)], **optimizer_kwargs)
        for group, local in zip(self.param_groups, self.local_optimizer.param_groups, strict=True):
            for key, value in _hyperparameters(local).items():
                group.setdefault(key, value)  # so param_groups show optimizer_cls's defaults too
        self._constructed = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._constructed:
            raise NotImplementedError("ShardedOptimizer partitions its parameters once, at construction; build "
                                      "a new one to add a parameter group")
        super().add_param_group(param_group)

    # ----------------------------------------------------------------------------------------------------
    # Stepping

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Step this rank's shard (hyperparameters taken from ``param_groups``), then share the new values."""
        for group, local in zip(self.param_groups, self.local_optimizer.param_groups, strict=True):
            local.update(_hyperparameters(group))  # an LR scheduler changed param_groups, not the local ones
        loss = self.local_optimizer.step(closure) if closure is not None else self.local_optimizer.step()
        if self.stage == 1:
            self._broadcast_updated_parameters()
        else:
            self._all_gather_updated_parameters()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)  # the full parameters
        self.local_optimizer.zero_grad(set_to_none)  # stage 2's pieces

    def _broadcast_updated_parameters(self) -> None:
        """Stage 1: each rank broadcasts the parameters it updated, one message per (owner, dtype)."""
        for owner in range(self.world_size):
            owned = [p for p in self.all_parameters if self.owner[id(p)] == owner and p.requires_grad]
            for same_dtype in _by_dtype(owned):
                layout = FlatLayout([p.numel() for p in same_dtype], 1, 0)
                flat = same_dtype[0].new_empty(layout.padded_numel)
                if owner == self.rank:
                    layout.pack(same_dtype, flat)
                _count(self.bytes_communicated, "broadcast", flat)
                dist.broadcast(flat, src=_global_rank(self.process_group, owner), group=self.process_group)
                if owner != self.rank:
                    layout.unpack(flat, same_dtype)

    def _all_gather_updated_parameters(self) -> None:
        """Stage 2: every rank's updated shard of every bucket, to everyone."""
        for bucket in self._buckets:
            full = bucket.parameters[0].new_empty(bucket.layout.padded_numel)
            _count(self.bytes_communicated, "all_gather", full)
            _all_gather(full, bucket.layout.pack_shard(bucket.parameters), group=self.process_group)
            bucket.layout.unpack(full, bucket.parameters)

    # ----------------------------------------------------------------------------------------------------
    # Stage 2: reduce-scatter during backward

    def _make_buckets(self, bucket_cap_mb: float) -> list[_GradientBucket]:
        trainable = [(str(index), p) for index, p in enumerate(self.all_parameters) if p.requires_grad]
        if not trainable:
            raise ValueError("stage 2 got no parameter that requires a gradient: there is nothing to reduce")
        if any(not p.is_contiguous() for _, p in trainable):
            raise ValueError("stage 2 steps views of the parameters and needs them contiguous")
        buckets = []
        for positions in assign_buckets(trainable, int(bucket_cap_mb * MiB)):
            parameters = [trainable[position][1] for position in positions]
            layout = FlatLayout([p.numel() for p in parameters], self.world_size, self.rank)
            pieces = [p.detach().view(-1)[begin:end] if end > begin else None
                      for p, (begin, end, _) in zip(parameters, layout.pieces(), strict=True)]
            bucket = _GradientBucket(parameters, layout, pieces)
            bucket.reset()
            buckets.append(bucket)
            for position, p in enumerate(parameters):
                p.register_post_accumulate_grad_hook(partial(self._on_gradient_ready, bucket, position))
        return buckets

    def _on_gradient_ready(self, bucket: _GradientBucket, position: int, param: torch.Tensor) -> None:
        if not self._pass_started:
            self._pass_started = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_gradient_reduction)
        if bucket.flat is None:
            bucket.flat = param.new_zeros(bucket.layout.padded_numel)
        offset, numel = bucket.layout.offsets[position], bucket.layout.numels[position]
        with torch.no_grad():
            bucket.flat[offset:offset + numel].copy_(param.grad.reshape(-1))
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
            bucket.flat = bucket.parameters[0].new_zeros(bucket.layout.padded_numel)
        bucket.shard = bucket.flat.new_empty(bucket.layout.shard_numel)
        _count(self.bytes_communicated, "reduce_scatter", bucket.flat)
        bucket.handle = _reduce_scatter(bucket.shard, bucket.flat, group=self.process_group, async_op=True)

    def _deliver(self, bucket: _GradientBucket) -> None:
        """Wait for a bucket's reduce-scatter; its shard becomes (or is added to) the pieces' gradients."""
        if bucket.handle is None:
            return
        bucket.handle.wait()
        _add_shard_gradients(bucket.shard.div_(self.world_size), bucket.pieces, bucket.layout)
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

    # ----------------------------------------------------------------------------------------------------
    # Consolidated state dict

    def state_dict(self) -> dict[str, Any]:
        """The state ``optimizer_cls`` over all parameters would have (tensors on the CPU), on every rank."""
        mine: dict[int, tuple[int, dict[str, Any]]] = {}  # parameter index -> (first element, its state here)
        for local in self.local_optimizer.param_groups:
            for tensor in local["params"]:
                if tensor in self.local_optimizer.state:
                    index, begin = self._origin[id(tensor)]
                    mine[index] = (begin, {key: value.detach().cpu() if torch.is_tensor(value) else value
                                           for key, value in self.local_optimizer.state[tensor].items()})
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.process_group)
        state = {}
        for index, p in enumerate(self.all_parameters):
            parts = sorted(part[index] for part in everyone if index in part)
            if parts:
                state[index] = {key: torch.cat([entry[key] for _, entry in parts]).view(p.shape)
                                if _is_elementwise(value) and self.stage == 2 else value
                                for key, value in parts[0][1].items()}
        groups, start = [], 0
        for group in self.param_groups:
            groups.append({**_hyperparameters(group), "params": list(range(start, start + len(group["params"])))})
            start += len(group["params"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a consolidated state dict (from :meth:`state_dict` or a plain ``optimizer_cls``)."""
        saved_groups = state_dict["param_groups"]
        if [len(group["params"]) for group in saved_groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("the state dict's parameter groups do not match this optimizer's in number or size")
        local_state, local_groups, local_index = {}, [], 0
        for group, saved, local in zip(self.param_groups, saved_groups, self.local_optimizer.param_groups,
                                       strict=True):
            group.update(_hyperparameters(saved))
            local_groups.append({**_hyperparameters(saved), "params": []})
            for tensor in local["params"]:
                index, begin = self._origin[id(tensor)]
                saved_state = state_dict["state"].get(index, state_dict["state"].get(str(index)))
                shape = self.all_parameters[index].shape
                if saved_state is not None:
                    local_state[local_index] = {  # copies: the caller's tensors must not step with ours
                        key: (value.reshape(-1)[begin:begin + tensor.numel()] if self.stage == 2
                              and value.shape == shape else value).clone() if torch.is_tensor(value) else value
                        for key, value in saved_state.items()}
                local_groups[-1]["params"].append(local_index)
                local_index += 1
        self.local_optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})

    # ----------------------------------------------------------------------------------------------------
    # What a lesson shows

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds, measured (``labkit.memory.model_state_bytes``' keys)."""
        seen: set[int] = set()
        local = [t for group in self.local_optimizer.param_groups for t in group["params"]]
        weights = storage_bytes(self.all_parameters, seen)
        storage_bytes(local, seen)  # stage 2's pieces are views of the parameters
        gradients = storage_bytes([t.grad for t in self.all_parameters + local if t.grad is not None], seen)
        states = other = 0
        for tensor in local:
            for value in self.local_optimizer.state.get(tensor, {}).values():
                if torch.is_tensor(value) and value.shape == tensor.shape:
                    states += storage_bytes([value], seen)
                elif torch.is_tensor(value):
                    other += storage_bytes([value], seen)
        return {"weights": weights, "gradients": gradients, "optimizer_states": states, "optimizer_other": other}

    def communication_per_step(self) -> dict[str, int]:
        """Bytes entering each collective per step, from the layout (stage 1 leaves the all-reduce to DDP)."""
        if self.stage == 1:
            return {"broadcast": sum(p.numel() * p.element_size() for p in self.all_parameters if p.requires_grad)}
        volume = sum(b.layout.padded_numel * b.parameters[0].element_size() for b in self._buckets)
        return {"reduce_scatter": volume, "all_gather": volume}


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != "params"}


def _is_elementwise(value: Any) -> bool:
    return torch.is_tensor(value) and value.dim() >= 1


def _partition_by_size(param_groups: list[dict[str, Any]], world_size: int) -> dict[int, int]:
    """``id(parameter) -> rank``: within each group largest first, each to the rank with the fewest elements."""
    load, owner = [0] * world_size, {}
    for group in param_groups:
        for p in sorted(group["params"], key=lambda t: t.numel(), reverse=True):
            rank = load.index(min(load))
            owner[id(p)], load[rank] = rank, load[rank] + p.numel()
    return owner


def _add_shard_gradients(shard: torch.Tensor, pieces: list[torch.Tensor | None], layout: FlatLayout) -> None:
    for piece, (begin, end, at) in zip(pieces, layout.pieces(), strict=True):
        if piece is None:
            continue
        gradient = shard[at:at + end - begin].to(piece.dtype)
        if piece.grad is None:
            piece.grad = gradient  # a view of the shard: one buffer of ceil(n/N) elements per bucket
        else:
            piece.grad.add_(gradient)


# --------------------------------------------------------------------------------------------------------
# ZeRO-3: fully sharded data parallel


class _FlatParameter:
    """The parameters of one unit with one dtype and ``requires_grad``: a flat shard (what this rank keeps,
    exposed as one 1-D piece per parameter) and a full flat buffer (allocated only while gathered)."""

    def __init__(self, parameters: list[nn.Parameter], slots: list[list[tuple[nn.Module, str]]],
                 names: list[list[str]], world_size: int, rank: int, compute_dtype: torch.dtype):
        self.slots, self.names = slots, names
        self.shapes = [p.shape for p in parameters]
        self.requires_grad = parameters[0].requires_grad
        self.layout = FlatLayout([p.numel() for p in parameters], world_size, rank)
        with torch.no_grad():
            self.shard = self.layout.pack_shard([p.detach() for p in parameters])
        self.pieces = [nn.Parameter(self.shard[at:at + end - begin], requires_grad=self.requires_grad)
                       for begin, end, at in self.layout.pieces()]
        self.full = self.shard.new_empty(self.layout.padded_numel, dtype=compute_dtype)
        # Views of ``full.data``: they share its storage but not its version counter, so gathering into
        # ``full`` again for backward does not look to autograd like a change to the tensors it saved.
        self.full_parameters = [
            nn.Parameter(self.full.data[offset:offset + numel].view(shape), requires_grad=self.requires_grad)
            for offset, numel, shape in zip(self.layout.offsets, self.layout.numels, self.shapes, strict=True)]
        self.full.untyped_storage().resize_(0)
        self.handle: Any = None  # an all-gather in flight
        self.gathered = False

    def use(self, tensors: list[nn.Parameter]) -> None:
        for tensor, slots in zip(tensors, self.slots, strict=True):
            for module, attribute in slots:
                module._parameters[attribute] = tensor


@dataclass
class _Unit:
    module: nn.Module
    flats: list[_FlatParameter]
    is_root: bool = False
    pre_backward_done: bool = False
    post_backward_done: bool = False


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward, run once the unit's gradients are done, calls ``callback``."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx: Any, *gradients: torch.Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *gradients)


class FullyShardedDataParallel(nn.Module):
    """ZeRO-3: parameters, gradients and (through an optimizer on ``parameters()``) optimizer states sharded.

    ::

        model = FullyShardedDataParallel(TinyGPT(config))          # one unit per block, the rest in the root
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # steps this rank's pieces only
        loss = model(x, y)[1]; loss.backward(); optimizer.step(); optimizer.zero_grad()
        full = model.gather_full_params()                            # {name: tensor} like state_dict()

    ``state_dict()`` is nn.Module's: this rank's 1-D pieces, a sharded checkpoint; ``gather_full_params()``
    is the unsharded one.

    Args:
        module: the model (same architecture on every rank; rank 0's values win).
        compute_dtype: dtype of the gathered parameters and of the forward/backward (default: the shards').
        reduce_dtype: dtype the gradients are reduce-scattered in (default: the shards').
        units: modules to gather and free one at a time (default: children of ``blocks``/``layers`` lists).
        prefetch: start the next unit's all-gather while the current unit computes.
        group: the process group to shard over (default: every rank).
    """

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, units: Iterable[nn.Module] | None = None,
                 prefetch: bool = True, group: dist.ProcessGroup | None = None):
        super().__init__()
        unit_modules = _check_fsdp_arguments(module, compute_dtype, reduce_dtype, units, prefetch, group)
        self.module, self.prefetch, self.group = module, prefetch, group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        _check_same_everywhere(list(module.named_parameters()) + list(module.named_buffers()), group)
        _broadcast_from_first_rank(list(module.parameters()) + list(module.buffers()), group)
        self.master_dtype = next(module.parameters()).dtype  # the shards' (mixed dtypes need both given)
        self.compute_dtype = compute_dtype or self.master_dtype
        self.reduce_dtype = reduce_dtype or self.master_dtype
        self.bytes_communicated: Counter = Counter()
        self.units = self._make_units(unit_modules)
        for unit in self.units[1:]:
            unit.module.register_forward_pre_hook(partial(self._pre_forward, unit), with_kwargs=True)
            unit.module.register_forward_hook(partial(self._post_forward, unit))
        self._forward_order: list[_Unit] = []
        self._pending_reduce_scatter: tuple[Any, ...] | None = None
        self._backward_started = False

    def _make_units(self, unit_modules: list[nn.Module]) -> list[_Unit]:
        slots: dict[int, list[tuple[nn.Module, str]]] = {}
        names: dict[int, list[str]] = {}
        parameters: dict[int, nn.Parameter] = {}
        for prefix, owner in self.module.named_modules(remove_duplicate=False):
            for attribute, p in owner._parameters.items():
                if p is not None and (owner, attribute) not in slots.get(id(p), []):
                    slots.setdefault(id(p), []).append((owner, attribute))
                    names.setdefault(id(p), []).append(f"{prefix}.{attribute}" if prefix else attribute)
                    parameters[id(p)] = p
        holders: dict[int, list[int]] = {}
        for index, unit_module in enumerate(unit_modules):
            for p in unit_module.parameters():
                holders.setdefault(id(p), []).append(index)
        members: list[list[nn.Parameter]] = [[] for _ in range(len(unit_modules) + 1)]  # root first
        for key, p in parameters.items():
            held_by = holders.get(key, [])
            members[held_by[0] + 1 if len(held_by) == 1 else 0].append(p)  # shared or unclaimed: root
        units = []
        for index, unit_parameters in enumerate(members):
            flats = []
            for kind in dict.fromkeys((p.dtype, p.requires_grad) for p in unit_parameters):
                chosen = [p for p in unit_parameters if (p.dtype, p.requires_grad) == kind]
                flats.append(_FlatParameter(chosen, [slots[id(p)] for p in chosen], [names[id(p)] for p in chosen],
                                            self.world_size, self.rank, self.compute_dtype))
            units.append(_Unit(self.module if index == 0 else unit_modules[index - 1], flats, is_root=index == 0))
        for unit in units:
            for flat in unit.flats:
                flat.use(flat.pieces)  # from now on the module's parameters are this rank's pieces
        return units

    # ----------------------------------------------------------------------------------------------------
    # Gathering and freeing

    def _start_gather(self, unit: _Unit) -> None:
        for flat in unit.flats:
            if flat.gathered or flat.handle is not None:
                continue
            flat.full.untyped_storage().resize_(flat.full.numel() * flat.full.element_size())
            _count(self.bytes_communicated, "all_gather", flat.full)
            flat.handle = _all_gather(flat.full, flat.shard.to(self.compute_dtype), group=self.group,
                                      async_op=True)

    def _gather(self, unit: _Unit) -> None:
        self._start_gather(unit)
        for flat in unit.flats:
            if flat.handle is not None:
                flat.handle.wait()
                flat.handle, flat.gathered = None, True

    def _free(self, unit: _Unit) -> None:
        for flat in unit.flats:
            if flat.handle is not None:  # a prefetch that was not used
                flat.handle.wait()
                flat.handle = None
            flat.full.untyped_storage().resize_(0)
            flat.gathered = False

    def _neighbour(self, unit: _Unit, step: int) -> _Unit | None:
        order = self._forward_order if step < 0 else self.units
        position = order.index(unit) + step if unit in order else -1
        return order[position] if 0 <= position < len(order) else None

    # ----------------------------------------------------------------------------------------------------
    # Forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        root = self.units[0]
        self._forward_order = [root]
        root.pre_backward_done = root.post_backward_done = False
        self._start_gather(root)
        if self.prefetch and len(self.units) > 1:
            self._start_gather(self.units[1])
        self._gather(root)
        for flat in root.flats:
            flat.use(flat.full_parameters)
        if self.compute_dtype != self.master_dtype:
            args, kwargs = _map_tensors(lambda t: t.to(self.compute_dtype) if t.is_floating_point() else t,
                                        (args, kwargs))
        try:
            output = self.module(*args, **kwargs)
        finally:
            for flat in root.flats:
                flat.use(flat.pieces)
        if torch.is_grad_enabled() and _register_on_outputs(output, partial(self._pre_backward, root)):
            return output  # the root stays gathered until the end of backward
        for unit in self.units:
            self._free(unit)
        return output

    def _pre_forward(self, unit: _Unit, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._gather(unit)
        self._forward_order.append(unit)
        following = self._neighbour(unit, +1)
        if self.prefetch and following is not None:
            self._start_gather(following)
        for flat in unit.flats:
            flat.use(flat.full_parameters)
        if torch.is_grad_enabled():
            tensors = [t for t in _tensors((args, kwargs)) if t.requires_grad]
            if tensors:
                outputs = _PostBackward.apply(partial(self._post_backward, unit), *tensors)
                replaced = {id(t): out for t, out in zip(tensors, outputs, strict=True)}
                args, kwargs = _map_tensors(lambda t: replaced.get(id(t), t), (args, kwargs))
        return args, kwargs

    def _post_forward(self, unit: _Unit, module: nn.Module, args: tuple, output: Any) -> Any:
        for flat in unit.flats:
            flat.use(flat.pieces)
        self._free(unit)
        if torch.is_grad_enabled():
            _register_on_outputs(output, partial(self._pre_backward, unit))
        unit.pre_backward_done = unit.post_backward_done = False
        return output

    # ----------------------------------------------------------------------------------------------------
    # Backward

    def _pre_backward(self, unit: _Unit, gradient: torch.Tensor) -> None:
        if not self._backward_started:
            self._backward_started = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        if unit.pre_backward_done:
            return
        unit.pre_backward_done = True
        self._gather(unit)
        previous = self._neighbour(unit, -1) if not unit.is_root else self._forward_order[-1]
        if self.prefetch and previous is not None and not previous.is_root:
            self._start_gather(previous)

    def _post_backward(self, unit: _Unit) -> None:
        """Reduce-scatter the unit's gradients (the previous unit's reduce-scatter is waited for first)."""
        if unit.post_backward_done:
            return
        unit.post_backward_done = True
        for flat in unit.flats:
            if not flat.requires_grad:
                continue
            gradients = [p.grad for p in flat.full_parameters]
            full = flat.layout.pack(gradients, flat.full.new_empty(flat.layout.padded_numel,
                                                                   dtype=self.reduce_dtype))
            for p in flat.full_parameters:
                p.grad = None
            self._complete_reduce_scatter()
            shard = full.new_empty(flat.layout.shard_numel)
            _count(self.bytes_communicated, "reduce_scatter", full)
            handle = _reduce_scatter(shard, full, group=self.group, async_op=True)
            self._pending_reduce_scatter = (handle, shard, full, flat)
        if not unit.is_root:
            self._free(unit)

    def _complete_reduce_scatter(self) -> None:
        if self._pending_reduce_scatter is not None:
            handle, shard, _, flat = self._pending_reduce_scatter
            handle.wait()
            _add_shard_gradients(shard.div_(self.world_size), flat.pieces, flat.layout)
            self._pending_reduce_scatter = None

    def _finish_backward(self) -> None:
        try:
            for unit in reversed(self._forward_order):
                self._post_backward(unit)  # units whose inputs needed no gradient, and the root
            self._complete_reduce_scatter()
        finally:
            self._backward_started = False
            for unit in self.units:
                self._free(unit)
                unit.pre_backward_done = unit.post_backward_done = True

    # ----------------------------------------------------------------------------------------------------
    # Checkpoints and the facts a lesson shows

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """The unsharded model's ``state_dict()`` (full parameters in the shards' dtype, and the buffers), on
        every rank: a collective."""
        full: dict[str, torch.Tensor] = {}
        for unit in self.units:
            for flat in unit.flats:
                gathered = flat.shard.new_empty(flat.layout.padded_numel)
                _all_gather(gathered, flat.shard, group=self.group)
                for offset, numel, shape, names in zip(flat.layout.offsets, flat.layout.numels, flat.shapes,
                                                       flat.names, strict=True):
                    for name in names:
                        full[name] = gathered[offset:offset + numel].view(shape).clone()
        full.update({name: buffer.detach().clone() for name, buffer in self.module.named_buffers()})
        return {name: full[name] for name in self.module.state_dict()}

    def memory_breakdown(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds between steps (``labkit.memory.model_state_bytes`` of the sharded module)."""
        return model_state_bytes(self.module, optimizer)

    def unsharded_bytes(self) -> int:
        """Bytes of full (gathered or being gathered) parameters allocated right now: the transient on top."""
        return sum(flat.full.untyped_storage().nbytes() for unit in self.units for flat in unit.flats)

    def communication_per_step(self) -> dict[str, int]:
        """Bytes entering each collective in one forward + backward: every unit gathered twice (the root
        once), every trainable flat reduce-scattered once."""
        compute_size = torch.empty(0, dtype=self.compute_dtype).element_size()
        reduce_size = torch.empty(0, dtype=self.reduce_dtype).element_size()
        gathers = sum((1 if unit.is_root else 2) * flat.layout.padded_numel * compute_size
                      for unit in self.units for flat in unit.flats)
        scatters = sum(flat.layout.padded_numel * reduce_size
                       for unit in self.units for flat in unit.flats if flat.requires_grad)
        return {"all_gather": gathers, "reduce_scatter": scatters}

    @property
    def unit_names(self) -> list[list[str]]:
        """Per unit (root first): the names of the parameters it gathers."""
        return [[names[0] for flat in unit.flats for names in flat.names] for unit in self.units]


# --------------------------------------------------------------------------------------------------------
# Helpers


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    if torch.is_tensor(value):
        return fn(value)
    if isinstance(value, (tuple, list)) and type(value) in (tuple, list):
        return type(value)(_map_tensors(fn, item) for item in value)
    if isinstance(value, dict) and type(value) is dict:
        return {key: _map_tensors(fn, item) for key, item in value.items()}
    return value


def _register_on_outputs(output: Any, hook: Callable[[torch.Tensor], None]) -> bool:
    """Hook every output tensor that will receive a gradient; whether there was one."""
    hooked = False
    for tensor in _tensors(output):
        if tensor.requires_grad:
            tensor.register_hook(hook)
            hooked = True
    return hooked


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    kinds: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        kinds.setdefault(tensor.dtype, []).append(tensor)
    return list(kinds.values())


def _global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


@torch.no_grad()
def _broadcast_from_first_rank(tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    for same_dtype in _by_dtype(tensors):
        layout = FlatLayout([t.numel() for t in same_dtype], 1, 0)
        flat = layout.pack([t.detach() for t in same_dtype], same_dtype[0].new_empty(layout.padded_numel))
        dist.broadcast(flat, src=_global_rank(group, 0), group=group)
        layout.unpack(flat, [t.detach() for t in same_dtype])


def _check_same_everywhere(named: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None) -> None:
    """Every rank must shard the same tensors, or the collectives below mismatch or hang."""
    description = repr([(name, tuple(t.shape), str(t.dtype), t.requires_grad) for name, t in named])
    mine = torch.tensor([zlib.crc32(description.encode())], dtype=torch.int64, device=named[0][1].device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    differ = [rank for rank, checksum in enumerate(everyone) if not torch.equal(checksum, everyone[0])]
    if differ:
        raise ValueError(f"ranks {differ} hold parameters whose names, shapes, dtypes or requires_grad differ "
                         "from rank 0's; every rank must shard the same model")


def _check_process_group(group: Any) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("no process group is initialised: run this inside labkit.launch.launch(fn, "
                           "nprocs=N) or call torch.distributed.init_process_group first")
    if group is not None and dist.get_rank(group) < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of group {group!r}")


def _check_optimizer_arguments(optimizer_cls: Any, stage: Any, bucket_cap_mb: Any, group: Any) -> None:
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer subclass (e.g. torch.optim.AdamW, not an "
                        f"instance), got {optimizer_cls!r:.80}")
    if isinstance(optimizer_cls, type) and issubclass(optimizer_cls, ShardedOptimizer):
        raise TypeError("optimizer_cls cannot be ShardedOptimizer itself")
    if stage not in (1, 2) or isinstance(stage, bool):
        raise ValueError(f"stage must be 1 (optimizer states) or 2 (and gradients), got {stage!r}; for stage 3 "
                         "wrap the model in FullyShardedDataParallel")
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or \
            not math.isfinite(bucket_cap_mb) or bucket_cap_mb < 0:
        raise ValueError(f"bucket_cap_mb must be a finite number >= 0 (MiB per bucket), got {bucket_cap_mb!r}")
    _check_process_group(group)


def _check_fsdp_arguments(module: Any, compute_dtype: Any, reduce_dtype: Any, units: Any, prefetch: Any,
                          group: Any) -> list[nn.Module]:
    """Check the arguments; return the unit modules (given, or found)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}: {module!r:.80}")
    parameters = list(module.parameters())
    if not parameters:
        raise ValueError("module has no parameters: there is nothing to shard")
    if any(not p.is_floating_point() for p in parameters):
        raise ValueError("every parameter must be floating point to be sharded and reduced")
    for name, dtype in (("compute_dtype", compute_dtype), ("reduce_dtype", reduce_dtype)):
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"{name} must be None or a floating-point torch.dtype, got {dtype!r}")
    if len({p.dtype for p in parameters}) > 1 and (compute_dtype is None or reduce_dtype is None):
        raise ValueError("the module mixes parameter dtypes; pass compute_dtype and reduce_dtype explicitly")
    if not isinstance(prefetch, bool):
        raise TypeError(f"prefetch must be True or False, got {prefetch!r}")
    _check_process_group(group)
    submodules = {id(m) for m in module.modules() if m is not module}
    if units is None:
        found = [child for name, lst in module.named_modules() if name.split(".")[-1] in ("blocks", "layers")
                 and isinstance(lst, (nn.ModuleList, nn.Sequential)) for child in lst]
        units = [m for m in found if not any(m is not other and any(m is sub for sub in other.modules())
                                             for other in found)]
    else:
        units = list(units)
        for unit in units:
            if not isinstance(unit, nn.Module) or id(unit) not in submodules:
                raise ValueError(f"every unit must be a submodule of module (not module itself), got {unit!r:.80}")
        if len({id(unit) for unit in units}) != len(units):
            raise ValueError("units lists a module twice")
        for unit in units:
            for other in units:
                if other is not unit and any(other is sub for sub in unit.modules()):
                    raise ValueError(f"units must not nest: {type(other).__name__} is inside "
                                     f"{type(unit).__name__}")
    return units
