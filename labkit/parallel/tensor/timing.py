"""Where a tensor-parallel step's time goes on a CPU: the kernels the split divides, and what ranks that share a
machine cost each other.

Lesson 06 predicts a tensor-parallel step from one process's step with
:func:`labkit.costmodel.tensor_parallel.tensor_parallel_step_time`.  On GPUs (section 2 of the lesson) the split
divides the layer's FLOPs and the collectives cost what the link's ring model says.  On a laptop's CPU cores
three more things decide the step, and each is measured here, apart from the step it predicts:

- **what does not split** (:class:`SplitKernels`): tensor parallelism divides the matrix products, attention
  and the activation function between the split matrices; every rank still runs the norms, the residual
  additions, the embedding lookup, the loss's softmax and the optimizer's arithmetic over what it holds, and
  pays the framework's fixed cost per operation for every operation, split or not.  On a tiny model that is a
  large share of the step;
- **ranks that share cores and caches** (:func:`shared_machine_costs`, ``slowdown``): the same burst of matrix
  products timed on one rank alone, then on every rank at once.  More ranks than cores take turns (at least
  ``t / cores``); fewer still share the caches and the memory bus;
- **what a collective costs between bursts of compute** (:func:`shared_machine_costs`, ``collective_s``): the
  bursts again with an all-reduce of each size between them, beyond the bursts alone.  On one machine's
  loopback that is mostly latency: the waiting rank sleeps and must be woken, and its partner, slowed by the
  same shared cores, arrives late.  A ring model fitted to messages between otherwise idle ranks sees little
  of either.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from labkit.dist import require_group

# The kernels that tensor parallelism divides t ways (each rank runs them on its 1/t of the columns or heads):
# the matrix products of the split layers, attention over this rank's heads, and the activation between the
# column- and the row-parallel matrix.  Their backward passes are the same products and their own kernels.
SPLIT_KERNELS = frozenset({"mm", "addmm", "bmm", "gelu", "gelu_backward"})
SPLIT_PREFIXES = ("_scaled_dot_product",)  # attention's fused kernels, forward and backward, on any backend


def is_split_kernel(name: str) -> bool:
    """Whether the ATen operator ``name`` (``"aten::mm"`` or ``"mm"``) is one that tensor parallelism divides."""
    short = name.split("::")[-1].split(".")[0]
    return short in SPLIT_KERNELS or short.startswith(SPLIT_PREFIXES)


class SplitKernels(TorchDispatchMode):
    """``with SplitKernels() as kernels: <a training step>``: ``kernels.split_s``, the thread time spent inside
    the kernels tensor parallelism divides (:func:`is_split_kernel`), and ``kernels.calls`` how many ran.

    The time is the kernel's own (``time.thread_time`` around the call), so the mode's small cost per operation
    falls outside it; time the whole step apart, without the mode, to get what the rest costs."""

    def __init__(self) -> None:
        super().__init__()
        self.split_s, self.calls = 0.0, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if not is_split_kernel(func.name()):
            return func(*args, **(kwargs or {}))
        start = time.thread_time()
        result = func(*args, **(kwargs or {}))
        self.split_s += time.thread_time() - start
        self.calls += 1
        return result


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def shared_machine_costs(message_bytes: tuple[int, ...], repeats: int = 6, rounds: int = 2, warmup: bool = True,
                         burst: tuple[int, int, int] = (512, 144, 576), group: Any = None) -> dict[str, Any]:
    """Collective (every rank of ``group`` calls it; every rank gets the same answer): how much slower ranks
    compute together than one alone, and what an all-reduce costs between bursts of compute.

    A burst is two ``[m, k] @ [k, n]`` matrix products (``burst = (m, k, n)``; the default, 2-3 ms on one
    thread, is about what TinyGPT 1M computes between two of its collectives).  Each window runs ``repeats``
    bursts between two barriers and lasts until the last rank is done (the slowest rank's time: ranks that
    take turns on shared cores finish one after another): on rank 0 alone while the others wait, then on every
    rank at once, then on every rank with an all-reduce of each of ``message_bytes`` (fp32) after each burst.
    Medians over ``rounds`` rounds, after one to warm up (``warmup=False``: none, where the same collectives
    have just run; a caller that interleaves single rounds with what it measures, so that a burst of load from
    elsewhere meets both alike, takes the medians itself).  Returns ``{"slowdown": together / alone,
    "collective_s": {nbytes: seconds per all-reduce beyond the bursts}}`` (floats).  Raises ``ValueError``
    naming a bad ``repeats``, ``rounds``, ``message_bytes`` or ``burst`` before it touches the group."""
    for name, value in (("repeats", repeats), ("rounds", rounds)):
        if not _is_count(value):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if not message_bytes or not all(_is_count(size) and size % 4 == 0 for size in message_bytes):
        raise ValueError("message_bytes must be one or more sizes of fp32 messages, each a positive multiple of 4 "
                         f"bytes, got {message_bytes!r}")
    if len(burst) != 3 or not all(map(_is_count, burst)):
        raise ValueError(f"burst must be three integers (m, k, n) >= 1, got {burst!r}")
    group = require_group(group)
    rank = dist.get_rank(group)
    m, k, n = burst
    a, b = torch.randn(m, k), torch.randn(k, n)
    messages = [None, *(torch.zeros(size // 4) for size in message_bytes)]

    def window(message: torch.Tensor | None, run: bool = True) -> float:
        dist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(repeats if run else 0):
            torch.mm(a, b)
            torch.mm(a, b)
            if message is not None:
                dist.all_reduce(message, group=group)
        dist.barrier(group=group)  # the window ends when the last rank is done
        return time.perf_counter() - start

    samples: list[list[float]] = []
    for round_ in range(rounds + warmup):  # a first round warms up: connections, buffers, caches
        alone = window(None, run=rank == 0)  # the others wait in the closing barrier, asleep
        together = [window(message) for message in messages]
        if round_ >= warmup:
            samples.append([alone, *together])
    medians = torch.tensor([statistics.median(column) for column in zip(*samples, strict=True)], dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=group)  # rank 0's windows are everyone's, give or take
    alone_s, together_s, *with_messages = (float(value) for value in medians)
    costs = [max(0.0, (seconds - together_s) / repeats) for seconds in with_messages]
    return {"slowdown": together_s / alone_s, "collective_s": dict(zip(message_bytes, costs, strict=True))}
