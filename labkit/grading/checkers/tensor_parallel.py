"""Checks for exercise 06 (``06_tensor_parallel.py``): f and g, split_column and split_row, the column- and
row-parallel forwards.

Each check grades one part; the others are the reference's.  ``split_column`` and ``split_row`` run in this
process for every rank of 2, 3 and 4, on non-square weights (a split along the wrong dimension has the wrong
shape), with and without a bias; the shards must be copies (a view keeps the whole weight alive), and a size the
world size does not divide must raise.  The other checks are one launch each of 4 gloo ranks, which form
tensor-parallel groups three ways: the default group of 4 (``group=None``), ``[0, 1, 2]`` beside ``[3]`` alone,
and ``[0, 1]`` beside ``[2, 3]``.  Every group works on its own data, so a reduction over the wrong group gives
wrong numbers rather than a hang.  ``f`` and ``g`` are probed one at a time (``f`` is handed a different
gradient on every rank, ``g`` a different partial sum), then inside the MLP ``g(gelu(f(x) W1_r^T + b1_r) W2_r^T)
+ b2`` of the reference split; each layer's forward runs with the reference ``f`` and ``g`` put in their place
in the student's module.  Outputs and the gradients of the input, the weights and the biases are compared with
one process running the dense layers, inputs ``[n, in]`` and ``[batch, seq, in]``, in float64, within 1e-9;
when a result is a multiple of the truth, the hint says by what factor.  Besides ``labkit.parallel``,
:mod:`labkit.grading.guard` forbids torch's own tensor parallelism (DTensor, ``parallelize_module``) and the
differentiable collectives of ``torch.distributed.nn``: ``f`` and ``g`` are built from ``dist.all_reduce``.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable

import torch

# launch() imports torch._dynamo before it forks the ranks, a second in every check process that lacks it:
# import it once, here, and the check processes forked later inherit it.
import torch._dynamo  # noqa: F401
import torch.distributed as dist
import torch.nn.functional as F

from labkit.grading import CheckFailed, guard
from labkit.launch import launch

LAUNCH_TIMEOUT = 60.0  # seconds a distributed check may take before the ranks count as hung
TOLERANCE = 1e-9  # float64 on one machine; the wrong answers miss by a factor or by a bias
BUILT_INS = ("torch.distributed.tensor._api", "torch.distributed.tensor.parallel",
             "torch.distributed.nn.functional")
WORLD_SIZE = 4
LAYOUTS = [[[0, 1, 2, 3]], [[0, 1, 2], [3]], [[0, 1], [2, 3]]]  # the groups of each; every rank is in one
IN_FEATURES, HIDDEN, OUT_FEATURES = 12, 24, 10  # IN_FEATURES and HIDDEN divide by 2, 3 and 4
BATCH_SHAPES = [(5,), (2, 3)]  # inputs [5, features] and [2, 3, features]


def _data(shape: tuple[int, ...], *key: object) -> torch.Tensor:
    """The same float64 numbers for the same key, in every process."""
    generator = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
    return torch.randn(shape, generator=generator, dtype=torch.float64)


def _block(size: int, rank: int, world_size: int) -> slice:
    return slice(rank * size // world_size, (rank + 1) * size // world_size)


def _cuts(kind: str, r: int, t: int) -> dict[str, tuple]:
    """What rank ``r`` of ``t`` holds of a column- or row-parallel layer's input, weight, bias and output."""
    block = _block(HIDDEN, r, t)  # the column layer's output features, the row layer's input features
    if kind == "column":
        return {"x": (...,), "weight": (block,), "bias": (block,), "y": (..., block)}
    return {"x": (..., block), "weight": (slice(None), block), "bias": (...,), "y": (...,)}


def _layer(kind: str, key: tuple, index: int) -> dict[str, torch.Tensor]:
    """The dense layer's input, weight, bias and the gradient of its output: IN->HIDDEN or HIDDEN->OUT."""
    features_in, features_out = (IN_FEATURES, HIDDEN) if kind == "column" else (HIDDEN, OUT_FEATURES)
    batch = BATCH_SHAPES[index]
    return {"x": _data((*batch, features_in), kind, "x", key, index),
            "weight": _data((features_out, features_in), kind, "weight", key, index),
            "bias": _data((features_out,), kind, "bias", key, index),
            "upstream": _data((*batch, features_out), kind, "upstream", key, index)}


class _Copy(torch.autograd.Function):  # the reference f
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Reduce(torch.autograd.Function):  # the reference g
    @staticmethod
    def forward(ctx, x, group):
        total = x.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# --------------------------------------------------------------------------------------------------------
# Running on the ranks, comparing here


def _on_every_group(test: Callable, module) -> dict:
    """Runs on every rank: ``test(module, ranks, group, index)`` in this rank's group of each layout."""
    rank, results = dist.get_rank(), {}
    for layout in LAYOUTS:
        for ranks in layout:  # every rank creates every group, in the same order
            group = None if len(ranks) == WORLD_SIZE else dist.new_group(ranks)
            if rank in ranks:
                results[tuple(ranks)] = [test(module, ranks, group, index) for index in range(len(BATCH_SHAPES))]
    return results


def _launch(test: Callable, module) -> list[tuple[list[int], list[list]]]:
    """``(ranks, results)`` for every group, in layout order; ``results[r][index]`` from the group's rank r."""
    per_rank = launch(_on_every_group, test, module, nprocs=WORLD_SIZE, timeout=LAUNCH_TIMEOUT,
                      rank_output="none")
    return [(ranks, [per_rank[rank][tuple(ranks)] for rank in ranks]) for layout in LAYOUTS for ranks in layout]


def _is(got: torch.Tensor | None, want: torch.Tensor, factor: float = 1.0) -> bool:
    """``got`` is ``factor * want``, within the tolerance."""
    if got is None or tuple(got.shape) != tuple(want.shape):
        return False
    return (got - factor * want).abs().max().item() <= TOLERANCE * max(1.0, abs(factor))


def _compare(got: torch.Tensor | None, want: torch.Tensor, what: str, hint: str = "",
             truth: str = "the dense layers'") -> None:
    if not isinstance(got, torch.Tensor):
        raise CheckFailed(f"{what} is {got!r}, not a tensor" + (" (is every step differentiable, nothing "
                                                                 "detached?)" if got is None else ""))
    if tuple(got.shape) != tuple(want.shape):
        raise CheckFailed(f"{what} has shape {list(got.shape)}, expected {list(want.shape)}")
    worst = (got - want).abs().max().item()
    if worst > TOLERANCE:
        factor = ((got * want).sum() / (want * want).sum()).item() if want.any() else 0.0
        times = f"; it is {factor:.4g} times the right one" if _is(got, want, factor) and factor else ""
        raise CheckFailed(f"{what} differs from {truth} by up to {worst:.2e}{times}{hint}")


def _where(ranks: list[int], r: int, index: int) -> str:
    group = "the default group (None)" if len(ranks) == WORLD_SIZE else f"the group of ranks {ranks}"
    return f"t={len(ranks)}, {group}, its rank {r}, inputs [{', '.join(map(str, BATCH_SHAPES[index]))}, features]"


def _group_hint(ranks: list[int]) -> str:
    return ("" if len(ranks) == WORLD_SIZE else " (the same passed on the default group of 4 ranks: do you pass "
            "group=group to every collective?)")


# --------------------------------------------------------------------------------------------------------
# f and g


def _f_and_g_on_rank(module, ranks, group, index) -> dict:
    key, r, batch = tuple(ranks), ranks.index(dist.get_rank()), BATCH_SHAPES[index]
    out = {}
    for name, features in (("f", IN_FEATURES), ("g", OUT_FEATURES)):
        operator = module.CopyToTensorParallel if name == "f" else module.ReduceFromTensorParallel
        # f gets the same x on every rank and a different gradient; g a different x and the same gradient
        leaf = _data((*batch, features), name, key, index, r if name == "g" else 0).requires_grad_()
        x = leaf.clone()  # not a leaf, so that a change in place shows instead of raising
        y = operator.apply(x, group)
        if isinstance(y, torch.Tensor) and y.requires_grad:
            y.backward(_data(tuple(y.shape), name, "grad", key, index, r if name == "f" else 0))
        out[name] = (y.detach().clone() if isinstance(y, torch.Tensor) else y, x.detach().clone(), leaf.grad)
    column, row = _layer("column", key, index), _layer("row", key, index)
    mine = {name: tensor[_mlp_cuts(r, len(ranks)).get(name, (...,))].clone().requires_grad_() for name, tensor in
            (("x", column["x"]), ("w1", column["weight"]), ("b1", column["bias"]), ("w2", row["weight"]),
             ("b2", row["bias"]))}
    try:
        hidden = F.gelu(F.linear(module.CopyToTensorParallel.apply(mine["x"], group), mine["w1"], mine["b1"]))
        y = module.ReduceFromTensorParallel.apply(F.linear(hidden, mine["w2"]), group) + mine["b2"]
        y.backward(row["upstream"])
    except CheckFailed:
        raise
    except Exception as error:  # reported after the probes, which say more
        out["mlp"] = f"{type(error).__name__}: {error}"
        return out
    out["mlp"] = {"y": y.detach().clone(), **{name: tensor.grad for name, tensor in mine.items()}}
    return out


def _mlp_cuts(r: int, t: int) -> dict[str, tuple]:
    return {"w1": _cuts("column", r, t)["weight"], "b1": _cuts("column", r, t)["bias"],
            "w2": _cuts("row", r, t)["weight"]}


def _dense_mlp(key: tuple, index: int) -> dict[str, torch.Tensor]:
    column, row = _layer("column", key, index), _layer("row", key, index)
    dense = {"x": column["x"], "w1": column["weight"], "b1": column["bias"], "w2": row["weight"], "b2": row["bias"]}
    dense = {name: tensor.requires_grad_() for name, tensor in dense.items()}
    y = F.linear(F.gelu(F.linear(dense["x"], dense["w1"], dense["b1"])), dense["w2"], dense["b2"])
    y.backward(row["upstream"])
    return {"y": y.detach(), **{name: tensor.grad for name, tensor in dense.items()}}


@guard.no_shortcuts(built_ins=BUILT_INS)
def check_f_and_g(module) -> None:
    """f is the identity forward and sums the gradient backward; g sums forward and is the identity backward"""
    for ranks, results in _launch(_f_and_g_on_rank, module):
        t, key = len(ranks), tuple(ranks)
        for index, batch in enumerate(BATCH_SHAPES):
            x = _data((*batch, IN_FEATURES), "f", key, index, 0)
            f_grads = [_data((*batch, IN_FEATURES), "f", "grad", key, index, r) for r in range(t)]
            partials = [_data((*batch, OUT_FEATURES), "g", key, index, r) for r in range(t)]
            g_grad = _data((*batch, OUT_FEATURES), "g", "grad", key, index, 0)
            dense = _dense_mlp(key, index)
            for r, out in enumerate(result[index] for result in results):
                where = _where(ranks, r, index)
                (f_out, f_input, f_grad), (g_out, g_input, g_grad_got) = out["f"], out["g"]
                if t > 1 and _is(f_out, x, t):
                    raise CheckFailed(f"{where}: f(x) is {t} times x: f's forward all-reduced x, which every rank "
                                      "already holds; f is the identity forward, its all-reduce belongs in backward")
                _compare(f_out, x, f"{where}: f(x)", " (f's forward returns x unchanged)", "x")
                if not _is(f_input, x):
                    raise CheckFailed(f"{where}: f changed its input in place; its forward returns x unchanged")
                if t > 1 and _is(f_grad, f_grads[r]):
                    raise CheckFailed(f"{where}: the gradient f passed back is the one this rank gave it, not the "
                                      f"sum over the group's {t} ranks: f's backward all-reduces it over group (each "
                                      "rank's gradient of x covers only its own columns of the weight)")
                _compare(f_grad, sum(f_grads), f"{where}: the gradient f passed back", _group_hint(ranks),
                         "the sum over the group of the gradients f was given")
                if not _is(g_input, partials[r]):
                    raise CheckFailed(f"{where}: g changed its input in place (dist.all_reduce works in place): "
                                      "all-reduce a clone, so that the caller's tensor stays as it was")
                if t > 1 and _is(g_out, partials[r]):
                    raise CheckFailed(f"{where}: g returned this rank's own partial sum: g's forward all-reduces "
                                      "(sums) the partial sums over group")
                _compare(g_out, sum(partials), f"{where}: g(partial)", _group_hint(ranks),
                         "the sum of the group's partial sums")
                hint = (": g's backward is the identity (the gradient of a sum reaches each term unchanged); an "
                        "all-reduce there counts it once per rank" if t > 1 else "")
                _compare(g_grad_got, g_grad, f"{where}: the gradient g passed back", hint, "the gradient g was given")
                mlp = f"{where}: in the MLP g(gelu(f(x) W1_r^T + b1_r) W2_r^T) + b2"
                if isinstance(out["mlp"], str):
                    raise CheckFailed(f"{mlp}, your f and g raised {out['mlp']}")
                for name, want in dense.items():
                    what = "the output" if name == "y" else f"the gradient of {name}"
                    _compare(out["mlp"][name], want[_mlp_cuts(r, t).get(name, (...,))], f"{mlp}, {what}")


# --------------------------------------------------------------------------------------------------------
# split_column, split_row

SPLIT_SHAPES = [(24, 12), (12, 36), (48, 24)]  # [out, in]: not square; every size divides by 2, 3 and 4
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
    if other is not None and _is(got, other):
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
        weight = _data((out_features, in_features), "split", out_features)
        bias = _data((out_features,), "split bias", out_features)
        for world_size in (2, 3, 4):
            for rank in range(world_size):
                rows, columns = _block(out_features, rank, world_size), _block(in_features, rank, world_size)
                with_bias, shape = (rank + world_size) % 2 == 0, f"weight [{out_features}, {in_features}]"
                arguments = f"rank={rank}, world_size={world_size}"
                call = f"split_column({shape}, {'bias' if with_bias else 'None'}, {arguments})"
                got = _call(module.split_column, call, weight, bias if with_bias else None, rank, world_size)
                if not (isinstance(got, tuple) and len(got) == 2):
                    raise CheckFailed(f"{call} returned {type(got).__name__}; return (weight_shard, bias_shard)")
                _check_shard(got[0], weight[rows], weight, call, weight[:, columns])
                if with_bias:
                    _check_shard(got[1], bias[rows], bias, f"{call}, for the bias,", None)
                elif got[1] is not None:
                    raise CheckFailed(f"{call} returned a bias shard for no bias: return None in its place")
                call = f"split_row({shape}, {arguments})"
                _check_shard(_call(module.split_row, call, weight, rank, world_size), weight[:, columns], weight,
                             call, weight[rows])
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
    cuts, full = _cuts(kind, r, len(ranks)), _layer(kind, tuple(ranks), index)
    for with_bias in (True, False):
        mine = {name: full[name][cuts[name]].clone().requires_grad_() for name in ("x", "weight", "bias")}
        forward = getattr(module, f"{kind}_parallel_forward")
        y = forward(mine["x"], mine["weight"], mine["bias"] if with_bias else None, group)
        upstream = full["upstream"][cuts["y"]]
        if isinstance(y, torch.Tensor) and y.shape == upstream.shape and y.requires_grad:
            y.backward(upstream)
        results[with_bias] = {"y": y.detach().clone() if isinstance(y, torch.Tensor) else y,
                              **{name: mine[name].grad for name in ("x", "weight", "bias")}}
    return results


def _dense_layer(kind: str, key: tuple, index: int, with_bias: bool) -> dict[str, torch.Tensor]:
    full = _layer(kind, key, index)
    x, weight, bias = (full[name].requires_grad_() for name in ("x", "weight", "bias"))
    y = F.linear(x, weight, bias if with_bias else None)
    y.backward(full["upstream"])
    return {"y": y.detach(), "x": x.grad, "weight": weight.grad, "bias": bias.grad, "bias value": bias.detach()}


def _check_layer(module, kind: str) -> None:
    for ranks, results in _launch(functools.partial(_layer_on_rank, kind), module):
        t = len(ranks)
        for index in range(len(BATCH_SHAPES)):
            for with_bias in (True, False):
                dense = _dense_layer(kind, tuple(ranks), index, with_bias)
                for r, result in enumerate(outcome[index][with_bias] for outcome in results):
                    where = f"{kind}_parallel_forward, {_where(ranks, r, index)}, {'with' if with_bias else 'no'} bias"
                    cuts, y, hint = _cuts(kind, r, t), result["y"], ""
                    if kind == "row" and with_bias and isinstance(y, torch.Tensor) and not _is(y, dense["y"]) \
                            and y.shape == dense["y"].shape:
                        difference, bias = y - dense["y"], dense["bias value"].expand_as(y)
                        extra = ((difference * bias).sum() / (bias * bias).sum()).item()
                        if _is(difference, bias, extra):
                            raise CheckFailed(f"{where}: the output has the bias {1 + extra:.4g} times over: add the "
                                              "whole bias once, after g's sum (added on each rank before it, it "
                                              "counts once per rank)")
                    if kind == "column" and t > 1 and not _is(result["x"], dense["x"]):
                        hint = (": each rank's product covers only its own output features, so its gradient of x "
                                "is a partial sum; pass x through f (CopyToTensorParallel) so that backward sums "
                                "it over the group")
                    for name in ("y", "x", "weight", "bias") if with_bias else ("y", "x", "weight"):
                        _compare(result[name], dense[name][cuts[name]], f"{where}: {WHAT[kind][name]}",
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
