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

**Pipelining.**  A step cannot start forwarding chunk ``c`` until it has arrived and been added.  Cutting each
chunk into *segments* lets a rank forward segment ``j`` while segment ``j+1`` is still arriving, so adding and
moving overlap; the price is ``alpha`` per segment.  Sends and receives are non-blocking (``isend``/``irecv``):
if every rank called a blocking ``send`` first, each would wait for a ``recv`` that nobody had posted yet.

Reduce-scatter needs somewhere to receive before adding: ``RECEIVE_SLOTS`` segment-sized slots, reused
round-robin and kept between calls (fresh pages from the kernel each call cost a few percent at 16 MiB).
All-gather receives straight into place.  Under NCCL ``wait()`` orders CUDA streams instead of blocking; the
code is written to stay correct there, but it is tested and tuned on gloo.

**Broadcast** here is a *binomial tree* (MPICH's): in round ``k`` every rank that already has the data sends it
to the rank ``2^(R-1-k)`` places further on, so the number of holders doubles every round and ``R = ceil(log2
N)`` rounds suffice: time ``R (alpha + n beta)``.  The root sends ``R * n`` bytes, a leaf nothing.  That is the
right choice for latency-bound (small) messages; for large ones a pipelined chain or scatter + all-gather gets
close to ``n beta``, as the ring does for all-reduce.

Results use the default process group or the one passed as ``group``; ranks in records are ranks *in that
group* (positions on the ring).  Sums are computed in the tensor's dtype, as gloo and NCCL do.  Pass a list as
``record`` to get one plain dict per message sent (who sent which chunk to whom at which step, and how many
bytes), which is what the notebook animates and what the tests compare with the cost model below.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from labkit.dist import device as rank_device

# A segment is the unit of pipelining.  Small segments start forwarding sooner; large ones pay the
# per-message cost (alpha, plus ~20 us of Python per isend/irecv) less often and hold bigger receive slots.
# By default each chunk is cut into SEGMENTS_PER_CHUNK pieces, kept between the two bounds below.  On gloo over
# loopback (benchmarks/bench_collectives.py) 4 MiB segments used the least CPU on 64 MiB messages; the speed
# differences between 1, 2 and 4 MiB were within that machine's run-to-run noise (about 20%).
SEGMENTS_PER_CHUNK = 4
MIN_SEGMENT_BYTES = 1 << 20
MAX_SEGMENT_BYTES = 4 << 20
# Receives posted ahead in reduce-scatter (each needs a segment-sized buffer): enough slack for the left
# neighbour to keep streaming while this rank adds.
RECEIVE_SLOTS = 4

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
                           "chunk": chunk, "segment": segment, "bytes": tensor.numel() * tensor.element_size()})
        return dist.isend(tensor, self._global(dst), group=self.group)

    def irecv(self, tensor: torch.Tensor, src: int) -> dist.Work:
        return dist.irecv(tensor, self._global(src), group=self.group)

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)


def _ring_of(group: dist.ProcessGroup | None) -> _Ring:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("no process group is initialised: run this inside labkit.launch.launch(fn, nprocs=N) "
                           "or call torch.distributed.init_process_group first")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of group {group!r}")
    return _Ring(group, rank, dist.get_world_size(group))


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


def chunk_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each rank's chunk of ``numel`` elements: contiguous, in rank order, sizes differing
    by at most one — the first ``numel % world_size`` chunks take one extra element.  Chunks may be empty."""
    if numel < 0 or world_size < 1:
        raise ValueError(f"need numel >= 0 and world_size >= 1, got numel={numel}, world_size={world_size}")
    base, extra = divmod(numel, world_size)
    starts = [rank * base + min(rank, extra) for rank in range(world_size + 1)]
    return [(starts[rank], starts[rank + 1]) for rank in range(world_size)]


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


def _segment_elements(tensor: torch.Tensor, segment_bytes: int | None, world_size: int) -> int:
    """Elements per pipelined segment: ``segment_bytes`` when given, else a quarter of a chunk within bounds."""
    if segment_bytes is None:
        chunk_bytes = -(-tensor.numel() // world_size) * tensor.element_size()
        segment_bytes = min(MAX_SEGMENT_BYTES, max(MIN_SEGMENT_BYTES, chunk_bytes // SEGMENTS_PER_CHUNK))
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
    (at most 16 MiB, kept for the next call).  ``segment_bytes=None`` picks the pipelining segment per message.
    """
    _check_tensor(tensor, record)
    average = _average(op, tensor)
    ring = _ring_of(group)
    with _flat_in_place(tensor) as flat:
        _reduce_scatter_flat(flat, ring, average, record, _segment_elements(tensor, segment_bytes, ring.world_size))
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
        _all_gather_flat(flat, ring, record, _segment_elements(tensor, segment_bytes, ring.world_size))
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
    segment_elements = _segment_elements(tensor, segment_bytes, ring.world_size)
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


# --------------------------------------------------------------------------------------------------------
# The alpha-beta cost model


@dataclass(frozen=True)
class LinkModel:
    """One link: a message of ``m`` bytes takes ``alpha_s + m * beta_s_per_byte`` seconds.

    The defaults (20 us, 1 GB/s) are only a plausible start; :func:`measure_alpha_beta` fits the real ones."""

    alpha_s: float = 20e-6
    beta_s_per_byte: float = 1 / 1e9

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return 1.0 / self.beta_s_per_byte


@dataclass(frozen=True)
class CollectiveCost:
    """What a collective costs: predicted seconds, message rounds, and bytes sent by each rank (index = rank)."""

    time_s: float
    steps: int
    bytes_sent: list[int]


def _chunk_bytes(nbytes: int, world_size: int, element_size: int) -> list[int]:
    if nbytes % element_size:
        raise ValueError(f"nbytes={nbytes} is not a whole number of {element_size}-byte elements")
    return [(stop - start) * element_size for start, stop in chunk_bounds(nbytes // element_size, world_size)]


def ring_reduce_scatter_cost(nbytes: int, world_size: int, link: LinkModel = LinkModel(),
                             element_size: int = 4) -> CollectiveCost:
    """Ring reduce-scatter of an ``nbytes`` tensor: ``N-1`` steps of one chunk each, ``(N-1)/N * n`` bytes per
    rank, time ``(N-1) (alpha + n/N beta)``.  Exactly: rank ``r`` sends every chunk but its own."""
    chunks = _chunk_bytes(nbytes, world_size, element_size)
    sent = [nbytes - chunks[rank] for rank in range(world_size)] if world_size > 1 else [0]
    steps = world_size - 1
    return CollectiveCost(steps * (link.alpha_s + max(chunks) * link.beta_s_per_byte), steps, sent)


def ring_all_gather_cost(nbytes: int, world_size: int, link: LinkModel = LinkModel(),
                         element_size: int = 4) -> CollectiveCost:
    """Ring all-gather into an ``nbytes`` tensor: ``N-1`` steps, ``(N-1)/N * n`` bytes per rank, time
    ``(N-1) (alpha + n/N beta)``.  Exactly: rank ``r`` sends every chunk but its right neighbour's."""
    chunks = _chunk_bytes(nbytes, world_size, element_size)
    sent = [nbytes - chunks[(rank + 1) % world_size] for rank in range(world_size)] if world_size > 1 else [0]
    steps = world_size - 1
    return CollectiveCost(steps * (link.alpha_s + max(chunks) * link.beta_s_per_byte), steps, sent)


def ring_all_reduce_cost(nbytes: int, world_size: int, link: LinkModel = LinkModel(),
                         element_size: int = 4) -> CollectiveCost:
    """Ring all-reduce: reduce-scatter then all-gather.  ``2 (N-1)`` steps, ``2 (N-1)/N * n`` bytes per rank,
    time ``2 (N-1) alpha + 2 (N-1)/N * n beta`` — the bandwidth term tends to ``2 n beta``, independent of N.

    ``bytes_sent`` is exact, uneven splits included (chunks are whole ``element_size``-byte elements); the time
    counts each step at the largest chunk and leaves out the time spent adding."""
    scatter = ring_reduce_scatter_cost(nbytes, world_size, link, element_size)
    gather = ring_all_gather_cost(nbytes, world_size, link, element_size)
    return CollectiveCost(scatter.time_s + gather.time_s, scatter.steps + gather.steps,
                          [a + b for a, b in zip(scatter.bytes_sent, gather.bytes_sent, strict=True)])


def naive_all_reduce_cost(nbytes: int, world_size: int, link: LinkModel = LinkModel()) -> CollectiveCost:
    """Parameter server: the root receives ``(N-1) n`` and sends ``(N-1) n`` bytes, every other rank sends ``n``.
    Its one link serialises ``2 (N-1)`` messages: time ``2 (N-1) (alpha + n beta)``, linear in N."""
    if world_size == 1 or nbytes == 0:
        return CollectiveCost(0.0, 0, [0] * world_size)
    sent = [(world_size - 1) * nbytes] + [nbytes] * (world_size - 1)
    steps = 2 * (world_size - 1)
    return CollectiveCost(steps * (link.alpha_s + nbytes * link.beta_s_per_byte), steps, sent)


def tree_broadcast_cost(nbytes: int, world_size: int, link: LinkModel = LinkModel(), src: int = 0) -> CollectiveCost:
    """Binomial-tree broadcast: ``R = ceil(log2 N)`` rounds of the whole message, time ``R (alpha + n beta)``.

    Counting ranks from the root, in round ``k`` the holders are the multiples of ``2d`` with ``d = 2^(R-1-k)``
    and each sends one copy ``d`` places on (if that rank exists): the root sends ``R n`` bytes, half the ranks
    send nothing, and ``(N-1) n`` bytes move in all."""
    rounds = math.ceil(math.log2(world_size)) if world_size > 1 else 0
    sent = [0] * world_size
    for round_number in range(rounds):
        distance = 1 << (rounds - 1 - round_number)
        for relative in range(0, world_size, 2 * distance):
            if relative + distance < world_size and nbytes > 0:
                sent[(relative + src) % world_size] += nbytes
    return CollectiveCost(rounds * (link.alpha_s + nbytes * link.beta_s_per_byte) if nbytes else 0.0, rounds, sent)


def tree_all_reduce_cost(nbytes: int, world_size: int, link: LinkModel = LinkModel()) -> CollectiveCost:
    """Binomial-tree all-reduce: reduce to rank 0 (every other rank sends ``n`` once), then a tree broadcast.
    ``2 ceil(log2 N)`` rounds of the whole message: time ``2 ceil(log2 N) (alpha + n beta)``."""
    down = tree_broadcast_cost(nbytes, world_size, link, src=0)
    up = [nbytes if rank > 0 and nbytes > 0 else 0 for rank in range(world_size)]
    return CollectiveCost(2 * down.time_s, 2 * down.steps, [a + b for a, b in zip(up, down.bytes_sent, strict=True)])


_BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def bus_bandwidth(nbytes: int, seconds: float, world_size: int, collective: str = "all_reduce") -> float:
    """Bus bandwidth in bytes/s, NCCL-tests' convention: ``algbw = nbytes / seconds`` times a factor that makes
    a bandwidth-optimal algorithm's number equal the link speed (all-reduce ``2 (N-1)/N``, reduce-scatter and
    all-gather ``(N-1)/N`` with ``nbytes`` the full tensor, broadcast 1)."""
    if collective not in _BUS_FACTORS:
        raise ValueError(f"collective must be one of {sorted(_BUS_FACTORS)}, got {collective!r}")
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds!r}")
    return nbytes / seconds * _BUS_FACTORS[collective](world_size)


def measure_alpha_beta(sizes: tuple[int, ...] = (8, 1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22),
                       iterations: int = 10, group: dist.ProcessGroup | None = None,
                       pattern: str = "ring") -> LinkModel:
    """Fit the alpha-beta model to timed messages (call it on every rank; every rank returns the same fit).

    ``pattern="ring"`` times one *ring step*: every rank sends ``m`` bytes to its right neighbour while
    receiving ``m`` from its left, all at once — the links used the way the ring algorithms use them.
    ``pattern="ping-pong"`` times ranks 0 and 1 alone, bouncing a message back and forth (half a round trip
    per message), as latency benchmarks do.  On dedicated links (NVLink, InfiniBand) the two agree; on one
    machine's CPUs (gloo over loopback) all ranks share the same cores and memory, so the ring's beta is larger
    and is the one that predicts a ring collective.

    ``alpha`` and ``beta`` come from :func:`fit_alpha_beta` on the median times; rank 0's fit is broadcast.
    """
    ring = _ring_of(group)
    if pattern not in ("ring", "ping-pong"):
        raise ValueError(f"pattern must be 'ring' or 'ping-pong', got {pattern!r}")
    if ring.world_size < 2:
        raise ValueError("measure_alpha_beta needs at least 2 ranks to send messages between")
    fit = torch.zeros(2, dtype=torch.float64, device=rank_device())
    right, left = (ring.rank + 1) % ring.world_size, (ring.rank - 1) % ring.world_size
    if pattern == "ring" or ring.rank in (0, 1):
        times = []
        for nbytes in sizes:
            outgoing = torch.zeros(nbytes, dtype=torch.uint8, device=fit.device)
            incoming = torch.empty_like(outgoing)
            samples = []
            for _ in range(iterations + 1):  # the first is a warm-up
                begin = time.perf_counter()
                if pattern == "ring":
                    receive = ring.irecv(incoming, left)
                    ring.isend(outgoing, right, None, "", "", 0, 0).wait()
                    receive.wait()
                elif ring.rank == 0:
                    ring.isend(outgoing, 1, None, "", "", 0, 0).wait()
                    ring.irecv(incoming, 1).wait()
                else:
                    ring.irecv(incoming, 0).wait()
                    ring.isend(outgoing, 0, None, "", "", 0, 0).wait()
                if outgoing.is_cuda:  # under NCCL, wait() only orders streams; the clock needs the GPU done
                    torch.cuda.synchronize(outgoing.device)
                samples.append((time.perf_counter() - begin) / (1 if pattern == "ring" else 2))
            times.append(statistics.median(samples[1:]))
        if ring.rank == 0:
            link = fit_alpha_beta(sizes, times)
            fit = torch.tensor([link.alpha_s, link.beta_s_per_byte], dtype=torch.float64, device=fit.device)
    broadcast(fit, src=0, group=group)
    return LinkModel(alpha_s=float(fit[0]), beta_s_per_byte=float(fit[1]))


def fit_alpha_beta(sizes: list[int] | tuple[int, ...], seconds: list[float]) -> LinkModel:
    """The alpha-beta line through measured ``(message bytes, seconds)`` points.

    Least squares weighted by ``1/time``, so small messages (which pin down alpha) count as much as large
    ones (which pin down beta).  Noise can tilt the line: a negative alpha is clipped to 0, and if the slope
    comes out non-positive (the size dependence drowned in noise — a busy machine) the fit falls back to the
    two-point estimate ``alpha = fastest time``, ``beta = (largest message's time - alpha) / its size``.
    """
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError(f"need at least two (size, seconds) points of equal count, got {len(sizes)} and "
                         f"{len(seconds)}")
    times = torch.tensor(seconds, dtype=torch.float64)
    if not bool((times > 0).all()):
        raise ValueError(f"seconds must all be positive, got {list(seconds)}")
    weights = 1.0 / times
    design = torch.stack([torch.ones_like(times), torch.tensor(sizes, dtype=torch.float64)], dim=1)
    alpha, beta = torch.linalg.lstsq(design * weights[:, None], (times * weights)[:, None]).solution.flatten()
    alpha, beta = max(float(alpha), 0.0), float(beta)
    if beta <= 0:
        largest = max(range(len(sizes)), key=lambda index: sizes[index])
        alpha = float(times.min())
        beta = max(float(times[largest]) - alpha, float(times[largest]) * 1e-3) / max(sizes[largest], 1)
    return LinkModel(alpha_s=alpha, beta_s_per_byte=beta)


def time_collectives(algorithms: dict[str, Callable[[torch.Tensor], object]], sizes: list[int],
                     batches: int = 5, dtype: torch.dtype = torch.float32,
                     group: dist.ProcessGroup | None = None) -> dict[str, list[float]]:
    """Seconds per call of each collective at each message size, timed the way NCCL-tests does (call it on
    every rank of a launched job; every rank returns the same numbers).

    For each size, after a warm-up call, ``batches`` rounds run every algorithm in turn (so a burst of load from
    elsewhere hits all of them alike); each round is a barrier, then a batch of back-to-back calls (enough to
    move ~32 MiB, at least 2), divided by the number of calls.  A batch's time is its slowest rank's — a
    collective is done when the last rank is — and the result is the median over batches.  Tensors are zeros,
    so repeated sums never overflow.
    """
    timed: dict[str, list[float]] = {name: [] for name in algorithms}
    for nbytes in sizes:
        tensor = torch.zeros(nbytes // torch.tensor([], dtype=dtype).element_size(), dtype=dtype,
                             device=rank_device())
        calls = max(2, min(20, (32 << 20) // max(nbytes, 1)))
        for run in algorithms.values():  # warm-up: connections, buffers, page faults
            run(tensor)
        samples: dict[str, list[float]] = {name: [] for name in algorithms}
        for _ in range(batches):
            for name, run in algorithms.items():
                dist.barrier(group=group)
                begin = time.perf_counter()
                for _ in range(calls):
                    run(tensor)
                if tensor.is_cuda:
                    torch.cuda.synchronize(tensor.device)
                elapsed = torch.tensor([(time.perf_counter() - begin) / calls], dtype=torch.float64,
                                       device=tensor.device)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)  # the slowest rank's time
                samples[name].append(float(elapsed))
        for name in algorithms:
            timed[name].append(statistics.median(samples[name]))
    return timed
