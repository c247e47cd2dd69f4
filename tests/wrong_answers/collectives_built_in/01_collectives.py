"""Exercise 01 — ring reduce-scatter and all-gather (and so all-reduce) from send/recv (solution).

The ranks form a ring: rank ``r`` sends only to its right neighbour ``(r + 1) % N`` and receives only from its
left neighbour ``(r - 1) % N``.  A 1-D tensor of ``n`` elements is cut into ``N`` chunks by ``chunk_bounds``.

- Reduce-scatter, ``N - 1`` steps: at step ``s`` rank ``r`` sends chunk ``(r - s - 1) % N`` and receives chunk
  ``(r - s - 2) % N``, which it adds into its own copy.  Afterwards rank ``r`` holds chunk ``r`` summed over
  every rank.
- All-gather, ``N - 1`` steps: at step ``s`` rank ``r`` sends chunk ``(r - s) % N`` (at step 0: its own finished
  chunk) and receives chunk ``(r - s - 1) % N``, which it stores.  Afterwards every rank holds every chunk.

Each step sends and receives at the same time (``isend`` + ``irecv``): if every rank made a blocking ``send``
first, each would wait for a receive that nobody has posted.
"""

import torch
import torch.distributed as dist

from labkit.collectives import chunk_bounds


def _exchange(send: torch.Tensor, receive: torch.Tensor) -> None:
    """Send ``send`` to the right neighbour while receiving ``receive`` from the left one."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    requests = [dist.isend(send.contiguous(), (rank + 1) % world_size),
                dist.irecv(receive, (rank - 1) % world_size)]
    for request in requests:
        request.wait()


def ring_reduce_scatter(flat: torch.Tensor) -> torch.Tensor:
    """Sum the 1-D tensor ``flat`` over all ranks so that rank ``r`` ends with the finished chunk ``r``.

    Work in place in ``flat`` and return chunk ``r`` of it (the other chunks end up holding partial sums).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    bounds = chunk_bounds(flat.numel(), world_size)
    for step in range(world_size - 1):
        send_start, send_stop = bounds[(rank - step - 1) % world_size]
        receive_start, receive_stop = bounds[(rank - step - 2) % world_size]
        incoming = torch.empty(receive_stop - receive_start, dtype=flat.dtype)
        _exchange(flat[send_start:send_stop], incoming)
        flat[receive_start:receive_stop] += incoming
    start, stop = bounds[rank]
    return flat[start:stop]


def ring_all_gather(flat: torch.Tensor) -> torch.Tensor:
    """Rank ``r``'s chunk ``r`` of the 1-D tensor ``flat`` is valid; fill every other chunk in place; return ``flat``."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    bounds = chunk_bounds(flat.numel(), world_size)
    for step in range(world_size - 1):
        send_start, send_stop = bounds[(rank - step) % world_size]
        receive_start, receive_stop = bounds[(rank - step - 1) % world_size]
        incoming = torch.empty(receive_stop - receive_start, dtype=flat.dtype)
        _exchange(flat[send_start:send_stop], incoming)
        flat[receive_start:receive_stop] = incoming
    return flat


def ring_all_reduce(flat: torch.Tensor) -> torch.Tensor:
    """Sum the 1-D tensor ``flat`` over all ranks, in place, with the two phases above; return ``flat``."""
    dist.all_reduce(flat)  # WRONG: the built-in collective, not the ring
    return flat
