"""Expert parallelism (GShard, Lepikhin et al. 2020): ``ep`` ranks hold ``E / ep`` experts each, contiguous (rank
``r`` experts ``r E/ep .. (r+1) E/ep - 1``), and every rank routes its own tokens.  Once the rows are permuted by
expert (:mod:`labkit.parallel.experts.permute`):

1. **exchange counts**: an all-to-all of the ``E`` per-expert counts tells every rank how many rows it will
   receive from each rank for each of its experts; the splits are uneven, and a receiver must know them before
   the data arrives (``all_to_all_single`` takes them as arguments);
2. **dispatch**: ``all_to_all_single`` of the permuted rows, ``send_counts[j]`` of them to rank ``j``;
3. the receiver regroups the rows from (source, expert) order to (expert, source) order, runs each expert on its
   rows, and puts them back;
4. **combine**: the reverse all-to-all, the same splits swapped; the sender undoes its permutation, weights
   each row by its gate and sums a token's ``k`` rows.

The backward pass is the same two all-to-alls in the other direction (the gradient of a dispatch is a combine),
so a layer sends, per rank and direction, ``T k h b (ep - 1) / ep`` bytes when the routing is uniform (``T``
tokens of width ``h`` and ``b`` bytes, ``k`` choices, the ``1 / ep`` for this rank's own experts staying home),
twice forward and twice backward; with a real router, the rows it actually sends, which the log records
(``labkit.costmodel.experts``).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labkit import trace
from labkit.degrees import check_degree
from labkit.dist import require_group
from labkit.parallel.experts.permute import dispatch_order, inverse_permutation, run_experts


def check_expert_parallel(n_experts: int, ep: object) -> None:
    """``ep`` must be a positive integer dividing the experts; ``ValueError`` naming the values."""
    check_degree("ep", ep)
    if n_experts % ep:
        raise ValueError(f"expert parallelism gives every rank n_experts / ep experts: n_experts={n_experts} "
                         f"does not divide by ep={ep}")


class ExpertParallelGroup:
    """The ranks the experts are spread over, and a record of what they sent.

    ``log`` lists ``(phase, kind, bytes)``: ``kind`` ``"counts"`` (the per-expert counts), ``"dispatch"`` or
    ``"combine"`` (``"ddispatch"``, ``"dcombine"`` in backward); ``bytes`` the rows sent to *other* ranks.
    ``splits`` lists, per forward dispatch, the rows this rank sent to each rank and received from each.
    ``expert_seconds`` lists this rank's time in its experts per layer call (forward), as the CPU time of its
    thread: what the experts cost it whether or not other ranks shared its core meanwhile.
    """

    def __init__(self, group: Any = None):
        self.group = require_group(group)
        self.size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.log: list[tuple[str, str, int]] = []
        self.splits: list[tuple[list[int], list[int]]] = []
        self.expert_seconds: list[float] = []

    def clear(self) -> None:
        """Forget what was sent and timed (a new step)."""
        self.log, self.splits, self.expert_seconds = [], [], []

    def experts(self, n_experts: int) -> range:
        """The expert ids this rank holds."""
        local = n_experts // self.size
        return range(self.rank * local, (self.rank + 1) * local)

    def _record(self, kind: str, nbytes: int) -> None:
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        self.log.append((phase, kind, nbytes))

    def exchange_counts(self, per_expert: torch.Tensor) -> torch.Tensor:
        """``per_expert`` ``[E]`` rows this rank sends to each expert -> ``[ep, E / ep]``: the rows each rank
        sends to each of this rank's experts."""
        received = torch.empty_like(per_expert)
        with trace.span("ep all-to-all counts", "comm"):
            dist.all_to_all_single(received, per_expert, group=self.group)
        share = per_expert.numel() // self.size
        self._record("counts", (per_expert.numel() - share) * per_expert.element_size())
        return received.view(self.size, share)

    def all_to_all(self, rows: torch.Tensor, out_splits: list[int], in_splits: list[int], kind: str) -> torch.Tensor:
        """``rows`` ``[sum(in_splits), h]``, ``in_splits[j]`` of them to rank ``j`` -> ``[sum(out_splits), h]``."""
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        with trace.span(f"ep all-to-all {kind}", "comm"):
            dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=self.group)
        width = math.prod(rows.shape[1:]) * rows.element_size()  # bytes of one row
        self._record(kind, (sum(in_splits) - in_splits[self.rank]) * width)
        return out


    def exchange(self, rows: torch.Tensor, per_expert: torch.Tensor, experts: nn.ModuleList) -> torch.Tensor:
        """Steps 1-4 for ``rows`` grouped by expert, ``per_expert`` ``[E]`` of them for each: the experts'
        outputs, in the same order."""
        from_each = self.exchange_counts(per_expert)  # [ep, E / ep]
        send = per_expert.view(self.size, -1).sum(dim=1).tolist()
        receive = from_each.sum(dim=1).tolist()
        self.splits.append((send, receive))
        received = _AllToAll.apply(rows, receive, send, self, "dispatch")
        # (source, expert) order -> (expert, source): a stable sort by local expert id
        local = torch.arange(from_each.shape[1], device=rows.device).repeat(self.size)
        regroup = dispatch_order(local.repeat_interleave(from_each.reshape(-1)), from_each.shape[1], 1)
        start, first = time.thread_time(), self.experts(len(experts)).start
        name = f"experts {first}-{first + from_each.shape[1] - 1}"
        marks: dict[str, float] = {}  # the experts' backward on the trace: from its first gradient to its last
        with trace.span(name, "compute"):
            computed = run_experts(_Mark.apply(received[regroup], marks, f"{name} backward"),
                                   from_each.sum(dim=0).tolist(), experts, first)
        if torch.is_grad_enabled():
            self.expert_seconds.append(time.thread_time() - start)
        computed = _Mark.apply(computed, marks, None)
        return _AllToAll.apply(computed[inverse_permutation(regroup)], send, receive, self, "combine")


class _Mark(torch.autograd.Function):
    """Identity.  While tracing, its backward notes the time: placed after the experts (``name`` ``None``) it runs
    as their backward starts; placed before them, as it ends, and records the span ``name`` from one to the other."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, marks: dict[str, float], name: str | None) -> torch.Tensor:
        ctx.marks, ctx.name = marks, name
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        if ctx.name is None:
            ctx.marks["start"] = trace.now()
        elif "start" in ctx.marks:
            trace.add(ctx.name, "compute", ctx.marks["start"], trace.now())
        return grad, None, None


class _AllToAll(torch.autograd.Function):
    """Rows to other ranks; the backward sends their gradients back the same way reversed."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
                ep: ExpertParallelGroup, kind: str) -> torch.Tensor:
        ctx.splits, ctx.ep, ctx.kind = (out_splits, in_splits), ep, kind
        return ep.all_to_all(rows, out_splits, in_splits, kind)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        out_splits, in_splits = ctx.splits
        return ctx.ep.all_to_all(grad, in_splits, out_splits, f"d{ctx.kind}"), None, None, None, None
