"""Context parallelism applied to TinyGPT: what changes in a model when its sequences are split over ``cp`` ranks.

Almost nothing.  Embeddings, norms, the MLP, the LM head and the loss work token by token, so each rank runs
them on its own tokens unchanged; two things need the rest of the sequence:

- **attention**, whose core (``block.attn.core``, a :class:`labkit.models.Attention`) is replaced by
  :class:`ContextParallelAttention`: ring, all-gather or Ulysses over the cp group
  (:mod:`labkit.parallel.context.attention`);
- **positions**: token ``i`` of a rank's chunk is not at position ``i`` of the sequence.  The position embedding
  (:class:`ChunkPositionEmbedding`, the same weight) looks up each local token's place in the whole sequence;
  with RoPE it would be the rotation angles (torchtitan shards its ``freqs_cis`` the same way).

**The loss.**  A rank holds ``1 / cp`` of each sequence's tokens, and the loss is the mean over all of them.  Each
rank back-propagates ``cp x (its tokens' summed loss) / (all tokens)``; the data-parallel wrapper, running over
the ``dp x cp`` ranks that hold the same weights (``Mesh.group("dp_cp")``), averages the gradients, dividing by
``cp`` again: the sum over the cp ranks of their shares, the gradient of the whole sequences' mean loss
(:func:`shard_batch`'s ``weight``).  A sequence that the split does not cut evenly is padded at the end
(ignored targets), and the weights differ between ranks by the padding each holds.  The CP ranks of one data-
parallel rank read the same sequences (``labkit.data`` shards batches by dp rank only), and each keeps its
chunks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from labkit.models import IGNORE_INDEX
from labkit.parallel.context.attention import (
    STRATEGIES,
    ContextParallelGroup,
    check_ulysses_heads,
    context_parallel_attention,
)
from labkit.parallel.context.sequence import check_cp, check_sequence, pad_batch, shard_sequence


class ContextParallelAttention(nn.Module):
    """The attention core over the cp group: this rank's queries against the whole sequence's keys (causal)."""

    def __init__(self, cp_group: ContextParallelGroup, strategy: str = "ring"):
        super().__init__()
        self.cp_group, self.strategy = cp_group, strategy

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return context_parallel_attention(q, k, v, self.cp_group, strategy=self.strategy, causal=True)

    def extra_repr(self) -> str:
        return f"{self.strategy}, cp={self.cp_group.size}, {self.cp_group.split}, block_size={self.cp_group.block_size}"


class ChunkPositionEmbedding(nn.Embedding):
    """The position embedding of this rank's tokens: local index ``i`` -> the row of its whole-sequence position.

    Shares the dense embedding's weight (same parameter, same ``state_dict`` name).  Padding positions past the
    table are clamped to its last row: no real token attends to them and their targets are ignored."""

    def __init__(self, dense: nn.Embedding, positions: torch.Tensor):
        super().__init__(dense.num_embeddings, dense.embedding_dim, device="meta")
        self.weight = dense.weight
        # A plain attribute, not a buffer: it differs from rank to rank, and DDP would broadcast a buffer.
        self.positions = positions.clamp(max=dense.num_embeddings - 1).to(dense.weight.device)

    def forward(self, local: torch.Tensor) -> torch.Tensor:
        return F.embedding(self.positions[local], self.weight)


def apply_context_parallel(model: nn.Module, cp_group: ContextParallelGroup, seq_len: int,
                           strategy: str = "ring") -> nn.Module:
    """Make ``model`` (a TinyGPT, a pipeline stage of one, or a tensor-parallel one's ``.module``) attend over
    ``cp_group``, in place, for sequences of ``seq_len`` tokens (padded as the split needs); returns it."""
    padded = check_sequence(seq_len, cp_group.size, cp_group.split)
    for block in model.blocks:
        if block is not None:
            block.attn.core = ContextParallelAttention(cp_group, strategy)
    if getattr(model, "position_embedding", None) is not None:
        model.position_embedding = ChunkPositionEmbedding(model.position_embedding,
                                                          cp_group.positions(padded // cp_group.size))
    return model


def shard_batch(inputs: torch.Tensor, targets: torch.Tensor, cp: int, rank: int,
                split: str = "zigzag") -> tuple[torch.Tensor, torch.Tensor, float]:
    """This rank's chunks of ``inputs`` and ``targets`` ``[batch, seq]`` (padded at the end as the split
    needs), and the weight of its mean loss: ``cp x (its counted targets) / (all counted targets)``, 1.0 when
    nothing is padded."""
    padded = check_sequence(inputs.shape[1], cp, split)
    inputs, targets = pad_batch(inputs, targets, padded)
    mine = shard_sequence(inputs, cp, rank, split), shard_sequence(targets, cp, rank, split)
    counted = int((mine[1] != IGNORE_INDEX).sum())
    total = int((targets != IGNORE_INDEX).sum())
    return mine[0], mine[1], cp * counted / total


def check_context_parallel(config: Any, cp: int, tp: int = 1, strategy: str = "ring", split: str = "zigzag",
                           seq_len: int | None = None) -> None:
    """Every check of context parallelism that needs no process group; ``ValueError`` naming the value."""
    check_cp(cp, split)
    if strategy not in STRATEGIES:
        raise ValueError(f"cp_strategy must be one of {STRATEGIES}, got {strategy!r}")
    if cp > 1 and config.dropout:
        raise ValueError(f"context parallelism here needs dropout=0 (got {config.dropout}): attention dropout's "
                         "mask would have to be drawn per chunk pair as one process draws it for the whole matrix")
    if cp > 1 and strategy == "ulysses":
        check_ulysses_heads(config.n_head // tp, cp)
    if cp > 1 and seq_len is not None:
        check_sequence(seq_len, cp, split)
