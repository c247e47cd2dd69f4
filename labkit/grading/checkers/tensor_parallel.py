"""Checks for exercise 06 (``06_tensor_parallel.py``): f and g, split_column and split_row, the column- and
row-parallel forwards.

Each check grades one part; the others are the reference's.  ``split_column`` and ``split_row`` run in this
process for every rank of 1, 2, 3, 4 and 6, on non-square weights (a split along the wrong dimension has the
wrong shape), with and without a bias; the shards must be copies (a view keeps the whole weight alive), and a
size the world size does not divide must raise.  The other checks are one launch each of 4 gloo ranks, which
form tensor-parallel groups three ways (:mod:`~labkit.grading.checkers.tensor_parallel_data`): the default group
of 4 (``group=None``), ``[0, 1, 2]`` beside ``[3]`` alone, and ``[0, 1]`` beside ``[2, 3]``.  Every group works
on its own data, so a reduction over the wrong group gives wrong numbers rather than a hang.  ``f`` and ``g``
are probed one at a time (:mod:`~labkit.grading.checkers.tensor_parallel_fg`: different inputs and gradients on
every rank, shared, transposed and broadcast gradients, no change in place, no message where none belongs),
then inside an MLP; each layer's forward runs with the reference ``f`` and ``g`` put in their place in the
student's module, under the recorder of the probes: a layer may send nothing but what those f and g send (an
all-reduce or broadcast of x, or an all-gather to "check" g's sum, is a message per layer for nothing).  Outputs and the gradients of the input, the weights and the biases are compared with one
process running the dense layers, inputs ``[n, in]`` and ``[batch, seq, in]``, in float64, within 1e-9; when a
result is a multiple of the truth, the hint says by what factor.  Besides ``labkit.parallel``,
:mod:`labkit.grading.guard` forbids torch's own tensor parallelism (DTensor, ``parallelize_module``) and the
differentiable collectives of ``torch.distributed.nn``: ``f`` and ``g`` are built from ``dist.all_reduce``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.grading import CheckFailed, guard
from labkit.grading.checkers import tensor_parallel_data as common
from labkit.grading.checkers.tensor_parallel_data import BATCH_SHAPES, BUILT_INS
from labkit.grading.checkers.tensor_parallel_fg import Communication, check_f_and_g

__all__ = ["BUILT_INS", "CHECKS", "check_column_parallel_forward", "check_f_and_g", "check_row_parallel_forward",
           "check_split"]


_IN_REFERENCE = [False]  # True while the reference f or g communicates: the layer's recorder lets it pass


def _reference_all_reduce(tensor: torch.Tensor, group) -> None:
    _IN_REFERENCE[0] = True
    try:
        dist.all_reduce(tensor, group=group)
    finally:
        _IN_REFERENCE[0] = False


class _Copy(torch.autograd.Function):  # the reference f
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        _reference_all_reduce(grad, ctx.group)
        return grad, None


class _Reduce(torch.autograd.Function):  # the reference g
    @staticmethod
    def forward(ctx, x, group):
        total = x.contiguous().clone()
        _reference_all_reduce(total, group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# --------------------------------------------------------------------------------------------------------
# split_column, split_row

SPLIT_SHAPES = [(24, 12), (12, 36), (48, 24)]  # [out, in]: not square; every size divides by 2, 3, 4, 6
SPLIT_WORLD_SIZES = (1, 2, 3, 4, 6)  # one rank holds it all (still a copy); 3 and 6 are not powers of two
INDIVISIBLE = [("split_column", (10, 12), 4), ("split_row", (12, 10), 3), ("split_column", (8, 12), 3)]


def _call(function: Callable, call: str, *args):
    try:
        return function(*args)
    except NotImplementedError:
        raise
    except Exception as error:
        raise CheckFailed(f"{call} raised {type(error).__name__}: {error}") from None


def _check_shard(got, want: torch.Tensor, full: torch.Tensor, call: str, other: torch.Tensor | None) -> None:
    if not isinstance(got, torch.Tensor):
        raise CheckFailed(f"{call} returned {type(got).__name__} where a tensor was expected (did you forget the "
                          "return?)")
    if other is not None and common.is_(got, other):
        raise CheckFailed(f"{call} returned the block of the other dimension: column-parallel splits the output "
                          "features (rows of the weight [out, in], dimension 0), row-parallel the input features "
                          "(columns, dimension 1)")
    if tuple(got.shape) != tuple(want.shape) or not torch.equal(got, want):
        raise CheckFailed(f"{call} returned a tensor of shape {list(got.shape)}"
                          + (" with other values" if tuple(got.shape) == tuple(want.shape) else "")
                          + f"; expected block `rank` of `world_size` equal contiguous blocks, {list(want.shape)}")
    if got.untyped_storage().data_ptr() == full.untyped_storage().data_ptr():
        raise CheckFailed(f"{call} returned a view of the whole tensor: it keeps all {full.numel()} elements in "
                          "memory on every rank, the memory tensor parallelism exists to save; return a copy "
                          "(.clone())")


@guard.no_shortcuts(built_ins=BUILT_INS)
def check_split(module) -> None:
    """split_column gives each rank its block of output rows, split_row its block of input columns"""
    for out_features, in_features in SPLIT_SHAPES:
        weight = common.data((out_features, in_features), "split", out_features)
        bias = common.data((out_features,), "split bias", out_features)
        for world_size in SPLIT_WORLD_SIZES:
            for rank in range(world_size):
                rows = common.block(out_features, rank, world_size)
                columns = common.block(in_features, rank, world_size)
                with_bias, shape = (rank + world_size) % 2 == 0, f"weight [{out_features}, {in_features}]"
                arguments = f"rank={rank}, world_size={world_size}"
                call = f"split_column({shape}, {'bias' if with_bias else 'None'}, {arguments})"
                got = _call(module.split_column, call, weight, bias if with_bias else None, rank, world_size)
                if not (isinstance(got, tuple) and len(got) == 2):
                    raise CheckFailed(f"{call} returned {type(got).__name__}; return (weight_shard, bias_shard)")
                other = weight[:, columns] if world_size > 1 else None  # one rank: both blocks are the weight
                _check_shard(got[0], weight[rows], weight, call, other)
                if with_bias:
                    _check_shard(got[1], bias[rows], bias, f"{call}, for the bias,", None)
                elif got[1] is not None:
                    raise CheckFailed(f"{call} returned a bias shard for no bias: return None in its place")
                call = f"split_row({shape}, {arguments})"
                _check_shard(_call(module.split_row, call, weight, rank, world_size), weight[:, columns], weight,
                             call, weight[rows] if world_size > 1 else None)
    for function, shape, world_size in INDIVISIBLE:
        size, bias = (shape[0], (None,)) if function == "split_column" else (shape[1], ())
        call = f"{function}(weight {list(shape)}, {'None, ' if bias else ''}rank=0, world_size={world_size})"
        try:
            getattr(module, function)(torch.zeros(shape), *bias, 0, world_size)
        except ValueError as error:
            if str(size) not in str(error) or str(world_size) not in str(error):
                raise CheckFailed(f"{call} raised ValueError({str(error)!r}): name the size ({size}) and the world "
                                  f"size ({world_size}) in the message") from None
            continue
        raise CheckFailed(f"{call} did not raise: {world_size} does not divide {size}; raise ValueError")


# --------------------------------------------------------------------------------------------------------
# The layers

WHAT = {"column": {"y": "the output (this rank's slice of the output features)", "x": "the gradient of x",
                   "weight": "the gradient of the weight shard", "bias": "the gradient of the bias shard"},
        "row": {"y": "the output (the same on every rank)", "x": "the gradient of this rank's input shard",
                "weight": "the gradient of the weight shard",
                "bias": "the gradient of the bias (whole on every rank)"}}


def _layer_on_rank(kind: str, module, ranks, group, index) -> dict:
    module.CopyToTensorParallel, module.ReduceFromTensorParallel = _Copy, _Reduce  # grade the layer alone
    r, results = ranks.index(dist.get_rank()), {}
    cuts, full = common.cuts(kind, r, len(ranks)), common.layer(kind, tuple(ranks), index)
    for with_bias in (True, False):
        mine = {name: full[name][cuts[name]].clone().requires_grad_() for name in ("x", "weight", "bias")}
        forward, recorder = getattr(module, f"{kind}_parallel_forward"), _BesidesTheReference()
        with recorder:
            recorder.phase = "forward"
            y = forward(mine["x"], mine["weight"], mine["bias"] if with_bias else None, group)
            upstream = full["upstream"][cuts["y"]]
            if isinstance(y, torch.Tensor) and y.shape == upstream.shape and y.requires_grad:
                recorder.phase = "backward"
                y.backward(upstream)
        results[with_bias] = {"y": y.detach().clone() if isinstance(y, torch.Tensor) else y,
                              **{name: mine[name].grad for name in ("x", "weight", "bias")},
                              "besides": [(phase, op) for phase, op, _ in recorder.seen if phase != "reference"]}
    return results


class _BesidesTheReference(Communication):
    """The probes' recorder, which marks what the reference f and g send as ``"reference"``."""

    def __torch_dispatch__(self, func, op_types, args=(), kwargs=None):
        phase, self.phase = self.phase, "reference" if _IN_REFERENCE[0] else self.phase
        try:
            return super().__torch_dispatch__(func, op_types, args, kwargs)
        finally:
            self.phase = phase


EXTRA = {"column": "every rank already holds the whole x, which f passes on unchanged: the layer's one message is "
                   "f's all-reduce of the gradient of x, in backward",
         "row": "g's all-reduce is the layer's one message: after it every rank holds the same sum already"}


def _dense_layer(kind: str, key: tuple, index: int, with_bias: bool) -> dict[str, torch.Tensor]:
    full = common.layer(kind, key, index)
    x, weight, bias = (full[name].requires_grad_() for name in ("x", "weight", "bias"))
    y = F.linear(x, weight, bias if with_bias else None)
    y.backward(full["upstream"])
    return {"y": y.detach(), "x": x.grad, "weight": weight.grad, "bias": bias.grad, "bias value": bias.detach()}


def _check_layer(module, kind: str) -> None:
    for ranks, results in common.on_every_group(functools.partial(_layer_on_rank, kind), module):
        t = len(ranks)
        for index in range(len(BATCH_SHAPES)):
            for with_bias in (True, False):
                dense = _dense_layer(kind, tuple(ranks), index, with_bias)
                for r, result in enumerate(outcome[index][with_bias] for outcome in results):
                    where = (f"{kind}_parallel_forward, {common.where(ranks, r, index)}, "
                             f"{'with' if with_bias else 'no'} bias")
                    cuts, y, hint = common.cuts(kind, r, t), result["y"], ""
                    if result["besides"]:
                        phase, op = result["besides"][0]
                        raise CheckFailed(f"{where}: {kind}_parallel_forward ran {op} in {phase}, besides f and g: "
                                          f"{EXTRA[kind]} (this check puts the reference f and g in your module, "
                                          "so the message is the layer's own)")
                    if kind == "row" and with_bias and isinstance(y, torch.Tensor) and not common.is_(y, dense["y"]) \
                            and y.shape == dense["y"].shape:
                        difference, bias = y - dense["y"], dense["bias value"].expand_as(y)
                        extra = ((difference * bias).sum() / (bias * bias).sum()).item()
                        if common.is_(difference, bias, extra):
                            raise CheckFailed(f"{where}: the output has the bias {1 + extra:.4g} times over: add the "
                                              "whole bias once, after g's sum (added on each rank before it, it "
                                              "counts once per rank)")
                    if kind == "column" and t > 1 and not common.is_(result["x"], dense["x"]):
                        hint = (": each rank's product covers only its own output features, so its gradient of x "
                                "is a partial sum; pass x through f (CopyToTensorParallel) so that backward sums "
                                "it over the group")
                    for name in ("y", "x", "weight", "bias") if with_bias else ("y", "x", "weight"):
                        common.compare(result[name], dense[name][cuts[name]], f"{where}: {WHAT[kind][name]}",
                                 hint if name == "x" else "")


@guard.no_shortcuts(built_ins=BUILT_INS)
def check_column_parallel_forward(module) -> None:
    """column_parallel_forward gives each rank its slice of the dense layer's output, and its gradients"""
    _check_layer(module, "column")


@guard.no_shortcuts(built_ins=BUILT_INS)
def check_row_parallel_forward(module) -> None:
    """row_parallel_forward gives every rank the dense layer's output (bias once), and its gradients"""
    _check_layer(module, "row")


CHECKS = [check_f_and_g, check_split, check_column_parallel_forward, check_row_parallel_forward]
