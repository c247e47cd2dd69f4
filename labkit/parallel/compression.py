"""Gradient compression for data parallelism: send fewer bytes per step, pay with accuracy or compute.

A data-parallel step all-reduces the whole gradient: ``n`` bytes per rank enter a ring all-reduce, which puts
``2 (N-1)/N * n`` bytes on every rank's link (``labkit.collectives``).  When the network, not the arithmetic,
sets the step time, sending fewer bytes is the remaining lever.  Three families, in increasing ambition:

**Low-precision casting** (:class:`FP16Compression`, :class:`BF16Compression`; PyTorch's
``fp16_compress_hook`` and ``bf16_compress_hook``).  Cast the bucket to 16 bits, all-reduce, cast back.
Compression ratio ``element_size / 2``: 2x for float32 gradients.  The sum is taken in 16 bits, so each
element carries a relative rounding error of about ``2^-11`` (fp16, 10 mantissa bits) or ``2^-8`` (bf16, 7
bits) per addition.  The bucket is divided by ``N`` *before* the cast: the mean of N gradients fits fp16's
range (max 65504) when their sum may not.  bf16 has float32's range but a coarser mantissa.

**Top-k sparsification with error feedback** (:class:`TopKCompression`; Strom 2015, Aji & Heafield 2017,
Lin et al. 2018 "Deep Gradient Compression", Stich et al. 2018 "Sparsified SGD with memory").  Each rank adds
its *residual* (what it did not send before) to the gradient, keeps the ``k = ceil(fraction * n)`` entries
with the largest magnitude, and keeps everything else as the residual for the next step.  Nothing is thrown
away, only delayed: summed over steps, sent + final residual = the true gradients.  The ranks' selections
differ, so the sparse vectors cannot be summed in place by an all-reduce; they are *all-gathered* (values and
``int32`` indices) and added up locally.  Each rank contributes ``k * (element_size + 4)`` bytes instead of
``n * element_size``: ratio ``element_size / (fraction * (element_size + 4))``, 50x for float32 at
``fraction=0.01``.  But an all-gather delivers every rank's ``k`` entries to every rank, so the bytes
*received* grow with N, ``(N-1) * k * (element_size + 4)``, where a ring all-reduce stays below ``2n``: top-k
pays off only while ``fraction`` is well below ``1/N``.  The selection itself (a top-k over the bucket) costs
compute that a fast network may not repay.

**PowerSGD** (:class:`PowerSGDCompression`; Vogels, Karimireddy & Jaggi, NeurIPS 2019; PyTorch's
``powerSGD_hook``).  View each gradient tensor as a matrix ``M`` (``n x m``: first dimension by the rest) and
send a rank-``r`` approximation found by one step of power iteration, with summable factors::

    M = gradient + error           (error feedback, per rank)
    P = M Q;    all-reduce P       (n x r; every rank uses the same Q, so the mean of M Q is (mean M) Q)
    P = orthonormalise(P)
    Q = M^T P;  all-reduce Q       (m x r)
    M ~ P Q^T;  error = M - P Q^T  (what the approximation missed waits for the next step)

``Q`` is kept for the next step (*warm start*): successive gradients are similar, so one power-iteration step
per training step tracks the leading subspace.  A matrix costs ``(n + m) * r`` elements instead of ``n * m``:
ratio ``n m / ((n + m) r)``, ~256x for a 1024 x 1024 weight at ``r=2``.  Both messages are all-reduces, so
unlike top-k the cost does not grow with N.  1-D tensors (biases, norms) and matrices that would shrink by
less than ``min_compression_rate`` are all-reduced uncompressed, batched into one message.  If the mean
gradient has rank ``<= r``, the approximation is exact (up to rounding).  PyTorch also runs plain all-reduce
for the first ``start_powerSGD_iter`` steps; here compression starts at once.

**The protocol** ``labkit.parallel.ddp.DistributedDataParallel`` uses, and that all three implement::

    handle = compression.launch(key, flat, views, group, count=None)  # compress, start the communication
    compression.complete(handle)                                      # wait, decompress: flat holds the *mean*

``key`` is the bucket's index (it names the state kept between steps: residuals, errors, warm-start Qs, so use
one compression object per model); ``flat`` is the bucket's contiguous gradient buffer and ``views`` are its
per-parameter slices in the parameters' shapes (PowerSGD needs the matrices; the others ignore them).
``launch`` must start communication in the same order on every rank; ``complete`` is called in bucket order.
``count``, when given, is called as ``count(kind, tensor)`` for every tensor that enters a collective (``kind``:
``"all_reduce"`` or ``"all_gather"``), measured as ``labkit.parallel.base`` measures a collective's size (an
all-gather by its output, ``N`` contributions); DDP passes its byte counter, so that its
``communication_per_step()`` shows what the compressor really sent, by collective.

Every compression counts ``bytes_sent`` (bytes this rank put into collectives: the message size ``n`` of the
alpha-beta model, before the algorithm's own ``2(N-1)/N`` or ``N-1`` factor) and ``bytes_uncompressed`` (what
a plain all-reduce of the same buckets would have put in), cumulatively; ``compression_ratio`` divides them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from labkit import trace

CountBytes = Callable[[str, torch.Tensor], None]  # count(kind, tensor): tensor enters a collective of kind


class GradientCompression(Protocol):
    bytes_sent: int
    bytes_uncompressed: int

    def launch(self, key: int, flat: torch.Tensor, views: list[torch.Tensor],
               group: dist.ProcessGroup | None, count: CountBytes | None = None) -> Any: ...

    def complete(self, handle: Any) -> None: ...


class _ByteCounter:
    """Cumulative bytes put into collectives, and what plain all-reduce would have put in."""

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.bytes_uncompressed = 0

    @property
    def compression_ratio(self) -> float:
        return self.bytes_uncompressed / self.bytes_sent if self.bytes_sent else float("nan")

    def reset_counters(self) -> None:
        self.bytes_sent = 0
        self.bytes_uncompressed = 0

    def _count(self, sent: int, flat: torch.Tensor) -> None:
        self.bytes_sent += sent
        self.bytes_uncompressed += flat.numel() * flat.element_size()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _tell(count: CountBytes | None, kind: str, *tensors: torch.Tensor) -> None:
    if count is not None:
        for tensor in tensors:
            count(kind, tensor)


# --------------------------------------------------------------------------------------------------------
# fp16 / bf16


class CastCompression(_ByteCounter):
    """All-reduce the bucket in a 16-bit ``dtype``: ratio ``element_size / 2`` (2x for float32)."""

    def __init__(self, dtype: torch.dtype = torch.float16):
        super().__init__()
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype!r}")
        self.dtype = dtype

    def launch(self, key: int, flat: torch.Tensor, views: list[torch.Tensor],
               group: dist.ProcessGroup | None, count: CountBytes | None = None) -> Any:
        low = flat.div(dist.get_world_size(group)).to(self.dtype)  # divide first: the mean cannot overflow
        work = dist.all_reduce(low, group=group, async_op=True)
        trace.record_async(work, f"all-reduce bucket {key} ({str(self.dtype).removeprefix('torch.')})")
        self._count(_nbytes(low), flat)
        _tell(count, "all_reduce", low)
        return flat, low, work

    def complete(self, handle: Any) -> None:
        flat, low, work = handle
        work.wait()
        flat.copy_(low)


class FP16Compression(CastCompression):
    def __init__(self) -> None:
        super().__init__(torch.float16)


class BF16Compression(CastCompression):
    def __init__(self) -> None:
        super().__init__(torch.bfloat16)


# --------------------------------------------------------------------------------------------------------
# Top-k with error feedback


class TopKCompression(_ByteCounter):
    """Send the ``k = ceil(fraction * n)`` largest ``|gradient + residual|`` entries of each bucket; keep the
    rest as the residual.  Each rank contributes ``k * (element_size + 4)`` bytes (values and int32 indices)
    to an all-gather, instead of ``n * element_size`` to an all-reduce.

    The selection is over the whole bucket ("global" top-k within a bucket), so a layer whose gradients are
    small may send nothing for a while; its entries grow in the residual until they are picked.
    """

    def __init__(self, fraction: float = 0.01):
        super().__init__()
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"fraction must be a number in (0, 1] (the share of entries sent), "
                             f"got {fraction!r}")
        self.fraction = float(fraction)
        self.residuals: dict[int, torch.Tensor] = {}  # bucket key -> what this rank has not sent yet

    def k_of(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(self.fraction * numel)))

    def launch(self, key: int, flat: torch.Tensor, views: list[torch.Tensor],
               group: dist.ProcessGroup | None, count: CountBytes | None = None) -> Any:
        corrected = flat + self.residuals[key] if key in self.residuals else flat.clone()
        indices = corrected.abs().topk(self.k_of(flat.numel()), sorted=False).indices
        values = corrected[indices]
        corrected[indices] = 0
        self.residuals[key] = corrected  # error feedback: the unsent mass joins the next step's gradient
        indices = indices.to(torch.int32)
        world_size = dist.get_world_size(group)
        all_values = [torch.empty_like(values) for _ in range(world_size)]
        all_indices = [torch.empty_like(indices) for _ in range(world_size)]
        works = [dist.all_gather(all_values, values, group=group, async_op=True),
                 dist.all_gather(all_indices, indices, group=group, async_op=True)]
        for work in works:
            trace.record_async(work, f"all-gather bucket {key} (top-k)")
        self._count(_nbytes(values) + _nbytes(indices), flat)
        _tell(count, "all_gather", *all_values, *all_indices)
        return flat, all_values, all_indices, works

    def complete(self, handle: Any) -> None:
        flat, all_values, all_indices, works = handle
        for work in works:
            work.wait()
        flat.zero_()
        for values, indices in zip(all_values, all_indices, strict=True):
            flat.index_add_(0, indices, values)  # ranks may pick the same index: add, do not overwrite
        flat.div_(len(all_values))


# --------------------------------------------------------------------------------------------------------
# PowerSGD


class PowerSGDCompression(_ByteCounter):
    """Rank-``rank`` PowerSGD with error feedback and warm start (Vogels et al. 2019).

    A tensor viewed as an ``n x m`` matrix is compressed when ``n m >= min_compression_rate * (n + m) r``
    (``r = min(rank, n, m)``) and then costs ``(n + m) r`` elements in two all-reduces (P, then Q); other
    tensors cost ``numel`` elements in one more all-reduce.  ``seed`` makes the first ``Q`` identical on every
    rank, which the method needs (each rank computes its own ``M Q``, and only a shared ``Q`` makes their mean
    equal ``(mean M) Q``).

    Only the P all-reduce overlaps the backward pass: orthonormalising P needs its result, so the Q round
    runs in ``complete``, at the end of backward.  (PyTorch chains it with a future callback instead;
    launching collectives from callback threads needs care to keep every rank's order the same.)
    """

    def __init__(self, rank: int = 1, min_compression_rate: float = 2.0, seed: int = 0):
        super().__init__()
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be an integer >= 1 (the approximation's rank), got {rank!r}")
        if isinstance(min_compression_rate, bool) or not isinstance(min_compression_rate, (int, float)) \
                or min_compression_rate < 1:
            raise ValueError(f"min_compression_rate must be a number >= 1, got {min_compression_rate!r}")
        self.rank = rank
        self.min_compression_rate = float(min_compression_rate)
        self.seed = seed
        self.errors: dict[tuple[int, int], torch.Tensor] = {}  # (bucket, tensor) -> error feedback
        self.qs: dict[tuple[int, int], torch.Tensor] = {}  # (bucket, tensor) -> Q for the warm start

    def matrix_shape(self, tensor: torch.Tensor) -> tuple[int, int, int] | None:
        """``(n, m, r)`` when ``tensor`` is worth compressing, else ``None``."""
        if tensor.dim() < 2 or tensor.numel() == 0:
            return None
        n = tensor.shape[0]
        m = tensor.numel() // n
        r = min(self.rank, n, m)
        return (n, m, r) if n * m >= self.min_compression_rate * (n + m) * r else None

    def launch(self, key: int, flat: torch.Tensor, views: list[torch.Tensor],
               group: dist.ProcessGroup | None, count: CountBytes | None = None) -> Any:
        matrices, others = [], []
        for position, view in enumerate(views):
            shape = self.matrix_shape(view)
            if shape is None:
                others.append(view)
                continue
            n, m, r = shape
            matrix = view.reshape(n, m)  # a view into the bucket: the result is written back through it
            if (key, position) in self.errors:
                matrix.add_(self.errors[key, position])  # M = gradient + error
            if (key, position) not in self.qs:
                generator = torch.Generator().manual_seed(self.seed + 1_000_003 * key + position)
                q = torch.randn(m, r, generator=generator, dtype=flat.dtype)
                self.qs[key, position] = q.to(flat.device)
            matrices.append((position, matrix, r))
        p_flat = flat.new_empty(sum(matrix.shape[0] * r for _, matrix, r in matrices))
        ps, offset = [], 0
        for position, matrix, r in matrices:
            p = p_flat[offset:offset + matrix.shape[0] * r].view(matrix.shape[0], r)
            torch.matmul(matrix, self.qs[key, position], out=p)
            ps.append(p)
            offset += p.numel()
        rest = torch.cat([view.reshape(-1) for view in others]) if others else flat.new_empty(0)
        works = [dist.all_reduce(p_flat, group=group, async_op=True),
                 dist.all_reduce(rest, group=group, async_op=True)]
        trace.record_async(works[0], f"all-reduce P bucket {key} (PowerSGD)")
        trace.record_async(works[1], f"all-reduce bucket {key} (uncompressed part)")
        q_elements = sum(matrix.shape[1] * r for _, matrix, r in matrices)
        self._count((p_flat.numel() + q_elements + rest.numel()) * flat.element_size(), flat)
        _tell(count, "all_reduce", p_flat, rest)
        return key, group, matrices, ps, p_flat, others, rest, works, count

    def complete(self, handle: Any) -> None:
        key, group, matrices, ps, p_flat, others, rest, works, count = handle
        world_size = dist.get_world_size(group)
        works[0].wait()
        for p in ps:
            p.copy_(torch.linalg.qr(p).Q)  # orthonormal columns spanning the mean M Q (ranks agree: same P)
        q_flat = p_flat.new_empty(sum(matrix.shape[1] * r for _, matrix, r in matrices))
        qs, offset = [], 0
        for (_position, matrix, r), p in zip(matrices, ps, strict=True):
            q = q_flat[offset:offset + matrix.shape[1] * r].view(matrix.shape[1], r)
            torch.matmul(matrix.t(), p, out=q)  # Q = M^T P: summed over ranks, (sum M)^T P
            qs.append(q)
            offset += q.numel()
        _tell(count, "all_reduce", q_flat)
        with trace.span(f"all-reduce Q bucket {key} (PowerSGD)", "comm"):
            dist.all_reduce(q_flat, group=group)
        q_flat.div_(world_size)
        for (position, matrix, _r), p, q in zip(matrices, ps, qs, strict=True):
            approximation = p @ q.t()
            self.errors[key, position] = matrix - approximation  # this rank's M minus what everyone applies
            matrix.copy_(approximation)
            self.qs[key, position] = q.clone()  # warm start
        works[1].wait()
        rest.div_(world_size)
        offset = 0
        for view in others:
            view.copy_(rest[offset:offset + view.numel()].view_as(view))
            offset += view.numel()
