"""The router: which ``k`` of ``E`` experts each token goes to, with what weight, and which assignments are dropped.

**Scores.**  A linear gate (no bias) gives each token ``E`` logits.  ``score="softmax"`` (Switch, GShard,
Mixtral) turns them into probabilities over the experts; ``score="sigmoid"`` (DeepSeek-V3) scores each expert
on its own, in ``(0, 1)``.  The token goes to its ``k`` highest-scoring experts (*token choice*), and the
expert's output is weighted by the token's score for it, renormalised over the ``k`` chosen when ``k > 1``
(Mixtral's softmax over the top-k logits is the same thing; DeepSeek-V3 normalises its sigmoid scores alike).
With ``k = 1`` the weight is the raw probability, as in Switch: normalised it would be 1 and the gate would get
no gradient.

**Capacity** (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021).  Experts run fixed-size batches on
accelerators, so an expert takes at most ``capacity = ceil(capacity_factor * T k / E)`` of the ``T k``
assignments of a batch of ``T`` tokens (Megatron-Core's ``get_capacity``); the assignments past it are
**dropped**: the expert does not see the token, its output for that choice is zero, and the token passes
through the block on the residual connection alone.  Priority follows GShard: every token's first choice is
served before any token's second, and within a choice, tokens in order.  ``capacity_factor=None`` drops
nothing (dropless MoE, as Megatron-Core and torchtitan train by default).  The capacity is counted over the
tokens one forward pass routes: with expert parallelism, each rank's own tokens, before they leave the rank.

**Balance.**  A router left alone tends to collapse onto a few experts (they get more tokens, so better, so
more tokens).  Two remedies, both here:

- the **auxiliary loss** (Switch's eq. 4, GShard's form): ``E * sum_e f_e P_e``, where ``f_e`` is the fraction
  of the ``T k`` assignments given to expert ``e`` and ``P_e`` its mean score over the tokens (sigmoid scores
  normalised over the experts first).  It is 1 when both are uniform, up to ``E`` when everything goes to one
  expert; ``f`` is counted, not differentiated, so the gradient pushes the scores of busy experts down.  Added
  to the loss with a small weight (Switch: 0.01);
- **auxiliary-loss-free bias balancing** (DeepSeek-V3, Liu et al. 2024, section 2.1.2; Wang et al. 2024): a
  bias ``b_e`` per expert is added to the scores *for the choice only* (the weights use the unbiased scores),
  and after every step each expert's bias moves by ``gamma`` towards balance: down if it took more than the
  mean load, up if fewer (:meth:`Router.update_bias`).  No gradient is involved.

**Stability** (ST-MoE, Zoph et al. 2022).  The router's softmax (or sigmoid) exponentiates its logits, and in
bfloat16 (8 significant bits) a logit of 30 carries a rounding error near 0.1, a tenth of a probability's
worth.  Two remedies, both here: the router computes in float32 whatever the model's dtype (Switch's *selective
precision*, Fedus et al. 2021, section 2.4: the gate's product, the scores and the top-k in float32 or wider,
outside autocast), and the **router z-loss** (ST-MoE's eq. 5) ``mean_t (log sum_e exp(logit_te))^2`` penalises
large logits, added to the loss with a small weight (ST-MoE: 0.001): it keeps the exponent's argument where
rounding is small, without constraining which expert wins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SCORES = ("softmax", "sigmoid")


def check_moe(n_experts: object, top_k: object, *, score: object = "softmax", capacity_factor: object = None,
              n_shared_experts: object = 0, expert_hidden: object = None, aux_loss_weight: object = 0.0,
              bias_update_rate: object = 0.0, z_loss_weight: object = 0.0) -> None:
    """Every check of a mixture-of-experts configuration; ``ValueError`` naming the value."""
    for name, value, least in (("n_experts", n_experts, 1), ("top_k", top_k, 1),
                               ("n_shared_experts", n_shared_experts, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    if top_k > n_experts:
        raise ValueError(f"top_k={top_k} experts per token cannot exceed n_experts={n_experts}")
    if score not in SCORES:
        raise ValueError(f"router score must be one of {SCORES}, got {score!r}")
    if expert_hidden is not None and (isinstance(expert_hidden, bool) or not isinstance(expert_hidden, int)
                                      or expert_hidden < 1):
        raise ValueError(f"expert_hidden must be an integer >= 1 or None (4 n_embd), got {expert_hidden!r}")
    # Finite: an infinite capacity (None is no limit) overflows ceil(C T k / E), an infinite loss weight trains to
    # NaN, and an infinite bias step makes the biases infinite, so the routing no longer reads the scores.
    if capacity_factor is not None and (isinstance(capacity_factor, bool)
                                        or not isinstance(capacity_factor, (int, float))
                                        or not 0 < capacity_factor < math.inf):
        raise ValueError(f"capacity_factor must be a finite number > 0, or None to drop nothing, got "
                         f"{capacity_factor!r}")
    for name, value in (("aux_loss_weight", aux_loss_weight), ("bias_update_rate", bias_update_rate),
                        ("z_loss_weight", z_loss_weight)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def expert_capacity(tokens: int, top_k: int, n_experts: int, capacity_factor: float | None) -> int | None:
    """The most assignments one expert takes from ``tokens`` tokens: ``ceil(capacity_factor * tokens k / E)``
    (``None``: unlimited)."""
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * tokens * top_k / n_experts)


@dataclass
class Routing:
    """One forward pass's routing of ``T`` tokens: ``experts`` ``[T, k]`` (chosen expert ids), ``weights``
    ``[T, k]`` (differentiable), ``kept`` ``[T, k]`` (within capacity), ``scores`` ``[T, E]`` (the router's,
    differentiable), ``capacity`` (``None``: unlimited), ``logits`` ``[T, E]`` (the gate's, before the softmax or
    sigmoid; float32 or wider)."""

    experts: torch.Tensor
    weights: torch.Tensor
    kept: torch.Tensor
    scores: torch.Tensor
    capacity: int | None
    logits: torch.Tensor | None = None

    @property
    def n_experts(self) -> int:
        return self.scores.shape[-1]

    def assigned(self) -> torch.Tensor:
        """Assignments the router made to each expert ``[E]``, before the capacity drops some."""
        return torch.bincount(self.experts.reshape(-1), minlength=self.n_experts)

    def received(self) -> torch.Tensor:
        """Tokens each expert computes ``[E]``: its kept assignments."""
        return torch.bincount(self.experts[self.kept], minlength=self.n_experts)

    def dropped(self) -> int:
        """Assignments dropped by the capacity."""
        return int((~self.kept).sum())

    def aux_loss(self) -> torch.Tensor:
        """Switch's load-balancing loss ``E * sum_e f_e P_e`` (1 when uniform; see the module docstring)."""
        fraction = self.assigned().to(self.scores.dtype) / self.experts.numel()
        probabilities = self.scores / self.scores.sum(dim=-1, keepdim=True)  # softmax: unchanged
        return self.n_experts * (fraction * probabilities.mean(dim=0)).sum()

    def z_loss(self) -> torch.Tensor:
        """ST-MoE's router z-loss ``mean_t (logsumexp_e logit_te)^2`` (see the module docstring)."""
        if self.logits is None:
            raise ValueError("this Routing was built without its logits: the z-loss needs them")
        return self.logits.logsumexp(dim=-1).pow(2).mean()


def drop_over_capacity(experts: torch.Tensor, n_experts: int, capacity: int | None) -> torch.Tensor:
    """``kept`` ``[T, k]``: each assignment's place in its expert's queue is below ``capacity``.  The queue is
    filled choice by choice (every token's first choice, then every second), tokens in order (GShard)."""
    if capacity is None:
        return torch.ones_like(experts, dtype=torch.bool)
    by_choice = experts.t().reshape(-1)  # [k T]: first choices of all tokens, then second choices, ...
    one_hot = F.one_hot(by_choice, n_experts)
    place = (one_hot.cumsum(dim=0) * one_hot).sum(dim=-1) - 1  # 0 for an expert's first assignment
    return (place < capacity).view(experts.shape[1], experts.shape[0]).t()


class Gate(nn.Linear):
    """The router's linear gate (no bias), computed in float32 at least, outside autocast, whatever the dtype of its
    inputs and weight (float64 stays float64): Switch's selective precision.  A module of its own, so that the
    weight is used inside its layer's forward (a split pipeline backward finds it there)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(tokens.dtype, torch.float32)
        with torch.autocast(tokens.device.type, enabled=False):
            return F.linear(tokens.to(dtype), self.weight.to(dtype))


class Router(nn.Module):
    """Linear gate, scores, top-k, capacity; see the module docstring.  ``forward(tokens [T, h]) -> Routing``."""

    def __init__(self, n_embd: int, n_experts: int, top_k: int, score: str = "softmax",
                 capacity_factor: float | None = None, device: torch.device | str | None = None):
        super().__init__()
        check_moe(n_experts, top_k, score=score, capacity_factor=capacity_factor)
        self.n_experts, self.top_k, self.score, self.capacity_factor = n_experts, top_k, score, capacity_factor
        self.gate = Gate(n_embd, n_experts, bias=False, device=device)
        # DeepSeek-V3's balancing bias: shifts the choice only; a buffer (no gradient), saved in checkpoints.
        self.register_buffer("bias", torch.zeros(n_experts, device=device))

    def forward(self, tokens: torch.Tensor) -> Routing:
        logits = self.gate(tokens)  # float32 at least (Gate)
        scores = logits.softmax(dim=-1) if self.score == "softmax" else logits.sigmoid()
        chosen = (scores.detach() + self.bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.top_k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        capacity = expert_capacity(tokens.shape[0], self.top_k, self.n_experts, self.capacity_factor)
        return Routing(chosen, weights, drop_over_capacity(chosen, self.n_experts, capacity), scores, capacity, logits)

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, rate: float) -> None:
        """DeepSeek-V3's update: ``b_e += rate * sign(mean load - load_e)``, ``load`` ``[E]`` the tokens each
        expert was assigned over the step (every data-parallel rank's, summed, so that all ranks move alike)."""
        load = load.to(self.bias.dtype)
        self.bias += rate * torch.sign(load.mean() - load)

    def extra_repr(self) -> str:
        return (f"{self.score}, top_k={self.top_k}, "
                f"capacity_factor={self.capacity_factor if self.capacity_factor is not None else 'none'}")
