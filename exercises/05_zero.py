"""Exercise 05 — ZeRO-1: shard the optimizer state, step the local shard, broadcast the updated parameters.

Under data parallelism every rank keeps the whole AdamW state, ``exp_avg`` and ``exp_avg_sq``: 8 bytes per
fp32 parameter, twice the weights themselves, and identical on every rank.  ZeRO stage 1 (Rajbhandari et al.,
2020) keeps one copy in all: each rank *owns* a subset of the parameters and holds optimizer state for those
only, so a rank holds ``8 Psi / N`` bytes of state instead of ``8 Psi``.  The step becomes:

1. the gradients are averaged over ranks as in data parallelism (every rank has the full mean gradient);
2. each rank steps *its own* parameters with its local optimizer — the others stay stale on this rank;
3. each parameter is broadcast from its owner, so every replica holds every updated parameter again.

The price is that broadcast: every parameter's bytes (``4 Psi`` in fp32) leave their owner once per step, on
top of DDP's all-reduce (this is ``torch.distributed.optim.ZeroRedundancyOptimizer``; ``labkit.parallel.zero`` packs
one message per owner instead of one per parameter).  Whole parameters per rank let any optimizer work, even
one that looks at a whole tensor; the memory is balanced only to within one parameter, so the owners are
chosen greedily by size.

One training step with these functions, on every rank::

    owners = shard_parameters(parameters, world_size)                      # once
    local_optimizer = make_local_optimizer(parameters, owners, rank, lr, weight_decay)  # once
    ...
    loss.backward()                                                        # + average the gradients
    zero1_step(parameters, owners, local_optimizer)

Complete the three functions, then run the grading cell of ``notebooks/05_zero_and_fsdp.ipynb`` (or
``labkit grade``).  The checks give each function size lists, rank numbers and a small model on 2 and 3 gloo
ranks, and compare with one process training the same model with plain AdamW.  While they run, labkit's own
ZeRO (``labkit.parallel``) is switched off: the answer must be yours.
"""

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)


def shard_parameters(parameters: list[torch.Tensor], world_size: int) -> list[int]:
    """Choose the rank that owns each parameter (and holds its optimizer state): ``owners[i]`` for
    ``parameters[i]``.

    Balance the number of *elements* (``numel()``) per rank greedily: take the parameters from the largest to
    the smallest (parameters of equal size in index order, i.e. a stable sort) and give each to the rank that
    holds the fewest elements so far (the lowest such rank on a tie).  This is ``ZeroRedundancyOptimizer``'s
    rule.  Examples (sizes -> owners): ``[100, 1, 1, 1]`` over 2 ranks -> ``[0, 1, 1, 1]``;
    ``[1, 2, 3, 4, 5, 6]`` over 3 ranks -> ``[0, 1, 2, 2, 1, 0]``.
    """
    # TODO: keep the elements held by each rank in a list; walk the indices sorted by numel(), largest first
    #       (sorted(..., reverse=True) is stable); give each to load.index(min(load)).
    raise NotImplementedError("shard_parameters")


def make_local_optimizer(parameters: list[torch.Tensor], owners: list[int], rank: int, lr: float,
                         weight_decay: float) -> torch.optim.AdamW:
    """This rank's optimizer: ``torch.optim.AdamW(lr=lr, weight_decay=weight_decay)`` (other arguments at
    their defaults) over the parameters that ``rank`` owns, in their order in ``parameters`` — and no other,
    so that optimizer state exists only for them.  Every rank owns at least one parameter here."""
    # TODO: keep the parameters whose owner is `rank`; build torch.optim.AdamW over those only.
    raise NotImplementedError("make_local_optimizer")


def zero1_step(parameters: list[torch.Tensor], owners: list[int],
               local_optimizer: torch.optim.Optimizer) -> None:
    """One ZeRO-1 step, called on every rank after the gradients have been averaged: step ``local_optimizer``
    (this rank's parameters), then broadcast each parameter from its owner, in place, so that every rank ends
    with all the updated parameters.  Every rank must issue the same broadcasts in the same order."""
    # TODO: local_optimizer.step(); then, under torch.no_grad(), dist.broadcast(parameter, src=owner) for
    #       every parameter (owned here or not: the owner sends, every other rank receives).
    raise NotImplementedError("zero1_step")
