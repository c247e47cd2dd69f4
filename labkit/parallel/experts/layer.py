"""The mixture-of-experts layer: TinyGPT's MLP replaced by ``E`` MLPs and a router (Shazeer et al. 2017).

A dense block runs every token through one MLP.  An MoE block has ``E`` experts, each an MLP, and sends each
token through ``k`` of them (:mod:`labkit.parallel.experts.router`), summing their outputs weighted by the
router's scores: the parameters grow ``E`` times, the FLOPs per token ``k`` times (for Mixtral 8x7B, 47B
parameters of which 13B work on each token; DeepSeek-V3, 671B and 37B).  Optionally ``n_shared_experts`` more
MLPs see every token (DeepSeek-V3's shared expert), one MLP ``n_shared_experts`` times as wide.

**Shared experts** (DeepSeekMoE, Dai et al. 2024, section 3.2).  With many small routed experts (DeepSeek's
*fine-grained segmentation*: 256 of width 2048 where a dense layer would have one of 18432), every routed expert
would otherwise relearn what all tokens need (syntax, frequent words).  Isolating that in experts every token
goes through leaves the routed ones free to specialise; a token's FLOPs are its ``k`` routed experts plus the
shared ones (DeepSeek-V3: 8 + 1 of width 2048, the 18432 of its dense layers), and a token whose routed choices
were all dropped still gets the shared experts' output.

**Where the auxiliary loss enters.**  The balancing loss is computed in the layer, but the loss lives at the end
of the model (or of the pipeline, on another rank).  As Megatron-Core does (``MoEAuxLossAutoScaler``), the layer
returns its output through :class:`_AuxLoss`, an identity in forward whose backward also gives the auxiliary
loss the gradient ``aux_loss_weight x scale``: ``scale`` is the factor the model's loss is multiplied by before
its backward (1; the loss scaler's ``S / m`` with ``m`` micro-batches), set with :func:`aux_loss_scale` around
the forward pass (the pipeline stages and the wrappers do).  So the gradients are those of
``loss + aux_loss_weight x sum of the layers' aux losses`` wherever the layers are, and the loss reported stays
the language-model loss.  ST-MoE's router z-loss (``z_loss_weight``) rides the same way.

:func:`moe_reference` is the textbook definition, every expert on every token, to check the layer against.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from labkit.parallel.experts.permute import route_to_experts
from labkit.parallel.experts.router import Router, Routing, check_moe

_SCALE = [1.0]  # the factor the loss's gradient carries (aux_loss_scale)


@contextlib.contextmanager
def aux_loss_scale(scale: float) -> Iterator[None]:
    """Forward passes run inside give the auxiliary losses' gradient this factor (the loss's own)."""
    previous, _SCALE[0] = _SCALE[0], float(scale)
    try:
        yield
    finally:
        _SCALE[0] = previous


class _AuxLoss(torch.autograd.Function):
    """Identity on ``out``; in backward, ``aux`` receives the gradient ``weight`` (Megatron's autoscaler)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight = weight
        ctx.save_for_backward(aux)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.weight), None


class Expert(nn.Module):
    """One MLP: ``proj(gelu(fc(x)))``, hidden width ``hidden`` (the dense block's MLP is one with ``4 h``)."""

    def __init__(self, n_embd: int, hidden: int, bias: bool = True, dropout: float = 0.0):
        super().__init__()
        self.fc = nn.Linear(n_embd, hidden, bias=bias)
        self.proj = nn.Linear(hidden, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class MoE(nn.Module):
    """Router, ``n_experts`` experts (:attr:`experts`, a ``ModuleList`` whose slots are ``None`` for the experts
    another rank holds), optional shared experts.  ``forward(x [..., h]) -> [..., h]``.

    After each forward, :attr:`last` holds its routing statistics (``assigned``, ``received`` per expert,
    ``dropped``, ``capacity``, ``aux_loss``, ``z_loss``), and :attr:`load` accumulates the assignments per expert until
    :func:`balance_experts` uses them.
    """

    def __init__(self, n_embd: int, n_experts: int, top_k: int, *, expert_hidden: int | None = None,
                 score: str = "softmax", capacity_factor: float | None = None, n_shared_experts: int = 0,
                 aux_loss_weight: float = 0.0, z_loss_weight: float = 0.0, bias: bool = True):
        super().__init__()
        hidden = expert_hidden or 4 * n_embd
        check_moe(n_experts, top_k, score=score, capacity_factor=capacity_factor, n_shared_experts=n_shared_experts,
                  expert_hidden=hidden, aux_loss_weight=aux_loss_weight, z_loss_weight=z_loss_weight)
        self.aux_loss_weight, self.z_loss_weight = float(aux_loss_weight), float(z_loss_weight)
        self.router = Router(n_embd, n_experts, top_k, score, capacity_factor)
        self.experts = nn.ModuleList(Expert(n_embd, hidden, bias) for _ in range(n_experts))
        self.shared = Expert(n_embd, n_shared_experts * hidden, bias) if n_shared_experts else None
        # Assignments per expert since the last balancing: a plain tensor, not a buffer (DDP broadcasts buffers).
        self.load: torch.Tensor | None = None
        self.ep: Any = None  # an ExpertParallelGroup when the experts are spread (apply_expert_parallel)
        self.last: dict[str, Any] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        routing = self.router(tokens)
        out = route_to_experts(tokens, routing.experts, routing.weights, routing.kept, self.experts, self.ep)
        if self.shared is not None:
            out = out + self.shared(tokens)
        aux, z = routing.aux_loss(), routing.z_loss()
        self._record(routing, aux, z)
        if (self.aux_loss_weight or self.z_loss_weight) and torch.is_grad_enabled():
            penalty = self.aux_loss_weight * aux + self.z_loss_weight * z
            out = _AuxLoss.apply(out, penalty, _SCALE[0])
        return out.view_as(x)

    @torch.no_grad()
    def _record(self, routing: Routing, aux: torch.Tensor, z: torch.Tensor) -> None:
        assigned = routing.assigned()
        if self.training:
            self.load = assigned if self.load is None else self.load + assigned
        self.last = {"assigned": assigned, "received": routing.received(), "dropped": routing.dropped(),
                     "capacity": routing.capacity, "aux_loss": float(aux), "z_loss": float(z)}

    def extra_repr(self) -> str:
        held = [index for index, expert in enumerate(self.experts) if expert is not None]
        return f"experts {held[0]}..{held[-1]} of {len(self.experts)}" + (f", ep={self.ep.size}" if self.ep else "")


def moe_reference(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer's output by definition, on one process holding every expert: each expert on *every* token,
    weighted by the token's gate for it (zero where not chosen, or dropped), summed; plus the shared experts."""
    tokens = x.reshape(-1, x.shape[-1])
    routing = layer.router(tokens)
    gates = torch.zeros_like(routing.scores).scatter_add(
        -1, routing.experts, routing.weights * routing.kept.to(routing.weights.dtype))
    out = sum(gates[:, e:e + 1] * expert(tokens) for e, expert in enumerate(layer.experts))
    if layer.shared is not None:
        out = out + layer.shared(tokens)
    return out.view_as(x)


def moe_layers(model: nn.Module) -> list[MoE]:
    """Every MoE layer of ``model``, in order."""
    return [module for module in model.modules() if isinstance(module, MoE)]


def is_expert_parallel(parameter: torch.Tensor) -> bool:
    """Whether data parallelism must leave ``parameter`` alone (an expert held by this rank only)."""
    return getattr(parameter, "expert_parallel", False)
