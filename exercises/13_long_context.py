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

import math  # noqa: F401 (the scale of the scores: math.sqrt(d))

import torch


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over the keys of two partial results, from their outputs and log-sum-exps."""
    # TODO: the merged log-sum-exp, then each part's output weighted by its share (exp(lse_part - lse)).
    #       Mind the rows where a part (or both) saw no key: lse = -inf.
    raise NotImplementedError("merge_partials")


def zigzag_positions(seq_len: int, cp: int, rank: int) -> list[int]:
    """The positions of the tokens rank ``rank`` of ``cp`` holds under the zig-zag split (padded sequence)."""
    # TODO: pad to a multiple of 2 * cp, cut into 2 * cp chunks, take chunks rank and 2 * cp - 1 - rank.
    raise NotImplementedError("zigzag_positions")


def blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of ``q`` over ``k, v``, one block of keys at a time: ``(out, lse)``."""
    # TODO: start from out = 0, lse = -inf; for each block of keys, its masked scores [..., s, block], their
    #       log-sum-exp and the block's output, merged in with merge_partials.  math.sqrt(d) scales the scores.
    raise NotImplementedError("blockwise_attention")
