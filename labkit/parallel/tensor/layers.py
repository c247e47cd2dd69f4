"""The split layers of tensor parallelism: column- and row-parallel linear layers, the vocabulary-parallel
embedding, and a cross-entropy that never gathers the logits.

For ``nn.Linear`` (``y = x W^T + b``, ``W`` of shape ``[out, in]``) over ``t`` ranks:

- **column-parallel** (:class:`ColumnParallelLinear`): rank ``r`` holds rows ``r out/t .. (r+1) out/t`` of
  ``W`` and of ``b``, i.e. a slice of the *output* features, and computes that slice of ``y`` from the whole
  ``x``; its input enters the region through ``f`` (or the sequence all-gather);
- **row-parallel** (:class:`RowParallelLinear`): rank ``r`` holds columns ``r in/t .. (r+1) in/t`` of ``W``,
  the *input* features that a column-parallel layer before it produced, computes a partial ``y`` and ``g``
  sums them; the bias is whole on every rank and added once, after the sum (added before, it would count
  ``t`` times).

A column-parallel layer followed by a row-parallel one (the MLP; attention's value and output projections,
split by heads) needs no communication between them: one ``f`` in, one ``g`` out.

**The vocabulary** (:class:`VocabParallelEmbedding`, :func:`vocab_parallel_cross_entropy`) is split by rows
of the ``[vocab, hidden]`` table, which is also the LM head's weight, so a tied embedding and head stay one
``Parameter``.  A vocabulary that ``t`` does not divide is padded with rows of zeros to the next multiple;
their logits are left out of the softmax, so the loss is exactly ``F.cross_entropy`` over the real vocabulary.
labkit pads to a multiple of ``t`` by default, the least that splits evenly.  Megatron-LM pads to a multiple of
``make_vocab_size_divisible_by * t`` (``--make-vocab-size-divisible-by``, default 128, "for computational
efficiency": every rank's slice then a multiple of 128 rows; ``_vocab_size_with_padding`` in
``megatron/training/tokenizer/tokenizer.py``): pass ``divisible_by=128`` for Megatron's sizes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit.models import IGNORE_INDEX
from labkit.parallel.tensor.ops import (
    TensorParallelGroup,
    copy_to_tensor_parallel,
    gathered_linears,
    reduce_from_tensor_parallel,
    reduce_scatter_to_sequence_parallel,
)

MEGATRON_VOCAB_DIVISIBLE_BY = 128  # Megatron-LM's --make-vocab-size-divisible-by default


def padded_size(size: int, tp_degree: int, divisible_by: int = 1) -> int:
    """``size`` rounded up to a multiple of ``divisible_by * tp_degree``: labkit's padding with the default
    ``divisible_by=1``, Megatron-LM's with ``divisible_by=128`` (:data:`MEGATRON_VOCAB_DIVISIBLE_BY`)."""
    for name, value in (("size", size), ("tp_degree", tp_degree), ("divisible_by", divisible_by)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    multiple = divisible_by * tp_degree
    return -(-size // multiple) * multiple


def enter_columns(x: torch.Tensor, layers: list[ColumnParallelLinear], tp: TensorParallelGroup,
                  sequence_parallel: bool, where: str = "") -> list[torch.Tensor]:
    """Column-parallel ``layers`` sharing one input: it enters the region once (``f``, or one all-gather along
    the sequence with sequence parallelism), so backward reduces its gradient once, not once per layer."""
    if sequence_parallel:
        return gathered_linears(x, layers, tp, where)
    x = copy_to_tensor_parallel(x, tp, where)
    # Through each layer's own call, so that its forward hooks see its output (a split backward captures it).
    return [layer(x, entered=True) for layer in layers]


class ColumnParallelLinear(nn.Module):
    """``nn.Linear(in_features, out_features)`` with this rank's ``out_features / t`` output features.

    ``forward(x) -> y_r``: the input is whole (or, with ``sequence_parallel``, this rank's sequence shard), the
    output is this rank's slice of the last dimension; nothing is gathered.
    """

    def __init__(self, in_features: int, out_features: int, tp: TensorParallelGroup, bias: bool = True,
                 sequence_parallel: bool = False, where: str = ""):
        super().__init__()
        if out_features % tp.size:
            raise ValueError(f"out_features={out_features} is not divisible by the tensor-parallel size {tp.size}")
        self.in_features, self.out_features, self.tp = in_features, out_features, tp
        self.sequence_parallel, self.where = sequence_parallel, where
        self.weight = nn.Parameter(torch.empty(out_features // tp.size, in_features))
        self.bias = nn.Parameter(torch.empty(out_features // tp.size)) if bias else None

    @classmethod
    @torch.no_grad()
    def from_dense(cls, dense: nn.Linear, tp: TensorParallelGroup, sequence_parallel: bool = False,
                   where: str = "") -> ColumnParallelLinear:
        """This rank's rows of ``dense``'s weight and bias."""
        layer = cls(dense.in_features, dense.out_features, tp, dense.bias is not None, sequence_parallel, where)
        layer.to(dense.weight.device, dense.weight.dtype)
        layer.weight.copy_(dense.weight.chunk(tp.size, dim=0)[tp.rank])
        if dense.bias is not None:
            layer.bias.copy_(dense.bias.chunk(tp.size, dim=0)[tp.rank])
        return layer

    def forward(self, x: torch.Tensor, entered: bool = False) -> torch.Tensor:
        """``x W_r^T + b_r``; ``entered``: ``x`` has already passed ``f`` (:func:`enter_columns`)."""
        if entered:
            return F.linear(x, self.weight, self.bias)
        if self.sequence_parallel:
            return enter_columns(x, [self], self.tp, self.sequence_parallel, self.where)[0]
        return F.linear(copy_to_tensor_parallel(x, self.tp, self.where), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (this rank: " \
               f"{self.weight.shape[0]}), tp={self.tp.size}, sequence_parallel={self.sequence_parallel}"


class RowParallelLinear(nn.Module):
    """``nn.Linear(in_features, out_features)`` with this rank's ``in_features / t`` input features.

    ``forward(x_r) -> y``: the input is this rank's slice of the last dimension (a column-parallel layer's
    output); the partial products are summed (``g``; a reduce-scatter along the sequence with
    ``sequence_parallel``), then the whole bias is added once.
    """

    def __init__(self, in_features: int, out_features: int, tp: TensorParallelGroup, bias: bool = True,
                 sequence_parallel: bool = False, where: str = ""):
        super().__init__()
        if in_features % tp.size:
            raise ValueError(f"in_features={in_features} is not divisible by the tensor-parallel size {tp.size}")
        self.in_features, self.out_features, self.tp = in_features, out_features, tp
        self.sequence_parallel, self.where = sequence_parallel, where
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp.size))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    @classmethod
    @torch.no_grad()
    def from_dense(cls, dense: nn.Linear, tp: TensorParallelGroup, sequence_parallel: bool = False,
                   where: str = "") -> RowParallelLinear:
        """This rank's columns of ``dense``'s weight, and its whole bias."""
        layer = cls(dense.in_features, dense.out_features, tp, dense.bias is not None, sequence_parallel, where)
        layer.to(dense.weight.device, dense.weight.dtype)
        layer.weight.copy_(dense.weight.chunk(tp.size, dim=1)[tp.rank])
        if dense.bias is not None:
            layer.bias.copy_(dense.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel(partial, self.tp, self.where)
        else:
            y = reduce_from_tensor_parallel(partial, self.tp, self.where)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (this rank: {self.weight.shape[1]}), " \
               f"out_features={self.out_features}, tp={self.tp.size}, sequence_parallel={self.sequence_parallel}"


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding(num_embeddings, embedding_dim)`` with this rank's rows of the (padded) vocabulary.

    ``forward(ids) -> x``: every rank looks up the ids in its range (zeros for the others) and the partial
    embeddings are summed (``g``; a reduce-scatter along the sequence with ``sequence_parallel``).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallelGroup,
                 sequence_parallel: bool = False, where: str = "embedding", divisible_by: int = 1):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.tp = num_embeddings, embedding_dim, tp
        self.sequence_parallel, self.where = sequence_parallel, where
        rows = padded_size(num_embeddings, tp.size, divisible_by) // tp.size
        self.vocab_start = tp.rank * rows
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim))

    @classmethod
    @torch.no_grad()
    def from_dense(cls, dense: nn.Embedding, tp: TensorParallelGroup, sequence_parallel: bool = False,
                   divisible_by: int = 1) -> VocabParallelEmbedding:
        """This rank's rows of ``dense``'s table (the padding rows are zeros; ``divisible_by``: see
        :func:`padded_size`)."""
        layer = cls(dense.num_embeddings, dense.embedding_dim, tp, sequence_parallel, divisible_by=divisible_by)
        layer.to(dense.weight.device, dense.weight.dtype)
        layer.weight.zero_()
        mine = dense.weight[layer.vocab_start:layer.vocab_start + layer.weight.shape[0]]
        layer.weight[:mine.shape[0]].copy_(mine)
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        partial = F.embedding(local.masked_fill_(outside, 0), self.weight).masked_fill(outside[..., None], 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel(partial, self.tp, self.where)
        return reduce_from_tensor_parallel(partial, self.tp, self.where)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim} (this rank: rows {self.vocab_start}.." \
               f"{self.vocab_start + self.weight.shape[0] - 1}), tp={self.tp.size}"


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, tp: TensorParallelGroup,
                vocab_size: int) -> torch.Tensor:
        rows = logits.shape[-1]
        start = tp.rank * rows
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        logits = logits.reshape(-1, rows)
        logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        padding = torch.arange(start, start + rows, device=logits.device) >= vocab_size
        if padding.any():  # padding columns of the vocabulary take no part in the softmax
            logits = logits.masked_fill(padding, float("-inf"))
        maximum = logits.max(dim=-1).values  # 1: the largest logit, for a softmax that cannot overflow
        if tp.size > 1:
            tp.all_reduce(maximum, "loss", op=dist.ReduceOp.MAX)
        exp = (logits - maximum[:, None]).exp_()
        sum_exp = exp.sum(dim=-1)  # 2: the softmax's denominator
        local_targets = targets.reshape(-1) - start
        outside = (local_targets < 0) | (local_targets >= rows)
        local_targets = local_targets.masked_fill_(outside, 0)
        target_logit = logits.gather(1, local_targets[:, None]).squeeze(1).masked_fill_(outside, 0.0)
        target_logit = target_logit - maximum.masked_fill(outside, 0.0)  # 3: the target's logit, shifted
        if tp.size > 1:
            tp.all_reduce(sum_exp, "loss")
            tp.all_reduce(target_logit, "loss")
        counted = targets.reshape(-1) != IGNORE_INDEX  # F.cross_entropy's ignore_index: padding is left out
        ctx.counted = int(counted.sum())
        loss = ((sum_exp.log() - target_logit) * counted).sum() / ctx.counted
        softmax = exp.div_(sum_exp[:, None])
        if ctx.counted < counted.numel():
            softmax[~counted] = 0.0  # an ignored row's gradient is zero (its target is outside every slice)
        ctx.save_for_backward(softmax, local_targets, outside)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local_targets, outside = ctx.saved_tensors
        grad_logits = softmax.clone()
        rows = torch.arange(grad_logits.shape[0], device=grad_logits.device)
        grad_logits[rows, local_targets] -= (~outside).to(grad_logits.dtype)
        grad_logits.mul_(grad / ctx.counted)
        return grad_logits.view(ctx.shape).to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, tp: TensorParallelGroup,
                                 vocab_size: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of ``targets`` against logits whose last dimension is this rank's slice of the
    vocabulary (``[..., V_padded / t]``), equal to ``F.cross_entropy`` on the gathered ``[..., vocab_size]``
    logits; the logits are never gathered.  Forward all-reduces three vectors of one value per token: the
    largest logit, the sum of exponentials, the target's logit.  ``vocab_size`` (default: all the columns)
    leaves the padding columns out.  Targets equal to ``-100`` (``F.cross_entropy``'s ``ignore_index``, a padded
    sequence's end) are left out of the mean."""
    vocab_size = logits.shape[-1] * tp.size if vocab_size is None else vocab_size
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits of shape {tuple(logits.shape)} need targets of shape {tuple(logits.shape[:-1])}, "
                         f"got {tuple(targets.shape)}")
    return _VocabParallelCrossEntropy.apply(logits, targets, tp, vocab_size)
