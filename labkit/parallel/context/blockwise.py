"""Blockwise attention: FlashAttention-2's algorithm in PyTorch, the kernel every kind of context parallelism runs.

**Why.**  Attention ``softmax(Q K^T / sqrt(d)) V`` over a sequence of ``s`` tokens forms an ``s x s`` matrix of
scores per head: at ``s = 131,072`` that is 17 G elements a head, 64 GiB in fp32, for one layer.  Everything
else a transformer layer holds grows with ``s`` (Korthikanti et al. 2022's ``s b h`` terms); the scores grow with
``s^2``.  FlashAttention (Dao et al. 2022; FlashAttention-2, Dao 2023) never forms them.

**The online softmax** (Milakov & Gimelshein 2018).  Cut the keys and values into blocks of ``block_size`` and
walk them, keeping per query row three running numbers: the largest score ``m`` seen so far, the sum
``l = sum exp(score - m)``, and the unnormalised output ``acc = sum exp(score - m) v``.  When a block raises the
maximum from ``m`` to ``m'``, what was summed so far is rescaled by ``exp(m - m')``; at the end
``out = acc / l`` and the **log-sum-exp** ``lse = m + log l``.  Only one ``block x block`` tile of scores exists
at a time; what is kept for the backward pass is ``q, k, v, out`` and ``lse`` (one number per row): memory
linear in ``s``.

**The backward pass recomputes** each tile's probabilities from the LSE, ``P = exp(Q K^T / sqrt(d) - lse)``,
instead of storing them, and uses ``delta = rowsum(dO * O)`` for the softmax's Jacobian:
``dS = P * (dO V^T - delta)``, then ``dQ = dS K / sqrt(d)``, ``dK = dS^T Q / sqrt(d)``, ``dV = P^T dO``.
FLOPs: the forward pass is ``4 s^2 d`` per head (two matrix products; half that when causal), the backward
``2.5x`` the forward with the recomputation (FlashAttention-2, section 3.1.2).

**The causal mask by positions.**  Each query and key carries its position in the *whole* sequence; a key
later than the query is masked.  A tile whose keys all come after all its queries is skipped (no work), a tile
entirely on or below the diagonal needs no mask.  Context parallelism hands a rank the queries of its chunks and
keys from other ranks' chunks; with positions, the same kernel masks them right, and counts the tiles it
computed (:attr:`Tiles.computed`): the causal imbalance of lesson 13 is that count.

**The LSE also merges.**  Two partial results over disjoint sets of keys, ``(out_a, lse_a)`` and
``(out_b, lse_b)``, combine exactly into the result over both (:func:`merge_partials`):
``lse = log(exp(lse_a) + exp(lse_b))``, ``out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b``.  Ring
attention merges its ``cp`` partial results this way.

On CPU this is a teaching kernel: Python loops over tiles.  It agrees with torch's
``scaled_dot_product_attention`` to rounding (``tests/test_context_blockwise.py``) and is slower than torch's
fused CPU kernel (``benchmarks/bench_cp.py`` measures how much).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from labkit.parallel.context.sequence import Tiles, block_slices, tile_kind

DEFAULT_BLOCK_SIZE = 64


def check_attention_inputs(q: Any, k: Any, v: Any, block_size: Any) -> None:
    """``q`` ``[batch, heads, s_q, d]``, ``k`` and ``v`` ``[batch, heads, s_k, d]``, one dtype; ``block_size``
    an integer >= 1.  Raises ``TypeError``/``ValueError`` naming what is wrong."""
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 4:
            raise ValueError(f"{name} must be [batch, heads, seq, head_dim], got shape {tuple(tensor.shape)}")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must agree in batch, "
                         "heads and head_dim (k and v in every dimension)")
    if len({q.dtype, k.dtype, v.dtype}) != 1 or not q.is_floating_point():
        raise TypeError(f"q, k and v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")


def _positions(positions: torch.Tensor | None, length: int, device: torch.device) -> torch.Tensor:
    if positions is None:
        return torch.arange(length, device=device)
    if positions.shape != (length,):
        raise ValueError(f"positions must be one index per token, shape ({length},), got {tuple(positions.shape)}")
    return positions.to(device)


def _scores(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, kind: str,
            scale: float) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if kind == "masked":
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return scores


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                      block_size: int = DEFAULT_BLOCK_SIZE, scale: float | None = None,
                      q_positions: torch.Tensor | None = None, k_positions: torch.Tensor | None = None,
                      tiles: Tiles | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of attention from ``q`` to ``k, v``, one ``block_size`` tile of scores at a time.

    ``out`` has ``q``'s shape; ``lse`` is ``[batch, heads, s_q]`` in ``q``'s dtype: ``-inf`` (and ``out`` zero) for
    a query that sees no key.  ``q_positions``/``k_positions`` (default ``0 .. s - 1``) are the tokens' places in
    the whole sequence, which the causal mask compares.  ``tiles``, if given, counts the tiles.
    """
    check_attention_inputs(q, k, v, block_size)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q_pos = _positions(q_positions, q.shape[2], q.device)
    k_pos = _positions(k_positions, k.shape[2], q.device)
    count = Tiles() if tiles is None else tiles
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=q.dtype, device=q.device)
    for rows in block_slices(q.shape[2], block_size):
        q_rows = q[:, :, rows]
        m = torch.full(q_rows.shape[:3], float("-inf"), dtype=q.dtype, device=q.device)
        l = torch.zeros_like(m)  # noqa: E741 (the paper's name)
        acc = torch.zeros_like(q_rows)
        for cols in block_slices(k.shape[2], block_size):
            kind = tile_kind(q_pos[rows], k_pos[cols], causal)
            count.add(kind)
            if kind == "skip":
                continue
            scores = _scores(q_rows, k[:, :, cols], q_pos[rows], k_pos[cols], kind, scale)
            m_new = torch.maximum(m, scores.amax(dim=-1))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows with no key yet
            p = torch.exp(scores - m_safe[..., None])
            rescale = torch.exp(m - m_safe)
            l = rescale * l + p.sum(dim=-1)  # noqa: E741
            acc = rescale[..., None] * acc + torch.matmul(p, v[:, :, cols])
            m = m_new
        seen = l > 0
        out[:, :, rows] = torch.where(seen[..., None], acc / torch.where(seen, l, 1.0)[..., None], 0.0)
        lse[:, :, rows] = torch.where(seen, m + torch.log(torch.where(seen, l, 1.0)), float("-inf"))
    count.settle()
    return out, lse


def attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
                       delta: torch.Tensor, *, causal: bool = True, block_size: int = DEFAULT_BLOCK_SIZE,
                       scale: float | None = None, q_positions: torch.Tensor | None = None,
                       k_positions: torch.Tensor | None = None,
                       tiles: Tiles | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of attention from ``q`` to ``k, v``, recomputing each tile's probabilities from ``lse``.

    ``lse`` and ``delta = rowsum(dout * out)`` are the *final* result's (over every key the queries attend to,
    not only ``k``): then ``(dq, dk, dv)`` is exactly this block of keys' share of the gradient, which is how ring
    attention's backward pass works block by block.  The loop runs over key blocks outside (each ``dk, dv``
    block is finished in one pass) and query blocks inside, as FlashAttention-2's does.
    """
    check_attention_inputs(q, k, v, block_size)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q_pos = _positions(q_positions, q.shape[2], q.device)
    k_pos = _positions(k_positions, k.shape[2], q.device)
    count = Tiles() if tiles is None else tiles
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # a row with no key has p = 0 anyway
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    row_blocks = block_slices(q.shape[2], block_size)
    for cols in block_slices(k.shape[2], block_size):
        k_cols, v_cols = k[:, :, cols], v[:, :, cols]
        for rows in row_blocks:
            kind = tile_kind(q_pos[rows], k_pos[cols], causal)
            count.add(kind)
            if kind == "skip":
                continue
            scores = _scores(q[:, :, rows], k_cols, q_pos[rows], k_pos[cols], kind, scale)
            p = torch.exp(scores - lse_safe[:, :, rows, None])
            dout_rows = dout[:, :, rows]
            dv[:, :, cols] += torch.matmul(p.transpose(-2, -1), dout_rows)
            dscores = p * (torch.matmul(dout_rows, v_cols.transpose(-2, -1)) - delta[:, :, rows, None])
            dq[:, :, rows] += torch.matmul(dscores, k_cols) * scale
            dk[:, :, cols] += torch.matmul(dscores.transpose(-2, -1), q[:, :, rows]) * scale
    count.settle()
    return dq, dk, dv


def softmax_delta(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """``rowsum(dout * out)``: the softmax Jacobian's per-row term of the backward pass (FlashAttention-2's D)."""
    return (dout * out).sum(dim=-1)


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the keys of two partial results, from their outputs and log-sum-exps (exact).

    A row that saw no key in one part (``lse = -inf``) takes the other part whole; in neither, zero.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    weight_a = torch.exp(lse_a - lse_safe)[..., None]
    weight_b = torch.exp(lse_b - lse_safe)[..., None]
    return weight_a * out_a + weight_b * out_b, lse


class BlockwiseAttention(torch.autograd.Function):
    """Autograd for :func:`attention_forward`: saves ``q, k, v, out, lse`` (no score matrix) and recomputes."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, block_size: int,
                scale: float | None, q_positions: torch.Tensor | None = None,
                k_positions: torch.Tensor | None = None, tiles: Tiles | None = None) -> tuple[torch.Tensor, ...]:
        ctx.options = {"causal": causal, "block_size": block_size, "scale": scale, "q_positions": q_positions,
                       "k_positions": k_positions, "tiles": tiles}
        out, lse = attention_forward(q, k, v, **ctx.options)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, _dlse: torch.Tensor | None) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(q, k, v, dout, lse, softmax_delta(out, dout), **ctx.options)
        return dq, dk, dv, None, None, None, None, None, None


def blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                        block_size: int = DEFAULT_BLOCK_SIZE, scale: float | None = None,
                        return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``scaled_dot_product_attention(q, k, v, is_causal=causal)`` computed blockwise, differentiable.

    ``q, k, v``: ``[batch, heads, seq, head_dim]``; any sequence length (the last block is shorter).  With
    ``return_lse``, also the log-sum-exp ``[batch, heads, seq]`` of every query's scores.
    """
    check_attention_inputs(q, k, v, block_size)
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal attention here needs as many queries as keys (positions 0 .. s-1), got "
                         f"{q.shape[2]} queries and {k.shape[2]} keys")
    out, lse = BlockwiseAttention.apply(q, k, v, causal, block_size, scale)
    return (out, lse) if return_lse else out


def textbook_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d)) v`` as written: the whole score matrix formed, its probabilities (and the causal
    mask) kept for backward.  What blockwise attention avoids; lesson 13 measures both."""
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        future = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` from the whole ``s x s`` score matrix: the textbook formula, for checks and pictures."""
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        future = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v), torch.logsumexp(scores, dim=-1)


def causal_tiles(seq_len: int, block_size: int) -> Tiles:
    """The tiles one causal call over ``seq_len`` tokens computes, masks and skips (pure arithmetic)."""
    n = -(-seq_len // block_size)
    diagonal_masked = sum(min(block_size, seq_len - start) > 1 for start in range(0, seq_len, block_size))
    return Tiles(computed=n * (n + 1) // 2, masked=diagonal_masked, skipped=n * (n - 1) // 2)
