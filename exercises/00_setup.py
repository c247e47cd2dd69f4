"""Exercise 00 — ranks, shards and your first all-reduce.

Every rank holds a different slice of one big data set.  To compute a statistic of the *whole* data set, each
rank reduces its own slice locally and then one collective (``all_reduce``) combines the partial results, so
every rank ends up with the same answer.  This is the pattern behind data-parallel training: replace "sum of
numbers" with "gradient of the loss".

Complete the three functions, then run ``labkit.grading.check("setup")`` (the grading cell of
``notebooks/00_setup.ipynb``) or ``labkit grade`` in a terminal.  While the checks run, labkit's own
version of ``shard_bounds`` (``chunk_bounds``) is switched off: the answer must be yours.

Useful: ``torch.distributed.all_reduce(tensor, op=dist.ReduceOp.SUM)`` sums ``tensor`` over every rank,
*in place*, and every rank gets the result.  Inside these functions the process group already exists:
``dist.get_rank()`` and ``dist.get_world_size()`` work.
"""

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)


def shard_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """Return ``(start, stop)``: the items ``range(start, stop)`` that ``rank`` owns out of ``n``.

    Slices are contiguous and in rank order, cover every item exactly once, and their sizes differ by at most
    one: the first ``n % world_size`` ranks take one extra item.  Example: n=10, world_size=4 gives
    (0, 3), (3, 6), (6, 8), (8, 10).
    """
    # TODO: divmod(n, world_size) gives the base size and how many ranks take one extra item.
    raise NotImplementedError("shard_bounds")


def global_sum(local: torch.Tensor) -> torch.Tensor:
    """The sum of every element of ``local`` on every rank, returned (as a 0-d tensor) on every rank.

    ``local`` may have a different length on each rank, and may be empty.  Do not modify ``local``.
    """
    # TODO: reduce locally first (one number per rank), then all_reduce that number.
    raise NotImplementedError("global_sum")


def global_mean(local: torch.Tensor) -> torch.Tensor:
    """The mean of every element on every rank (0-d tensor), when ranks hold different numbers of elements.

    Careful: the mean of the per-rank means is *not* the answer when ranks hold different counts.
    """
    # TODO: all_reduce the sum and the count (one tensor of two numbers is one collective), then divide.
    raise NotImplementedError("global_mean")
