"""Checks for exercise 14 (``14_mixture_of_experts.py``): the router's choice, the combine weights, the capacity
and its drops, the auxiliary loss and the balancing bias.

Seven checks, one a function, then all six in a layer (the cases are in :mod:`.routing_rules`):

1. ``route`` on softmax and sigmoid scores, ``k`` = 1 to 8 of 4 to 64 experts (``k = E`` included, where only the
   order is left to get right), ``[T, E]``, ``[a, b, E]`` and ``[a, b, c, E]`` scores, float32 and float64, none and
   non-contiguous; a bias large enough to change choices (choosing by the scores alone, or subtracting the bias,
   fails) and the choices best first (ascending, or in index order, fails);
2. ``combine_weights`` to 1e-12 (float64) and its gradient in ``scores``: ``k = 1`` keeps the raw score
   (renormalising it gives 1 and no gradient), ``k > 1`` divides by the sum over all ``k`` choices (not over the
   kept ones), a dropped choice weighs 0; a softmax over the chosen scores, or weights with no gradient, fail;
3. ``expert_capacity`` on 15 batches, with products ``C T k / E`` that are whole numbers (one more, or rounding
   down and adding one, fails), that are not (rounding down or to the nearest fails), and below one; an ``int``
   (a float, even 6.0, fails: it sizes buffers), ``None`` for ``C = None``;
4. ``kept_choices``: every choice of 9 batches, GShard's order (a token's choices served together, a capacity for
   each rank of choice, the queue served from its end, or one more or one fewer, fail), capacities 0, unlimited and
   beyond the load, ``[T, k]`` to ``[a, b, c, k]``, experts no token chose;
5. ``aux_loss`` and its gradient, softmax and sigmoid (whose scores are normalised first), experts no token chose:
   ``f`` taken from the scores rather than counted, over ``T`` rather than ``T k``, or from first choices, fails;
6. ``update_bias``: every expert by exactly ``rate`` towards the mean load (the sign turned, a step proportional to
   the gap, the mean rounded down, or moving experts at the mean, fails), all ``k`` choices counted, experts no
   token chose (``bincount`` without ``minlength`` fails), the ``bias``' dtype;
7. all six in three training steps of a layer on 2, 3 and 4 processes, each with its own, uneven ``[batch, seq]``
   tokens: every rank's choices, drops, weights, output, gate gradient (through the weights and the auxiliary loss)
   and bias equal the rules'; the biases move alike on every rank only if the loads are summed over the ranks.

Every function is also tried on ``meta`` tensors (a tensor made without ``device=``, ``.tolist()`` or numpy fails
there) and must leave its inputs as they were; ids must be ``torch.long``, masks ``torch.bool``.  While the checks
run, :mod:`labkit.grading.guard` switches off ``labkit.parallel`` (labkit's router and layer), this checker refuses
any function of labkit's experts, of its plots or of this checker run from the student's call, however it was
loaded (:mod:`.own_code`), and a fresh copy of any labkit file registered under another name.  (torch has no MoE
router of its own to refuse.)
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from fractions import Fraction
from typing import Any

import torch

from labkit.grading import CheckFailed, copies, guard
from labkit.grading.checkers import own_code
from labkit.grading.checkers import routing_rules as rules
from labkit.launch import launch

LAUNCH_TIMEOUT = 60.0
# labkit's router, layer and dispatch, its plots (the explorer computes a capacity), and this checker's rules
FILES = own_code.implementation_files("parallel/experts", "viz/experts_plots.py",
                                      "grading/checkers/mixture_of_experts.py", "grading/checkers/routing_rules.py")


class MetaBincount:
    """``bincount`` on ``meta``, where torch has none (its size is data): ``minlength`` counts, which the probes'
    ids (all below it) give.  A method, not a function: the guard leaves a checker's methods alone, so torch may
    call it from inside the student's code."""

    def __call__(self, ids: torch.Tensor, weights: torch.Tensor | None = None, minlength: int = 0) -> torch.Tensor:
        return ids.new_empty(minlength, dtype=torch.long if weights is None else weights.dtype)


@contextmanager
def _meta_counts() -> Iterator[None]:
    library = torch.library.Library("aten", "IMPL")
    library.impl("bincount", MetaBincount(), "Meta")
    try:
        yield
    finally:
        library._destroy()


def call(module, name: str, *args: Any) -> Any:
    """The student's ``name(*args)``, refusing labkit's experts code however reached (:mod:`.own_code`)."""
    with own_code.only_own_code(FILES, getattr(module, "__file__", None), [MetaBincount.__call__.__code__]):
        return getattr(module, name)(*args)


def _run(module, name: str, what: str, *args: Any) -> Any:
    """``call``, with an error raised by the student's code named with the case that raised it."""
    try:
        return call(module, name, *args)
    except (CheckFailed, NotImplementedError):  # a refusal (guard.Forbidden is a CheckFailed), or the stub
        raise
    except Exception as error:  # any failure is the student's
        raise CheckFailed(f"{what} raised {type(error).__name__}: {str(error).splitlines()[0][:200]}") from None


def _tensor(result: object, what: str, shape: tuple[int, ...], dtype: torch.dtype, why: str) -> torch.Tensor:
    if not isinstance(result, torch.Tensor):
        raise CheckFailed(f"{what} returned {type(result).__name__}; expected a torch.Tensor of shape {shape}")
    if tuple(result.shape) != tuple(shape):
        raise CheckFailed(f"{what} returned a tensor of shape {tuple(result.shape)}; expected {tuple(shape)} (the "
                          "input's leading dimensions, whatever their number)")
    if result.dtype != dtype:
        raise CheckFailed(f"{what} returned {result.dtype}; expected {dtype}: {why}")
    return result


def _unchanged(before: list[torch.Tensor], after: list[torch.Tensor], what: str) -> None:
    for old, new in zip(before, after, strict=True):
        if not torch.equal(old, new.detach()):
            raise CheckFailed(f"{what} changed its input in place: the layer uses the scores, ids and bias again")


def _on_meta(module, name: str, args: tuple, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """The result lives where the inputs do: tried on ``meta``, which needs no GPU and refuses what would copy to
    the CPU (``.tolist()``, ``.item()``, numpy), mixing with CPU tensors, and a result made on the CPU."""
    moved = tuple(arg.detach().to("meta") if isinstance(arg, torch.Tensor) else arg for arg in args)
    try:
        with _meta_counts():
            result = call(module, name, *moved)
    except guard.Forbidden:
        raise
    except Exception as error:  # any failure is the student's (NotImplementedError too: the CPU's cases ran)
        raise CheckFailed(f"{name} of tensors on another device than the CPU failed ({type(error).__name__}: "
                          f"{str(error).splitlines()[0][:120]}): keep to torch operations on the inputs' device, "
                          "no Python lists, numpy or .item()") from None
    if not isinstance(result, torch.Tensor) or result.device.type != "meta":
        where = result.device if isinstance(result, torch.Tensor) else type(result).__name__
        raise CheckFailed(f"{name} of tensors on another device returned one on {where}: make new tensors on the "
                          "inputs' device (device=..., or *_like)")
    _tensor(result, f"{name} on meta", shape, dtype, "as on the CPU")


def _first(found: torch.Tensor, want: torch.Tensor, close: Callable | None = None) -> int:
    """The first token (row of the flattened leading dimensions) where the two differ."""
    a, b = found.detach().reshape(-1, found.shape[-1]), want.detach().reshape(-1, want.shape[-1])
    same = (close(a, b) if close else a == b).all(dim=-1)
    return int((~same).nonzero()[0, 0]) if not bool(same.all()) else -1


def _rows(tensor: torch.Tensor, token: int) -> list:
    flat = tensor.detach().reshape(-1, tensor.shape[-1])[token]
    return [round(v, 4) for v in flat.tolist()] if flat.is_floating_point() else flat.tolist()


def _hint(found: torch.Tensor, rivals: dict[str, torch.Tensor], close: Callable | None = None) -> str:
    for text, rival in rivals.items():
        if found.shape == rival.shape and bool((close or torch.equal)(found.detach(), rival)):
            return f" ({text})"
    return ""


@guard.no_shortcuts
def check_route(module) -> None:
    """route picks each token's k experts by score + bias, best first (any k, E, leading dimensions, layout)"""
    copies.refuse_copies_of_labkit()
    for case in rules.ROUTE_CASES:
        _, scores, bias = case.inputs()  # differentiable, as the gate hands them over
        before = [scores.detach().clone(), bias.clone()]
        what = f"route of {case.label()}"
        found = _tensor(_run(module, "route", what, scores, bias, case.top_k), what, (*case.lead, case.top_k),
                        torch.long,
                        "expert ids index the experts' weights and the all-to-all's rows; integers of any other "
                        "dtype are read as a mask (bool, uint8) or overflow past 32,767 (int16)")
        _unchanged(before, [scores, bias], what)
        want = rules.choose(scores, bias, case.top_k)
        if not torch.equal(found, want):
            token = _first(found, want)
            hint = _hint(found, {"chosen by the scores alone: the bias must move the choice":
                                 rules.choose(scores, torch.zeros_like(bias), case.top_k),
                                 "the bias subtracted: it is added to the scores": rules.choose(scores, -bias,
                                                                                                case.top_k),
                                 "the right experts, in the wrong order: best first, since the capacity serves a "
                                 "token's first choice before its second": want.flip(-1)})
            if not hint and torch.equal(found.sort(dim=-1).values, want.sort(dim=-1).values):
                hint = " (the right experts, in the wrong order: best first)"
            raise CheckFailed(f"{what}: token {token} got experts {_rows(found, token)}, expected "
                              f"{_rows(want, token)}{hint}")
    _, scores, bias = rules.ROUTE_CASES[2].inputs()
    _on_meta(module, "route", (scores, bias, 3), torch.long, (*scores.shape[:-1], 3))
    copies.refuse_copies_of_labkit()


def _close(dtype: torch.dtype) -> Callable:
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    return lambda a, b: (a.to(torch.float64) - b.to(torch.float64)).abs() <= tolerance


def _within(tolerance: float) -> Callable:
    return lambda a, b: bool(((a.double() - b.double()).abs() <= tolerance).all())


def _same(dtype: torch.dtype) -> Callable:
    return lambda a, b: bool(_close(dtype)(a, b).all())


def _gradient(found: torch.Tensor, want: torch.Tensor, leaf: torch.Tensor, what: str, dtype: torch.dtype) -> None:
    """``found``'s gradient in ``leaf`` (the logits the scores came from, as the gate's) against ``want``'s, for
    one random upstream gradient."""
    if not found.requires_grad:
        raise CheckFailed(f"{what}: the result carries no gradient to the scores (detached, or computed from "
                          "scores.detach() or .data): the gate learns through it")
    upstream = torch.randn(want.shape, generator=rules.generator(99), dtype=torch.float64).to(want.dtype)
    (got,) = torch.autograd.grad(found, leaf, upstream, retain_graph=True, allow_unused=True)
    (expected,) = torch.autograd.grad(want, leaf, upstream, retain_graph=True)
    got = torch.zeros_like(expected) if got is None else got
    if not _same(dtype)(got, expected):
        worst = float((got - expected).abs().max())
        raise CheckFailed(f"{what}: the values are right but the gate's gradient through them is off by "
                          f"{worst:.3g}: compute from the scores with torch operations, not from copies of their "
                          "values")


@guard.no_shortcuts
def check_combine(module) -> None:
    """combine_weights: the unbiased score, renormalised over the k choices when k > 1, 0 if dropped; its gradient"""
    copies.refuse_copies_of_labkit()
    for case, factor in rules.COMBINE_CASES:
        leaf, scores, bias = case.inputs()
        ids = rules.choose(scores, bias, case.top_k)
        kept = rules.served(ids, case.n_experts, rules.capacity(ids[..., 0].numel(), case.top_k, case.n_experts,
                                                                 factor))
        given = [ids, kept] if case.contiguous else [rules.noncontiguous(ids), rules.noncontiguous(kept)]
        before = [scores.detach().clone(), ids, kept]
        what = f"combine_weights of {case.label()}, capacity factor {factor}"
        found = _tensor(_run(module, "combine_weights", what, scores, *given), what, tuple(ids.shape), scores.dtype,
                        "the weights multiply the experts' outputs, in the scores' precision")
        _unchanged(before, [scores, *given], what)
        want = rules.combine(scores, ids, kept)
        same = _same(case.dtype)
        if not same(found, want):
            token = _first(found, want, _close(case.dtype))
            hint = _hint(found, {"not renormalised: with k > 1 divide by the sum of the token's k chosen scores":
                                 rules.combine(scores, ids, kept, normalise=False),
                                 "renormalised with k = 1: a lone weight divided by itself is 1, and the gate gets "
                                 "no gradient; keep the raw score": rules.combine(scores, ids, kept, normalise=True),
                                 "renormalised over the kept choices only: a drop must not hand its share to the "
                                 "token's other experts": rules.combine(scores, ids, kept, over_kept=True),
                                 "a dropped choice keeps its weight: it must weigh 0": rules.combine(
                                     scores, ids, kept, zero_dropped=False),
                                 "a softmax over the chosen scores: divide them by their sum instead": rules.combine(
                                     scores, ids, kept, softmax=True)}, same)
            raise CheckFailed(f"{what}: token {token} (experts {_rows(ids, token)}, kept {_rows(kept, token)}, "
                              f"scores {_rows(scores.gather(-1, ids), token)}) got {_rows(found, token)}, expected "
                              f"{_rows(want, token)}{hint}")
        if want.numel():
            _gradient(found, want, leaf, what, case.dtype)
    _, scores, bias = rules.COMBINE_CASES[2][0].inputs()
    ids = rules.choose(scores, bias, 4)
    _on_meta(module, "combine_weights", (scores, ids, rules.served(ids, 16, 3)), scores.dtype, tuple(ids.shape))
    copies.refuse_copies_of_labkit()


@guard.no_shortcuts
def check_capacity(module) -> None:
    """expert_capacity is ceil(C T k / E), an int; None without a capacity factor"""
    copies.refuse_copies_of_labkit()
    for tokens, top_k, n_experts, factor in rules.CAPACITY_CASES:
        what = f"expert_capacity({tokens}, {top_k}, {n_experts}, {factor})"
        found = _run(module, "expert_capacity", what, tokens, top_k, n_experts, factor)
        want = rules.capacity(tokens, top_k, n_experts, factor)
        if want is None:
            if found is not None:
                raise CheckFailed(f"{what} returned {found!r}; expected None: no capacity factor, no limit")
            continue
        if isinstance(found, bool) or not isinstance(found, numbers.Integral):
            raise CheckFailed(f"{what} returned {found!r} ({type(found).__name__}); expected an int: a capacity is "
                              "a whole number of choices, and it sizes the experts' buffers")
        if found != want:
            exact = Fraction(factor) * tokens * top_k / n_experts
            fewer = rules.capacity(tokens, 1, n_experts, factor)  # the tokens counted, not their choices
            hint = (" (rounded down, or to the nearest: an expert must have room for its whole share, so round "
                    "up)" if found == int(exact) else " (one more than the share when it is a whole number: round "
                    "up, do not add one)" if found == want + 1 else " (rounded to the nearest: round up)"
                    if found == round(exact) else " (is every choice counted? T tokens make T k choices)"
                    if found == fewer else "")
            raise CheckFailed(f"{what} returned {found}; expected {want}: C T k / E = {float(exact):g}{hint}")
    copies.refuse_copies_of_labkit()


@guard.no_shortcuts
def check_kept(module) -> None:
    """kept_choices keeps each expert's first `capacity` choices, first choices of all tokens served first"""
    copies.refuse_copies_of_labkit()
    for seed, (lead, n_experts, top_k, limit, skew, unused, contiguous) in enumerate(rules.KEPT_CASES):
        ids = rules.skewed_ids(lead, n_experts, top_k, 30 + seed, skew, unused)
        given = ids if contiguous else rules.noncontiguous(ids)
        what = (f"kept_choices of ids {list(ids.shape)}{'' if contiguous else ' (not contiguous)'} over {n_experts} "
                f"experts, capacity {limit}")
        found = _tensor(_run(module, "kept_choices", what, given, n_experts, limit), what, tuple(ids.shape), torch.bool,
                        "a mask indexes the choices it keeps; integers index positions")
        _unchanged([ids], [given], what)
        want = rules.served(ids, n_experts, limit)
        if not torch.equal(found, want):
            token = _first(found, want)
            rivals = {} if limit is None else {
                "a token's choices served together; every first choice comes before any second one": rules.served(
                    ids, n_experts, limit, token_major=True),
                "a capacity for each rank of choice: one queue for all of an expert's choices": rules.served(
                    ids, n_experts, limit, per_column=True),
                "the queue served from its end: the first in the queue are kept": rules.served(ids, n_experts, limit,
                                                                                        last_first=True),
                "one more than the capacity kept": rules.served(ids, n_experts, limit, at_most=1),
                "one fewer than the capacity kept": rules.served(ids, n_experts, limit, at_most=-1)}
            loads = rules.loads(ids, n_experts).tolist()
            raise CheckFailed(f"{what}: token {token}'s choices (experts {_rows(ids, token)}) got "
                              f"{_rows(found, token)}, expected {_rows(want, token)} (the experts' loads {loads})"
                              f"{_hint(found, rivals)}")
    ids = rules.skewed_ids((4, 5), 8, 3, 7)
    for limit in (2, None):
        _on_meta(module, "kept_choices", (rules.noncontiguous(ids), 8, limit), torch.bool, tuple(ids.shape))
    copies.refuse_copies_of_labkit()


@guard.no_shortcuts
def check_aux_loss(module) -> None:
    """aux_loss is Switch's E sum f_e P_e (f counted over the T k choices, P the mean normalised score); its gradient"""
    copies.refuse_copies_of_labkit()
    for seed, (case, skew, unused) in enumerate(rules.AUX_CASES):
        leaf, scores, _ = case.inputs()
        ids = rules.skewed_ids(case.lead, case.n_experts, case.top_k, 40 + seed, skew, unused)
        given = ids if case.contiguous else rules.noncontiguous(ids)
        before = [scores.detach().clone(), ids]
        what = f"aux_loss of {case.label().rsplit(',', 1)[0]}, ids with {unused} expert(s) unchosen"
        found = _tensor(_run(module, "aux_loss", what, scores, given), what, (), scores.dtype, "a loss term in the "
                        "scores' precision")
        _unchanged(before, [scores, given], what)
        want = rules.balance_loss(scores, ids)
        same = _same(case.dtype)
        if not same(found, want):
            hint = _hint(found, {"f taken from the scores: f_e counts the choices expert e got, P_e alone is the "
                                 "scores'": rules.balance_loss(scores, ids, counted=False),
                                 "f over the T tokens: it is the share of all T k choices": rules.balance_loss(
                                     scores, ids, per_token=True),
                                 "without the factor E, which makes a balanced router's loss 1": rules.balance_loss(
                                     scores, ids, times_experts=False),
                                 "P from the raw scores: divide each token's scores by their sum first (sigmoid "
                                 "scores do not sum to 1)": rules.balance_loss(scores, ids, normalised=False),
                                 "f from the first choices only: every choice counts": rules.balance_loss(
                                     scores, ids, first_only=True),
                                 "f from the first choices only, over T: every choice counts": rules.balance_loss(
                                     scores, ids, first_only=True, per_token=True)}, same)
            raise CheckFailed(f"{what} returned {float(found):.6g}; expected {float(want):.6g}{hint}")
        _gradient(found, want, leaf, what, case.dtype)
    _, scores, _ = rules.AUX_CASES[1][0].inputs()
    _on_meta(module, "aux_loss", (scores, rules.skewed_ids((5, 6), 8, 1, 41)), scores.dtype, ())
    copies.refuse_copies_of_labkit()


def _bias_cases() -> Iterator[tuple[str, torch.Tensor, torch.Tensor, float]]:
    for seed, (lead, n_experts, top_k, skew, unused, dtype, contiguous, rate) in enumerate(rules.BIAS_CASES):
        ids = rules.skewed_ids(lead, n_experts, top_k, 50 + seed, skew, unused)
        bias = rules.bias_of(n_experts, 0.05, 60 + seed, contiguous, dtype)
        yield (f"update_bias of a {str(dtype)[6:]} bias over {n_experts} experts, ids {list(ids.shape)}"
               f"{'' if contiguous else ' (neither contiguous)'}, rate {rate:g}", bias,
               ids if contiguous else rules.noncontiguous(ids), rate)
    for ids, n_experts in rules.EXPLICIT_LOADS:
        yield (f"update_bias of ids {ids.tolist()} over {n_experts} experts, rate 0.01",
               rules.bias_of(n_experts, 0.05, 70), ids, 0.01)


@guard.no_shortcuts
def check_update_bias(module) -> None:
    """update_bias moves every expert's bias by rate towards the mean load, counting every choice"""
    copies.refuse_copies_of_labkit()
    for what, bias, ids, rate in _bias_cases():
        before = [bias.clone(), ids.clone()]
        found = _tensor(_run(module, "update_bias", what, bias, ids, rate), what, tuple(bias.shape), bias.dtype,
                        "the new bias replaces the old one, in its dtype")
        _unchanged(before, [bias, ids], what)
        load = rules.loads(ids, bias.numel())
        want = rules.bias_step(bias, load, rate)
        same = _within(rate * 1e-3)
        if not same(found, want):
            rivals = {f"the sign turned: an expert above the mean load ({float(load.double().mean()):g}) must go "
                      "down": rules.bias_step(bias, load, rate, "flipped"),
                      "a step proportional to the gap: every expert moves by rate exactly, the sign of the gap "
                      "alone": rules.bias_step(bias, load, rate, "proportional"),
                      "an expert exactly at the mean moved: sign(0) is 0": rules.bias_step(bias, load, rate,
                                                                                           "ties move"),
                      "the mean load rounded down: it is a fraction": rules.bias_step(bias, load, rate,
                                                                                      "integer mean"),
                      "loads from the first choices only: all k choices count": rules.bias_step(
                          bias, rules.loads(ids, bias.numel(), first_only=True), rate),
                      "the bias did not move": bias}
            raise CheckFailed(f"{what}: loads {load.tolist()} moved the bias by "
                              f"{[round(v, 6) for v in (found.double() - bias.double()).tolist()]}, expected "
                              f"{[round(v, 6) for v in (want.double() - bias.double()).tolist()]}"
                              f"{_hint(found, rivals, same)}")
    _on_meta(module, "update_bias", (rules.bias_of(8, 0.05, 1, False), rules.skewed_ids((3, 5), 8, 2, 51), 0.01),
             torch.float32, (8,))
    copies.refuse_copies_of_labkit()


@guard.no_shortcuts
def check_layer(module) -> None:
    """all six in a layer's training steps on 2-4 ranks, uneven batches: choices, drops, weights, gradient, bias"""
    copies.refuse_copies_of_labkit()
    for setting in rules.LAYER_SETTINGS:
        results = launch(rules.layer_steps, module, call, setting, nprocs=setting.world, timeout=LAUNCH_TIMEOUT,
                         rank_output="none")
        wrong = [result for result in results if result is not None]
        if wrong:
            raise CheckFailed(f"{setting.label()}: {min(wrong)[1]}")
    copies.refuse_copies_of_labkit()


CHECKS = [check_route, check_combine, check_capacity, check_kept, check_aux_loss, check_update_bias, check_layer]
