"""Exercise 14 — mixture of experts: the dispatch of expert parallelism.

Expert parallelism spreads an MoE layer's ``E`` experts over ``ep`` ranks, contiguously: rank ``r`` holds experts
``r E/ep .. (r+1) E/ep - 1``.  Every rank routes its own tokens; each token's ``k`` choices are *assignments*, and
an assignment's row (the token's hidden vector) must travel to the rank holding its expert.  One
``all_to_all_single`` sends them all at once: this rank's rows laid out so that the rows for rank 0 come first,
then those for rank 1, and so on, with ``send_counts[j]`` rows for rank ``j`` (the receiver must know those counts
first: they are exchanged by an all-to-all of their own).  When the experts' results come back in the same layout,
they must be put back where each assignment was.  Three functions:

1. ``send_counts(expert_ids, n_experts, ep) -> torch.Tensor``: ``expert_ids`` holds the expert of each assignment,
   any shape (``[N]``, or ``[T, k]``: token ``t``'s ``k`` choices); return ``[ep]`` integers, the number of
   assignments bound for each rank, zeros included (a rank whose experts nobody chose still gets its 0).
2. ``dispatch_order(expert_ids, n_experts, ep) -> torch.Tensor``: ``expert_ids`` ``[N]``; return the permutation
   ``order`` (``[N]`` integer indices) that lays the assignments out for the all-to-all: ``expert_ids[order]``
   grouped by destination rank in rank order, within a rank grouped by expert in expert order (the receiver runs
   each expert on one contiguous block), and among assignments to the same expert, in their original order.
3. ``inverse_permutation(order) -> torch.Tensor``: the permutation ``inverse`` that undoes ``order``:
   ``x[order][inverse]`` is ``x`` for any ``x``.

All three return ``torch.long`` tensors (a real rank's counts pass 255 and its indices 32,767) on the input's device,
and leave their inputs as they were (the caller uses the ids and the order again).

Then run the grading cell of ``notebooks/14_mixture_of_experts.ipynb`` (or ``labkit grade``); the checks use several
``ep``, ``k`` and expert counts, uneven loads and experts no token chose, and finally your three functions in a
real all-to-all dispatch on 2 to 4 processes.  labkit's own ``labkit.parallel`` (its dispatch among it) is switched
off while the checks run: the answers must be yours.
"""

import torch


def send_counts(expert_ids: torch.Tensor, n_experts: int, ep: int) -> torch.Tensor:
    """``[ep]``: how many of the assignments ``expert_ids`` (any shape) go to each rank."""
    # TODO: the rank holding expert e is e // (n_experts // ep); count the assignments per rank, every rank
    #       (torch.bincount's minlength).
    raise NotImplementedError("send_counts")


def dispatch_order(expert_ids: torch.Tensor, n_experts: int, ep: int) -> torch.Tensor:
    """The permutation grouping the assignments ``expert_ids`` ``[N]`` by rank, then expert, stably."""
    # TODO: with contiguous experts, ordering by expert orders by rank too; ties must keep their order
    #       (torch.sort(..., stable=True) returns the indices).
    raise NotImplementedError("dispatch_order")


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """``inverse`` with ``x[order][inverse] == x``."""
    # TODO: position order[i] of the result holds i.
    raise NotImplementedError("inverse_permutation")
