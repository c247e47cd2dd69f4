"""Sending tokens to their experts and the results back: the arithmetic, and the path on one process.

The kept assignments (token, choice) of a batch are **permuted**: sorted by expert, stably
(:func:`dispatch_order`), so that each expert's rows are contiguous and every expert runs once on a batch of
its rows; on ``ep`` ranks holding ``E / ep`` experts each, contiguous, the same order groups the rows by
destination rank (:func:`send_counts` of them for each), and within a rank by expert.  The results come back in
that order; :func:`inverse_permutation` puts them back in assignment order, where each is weighted by its gate
and summed into its token (:func:`route_to_experts`).  What expert parallelism adds in between, the all-to-alls,
is :mod:`labkit.parallel.experts.dispatch`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def owner_of(expert_ids: torch.Tensor, n_experts: int, ep: int) -> torch.Tensor:
    """The rank holding each expert id: ``id // (E / ep)``."""
    return torch.div(expert_ids, n_experts // ep, rounding_mode="floor")


def send_counts(expert_ids: torch.Tensor, n_experts: int, ep: int) -> torch.Tensor:
    """``[ep]``: how many of the assignments ``expert_ids`` (any shape) go to each rank."""
    return torch.bincount(owner_of(expert_ids.reshape(-1), n_experts, ep), minlength=ep)


def dispatch_order(expert_ids: torch.Tensor, n_experts: int, ep: int) -> torch.Tensor:
    """The permutation ``order`` (``expert_ids[order]`` sorted) that groups assignments by destination rank, and
    within a rank by expert, keeping the original order among equals (stable): ``expert_ids`` is ``[N]``."""
    del n_experts, ep  # contiguous ownership: sorting by expert sorts by rank too
    return torch.sort(expert_ids, stable=True).indices


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """``inverse`` with ``x[order][inverse] == x``."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


def run_experts(rows: torch.Tensor, counts: list[int], experts: nn.ModuleList, first: int) -> torch.Tensor:
    """Expert ``first + i`` on the ``counts[i]`` rows of its chunk, in order; every expert runs, even on no rows,
    so that each gets a gradient (zero) and the data-parallel reduction sees every tensor."""
    outputs = [experts[first + i](chunk) for i, chunk in enumerate(rows.split(counts))]
    return torch.cat(outputs) if outputs else rows


def route_to_experts(tokens: torch.Tensor, experts_ids: torch.Tensor, weights: torch.Tensor, kept: torch.Tensor,
                     experts: nn.ModuleList, ep: Any = None) -> torch.Tensor:
    """``sum_k weights[t, k] * expert[experts_ids[t, k]](tokens[t])`` over the kept choices, ``[T, h]``: the
    experts all here, or with ``ep`` (an :class:`~labkit.parallel.experts.dispatch.ExpertParallelGroup`) spread
    over its ranks (``experts``' slots ``None`` for the others').  See the module docstring."""
    n_tokens, top_k = experts_ids.shape
    n_experts = len(experts)
    size = 1 if ep is None else ep.size
    kept_ids = kept.reshape(-1).nonzero().squeeze(1)  # assignment = token * k + choice
    expert_of = experts_ids.reshape(-1)[kept_ids]
    order = dispatch_order(expert_of, n_experts, size)
    rows = tokens[kept_ids[order] // top_k]  # the permuted rows, grouped by destination rank
    per_expert = torch.bincount(expert_of, minlength=n_experts)
    if ep is None or ep.size == 1:
        returned = run_experts(rows, per_expert.tolist(), experts, 0)
    else:
        returned = ep.exchange(rows, per_expert, experts)
    restored = returned[inverse_permutation(order)]  # back in assignment order
    gated = restored * weights.reshape(-1)[kept_ids].unsqueeze(-1).to(restored.dtype)
    return tokens.new_zeros(n_tokens, tokens.shape[-1]).index_add(0, kept_ids // top_k, gated)
