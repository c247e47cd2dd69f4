"""Long sequences: blockwise (flash) attention and context parallelism.

- ``blockwise``: FlashAttention-2's tiled forward (online softmax, log-sum-exp) and backward (recomputed from
  the LSE), in PyTorch; the LSE merge of partial results;
- ``split``: which tokens each of ``cp`` ranks holds (contiguous or zig-zag), their positions, the padding of
  a causal sequence, the causal work per rank;
- ``attention``: one sequence's attention over ``cp`` ranks: ring (pass-KV), all-gather (Llama 3) and Ulysses
  (all-to-all), each recorded byte by byte.
"""

from labkit.parallel.context.attention import (
    STRATEGIES,
    ContextParallelGroup,
    check_ulysses_heads,
    context_parallel_attention,
)
from labkit.parallel.context.blockwise import (
    DEFAULT_BLOCK_SIZE,
    Tiles,
    attention_backward,
    attention_forward,
    attention_reference,
    blockwise_attention,
    causal_tiles,
    merge_partials,
    textbook_attention,
)
from labkit.parallel.context.sequence import (
    SPLITS,
    chunk_positions,
    gather_sequence,
    pad_batch,
    padded_length,
    ring_tiles,
    shard_sequence,
)

__all__ = ["DEFAULT_BLOCK_SIZE", "SPLITS", "STRATEGIES", "ContextParallelGroup", "Tiles", "attention_backward",
           "attention_forward", "attention_reference", "blockwise_attention", "causal_tiles", "check_ulysses_heads",
           "chunk_positions", "context_parallel_attention", "gather_sequence", "merge_partials", "pad_batch",
           "padded_length", "ring_tiles", "shard_sequence", "textbook_attention"]
