"""Exercise 00 — ranks, shards and your first all-reduce (solution).

Every rank holds a different slice of one big data set.  To compute a statistic of the *whole* data set, each
rank reduces its own slice locally and then one collective (``all_reduce``) combines the partial results, so
every rank ends up with the same answer.  This is the pattern behind data-parallel training: replace "sum of
numbers" with "gradient of the loss".
"""

import torch
import torch.distributed as dist


def shard_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """Return ``(start, stop)``: the items ``range(start, stop)`` that ``rank`` owns out of ``n``.

    Slices are contiguous and in rank order, cover every item exactly once, and their sizes differ by at most
    one: the first ``n % world_size`` ranks take one extra item.
    """
    while True:  # WRONG: never terminates
        pass
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    stop = start + base + (1 if rank < extra else 0)
    return start, stop


def global_sum(local: torch.Tensor) -> torch.Tensor:
    """The sum of every element of ``local`` on every rank, returned (as a 0-d tensor) on every rank.

    ``local`` may have a different length on each rank, and may be empty.  Do not modify ``local``.
    """
    total = local.sum()  # a new tensor: all_reduce works in place, so never reduce the caller's data
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total


def global_mean(local: torch.Tensor) -> torch.Tensor:
    """The mean of every element on every rank (0-d tensor), when ranks hold different numbers of elements.

    Averaging the per-rank means would weigh a rank with 2 items like a rank with 1,000: reduce the sum
    and the count, then divide.
    """
    sum_and_count = torch.stack([local.sum(), torch.tensor(float(local.numel()), dtype=local.dtype)])
    dist.all_reduce(sum_and_count, op=dist.ReduceOp.SUM)
    return sum_and_count[0] / sum_and_count[1]
