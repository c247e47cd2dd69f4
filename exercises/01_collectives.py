"""Exercise 01 — ring reduce-scatter and all-gather (and so all-reduce) from send/recv.

The ranks form a ring: rank ``r`` sends only to its right neighbour ``(r + 1) % N`` and receives only from its
left neighbour ``(r - 1) % N``.  A 1-D tensor of ``n`` elements is cut into ``N`` chunks by ``chunk_bounds``
(contiguous, sizes differing by at most one; some may be empty when ``n < N``).

- Reduce-scatter, ``N - 1`` steps: at step ``s`` rank ``r`` sends chunk ``(r - s - 1) % N`` and receives chunk
  ``(r - s - 2) % N``, which it adds into its own copy.  Afterwards rank ``r`` holds chunk ``r`` summed over
  every rank.
- All-gather, ``N - 1`` steps: at step ``s`` rank ``r`` sends chunk ``(r - s) % N`` (at step 0: its own finished
  chunk) and receives chunk ``(r - s - 1) % N``, which it stores.  Afterwards every rank holds every chunk.

Use only point-to-point messages: ``dist.isend(tensor, dst)`` and ``dist.irecv(tensor, src)`` return requests
you ``.wait()`` on.  Post the send and the receive of a step *before* waiting on either — if every rank made a
blocking ``send`` first, each would wait for a receive that nobody has posted.  ``isend`` needs a contiguous
tensor; receive into a fresh buffer (``torch.empty``) and then add or copy it into ``flat``.

Check your work with the grading cell of ``notebooks/01_collectives.ipynb`` or ``labkit grade``.  The checks run
your functions on 2 to 4 ranks with every built-in collective (and labkit's own ``labkit.collectives``) switched
off, and compare the messages each rank sends and receives with the ring's schedule above.
"""

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)

from labkit.collectives import chunk_bounds  # noqa: F401  (chunk_bounds(n, N)[c] == (start, stop) of chunk c)


def ring_reduce_scatter(flat: torch.Tensor) -> torch.Tensor:
    """Sum the 1-D tensor ``flat`` over all ranks so that rank ``r`` ends with the finished chunk ``r``.

    Work in place in ``flat`` and return chunk ``r`` of it (the other chunks end up holding partial sums).
    """
    # TODO: N - 1 steps; at step s send chunk (r - s - 1) % N right, receive chunk (r - s - 2) % N from the
    #       left and add it into flat.
    raise NotImplementedError("ring_reduce_scatter")


def ring_all_gather(flat: torch.Tensor) -> torch.Tensor:
    """Rank ``r``'s chunk ``r`` of the 1-D tensor ``flat`` is valid; fill every other chunk in place; return ``flat``."""
    # TODO: N - 1 steps; at step s send chunk (r - s) % N right, receive chunk (r - s - 1) % N from the left
    #       and store it in flat.
    raise NotImplementedError("ring_all_gather")


def ring_all_reduce(flat: torch.Tensor) -> torch.Tensor:
    """Sum the 1-D tensor ``flat`` over all ranks, in place, with the two phases above; return ``flat``."""
    # TODO: reduce-scatter, then all-gather.
    raise NotImplementedError("ring_all_reduce")
