"""The communication of tensor parallelism: the conjugate operators, as autograd Functions, and the dropout RNG.

**f and g** (Shoeybi et al. 2019, figure 3).  A tensor-parallel region starts where a replicated activation
``X`` meets a column-split weight and ends where partial results of a row-split weight are summed:

- ``f`` (:func:`copy_to_tensor_parallel`): forward, the identity (every rank already holds ``X``); backward,
  an all-reduce, because each rank's gradient of ``X`` covers only the columns it holds;
- ``g`` (:func:`reduce_from_tensor_parallel`): forward, an all-reduce of the partial sums; backward, the
  identity (the gradient of a sum is the same for every term).

Each is the other's transpose, which is why a missing all-reduce in one backward pass still trains: the loss
goes down, on wrong gradients.  **Sequence parallelism** (Korthikanti et al. 2022) keeps the activations
outside the regions split along the sequence (dimension 1 of ``[batch, seq, hidden]``): ``f`` becomes an
all-gather along the sequence (:func:`gather_from_sequence_parallel`, reduce-scatter backward) and ``g`` a
reduce-scatter (:func:`reduce_scatter_to_sequence_parallel`, all-gather backward).
:func:`gathered_linears` fuses the all-gather with the column-parallel matrices that read it, so that only the
sequence shard is saved for backward, which gathers it again for the weight gradients.

Every operator is the identity on one rank, and tells its :class:`TensorParallelGroup` what it sent
(``labkit.costmodel.tensor_parallel`` predicts the same list).  **Dropout** (:class:`ParallelRNG`): activations
that every rank holds whole must drop the same elements everywhere, and shards of one activation different
ones; Megatron-LM keeps a second generator per rank for the split regions and swaps it in around them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit import trace
from labkit.dist import require_group
from labkit.parallel.base import all_gather_tensor, reduce_scatter_tensor

SEQUENCE_DIM = 1  # activations are [batch, seq, hidden]
PARALLEL_SEED_OFFSET = 2718  # Megatron-LM's: the split regions' generator is seeded with seed + 2718 + tp rank


class TensorParallelGroup:
    """The ranks a layer is split over, and a record of what its operators send.

    ``group``: ``None``, a ``ProcessGroup`` or a one-dimensional ``DeviceMesh``.  ``on_collective(phase, kind,
    where, tensor)`` (optional) is called for every collective with the tensor whose size it counts.
    """

    def __init__(self, group: Any = None,
                 on_collective: Callable[[str, str, str, torch.Tensor], None] | None = None):
        self.group = require_group(group)
        self.size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.on_collective = on_collective

    def _record(self, kind: str, where: str, tensor: torch.Tensor) -> None:
        if self.on_collective is not None:
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            self.on_collective(phase, kind, where, tensor)

    def all_reduce(self, tensor: torch.Tensor, where: str, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        """Sum (or ``op``) ``tensor`` over the group, in place; returns it."""
        self._record("all_reduce", where, tensor)
        with trace.span(f"all_reduce {where}", "comm"):
            dist.all_reduce(tensor, op=op, group=self.group)
        return tensor

    def all_gather(self, shard: torch.Tensor, where: str) -> torch.Tensor:
        """The ranks' ``shard``s concatenated along the sequence dimension, in rank order."""
        front = shard.transpose(0, SEQUENCE_DIM).contiguous()  # the collective concatenates along dim 0
        out = front.new_empty((front.shape[0] * self.size, *front.shape[1:]))
        self._record("all_gather", where, out)
        with trace.span(f"all_gather {where}", "comm"):
            all_gather_tensor(out, front, group=self.group)
        return out.transpose(0, SEQUENCE_DIM).contiguous()

    def reduce_scatter(self, tensor: torch.Tensor, where: str) -> torch.Tensor:
        """This rank's sequence shard of ``tensor`` summed over the group."""
        front = tensor.transpose(0, SEQUENCE_DIM).contiguous()
        out = front.new_empty((front.shape[0] // self.size, *front.shape[1:]))
        self._record("reduce_scatter", where, front)
        with trace.span(f"reduce_scatter {where}", "comm"):
            reduce_scatter_tensor(out, front, group=self.group)
        return out.transpose(0, SEQUENCE_DIM).contiguous()


# --------------------------------------------------------------------------------------------------------
# The conjugate operators


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallelGroup, where: str) -> torch.Tensor:
        ctx.tp, ctx.where = tp, where
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.tp.all_reduce(grad.contiguous().clone(), ctx.where), None, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallelGroup, where: str) -> torch.Tensor:
        return tp.all_reduce(x.contiguous().clone(), where)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class _GatherFromSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallelGroup, where: str) -> torch.Tensor:
        ctx.tp, ctx.where = tp, where
        return tp.all_gather(x, where)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.tp.reduce_scatter(grad, ctx.where), None, None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallelGroup, where: str) -> torch.Tensor:
        ctx.tp, ctx.where = tp, where
        return tp.reduce_scatter(x, where)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.tp.all_gather(grad, ctx.where), None, None


def copy_to_tensor_parallel(x: torch.Tensor, tp: TensorParallelGroup, where: str = "") -> torch.Tensor:
    """``f``: identity forward, all-reduce of the gradient backward."""
    return x if tp.size == 1 else _CopyToTensorParallel.apply(x, tp, where)


def reduce_from_tensor_parallel(x: torch.Tensor, tp: TensorParallelGroup, where: str = "") -> torch.Tensor:
    """``g``: all-reduce forward (into a new tensor), identity backward."""
    return x if tp.size == 1 else _ReduceFromTensorParallel.apply(x, tp, where)


def gather_from_sequence_parallel(x: torch.Tensor, tp: TensorParallelGroup, where: str = "") -> torch.Tensor:
    """Sequence parallelism's ``f``: all-gather along the sequence forward, reduce-scatter backward."""
    return x if tp.size == 1 else _GatherFromSequenceParallel.apply(x, tp, where)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, tp: TensorParallelGroup,
                                        where: str = "") -> torch.Tensor:
    """Sequence parallelism's ``g``: reduce-scatter along the sequence forward, all-gather backward."""
    return x if tp.size == 1 else _ReduceScatterToSequenceParallel.apply(x, tp, where)


f, g = copy_to_tensor_parallel, reduce_from_tensor_parallel


class _GatheredLinears(torch.autograd.Function):
    """All-gather ``x``'s sequence shards once, apply every ``(weight, bias)`` to the whole; save the shard only."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallelGroup, where: str,
                *weights_and_biases: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        weights, biases = weights_and_biases[0::2], weights_and_biases[1::2]
        whole = tp.all_gather(x, where)
        ctx.tp, ctx.where, ctx.has_bias = tp, where, [bias is not None for bias in biases]
        ctx.save_for_backward(x, *weights)
        return tuple(F.linear(whole, weight, bias) for weight, bias in zip(weights, biases, strict=True))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        grad_whole = sum(grad @ weight for grad, weight in zip(grads, weights, strict=True))
        grad_x = ctx.tp.reduce_scatter(grad_whole, ctx.where)
        whole = ctx.tp.all_gather(x, ctx.where).flatten(0, -2)  # gathered again: Korthikanti's memory trade
        out: list[torch.Tensor | None] = [grad_x, None, None]
        for grad, has_bias in zip(grads, ctx.has_bias, strict=True):
            flat = grad.flatten(0, -2)
            out += [flat.t() @ whole, flat.sum(0) if has_bias else None]
        return tuple(out)


def gathered_linears(x: torch.Tensor, layers: list[Any], tp: TensorParallelGroup,
                     where: str = "") -> list[torch.Tensor]:
    """Each column-parallel ``layer`` (with ``weight`` and ``bias``) applied to ``x`` gathered along the
    sequence: one all-gather for all of them forward; backward, one reduce-scatter and one all-gather again."""
    if tp.size == 1:
        return [F.linear(x, layer.weight, layer.bias) for layer in layers]
    flat = [tensor for layer in layers for tensor in (layer.weight, layer.bias)]
    return list(_GatheredLinears.apply(x, tp, where, *flat))


# --------------------------------------------------------------------------------------------------------
# Dropout: one generator for what is replicated, one per rank for what is split


class ParallelRNG:
    """The generator that dropout inside a split region draws from: seeded ``seed + 2718 + rank`` (Megatron-LM's
    ``model_parallel_cuda_manual_seed``), so ranks holding different shards drop different elements.  What
    every rank holds whole keeps drawing from the default generator, which must be in the same state on every
    rank of the group (``parallelize_tensor`` checks it)."""

    def __init__(self, seed: int, rank: int, device: torch.device):
        self.device = torch.device(device)
        self.seed = seed + PARALLEL_SEED_OFFSET + rank
        generator = torch.Generator(device=self.device).manual_seed(self.seed)
        self.state = generator.get_state()

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Draw from this generator inside the block (the default generator is left where it was)."""
        cuda = self.device.type == "cuda"
        saved = torch.cuda.get_rng_state(self.device) if cuda else torch.get_rng_state()
        (torch.cuda.set_rng_state(self.state, self.device) if cuda else torch.set_rng_state(self.state))
        try:
            yield
        finally:
            self.state = torch.cuda.get_rng_state(self.device) if cuda else torch.get_rng_state()
            (torch.cuda.set_rng_state(saved, self.device) if cuda else torch.set_rng_state(saved))


class RegionDropout(torch.nn.Dropout):
    """``nn.Dropout`` that draws from ``rng`` when its activation is split over the ranks (``rng`` given) and
    from the default generator when every rank holds it whole (``rng=None``)."""

    def __init__(self, p: float, rng: ParallelRNG | None):
        super().__init__(p)
        self.rng = rng

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rng is None or not self.training or self.p == 0:
            return super().forward(x)
        with self.rng.fork():
            return super().forward(x)
