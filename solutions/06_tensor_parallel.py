"""Exercise 06 — Tensor parallelism: the f and g operators, column- and row-parallel linear layers (solution).

Data parallelism and ZeRO copy or shard the *state* of a model, but every rank still runs every layer whole: a
layer whose weights or activations do not fit one device stays out of reach.  Megatron-LM's tensor parallelism
(Shoeybi et al., 2019) splits the matrices themselves over ``t`` ranks, so that each holds and multiplies
``1/t`` of every weight.  For ``nn.Linear`` (``y = x W^T + b``, ``W`` of shape ``[out, in]``):

- **column-parallel**: rank ``r`` holds a block of ``out/t`` *rows* of ``W`` (and the same slice of ``b``), the
  output features ``r out/t .. (r+1) out/t``.  From the whole ``x`` it computes its slice of ``y``, with no
  communication::

      W = [ W_0 ]   rank 0        y = [ x W_0^T + b_0 | x W_1^T + b_1 ]   (last dimension, out/t each)
          [ W_1 ]   rank 1

- **row-parallel**: rank ``r`` holds a block of ``in/t`` *columns* of ``W``, the input features that a
  column-parallel layer before it left on that rank.  Each rank's product is a partial sum of ``y``, and the
  ranks add them up: ``y = x_0 W_0^T + x_1 W_1^T + b``.  The bias is whole on every rank, and added once,
  after the sum (added before it, it would be counted ``t`` times).

An MLP ``row(gelu(column(x)))`` then needs exactly one all-reduce forward (the row layer's sum) and one
backward, the two *conjugate* operators that mark the region where activations are split:

- ``f`` at its entry (:class:`CopyToTensorParallel`): forward, the identity (every rank already holds ``x``);
  backward, an all-reduce, because each rank's gradient of ``x`` only covers the columns of ``W`` it holds;
- ``g`` at its exit (:class:`ReduceFromTensorParallel`): forward, an all-reduce of the partial sums; backward,
  the identity (the gradient of a sum reaches every term unchanged).

Each is the other's transpose.  The cost: per MLP and per step, two all-reduces of the activations (``b s h``
values of ``[batch, seq, hidden]``; a ring moves ``2 (t-1)/t`` of them per rank), on the critical path, which
is why tensor parallelism stays within a node's fast links.  In exchange a rank holds ``1/t`` of the weights,
their gradients and optimizer state, and of the hidden activations between the two layers.

Used on every rank of the tensor-parallel ``group`` (``None``: all ranks), the MLP equals the dense one::

    rank, t = dist.get_rank(group), dist.get_world_size(group)             # this rank within the group
    w1, b1 = split_column(dense.fc1.weight, dense.fc1.bias, rank, t)       # once: keep your shards
    w2 = split_row(dense.fc2.weight, rank, t)
    hidden = gelu(column_parallel_forward(x, w1, b1, group))                # [..., hidden/t], split
    y = row_parallel_forward(hidden, w2, dense.fc2.bias, group)             # [..., out], whole on every rank
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F


class CopyToTensorParallel(torch.autograd.Function):
    """Megatron's ``f``: the identity forward; backward, the gradient summed over ``group``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()  # the incoming gradient may be shared: reduce a copy
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's ``g``: forward, ``x`` summed over ``group`` (into a new tensor); backward, the identity."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        total = x.contiguous().clone()  # all_reduce works in place: never change the caller's tensor
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def split_column(weight: torch.Tensor, bias: torch.Tensor | None, rank: int,
                 world_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rank ``rank``'s shard of an ``nn.Linear`` for a column-parallel layer: the contiguous block of
    ``out/world_size`` rows of ``weight`` (``[out, in]``), block ``rank``, and the same slice of ``bias``
    (``None`` stays ``None``).  The shards are copies, so that the whole weight can be freed.  Raises
    ``ValueError`` when ``world_size`` does not divide ``out``."""
    rows = _block(weight.shape[0], rank, world_size, "output features (rows of the weight)")
    return weight[rows].clone(), None if bias is None else bias[rows].clone()


def split_row(weight: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s shard of an ``nn.Linear`` weight (``[out, in]``) for a row-parallel layer: the contiguous
    block of ``in/world_size`` columns, block ``rank``, as a copy.  Raises ``ValueError`` when ``world_size``
    does not divide ``in``."""
    columns = _block(weight.shape[1], rank, world_size, "input features (columns of the weight)")
    return weight[:, columns].clone()


def _block(size: int, rank: int, world_size: int, what: str) -> slice:
    if size % world_size:
        raise ValueError(f"cannot split {size} {what} evenly over {world_size} ranks")
    block = size // world_size
    return slice(rank * block, (rank + 1) * block)


def column_parallel_forward(x: torch.Tensor, weight_shard: torch.Tensor, bias_shard: torch.Tensor | None,
                            group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """A column-parallel linear layer on this rank: ``x`` (``[..., in]``, the same on every rank of ``group``)
    enters the region through ``f``, then the local product gives this rank's slice of the output features
    (``[..., out/t]``)."""
    return F.linear(CopyToTensorParallel.apply(x, group), weight_shard, bias_shard)


def row_parallel_forward(x_shard: torch.Tensor, weight_shard: torch.Tensor, bias: torch.Tensor | None,
                         group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """A row-parallel linear layer on this rank: the local product of this rank's input features
    (``[..., in/t]``) is a partial sum of the output, ``g`` adds the partial sums up, and the whole ``bias``
    (or ``None``) is added once, after the sum.  The result (``[..., out]``) is the same on every rank."""
    y = ReduceFromTensorParallel.apply(F.linear(x_shard, weight_shard), group)
    return y if bias is None else y + bias
