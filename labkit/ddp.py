"""DistributedDataParallel from scratch: broadcast, gradient hooks, buckets, overlap, ``no_sync``.

**Data parallelism.**  Every rank holds a full replica of the model and takes a different slice of the global
batch.  After the backward pass each rank's gradient is replaced by the mean over ranks (an *all-reduce*), so
every replica takes the same optimizer step and the replicas never drift apart.  For a loss that is a mean
over examples and slices of equal size, the mean of the ranks' gradients *is* the gradient of the whole batch:
N ranks with batch B train exactly like one process with batch N*B (up to floating-point rounding).  What does
not carry over is anything computed *across* a batch inside the model: BatchNorm normalises each rank's slice
with that slice's statistics (``torch.nn.SyncBatchNorm`` all-reduces them instead).

**Cost.**  A model with ``Psi`` trainable parameters of ``b`` bytes all-reduces ``n = Psi * b`` bytes per step
(``bytes_per_step``); a ring all-reduce puts ``2 (N-1)/N * n`` bytes on each rank's link in ``2 (N-1)``
messages (``labkit.collectives``).  Memory: one extra gradient-sized buffer (the buckets below).

**Buckets** (Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020).
One all-reduce per parameter pays the per-message latency ``alpha`` once per tensor (a transformer has
hundreds); one all-reduce of everything pays it once but cannot start before the whole backward pass has
finished.  Gradients are therefore packed into buckets of at most ``bucket_cap_mb`` MiB (a single larger
parameter gets a bucket of its own; ``bucket_cap_mb=0`` gives one bucket per parameter).  Gradients become
ready roughly in *reverse* order of registration (the last layer's first), so buckets are filled from the last
parameter backwards, and one bucket holds one dtype on one device.

**Overlap.**  A hook (``Tensor.register_post_accumulate_grad_hook``) fires when a parameter's gradient has
been accumulated into ``.grad``.  When a bucket's last gradient arrives, the bucket is all-reduced
*asynchronously* while autograd computes the gradients of earlier layers, and the step time falls from
``T_backward + T_comm`` towards ``max(T_backward, T_comm)`` plus the last bucket's all-reduce.  Every rank
must issue its collectives in the same order, so buckets are launched strictly in index order: a ready bucket
waits for the buckets before it (as PyTorch's Reducer does).  The first hook of a backward pass queues a
callback on the autograd engine that runs when the pass ends, waits for every bucket, and writes the mean back
into ``.grad`` (:meth:`DistributedDataParallel.finish_gradient_synchronization`; calling it again is a no-op).
With ``overlap=False`` nothing is launched during backward; every bucket is all-reduced in that callback.

**Bucket buffers.**  Each bucket owns a flat buffer.  Each gradient is copied in by its hook, the moment it
is ready, and divided by the world size in the same pass (``torch.div(grad, N, out=slice)``), as PyTorch's
Reducer does: the gradient was just written and is still in cache, the copy happens while the bucket waits
for its other gradients anyway, and the division needs no extra pass over the bucket after the last
all-reduce, on the critical path.  (Measured on TinyGPT 10m, 2 gloo ranks with one core each, ~250 ms of
CPU per step: the DDP's own work on the main thread fell from ~14 to ~10 ms per step, PyTorch's figure,
against copying a whole bucket when it is launched and dividing after the all-reduce;
``benchmarks/bench_ddp.py``.)  With ``compression`` the sums are copied undivided: each compressor takes
the mean its own way.  After the all-reduce the mean is copied back into ``.grad``.  PyTorch's
``gradient_as_bucket_view=True`` instead makes each ``.grad`` a view into the bucket, saving one
gradient-sized buffer, both copies and, when ``zero_grad`` sets ``.grad`` to ``None``, the fresh allocation
of every gradient (~15 ms of main-thread CPU in that step), at the price of re-pointing ``.grad`` whenever
an optimizer sets it to ``None``; the copies keep this module simple and ``.grad`` ordinary.

**Parameters that get no gradient** in a backward pass (a branch not taken on this rank) would leave their
bucket waiting for ever.  At the end of backward such a parameter contributes its current local ``.grad``
(zeros if it has none; its accumulated value after ``no_sync`` micro-batches), so every rank still all-reduces
every bucket and nothing deadlocks; ``unused_parameters`` lists them for the last pass.  A parameter no rank
used therefore ends with a zero ``.grad`` where PyTorch (``find_unused_parameters=True``, which pays an extra
all-reduce of a usage bitmap) leaves it ``None``: the same for plain SGD, not for weight decay or Adam.

**Gradient accumulation.**  Inside ``with ddp.no_sync():`` the hooks do nothing and autograd accumulates into
``.grad`` locally; the next synchronised backward all-reduces the accumulated sums.  As in PyTorch, the
forward pass decides: a backward is synchronised when its forward ran outside ``no_sync``.

**At construction** rank 0's parameters and buffers are broadcast to every rank (one
``torch.distributed.broadcast`` per dtype, of the tensors flattened together, after checking that every rank
holds the same parameter names, shapes and dtypes).  The built-in broadcast is used rather than
``labkit.collectives.broadcast``: it is one call, and faster on gloo.  Like PyTorch's default
(``broadcast_buffers=True``), buffers such as BatchNorm's running statistics are broadcast from rank 0 again
at the start of every synchronised forward pass with autograd on: not under ``no_grad`` (so evaluating on
rank 0 alone does not hang) and not inside ``no_sync`` (which communicates nothing).  PyTorch decides by the
*previous* forward instead, so within a ``no_sync`` cycle it broadcasts before the first micro-batch rather
than the last.

``state_dict()`` and ``load_state_dict()`` are the wrapped module's, *without* PyTorch's ``module.`` prefix,
so a checkpoint loads into the plain model and back.  ``parameters()`` are the module's tensors.

Differences from PyTorch's DDP worth knowing: PyTorch's first bucket is capped at 1 MiB (so communication
starts sooner), its buckets may exceed the cap by one tensor, and after the first step it rebuilds buckets in
the order gradients actually arrived.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labkit import trace
from labkit.compression import GradientCompression

MiB = 1024 * 1024


@dataclass
class _Bucket:
    """Parameters whose gradients travel together, the flat buffer they travel in, this pass's progress."""

    index: int
    parameters: list[nn.Parameter]
    names: list[str]
    buffer: torch.Tensor  # one dtype, one device
    views: list[torch.Tensor]  # the buffer's slices, in each parameter's shape
    ready: list[bool]  # per parameter: has its gradient arrived in this backward pass?
    missing: int = 0  # how many have not
    handle: Any = None  # the communication in flight (a Work, or the compression's handle)

    def reset(self) -> None:
        self.ready = [False] * len(self.parameters)
        self.missing = len(self.parameters)
        self.handle = None


def assign_buckets(parameters: list[tuple[str, torch.Tensor]], bucket_cap_bytes: int) -> list[list[int]]:
    """Group parameter indices into buckets of at most ``bucket_cap_bytes``, last parameter first.

    A bucket is closed when the next parameter would overflow it or has another dtype or device; a parameter
    larger than the cap gets a bucket of its own.
    """
    buckets: list[list[int]] = []
    size = 0
    for index in reversed(range(len(parameters))):
        tensor = parameters[index][1]
        nbytes = tensor.numel() * tensor.element_size()
        first = parameters[buckets[-1][0]][1] if buckets else None
        if first is None or size + nbytes > bucket_cap_bytes or (first.dtype, first.device) != (
                tensor.dtype, tensor.device):
            buckets.append([])
            size = 0
        buckets[-1].append(index)
        size += nbytes
    return buckets


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` so that every backward pass leaves the mean gradient over ranks in ``.grad``.

    Args:
        module: the model (the same architecture on every rank; rank 0's values win).
        bucket_cap_mb: bucket size in MiB; 0 gives one all-reduce per parameter.
        overlap: launch each bucket's all-reduce during backward (True) or all of them after it (False).
        group: the process group to average over (default: every rank).
        compression: None (plain all-reduce) or an object from ``labkit.compression``.
        broadcast_buffers: broadcast rank 0's buffers before every synchronised forward pass with autograd on.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, overlap: bool = True,
                 group: dist.ProcessGroup | None = None, compression: GradientCompression | None = None,
                 broadcast_buffers: bool = True):
        super().__init__()
        _check_arguments(module, bucket_cap_mb, overlap, group, compression, broadcast_buffers)
        self.module = module
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.overlap = overlap
        self.group = group
        self.compression = compression
        self.broadcast_buffers = broadcast_buffers
        self.world_size = dist.get_world_size(group)
        self.source_rank = 0 if group is None else dist.get_global_rank(group, 0)

        trainable = [(name, param) for name, param in module.named_parameters() if param.requires_grad]
        if not trainable:
            raise ValueError("module has no parameter that requires a gradient: there is nothing to average")
        _check_same_model_everywhere(module, group)
        self._module_buffers = list(module.buffers())
        with torch.no_grad():
            _broadcast_coalesced(list(module.parameters()) + self._module_buffers, self.source_rank, group)

        self._buckets: list[_Bucket] = []
        for index, positions in enumerate(assign_buckets(trainable, int(self.bucket_cap_mb * MiB))):
            names = [trainable[position][0] for position in positions]
            params = [trainable[position][1] for position in positions]
            buffer = params[0].new_zeros(sum(param.numel() for param in params))
            views, offset = [], 0
            for param in params:
                views.append(buffer[offset:offset + param.numel()].view(param.shape))
                offset += param.numel()
            bucket = _Bucket(index, params, names, buffer, views, [])
            bucket.reset()
            self._buckets.append(bucket)
        self._hook_handles = [
            param.register_post_accumulate_grad_hook(partial(self._on_gradient_ready, bucket, position))
            for bucket in self._buckets for position, param in enumerate(bucket.parameters)]

        self.require_gradient_sync = True  # False inside no_sync()
        self.unused_parameters: list[str] = []  # got no gradient in the last synchronised pass
        self._sync_this_backward = True  # decided by the forward pass
        self._pass_started = False  # a hook has fired since the last synchronisation
        self._next_bucket = 0  # buckets before this one have been launched
        self._compute_since: float | None = None  # trace: start of the backward computation not yet recorded

    # ----------------------------------------------------------------------------------------------------
    # Forward, and the facts a lesson shows

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.broadcast_buffers and self._module_buffers and torch.is_grad_enabled() \
                and self.require_gradient_sync:
            with torch.no_grad():
                _broadcast_coalesced(self._module_buffers, self.source_rank, self.group)
        self._sync_this_backward = self.require_gradient_sync
        output = self.module(*inputs, **kwargs)
        if trace.is_enabled() and self._sync_this_backward and isinstance(output, torch.Tensor) \
                and output.requires_grad:
            output.register_hook(self._backward_reached_output)
        return output

    @property
    def buckets(self) -> list[list[tuple[str, int]]]:
        """Per bucket, in launch order: ``(parameter name, gradient bytes)`` for each of its parameters."""
        return [[(name, view.numel() * view.element_size())
                 for name, view in zip(bucket.names, bucket.views, strict=True)] for bucket in self._buckets]

    @property
    def bytes_per_step(self) -> int:
        """Gradient bytes that enter all-reduces per synchronised step (before any compression)."""
        return sum(bucket.buffer.numel() * bucket.buffer.element_size() for bucket in self._buckets)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: a backward whose forward ran in the block communicates nothing."""
        previous = self.require_gradient_sync
        self.require_gradient_sync = False
        try:
            yield
        finally:
            self.require_gradient_sync = previous

    # ----------------------------------------------------------------------------------------------------
    # During backward

    def _backward_reached_output(self, grad: torch.Tensor) -> None:
        self._compute_since = trace.now()

    def _on_gradient_ready(self, bucket: _Bucket, position: int, param: torch.Tensor) -> None:
        if not self._sync_this_backward:
            return  # no_sync: autograd has accumulated into param.grad, which is all we want
        if not self._pass_started:
            self._pass_started = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_gradient_synchronization)
            if self._compute_since is None:
                self._compute_since = trace.now()
        if bucket.ready[position]:
            raise RuntimeError(f"the gradient of {bucket.names[position]!r} was accumulated twice in one "
                               "backward pass (reentrant activation checkpointing?); this DDP expects one "
                               "hook call per parameter and pass")
        bucket.ready[position] = True
        bucket.missing -= 1
        self._copy_into_bucket(bucket, position)
        if self.overlap:
            while self._next_bucket < len(self._buckets) and self._buckets[self._next_bucket].missing == 0:
                self._record_backward_compute()
                self._launch(self._buckets[self._next_bucket])
                self._next_bucket += 1
                self._compute_since = trace.now()

    def _record_backward_compute(self) -> None:
        if self._compute_since is not None:
            trace.add("backward", "compute", self._compute_since, trace.now())
            self._compute_since = None

    def _copy_into_bucket(self, bucket: _Bucket, position: int) -> None:
        grad, view = bucket.parameters[position].grad, bucket.views[position]
        if grad is None:
            view.zero_()  # no gradient on this rank (yet): contribute zeros
        elif grad.is_sparse:
            raise TypeError(f"{bucket.names[position]!r} has a sparse gradient; this DDP all-reduces dense "
                            "buckets only")
        elif self.compression is None:
            torch.div(grad, self.world_size, out=view)  # the mean's division, fused into the copy
        else:
            view.copy_(grad)  # a compressor takes the sum and divides its own way

    def _launch(self, bucket: _Bucket) -> None:
        for position, ready in enumerate(bucket.ready):
            if not ready:  # unused in this pass: its current local gradient (or zeros) stands in
                self._copy_into_bucket(bucket, position)
        if self.compression is None:
            bucket.handle = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
            trace.record_async(bucket.handle, f"all-reduce bucket {bucket.index}")
        else:
            bucket.handle = self.compression.launch(bucket.index, bucket.buffer, bucket.views, self.group)

    # ----------------------------------------------------------------------------------------------------
    # After backward

    def finish_gradient_synchronization(self) -> None:
        """Launch the buckets not yet launched, wait for all, leave the mean in every ``.grad``.

        Runs by itself at the end of every synchronised backward pass; calling it again does nothing.
        """
        if not self._pass_started:
            return
        self._record_backward_compute()
        self.unused_parameters = [name for bucket in self._buckets
                                  for name, ready in zip(bucket.names, bucket.ready, strict=True)
                                  if not ready]
        try:
            for bucket in self._buckets[self._next_bucket:]:
                self._launch(bucket)
            with trace.span("wait for gradients", "idle"):
                for bucket in self._buckets:
                    self._complete(bucket)
        finally:
            self._pass_started = False
            self._next_bucket = 0
            for bucket in self._buckets:
                bucket.reset()

    def _complete(self, bucket: _Bucket) -> None:
        if self.compression is None:
            bucket.handle.wait()  # the gradients went in divided by the world size: the sum is the mean
        else:
            self.compression.complete(bucket.handle)
        for param, view in zip(bucket.parameters, bucket.views, strict=True):
            if param.grad is None:
                param.grad = view.clone()
            else:
                param.grad.copy_(view)


# --------------------------------------------------------------------------------------------------------
# Construction helpers


def _check_arguments(module: Any, bucket_cap_mb: Any, overlap: Any, group: Any, compression: Any,
                     broadcast_buffers: Any) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}: {module!r:.80}")
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)):
        raise TypeError(f"bucket_cap_mb must be a number of MiB, got {type(bucket_cap_mb).__name__} "
                        f"{bucket_cap_mb!r}")
    if not math.isfinite(bucket_cap_mb) or bucket_cap_mb < 0:
        raise ValueError(f"bucket_cap_mb must be a finite number >= 0 (MiB per bucket; 0 means one "
                         f"all-reduce per parameter), got {bucket_cap_mb!r}")
    for name, value in (("overlap", overlap), ("broadcast_buffers", broadcast_buffers)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if compression is not None and not (callable(getattr(compression, "launch", None))
                                        and callable(getattr(compression, "complete", None))):
        raise TypeError(f"compression must be None or have launch() and complete() methods (see "
                        f"labkit.compression), got {compression!r:.80}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("no process group is initialised: run this inside labkit.launch.launch(fn, "
                           "nprocs=N) or call torch.distributed.init_process_group first")
    if group is not None and dist.get_rank(group) < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of group {group!r}")


def _check_same_model_everywhere(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Compare a checksum of every parameter's and buffer's name, shape, dtype and requires_grad across ranks.

    Different models would otherwise make the broadcasts and bucket all-reduces below mismatch or hang.
    """
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    description = repr([(name, tuple(t.shape), str(t.dtype), t.requires_grad) for name, t in tensors])
    mine = torch.tensor([zlib.crc32(description.encode())], dtype=torch.int64, device=tensors[0][1].device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    checksums = [int(t) for t in everyone]
    if len(set(checksums)) > 1:
        differ = [rank for rank, checksum in enumerate(checksums) if checksum != checksums[0]]
        raise ValueError(f"ranks {differ} hold a model whose parameter/buffer names, shapes, dtypes or "
                         "requires_grad differ from rank 0's; every rank must wrap the same architecture")


def _broadcast_coalesced(tensors: list[torch.Tensor], src: int, group: dist.ProcessGroup | None) -> None:
    """Overwrite ``tensors`` with rank ``src``'s values: one broadcast per (dtype, device) of the tensors
    flattened together, rather than one small message each."""
    kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        kinds.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for same_kind in kinds.values():
        flat = torch.cat([tensor.detach().reshape(-1) for tensor in same_kind])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for tensor in same_kind:
            tensor.detach().copy_(flat[offset:offset + tensor.numel()].view(tensor.shape))
            offset += tensor.numel()
