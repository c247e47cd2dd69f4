"""Context parallelism (``labkit.parallel.context``) on 2 and 4 gloo ranks against one process.

One launch per ``cp`` runs every case on every rank: ring, all-gather and Ulysses, contiguous and zig-zag,
causal and not, in fp64.  Each rank compares its share of the output and of the gradients of q, k and v with
torch's ``scaled_dot_product_attention`` over the whole sequence (to 1e-10), its log of messages with
``labkit.costmodel.context.cp_messages`` byte for byte, and the tiles its kernel computed with the layout's
causal work (``ring_tiles``): equal on every rank under zig-zag, growing with the rank under the contiguous split.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from labkit.costmodel import context as model
from labkit.launch import launch
from labkit.parallel.context import (
    LAYOUTS,
    STRATEGIES,
    ContextParallelGroup,
    Tiles,
    context_parallel_attention,
    ring_tiles,
    shard_sequence,
)

BATCH, HEADS, DIM, BLOCK = 2, 4, 8, 4


def _attention_cases(seq_len: int) -> list[dict]:
    results = []
    for strategy, layout, causal in itertools.product(STRATEGIES, LAYOUTS, (True, False)):
        cp = ContextParallelGroup(None, layout=layout, block_size=BLOCK)
        generator = torch.Generator().manual_seed(seq_len)
        q, k, v, dout = (torch.randn(BATCH, HEADS, seq_len, DIM, dtype=torch.float64, generator=generator)
                         for _ in range(4))
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = F.scaled_dot_product_attention(*whole, is_causal=causal)
        expected_grads = torch.autograd.grad(expected, whole, dout)

        def mine(t: torch.Tensor, cp: ContextParallelGroup = cp, layout: str = layout) -> torch.Tensor:
            return shard_sequence(t, cp.size, cp.rank, layout, dim=2)

        local = [mine(t).requires_grad_() for t in (q, k, v)]
        out = context_parallel_attention(*local, cp, strategy=strategy, causal=causal)
        forward_tiles = Tiles(**vars(cp.tiles))
        grads = torch.autograd.grad(out, local, mine(dout))
        error = max([(out - mine(expected)).abs().max().item()]
                    + [(a - mine(b)).abs().max().item() for a, b in zip(grads, expected_grads, strict=True)])
        results.append({"case": (strategy, layout, causal), "error": error, "log": cp.log,
                        "tiles": forward_tiles.computed})
    return results


@pytest.mark.parametrize("cp", [2, 4])
def test_every_strategy_and_layout_equals_one_process_and_sends_what_the_model_says(cp):
    seq_len = 8 * cp
    per_rank = launch(_attention_cases, seq_len, nprocs=cp, timeout=120)
    for rank, results in enumerate(per_rank):
        for result in results:
            strategy, layout, causal = result["case"]
            assert result["error"] < 1e-10, (rank, result["case"], result["error"])
            expected = model.cp_messages(strategy, cp, BATCH, HEADS, seq_len // cp, DIM, element_size=8)
            assert Counter(result["log"]) == Counter(expected), (rank, result["case"])
            if strategy != "ulysses":  # each rank's queries against every key: the layout's causal work
                work = ring_tiles(seq_len, cp, layout, block_size=BLOCK, causal=causal)[rank].computed
                assert result["tiles"] == work, (rank, result["case"])
    for strategy in ("ring", "all_gather"):
        zigzag = [next(r["tiles"] for r in results if r["case"] == (strategy, "zigzag", True))
                  for results in per_rank]
        contiguous = [next(r["tiles"] for r in results if r["case"] == (strategy, "contiguous", True))
                      for results in per_rank]
        assert len(set(zigzag)) == 1 and contiguous == sorted(contiguous) and contiguous[0] < contiguous[-1]
