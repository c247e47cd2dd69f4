"""Context parallelism: one sequence's attention over ``cp`` ranks, three ways, all on the blockwise kernel.

Each rank holds ``s / cp`` of the sequence's tokens (:mod:`labkit.parallel.context.sequence`: contiguous or
zig-zag) and their ``q, k, v`` ``[batch, heads, s / cp, d]``.  Everything in a transformer but attention works
token by token, so it needs no communication; attention needs every earlier key.  Write ``N = b (s / cp) h``
for the elements of one rank's ``K`` (``h = heads x d``), ``e`` for the bytes of one element.

**Ring attention, pass-KV** (Liu et al. 2023; "pass-KV" is Yang et al. 2024's name, beside their pass-Q).  The
ranks form a ring; at step ``i`` rank ``r`` holds the keys and values of rank ``r - i`` and computes its queries'
partial result against them (:func:`~labkit.parallel.context.blockwise.attention_forward`) while it passes
them on to ``r + 1`` and receives the next block from ``r - 1`` (``isend``/``irecv``, overlapped).  The ``cp``
partial results merge exactly by their log-sum-exps.  Sends per rank: ``(cp - 1)`` K/V blocks forward,
``2 N e (cp - 1)`` bytes; backward the K/V blocks rotate again and each block's ``dK, dV`` travel round the ring
behind them, accumulating every rank's share until they reach their owner: ``(cp - 1)`` more of each.
Memory: one K/V block in flight besides one's own.

**All-gather** (Llama 3, Grattafiori et al. 2024, section 3.3.2): all-gather ``K, V`` (``2 N cp e`` bytes out of
the all-gather, ``(cp - 1) / cp`` of it through each rank's link), attend locally, and in the backward pass
gather again and reduce-scatter ``dK, dV`` to their owners.  Simple, exposed (not overlapped), and memory for
the whole sequence's ``K, V`` while a layer runs; Llama 3 chose it for its flexibility with masks and because
``K, V`` are small under grouped-query attention.

**Ulysses** (Jacobs et al. 2023, DeepSpeed-Ulysses): an all-to-all turns sequence-sharded ``q, k, v``
into head-sharded ones (every rank: the whole sequence, ``heads / cp`` heads), each rank attends its heads with
no further communication, and a second all-to-all turns the output back.  Each all-to-all moves
``(cp - 1) / cp`` of its input: forward ``4 N e (cp - 1) / cp`` bytes per rank (q, k, v, out), the same backward
(their gradients) -- the paper's "4Nh/P" per link, constant when ``s`` and ``cp`` grow together.  The heads
must divide by ``cp``.

Every collective is recorded by the :class:`ContextParallelGroup` (what ``labkit.costmodel.context`` predicts),
timed on the trace, and every tile the kernel computes is counted in ``.tiles``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from labkit import trace
from labkit.dist import global_rank, require_group
from labkit.parallel.base import all_gather_tensor, reduce_scatter_tensor
from labkit.parallel.context.blockwise import (
    DEFAULT_BLOCK_SIZE,
    BlockwiseAttention,
    Tiles,
    attention_backward,
    attention_forward,
    merge_partials,
    softmax_delta,
)
from labkit.parallel.context.sequence import check_cp, chunk_positions, ulysses_problem

STRATEGIES = ("ring", "all_gather", "ulysses")


class ContextParallelGroup:
    """The ranks one sequence is split over, how it is split, and a record of what they sent and computed.

    ``group``: ``None``, a ``ProcessGroup`` or a one-dimensional ``DeviceMesh``.  ``log`` lists
    ``(phase, kind, bytes)`` for every send or collective (``kind``: ``"send"`` for the ring's point-to-point
    messages, else the collective's name), bytes that left this rank (labkit's one convention,
    :mod:`labkit.costmodel.collectives`): a send's size, an all-gather's input once to each other rank, the
    chunks of a reduce-scatter's or an all-to-all's input meant for other ranks.
    """

    def __init__(self, group: Any = None, split: str = "zigzag", block_size: int = DEFAULT_BLOCK_SIZE):
        self.group = require_group(group)
        self.size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        check_cp(self.size, split)
        self.split, self.block_size = split, block_size
        self.log: list[tuple[str, str, int]] = []
        self.tiles = Tiles()
        self._positions: dict[tuple[int, int], torch.Tensor] = {}

    def positions(self, local_len: int, rank: int | None = None) -> torch.Tensor:
        """The whole-sequence positions of rank ``rank``'s (default: this rank's) ``local_len`` tokens."""
        rank = self.rank if rank is None else rank
        if (local_len, rank) not in self._positions:
            self._positions[local_len, rank] = chunk_positions(local_len * self.size, self.size, rank, self.split)
        return self._positions[local_len, rank]

    def all_positions(self, local_len: int) -> torch.Tensor:
        """Every rank's positions, in rank order: the order of a sequence gathered along the group."""
        return torch.cat([self.positions(local_len, rank) for rank in range(self.size)])

    def _record(self, kind: str, nbytes: int) -> None:
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        self.log.append((phase, kind, nbytes))

    def rotate(self, sends: list[tuple[torch.Tensor, str]]) -> tuple[_Pending, list[torch.Tensor]]:
        """Send each tensor to the next rank of the ring and receive one of the same shape from the previous
        one, all in one batch (NCCL needs a ring's sends and receives grouped, or every rank's send waits for a
        receive queued behind it).  Returns the works to wait on and the receive buffers."""
        ops, received = [], []
        following = global_rank(self.group, (self.rank + 1) % self.size)
        preceding = global_rank(self.group, (self.rank - 1) % self.size)
        for tag, (tensor, _) in enumerate(sends):
            buffer = torch.empty_like(tensor)
            self._record("send", _nbytes(tensor))
            ops += [dist.P2POp(dist.isend, tensor, following, self.group, tag),
                    dist.P2POp(dist.irecv, buffer, preceding, self.group, tag)]
            received.append(buffer)
        posted = trace.now()
        works = dist.batch_isend_irecv(ops)
        return _Pending(works, posted, "+".join(what for _, what in sends)), received

    def all_gather(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """The ranks' ``tensor``s stacked along a new first dimension, in rank order."""
        out = tensor.new_empty((self.size * tensor.shape[0], *tensor.shape[1:]))  # concatenated along dim 0
        self._record("all_gather", (self.size - 1) * _nbytes(tensor))  # its tensor to each other rank
        with trace.span(f"all_gather {what}", "comm"):
            all_gather_tensor(out, tensor.contiguous(), group=self.group)
        return out.view(self.size, *tensor.shape)

    def reduce_scatter(self, stacked: torch.Tensor, what: str) -> torch.Tensor:
        """``stacked[r]`` summed over the ranks, on rank ``r``."""
        out = stacked.new_empty(stacked.shape[1:])
        self._record("reduce_scatter", _nbytes(stacked) - _nbytes(stacked[self.rank]))  # the others' sums
        with trace.span(f"reduce_scatter {what}", "comm"):
            reduce_scatter_tensor(out, stacked.contiguous().flatten(0, 1), group=self.group)
        return out

    def all_to_all(self, stacked: torch.Tensor, what: str) -> torch.Tensor:
        """``stacked[r]`` goes to rank ``r``; returns what every rank sent here, stacked by sender."""
        out = stacked.new_empty(stacked.shape)  # contiguous (empty_like would keep a view's strides)
        self._record("all_to_all", _nbytes(stacked) - _nbytes(stacked[self.rank]))  # its own chunk stays
        with trace.span(f"all_to_all {what}", "comm"):
            dist.all_to_all_single(out, stacked.contiguous(), group=self.group)
        return out


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _Pending:
    """A batch of ring messages in flight.  On the trace (gloo's point-to-point works have no completion
    callback), ``recv`` spans from posting to the wait's return and ``wait`` the part the rank sat waiting: the
    communication the compute did not hide."""

    def __init__(self, works: list[Any], posted: float, what: str):
        self.works, self.posted, self.what = works, posted, what

    def wait(self) -> None:
        waiting = trace.now()
        for work in self.works:
            work.wait()
        done = trace.now()
        trace.add(f"recv {self.what}", "comm", self.posted, done)
        trace.add(f"wait {self.what}", "idle", waiting, done)


def _wait(pending: _Pending | None) -> None:
    if pending is not None:
        pending.wait()


# --------------------------------------------------------------------------------------------------------
# Ring attention (pass-KV)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group: ContextParallelGroup,
                causal: bool) -> torch.Tensor:
        local = q.shape[2]
        kv = torch.stack([k, v])
        out = lse = None
        for step in range(cp_group.size):
            source = (cp_group.rank - step) % cp_group.size
            works, incoming = cp_group.rotate([(kv, "kv")]) if step < cp_group.size - 1 else (None, [kv])
            with trace.span(f"attention q{cp_group.rank} kv{source}", "compute"):
                part = attention_forward(q, kv[0], kv[1], causal=causal, block_size=cp_group.block_size,
                                         q_positions=cp_group.positions(local), k_positions=cp_group.positions(local, source),
                                         tiles=cp_group.tiles)
                out, lse = part if out is None else merge_partials(out, lse, *part)
            _wait(works)
            kv = incoming[0]
        # In q's memory layout (q is a view of the projection's [b, s, heads, d]), as torch's kernels return it:
        # the output projection then reads it without a copy of its own.
        out = torch.empty_like(q).copy_(out)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp_group, ctx.causal = cp_group, causal
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        cp_group, local = ctx.cp_group, q.shape[2]
        dout = dout.contiguous()
        delta = softmax_delta(out, dout)
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])
        own = pending = None
        for step in range(cp_group.size):
            source = (cp_group.rank - step) % cp_group.size
            # The dK, dV of the block held now arrive from the rank that held it last step (from step 2 on: at
            # step 1 the block's first share is computed here); this rank's last share leaves in the same batch.
            sends = [(pending, "dkv")] if pending is not None else []
            if step < cp_group.size - 1:
                sends.append((kv, "kv"))
            works, incoming = cp_group.rotate(sends) if sends else (None, [])
            with trace.span(f"attention backward q{cp_group.rank} kv{source}", "compute"):
                dq_part, dk, dv = attention_backward(
                    q, kv[0], kv[1], dout, lse, delta, causal=ctx.causal, block_size=cp_group.block_size,
                    q_positions=cp_group.positions(local), k_positions=cp_group.positions(local, source), tiles=cp_group.tiles)
            dq += dq_part
            dkv = torch.stack([dk, dv])
            _wait(works)
            if pending is not None:
                dkv += incoming.pop(0)
            if step == 0:
                own = dkv
            else:
                pending = dkv
            if incoming:
                kv = incoming[0]
        if pending is not None:  # the last share goes home: rank r + 1 held rank r's block at the last step
            works, incoming = cp_group.rotate([(pending, "dkv")])
            _wait(works)
            own = own + incoming[0]
        return dq, own[0], own[1], None, None


# --------------------------------------------------------------------------------------------------------
# All-gather (Llama 3)


def _gathered(stacked: torch.Tensor) -> torch.Tensor:
    """``[cp, 2, b, heads, s/cp, d]`` -> ``[2, b, heads, s, d]``, rank 0's tokens first."""
    cp, two, batch, heads, local, dim = stacked.shape
    return stacked.permute(1, 2, 3, 0, 4, 5).reshape(two, batch, heads, cp * local, dim)


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group: ContextParallelGroup,
                causal: bool) -> torch.Tensor:
        local = q.shape[2]
        kv = _gathered(cp_group.all_gather(torch.stack([k, v]), "kv"))
        with trace.span(f"attention q{cp_group.rank} all kv", "compute"):
            out, lse = attention_forward(q, kv[0], kv[1], causal=causal, block_size=cp_group.block_size,
                                         q_positions=cp_group.positions(local), k_positions=cp_group.all_positions(local),
                                         tiles=cp_group.tiles)
        ctx.save_for_backward(q, k, v, out, lse)  # this rank's K, V only: gathered again backward
        ctx.cp_group, ctx.causal = cp_group, causal
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        cp_group, local = ctx.cp_group, q.shape[2]
        dout = dout.contiguous()
        kv = _gathered(cp_group.all_gather(torch.stack([k, v]), "kv"))
        with trace.span(f"attention backward q{cp_group.rank} all kv", "compute"):
            dq, dk, dv = attention_backward(q, kv[0], kv[1], dout, lse, softmax_delta(out, dout),
                                            causal=ctx.causal, block_size=cp_group.block_size,
                                            q_positions=cp_group.positions(local), k_positions=cp_group.all_positions(local),
                                            tiles=cp_group.tiles)
        batch, heads, _, dim = dk.shape
        per_rank = torch.stack([dk, dv]).view(2, batch, heads, cp_group.size, local, dim).permute(3, 0, 1, 2, 4, 5)
        own = cp_group.reduce_scatter(per_rank, "dkv")
        return dq, own[0], own[1], None, None


# --------------------------------------------------------------------------------------------------------
# Ulysses (all-to-all)


def _sequence_to_heads(x: torch.Tensor, cp_group: ContextParallelGroup, what: str) -> torch.Tensor:
    """``[n, heads, s/cp, d]`` sequence-sharded -> ``[n, heads/cp, s, d]`` head-sharded (rank order of tokens)."""
    n, heads, local, dim = x.shape
    send = x.view(n, cp_group.size, heads // cp_group.size, local, dim).transpose(0, 1)  # [destination, n, heads/cp, ...]
    received = cp_group.all_to_all(send, what)  # [source, n, heads/cp, s/cp, d]
    return received.permute(1, 2, 0, 3, 4).reshape(n, heads // cp_group.size, cp_group.size * local, dim)


def _heads_to_sequence(x: torch.Tensor, cp_group: ContextParallelGroup, what: str) -> torch.Tensor:
    """The inverse of :func:`_sequence_to_heads`."""
    n, group_heads, length, dim = x.shape
    local = length // cp_group.size
    send = x.view(n, group_heads, cp_group.size, local, dim).permute(2, 0, 1, 3, 4)  # [destination (its tokens), ...]
    received = cp_group.all_to_all(send, what)  # [source (its heads), n, heads/cp, s/cp, d]
    return received.transpose(0, 1).reshape(n, cp_group.size * group_heads, local, dim)


class _AllToAll(torch.autograd.Function):
    """Sequence-sharded to head-sharded (``to_heads``) or back; the backward pass is the other way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cp_group: ContextParallelGroup, what: str, to_heads: bool) -> torch.Tensor:
        ctx.cp_group, ctx.what, ctx.to_heads = cp_group, what, to_heads
        return (_sequence_to_heads if to_heads else _heads_to_sequence)(x, cp_group, what)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        back = _heads_to_sequence if ctx.to_heads else _sequence_to_heads
        return back(grad.contiguous(), ctx.cp_group, f"d{ctx.what}"), None, None, None


def check_ulysses_heads(heads: int, cp: int, kv_heads: int | None = None, tp: int = 1) -> None:
    """Ulysses gives each rank ``heads / cp`` whole heads, and ``kv_heads / cp`` whole K/V heads (after ``tp``):
    ``ValueError`` when ``cp`` does not divide them (:func:`~labkit.parallel.context.sequence.ulysses_problem`)."""
    problem = ulysses_problem(heads, cp, kv_heads, tp)
    if problem:
        raise ValueError(f"{problem}: use ring or all-gather context parallelism, or a smaller cp")


def _ulysses(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group: ContextParallelGroup,
             causal: bool) -> torch.Tensor:
    check_ulysses_heads(q.shape[1], cp_group.size)
    batch, local = q.shape[0], q.shape[2]
    qkv = _AllToAll.apply(torch.cat([q, k, v]), cp_group, "qkv", True)  # one all-to-all for the three
    positions = cp_group.all_positions(local)
    with trace.span(f"attention heads of rank {cp_group.rank}", "compute"):
        out, _ = BlockwiseAttention.apply(qkv[:batch], qkv[batch:2 * batch], qkv[2 * batch:], causal,
                                          cp_group.block_size, None, positions, positions, cp_group.tiles)
    return _AllToAll.apply(out, cp_group, "out", False)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group: ContextParallelGroup, *,
                               strategy: str = "ring", causal: bool = True) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence's keys; ``q, k, v`` ``[batch, heads, s/cp, d]``
    hold this rank's tokens (``cp.split``), the result too.  Differentiable; equal to one process's attention
    over the whole sequence, gathered (``tests/test_context_parallel.py``)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if cp_group.size == 1:
        return BlockwiseAttention.apply(q, k, v, causal, cp_group.block_size, None, None, None, cp_group.tiles)[0]
    implementation: dict[str, Callable[..., torch.Tensor]] = {
        "ring": _RingAttention.apply, "all_gather": _AllGatherAttention.apply, "ulysses": _ulysses}
    return implementation[strategy](q, k, v, cp_group, causal)
