"""Exercise 06's check of f and g (:mod:`labkit.grading.checkers.tensor_parallel`): each operator alone, then the
MLP they bracket.

Each operator is probed alone, in every group of every layout, with inputs and gradients that *differ from rank
to rank*: an operator that averages over the group (or sums and divides by t) looks like the identity when every
rank holds the same numbers, and only then.  Four probes each:

- ``plain``: contiguous tensors;
- ``shared``: the output is added to another tensor z before backward (``y + z``), so the gradient reaching the
  operator is the very tensor z receives: a backward that changes it in place changes z's gradient;
- ``strided``: input and gradient laid out transposed (not contiguous: a transpose's gradient is not);
- ``broadcast``: the gradient is one row expanded over the batch (stride 0: what ``sum()`` and ``mean()`` give
  back).

The forward must return f's input unchanged and g's the group's sum, the backward f's the group's sum of the
gradients and g's its own gradient; neither input nor gradient may change in place.  A ``TorchDispatchMode``
below every Python name records each communication operator: f's forward and g's backward must run none (an
all-reduce that averages identical numbers is not the identity: it is an extra message per layer), and every
tensor handed to one must be contiguous (NCCL refuses the others; gloo quietly copies them); f's backward and
g's forward run one all-reduce (none or one in a group of one), not an all-gather and a sum (t copies received)
or a reduce and a broadcast (two messages).  Probes use
feature counts of 7 and 5, which no t > 1 divides.  Then the MLP ``g(gelu(f(x) W1_r^T + b1_r) W2_r^T) + b2`` of
the reference split runs with the student's f and g, as a model does (the same x and output gradient on every
rank), and is compared with the dense MLP.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from labkit.grading import CheckFailed, guard
from labkit.grading.checkers import tensor_parallel_data as common
from labkit.grading.checkers.tensor_parallel_data import BATCH_SHAPES, BUILT_INS, compare, data, is_, where

FEATURES = {"f": 7, "g": 5}
VARIANTS = {"plain": "", "shared": ", its output added to another tensor z before backward (y + z)",
            "strided": ", input and gradient laid out transposed (not contiguous)",
            "broadcast": ", the gradient one row broadcast over the batch (stride 0)"}
NAMES = {"f": "f (CopyToTensorParallel)", "g": "g (ReduceFromTensorParallel)"}
SILENT = ("barrier", "monitored_barrier_", "wait_tensor", "_wrap_tensor_autograd")  # no data moved
SILENT_PHASE = {"f": "forward", "g": "backward"}
ALL_REDUCES = ("c10d.allreduce_", "_c10d_functional.all_reduce", "_c10d_functional.all_reduce_",
               "_c10d_functional_autograd.all_reduce")


class Communication(TorchDispatchMode):
    """Records ``(phase, operator, all its tensors contiguous)`` for each communication operator run."""

    def __init__(self) -> None:
        super().__init__()
        self.phase, self.seen = "", []

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # see guard._PointToPointOnly

    def __torch_dispatch__(self, func, op_types, args=(), kwargs=None):
        if func.namespace in guard.COMMUNICATION_NAMESPACES and func._opname not in SILENT:
            first = args[0] if args else None
            tensors = first if isinstance(first, (list, tuple)) else [first]
            self.seen.append((self.phase, f"{func.namespace}.{func._opname}",
                              all(t.is_contiguous() for t in tensors if isinstance(t, torch.Tensor))))
        return func(*args, **(kwargs or {}))


def _laid_out(tensor: torch.Tensor, variant: str) -> torch.Tensor:
    return tensor.mT.contiguous().mT if variant == "strided" else tensor.clone()


def _probe(operator, name: str, key: tuple, index: int, r: int, variant: str, group) -> dict:
    shape = (*BATCH_SHAPES[index], FEATURES[name])
    leaf = data(shape, name, "x", key, index, r).requires_grad_()
    x = _laid_out(leaf, variant)  # not a leaf, so that a change in place shows instead of raising
    if variant == "broadcast":  # one row, stride 0 across the batch, in storage as large as the whole tensor:
        # an all-reduce in place then writes into memory the probe owns (with expand()'s one row it may crash)
        given = torch.zeros(math.prod(shape), dtype=torch.float64)
        given[:shape[-1]] = data(shape[-1:], name, "grad", key, index, r)
        grad = given.as_strided(shape, (0,) * (len(shape) - 1) + (1,))
    else:
        given = grad = _laid_out(data(shape, name, "grad", key, index, r), variant)
    kept, side = given.clone(), torch.zeros(shape, dtype=torch.float64, requires_grad=True)
    out, mode = {"error": None}, Communication()
    try:
        with mode:
            mode.phase = "forward"
            y = operator.apply(x, group)
            out["y"] = y.detach().clone() if isinstance(y, torch.Tensor) else y
            if isinstance(y, torch.Tensor) and y.requires_grad:
                mode.phase = "backward"
                (y + side if variant == "shared" else y).backward(grad)
    except (NotImplementedError, CheckFailed):
        raise
    except Exception as error:  # reported with the probe's name, which says more than a traceback
        out["error"] = f"{type(error).__name__}: {error}"
    out.update(x=x.detach().clone(), grad=leaf.grad, kept=torch.equal(given, kept), side=side.grad,
               seen=mode.seen)
    return out


def _on_rank(module, ranks, group, index) -> dict:
    key, r = tuple(ranks), ranks.index(dist.get_rank())
    out = {(name, variant): _probe(operator, name, key, index, r, variant, group) for variant in VARIANTS
           for name, operator in (("f", module.CopyToTensorParallel), ("g", module.ReduceFromTensorParallel))}
    column, row = common.layer("column", key, index), common.layer("row", key, index)
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
    return {"w1": common.cuts("column", r, t)["weight"], "b1": common.cuts("column", r, t)["bias"],
            "w2": common.cuts("row", r, t)["weight"]}


def _dense_mlp(key: tuple, index: int) -> dict[str, torch.Tensor]:
    column, row = common.layer("column", key, index), common.layer("row", key, index)
    dense = {"x": column["x"], "w1": column["weight"], "b1": column["bias"], "w2": row["weight"], "b2": row["bias"]}
    dense = {name: tensor.requires_grad_() for name, tensor in dense.items()}
    y = F.linear(F.gelu(F.linear(dense["x"], dense["w1"], dense["b1"])), dense["w2"], dense["b2"])
    y.backward(row["upstream"])
    return {"y": y.detach(), **{name: tensor.grad for name, tensor in dense.items()}}


# --------------------------------------------------------------------------------------------------------
# Judging one probe


def _truth(name: str, key: tuple, index: int, t: int, variant: str) -> tuple[list, list]:
    """Every rank's input and gradient of one probe."""
    shape = (*BATCH_SHAPES[index], FEATURES[name])
    xs = [data(shape, name, "x", key, index, s) for s in range(t)]
    grads = [data(shape[-1:], name, "grad", key, index, s).expand(shape) if variant == "broadcast" else
             data(shape, name, "grad", key, index, s) for s in range(t)]
    return xs, grads


def _judge(name: str, out: dict, ranks: list[int], r: int, index: int, variant: str) -> None:
    t, operator = len(ranks), NAMES[name]
    at = f"{where(ranks, r, index, f'{FEATURES[name]} features')}{VARIANTS[variant]}"
    xs, grads = _truth(name, tuple(ranks), index, t, variant)
    if out["error"]:
        hint = (" (this probe's tensors are not contiguous, which .view() refuses; .contiguous() gives a "
                "contiguous copy)" if variant in ("strided", "broadcast") else "")
        raise CheckFailed(f"{at}: {operator} raised {out['error']}{hint}")
    silent = SILENT_PHASE[name]
    talks = [op for phase, op, _ in out["seen"] if phase == silent]
    if talks:
        raise CheckFailed(f"{at}: {operator}'s {silent} ran {talks[0]}: "
                          + ("f's forward is the identity: every rank already holds x, so it sends nothing (an "
                             "average of identical copies returns x, at the price of a message); its all-reduce "
                             "belongs in backward" if name == "f" else
                             "g's backward is the identity: the gradient of a sum reaches every term unchanged, so "
                             "it sends nothing (an average returns the gradient only when every rank holds the same "
                             "one, at the price of a message); an all-reduce there counts it once per rank"))
    if not is_(out["x"], xs[r]):
        raise CheckFailed(f"{at}: {operator} changed its input in place"
                          + (" (dist.all_reduce works in place): all-reduce a copy, so that the caller's tensor "
                             "stays as it was" if name == "g" else "; its forward returns x unchanged"))
    want_y = xs[r] if name == "f" else sum(xs)
    if name == "g" and t > 1 and is_(out["y"], xs[r]):
        raise CheckFailed(f"{at}: g returned this rank's own partial sum: g's forward all-reduces (sums) the "
                          "partial sums over group")
    compare(out["y"], want_y, f"{at}: {operator}'s output", common.group_hint(ranks) if name == "g" else "",
            "this rank's input" if name == "f" else "the sum of the group's inputs")
    if not out["kept"] or variant == "shared" and not is_(out["side"], grads[r]):
        how = ("here y + z hands the same tensor to z, whose gradient came out changed" if variant == "shared" else
               ".contiguous() and .reshape() of a contiguous tensor return the tensor itself")
        raise CheckFailed(f"{at}: {operator}'s backward changed the gradient it was given, in place (dist.all_reduce "
                          f"works in place; {how}): that gradient may be shared with the rest of the graph, so "
                          "reduce a copy")
    want_grad = sum(grads) if name == "f" else grads[r]
    if t > 1 and is_(out["grad"], sum(grads) / t):
        which = ("their sum: each rank's gradient of x covers only its own columns of the weight, so they add up"
                 if name == "f" else "its own: g's backward is the identity")
        raise CheckFailed(f"{at}: the gradient {operator} passed back is the mean of the {t} gradients the group's "
                          f"ranks were given, not {which}")
    if name == "f" and t > 1 and is_(out["grad"], grads[r]):
        raise CheckFailed(f"{at}: the gradient f passed back is the one this rank gave it, not the sum over the "
                          f"group's {t} ranks: f's backward all-reduces it over group (each rank's gradient of x "
                          "covers only its own columns of the weight)")
    truth = "the sum over the group of the gradients given" if name == "f" else "the gradient it was given"
    compare(out["grad"], want_grad, f"{at}: the gradient {operator} passed back",
            common.group_hint(ranks) if name == "f" else "", truth)
    talking = "backward" if name == "f" else "forward"
    sent = [op for phase, op, _ in out["seen"] if phase == talking]
    if not (len(sent) == 1 and sent[0] in ALL_REDUCES or t == 1 and not sent):
        raise CheckFailed(f"{at}: {operator}'s {talking} ran {', '.join(sent) or 'no collective'}: one all-reduce "
                          "(dist.all_reduce) does it, each rank sending and receiving about 2 (t - 1) / t of the "
                          "tensor; an all-gather then a sum receives t copies, a reduce then a broadcast takes two "
                          "messages' time")
    strided = [op for _, op, contiguous in out["seen"] if not contiguous]
    if strided:
        raise CheckFailed(f"{at}: {operator} handed {strided[0]} a tensor that is not contiguous (a clone keeps its "
                          "source's strides): NCCL refuses those, gloo copies them; .contiguous() before the "
                          "all-reduce")


@guard.no_shortcuts(built_ins=BUILT_INS)
def check_f_and_g(module) -> None:
    """f is the identity forward and sums the gradient backward; g sums forward and is the identity backward"""
    for ranks, results in common.on_every_group(_on_rank, module):
        t, key = len(ranks), tuple(ranks)
        for index in range(len(BATCH_SHAPES)):
            for variant in VARIANTS:
                for name in ("f", "g"):
                    for r, result in enumerate(results):
                        _judge(name, result[index][(name, variant)], ranks, r, index, variant)
            dense = _dense_mlp(key, index)
            for r, result in enumerate(results):
                mlp = f"{where(ranks, r, index)}: in the MLP g(gelu(f(x) W1_r^T + b1_r) W2_r^T) + b2"
                if isinstance(result[index]["mlp"], str):
                    raise CheckFailed(f"{mlp}, your f and g raised {result[index]['mlp']}")
                for name, want in dense.items():
                    what = "the output" if name == "y" else f"the gradient of {name}"
                    compare(result[index]["mlp"][name], want[_mlp_cuts(r, t).get(name, (...,))], f"{mlp}, {what}")
