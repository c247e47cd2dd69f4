"""One attention's forward and backward under context parallelism, measured on every rank: what lesson 13 and
``benchmarks/bench_cp.py`` show (run it on ``cp`` ranks with :func:`labkit.launch.launch`).

Each rank holds its share of one batch of sequences (the same random ``q, k, v`` on every rank, cut by the split),
with one thread (``torch.set_num_threads(1)``: ranks sharing a laptop's cores otherwise time each other's threads).
:func:`attention_run` returns this rank's median time of a forward and backward, the tiles its kernel computed, the
bytes it sent (the group's log), the largest tensor it formed, the largest difference of its output and gradients
from one process's ``scaled_dot_product_attention`` over the whole sequence, and with ``traced`` the spans of one
more pass, on a common clock (:func:`labkit.trace.gather`).

**Tiles as timed waits** (``tile_seconds``; :func:`timed_ring`).  Four ranks on a 2-core laptop share its cores, so
the busiest rank's extra work is spread over everyone's time and the step hardly shows the split (lesson 13's
section 4).  As lesson 7 times pipelines with stages that sleep (:mod:`labkit.parallel.pipeline.timed`), each tile
the kernel computes can also be a wait of ``tile_seconds`` (``FLASH_BACKWARD_RATIO`` times that in the backward
pass, FlashAttention-2's count), on tensors small enough that computing them costs little beside it: a sleeping
rank needs no core, so every rank keeps its own pace, as on its own GPU, and the step measures the split's work.
Everything else is real: the ring's messages, its merges, its waits for the rank before it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from labkit import trace
from labkit.costmodel.kernels import FLASH_BACKWARD_RATIO
from labkit.measure import LargestTensor
from labkit.parallel.context.attention import ContextParallelGroup, context_parallel_attention
from labkit.parallel.context.sequence import SPLITS, Tiles, shard_sequence


class TimedTiles(Tiles):
    """A tile count whose computed tiles are also a wait: ``tile_seconds`` each forward, ``FLASH_BACKWARD_RATIO``
    times that backward, waited at the end of each kernel call (one sleep a ring step, not one a tile: fewer
    wake-ups for a busy scheduler to delay)."""

    def __init__(self, tile_seconds: float):
        super().__init__()
        self.tile_seconds, self.owed = tile_seconds, 0.0

    def add(self, kind: str) -> None:
        super().add(kind)
        if kind != "skip":
            backward = torch._C._current_graph_task_id() != -1  # inside autograd's backward pass
            self.owed += self.tile_seconds * (FLASH_BACKWARD_RATIO if backward else 1.0)

    def settle(self) -> None:
        owed, self.owed = self.owed, 0.0
        if owed:
            time.sleep(owed)


def attention_run(strategy: str = "ring", split: str = "zigzag", *, batch: int = 1, heads: int = 4,
                  seq_len: int = 1024, head_dim: int = 32, block_size: int = 64, repeats: int = 3,
                  traced: bool = False, seed: int = 0, tile_seconds: float = 0.0) -> dict[str, Any]:
    """This rank's measurements of ``repeats`` forward and backward passes (after one warm-up); see the module
    docstring.  A collective: every rank of the default group calls it with the same arguments.  ``passes``: each
    pass's seconds, in order (the passes start together, after a barrier); ``cpu_seconds``:
    the CPU time this rank's process spent (its work, whether or not it shared a core meanwhile);
    ``tile_seconds > 0``: every tile computed is also a timed wait (module docstring)."""
    if isinstance(tile_seconds, bool) or not isinstance(tile_seconds, (int, float)) or tile_seconds < 0:
        raise ValueError(f"tile_seconds must be a number of seconds >= 0, got {tile_seconds!r}")
    torch.set_num_threads(1)

    def count() -> Tiles:
        return TimedTiles(tile_seconds) if tile_seconds else Tiles()

    cp_group = ContextParallelGroup(None, split=split, block_size=block_size)
    cp_group.tiles = count()
    generator = torch.Generator().manual_seed(seed)
    whole = [torch.randn(batch, heads, seq_len, head_dim, generator=generator) for _ in range(4)]
    q, k, v, dout = (shard_sequence(t, cp_group.size, cp_group.rank, split, dim=2) for t in whole)

    def one_pass() -> tuple[torch.Tensor, ...]:
        local = [t.clone().requires_grad_() for t in (q, k, v)]
        out = context_parallel_attention(*local, cp_group, strategy=strategy)
        torch.autograd.backward(out, dout)
        return (out.detach(), *(t.grad for t in local))

    with LargestTensor() as largest:  # the warm-up (first calls allocate, gloo sets up its pairs), watched
        found = one_pass()
    reference = [t.clone().requires_grad_() for t in whole[:3]]  # one process's attention over the whole sequence
    out = torch.nn.functional.scaled_dot_product_attention(*reference, is_causal=True)
    torch.autograd.backward(out, whole[3])
    expected = (out.detach(), *(t.grad for t in reference))
    error = max(float((mine - shard_sequence(theirs, cp_group.size, cp_group.rank, split, dim=2)).abs().max())
                for mine, theirs in zip(found, expected, strict=True))
    seconds, cpu_seconds = [], []
    for _ in range(repeats):
        dist.barrier()
        cp_group.log.clear()
        cp_group.tiles = count()
        start, cpu_start = time.perf_counter(), time.process_time()
        one_pass()
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(time.process_time() - cpu_start)
    result = {"rank": cp_group.rank, "seconds": statistics.median(seconds), "passes": seconds,
              "tiles": cp_group.tiles.computed, "error": error,
              "cpu_seconds": statistics.median(cpu_seconds),
              "sent": sum(nbytes for _, _, nbytes in cp_group.log), "log": list(cp_group.log), "largest": largest.numel,
              "largest_shape": largest.shape}
    if traced:
        trace.enable()
        one_pass()
        spans = trace.gather()
        trace.disable()
        result["spans"] = spans
    return result


def timed_ring(seq_len: int = 512, block_size: int = 64, tile_seconds: float = 0.02, repeats: int = 2,
               splits: tuple[str, ...] = SPLITS) -> dict[str, dict[str, Any]]:
    """Ring attention over one head of 8 values per token, each tile a timed wait (module docstring), under each
    split in turn: ``{split: this rank's attention_run result}``.  A collective, as :func:`attention_run`.  Few
    long waits (blocks as long as a zig-zag chunk) keep the ring's real work, which a busy machine stretches, small
    beside them."""
    return {split: attention_run("ring", split, heads=1, seq_len=seq_len, head_dim=8, block_size=block_size,
                                 repeats=repeats, tile_seconds=tile_seconds) for split in splits}
