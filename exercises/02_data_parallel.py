"""Exercise 02 — the three pieces of data parallelism: broadcast, the averaging hook, buckets.

Data-parallel training keeps a full replica of the model on every rank and gives each rank a different slice
of the batch.  It stays correct because of two invariants:

1. every replica starts from the *same* weights (broadcast rank 0's at the start), and
2. every replica applies the *same* update (average the gradients over ranks before the optimizer step).

Averaging one parameter at a time costs one all-reduce — one latency ``alpha`` — per parameter, so real
implementations pack gradients into *buckets* of ~25 MB and all-reduce a bucket as soon as its last gradient is
ready, overlapping communication with the rest of the backward pass.

Complete the three functions, then run the grading cell of ``notebooks/02_data_parallel.ipynb`` (or
``labkit grade``).  The checks train a small model on several gloo ranks with your broadcast and hook and
compare it with single-process training on the whole batch.  While they run, labkit's own data parallelism
(``labkit.parallel``) is switched off: the answer must be yours.
"""

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)
from torch import nn


def broadcast_parameters(module: nn.Module) -> None:
    """Copy rank 0's parameters and buffers into every rank's ``module``, in place."""
    # TODO: dist.broadcast(tensor, src=0) for every parameter and buffer (under torch.no_grad()).
    raise NotImplementedError("broadcast_parameters")


def average_gradient_hook(parameter: torch.Tensor) -> None:
    """Registered with ``parameter.register_post_accumulate_grad_hook``: called when ``parameter.grad`` is
    ready.  Replace it, in place, by its average over all ranks (synchronously, for simplicity)."""
    # TODO: all-reduce parameter.grad (a sum over ranks), then turn the sum into an average.
    raise NotImplementedError("average_gradient_hook")


def assign_buckets(sizes_in_bytes: list[int], bucket_cap_bytes: int) -> list[list[int]]:
    """Group parameter indices into buckets for all-reduce, as ``labkit.parallel.ddp`` does.

    Walk the parameters from the *last* to the first (gradients become ready in roughly that order during
    backward), adding each to the current bucket — unless it would push a non-empty bucket past
    ``bucket_cap_bytes``: then close the bucket and start a new one with it.  So a bucket never exceeds the cap,
    except a single parameter larger than the cap, which gets a bucket of its own; a cap of 0 gives one bucket
    per parameter.  Return the buckets in the order they were filled, each listing indices in the order added.
    Example: sizes [4, 4, 4, 4, 4] with cap 8 -> [[4, 3], [2, 1], [0]].
    """
    # TODO: walk reversed(range(len(sizes_in_bytes))); close the current bucket before a parameter that would
    #       push it past the cap.
    raise NotImplementedError("assign_buckets")
