"""Exercise 13 — long sequences: merging partial attention, the zig-zag split, and attention one block at a time.

Attention over ``s`` keys never needs the ``s x s`` score matrix.  Cut the keys into blocks; the attention of a
query over one block of keys is a *partial* result: its output ``out`` (the block's values weighted by the
softmax over that block only) and the log-sum-exp ``lse = log(sum_j exp(score_j))`` of its scores there.  Two
partials over disjoint sets of keys combine into the attention over both, exactly:

    lse = log(exp(lse_a) + exp(lse_b))
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

That merge is how FlashAttention walks the keys block by block, and how ring attention combines what each rank's
keys contribute.  Three functions:

1. ``merge_partials(out_a, lse_a, out_b, lse_b) -> (out, lse)``: ``out_*`` ``[..., s, d]``, ``lse_*``
   ``[..., s]``, any leading dimensions.  A query that saw no key in a part has ``lse = -inf`` there (and an
   output of zeros): the merge must then return the other part unchanged, and ``out = 0, lse = -inf`` where both
   saw nothing, never ``nan``.  Scores can be large (``lse`` in the thousands): nothing may overflow.
2. ``zigzag_positions(seq_len, cp, rank) -> list[int]``: context parallelism splits a causal sequence over ``cp``
   ranks.  Pad it at the end to the next multiple of ``2 cp`` tokens, cut that into ``2 cp`` equal chunks, and
   give rank ``r`` chunks ``r`` and ``2 cp - 1 - r``, in that order.  Return the positions (in the padded
   sequence) of the tokens rank ``rank`` holds, as a list of ints: a caller indexes q, k and v with them, so
   not a generator (read once) and not floats.  Every rank then does the same causal work.
3. ``blockwise_attention(q, k, v, block_size) -> (out, lse)``: causal attention of ``q`` over ``k, v`` (all
   ``[..., s, d]``, query ``i`` sees keys ``0 .. i``, scores scaled by ``1 / sqrt(d)``), computed over blocks of
   ``block_size`` keys (the last one shorter) merged with your ``merge_partials``.  It must never form more than
   ``s x block_size`` scores per (batch, head) at once: the checks watch the largest tensor it creates.

Then run the grading cell of ``notebooks/13_long_context.ipynb`` (or ``labkit grade``); the checks run on the CPU,
with tensors of 2 to 4 dimensions and head sizes other than the examples', and also hand your functions what a
real caller does: q, k and v laid out transposed (not contiguous: use ``.reshape``, not ``.view``), in float32
(keep the inputs' dtype) and on the ``meta`` device, which stands for a GPU (make new tensors with
``device=q.device``).  labkit's own ``labkit.parallel.context``, however it is loaded, torch's fused attention
(``scaled_dot_product_attention``, its kernels, flex attention) and torch's context parallelism (its head-tail
load balancer, its merger of partial results) are switched off while the checks run: the answers must be yours.
"""

import math

import torch


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over the keys of two partial results, from their outputs and log-sum-exps."""
    lse = torch.logaddexp(lse_a, lse_b)  # log(e^a + e^b) without overflow; -inf only where both are
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # keeps -inf - (-inf) out of the exponent
    weight_a = torch.exp(lse_a - safe).unsqueeze(-1)  # each part's share of the softmax's denominator
    weight_b = torch.exp(lse_b - safe).unsqueeze(-1)
    return weight_a * out_a + weight_b * out_b, lse


def zigzag_positions(seq_len: int, cp: int, rank: int) -> list[int]:
    """The positions of the tokens rank ``rank`` of ``cp`` holds under the zig-zag split (padded sequence)."""
    chunks = 2 * cp
    chunk = -(-seq_len // chunks)  # the padded length divided by 2 cp, rounded up
    positions = []
    for index in (rank, chunks - 1 - rank):  # an early chunk and its mirror from the end
        positions += range(index * chunk, (index + 1) * chunk)
    return positions


def blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of ``q`` over ``k, v``, one block of keys at a time: ``(out, lse)``."""
    seq_len = q.shape[-2]
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    rows = torch.arange(seq_len, device=q.device)
    for start in range(0, k.shape[-2], block_size):
        cols = torch.arange(start, min(start + block_size, k.shape[-2]), device=q.device)
        scores = q @ k[..., cols, :].transpose(-2, -1) / math.sqrt(q.shape[-1])  # [..., s, block]
        scores = scores.masked_fill(cols[None, :] > rows[:, None], float("-inf"))  # later keys are masked
        block_lse = torch.logsumexp(scores, dim=-1)  # -inf for a query before the whole block
        safe = torch.where(torch.isinf(block_lse), torch.zeros_like(block_lse), block_lse)
        block_out = torch.exp(scores - safe.unsqueeze(-1)) @ v[..., cols, :]
        out, lse = merge_partials(out, lse, block_out, block_lse)
    return out, lse
