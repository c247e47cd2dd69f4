"""Exercise 14 — mixture of experts: the router's choice, its combine weights, the capacity and its drops, balance.

Lesson 14's MoE layer, for a batch of ``T`` tokens and ``E`` experts: the gate gives each token a score for every
expert (``scores [..., E]``: a softmax over the experts, or DeepSeek-V3's sigmoids); the router sends the token to
``k`` of them; an expert takes at most a **capacity** of the batch's ``T k`` choices and drops the rest; the
token's output is the sum of its kept experts' outputs, each multiplied by a **combine weight**; and the loads are
kept even by an auxiliary loss or by a bias.  Write the six rules, in the lesson's order.  Tensors may have any
number of leading dimensions (``[T, E]``, ``[batch, seq, E]``) and any layout (a transposed view is not
contiguous); a token is one position of the leading dimensions, in their row-major order.

**Routing** (the lesson's router, and the tokens it drops).

1. ``route(scores, bias, top_k)``: ``[..., k]`` expert ids, ``torch.long``: each token's ``k`` experts with the
   highest ``score + bias``, the best first (the first choice is the one the capacity serves first).  ``bias``
   ``[E]`` is DeepSeek-V3's balancing bias (zeros when unused): it moves the choice, and nothing else.
2. ``combine_weights(scores, expert_ids, kept)``: ``[..., k]``, in ``scores``' dtype and differentiable in
   ``scores`` (the gate learns through these weights): each choice's weight is the token's score for that expert
   (the score, not score + bias); with ``k > 1`` divided by the sum of the scores of the token's ``k`` choices,
   dropped ones included (a drop does not hand its share to the others); with ``k = 1`` the score itself
   (divided by itself it would be 1, and the gate would get no gradient); and 0 where ``kept`` is False.

**Capacity** (the same section, and the capacity factor against dropped tokens and time).

3. ``expert_capacity(tokens, top_k, n_experts, capacity_factor)``: an ``int``, the most choices one expert takes
   from a batch of ``tokens`` tokens: ``capacity_factor`` times an even share of the batch's choices, rounded up to
   a whole choice; ``None`` when ``capacity_factor`` is ``None`` (dropless).
4. ``kept_choices(expert_ids, n_experts, capacity)``: ``[..., k]`` ``torch.bool``, True where the expert takes the
   choice.  Each expert serves its choices in GShard's priority: every token's first choice before any token's
   second, and so on; among choices of the same rank, tokens in order.  It takes the first ``capacity`` of them;
   ``capacity=None`` keeps everything.

**Balance** (the auxiliary loss and DeepSeek-V3's bias).

5. ``aux_loss(scores, expert_ids)``: Switch's auxiliary loss ``E sum_e f_e P_e``, a 0-dim tensor in ``scores``'
   dtype, differentiable in ``scores``: ``f_e`` the share of all ``T k`` choices that went to expert ``e``
   (counted), ``P_e`` expert ``e``'s mean score over the tokens, each token's scores first divided by their sum
   (softmax scores already sum to 1, sigmoid ones do not).  1 when both are even.
6. ``update_bias(bias, expert_ids, rate, group=None)``: DeepSeek-V3's step on its bias, returning the new bias
   ``[E]`` (``bias``'s dtype): every expert's bias moves by ``rate``, down if its load is above the mean load over
   the experts, up if below, not at all if equal.  An expert's load is the number of choices that named it (all
   ``k`` of every token: what the router asked of it, not what a capacity let through).  With ``group``, a
   process group of data-parallel ranks, the loads are those of all its ranks summed, so that every rank moves its
   biases alike; with ``group=None`` this process's alone (no collective).

What a caller needs: ids as ``torch.long`` (indices of a real batch pass 32,767), masks as ``torch.bool``
(indexing reads integers as positions), an ``int`` capacity (it sizes buffers), every tensor on its inputs' device
(tried on ``meta``: no ``.tolist()``, numpy or new tensors made on the CPU), and every input left as it was (the
layer uses the scores, ids and bias again).

Then run the grading cell of ``notebooks/14_mixture_of_experts.ipynb`` (or ``labkit grade``).  The checks try many
``k``, ``E``, capacity factors and shapes, skewed and untouched experts, and finally your six in a layer's
training steps on 2 to 4 processes with uneven batches.  While they run, labkit's own router and layer
(``labkit.parallel``) are switched off, and so is any copy of their code, however loaded: the answers must be
yours.  ``torch.topk``, ``gather``, ``cumsum``, ``bincount`` and ``dist.all_reduce`` are yours to use.
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F


def route(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """``[..., k]`` ``torch.long``: each token's ``top_k`` experts by ``scores + bias``, best first."""
    return (scores.detach() + bias).topk(top_k, dim=-1).indices  # topk sorts, largest first


def combine_weights(scores: torch.Tensor, expert_ids: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``[..., k]``: each choice's score, renormalised over the token's ``k`` choices when ``k > 1``; 0 if dropped."""
    weights = scores.gather(-1, expert_ids)  # the unbiased scores of the chosen experts
    if expert_ids.shape[-1] > 1:  # all k choices, dropped or not, share the token's weight
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.masked_fill(~kept, 0.0)


def expert_capacity(tokens: int, top_k: int, n_experts: int, capacity_factor: float | None) -> int | None:
    """The most choices one expert takes from ``tokens`` tokens (``None``: unlimited)."""
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * tokens * top_k / n_experts)  # an int: a fraction of a row cannot be served


def kept_choices(expert_ids: torch.Tensor, n_experts: int, capacity: int | None) -> torch.Tensor:
    """``[..., k]`` ``torch.bool``: the choices within their expert's capacity, first choices served first."""
    if capacity is None:
        return torch.ones_like(expert_ids, dtype=torch.bool)
    top_k = expert_ids.shape[-1]
    by_token = expert_ids.reshape(-1, top_k)  # [T, k]: reshape copies a non-contiguous input, view would refuse
    queue = by_token.t().reshape(-1)  # the serving order: every first choice, then every second, ...
    one_hot = F.one_hot(queue, n_experts)
    place = (one_hot.cumsum(dim=0) * one_hot).sum(dim=-1) - 1  # how many went before it to the same expert
    return (place < capacity).view(top_k, by_token.shape[0]).t().reshape(expert_ids.shape)


def aux_loss(scores: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """Switch's ``E sum_e f_e P_e``: ``f`` counted from the choices, ``P`` the mean normalised score."""
    n_experts = scores.shape[-1]
    counts = torch.bincount(expert_ids.reshape(-1), minlength=n_experts)
    fraction = counts.to(scores.dtype) / expert_ids.numel()  # a count: no gradient flows through f
    probabilities = scores / scores.sum(dim=-1, keepdim=True)
    return n_experts * (fraction * probabilities.reshape(-1, n_experts).mean(dim=0)).sum()


def update_bias(bias: torch.Tensor, expert_ids: torch.Tensor, rate: float,
                group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The new bias: ``bias + rate * sign(mean load - load)``, the loads summed over ``group``."""
    load = torch.bincount(expert_ids.reshape(-1), minlength=bias.numel())
    if group is not None:  # every data-parallel rank's choices: the ranks' biases stay equal
        dist.all_reduce(load, group=group)
    load = load.to(bias.dtype)
    return bias + rate * torch.sign(load.mean() - load)
