"""What a collective costs in the alpha-beta model: seconds, message rounds and bytes sent by each rank.

Sending a message of ``m`` bytes over one link takes ``alpha + m * beta`` seconds: ``alpha`` is the latency
(start-up cost per message), ``beta`` the inverse bandwidth (seconds per byte).  The algorithms themselves, built
from send and recv, are in ``labkit.collectives``, whose docstring derives each formula below; the measurement
that fits ``alpha`` and ``beta`` on a real machine is ``labkit.measure.measure_alpha_beta``.  Everything here is
pure arithmetic: no process group, no tensors.

=====================  ==================  ===============================  ==========================
collective             message rounds      bytes each rank sends            time
=====================  ==================  ===============================  ==========================
ring reduce-scatter    ``N-1``             ``(N-1)/N n``                    ``(N-1)(alpha + n/N beta)``
ring all-gather        ``N-1``             ``(N-1)/N n``                    ``(N-1)(alpha + n/N beta)``
ring all-reduce        ``2(N-1)``          ``2(N-1)/N n``                   sum of the two
parameter server       ``2(N-1)``          root ``(N-1) n``, others ``n``   ``2(N-1)(alpha + n beta)``
tree broadcast         ``ceil(log2 N)``    root ``R n``, leaves 0           ``R (alpha + n beta)``
tree all-reduce        ``2 ceil(log2 N)``  up ``n``, then the broadcast     twice the broadcast
all-to-all             ``N-1`` messages    ``(N-1)/N n``                    ``(N-1)(alpha + n/N beta)``
=====================  ==================  ===============================  ==========================

Bytes on a link are what *leaves* a rank, each way (a full-duplex link carries as much the other way at the same
time): the third column, what the cost models of context and expert parallelism and their runtimes' logs count.
A collective's *size* ``n`` (an all-reduce's message, a reduce-scatter's or an all-to-all's input, an all-gather's
output) is its total, shown beside where a lesson needs it: the wrapper contract's ``communication_per_step``
counts it (:mod:`labkit.parallel.base`), and this table turns it into bytes on the link.  An all-to-all of a
rank's ``n`` bytes keeps ``n / N`` at home and sends the rest; on a cluster its messages to the ``k`` ranks of its
node (itself included) go over NVLink and the others through the GPU's own network adapter, both at once
(:func:`all_to_all_seconds`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def chunk_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each rank's chunk of ``numel`` elements: contiguous, in rank order, sizes differing
    by at most one — the first ``numel % world_size`` chunks take one extra element.  Chunks may be empty."""
    if numel < 0 or world_size < 1:
        raise ValueError(f"need numel >= 0 and world_size >= 1, got numel={numel}, world_size={world_size}")
    base, extra = divmod(numel, world_size)
    starts = [rank * base + min(rank, extra) for rank in range(world_size + 1)]
    return [(starts[rank], starts[rank + 1]) for rank in range(world_size)]


@dataclass(frozen=True)
class LinkModel:
    """One link: a message of ``m`` bytes takes ``alpha_s + m * beta_s_per_byte`` seconds.

    The defaults (20 us, 1 GB/s) are only a plausible start; :func:`labkit.measure.measure_alpha_beta` fits the real ones."""

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


def all_to_all_seconds(on_node: tuple[float, float], off_node: tuple[float, float], intra: LinkModel,
                       inter: LinkModel) -> float:
    """One rank's all-to-all from its ``(messages, bytes)`` to the ranks of its node and to other nodes: the first
    over ``intra`` (NVLink), the second over ``inter`` (one GPU's network adapter), each share's messages in turn
    (``m alpha + bytes beta``, the latency per message as for a ring step).  NCCL posts every peer's send and
    receive in one group, and NVLink and the adapter are separate paths out of the GPU, so the two shares run at
    the same time and the slower one sets the time: ``max(m_on alpha_on + b_on beta_on, m_off alpha_off + b_off
    beta_off)``.  (A sum would serialise two links that do not wait for each other; both shares read the same
    HBM, at ~3 TB/s on an H100, far above either link, so they do not slow each other either.)"""
    return max(on_node[0] * intra.alpha_s + on_node[1] * intra.beta_s_per_byte,
               off_node[0] * inter.alpha_s + off_node[1] * inter.beta_s_per_byte)


def all_to_all_cost(nbytes: int, world_size: int, link: LinkModel = LinkModel(), element_size: int = 4,
                    local: int | None = None, inter: LinkModel | None = None) -> CollectiveCost:
    """All-to-all of each rank's ``nbytes`` input cut into ``N`` chunks (:func:`chunk_bounds`), chunk ``j`` to rank
    ``j``: every rank sends all chunks but its own, ``(N-1)/N n`` bytes, one message to each other rank.  On one
    ``link``: ``(N-1) (alpha + n/N beta)``.  With ``local`` of the ``N`` ranks on this rank's node (itself
    included) and the others behind ``inter``: :func:`all_to_all_seconds` of ``local - 1`` chunks over ``link``
    and ``N - local`` over ``inter``."""
    chunks = _chunk_bytes(nbytes, world_size, element_size)
    sent = [nbytes - chunks[rank] for rank in range(world_size)] if world_size > 1 else [0]
    local, chunk = world_size if local is None else local, max(chunks)
    time = all_to_all_seconds((local - 1, (local - 1) * chunk), (world_size - local, (world_size - local) * chunk),
                              link, link if inter is None else inter)
    return CollectiveCost(time, world_size - 1, sent)


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


def fit_alpha_beta(sizes: list[int] | tuple[int, ...], seconds: Sequence[float | Sequence[float]],
                   max_bandwidth_bytes_per_s: float | None = None) -> LinkModel:
    """The alpha-beta line through measured ``(message bytes, seconds)`` points.

    ``seconds[i]`` is the time at ``sizes[i]``: one number, or repeated samples of it, of which the median is
    fitted (a sample slowed by a burst of load elsewhere moves a median little and a mean a lot).  Least squares
    weighted by ``1/time``, so small messages (which pin down alpha) count as much as large ones (which pin down
    beta).  A negative alpha is no latency: it is clipped to 0.

    Noise can flatten the line: when the size dependence drowns in it (a busy machine), the slope comes out
    near zero or below, and ``1/beta`` reads as an absurd bandwidth.  ``max_bandwidth_bytes_per_s`` is the
    ceiling no link can pass (:func:`labkit.calibrate.calibrate` gives the rate at which one thread copies a
    message as large as the largest here: a loopback send copies each byte at least twice); given one, a fit
    above it, or a slope of zero or less, raises ``ValueError`` naming the times and the fit.  Without one, a
    non-positive slope falls back to the two-point estimate ``alpha = fastest time``, ``beta = (largest
    message's time - alpha) / its size`` (at least a thousandth of its time), which benchmarks print as a
    rough figure.
    """
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError(f"need at least two (size, seconds) points of equal count, got {len(sizes)} and "
                         f"{len(seconds)}")
    medians = [float(statistics.median(value)) if isinstance(value, Sequence) else float(value) for value in seconds]
    times = torch.tensor(medians, dtype=torch.float64)
    if not bool((times > 0).all()):
        raise ValueError(f"seconds must all be positive, got {list(seconds)}")
    weights = 1.0 / times
    design = torch.stack([torch.ones_like(times), torch.tensor(sizes, dtype=torch.float64)], dim=1)
    alpha, beta = (float(value) for value in torch.linalg.lstsq(
        design * weights[:, None], (times * weights)[:, None]).solution.flatten())
    measured = ", ".join(f"{size:,} B {1e6 * time:.1f} us" for size, time in zip(sizes, medians, strict=True))
    if max_bandwidth_bytes_per_s is not None:
        if beta <= 0:
            raise ValueError(f"the link's times do not grow with the message size ({measured}; fitted slope "
                             f"{beta:.3g} s/B): the size dependence drowned in noise, so no bandwidth can be read "
                             "from them; measure again on a quieter machine")
        if 1 / beta > max_bandwidth_bytes_per_s:
            raise ValueError(f"a link fitted at {1 / beta / 1e9:.1f} GB/s (alpha {1e6 * alpha:.1f} us, beta "
                             f"{beta:.3g} s/B, from {measured}) is above {max_bandwidth_bytes_per_s / 1e9:.1f} GB/s, the "
                             "fastest this machine copies such a message, which a loopback send (each byte "
                             "copied at least twice) cannot beat: the slope is noise, not a link; measure again "
                             "on a quieter machine")
    elif beta <= 0:
        largest = max(range(len(sizes)), key=lambda index: sizes[index])
        alpha = float(times.min())
        beta = max(float(times[largest]) - alpha, float(times[largest]) * 1e-3) / max(sizes[largest], 1)
    return LinkModel(alpha_s=max(alpha, 0.0), beta_s_per_byte=beta)
