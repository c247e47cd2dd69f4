"""The contract every parallel wrapper keeps, and the plumbing they share.

Each parallelism in ``labkit.parallel`` takes a plain ``nn.Module`` and the process group it runs over (``group``:
``None`` for every rank, a ``ProcessGroup``, or one dimension of a ``labkit.mesh.Mesh``) and offers the same few
things, so that the trainer, the checkpointer, the notebooks and the benchmarks never ask which wrapper they hold:

================================  ==============================================================================
``.module``                       the plain model (or this rank's part of it)
``make_optimizer(cls, **kw)``     an optimizer over what this rank updates (ZeRO: a ``ShardedOptimizer``)
``forward_backward(x, y)``        one step's forward and backward passes over this rank's batch: its mean loss
                                  (a pipeline runs its whole schedule; ``loss_scale=S`` scales the gradients)
``set_requires_gradient_sync(b)`` ``False``: backward passes accumulate locally and communicate nothing
``reduce_gradients()``            the reduction those backward passes skipped, explicitly: after ``m`` forwards
                                  and ``m`` backwards with sync off (a pipeline schedule's order), one call
                                  leaves the gradient of the whole batch, as one process would have it
``gradients()``                   ``{name: this rank's gradient}``: the full gradient, or this rank's shard
``clip_grad_norm_(max_norm)``     clip by the norm over every rank's shards: ``clip_grad_norm_`` on one process
``communication_per_step()``      bytes that entered each collective in the last step, measured
``predicted_communication()``     the same, from the layout: what ``communication_per_step()`` is held to
``memory_breakdown()``            bytes this rank holds: weights, gradients, optimizer states (measured storage)
``state_dict()``                  this rank's part (a shard, for sharded wrappers)
``full_state_dict()``             collective: the unsharded model's ``state_dict()``, on every rank
================================  ==============================================================================

Bytes "entering a collective" are counted as the literature counts a collective's size ``n``: an all-reduce's
or broadcast's message, a reduce-scatter's input, an all-gather's output.  What each rank then puts on its link
follows from ``labkit.costmodel.collectives`` (``2 (N-1)/N n`` for a ring all-reduce).  A *step* runs from a
forward pass that follows a completed gradient reduction to the next such forward: it includes the optimizer's
communication (ZeRO's all-gather of updated shards) and every micro-batch of gradient accumulation.

The flat shards that ZeRO-2 and FSDP share are :mod:`labkit.parallel.flat_shards`'s.
"""

from __future__ import annotations

import inspect
import math
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labkit.dist import global_rank, require_group
from labkit.measure import model_state_bytes
from labkit.parallel.experts.layer import aux_loss_scale

# torch 2.14 renamed the flat collectives (the old names still work, with a warning); we support torch >= 2.4.
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# --------------------------------------------------------------------------------------------------------
# The contract

Piece = tuple[torch.Tensor, list[int], int, int]  # a sharded checkpoint's piece: see sharded_state


class ParallelWrapper(nn.Module):
    """Base class of every parallel wrapper: the contract above, its shared state and its defaults.

    Subclasses call ``super().__init__(module, group)`` first and implement the abstract methods; they count
    the bytes they put into collectives with :meth:`_count` and call :meth:`_reduction_done` when a step's
    gradients are reduced.
    """

    def __init__(self, module: nn.Module, group: Any = None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}: {module!r:.80}")
        self.module = module
        if isinstance(self, SingleProcess):  # the baseline needs no process group
            self.group, self.world_size, self.rank = None, 1, 0
        else:
            self.group = require_group(group)
            self.world_size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.require_gradient_sync = True
        self.optimizer: torch.optim.Optimizer | None = None  # the one make_optimizer built
        self._traffic: Counter = Counter()
        self._step_reduced = False

    # -- communication -----------------------------------------------------------------------------------

    def _count(self, kind: str, tensor: torch.Tensor) -> None:
        """Record ``tensor``'s bytes entering a collective of ``kind`` (``"all_reduce"``, ``"all_gather"``, ...)."""
        if self._step_reduced:  # the first communication after a completed step starts a new one
            self._traffic.clear()
            self._step_reduced = False
        self._traffic[kind] += tensor.numel() * tensor.element_size()

    def _reduction_done(self) -> None:
        self._step_reduced = True

    def _start_forward(self) -> None:
        """Call at the top of ``forward``: a forward after a completed reduction begins the next step."""
        if self._step_reduced:
            self._traffic.clear()
            self._step_reduced = False

    def communication_per_step(self) -> dict[str, int]:
        """Bytes that entered each collective in the last step (the current one, if it is still running)."""
        return dict(self._traffic)

    def predicted_communication(self) -> dict[str, int]:
        raise NotImplementedError

    # -- gradients -----------------------------------------------------------------------------------------

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, *, loss_scale: float = 1.0
                         ) -> torch.Tensor:
        """One step's forward and backward passes over this rank's batch; returns its mean loss (detached).

        Default: one forward, and ``backward()`` of ``loss * loss_scale``.  The loss is the module's own when its
        ``forward`` takes the targets and returns ``(output, loss)`` (TinyGPT), else the cross-entropy of its
        output.  A pipeline (:class:`labkit.parallel.parallelize.Parallel3D`) runs its schedule instead.
        """
        takes_targets = len(inspect.signature(self.module.forward).parameters) >= 2
        with aux_loss_scale(loss_scale):  # an MoE layer's auxiliary loss: the gradient scale the loss gets
            output = self(inputs, targets) if takes_targets else self(inputs)
        loss = output[1] if isinstance(output, tuple) else nn.functional.cross_entropy(output, targets)
        (loss * loss_scale if loss_scale != 1.0 else loss).backward()
        return loss.detach()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """``False``: backward passes leave their gradients on this rank (accumulating) until
        :meth:`reduce_gradients` or a backward pass with sync back on."""
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(f"requires_gradient_sync must be True or False, got {requires_gradient_sync!r}")
        self.require_gradient_sync = requires_gradient_sync

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes run inside the block accumulate locally and communicate nothing."""
        previous = self.require_gradient_sync
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(previous)

    def reduce_gradients(self) -> None:
        raise NotImplementedError

    def gradients(self) -> dict[str, torch.Tensor | None]:
        """``{name: gradient}`` of this rank (default: the module's parameters' ``.grad``)."""
        return {name: p.grad for name, p in self.module.named_parameters()}

    def _sharded(self) -> bool:
        """Whether :meth:`gradients` holds disjoint shards (their norms add up over the group)."""
        return False

    def _gradient_parts(self) -> tuple[list[torch.Tensor], list[torch.Tensor], bool]:
        """``(shards, whole, reduce)``: gradients whose norms add up over the group, gradients every rank holds
        whole, and whether to all-reduce the shards' part (the same answer on every rank)."""
        grads = [g for g in dict.fromkeys(self.gradients().values()) if g is not None]  # a tied one once
        return (grads, [], True) if self._sharded() else ([], grads, False)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every gradient so that their global norm is at most ``max_norm``; return the norm before.

        Equal to ``torch.nn.utils.clip_grad_norm_`` on one process holding the whole gradient: for sharded
        gradients each rank's ``|g|^p`` sums (or maxima, for ``inf``) are all-reduced over the group first, and
        what every rank holds whole is added once.
        """
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
            raise ValueError(f"max_norm must be a number > 0, got {max_norm!r}")
        norm_type = float(norm_type)
        if not (norm_type == math.inf or norm_type > 0):
            raise ValueError(f"norm_type must be > 0 or inf, got {norm_type!r}")
        shards, whole, reduce = self._gradient_parts()
        device = next(self.module.parameters()).device

        def norm_term(grads: list[torch.Tensor]) -> torch.Tensor:
            if norm_type == math.inf:
                maxima = [g.detach().abs().max().float() for g in grads if g.numel()]
                return torch.stack(maxima).max() if maxima else torch.zeros((), device=device)
            return sum((g.detach().float().norm(norm_type) ** norm_type for g in grads),
                       torch.zeros((), device=device))

        local = norm_term(shards)
        if reduce:
            op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
            dist.all_reduce(local, op=op, group=self.group)
        local = torch.maximum(local, norm_term(whole)) if norm_type == math.inf else local + norm_term(whole)
        total = local if norm_type == math.inf else local ** (1.0 / norm_type)
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in shards + whole:
            g.mul_(coefficient.to(g.dtype))
        return total

    # -- optimizer, memory, checkpoints ----------------------------------------------------------------------

    def make_optimizer(self, optimizer_cls: type[torch.optim.Optimizer], params: Iterable[Any] | None = None,
                       **kwargs: Any) -> torch.optim.Optimizer:
        """An ``optimizer_cls`` over the parameters this rank updates: ``params`` (the module's parameters, or
        parameter groups of them, as for any optimizer; default: all of ``self.parameters()``)."""
        check_optimizer_class(optimizer_cls)
        self.optimizer = optimizer_cls(self.parameters() if params is None else params, **kwargs)
        return self.optimizer

    def memory_breakdown(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds between steps (``labkit.measure.model_state_bytes``' keys), with ``optimizer``
        (default: the one :meth:`make_optimizer` built)."""
        return model_state_bytes(self.module, optimizer if optimizer is not None else self.optimizer)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load an unsharded model state (a :meth:`full_state_dict`) into this rank's part (default: whole)."""
        self.module.load_state_dict(state)

    def full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer``'s state as one process over the unsharded model would hold it (a collective where it is
        sharded).  Default: the optimizer's own, when it is replicated or consolidates itself (ZeRO's)."""
        if self._optimizer_state_sharded:
            raise NotImplementedError(f"{type(self).__name__} keeps per-rank shards of the optimizer state; "
                                      "gathering them into a full checkpoint is not written yet")
        return optimizer.state_dict()

    def load_full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load a :meth:`full_optimizer_state_dict` into ``optimizer`` (this rank's part of it)."""
        if self._optimizer_state_sharded:
            raise NotImplementedError(f"{type(self).__name__}: loading a full optimizer state is not written yet")
        optimizer.load_state_dict(state)

    def sharded_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Piece]:
        """For a sharded checkpoint, ``{"model/NAME" or "optimizer/POSITION/STATE": (this rank's piece, the whole
        shape, its first element, the dimension it is cut along)}``: the piece holds the flat elements
        ``begin .. begin + piece.numel()`` of the whole tensor with ``dim`` moved first
        (``whole.movedim(dim, 0).flatten()``; with ``dim = 0``, of the whole tensor itself, FSDP's rows);
        default: replicated states, whole, on the first rank."""
        model, optimizer_state = self.full_state_dict(), self.full_optimizer_state_dict(optimizer)
        pieces = {f"model/{name}": (tensor, list(tensor.shape), 0, 0) for name, tensor in model.items()}
        pieces.update((f"optimizer/{position}/{key}", (value, list(value.shape), 0, 0))
                      for position, entries in optimizer_state["state"].items() for key, value in entries.items()
                      if torch.is_tensor(value) and value.dim() > 0)
        return pieces if self.rank == 0 else {}

    def random_states(self) -> dict[str, torch.Tensor]:
        """Random-generator states this wrapper keeps on each rank besides the global ones (a checkpoint saves
        them per rank; tensor parallelism's dropout generator); default: none."""
        return {}

    def load_random_states(self, states: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`random_states` returned on this rank."""
        if states:
            raise ValueError(f"{type(self).__name__} keeps no random states, got {sorted(states)}")

    _optimizer_state_sharded = False  # True: a plain optimizer over per-rank slices, no gather written yet


class SingleProcess(ParallelWrapper):
    """No parallelism: the contract around a plain model on one process, the baseline every wrapper is held to.

    It communicates nothing, holds everything, and its :meth:`reduce_gradients` has nothing to do; it needs no
    process group, so the trainer's one loop also runs a plain model."""

    def __init__(self, module: nn.Module):
        super().__init__(module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def predicted_communication(self) -> dict[str, int]:
        return {}

    def reduce_gradients(self) -> None:
        pass

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.module.state_dict()


def per_optimizer_parameter(optimizer: torch.optim.Optimizer, where: dict[int, Any], model: str) -> list[Any]:
    """For each parameter of ``optimizer``, in its groups' order (the positions of its ``state_dict``),
    ``where[id(parameter)]``; a ``ValueError`` naming the positions of parameters that are not ``model``'s."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    strangers = [i for i, p in enumerate(params) if id(p) not in where]
    if strangers:
        raise ValueError(f"the optimizer's parameters {strangers} are not {model}'s: build it with "
                         "model.make_optimizer(...)")
    return [where[id(p)] for p in params]


def check_optimizer_class(optimizer_cls: Any) -> None:
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer subclass (e.g. torch.optim.AdamW, not an "
                        f"instance), got {optimizer_cls!r:.80}")


# --------------------------------------------------------------------------------------------------------
# Set-up helpers every wrapper uses


def by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        kinds.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    return list(kinds.values())


@torch.no_grad()
def replicated_parameters(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``module``'s named parameters that data parallelism keeps alike on every rank: all but those marked
    ``expert_parallel`` (the experts only this rank holds; :func:`labkit.parallel.experts.apply_expert_parallel`),
    whose gradients are reduced over their own group."""
    return [(name, p) for name, p in module.named_parameters() if not getattr(p, "expert_parallel", False)]


def broadcast_from_first_rank(tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Overwrite ``tensors`` with the group's first rank's values: one broadcast per (dtype, device) of the
    tensors flattened together, rather than one small message each."""
    for same_kind in by_dtype(tensors):
        flat = torch.cat([tensor.detach().reshape(-1) for tensor in same_kind])
        dist.broadcast(flat, src=global_rank(group, 0), group=group)
        offset = 0
        for tensor in same_kind:
            tensor.detach().copy_(flat[offset:offset + tensor.numel()].view(tensor.shape))
            offset += tensor.numel()


def check_same_model(named: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None) -> None:
    """Compare a checksum of every tensor's name, shape, dtype and ``requires_grad`` across the group.

    Different models would otherwise make the broadcasts and reductions that follow mismatch or hang."""
    if not named:
        raise ValueError("the module has no parameters or buffers")
    description = repr([(name, tuple(t.shape), str(t.dtype), t.requires_grad) for name, t in named])
    mine = torch.tensor([zlib.crc32(description.encode())], dtype=torch.int64, device=named[0][1].device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    differ = [rank for rank, checksum in enumerate(everyone) if not torch.equal(checksum, everyone[0])]
    if differ:
        raise ValueError(f"ranks {differ} (of the group) hold a model whose parameter/buffer names, shapes, dtypes "
                         "or requires_grad differ from rank 0's; every rank must wrap the same model")


def queue_end_of_backward(callback: Any) -> None:
    """Run ``callback`` once the autograd engine finishes the current backward pass (call it from a hook)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)
