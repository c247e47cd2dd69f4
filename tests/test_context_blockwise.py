"""Blockwise (flash) attention and the sequence splits of context parallelism, on one process.

The kernel against torch's ``scaled_dot_product_attention`` (outputs, gradients of q, k and v) and torch's own CPU
flash kernel (the log-sum-exp), in fp64 to 1e-10 and fp32 to 1e-5, causal and not, at lengths the block size
does not divide; its memory (saved bytes and the largest tensor it forms) against the cost model; the LSE merge;
the splits' positions, padding, refusals and causal work, tile by tile against its closed forms; RoPE at global
positions; Ulysses' bound by the heads.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from labkit.costmodel import context as model
from labkit.measure import ActivationMeter, LargestTensor
from labkit.parallel.context import (
    Tiles,
    attention_forward,
    attention_reference,
    blockwise_attention,
    causal_tiles,
    check_ulysses_heads,
    chunk_positions,
    gather_sequence,
    merge_partials,
    pad_batch,
    padded_length,
    ring_tiles,
    rotary,
    shard_sequence,
    textbook_attention,
    tiles_per_rank,
    ulysses_problem,
)

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
LENGTHS = [(37, 8), (64, 16), (5, 64), (33, 1), (100, 32)]  # (sequence, block): most do not divide


def _qkv(seq_len: int, dtype: torch.dtype, seed: int, heads: int = 3, batch: int = 2, dim: int = 8):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, seq_len, dim, dtype=dtype, generator=generator) for _ in range(4)]


def _torch_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """The log-sum-exp from torch's fused CPU kernel where this torch has it, else from the score matrix."""
    flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if flash is None:
        return attention_reference(q, k, v, causal=causal)[1]
    return flash(q, k, v, 0.0, causal)[1]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
def test_blockwise_attention_equals_sdpa_and_torch_lse_at_lengths_the_block_does_not_divide(dtype, causal):
    for seq_len, block in LENGTHS:
        q, k, v, dout = _qkv(seq_len, dtype, seed=seq_len)
        mine = [t.clone().requires_grad_() for t in (q, k, v)]
        theirs = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = blockwise_attention(*mine, causal=causal, block_size=block, return_lse=True)
        expected = F.scaled_dot_product_attention(*theirs, is_causal=causal)
        (out * dout).sum().backward()
        (expected * dout).sum().backward()
        errors = {"out": (out - expected).abs().max(), "lse": (lse - _torch_lse(q, k, v, causal)).abs().max()}
        errors.update({f"d{name}": (a.grad - b.grad).abs().max() for name, a, b in zip("qkv", mine, theirs, strict=True)})
        worst = max(errors.values())
        assert worst < TOLERANCE[dtype], (seq_len, block, {name: f"{e:.1e}" for name, e in errors.items()})


def test_a_query_that_sees_no_key_gets_zero_and_minus_infinity():
    q, k, v, _ = _qkv(4, torch.float64, seed=1)
    out, lse = attention_forward(q, k, v, causal=True, q_positions=torch.arange(4), k_positions=torch.arange(4) + 2)
    assert torch.all(out[:, :, :2] == 0) and torch.all(torch.isneginf(lse[:, :, :2]))
    reference = F.scaled_dot_product_attention(q[:, :, 2:], k[:, :, :2], v[:, :, :2], is_causal=True)
    assert torch.allclose(out[:, :, 2:], reference, atol=1e-12)


def test_merging_two_partial_results_by_their_lse_equals_attention_over_all_keys():
    q, k, v, _ = _qkv(24, torch.float64, seed=2)
    whole = attention_forward(q, k, v, causal=True, block_size=5)
    positions = torch.arange(24)
    early = attention_forward(q, k[:, :, :10], v[:, :, :10], causal=True, k_positions=positions[:10])
    late = attention_forward(q, k[:, :, 10:], v[:, :, 10:], causal=True, k_positions=positions[10:])
    for merged in (merge_partials(*early, *late), merge_partials(*late, *early)):
        assert torch.allclose(merged[0], whole[0], atol=1e-12) and torch.allclose(merged[1], whole[1], atol=1e-12)
    # Rescaling is what makes it exact: a merge that adds the outputs (or keeps the larger LSE's) is wrong.
    assert not torch.allclose(early[0] + late[0], whole[0], atol=1e-3)
    assert not torch.allclose(torch.where((early[1] > late[1])[..., None], early[0], late[0]), whole[0], atol=1e-3)


def test_blockwise_attention_saves_q_k_v_out_and_lse_and_forms_no_score_matrix():
    batch, heads, seq_len, dim, block = 1, 2, 256, 8, 32
    q, k, v = (t.requires_grad_() for t in _qkv(seq_len, torch.float32, 3, heads, batch, dim)[:3])
    with ActivationMeter() as meter, LargestTensor() as largest:
        out = blockwise_attention(q, k, v, block_size=block)
    assert meter.bytes == model.attention_saved_bytes(batch, heads, seq_len, dim, 4)
    assert largest.numel <= max(batch * heads * seq_len * dim, model.tile_bytes(batch, heads, block, 4) // 4)
    out.sum().backward()
    with ActivationMeter() as scores_meter, LargestTensor() as scores_largest:
        textbook_attention(q, k, v)
    assert scores_meter.bytes == model.attention_saved_bytes(batch, heads, seq_len, dim, 4, kernel="scores")
    assert scores_largest.numel == batch * heads * seq_len * seq_len


def test_tile_counts_follow_the_causal_rule():
    for seq_len, block in LENGTHS:
        counted = Tiles()
        q, k, v, _ = _qkv(seq_len, torch.float32, seed=4, heads=1, batch=1)
        attention_forward(q, k, v, causal=True, block_size=block, tiles=counted)
        assert counted == causal_tiles(seq_len, block)
        full = Tiles()
        attention_forward(q, k, v, causal=False, block_size=block, tiles=full)
        n = -(-seq_len // block)
        assert full == Tiles(computed=n * n)


def test_bad_inputs_are_refused_naming_the_value():
    q = torch.zeros(1, 2, 8, 4)
    with pytest.raises(ValueError, match="block_size must be an integer >= 1, got 0"):
        blockwise_attention(q, q, q, block_size=0)
    with pytest.raises(ValueError, match=r"must be \[batch, heads, seq, head_dim\], got shape \(2, 8, 4\)"):
        blockwise_attention(q[0], q, q)
    with pytest.raises(TypeError, match="one floating dtype"):
        blockwise_attention(q, q.double(), q)
    with pytest.raises(ValueError, match="as many queries as keys"):
        blockwise_attention(q, q[:, :, :4], q[:, :, :4])
    with pytest.raises(ValueError, match="whole heads on each of cp=4 ranks, and cp does not divide the 6 heads"):
        check_ulysses_heads(6, 4)


# --------------------------------------------------------------------------------------------------------
# Layouts


def test_zigzag_gives_rank_r_chunks_r_and_its_mirror():
    assert chunk_positions(8, 2, 0, "zigzag").tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 2, 1, "zigzag").tolist() == [2, 3, 4, 5]
    assert chunk_positions(16, 4, 1, "zigzag").tolist() == [2, 3, 12, 13]
    assert chunk_positions(12, 3, 2, "contiguous").tolist() == [8, 9, 10, 11]
    for cp, split in itertools.product((1, 2, 3, 4), ("contiguous", "zigzag")):
        seq_len = 4 * cp * 3
        owned = torch.cat([chunk_positions(seq_len, cp, rank, split) for rank in range(cp)])
        assert sorted(owned.tolist()) == list(range(seq_len))
        x = torch.randn(2, seq_len, 3)
        parts = [shard_sequence(x, cp, rank, split) for rank in range(cp)]
        assert torch.equal(gather_sequence(parts, split), x)


def test_causal_sequences_are_padded_at_the_end_and_non_causal_ones_refused():
    assert padded_length(30, 4, "zigzag") == 32 and padded_length(30, 4, "contiguous") == 32
    assert padded_length(30, 3, "contiguous") == 30 and padded_length(30, 3, "zigzag") == 30
    assert padded_length(31, 2, "zigzag") == 32
    with pytest.raises(ValueError, match="non-causal attention cannot be padded"):
        padded_length(30, 4, "zigzag", causal=False)
    with pytest.raises(ValueError, match=r"seq_len=30 does not split into 8 equal chunks"):
        chunk_positions(30, 4, 0, "zigzag")
    with pytest.raises(ValueError, match="cp must be an integer >= 1"):
        padded_length(8, 0)
    with pytest.raises(ValueError, match="split must be one of"):
        padded_length(8, 2, "striped")
    idx, targets = pad_batch(torch.ones(2, 30, dtype=torch.long), torch.ones(2, 30, dtype=torch.long), 32)
    assert idx[:, 30:].eq(0).all() and targets[:, 30:].eq(-100).all() and idx.shape == (2, 32)


def test_zigzag_balances_the_causal_work_that_the_contiguous_split_skews():
    for cp in (2, 4, 8):
        seq_len = 2 * cp * 16
        contiguous = model.causal_pairs_per_rank(seq_len, cp, "contiguous")
        zigzag = model.causal_pairs_per_rank(seq_len, cp, "zigzag")
        assert sum(contiguous) == sum(zigzag) == seq_len * (seq_len + 1) // 2
        assert len(set(zigzag)) == 1
        assert contiguous == sorted(contiguous)
        assert model.imbalance(contiguous) == pytest.approx((2 * cp - 1) / cp, rel=0.02)  # the last rank's share
        # The kernel's tiles, at block size 1, are the pairs.
        assert [t.computed for t in ring_tiles(seq_len, cp, "contiguous", block_size=1)] == contiguous
        tiles = [t.computed for t in ring_tiles(seq_len, cp, "zigzag", block_size=4)]
        assert len(set(tiles)) == 1


def test_attention_flops_and_messages_of_the_cost_model():
    assert model.attention_flops(1, 4, 8, causal=False) == 4 * 16 * 8
    assert model.attention_flops(1, 4, 8) == 4 * 10 * 8
    assert model.attention_flops(1, 4, 8, backward=True) == 2.5 * 4 * 10 * 8
    block = 2 * 8 * 4 * 4  # one of q, k, v of a rank's 8 tokens: 2 heads of 4 fp32 values, 256 bytes
    ring = model.cp_messages("ring", 4, 1, 2, 8, 4, 4)
    assert len(ring) == 9 and {nbytes for _, _, nbytes in ring} == {2 * block}
    # bytes that leave the rank: an all-gather sends its K/V to the 3 others (1,536 of the 2,048 it gathers), a
    # reduce-scatter the 3 others' dK/dV, an all-to-all 3/4 of its input (its own heads' quarter stays)
    gathered = model.cp_messages("all_gather", 4, 1, 2, 8, 4, 4)
    assert gathered == [("forward", "all_gather", 3 * 2 * block), ("backward", "all_gather", 3 * 2 * block),
                        ("backward", "reduce_scatter", 3 * 2 * block)]
    assert model.collective_size("all_gather", 3 * 2 * block, 4) == 4 * 2 * block  # the whole sequence's K/V
    assert model.collective_size("send", 2 * block, 4) == 2 * block
    link = model.cp_link_bytes("ulysses", 4, 1, 2, 8, 4, 4)
    assert link["forward"] == link["backward"] == (3 + 1) * block * 3 / 4
    assert model.cp_link_bytes("ring", 4, 1, 2, 8, 4, 4)["forward"] == \
        model.cp_link_bytes("all_gather", 4, 1, 2, 8, 4, 4)["forward"] == 3 * 2 * block  # the same K/V bytes
    with pytest.raises(ValueError, match="kind must be one of"):
        model.collective_size("broadcast", 1, 4)
    assert model.cp_messages("all_gather", 1, 1, 2, 8, 4) == []
    with pytest.raises(ValueError, match="strategy must be"):
        model.cp_messages("tree", 2, 1, 1, 1, 1)


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("blocks_per_chunk", [1, 2, 3])
def test_ring_tiles_are_the_closed_forms_of_the_tile_model_when_the_block_divides_the_chunks(cp, blocks_per_chunk):
    """Not only the direction: every rank's count.  Contiguous, ``c`` blocks a rank: rank ``r`` computes ``r c^2``
    tiles of earlier ranks' keys and ``c (c + 1) / 2`` of its own; zig-zag, ``n`` blocks in all: every rank
    ``n (n + 1) / (2 cp)``, the one-process triangle shared out; both sum to ``n (n + 1) / 2``."""
    block = 4
    seq_len = 2 * cp * blocks_per_chunk * block
    n = seq_len // block
    c = n // cp
    contiguous = [t.computed for t in ring_tiles(seq_len, cp, "contiguous", block)]
    zigzag = [t.computed for t in ring_tiles(seq_len, cp, "zigzag", block)]
    assert contiguous == [r * c * c + c * (c + 1) // 2 for r in range(cp)]
    assert zigzag == [n * (n + 1) // (2 * cp)] * cp
    assert sum(contiguous) == sum(zigzag) == n * (n + 1) // 2 == causal_tiles(seq_len, block).computed
    # the busiest rank's share of the work, what the ring's step follows: (2 cp - 1) c^2 / 2 + c / 2 tiles
    assert max(contiguous) / max(zigzag) == pytest.approx((cp * c * c - c * (c - 1) / 2) / (n * (n + 1) / (2 * cp)))


def test_a_block_that_straddles_zigzag_chunks_computes_more_tiles_than_one_process():
    # 48 tokens over 2 ranks: zig-zag chunks of 12 in blocks of 8; a block holds early and late tokens
    assert [t.computed for t in ring_tiles(48, 2, "zigzag", 8)] == [12, 12]
    assert causal_tiles(48, 8).computed == 21
    assert [t.computed for t in ring_tiles(48, 2, "contiguous", 8)] == [6, 15]  # chunks of 24: whole blocks


def test_striped_attention_balances_the_pairs_but_masks_every_diagonal_tile():
    s, cp = 2048, 4
    striped = [torch.arange(rank, s, cp) for rank in range(cp)]  # Brandon et al. 2023: token t on rank t mod cp
    pairs = [int((positions + 1).sum()) for positions in striped]
    assert sum(pairs) == s * (s + 1) // 2 and max(pairs) - min(pairs) == (cp - 1) * s // cp
    tiles = tiles_per_rank(striped, 128)
    assert [(t.computed, t.masked, t.skipped) for t in tiles] == [(40, 16, 24)] * cp
    zigzag = ring_tiles(s, cp, "zigzag", 128)
    assert [(t.computed, t.masked) for t in zigzag] == [(34, 4)] * cp
    assert tiles_per_rank([chunk_positions(s, cp, r, "zigzag") for r in range(cp)], 128) == zigzag


def test_rotary_scores_depend_on_the_difference_of_global_positions_only():
    q, k = (torch.randn(1, 2, 16, 8, dtype=torch.float64) for _ in range(2))
    positions = torch.arange(16)
    scores = rotary(q, positions) @ rotary(k, positions).transpose(-2, -1)
    shifted = rotary(q, positions + 1000) @ rotary(k, positions + 1000).transpose(-2, -1)
    assert torch.allclose(scores, shifted, atol=1e-9)
    assert torch.equal(rotary(q, torch.zeros(16, dtype=torch.long)), q)  # position 0: no turn
    # a CP rank that numbers its own tokens from 0 changes its scores with another rank's keys
    mine, theirs = chunk_positions(16, 2, 1, "zigzag"), chunk_positions(16, 2, 0, "zigzag")
    right = rotary(q[:, :, mine], mine) @ rotary(k[:, :, theirs], theirs).transpose(-2, -1)
    assert torch.allclose(right, scores[:, :, mine][:, :, :, theirs], atol=1e-12)
    local = rotary(q[:, :, mine], torch.arange(8)) @ rotary(k[:, :, theirs], torch.arange(8)).transpose(-2, -1)
    assert (local - right).abs().max() > 0.1
    with pytest.raises(ValueError, match="even head size"):
        rotary(torch.randn(1, 1, 4, 3), torch.arange(4))
    with pytest.raises(ValueError, match=r"positions must be \[4\]"):
        rotary(q[:, :, :4], torch.arange(5))


def test_ulysses_needs_whole_query_and_key_value_heads_on_every_rank():
    assert ulysses_problem(32, 8, 8) is None and ulysses_problem(32, 4, 8, tp=2) is None
    assert "does not divide the 8 K/V heads" in ulysses_problem(32, 16, 8)
    assert "1 K/V heads a TP rank holds (tp=8)" in ulysses_problem(128, 2, 8, tp=8)  # Llama 3 405B: no Ulysses
    assert "6 heads" in ulysses_problem(6, 4)
    with pytest.raises(ValueError, match="does not divide the 8 K/V heads: use ring or all-gather"):
        check_ulysses_heads(32, 16, kv_heads=8)
