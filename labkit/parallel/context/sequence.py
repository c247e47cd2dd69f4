"""How context parallelism cuts a sequence: which tokens each of ``cp`` ranks holds, and the work that gives it.

**Contiguous** (``split="contiguous"``): rank ``r`` holds chunk ``r`` of ``cp`` equal chunks.  Under the
causal mask, chunk ``r``'s queries see the keys of chunks ``0 .. r``: rank ``r`` computes ``r`` full blocks of
scores and one half (the diagonal), so the last rank works about ``2 cp - 1`` times as long as the first, and
every ring step waits for it.

**Zig-zag** (``split="zigzag"``; the head-tail split of zhuzilin/ring-flash-attention and Megatron-Core, and
Llama 3's, Dubey et al. 2024, section 3.3.2; Brandon et al. 2023's striped attention balances the same work
round-robin, token by token, instead): cut the sequence into ``2 cp`` chunks; rank ``r`` holds chunks ``r`` and
``2 cp - 1 - r``, an early one and its mirror from the end.  Each rank's two chunks together see the
same number of keys, ``2 cp + 1`` half-chunks' worth, so every rank does the same work.

Both need the sequence length to divide: by ``cp`` (contiguous) or ``2 cp`` (zig-zag).  A causal sequence that
does not is **padded at the end** (:func:`padded_length`): padding tokens come after every real token, so no
real query attends to them, and their targets are ignored by the loss; nothing a real token computes changes.
A non-causal sequence cannot be padded that way (every query would see the padding) and is refused.

Every rank also needs its tokens' places in the whole sequence (:func:`chunk_positions`): for the position
embedding (or RoPE's angles), and for the causal mask between its queries and another rank's keys.

Ulysses cuts the heads instead of the sequence while attention runs (:func:`ulysses_problem`): each of the
``cp`` ranks of a tensor-parallel rank's group needs whole query heads *and* whole key/value heads, so under
grouped-query attention its degree is bounded by the K/V heads left after TP: 8 K/V heads at ``tp = 8`` (Llama 3
405B's layout) leave Ulysses no split at all, unless each K/V head is copied to several ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from labkit.degrees import check_degree
from labkit.models import IGNORE_INDEX

SPLITS = ("contiguous", "zigzag")


@dataclass
class Tiles:
    """The ``block x block`` tiles of one call: ``computed`` (of which ``masked`` needed the causal mask) and
    ``skipped`` (every key after every query)."""

    computed: int = 0
    masked: int = 0
    skipped: int = 0

    def add(self, kind: str) -> None:
        """Count one tile of :func:`tile_kind`'s ``kind``."""
        self.computed += kind != "skip"
        self.masked += kind == "masked"
        self.skipped += kind == "skip"

    def settle(self) -> None:
        """Called by the kernel when one call's tiles are computed: nothing here; a count whose tiles are timed
        waits (:class:`labkit.parallel.context.timing.TimedTiles`) waits for them there, once a call."""


def block_slices(length: int, block_size: int) -> list[slice]:
    return [slice(start, min(start + block_size, length)) for start in range(0, length, block_size)]


def tile_kind(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool) -> str:
    """``"skip"`` (every key after every query), ``"full"`` (no key after any query) or ``"masked"``."""
    if not causal:
        return "full"
    if int(k_pos.min()) > int(q_pos.max()):
        return "skip"
    return "full" if int(k_pos.max()) <= int(q_pos.min()) else "masked"


def check_cp(cp: Any, split: Any = "zigzag") -> None:
    """``cp`` an integer >= 1 and ``split`` one of :data:`SPLITS`; ``ValueError`` naming the value."""
    check_degree("cp", cp)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def ulysses_problem(heads: int, cp: int, kv_heads: int | None = None, tp: int = 1) -> str | None:
    """Why Ulysses cannot spread ``heads`` query heads and ``kv_heads`` key/value heads (default: as many), split
    ``tp`` ways by tensor parallelism first, over ``cp`` ranks, or None: each rank needs whole heads of both."""
    where = f" a TP rank holds (tp={tp})" if tp > 1 else ""
    kinds = ((heads, ""),) if kv_heads in (None, heads) else ((heads, "query "), (kv_heads, "K/V "))
    problems = [f"{count // tp} {what}heads{where}" for count, what in kinds if (count // tp) % cp]
    if not problems:
        return None
    return f"Ulysses needs whole heads on each of cp={cp} ranks, and cp does not divide the " + " nor the ".join(
        problems)


def chunks_per_rank(split: str) -> int:
    """Pieces of the sequence a rank holds: 1 (contiguous) or 2 (zig-zag)."""
    return 2 if split == "zigzag" else 1


def padded_length(seq_len: int, cp: int, split: str = "zigzag", *, causal: bool = True) -> int:
    """The smallest length >= ``seq_len`` that the split cuts evenly (``seq_len`` itself when it divides).

    Raises ``ValueError`` for a non-causal sequence that would need padding (the padding would be attended to).
    """
    check_cp(cp, split)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be an integer >= 1, got {seq_len!r}")
    pieces = cp * chunks_per_rank(split)
    padded = -(-seq_len // pieces) * pieces
    if padded != seq_len and not causal:
        raise ValueError(f"a sequence of {seq_len} tokens does not split into {pieces} equal chunks "
                         f"(cp={cp}, {split}), and non-causal attention cannot be padded (every query would "
                         f"attend to the padding): use a length divisible by {pieces}")
    return padded


def check_sequence(seq_len: int, cp: int, split: str = "zigzag") -> int:
    """The padded length of a causal ``seq_len``-token sequence over ``cp`` ranks, after checking that every rank
    holds at least one real token (a rank of padding only would average its loss over nothing).  ``ValueError``
    naming the numbers otherwise."""
    padded = padded_length(seq_len, cp, split)
    for rank in range(cp):
        if int(chunk_positions(padded, cp, rank, split).min()) >= seq_len:
            raise ValueError(f"a sequence of {seq_len} tokens over cp={cp} ranks ({split}, padded to {padded}) "
                             f"leaves rank {rank} only padding: use sequences of at least "
                             f"{(cp - 1) * padded // (cp * chunks_per_rank(split)) + 1} tokens, or a smaller cp")
    return padded


def chunk_positions(seq_len: int, cp: int, rank: int, split: str = "zigzag") -> torch.Tensor:
    """The positions, in the whole sequence of ``seq_len`` tokens, of the tokens rank ``rank`` holds, in the order
    it holds them.  ``seq_len`` must divide evenly (pad first with :func:`padded_length`)."""
    check_cp(cp, split)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < cp:
        raise ValueError(f"rank must be in [0, cp={cp}), got {rank!r}")
    pieces = cp * chunks_per_rank(split)
    if seq_len % pieces:
        raise ValueError(f"seq_len={seq_len} does not split into {pieces} equal chunks (cp={cp}, {split}); "
                         f"pad it to padded_length(...) = {-(-seq_len // pieces) * pieces} first")
    size = seq_len // pieces
    owned = [rank] if split == "contiguous" else [rank, 2 * cp - 1 - rank]
    return torch.cat([torch.arange(chunk * size, (chunk + 1) * size) for chunk in owned])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, split: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s tokens of ``x`` along ``dim`` (whose length must divide evenly)."""
    return x.index_select(dim, chunk_positions(x.shape[dim], cp, rank, split).to(x.device))


def gather_sequence(parts: list[torch.Tensor], split: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The inverse of :func:`shard_sequence`: every rank's part (in rank order) back in sequence order."""
    cp = len(parts)
    joined = torch.cat(parts, dim=dim)
    order = torch.cat([chunk_positions(joined.shape[dim], cp, rank, split) for rank in range(cp)])
    return joined.index_select(dim, torch.argsort(order).to(joined.device))


def pad_batch(idx: torch.Tensor, targets: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``idx`` and ``targets`` ``[batch, seq]`` padded at the end to ``length`` (tokens 0, targets ignored)."""
    extra = length - idx.shape[1]
    if extra < 0:
        raise ValueError(f"cannot pad a sequence of {idx.shape[1]} tokens to {length}")
    if extra == 0:
        return idx, targets
    return (torch.nn.functional.pad(idx, (0, extra), value=0),
            torch.nn.functional.pad(targets, (0, extra), value=IGNORE_INDEX))


def ring_tiles(seq_len: int, cp: int, split: str = "zigzag", block_size: int = 8,
               causal: bool = True) -> list[Tiles]:
    """Per rank, the score tiles its queries compute against every rank's keys in one causal forward pass (pure
    arithmetic with the kernel's own tile rule): the work each ring step's compute takes, summed."""
    seq_len = padded_length(seq_len, cp, split, causal=causal)
    return tiles_per_rank([chunk_positions(seq_len, cp, rank, split) for rank in range(cp)], block_size, causal)


def tiles_per_rank(positions: list[torch.Tensor], block_size: int, causal: bool = True) -> list[Tiles]:
    """:func:`ring_tiles` for any assignment of tokens to ranks: ``positions[r]``, the positions rank ``r`` holds
    in the order it holds them (e.g. striped attention's ``torch.arange(r, s, cp)``).  Each rank cuts its own
    tokens into blocks of ``block_size``; a tile is one block of its queries against one block of a rank's keys."""
    work = []
    for mine in positions:
        count = Tiles()
        for theirs in positions:
            for rows in block_slices(len(mine), block_size):
                for cols in block_slices(len(theirs), block_size):
                    count.add(tile_kind(mine[rows], theirs[cols], causal))
        work.append(count)
    return work


def rotary(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding (RoPE; Su et al. 2021, *RoFormer*), as Llama applies it to queries and keys:
    each pair of values ``(x_i, x_{i + d/2})`` of the token at ``positions[j]`` turned by the angle
    ``positions[j] * base ** (-2i / d)``.  ``x`` ``[..., seq, d]`` with ``d`` even; ``positions`` ``[seq]``, each
    token's place in the *whole* sequence (a CP rank's are :func:`chunk_positions`).  A query's score with a key
    then depends on their positions' difference only."""
    if x.shape[-1] % 2:
        raise ValueError(f"rotary needs an even head size, got {x.shape[-1]}")
    if positions.shape != (x.shape[-2],):
        raise ValueError(f"positions must be [{x.shape[-2]}] (one per token), got {tuple(positions.shape)}")
    half = x.shape[-1] // 2
    frequencies = base ** (-torch.arange(half, dtype=torch.float64, device=x.device) / half)
    angles = (positions.to(x.device, torch.float64)[:, None] * frequencies).to(x.dtype)
    cos, sin = angles.cos(), angles.sin()
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)
