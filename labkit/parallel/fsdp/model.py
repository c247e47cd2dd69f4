"""**ZeRO-3** (:class:`FullyShardedDataParallel`, FSDP; Zhao et al., "PyTorch FSDP", VLDB 2023): parameters,
gradients and optimizer states all sharded, each rank holding ``1/N`` of every model state.

The model is cut into *units*: each child of a ``ModuleList``/``Sequential`` called ``blocks`` or ``layers``
(one transformer block each), or the modules passed as ``units``; the *root* unit holds every other parameter
and any parameter two units share (a tied embedding and LM head).  A unit's parameters of one dtype and
``requires_grad`` travel in one collective.  The cut is ``fully_shard``'s (FSDP2; ``FlatShards``): each
parameter is cut along dim 0 into ``N`` chunks of ``ceil(rows / N)`` rows (``torch.chunk``), and rank ``r``'s
chunks, padded to the full chunk size, lie end to end in one flat *shard* buffer per unit.  The module's
parameters *are* this rank's chunks, ``nn.Parameter`` views of that buffer of shape ``[rows_r, ...]`` under
their own names, so ``named_parameters()``, ``state_dict()`` and ``.grad`` hold per-parameter shards (FSDP2's
``DTensor.to_local()``) and an optimizer on ``parameters()`` keeps ``1/N`` of the state.
Hooks on every unit (every rank runs the same units in the same order):

- *before its forward*: all-gather the shards into a padded full buffer, copy the rows out into the full
  parameters ("copy-out"), free the buffer; start the next unit's all-gather (prefetch: it overlaps compute);
- *after its forward*: put the shards back and free the full parameters (``untyped_storage().resize_(0)``;
  the tensors autograd saved keep their shape but hold no memory);
- *before its backward* (a hook on its outputs): gather again, into the same storage, so what autograd saved
  is valid again, and prefetch the unit whose backward comes next;
- *after its backward* (an identity ``autograd.Function`` on its inputs, whose backward runs once the unit's
  nodes are done; else the callback that ends the backward pass): copy the full gradients into a padded buffer
  ("copy-in"), reduce-scatter it, divide this rank's shard by ``N`` (FSDP2's order), free the unit.

The root is gathered once, kept until the end of backward.  A rank holds ``Psi/N`` of every model state plus,
briefly, the full root and about two units.  Per step every unit's padded buffer is all-gathered twice (the root
once) and every trainable one reduce-scattered once: ``3 Psi``, 1.5 times DDP.  With ``compute_dtype`` (bf16)
the fp32 *master* shards are cast before the all-gather (half the bytes), gradients reduced in ``reduce_dtype``.
**m forwards, then m backwards** (a pipeline schedule).  The backward bookkeeping lives in a record of each
forward pass that its hooks carry, so every backward re-gathers each unit before its part of that graph and
frees it after; the root stays gathered until no forward awaits its backward.  With
``set_requires_gradient_sync(False)`` (read when a unit's backward ends, as in FSDP2) each unit keeps its
*unsharded* gradient, summed in ``reduce_dtype``; ``reduce_gradients()`` reduce-scatters the sums, and a later
backward with sync on sends them with its own.  Not supported: activation checkpointing inside a unit, a unit
run twice in one forward.  Buffers are broadcast from the first rank at construction only.

**Sharded and replicated parameters** (``shard_modules``).  By default every parameter is sharded.
``shard_modules=(nn.Linear, nn.Embedding)`` shards only the parameters inside modules of those types and keeps every
other one (the norms' weights and biases) *replicated*: whole on every rank, its gradient all-reduced and divided by
``N`` when its unit's backward ends, so every rank holds the same gradient and, after the optimizer step, the same
value, as under DDP.  It is FSDP2's ``fully_shard`` called on the chosen submodules only, the rest all-reduced
beside it (Stanford CS336's 2026 FSDP assignment shards Linear and Embedding layers and checks that the norms'
gradients agree on every rank).  The costs, for ``P`` parameters in fp32 with Adam: sharded, ``16 P / N`` bytes of
model state (ZeRO-3) and per step two all-gathers and a reduce-scatter of their ``4 P`` bytes (each rank's ring link
carries ``3 (N-1)/N`` times that); replicated, ``16 P`` bytes on every rank (stage 0) and one all-reduce
(``2 (N-1)/N`` times).  A norm's weight is ``h`` of a block's ``12 h^2`` parameters: sharding it saves ``1/N`` of almost
nothing and sends its bytes three times a step instead of twice.  Replicated parameters travel with their unit:
copied into the compute dtype when it is gathered (no communication), all-reduced as one flat buffer in
``reduce_dtype`` when its backward ends.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from labkit.parallel.base import (
    ParallelWrapper,
    Piece,
    all_gather_tensor,
    broadcast_from_first_rank,
    check_same_model,
    queue_end_of_backward,
    reduce_scatter_tensor,
)
from labkit.parallel.flat_shards import add_shard_gradients
from labkit.parallel.fsdp import state as full_states
from labkit.parallel.fsdp.units import FlatParameter, Unit, check_arguments, make_units, predicted_memory


@dataclass(eq=False)
class _Pass:
    """A forward pass with autograd on: its units in forward order; those whose backward started and ended."""

    units: list[Unit]
    pre_backward: set[Unit] = field(default_factory=set)
    post_backward: set[Unit] = field(default_factory=set)


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


class FullyShardedDataParallel(ParallelWrapper):
    """ZeRO-3 over ``group`` (``None``: every rank, a ``ProcessGroup`` or a 1-D ``DeviceMesh``)::

        model = FullyShardedDataParallel(TinyGPT(config))             # one unit per block, the rest in the root
        optimizer = model.make_optimizer(torch.optim.AdamW, lr=1e-3)  # steps this rank's shards only
        full = model.full_state_dict()                                # collective: the unsharded state_dict()

        FullyShardedDataParallel(model, shard_modules=(nn.Linear, nn.Embedding))  # norms stay replicated

    ``compute_dtype``: of the gathered parameters, the inputs and the computation; ``reduce_dtype``: of the
    gradients' reduction (both default to the shards' dtype); ``units``: the modules gathered one at a time;
    ``prefetch``: start the next unit's all-gather while this one computes; ``shard_modules``: shard only the
    parameters inside these modules (types, names or submodules; ``labkit.parallel.fsdp.units``), replicate the
    rest (default: shard every parameter).  Rank 0's values win.
    """

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, units: Iterable[nn.Module] | None = None,
                 prefetch: bool = True, group: Any = None, shard_modules: Any = None):
        unit_modules, sharded = check_arguments(module, compute_dtype, reduce_dtype, units, prefetch, shard_modules)
        super().__init__(module, group)
        self.prefetch = prefetch
        check_same_model(list(module.named_parameters()) + list(module.named_buffers()), self.group)
        broadcast_from_first_rank(list(module.parameters()) + list(module.buffers()), self.group)
        self.master_dtype = next(module.parameters()).dtype  # the shards' (mixed dtypes need both given)
        self.compute_dtype, self.reduce_dtype = compute_dtype or self.master_dtype, reduce_dtype or self.master_dtype
        self.units = make_units(module, unit_modules, sharded, self.world_size, self.rank, self.compute_dtype)
        for unit in self.units[1:]:
            unit.module.register_forward_pre_hook(partial(self._pre_forward, unit), with_kwargs=True)
            unit.module.register_forward_hook(partial(self._post_forward, unit))
        self._live: weakref.WeakSet[_Pass] = weakref.WeakSet()  # forward passes awaiting their backward
        self._recording: _Pass | None = None  # the forward pass running now
        self._backward: list[_Pass] = []  # the passes the running backward has reached
        self._pending_reduction: tuple[Any, ...] | None = None

    def _start_gather(self, unit: Unit) -> None:
        for flat in unit.flats:
            if flat.gathered or flat.handle is not None or flat.replicated:  # a replicated one: a local copy
                continue
            flat.gathering = flat.shard.new_empty(flat.shards.padded_numel, dtype=self.compute_dtype)
            self._count("all_gather", flat.gathering)
            flat.handle = all_gather_tensor(flat.gathering, flat.shard.to(self.compute_dtype), group=self.group,
                                            async_op=True)

    def _gather(self, unit: Unit) -> None:
        self._start_gather(unit)
        for flat in unit.flats:
            if flat.gathered:
                continue
            if flat.handle is not None:
                flat.handle.wait()
            for p in flat.full_parameters:
                p.untyped_storage().resize_(p.numel() * p.element_size())
            # Copy out through .data: a new version counter, so autograd's saved tensors stay valid.
            source = flat.shard.to(self.compute_dtype) if flat.replicated else flat.gathering
            flat.shards.unpack(source, [p.data for p in flat.full_parameters])
            flat.gathering, flat.handle, flat.gathered = None, None, True

    def _free(self, unit: Unit) -> None:
        for flat in unit.flats:
            if flat.handle is not None:  # a prefetch that was not used
                flat.handle.wait()
            flat.gathering, flat.handle, flat.gathered = None, None, False
            for p in flat.full_parameters:
                p.untyped_storage().resize_(0)

    # ----------------------------------------------------------------------------------------------------
    # Forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._start_forward()
        root = self.units[0]
        if not self._live:
            self._free(root)  # a gather no backward awaits may predate an optimizer step: gather afresh
        self._start_gather(root)
        if self.prefetch and len(self.units) > 1:
            self._start_gather(self.units[1])
        self._gather(root)
        if self.compute_dtype != self.master_dtype:
            args, kwargs = tree_map_only(torch.Tensor, lambda t: t.to(self.compute_dtype) if t.is_floating_point()
                                         else t, (args, kwargs))
        record = self._recording = _Pass([root])
        root.use(full=True)
        try:
            output = self.module(*args, **kwargs)
        finally:
            root.use(full=False)
            self._recording = None
        if torch.is_grad_enabled() and _register_on_outputs(output, partial(self._pre_backward, record, root)):
            self._live.add(record)  # the root stays gathered until the end of its backward
        elif not self._live:
            self._free(root)
        return output

    def _pre_forward(self, unit: Unit, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        record = self._recording if self._recording is not None else _Pass([])  # run outside our forward
        if unit in record.units:
            raise RuntimeError(f"unit {type(unit.module).__name__} ran twice in one forward pass: unsupported")
        self._gather(unit)
        record.units.append(unit)
        position = self.units.index(unit)
        if self.prefetch and position + 1 < len(self.units):
            self._start_gather(self.units[position + 1])
        unit.use(full=True)
        if torch.is_grad_enabled():
            tensors = [t for t in tree_leaves((args, kwargs)) if torch.is_tensor(t) and t.requires_grad]
            if tensors:
                outputs = _PostBackward.apply(partial(self._post_backward, record, unit), *tensors)
                replaced = {id(t): out for t, out in zip(tensors, outputs, strict=True)}
                args, kwargs = tree_map_only(torch.Tensor, lambda t: replaced.get(id(t), t), (args, kwargs))
        return args, kwargs

    def _post_forward(self, unit: Unit, module: nn.Module, args: tuple, output: Any) -> Any:
        unit.use(full=False)
        self._free(unit)
        if torch.is_grad_enabled() and self._recording is not None:
            _register_on_outputs(output, partial(self._pre_backward, self._recording, unit))
        return output

    # ----------------------------------------------------------------------------------------------------
    # Backward

    def _pre_backward(self, record: _Pass, unit: Unit, gradient: torch.Tensor) -> None:
        if not self._backward:
            queue_end_of_backward(self._finish_backward)
        if record not in self._backward:
            self._backward.append(record)
            self._live.add(record)  # again, if a retained graph is run backward a second time
        if unit in record.pre_backward:
            return
        record.pre_backward.add(unit)
        self._gather(unit)
        upcoming = record.units[record.units.index(unit) - 1]  # the root's backward comes before the last unit's
        if self.prefetch and not upcoming.is_root:
            self._start_gather(upcoming)

    def _post_backward(self, record: _Pass, unit: Unit) -> None:
        """Reduce-scatter the unit's gradients (or, with sync off, add them to what it accumulated); free it."""
        if unit in record.post_backward:
            return
        record.post_backward.add(unit)
        for flat in unit.flats:
            if not flat.requires_grad:
                continue
            if self.require_gradient_sync:
                self._reduce(flat)
            else:
                flat.accumulated = [None if g is None else g.to(self.reduce_dtype) for g in _take_gradients(flat)]
        if not unit.is_root:
            self._free(unit)

    def _reduce(self, flat: FlatParameter) -> None:
        """Launch the reduce-scatter (replicated: the all-reduce) of ``flat``'s full gradients; the previous
        reduction is waited for first."""
        full = flat.shard.new_empty(flat.shards.padded_numel, dtype=self.reduce_dtype)
        flat.shards.pack(_take_gradients(flat), full)
        self._complete_reduction()
        if flat.replicated:
            self._count("all_reduce", full)
            shard, handle = full, dist.all_reduce(full, group=self.group, async_op=True)
        else:
            shard = full.new_empty(flat.shards.shard_numel)
            self._count("reduce_scatter", full)
            handle = reduce_scatter_tensor(shard, full, group=self.group, async_op=True)
        self._pending_reduction = (handle, shard, full, flat)

    def _complete_reduction(self) -> None:
        if self._pending_reduction is not None:
            handle, shard, _, flat = self._pending_reduction
            handle.wait()
            add_shard_gradients(shard.div_(self.world_size), flat.pieces, flat.shards)
            self._pending_reduction = None

    def _finish_backward(self) -> None:
        try:
            for record in self._backward:
                for unit in reversed(record.units):
                    self._post_backward(record, unit)  # units whose inputs needed no gradient, and the root
                record.pre_backward, record.post_backward = set(), set()  # a retained graph may run again
                self._live.discard(record)
            self._complete_reduction()
            if self.require_gradient_sync:
                self._reduction_done()
        finally:
            self._backward = []
            for unit in self.units:
                if not (unit.is_root and self._live):
                    self._free(unit)

    def reduce_gradients(self) -> None:
        """Reduce-scatter (all-reduce, if replicated) what backward passes with sync off accumulated into the
        pieces' ``.grad`` (the mean over ranks).  A collective: every rank calls it after the same backward passes."""
        flats = [flat for unit in self.units for flat in unit.flats if flat.requires_grad]
        if any(g is not None for flat in flats for g in flat.accumulated):
            for flat in flats:
                self._reduce(flat)
            self._complete_reduction()
        self._reduction_done()

    def _sharded(self) -> bool:
        return True

    def _gradient_parts(self) -> tuple[list[torch.Tensor], list[torch.Tensor], bool]:
        parts: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for flat in (flat for unit in self.units for flat in unit.flats):
            parts[flat.replicated].extend(p.grad for p in flat.pieces if p.grad is not None)
        return parts[0], parts[1], True

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the unsharded model's ``state_dict()`` (the shards' dtype, and the buffers) on every rank."""
        return full_states.full_state_dict(self)

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        full_states.load_full_state_dict(self, state)

    def full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return full_states.full_optimizer_state_dict(self, optimizer)

    def load_full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        full_states.load_full_optimizer_state_dict(self, optimizer, state)

    def sharded_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Piece]:
        return full_states.sharded_state(self, optimizer)

    def unsharded_bytes(self) -> int:
        """Bytes of full parameters and all-gather buffers allocated right now: the transient on top."""
        return sum(t.untyped_storage().nbytes() for unit in self.units for flat in unit.flats
                   for t in (*flat.full_parameters, flat.gathering) if t is not None)

    def predicted_communication(self, forwards: int = 1, root_gathers: int = 1) -> dict[str, int]:
        """Bytes into each collective in a step of ``forwards`` forwards and backwards: every unit's sharded part
        gathered twice each, the root's ``root_gathers`` times (kept while a backward is due), every trainable
        one scattered once; every trainable replicated part all-reduced once (kinds with no bytes left out)."""
        flats = [(unit, flat) for unit in self.units for flat in unit.flats]
        gathers = sum((root_gathers if unit.is_root else 2 * forwards) * flat.shards.padded_numel
                      for unit, flat in flats if not flat.replicated)
        reduced = [sum(flat.shards.padded_numel for _, flat in flats if flat.requires_grad and flat.replicated == kind)
                   for kind in (False, True)]
        size = torch.finfo(self.reduce_dtype).bits // 8
        found = {"all_gather": gathers * torch.finfo(self.compute_dtype).bits // 8,
                 "reduce_scatter": reduced[0] * size, "all_reduce": reduced[1] * size}
        return {kind: count for kind, count in found.items() if count}

    def predicted_memory(self, optimizer: str = "adam") -> dict[str, int]:
        """Model-state bytes this rank holds between steps, from the layout (``units.predicted_memory``):
        what :meth:`memory_breakdown` measures after an optimizer step, less Adam's ``step`` counters."""
        return predicted_memory(self.units, self.master_dtype, self.reduce_dtype, optimizer)

    @property
    def unit_names(self) -> list[list[str]]:
        """Per unit (root first): the names of the parameters it gathers (or copies, if replicated)."""
        return [[names[0] for flat in unit.flats for names in flat.names] for unit in self.units]


def _take_gradients(flat: FlatParameter) -> list[torch.Tensor | None]:
    """The full gradients on ``flat``'s parameters plus what it accumulated with sync off, taken off it."""
    taken = []
    for p, total in zip(flat.full_parameters, flat.accumulated, strict=True):
        gradient, p.grad = p.grad, None
        taken.append(gradient if total is None else total if gradient is None else total.add_(gradient))
    flat.accumulated = [None] * len(taken)
    return taken


def _register_on_outputs(output: Any, hook: Callable[[torch.Tensor], None]) -> bool:
    """Hook every output tensor that will receive a gradient; whether there was one."""
    tensors = [t for t in tree_leaves(output) if torch.is_tensor(t) and t.requires_grad]
    for tensor in tensors:
        tensor.register_hook(hook)
    return bool(tensors)
