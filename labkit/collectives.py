"""Collectives from point-to-point messages: ring all-reduce, reduce-scatter, all-gather, broadcast.

Data-parallel training spends its communication budget on one operation: every rank holds a gradient of ``n``
bytes and every rank needs the sum.  This module builds that *all-reduce* — and the pieces it is made of — from
nothing but ``send`` and ``recv``, and states what each algorithm costs in the **alpha-beta model**: sending a
message of ``m`` bytes over one link takes ``alpha + m * beta`` seconds, where ``alpha`` is the latency (start-up
cost per message) and ``beta`` the inverse bandwidth (seconds per byte).

**Parameter server (naive all-reduce).**  Every rank sends its tensor to rank 0, which adds them up and sends
the sum back.  The root receives ``(N-1) * n`` bytes and sends ``(N-1) * n`` bytes: its one link carries all
the traffic, so the time grows linearly with the number of ranks, ``2 (N-1) (alpha + n beta)``.

**Ring all-reduce** (Patarasuk & Yuan 2009; Baidu 2017; what NCCL and gloo do for large messages).  Arrange the
ranks in a ring, each sending only to its right neighbour, and cut the tensor into ``N`` chunks.

1. *Reduce-scatter*, ``N-1`` steps: at step ``s`` rank ``r`` sends chunk ``(r-s-1) mod N`` to rank ``r+1`` and
   receives chunk ``(r-s-2) mod N`` from rank ``r-1``, which it adds to its own copy.  A chunk picks up one
   rank's contribution per step, so after ``N-1`` steps rank ``r`` holds chunk ``r`` summed over all ranks.
2. *All-gather*, ``N-1`` more steps: the finished chunks travel round the ring the same way, now overwriting
   instead of adding, until every rank holds every finished chunk.

Every rank sends ``2 (N-1)`` messages of ``n/N`` bytes: ``2 (N-1)/N * n`` bytes in ``2 (N-1)`` steps, time
``2 (N-1) alpha + 2 (N-1)/N * n beta``.  The bandwidth term *does not grow with N*: it approaches ``2 n beta``,
which is optimal (each rank must send its ``n`` bytes out and receive the result in).  The latency term does
grow, which is why small messages use trees instead.  NCCL-tests report the *bus bandwidth* ``busbw = algbw *
2 (N-1)/N`` (``algbw = n / time``) so that a ring's number is comparable with the raw link speed whatever N is.

**On one machine the links are not independent.**  The model charges a ring step ``alpha + (n/N) beta`` although
every rank sends *and* receives ``n/N`` bytes in it: it assumes full-duplex links, one per rank, as NVLink or
InfiniBand give.  Over loopback TCP each byte is copied twice by a CPU (into the kernel by the sender, out by
the receiver), and every rank's copies share the same cores.  On a 2-core machine an *exchange* (two ranks
each sending ``m`` bytes to the other at once) took 2-3.6x as long as sending ``m`` one way (4-16 MiB;
``benchmarks/bench_collectives.py --anatomy``).  At ``N = 2`` the ring and the parameter server move the same
bytes per rank, ``n`` out and ``n`` in: the ring as two exchanges of ``n/2``, the parameter server as two
one-way transfers of ``n``, so the ring's predicted 2x advantage does not appear (16 MiB, loaded machine: ring
22.8 ms, its two exchanges alone 24.9 ms, parameter server 21.7 ms).  From ``N = 3``
the server's root carries ``N - 1`` times a leaf's bytes and the ring wins (about 2x at 4 ranks), as modelled.

**Pipelining.**  A step cannot start forwarding chunk ``c`` until it has arrived and been added.  Cutting each
chunk into *segments* lets a rank forward segment ``j`` while segment ``j+1`` is still arriving, so adding and
moving overlap, at ``alpha`` per segment.  Sends and receives are non-blocking (``isend``/``irecv``): if every
rank called a blocking ``send`` first, each would wait for a ``recv`` nobody had posted.

How large a segment?  On gloo over loopback ``alpha`` is mostly CPU time: Python, gloo's handshake (a
message flows once its receiver has posted the receive) and waking the threads that wait, about 0.1 ms of
CPU per message, sender and receiver together.  With more ranks than cores (4 ranks on 2 cores) the
all-reduce is CPU-bound: every message's overhead shows in its time, and overlapping an add (about 0.1 ms per
MiB) with a transfer gains nothing when no core is idle.  Segments are therefore large, ``SEGMENT_BYTES`` (4
MiB): a chunk of up to 4 MiB travels as one message.  At 16 MiB on 4 ranks (all threads' CPU, eight runs on a
loaded 2-core machine) 1 MiB segments took 12% more CPU than gloo's all-reduce, 4 MiB 2% less; in time 4 MiB
took 0.99x gloo's, 1 MiB 1.08x, 256 KiB 1.49x (``benchmarks/bench_collectives.py --segment-bytes``).

Reduce-scatter needs somewhere to receive before adding: ``RECEIVE_SLOTS`` segment-sized slots, reused
round-robin and kept between calls (fresh pages from the kernel each call cost a few percent at 16 MiB);
with up to ``RECEIVE_SLOTS`` segments to receive, every receive is posted before the first send, so no sender
waits for its neighbour to be ready.  All-gather receives straight into place, all posted up front.  Under
NCCL ``wait()`` orders CUDA streams instead of blocking; the code is written to stay correct there, but it is
tested and tuned on gloo.

**Broadcast** here is a *binomial tree* (MPICH's): in round ``k`` every rank that already has the data sends it
to the rank ``2^(R-1-k)`` places further on, so the number of holders doubles every round and ``R = ceil(log2
N)`` rounds suffice: time ``R (alpha + n beta)``.  The root sends ``R * n`` bytes, a leaf nothing.  That is the
right choice for latency-bound (small) messages; for large ones a pipelined chain or scatter + all-gather gets
close to ``n beta``, as the ring does for all-reduce.

Results use the default process group or the one passed as ``group``; ranks in records are ranks *in that
group* (positions on the ring).  Sums are computed in the tensor's dtype, as gloo and NCCL do.  Pass a list as
``record`` to get one plain dict per message sent (who sent which chunk to whom at which step, how many bytes,
and when, as ``time.perf_counter()`` on the sender when it posted the send), which is what the notebook
animates, what the tests compare with the cost model (``labkit.costmodel.collectives``;
``labkit.measure.measure_alpha_beta`` fits alpha and beta on this machine), and, from the times, where a step
waited.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from labkit.costmodel.collectives import chunk_bounds
from labkit.dist import global_rank, require_group

SEGMENT_BYTES = 4 << 20  # the unit of pipelining: a chunk is cut into segments of at most this (see above)
RECEIVE_SLOTS = 4  # receives posted ahead in reduce-scatter, each segment-sized: slack while this rank adds

# --------------------------------------------------------------------------------------------------------
# Arguments, groups and chunks


@dataclass(frozen=True)
class _Ring:
    """This rank's place in a group: its rank and the group's size, and how to address a peer."""

    group: dist.ProcessGroup | None
    rank: int
    world_size: int

    def isend(self, tensor: torch.Tensor, dst: int, record: list | None, algorithm: str, phase: str,
              step: int, chunk: int, segment: int = 0) -> dist.Work:
        if record is not None:
            record.append({"algorithm": algorithm, "phase": phase, "step": step, "src": self.rank, "dst": dst,
                           "chunk": chunk, "segment": segment, "bytes": tensor.numel() * tensor.element_size(),
                           "time_s": time.perf_counter()})
        return dist.isend(tensor, self._global(dst), group=self.group)

    def irecv(self, tensor: torch.Tensor, src: int) -> dist.Work:
        return dist.irecv(tensor, self._global(src), group=self.group)

    def _global(self, group_rank: int) -> int:
        return global_rank(self.group, group_rank)


def _ring_of(group: dist.ProcessGroup | None) -> _Ring:
    group = require_group(group)
    return _Ring(group, dist.get_rank(group), dist.get_world_size(group))


def _check_tensor(tensor: object, record: object) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}: {tensor!r:.80}")
    if record is not None and not isinstance(record, list):
        raise TypeError(f"record must be a list (to append send records to) or None, got {record!r:.80}")


def _average(op: object, tensor: torch.Tensor) -> bool:
    """True for "avg" / ReduceOp.AVG, False for "sum" / ReduceOp.SUM; anything else is an error."""
    if isinstance(op, str) and op.lower() in ("sum", "avg"):
        average = op.lower() == "avg"
    elif isinstance(op, dist.ReduceOp.RedOpType) and op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        average = op == dist.ReduceOp.AVG
    elif isinstance(op, (str, dist.ReduceOp.RedOpType)):
        raise ValueError(f"op must be 'sum' or 'avg' (or ReduceOp.SUM / ReduceOp.AVG), got {op!r}")
    else:
        raise TypeError(f"op must be 'sum', 'avg', ReduceOp.SUM or ReduceOp.AVG, got {type(op).__name__} {op!r}")
    if average and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"op='avg' needs a floating-point tensor, got dtype {tensor.dtype}")
    return average




@contextmanager
def _flat_in_place(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """A 1-D view of ``tensor`` to work on in place, without autograd.  A non-contiguous tensor is worked on as
    a contiguous copy, written back when the block ends — so every collective is in place, whatever the layout."""
    with torch.no_grad():
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        yield work.view(-1)
        if work is not tensor:
            tensor.copy_(work)


def _segments(start: int, stop: int, segment_elements: int) -> list[tuple[int, int]]:
    return [(begin, min(begin + segment_elements, stop)) for begin in range(start, stop, segment_elements)]


def _segment_elements(tensor: torch.Tensor, segment_bytes: int | None) -> int:
    """Elements per pipelined segment: ``segment_bytes`` when given, else ``SEGMENT_BYTES``."""
    if segment_bytes is None:
        segment_bytes = SEGMENT_BYTES
    elif isinstance(segment_bytes, bool) or not isinstance(segment_bytes, int) or segment_bytes < 1:
        raise ValueError(f"segment_bytes must be a positive int or None, got {segment_bytes!r}")
    return max(1, segment_bytes // tensor.element_size())


# Receive slots outlive a call: a fresh multi-megabyte buffer is fresh pages from the kernel each time, and
# faulting them in cost a few percent of a large all-reduce.  One per (thread, dtype, device) — two threads'
# collectives never share one — holding at most RECEIVE_SLOTS segments (16 MiB by default), grown on demand.
_slot_cache: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def _receive_slots(count: int, slot_elements: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (threading.get_ident(), dtype, device)
    cached = _slot_cache.get(key)
    if cached is None or cached.numel() < count * slot_elements:
        cached = _slot_cache[key] = torch.empty(count * slot_elements, dtype=dtype, device=device)
    return cached[:count * slot_elements].view(count, slot_elements)


# --------------------------------------------------------------------------------------------------------
# Ring reduce-scatter, all-gather, all-reduce


def ring_reduce_scatter(tensor: torch.Tensor, op: object = "sum", group: dist.ProcessGroup | None = None,
                        record: list | None = None, *, segment_bytes: int | None = None) -> torch.Tensor:
    """Reduce ``tensor`` across ranks, leaving rank ``r`` with the finished chunk ``r`` (see :func:`chunk_bounds`
    on the flattened tensor), and return that chunk.

    ``tensor`` is the full-size input on every rank and is used as the working buffer: afterwards this rank's
    chunk holds the reduced values and the other chunks hold *partial* sums (whatever passed through this rank).
    The returned chunk is a view of ``tensor`` when ``tensor`` is contiguous, else a copy.  Cost per rank:
    ``N-1`` steps, ``(N-1)/N * n`` bytes sent and received, and ``RECEIVE_SLOTS`` segment-sized receive slots
    (at most 16 MiB, kept for the next call).  ``segment_bytes``: the pipelining segment (None: ``SEGMENT_BYTES``).
    """
    _check_tensor(tensor, record)
    average = _average(op, tensor)
    ring = _ring_of(group)
    with _flat_in_place(tensor) as flat:
        _reduce_scatter_flat(flat, ring, average, record, _segment_elements(tensor, segment_bytes))
        start, stop = chunk_bounds(flat.numel(), ring.world_size)[ring.rank]
        return flat[start:stop]


def ring_all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None = None, record: list | None = None,
                    *, segment_bytes: int | None = None) -> torch.Tensor:
    """Fill every chunk of ``tensor`` from the rank that owns it; this rank's chunk must already be valid.

    ``tensor`` is the full-size buffer on every rank (chunks per :func:`chunk_bounds` of the flattened tensor);
    the other chunks are overwritten in place and ``tensor`` is returned.  Received data lands directly in
    place, so no extra memory is used.  Cost per rank: ``N-1`` steps, ``(N-1)/N * n`` bytes sent and received.
    """
    _check_tensor(tensor, record)
    ring = _ring_of(group)
    with _flat_in_place(tensor) as flat:
        _all_gather_flat(flat, ring, record, _segment_elements(tensor, segment_bytes))
    return tensor


def ring_all_reduce(tensor: torch.Tensor, op: object = "sum", group: dist.ProcessGroup | None = None,
                    record: list | None = None, *, segment_bytes: int | None = None) -> torch.Tensor:
    """Sum (or average) ``tensor`` over all ranks in place, like ``torch.distributed.all_reduce``; returns it.

    Reduce-scatter then all-gather.  Every rank sends and receives ``2 (N-1)/N * n`` bytes in ``2 (N-1)``
    steps.  Averages divide the finished chunk once, before the all-gather, so every rank gets identical bits.
    """
    _check_tensor(tensor, record)
    average = _average(op, tensor)
    ring = _ring_of(group)
    segment_elements = _segment_elements(tensor, segment_bytes)
    with _flat_in_place(tensor) as flat:
        _reduce_scatter_flat(flat, ring, average, record, segment_elements, algorithm="ring_all_reduce")
        _all_gather_flat(flat, ring, record, segment_elements, algorithm="ring_all_reduce")
    return tensor


def _reduce_scatter_flat(flat: torch.Tensor, ring: _Ring, average: bool, record: list | None,
                         segment_elements: int, algorithm: str = "ring_reduce_scatter") -> None:
    rank, world_size = ring.rank, ring.world_size
    if world_size == 1:  # the sum over one rank is the tensor itself (and so is its average)
        return
    bounds = chunk_bounds(flat.numel(), world_size)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    arrivals = []  # what comes from the left, in order: at step s, the segments of chunk (rank - s - 2)
    for step in range(world_size - 1):
        chunk = (rank - step - 2) % world_size
        for index, (begin, end) in enumerate(_segments(*bounds[chunk], segment_elements)):
            arrivals.append((step, chunk, index, begin, end))
    # A few one-segment receive slots, reused round-robin: memory stays RECEIVE_SLOTS segments whatever n is,
    # and enough receives are posted ahead that the left neighbour never waits for us to be ready.
    slot_elements = min(segment_elements, bounds[0][1] - bounds[0][0])  # chunk 0 is the largest
    slots = _receive_slots(min(RECEIVE_SLOTS, len(arrivals)), slot_elements, flat.dtype, flat.device)
    posted: deque[tuple[dist.Work, torch.Tensor]] = deque()

    def post_receive(arrival: int) -> None:
        begin, end = arrivals[arrival][3:]
        slot = slots[arrival % len(slots)][:end - begin]
        posted.append((ring.irecv(slot, left), slot))

    for arrival in range(len(slots)):
        post_receive(arrival)
    first = (rank - 1) % world_size  # step 0 sends our own data, which nothing has to wait for
    sends = [ring.isend(flat[begin:end], right, record, algorithm, "reduce-scatter", 0, first, index)
             for index, (begin, end) in enumerate(_segments(*bounds[first], segment_elements))]
    for arrival, (step, chunk, index, begin, end) in enumerate(arrivals):
        request, slot = posted.popleft()
        request.wait()
        flat[begin:end].add_(slot)
        if step + 1 < world_size - 1:  # forward the segment at once: it is what step + 1 sends
            sends.append(ring.isend(flat[begin:end], right, record, algorithm, "reduce-scatter", step + 1,
                                    chunk, index))
        if arrival + len(slots) < len(arrivals):
            post_receive(arrival + len(slots))
    for request in sends:
        request.wait()
    if average:
        start, stop = bounds[rank]
        flat[start:stop].div_(world_size)


def _all_gather_flat(flat: torch.Tensor, ring: _Ring, record: list | None, segment_elements: int,
                     algorithm: str = "ring_all_gather") -> None:
    rank, world_size = ring.rank, ring.world_size
    if world_size == 1:
        return
    bounds = chunk_bounds(flat.numel(), world_size)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    # Every chunk arriving here has its own final place in `flat`, so all receives can be posted up front.
    receives = []
    for step in range(world_size - 1):
        chunk = (rank - step - 1) % world_size
        receives.append([(ring.irecv(flat[begin:end], left), begin, end)
                         for begin, end in _segments(*bounds[chunk], segment_elements)])
    sends = []
    for index, (begin, end) in enumerate(_segments(*bounds[rank], segment_elements)):
        sends.append(ring.isend(flat[begin:end], right, record, algorithm, "all-gather", 0, rank, index))
    for step in range(world_size - 1):
        chunk = (rank - step - 1) % world_size
        for index, (request, begin, end) in enumerate(receives[step]):
            request.wait()
            if step + 1 < world_size - 1:  # pass it on, except at the last step (the right neighbour owns it)
                sends.append(ring.isend(flat[begin:end], right, record, algorithm, "all-gather", step + 1,
                                        chunk, index))
    for request in sends:
        request.wait()


# --------------------------------------------------------------------------------------------------------
# Binomial-tree broadcast and the parameter-server all-reduce


def broadcast(tensor: torch.Tensor, src: int = 0, group: dist.ProcessGroup | None = None,
              record: list | None = None) -> torch.Tensor:
    """Copy ``tensor`` from group rank ``src`` to every rank, in place, over a binomial tree; returns ``tensor``.

    Ranks are numbered relative to the root, ``v = (rank - src) mod N``.  Rank ``v > 0`` receives once, from
    ``v`` minus its lowest set bit; then every rank sends to ``v + 2^k`` for each ``2^k`` below that bit (the root:
    below ``N``), largest first.  ``ceil(log2 N)`` rounds; the root sends ``ceil(log2 N) * n`` bytes.
    """
    _check_tensor(tensor, record)
    ring = _ring_of(group)
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < ring.world_size:
        raise ValueError(f"src must be a rank of the group, 0..{ring.world_size - 1}, got {src!r}")
    rounds = math.ceil(math.log2(ring.world_size)) if ring.world_size > 1 else 0
    with _flat_in_place(tensor) as flat:
        relative = (ring.rank - src) % ring.world_size
        mask = 1
        while mask < ring.world_size:  # receive from the parent: clear my lowest set bit
            if relative & mask:
                if flat.numel() > 0:
                    ring.irecv(flat, (relative - mask + src) % ring.world_size).wait()
                break
            mask <<= 1
        sends = []
        mask >>= 1
        while mask > 0:
            if relative + mask < ring.world_size and flat.numel() > 0:
                step = rounds - 1 - int(math.log2(mask))
                sends.append(ring.isend(flat, (relative + mask + src) % ring.world_size, record, "broadcast",
                                        "broadcast", step, 0))
            mask >>= 1
        for request in sends:
            request.wait()
    return tensor


def naive_all_reduce(tensor: torch.Tensor, op: object = "sum", group: dist.ProcessGroup | None = None,
                     record: list | None = None) -> torch.Tensor:
    """All-reduce through one server (group rank 0): everyone sends it their tensor, it adds them up and sends
    the result back.  In place; returns ``tensor``.

    The parameter-server pattern, here for contrast with the ring: the root receives and sends ``(N-1) * n``
    bytes and holds ``(N-1) * n`` bytes of receive buffers, while every other rank sends only ``n``.  The root's
    link is the bottleneck, so the time grows linearly with N.
    """
    _check_tensor(tensor, record)
    average = _average(op, tensor)
    ring = _ring_of(group)
    with _flat_in_place(tensor) as flat:
        if ring.world_size > 1 and flat.numel() > 0:
            if ring.rank == 0:
                buffers = torch.empty(ring.world_size - 1, flat.numel(), dtype=flat.dtype, device=flat.device)
                receives = [ring.irecv(buffers[peer - 1], peer) for peer in range(1, ring.world_size)]
                for request, received in zip(receives, buffers, strict=True):
                    request.wait()
                    flat.add_(received)
                if average:
                    flat.div_(ring.world_size)
                sends = [ring.isend(flat, peer, record, "naive_all_reduce", "broadcast", 1, 0)
                         for peer in range(1, ring.world_size)]
                for request in sends:
                    request.wait()
            else:
                ring.isend(flat, 0, record, "naive_all_reduce", "gather", 0, 0).wait()
                ring.irecv(flat, 0).wait()
        elif average:
            flat.div_(ring.world_size)
    return tensor


def tree_all_reduce(tensor: torch.Tensor, op: object = "sum", group: dist.ProcessGroup | None = None,
                    record: list | None = None) -> torch.Tensor:
    """All-reduce over a binomial tree: reduce up to group rank 0, then :func:`broadcast` back down.  In place;
    returns ``tensor``.

    In reduce round ``k`` (``mask = 2^k``) every rank whose relative number has bit ``k`` set sends its partial
    sum to the rank ``mask`` below and drops out; the receivers add.  ``ceil(log2 N)`` rounds up, as many down:
    time ``2 ceil(log2 N) (alpha + n beta)``.  Fewer, larger steps than the ring's ``2 (N-1)``: the tree wins when
    alpha dominates (small messages, many ranks), the ring when bandwidth does — which is why NCCL uses both.
    """
    _check_tensor(tensor, record)
    average = _average(op, tensor)
    ring = _ring_of(group)
    with _flat_in_place(tensor) as flat:
        if ring.world_size > 1 and flat.numel() > 0:
            incoming = torch.empty_like(flat)
            mask, step = 1, 0
            while mask < ring.world_size:
                if ring.rank & mask:  # send my partial sum down the tree, and I am done with this phase
                    ring.isend(flat, ring.rank - mask, record, "tree_all_reduce", "reduce", step, 0).wait()
                    break
                if ring.rank + mask < ring.world_size:
                    ring.irecv(incoming, ring.rank + mask).wait()
                    flat.add_(incoming)
                mask, step = mask << 1, step + 1
            if average and ring.rank == 0:
                flat.div_(ring.world_size)
            broadcast(flat, src=0, group=group, record=record)
        elif average:
            flat.div_(ring.world_size)
    return tensor
