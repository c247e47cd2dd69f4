"""DistributedDataParallel from scratch: broadcast, gradient hooks, buckets, overlap, deferred reduction.

**Data parallelism.**  Every rank holds a full replica of the model and takes a different slice of the global
batch.  After the backward pass each rank's gradient is replaced by the mean over ranks (an *all-reduce*), so
every replica takes the same optimizer step and the replicas never drift apart.  For a loss that is a mean
over examples and slices of equal size, the mean of the ranks' gradients *is* the gradient of the whole batch:
N ranks with batch B train exactly like one process with batch N*B (up to floating-point rounding).  What does
not carry over is anything computed *across* a batch inside the model: BatchNorm normalises each rank's slice
with that slice's statistics (``torch.nn.SyncBatchNorm`` all-reduces them instead).

**Cost.**  A model with ``Psi`` trainable parameters of ``b`` bytes all-reduces ``n = Psi * b`` bytes per step
(``predicted_communication()``, held against the measured ``communication_per_step()``); a ring all-reduce puts
``2 (N-1)/N * n`` bytes on each rank's link in ``2 (N-1)`` messages (``labkit.collectives``).  Memory: none
beyond one process's, since the gradients live in the buckets below (with ``gradient_as_bucket_view=False``, one
extra gradient-sized buffer).

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
callback on the autograd engine that runs when the pass ends, waits for every bucket, and so leaves the mean
in every ``.grad`` (:meth:`DistributedDataParallel.finish_gradient_synchronization`; calling it again is a no-op).
With ``overlap=False`` nothing is launched during backward; every bucket is all-reduced in that callback.

**Bucket buffers: gradients as views** (``gradient_as_bucket_view=True``, the default; PyTorch's option of
the same name, which PyTorch leaves off).  Each bucket owns a flat buffer, and each parameter's ``.grad`` is a
view of its slice of it, so autograd accumulates straight into the bucket.  When a gradient's hook fires it is
already in place and the hook only divides it by the world size (``div_``); the all-reduce then leaves the
mean in ``.grad``, and nothing is copied either way.  A ``.grad`` that is *not* the view is a tensor autograd
has just made: in the first backward, after ``zero_grad(set_to_none=True)`` (PyTorch's default), or whenever
code replaced it.  The hook then copies it in, divided in the same pass (``torch.div(grad, N, out=slice)``,
while the gradient is still in cache), and points ``.grad`` at the view; autograd's tensor is freed.  That is
what PyTorch's Reducer does.  What it costs and saves, per step, with ``Psi * b`` bytes of gradients:

- memory: gradients and buckets are one buffer, ``Psi * b`` bytes (``memory_breakdown()``), where copies hold two;
- ``zero_grad(set_to_none=True)``: one fused copy-and-divide into the buckets, and no copy back out;
- ``zero_grad(set_to_none=False)``: autograd adds into the zeroed buckets and the hook divides in place: no copy
  at all, but a zeroing pass and an add where autograd would have handed its tensor over.

Pointing every ``None`` ``.grad`` at its zeroed view *before* backward instead (so autograd adds rather than
hands over a fresh tensor) measured 3-6 ms more main-thread CPU per TinyGPT-10m step than copying in from the
hook: the backward kernel allocates its output either way (``benchmarks/bench_ddp.py`` compares views and copies
with torch's).  The price of views: ``.grad`` is a view, so ``.grad.detach_()`` fails (``Optimizer.zero_grad``
does not call it), and a ``.grad`` replaced by another tensor is copied back in at the next synchronised backward.

``gradient_as_bucket_view=False`` keeps ``.grad`` ordinary tensors: each hook copies its gradient into the
bucket (divided), and after the all-reduce the mean is copied back into ``.grad``.  With ``compression`` the
buckets hold the undivided sums (each compressor takes the mean its own way and writes it into the bucket, so
with views the mean lands in ``.grad`` without a copy), and ``communication_per_step()`` counts what the
compressor really put into its collectives.

**Parameters that get no gradient** in a backward pass (a branch not taken on this rank) would leave their
bucket waiting for ever.  At the end of backward such a parameter contributes its current local ``.grad``
(zeros if it has none; its accumulated value after unsynchronised micro-batches), so every rank still
all-reduces every bucket and nothing deadlocks; ``unused_parameters`` lists them for the last synchronised
pass.  A parameter no rank used therefore ends with a zero ``.grad`` where PyTorch
(``find_unused_parameters=True``, which pays an extra all-reduce of a usage bitmap) leaves it ``None``: the
same for plain SGD, not for weight decay or Adam.

**Deferred reduction: gradient accumulation and pipeline schedules.**  ``set_requires_gradient_sync(False)``
(or the block ``with ddp.no_sync():``) makes the hooks do nothing: autograd accumulates into ``.grad``
locally.  Then either a backward pass with sync back on all-reduces the accumulated sums (gradient
accumulation: ``m - 1`` micro-batches unsynchronised, the last one synchronised), or :meth:`reduce_gradients`
all-reduces every bucket from the current ``.grad`` explicitly, launched in bucket order, and leaves the mean
there.  The flag is read *when the backward pass runs*, not when the forward did (PyTorch's DDP decides in
the forward), so a pipeline schedule may run ``m`` forwards, then ``m`` backwards with sync off, in any
interleaving, then one ``reduce_gradients()`` (a collective: every rank calls it, once per step): the gradient
of the whole batch, for one all-reduce of every bucket.  (FSDP2's ``set_requires_gradient_sync`` does the same.)

**At construction** rank 0's parameters and buffers are broadcast to every rank (one
``torch.distributed.broadcast`` per dtype, of the tensors flattened together, after checking that every rank
holds the same parameter names, shapes and dtypes; the built-in broadcast: one call, faster on gloo).  Like PyTorch's default
(``broadcast_buffers=True``), buffers such as BatchNorm's running statistics are broadcast from rank 0 again
at the start of every forward pass run with autograd on while gradient sync is on: not under ``no_grad`` (so
evaluating on rank 0 alone does not hang) and not while sync is off (which communicates nothing).  A
gradient-accumulation step with its last micro-batch synchronised thus broadcasts once per step; a pipeline
schedule that runs its forwards with sync on broadcasts at each of them (the bytes show under
``"broadcast"``), and one that runs them with sync off never does, so its buffers stay per rank.  PyTorch
decides by the *previous* forward instead, so within a ``no_sync`` cycle it broadcasts before the first
micro-batch rather than the last.

**The contract** (``labkit.parallel.base.ParallelWrapper``): ``state_dict()`` and ``load_state_dict()`` are the
wrapped module's, *without* PyTorch's ``module.`` prefix, so a checkpoint loads into the plain model and back;
every rank holds the whole model, so ``full_state_dict()`` is the same dictionary and needs no communication;
``gradients()`` are the module's ``.grad`` (the full mean, once reduced) and ``clip_grad_norm_`` clips them as
``torch.nn.utils.clip_grad_norm_`` would on one process.  ``parameters()`` are the module's tensors.

Unlike PyTorch's DDP: its first bucket is capped at 1 MiB (communication starts sooner), its buckets may exceed
the cap by one tensor, and after the first step it rebuilds buckets in the order gradients arrived.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labkit import trace
from labkit.measure import model_state_bytes, storage_bytes
from labkit.parallel.base import (
    ParallelWrapper,
    broadcast_from_first_rank,
    check_same_model,
    queue_end_of_backward,
    replicated_parameters,
)
from labkit.parallel.compression import GradientCompression

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


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class DistributedDataParallel(ParallelWrapper):
    """Wrap ``module`` so that every synchronised backward pass leaves the mean gradient over ranks in ``.grad``.

    Args:
        module: the model (the same architecture on every rank; the group's first rank's values win).
        bucket_cap_mb: bucket size in MiB; 0 gives one all-reduce per parameter.
        overlap: launch each bucket's all-reduce during backward (True) or all of them after it (False).
        group: the ranks to average over: ``None`` (every rank), a ``ProcessGroup``, or one dimension of a
            ``labkit.mesh.Mesh`` (``mesh.group("dp")``).
        compression: None (plain all-reduce) or an object from ``labkit.parallel.compression``.
        broadcast_buffers: broadcast the first rank's buffers before every forward pass run with autograd on
            while gradient sync is on.
        gradient_as_bucket_view: make every ``.grad`` a view of its bucket (True: no copies, one gradient-sized
            buffer) or keep them separate tensors that the buckets are copied from and back into (False).
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, overlap: bool = True,
                 group: Any = None, compression: GradientCompression | None = None,
                 broadcast_buffers: bool = True, gradient_as_bucket_view: bool = True):
        _check_arguments(bucket_cap_mb, overlap, compression, broadcast_buffers,
                         gradient_as_bucket_view)  # before any communication
        super().__init__(module, group)
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.overlap, self.gradient_as_bucket_view = overlap, gradient_as_bucket_view
        self.compression, self.broadcast_buffers = compression, broadcast_buffers

        shared = replicated_parameters(module)  # all but an expert-parallel rank's own experts
        if not (trainable := [(name, param) for name, param in shared if param.requires_grad]):
            raise ValueError("module has no parameter that requires a gradient: there is nothing to average")
        check_same_model(shared + list(module.named_buffers()), self.group)
        self._module_buffers = list(module.buffers())
        broadcast_from_first_rank([param for _, param in shared] + self._module_buffers, self.group)

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

        self.unused_parameters: list[str] = []  # got no gradient in the last synchronised pass
        self._pass_started = False  # a hook of a synchronised backward has fired since the last reduction
        self._next_bucket = 0  # buckets before this one have been launched
        self._compute_since: float | None = None  # trace: start of the backward computation not yet recorded

    # ----------------------------------------------------------------------------------------------------
    # Forward, and the facts a lesson shows

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self._start_forward()
        if self.broadcast_buffers and self._module_buffers and torch.is_grad_enabled() \
                and self.require_gradient_sync:
            broadcast_from_first_rank(self._module_buffers, self.group)
            for buffer in self._module_buffers:
                self._count("broadcast", buffer)
        output = self.module(*inputs, **kwargs)
        if trace.is_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self._backward_reached_output)
        return output

    @property
    def buckets(self) -> list[list[tuple[str, int]]]:
        """Per bucket, in launch order: ``(parameter name, gradient bytes)`` for each of its parameters."""
        return [[(name, _nbytes(view)) for name, view in zip(bucket.names, bucket.views, strict=True)]
                for bucket in self._buckets]

    def predicted_communication(self) -> dict[str, int]:
        """Bytes entering collectives per step without compression: every trainable parameter's gradient once
        (``"all_reduce"``), and with ``broadcast_buffers`` the buffers once (``"broadcast"``: one synchronised
        forward with autograd on per step)."""
        predicted = {"all_reduce": sum(_nbytes(bucket.buffer) for bucket in self._buckets)}
        if self.broadcast_buffers and self._module_buffers:
            predicted["broadcast"] = sum(_nbytes(buffer) for buffer in self._module_buffers)
        return predicted

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's ``state_dict()``: every rank holds the whole model, so nothing is communicated."""
        return self.module.state_dict()

    def memory_breakdown(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds (``labkit.measure.model_state_bytes``), the buckets counted as ``gradients``:
        with ``gradient_as_bucket_view`` the ``.grad`` are views of them, one gradient-sized buffer in all;
        without, the buckets are a second one beside the ``.grad``."""
        optimizer = optimizer if optimizer is not None else self.optimizer
        breakdown = model_state_bytes(self.module, optimizer)
        parameters = list(self.module.parameters()) + ([] if optimizer is None else [
            p for group in optimizer.param_groups for p in group["params"]])
        counted = {p.grad.untyped_storage().data_ptr() for p in parameters if p.grad is not None}
        breakdown["gradients"] += storage_bytes([bucket.buffer for bucket in self._buckets], counted)
        return breakdown

    # ----------------------------------------------------------------------------------------------------
    # During backward

    def _backward_reached_output(self, grad: torch.Tensor) -> None:
        if self.require_gradient_sync:
            self._compute_since = trace.now()

    def _on_gradient_ready(self, bucket: _Bucket, position: int, param: torch.Tensor) -> None:
        if not self.require_gradient_sync:
            return  # sync off: autograd has accumulated into param.grad, which is all we want
        if not self._pass_started:
            self._pass_started = True
            queue_end_of_backward(self.finish_gradient_synchronization)
            if self._compute_since is None:
                self._compute_since = trace.now()
        if bucket.ready[position]:
            raise RuntimeError(f"the gradient of {bucket.names[position]!r} was accumulated twice in one "
                               "backward pass (reentrant activation checkpointing?); this DDP expects one "
                               "hook call per parameter and pass")
        bucket.ready[position] = True
        bucket.missing -= 1
        self._gradient_into_bucket(bucket, position)
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

    def _gradient_into_bucket(self, bucket: _Bucket, position: int) -> None:
        """Leave this rank's contribution in the parameter's slice of the bucket: its gradient divided by the
        world size (undivided with compression: a compressor takes the sum and divides its own way)."""
        param, view = bucket.parameters[position], bucket.views[position]
        grad = param.grad
        if grad is view:  # gradient_as_bucket_view: autograd accumulated straight into the bucket
            if self.compression is None:
                view.div_(self.world_size)
            return
        if grad is None:
            view.zero_()  # no gradient on this rank (yet): contribute zeros
        elif grad.is_sparse:
            raise TypeError(f"{bucket.names[position]!r} has a sparse gradient; this DDP all-reduces dense "
                            "buckets only")
        elif self.compression is None:
            torch.div(grad, self.world_size, out=view)  # the mean's division, fused into the copy
        else:
            view.copy_(grad)
        if self.gradient_as_bucket_view:
            param.grad = view  # from now on autograd accumulates into the bucket; the old tensor is freed

    def _launch(self, bucket: _Bucket) -> None:
        for position, ready in enumerate(bucket.ready):
            if not ready:  # unused in this pass (or no pass: reduce_gradients): its current local gradient
                self._gradient_into_bucket(bucket, position)
        if self.compression is None:
            self._count("all_reduce", bucket.buffer)
            bucket.handle = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
            trace.record_async(bucket.handle, f"all-reduce bucket {bucket.index}")
        else:
            bucket.handle = self.compression.launch(bucket.index, bucket.buffer, bucket.views, self.group,
                                                    count=self._count)

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
        self._reduce_remaining_buckets()

    def reduce_gradients(self) -> None:
        """All-reduce every bucket from the current ``.grad`` (launched in bucket order) and leave the mean in
        ``.grad``: the reduction that backward passes with sync off skipped.  A collective: every rank calls it.

        A parameter without ``.grad`` contributes zeros and ends with the mean of the others' gradients.
        """
        if self._pass_started:
            raise RuntimeError("reduce_gradients() was called while a synchronised backward pass was still "
                               "reducing; call it after backward passes run with set_requires_gradient_sync(False)")
        self._reduce_remaining_buckets()

    def _reduce_remaining_buckets(self) -> None:
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
        self._reduction_done()

    def _complete(self, bucket: _Bucket) -> None:
        if self.compression is None:
            bucket.handle.wait()  # the gradients went in divided by the world size: the sum is the mean
        else:
            self.compression.complete(bucket.handle)
        if self.gradient_as_bucket_view:
            return  # every .grad of the bucket is a view of it: the mean is already there
        for param, view in zip(bucket.parameters, bucket.views, strict=True):
            if param.grad is None:
                param.grad = view.clone()
            else:
                param.grad.copy_(view)


# --------------------------------------------------------------------------------------------------------
# Construction helpers


def _check_arguments(bucket_cap_mb: Any, overlap: Any, compression: Any, broadcast_buffers: Any,
                     gradient_as_bucket_view: Any) -> None:
    """The arguments only this wrapper takes (the base class checks ``module`` and ``group``)."""
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)):
        raise TypeError(f"bucket_cap_mb must be a number of MiB, got {type(bucket_cap_mb).__name__} "
                        f"{bucket_cap_mb!r}")
    if not math.isfinite(bucket_cap_mb) or bucket_cap_mb < 0:
        raise ValueError(f"bucket_cap_mb must be a finite number >= 0 (MiB per bucket; 0 means one "
                         f"all-reduce per parameter), got {bucket_cap_mb!r}")
    for name, value in (("overlap", overlap), ("broadcast_buffers", broadcast_buffers),
                        ("gradient_as_bucket_view", gradient_as_bucket_view)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if compression is not None and not (callable(getattr(compression, "launch", None))
                                        and callable(getattr(compression, "complete", None))):
        raise TypeError(f"compression must be None or have launch() and complete() methods (see "
                        f"labkit.parallel.compression), got {compression!r:.80}")
