"""Exercise 14's rules as the checks compute them, the rival rules their hints name, and the cases, as data.

The references are written apart from labkit's router (:mod:`labkit.parallel.experts.router`, switched off while
the checks run) and from the solution: the capacity in exact rational arithmetic, the drops by serving a queue
one choice at a time.  Each rival is a plausible mistake; when an answer equals one, the hint names it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist

# --------------------------------------------------------------------------------------------------------
# The rules


def choose(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """``[..., k]``: the ``k`` largest ``score + bias``, best first."""
    return (scores.detach() + bias).topk(top_k, dim=-1).indices


def capacity(tokens: int, top_k: int, n_experts: int, factor: float | None) -> int | None:
    """``ceil(C T k / E)``, exactly (``Fraction`` holds the float ``C`` as it is)."""
    return None if factor is None else math.ceil(Fraction(factor) * tokens * top_k / n_experts)


def served(expert_ids: torch.Tensor, n_experts: int, limit: int | None, token_major: bool = False,
           per_column: bool = False, last_first: bool = False, at_most: int = 0) -> torch.Tensor:
    """The kept mask, by serving each expert's queue: first choices of every token, then second ones (GShard).
    The flags build rivals: ``token_major`` (a token's choices together), ``per_column`` (a fresh capacity for
    each rank of choice), ``last_first`` (the queue served from its end), ``at_most`` (``limit + at_most``)."""
    top_k = expert_ids.shape[-1]
    rows = expert_ids.reshape(-1, top_k).tolist()
    kept = [[limit is None] * top_k for _ in rows]
    if limit is not None:
        queue = [(t, c) for t in range(len(rows)) for c in range(top_k)] if token_major else \
            [(t, c) for c in range(top_k) for t in range(len(rows))]
        if last_first:
            queue.reverse()
        taken: dict[tuple[int, int], int] = {}
        for t, c in queue:
            key = (rows[t][c], c if per_column else -1)
            if taken.get(key, 0) < limit + at_most:
                kept[t][c] = True
                taken[key] = taken.get(key, 0) + 1
    return torch.tensor(kept, dtype=torch.bool).reshape(expert_ids.shape)


def combine(scores: torch.Tensor, expert_ids: torch.Tensor, kept: torch.Tensor, normalise: bool | None = None,
            over_kept: bool = False, zero_dropped: bool = True, softmax: bool = False) -> torch.Tensor:
    """The combine weights: the chosen scores, divided by their sum over the ``k`` when ``k > 1`` (``normalise``
    forces it either way), 0 where dropped.  Rivals: ``over_kept`` (the sum of the kept ones only),
    ``zero_dropped=False``, ``softmax`` (a softmax over the chosen scores)."""
    weights = scores.gather(-1, expert_ids)
    if softmax:
        weights = weights.softmax(dim=-1)
    elif normalise if normalise is not None else expert_ids.shape[-1] > 1:
        mask = kept.to(weights.dtype) if over_kept else torch.ones_like(weights)
        weights = weights / (weights * mask).sum(dim=-1, keepdim=True).clamp_min(1e-300)
    return torch.where(kept, weights, torch.zeros_like(weights)) if zero_dropped else weights


def balance_loss(scores: torch.Tensor, expert_ids: torch.Tensor, counted: bool = True, per_token: bool = False,
                 times_experts: bool = True, normalised: bool = True, first_only: bool = False) -> torch.Tensor:
    """Switch's ``E sum_e f_e P_e``.  Rivals: ``counted=False`` (``f`` taken from the scores), ``per_token``
    (``f`` over ``T``, not ``T k``), ``times_experts=False``, ``normalised=False`` (raw sigmoid scores),
    ``first_only`` (``f`` from the first choices)."""
    n_experts = scores.shape[-1]
    flat = scores.reshape(-1, n_experts)
    probabilities = flat / flat.sum(dim=-1, keepdim=True) if normalised else flat
    mean = probabilities.mean(dim=0)
    ids = expert_ids.reshape(-1, expert_ids.shape[-1])
    choices = ids.shape[0] if per_token else ids.numel()
    ids = ids[:, :1] if first_only else ids
    if counted:
        counts = torch.zeros(n_experts, dtype=scores.dtype)
        counts.index_add_(0, ids.reshape(-1), torch.ones(ids.numel(), dtype=scores.dtype))
        fraction = counts / choices
    else:
        fraction = mean.detach()
    return (n_experts if times_experts else 1) * (fraction * mean).sum()


def loads(expert_ids: torch.Tensor, n_experts: int, first_only: bool = False) -> torch.Tensor:
    """The choices each expert got, ``[E]`` ``torch.long``."""
    ids = expert_ids.reshape(-1, expert_ids.shape[-1])
    ids = ids[:, :1] if first_only else ids
    return torch.zeros(n_experts, dtype=torch.long).index_add_(0, ids.reshape(-1), torch.ones(ids.numel(),
                                                                                                dtype=torch.long))


def bias_step(bias: torch.Tensor, load: torch.Tensor, rate: float, rule: str = "sign") -> torch.Tensor:
    """DeepSeek-V3's ``b + rate * sign(mean load - load)``.  Rivals by ``rule``: ``"flipped"`` (the sign turned),
    ``"proportional"`` (``rate * (mean - load)``), ``"ties move"`` (up unless above the mean), ``"integer mean"``
    (the mean rounded down)."""
    load = load.to(torch.float64)
    mean = load.mean()
    if rule == "integer mean":
        mean = torch.floor(mean)
    step = {"sign": torch.sign(mean - load), "flipped": torch.sign(load - mean), "proportional": mean - load,
            "ties move": torch.where(load > mean, -1.0, 1.0), "integer mean": torch.sign(mean - load)}[rule]
    return bias + (rate * step).to(bias.dtype)


# --------------------------------------------------------------------------------------------------------
# The cases


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def scores_of(lead: tuple[int, ...], n_experts: int, kind: str, dtype: torch.dtype, seed: int,
              contiguous: bool = True, logits: torch.Tensor | None = None) -> torch.Tensor:
    """Router scores ``[*lead, E]``, softmax or sigmoid of random ``logits`` (given: a leaf whose gradient the
    checks read, as the gate's); not contiguous: laid out column-major."""
    if logits is None:
        logits = torch.randn(*lead, n_experts, generator=generator(seed), dtype=torch.float64)
    scores = (logits.softmax(dim=-1) if kind == "softmax" else logits.sigmoid()).to(dtype)
    return scores if contiguous else noncontiguous(scores)


def bias_of(n_experts: int, scale: float, seed: int, contiguous: bool = True,
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A balancing bias ``[E]`` of about ``scale``; not contiguous: every other element of a longer tensor."""
    values = (torch.rand(2 * n_experts, generator=generator(seed), dtype=torch.float64) * 2 - 1) * scale
    values = values.to(dtype)
    return values[::2] if not contiguous else values[:n_experts].clone()


def noncontiguous(tensor: torch.Tensor) -> torch.Tensor:
    """The same values laid out column-major, every dimension's order reversed (a transposed view): neither
    ``view(-1)`` nor, with two leading dimensions or more, ``view(-1, k)`` can read it."""
    order = tuple(reversed(range(tensor.dim())))
    return tensor.permute(order).contiguous().permute(order)


def skewed_ids(lead: tuple[int, ...], n_experts: int, top_k: int, seed: int, skew: float = 0.3,
               unused: int = 0) -> torch.Tensor:
    """Each token's ``k`` distinct experts, best first, from scores leaning towards the first experts; the last
    ``unused`` experts never chosen."""
    scores = scores_of(lead, n_experts, "softmax", torch.float64, seed)
    lean = skew * torch.linspace(1, 0, n_experts, dtype=torch.float64)
    if unused:
        lean[n_experts - unused:] = -10.0
    return choose(scores, lean, top_k)


@dataclass(frozen=True)
class RouteCase:
    lead: tuple[int, ...]
    n_experts: int
    top_k: int
    kind: str  # "softmax" or "sigmoid"
    bias_scale: float
    dtype: torch.dtype
    contiguous: bool
    seed: int

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logits, scores, bias)``: the scores computed from the leaf ``logits``, as the gate's are."""
        logits = torch.randn(*self.lead, self.n_experts, generator=generator(self.seed), dtype=torch.float64)
        logits.requires_grad_(logits.numel() > 0)
        scores = scores_of(self.lead, self.n_experts, self.kind, self.dtype, self.seed, self.contiguous, logits)
        return logits, scores, bias_of(self.n_experts, self.bias_scale, self.seed + 1, self.contiguous)

    def label(self) -> str:
        return (f"{self.kind} scores {list(self.lead) + [self.n_experts]} ({str(self.dtype)[6:]}"
                f"{'' if self.contiguous else ', not contiguous'}), top-{self.top_k}, "
                f"{'a bias of about ' + format(self.bias_scale, 'g') if self.bias_scale else 'no bias'}")


ROUTE_CASES = [RouteCase((24,), 8, 2, "softmax", 0.0, torch.float64, True, 1),
               RouteCase((10,), 8, 1, "softmax", 0.1, torch.float64, True, 2),
               RouteCase((7, 3), 16, 4, "sigmoid", 0.2, torch.float32, False, 3),
               RouteCase((2, 3, 5), 6, 6, "softmax", 0.1, torch.float64, True, 4),
               RouteCase((300,), 64, 8, "sigmoid", 0.1, torch.float64, False, 5),
               RouteCase((0,), 4, 2, "softmax", 0.1, torch.float64, True, 6)]

# Combine weights: (scores case, capacity factor), drops and all; the ids chosen with the case's bias
COMBINE_CASES = [(RouteCase((24,), 8, 2, "softmax", 0.05, torch.float64, True, 11), 1.0),
                 (RouteCase((12,), 8, 1, "softmax", 0.0, torch.float64, True, 12), 1.0),
                 (RouteCase((4, 6), 16, 4, "sigmoid", 0.1, torch.float64, False, 13), 0.75),
                 (RouteCase((2, 3, 4), 6, 3, "softmax", 0.1, torch.float32, True, 14), None),
                 (RouteCase((9,), 4, 1, "sigmoid", 0.1, torch.float64, False, 15), 1.0),
                 (RouteCase((0,), 4, 2, "softmax", 0.0, torch.float64, True, 16), 1.0)]

# (tokens, k, E, C): products that are whole numbers (an answer off by one, or rounding down and adding one,
# fails there) and products that are not (rounding down or to nearest fails); below one share; None.
CAPACITY_CASES = [(24, 2, 8, 1.0), (24, 2, 8, 1.25), (4096, 2, 8, 1.25), (10, 1, 4, 1.0), (1000, 2, 64, 1.1),
                  (7, 3, 8, 0.5), (4096, 8, 256, 1.0), (4096, 8, 256, 1.5), (5, 1, 8, 1.0), (100, 2, 8, 2.0),
                  (3, 2, 6, 1.0), (333, 2, 8, 1.25), (100, 1, 8, 2), (1, 1, 1, 1.0), (50, 4, 16, 0.3),
                  (24, 2, 8, None), (4096, 8, 256, None)]

# (ids' leading shape, E, k, capacity, skew, unused experts, contiguous)
KEPT_CASES = [((24,), 8, 2, 6, 0.3, 0, True), ((30,), 4, 1, 5, 0.5, 0, True), ((4, 5), 8, 3, 2, 0.3, 2, False),
              ((2, 3, 4), 6, 4, 3, 0.2, 0, False), ((2048,), 64, 4, 128, 0.6, 0, True),
              ((16,), 8, 2, 0, 0.3, 0, True), ((16,), 8, 2, None, 0.3, 0, True), ((16,), 8, 2, 40, 0.3, 0, True),
              ((0,), 4, 2, 3, 0.3, 0, True)]

# (scores case, skew of the choice, unused experts)
AUX_CASES = [(RouteCase((24,), 8, 2, "softmax", 0.0, torch.float64, True, 21), 0.3, 0),
             (RouteCase((5, 6), 8, 1, "sigmoid", 0.0, torch.float64, False, 22), 0.3, 2),
             (RouteCase((2, 3, 4), 16, 4, "sigmoid", 0.0, torch.float32, True, 23), 0.6, 4),
             (RouteCase((64,), 6, 3, "softmax", 0.0, torch.float64, False, 24), 0.0, 0)]

# (ids' leading shape, E, k, skew, unused experts, bias dtype, contiguous, rate)
BIAS_CASES = [((24,), 8, 2, 0.3, 0, torch.float32, True, 0.01), ((9,), 4, 1, 0.2, 0, torch.float64, True, 0.001),
              ((3, 5), 8, 2, 0.6, 3, torch.float32, False, 0.05), ((2, 3, 4), 6, 3, 0.2, 0, torch.float64, False, 0.1),
              ((4096,), 256, 8, 0.4, 0, torch.float32, True, 0.001), ((8,), 4, 1, 50.0, 3, torch.float32, True, 0.01)]

# ids chosen by hand: every expert at the mean load (no bias moves); loads [3, 2, 2, 2], a mean of 2.25 (three
# experts below it, none above by a whole choice); and every token on expert 0 (``bincount`` without ``minlength``
# gives one count, which broadcasts)
EXPLICIT_LOADS = [(torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]]), 4),
                  (torch.tensor([0, 0, 0, 1, 1, 2, 2, 3, 3])[:, None], 4), (torch.zeros(6, 1, dtype=torch.long), 4)]


# --------------------------------------------------------------------------------------------------------
# A layer's training steps on several processes


@dataclass(frozen=True)
class LayerSetting:
    world: int
    n_experts: int
    top_k: int
    factor: float | None
    kind: str
    steps: int = 3
    rate: float = 0.1
    seed: int = 0

    def label(self) -> str:
        return (f"{self.world} processes, {self.n_experts} experts, top-{self.top_k}, {self.kind} router, capacity "
                f"factor {self.factor}")


LAYER_SETTINGS = [LayerSetting(2, 4, 2, 1.0, "softmax"), LayerSetting(3, 6, 1, 1.25, "sigmoid"),
                  LayerSetting(4, 8, 3, None, "softmax")]
HIDDEN, AUX_WEIGHT = 6, 0.01


def reference_functions(setting: LayerSetting) -> tuple[Callable, ...]:
    """The six rules, the bias's loads summed over the group as the exercise asks."""
    def update(bias: torch.Tensor, expert_ids: torch.Tensor, rate: float, group: Any) -> torch.Tensor:
        load = loads(expert_ids, bias.numel())
        dist.all_reduce(load, group=group)
        return bias_step(bias, load, rate)

    return choose, capacity, lambda ids, e, limit: served(ids, e, limit), combine, balance_loss, update


def layer_step(functions: tuple[Callable, ...], x: torch.Tensor, target: torch.Tensor, gate: torch.Tensor,
               experts: torch.Tensor, bias: torch.Tensor, setting: LayerSetting) -> dict[str, Any]:
    """One step of an MoE layer built from ``functions``: route, capacity, drops, weights, output (each expert
    ``tanh(x W_e)``), the loss with the auxiliary term, the gate's gradient, the new bias."""
    route, capacity_of, kept_of, weights_of, aux_of, update = functions
    leaf = gate.clone().requires_grad_()
    logits = x @ leaf
    scores = logits.softmax(dim=-1) if setting.kind == "softmax" else logits.sigmoid()
    ids = route(scores, bias, setting.top_k)
    limit = capacity_of(x.shape[0] * x.shape[1], setting.top_k, setting.n_experts, setting.factor)
    kept = kept_of(ids, setting.n_experts, limit)
    weights = weights_of(scores, ids, kept)
    aux = aux_of(scores, ids)
    outputs = torch.tanh(torch.einsum("bsh,bskhg->bskg", x, experts[ids]))
    out = (weights.unsqueeze(-1) * outputs).sum(dim=-2)
    (gradient,) = torch.autograd.grad((out * target).sum() + AUX_WEIGHT * aux, leaf)
    new_bias = update(bias, ids, setting.rate, dist.group.WORLD)
    return {"ids": ids, "capacity": limit, "kept": kept, "weights": weights.detach(), "aux": aux.detach(),
            "out": out.detach(), "gradient": gradient, "bias": new_bias}


def _differs(a: Any, b: Any, tolerance: float) -> bool:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return a != b
    return a.shape != b.shape or bool(((a.double() - b.double()).abs() > tolerance).any())


def layer_weights(setting: LayerSetting) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate ``[h, E]`` and the experts ``[E, h, h]``, the same on every rank."""
    shared = generator(setting.seed)
    gate = torch.randn(HIDDEN, setting.n_experts, generator=shared, dtype=torch.float64)
    return gate, torch.randn(setting.n_experts, HIDDEN, HIDDEN, generator=shared, dtype=torch.float64) / HIDDEN ** 0.5


def layer_batches(setting: LayerSetting, rank: int, gate: torch.Tensor) -> Iterator[tuple[torch.Tensor, ...]]:
    """Each step's tokens ``[2, 3 + 2 rank + step, h]`` and target: uneven, every rank its own count and every
    step; leaning towards the rank's own expert (data-parallel ranks see different data)."""
    lean = 1.5 * gate[:, rank % setting.n_experts] / gate[:, rank % setting.n_experts].norm()
    own = generator(setting.seed + 1 + rank)
    for step in range(setting.steps):
        tokens = 3 + 2 * rank + step
        x = torch.randn(2, tokens, HIDDEN, generator=own, dtype=torch.float64) + lean
        yield x, torch.randn(2, tokens, HIDDEN, generator=own, dtype=torch.float64)


def layer_steps(module: Any, call: Callable, setting: LayerSetting) -> tuple[int, str] | None:
    """One rank's steps: the student's six (through the checker's ``call``) and the rules side by side, from the
    same state each step; the first difference, as ``(step, message)``.  Every rank runs every step, so that the
    collectives of ``update_bias`` match whatever differs.  Each rank's tokens lean towards its own expert (data
    parallel ranks see different data), so that its own loads and the group's disagree."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gate, experts = layer_weights(setting)
    names = ("route", "expert_capacity", "kept_choices", "combine_weights", "aux_loss", "update_bias")
    student = tuple(lambda *args, name=name: call(module, name, *args) for name in names)
    bias, first = torch.zeros(setting.n_experts), None
    for step, (x, target) in enumerate(layer_batches(setting, rank, gate)):
        tokens = x.shape[1]
        found = layer_step(student, x, target, gate, experts, bias.clone(), setting)
        want = layer_step(reference_functions(setting), x, target, gate, experts, bias, setting)
        local = bias_step(bias, loads(want["ids"], bias.numel()), setting.rate)  # every rank, every step: the
        averaged = local.clone()  # same collectives whatever differs
        dist.all_reduce(averaged)
        averaged /= world
        where = f"rank {rank}, step {step} ({2 * tokens} tokens [2, {tokens}])"
        for key, tolerance in (("ids", 0), ("capacity", 0), ("kept", 0), ("weights", 1e-12), ("aux", 1e-12),
                               ("out", 1e-10), ("gradient", 1e-10), ("bias", setting.rate * 1e-3)):
            if first is None and _differs(found[key], want[key], tolerance):
                first = (step, f"{where}: " + (_layer_message(key, found, want) if key != "bias" else
                                               _bias_message(found, want, bias, local, averaged, setting, world)))
        bias = want["bias"]
    return first


def _layer_message(key: str, found: dict, want: dict) -> str:
    shown = {"ids": "route's experts", "capacity": "expert_capacity", "kept": "kept_choices",
             "weights": "combine_weights", "aux": "aux_loss", "out": "the layer's output (from your weights)",
             "gradient": "the gate's gradient (through your weights and auxiliary loss)"}[key]
    got, expected = found[key], want[key]
    if isinstance(got, torch.Tensor) and isinstance(expected, torch.Tensor) and got.shape == expected.shape:
        flat_got, flat_expected = got.double().reshape(-1), expected.double().reshape(-1)
        index = int(((flat_got - flat_expected).abs() > 1e-12).nonzero()[0, 0])
        at = f" at flat index {index}" if got.dim() else ""
        return (f"{shown} gave {flat_got[index].item():.6g}{at}, the rules {flat_expected[index].item():.6g} "
                "(everything before it agreed; the single checks above say why)")
    shapes = [tuple(value.shape) if isinstance(value, torch.Tensor) else value for value in (got, expected)]
    return f"{shown} gave {shapes[0]}, the rules {shapes[1]}"


def _bias_message(found: dict, want: dict, bias: torch.Tensor, local: torch.Tensor, averaged: torch.Tensor,
                  setting: LayerSetting, world: int) -> str:
    moved = [round(v, 4) for v in (found["bias"].double() - bias.double()).tolist()]
    expected = [round(v, 4) for v in (want["bias"].double() - bias.double()).tolist()]
    hint = ""
    if not _differs(found["bias"], local, setting.rate * 1e-3):
        hint = (f": moved by this rank's loads alone; sum the loads over the group's {world} ranks "
                "(dist.all_reduce) so that every rank's biases take the same step")
    elif not _differs(found["bias"], averaged, setting.rate * 1e-3):
        hint = (": the ranks' own steps, averaged: the ranks agree, but on the wrong step; sum the loads over the "
                "group first, then take one step from them")
    return f"update_bias moved the bias by {moved}, expected {expected}{hint}"
