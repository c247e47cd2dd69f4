"""Context parallelism (``labkit.parallel.context``) on 2, 4 and 8 gloo ranks against one process.

One launch per ``cp`` runs every case on every rank: ring, all-gather and Ulysses, contiguous and zig-zag,
causal and not, in fp64.  Each rank compares its share of the output and of the gradients of q, k and v with
torch's ``scaled_dot_product_attention`` over the whole sequence (to 1e-10), its log of messages with
``labkit.costmodel.context.cp_messages`` byte for byte, and the tiles its kernel computed with the layout's
causal work (``ring_tiles``): equal on every rank under zig-zag, growing with the rank under the contiguous split.
Then TinyGPT with cp in the mesh (``parallelize``), composed with dp, tp, pp, ZeRO and FSDP: the loss and the final
weights of one process, and the bytes it predicts; and ``labkit.train --cp``.  Last, the ring with every tile a
timed wait: its step follows the busiest rank's tiles, so zig-zag's gain over the contiguous split is theirs.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.costmodel import context as model
from labkit.costmodel.memory import tinygpt_activation_bytes
from labkit.launch import launch
from labkit.measure import ActivationMeter
from labkit.mesh import Mesh
from labkit.models import GPTConfig, TinyGPT
from labkit.parallel.context import (
    SPLITS,
    STRATEGIES,
    ContextParallelGroup,
    Tiles,
    context_parallel_attention,
    ring_tiles,
    shard_sequence,
)
from labkit.parallel.context.timing import TimedTiles, attention_run, timed_ring
from labkit.parallel.parallelize import check_3d, parallelize
from labkit.train.config import parse_arguments

BATCH, HEADS, DIM, BLOCK = 2, 4, 8, 4


def _attention_cases(seq_len: int) -> list[dict]:
    results = []
    for strategy, split, causal in itertools.product(STRATEGIES, SPLITS, (True, False)):
        cp_group = ContextParallelGroup(None, split=split, block_size=BLOCK)
        generator = torch.Generator().manual_seed(seq_len)
        q, k, v, dout = (torch.randn(BATCH, HEADS, seq_len, DIM, dtype=torch.float64, generator=generator)
                         for _ in range(4))
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = F.scaled_dot_product_attention(*whole, is_causal=causal)
        expected_grads = torch.autograd.grad(expected, whole, dout)

        def mine(t: torch.Tensor, cp_group: ContextParallelGroup = cp_group, split: str = split) -> torch.Tensor:
            return shard_sequence(t, cp_group.size, cp_group.rank, split, dim=2)

        local = [mine(t).requires_grad_() for t in (q, k, v)]
        out = context_parallel_attention(*local, cp_group, strategy=strategy, causal=causal)
        forward_tiles = Tiles(**vars(cp_group.tiles))
        grads = torch.autograd.grad(out, local, mine(dout))
        error = max([(out - mine(expected)).abs().max().item()]
                    + [(a - mine(b)).abs().max().item() for a, b in zip(grads, expected_grads, strict=True)])
        results.append({"case": (strategy, split, causal), "error": error, "log": cp_group.log,
                        "tiles": forward_tiles.computed})
    return results


def _saved_activations() -> dict[str, int]:
    from labkit.parallel.context.model import apply_context_parallel, shard_batch

    found = {}
    for strategy in STRATEGIES:
        model = TinyGPT(GPT, seed=0)
        cp_group = ContextParallelGroup(None, "zigzag")
        apply_context_parallel(model, cp_group, GPT.block_size, strategy)
        ids = torch.randint(GPT.vocab_size, (SEQUENCES, GPT.block_size + 1), generator=torch.Generator().manual_seed(0))
        inputs, targets, _ = shard_batch(ids[:, :-1], ids[:, 1:], cp_group.size, cp_group.rank, "zigzag")
        with ActivationMeter(exclude=model.parameters()) as meter:
            model(inputs, targets)
        found[strategy] = meter.bytes
    return found


@pytest.mark.parametrize("cp", [2, 4])
def test_a_cp_rank_keeps_the_activations_of_s_over_cp_tokens(cp):
    """The memory model of one process at s / cp tokens (``tinygpt_activation_bytes``), to the byte, for the ring
    and all-gather; Ulysses keeps one more output a layer (``cp_saved_extra_bytes``)."""
    local = GPT.block_size // cp
    for rank, found in enumerate(launch(_saved_activations, nprocs=cp, rank_output="none")):
        for strategy, measured in found.items():
            expected = tinygpt_activation_bytes(GPT, SEQUENCES, local) + model.cp_saved_extra_bytes(
                strategy, GPT.n_layer, SEQUENCES, local, GPT.n_embd)
            assert measured == expected, (cp, rank, strategy, measured, expected)


@pytest.mark.parametrize("cp", [2, 4])
def test_every_strategy_and_layout_equals_one_process_and_sends_what_the_model_says(cp):
    seq_len = 8 * cp
    per_rank = launch(_attention_cases, seq_len, nprocs=cp, timeout=120)
    for rank, results in enumerate(per_rank):
        for result in results:
            strategy, split, causal = result["case"]
            assert result["error"] < 1e-10, (rank, result["case"], result["error"])
            expected = model.cp_messages(strategy, cp, BATCH, HEADS, seq_len // cp, DIM, element_size=8)
            assert Counter(result["log"]) == Counter(expected), (rank, result["case"])
            if strategy != "ulysses":  # each rank's queries against every key: the layout's causal work
                work = ring_tiles(seq_len, cp, split, block_size=BLOCK, causal=causal)[rank].computed
                assert result["tiles"] == work, (rank, result["case"])
    for strategy in ("ring", "all_gather"):
        zigzag = [next(r["tiles"] for r in results if r["case"] == (strategy, "zigzag", True))
                  for results in per_rank]
        contiguous = [next(r["tiles"] for r in results if r["case"] == (strategy, "contiguous", True))
                      for results in per_rank]
        assert len(set(zigzag)) == 1 and contiguous == sorted(contiguous) and contiguous[0] < contiguous[-1]


# --------------------------------------------------------------------------------------------------------
# TinyGPT with cp in the mesh: parallelize and labkit.train

GPT = GPTConfig.preset("100k", tie_weights=False)
STEPS, SEQUENCES, MICRO, LR = 2, 4, 2, 0.3
# (dp, tp, pp, cp, zero, schedule, cp strategy, layout, sequence length): every strategy and layout, sequence
# lengths that 2 cp divides and ones it does not (61, 60: padded at the end), with TP, PP, ZeRO, FSDP and ZB-H1.
LAYOUTS_4D = {
    2: [(1, 1, 1, 2, 0, "1f1b", "ring", "zigzag", 61), (1, 1, 1, 2, 0, "1f1b", "ulysses", "contiguous", 64)],
    4: [(1, 1, 1, 4, 0, "1f1b", "ring", "zigzag", 61), (1, 1, 1, 4, 0, "1f1b", "all_gather", "zigzag", 64),
        (1, 1, 1, 4, 0, "1f1b", "ulysses", "zigzag", 60), (2, 1, 1, 2, 2, "1f1b", "ring", "contiguous", 64)],
    8: [(2, 2, 1, 2, 0, "1f1b", "ring", "zigzag", 64), (1, 2, 2, 2, 0, "1f1b", "ulysses", "zigzag", 61),
        (2, 1, 2, 2, 3, "gpipe", "all_gather", "zigzag", 64), (1, 1, 2, 4, 1, "zb-h1", "ring", "zigzag", 64)],
}


def _gpt_batch(step: int, dp_rank: int, dp: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(GPT.vocab_size, (dp * SEQUENCES, seq_len + 1), generator=generator)
    rows = ids[dp_rank * SEQUENCES:(dp_rank + 1) * SEQUENCES]
    return rows[:, :-1], rows[:, 1:]


def _one_process(dp: int, seq_len: int) -> tuple[list[float], dict]:
    model = TinyGPT(GPT, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step in range(STEPS):
        parts = [_gpt_batch(step, rank, dp, seq_len) for rank in range(dp)]
        _, loss = model(torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _train_4d(layouts: list[tuple]) -> list[dict]:
    out = []
    for dp, tp, pp, cp, zero, schedule, strategy, layout, seq_len in layouts:
        torch.manual_seed(0)
        mesh = Mesh(dp=dp, tp=tp, pp=pp, cp=cp)
        model = parallelize(TinyGPT(GPT, seed=0), mesh, zero=zero, schedule=schedule, microbatches=MICRO,
                            micro_batch_size=SEQUENCES // MICRO, seq_len=seq_len, cp_strategy=strategy,
                            cp_split=layout)
        optimizer = model.make_optimizer(torch.optim.SGD, lr=LR, momentum=0.9)
        losses = []
        for step in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            losses.append(model.forward_backward(*_gpt_batch(step, mesh.rank("dp"), dp, seq_len)).item())
            optimizer.step()
        full = model.full_state_dict()
        out.append({"losses": losses, "full": full if dist.get_rank() == 0 else None,
                    "communication": model.communication_per_step(), "predicted": model.predicted_communication()})
    return out


@pytest.mark.parametrize("world_size", sorted(LAYOUTS_4D))
def test_tinygpt_with_cp_in_the_mesh_trains_as_one_process_and_sends_what_it_predicts(world_size):
    per_rank = launch(_train_4d, LAYOUTS_4D[world_size], nprocs=world_size, timeout=300, rank_output="none")
    for index, layout in enumerate(LAYOUTS_4D[world_size]):
        dp, seq_len = layout[0], layout[-1]
        losses, state = _one_process(dp, seq_len)
        reported = per_rank[0][index]["losses"]
        assert all(rank[index]["losses"] == reported for rank in per_rank[1:] if dp == 1), layout
        mean = [sum(rank[index]["losses"][step] for rank in per_rank) / world_size for step in range(STEPS)]
        assert mean == pytest.approx(losses, abs=1e-5, rel=0), layout
        full = per_rank[0][index]["full"]
        worst = max((full[name] - state[name]).abs().max().item() for name in state)
        assert set(full) == set(state) and worst < 1e-6, (layout, worst)
        for rank in per_rank:
            assert rank[index]["communication"] == rank[index]["predicted"], layout
            assert any(kind.startswith("cp ") for kind in rank[index]["communication"]), layout


def test_the_trainer_with_cp_reads_what_data_parallelism_alone_reads(tmp_path):
    """--cp 2 on 4 ranks: each pair of cp ranks splits the sequences that dp rank reads, so the losses are those of
    --dp 2 on 2 ranks, step for step; a bad --cp is refused before any process starts."""
    from labkit.train import TrainConfig
    from tests.test_parallelize import _train

    with_cp = TrainConfig(dp=2, tp=1, pp=1, cp=2, steps=3, batch_size=4, log_every=100)
    alone = TrainConfig(dp=2, tp=1, pp=1, steps=3, batch_size=4, log_every=100)
    four = launch(_train, [with_cp], nprocs=4, timeout=300, rank_output="none")
    two = launch(_train, [alone], nprocs=2, timeout=300, rank_output="none")
    for rank, result in enumerate(four):  # ranks 0, 1 hold dp rank 0's sequences, ranks 2, 3 dp rank 1's
        assert result[0]["losses"] == pytest.approx(two[rank // 2][0]["losses"], abs=1e-5, rel=0), rank
    with pytest.raises(ValueError, match="whole heads on each of cp=3 ranks, and cp does not divide the 4 heads"):
        parse_arguments(["--cp", "3", "--cp-strategy", "ulysses", "--nprocs", "3"])
    with pytest.raises(ValueError, match="cp_strategy must be one of"):
        parse_arguments(["--cp", "2", "--cp-strategy", "tree", "--nprocs", "2"])
    with pytest.raises(ValueError, match="--cp-strategy and --cp-split belong to context-parallel runs"):
        parse_arguments(["--cp-split", "contiguous"])
    with pytest.raises(ValueError, match="context parallelism here needs dropout=0"):
        check_3d(GPTConfig.preset("100k", dropout=0.1), 1, 1, 1, cp=2)
    with pytest.raises(ValueError, match="leaves rank 3 only padding"):
        check_3d(GPT, 1, 1, 1, cp=4, seq_len=3)


def test_timed_tiles_wait_once_a_kernel_call_and_backward_two_and_a_half_times_longer():
    import time

    from labkit.parallel.context.blockwise import BlockwiseAttention

    q = torch.randn(1, 1, 16, 4, requires_grad=True)
    tiles = TimedTiles(0.05)
    began = time.perf_counter()
    out = BlockwiseAttention.apply(q, q, q, True, 8, None, None, None, tiles)[0]  # 3 tiles: 150 ms
    forward = time.perf_counter() - began
    began = time.perf_counter()
    out.sum().backward()  # 3 more tiles at 125 ms
    backward = time.perf_counter() - began
    assert tiles.computed == 6 and tiles.owed == 0.0
    assert 0.15 <= forward < 0.15 + 0.15 and 0.375 <= backward < 0.375 + 0.15  # a busy machine oversleeps
    with pytest.raises(ValueError, match="tile_seconds must be a number of seconds >= 0"):
        attention_run(tile_seconds=-1.0)


def test_the_timed_ring_steps_at_the_busiest_ranks_tiles_so_zigzag_gains_their_ratio():
    """Every tile a 20 ms wait (50 ms backward) on 4 ranks, 512 tokens in blocks of 64: the contiguous split's
    busiest rank has 15 tiles forward, zig-zag's 9 each.  The step (the slowest rank's) is at least the busiest
    rank's waits and not much more (the messages, merges and each sleep's overshoot), and zig-zag's gain is the
    tiles' ratio, 1.67x, within 20 %: not the 1.0x of ranks sharing cores, nor the 5x of the contiguous split's
    tiles, last rank to first."""
    ranks = launch(timed_ring, 512, 64, 0.02, 2, nprocs=4, timeout=120, rank_output="none")
    # a pass's step is its slowest rank's; of the two, the one a busy machine disturbed least
    step = {split: min(max(rank[split]["passes"][k] for rank in ranks) for k in range(2)) for split in SPLITS}
    for split in SPLITS:
        work = [2 * t.computed for t in ring_tiles(512, 4, split, 64)]
        assert [rank[split]["tiles"] for rank in ranks] == work
        busiest = max(work) / 2 * 0.02 * 3.5
        assert busiest <= step[split] <= 1.4 * busiest, split
    assert [t.computed for t in ring_tiles(512, 4, "contiguous", 64)] == [3, 7, 11, 15]
    assert step["contiguous"] / step["zigzag"] == pytest.approx(15 / 9, rel=0.2)
