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

import torch
import torch.distributed as dist


def route(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """``[..., k]`` ``torch.long``: each token's ``top_k`` experts by ``scores + bias``, best first."""
    # TODO: rank the experts by score + bias and keep the top_k, best first.  Which torch function gives the k
    #       largest values along a dimension, and where they are?  Only where they are is wanted.
    raise NotImplementedError("route")


def combine_weights(scores: torch.Tensor, expert_ids: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``[..., k]``: each choice's score, renormalised over the token's ``k`` choices when ``k > 1``; 0 if dropped."""
    # TODO: pick each choice's score out of scores (the experts in expert_ids, along the last dimension).  Would
    #       renormalising help a token with a single choice, and what would its gradient be?  When one of a
    #       token's k is dropped, which sum divides?  Zero the dropped weights without cutting the gradient.
    raise NotImplementedError("combine_weights")


def expert_capacity(tokens: int, top_k: int, n_experts: int, capacity_factor: float | None) -> int | None:
    """The most choices one expert takes from ``tokens`` tokens (``None``: unlimited)."""
    # TODO: an even share is the batch's choices divided among the experts; the factor scales it.  What must an
    #       expert take when the share comes to 7.5 choices, and when it comes to exactly 6?  Return a Python int.
    raise NotImplementedError("expert_capacity")


def kept_choices(expert_ids: torch.Tensor, n_experts: int, capacity: int | None) -> torch.Tensor:
    """``[..., k]`` ``torch.bool``: the choices within their expert's capacity, first choices served first."""
    # TODO: line the choices up in the order the experts serve them; a choice is kept when fewer than capacity
    #       choices of the same expert are ahead of it in that line.  Count them for every choice at once (no
    #       Python loop over tokens), and give the mask the ids' shape.  A transposed tensor is not contiguous.
    raise NotImplementedError("kept_choices")


def aux_loss(scores: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """Switch's ``E sum_e f_e P_e``: ``f`` counted from the choices, ``P`` the mean normalised score."""
    # TODO: f_e is counted (no gradient flows through a count), P_e is averaged from the scores (the gradient flows
    #       there).  How many choices are there in all?  An expert nobody chose still has its f_e, 0.
    raise NotImplementedError("aux_loss")


def update_bias(bias: torch.Tensor, expert_ids: torch.Tensor, rate: float,
                group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The new bias: every expert's moved by ``rate`` towards the mean load, the loads summed over ``group``."""
    # TODO: count each expert's load from the ids (every expert, chosen or not); with a group, every rank must
    #       step from the same loads.  Each bias moves by rate exactly, towards balance, and not at all at the
    #       mean: which function of the gap is -1, 0 or 1?
    raise NotImplementedError("update_bias")
