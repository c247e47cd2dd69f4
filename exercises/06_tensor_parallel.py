"""Exercise 06 — Tensor parallelism: the f and g operators, column- and row-parallel linear layers.

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

Complete the classes and functions, then run the grading cell of ``notebooks/06_tensor_parallel.ipynb`` (or
``labkit grade``).  The checks run them on 2, 3 and 4 gloo ranks (and a group of one), on inputs ``[n, in]``
and ``[batch, seq, in]``, and compare the output and the gradients of the input, the weights and the biases
with one process running the dense layers, in float64.  They probe ``f`` and ``g`` alone too, with other
numbers on every rank, with gradients that are shared with the rest of the graph, transposed or broadcast,
and they watch which collectives each operator runs and what it changes in place: f's backward and g's
forward run one all-reduce each, and a layer sends nothing besides its f and g.  While they run, labkit's
own tensor parallelism (``labkit.parallel``), DTensor's (``torch.distributed.tensor``) and the differentiable
collectives of ``torch.distributed.nn`` are switched off: build ``f`` and ``g`` from ``dist.all_reduce``.
"""

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)
import torch.nn.functional as F  # noqa: F401  (F.linear(x, weight, bias) is x @ weight.T + bias)


class CopyToTensorParallel(torch.autograd.Function):
    """Megatron's ``f``: the identity forward; backward, the gradient summed over ``group``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        # TODO: every rank already holds the whole x, so nothing needs to be sent on the way in.  Backward will
        #       need something only forward is told: keep it on ctx.
        raise NotImplementedError("CopyToTensorParallel.forward")

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # TODO: each rank's grad comes from its own slice of the layer that follows, so the gradient of x is
        #       the sum over the group's ranks.  Mind the primitive's manners: it works in place, and grad may
        #       be shared with the rest of the graph or be non-contiguous (NCCL refuses those).  Return one
        #       gradient per input of forward (the group gets none).
        raise NotImplementedError("CopyToTensorParallel.backward")


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's ``g``: forward, ``x`` summed over ``group`` (into a new tensor); backward, the identity."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        # TODO: x is this rank's partial sum of the output; every rank needs the total.  The caller's x must
        #       come out of this unchanged.
        raise NotImplementedError("ReduceFromTensorParallel.forward")

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # TODO: if y = x_0 + x_1 + ..., what is dy/dx_r, and does computing it need any other rank?  (An
        #       average over the group looks right only when every rank holds the same gradient.)
        raise NotImplementedError("ReduceFromTensorParallel.backward")


def split_column(weight: torch.Tensor, bias: torch.Tensor | None, rank: int,
                 world_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rank ``rank``'s shard of an ``nn.Linear`` for a column-parallel layer: the contiguous block of
    ``out/world_size`` rows of ``weight`` (``[out, in]``), block ``rank``, and the same slice of ``bias``
    (``None`` stays ``None``).  The shards are copies, so that the whole weight can be freed.  Raises
    ``ValueError`` when ``world_size`` does not divide ``out``."""
    # TODO: which dimension of weight [out, in] holds the output features?  Keep block `rank` of world_size
    #       equal contiguous blocks of it, and the same entries of bias.  Refuse a size that world_size does not
    #       divide (a ValueError naming both numbers).  A slice is a view: what would it keep in memory?
    raise NotImplementedError("split_column")


def split_row(weight: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s shard of an ``nn.Linear`` weight (``[out, in]``) for a row-parallel layer: the contiguous
    block of ``in/world_size`` columns, block ``rank``, as a copy.  Raises ``ValueError`` when ``world_size``
    does not divide ``in``."""
    # TODO: split_column's rule, along the input features.  Why does a row-parallel layer not split its bias?
    raise NotImplementedError("split_row")


def column_parallel_forward(x: torch.Tensor, weight_shard: torch.Tensor, bias_shard: torch.Tensor | None,
                            group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """A column-parallel linear layer on this rank: ``x`` (``[..., in]``, the same on every rank of ``group``)
    enters the region through ``f``, then the local product gives this rank's slice of the output features
    (``[..., out/t]``)."""
    # TODO: forward, the local product needs no other rank.  Backward, though, the gradient of x that this
    #       rank's slice produces is partial: which of your two operators makes autograd add them up?
    raise NotImplementedError("column_parallel_forward")


def row_parallel_forward(x_shard: torch.Tensor, weight_shard: torch.Tensor, bias: torch.Tensor | None,
                         group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """A row-parallel linear layer on this rank: the local product of this rank's input features
    (``[..., in/t]``) is a partial sum of the output, ``g`` adds the partial sums up, and the whole ``bias``
    (or ``None``) is added once, after the sum.  The result (``[..., out]``) is the same on every rank."""
    # TODO: the local product is a partial sum of the output; which operator adds the partial sums?  The bias
    #       is whole on every rank: where must it be added so that it counts once, not t times?
    raise NotImplementedError("row_parallel_forward")
