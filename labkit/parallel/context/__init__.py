"""Long sequences: blockwise (flash) attention and context parallelism.

- ``blockwise``: FlashAttention-2's tiled forward (online softmax, log-sum-exp) and backward (recomputed from
  the LSE), in PyTorch; the LSE merge of partial results;
- ``sequence``: which tokens each of ``cp`` ranks holds (contiguous or zig-zag), their positions (and RoPE's
  angles at them), the padding of a causal sequence, the causal work per rank, Ulysses' bound by the heads;
- ``attention``: one sequence's attention over ``cp`` ranks: ring (pass-KV), all-gather (Llama 3) and Ulysses
  (all-to-all), each recorded byte by byte;
- ``timing``: one attention's forward and backward measured on every rank, its tiles optionally timed waits.
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
    rotary,
    shard_sequence,
    tiles_per_rank,
    ulysses_problem,
)

__all__ = ["DEFAULT_BLOCK_SIZE", "SPLITS", "STRATEGIES", "ContextParallelGroup", "Tiles", "attention_backward",
           "attention_forward", "attention_reference", "blockwise_attention", "causal_tiles", "check_ulysses_heads",
           "chunk_positions", "context_parallel_attention", "gather_sequence", "merge_partials", "pad_batch",
           "padded_length", "ring_tiles", "rotary", "shard_sequence", "textbook_attention", "tiles_per_rank",
           "ulysses_problem"]
