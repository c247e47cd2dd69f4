"""Measurements that the analytical models are held to: memory held, activations saved, links and steps timed.

**Memory.**  :func:`storage_bytes` counts each ``untyped_storage()`` once, by address, so a tied weight, a view,
or a parameter that is also an optimizer's parameter is not counted twice.  It is what the tensors *hold*;
allocator caching and fragmentation, which ``torch.cuda.memory_allocated`` and ``max_memory_reserved`` show on
a GPU, come on top (:func:`measure_cuda_memory`).  :func:`model_state_bytes` sorts a model's and an optimizer's
storages into the categories of ``labkit.costmodel.memory``.  Every parallel wrapper's ``memory_breakdown()``
(``labkit.parallel.base``) is built on these two functions.

**Activations.**  :class:`ActivationMeter` measures what autograd saves for the backward pass instead of
trusting a formula: a ``torch.autograd.graph.saved_tensors_hooks`` pair sees every tensor autograd saves, and
the meter adds up the storages behind them once each (a view shares its base's storage; the parameters, also
saved by every linear layer, are model states and are left out).  Under autocast the 16-bit copies of the
weights that the matrix multiplications save *are* counted: they are extra memory that exists only for the
backward pass.

**Links.**  :func:`measure_alpha_beta` times messages between ranks and fits the alpha-beta model of
``labkit.costmodel.collectives``, below the ceiling :func:`measure_copy_bandwidth` puts on a loopback link;
:func:`time_collectives` times whole collectives as NCCL-tests does.

**Steps.**  :func:`time_step` gives the median time of one forward and backward, on a GPU after waiting for
the device.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from labkit.costmodel.collectives import LinkModel, fit_alpha_beta
from labkit.dist import device, global_rank, require_group

# --------------------------------------------------------------------------------------------------------
# Memory


def storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int] | None = None) -> int:
    """Bytes held by the storages behind ``tensors``, each storage counted once.

    ``seen`` (storage addresses) is updated, so consecutive calls sharing it never count a storage twice.
    """
    seen = set() if seen is None else seen
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Measured bytes of ``weights`` (the model's parameters), ``gradients`` (every ``.grad``, the
    optimizer's parameters' included), ``optimizer_states`` (state tensors shaped like their parameter, and
    the optimizer's parameters when they are not the model's: fp32 master copies) and ``optimizer_other`` (any
    other state tensor, e.g. Adam's ``step`` counters)."""
    seen: set[int] = set()
    parameters = list(model.parameters())
    optimizer_parameters = [] if optimizer is None else [
        parameter for group in optimizer.param_groups for parameter in group["params"]]
    weights = storage_bytes(parameters, seen)
    gradients = storage_bytes((p.grad for p in parameters + optimizer_parameters if p.grad is not None), seen)
    states = storage_bytes(optimizer_parameters, seen)  # masters (the model's own were counted above)
    other = 0
    for parameter in optimizer_parameters:
        for value in (optimizer.state.get(parameter, {}).values() if optimizer is not None else ()):
            if isinstance(value, torch.Tensor):
                if value.shape == parameter.shape:
                    states += storage_bytes([value], seen)
                else:
                    other += storage_bytes([value], seen)
    return {"weights": weights, "gradients": gradients, "optimizer_states": states, "optimizer_other": other}


class ActivationMeter:
    """Counts the bytes autograd saves for backward while the ``with`` block runs::

        with ActivationMeter(exclude=model.parameters()) as meter:
            loss = model(x, y)[1]
        meter.bytes   # activations held until loss.backward()

    ``exclude``: tensors not to count (the parameters: model states, not activations).  Only the forward
    pass should run inside the block.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._excluded = {tensor.untyped_storage().data_ptr() for tensor in exclude}
        self._storages: dict[int, int] = {}  # storage address -> bytes
        self._hooks: Any = None

    @property
    def bytes(self) -> int:
        return sum(self._storages.values())

    @property
    def count(self) -> int:
        """How many distinct storages were saved."""
        return len(self._storages)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._excluded:
            self._storages[storage.data_ptr()] = storage.nbytes()
        return tensor  # saved as usual: the meter only looks

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def __enter__(self) -> ActivationMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._hooks.__exit__(*exc_info)


class LargestTensor(TorchDispatchMode):
    """The largest tensor any operation produces while the ``with`` block runs (elements and shape): the
    working memory a kernel needs at once, which :class:`ActivationMeter` (only what is *saved*) does not see::

        with LargestTensor() as largest:
            blockwise_attention(q, k, v)
        largest.numel, largest.shape   # one tile of scores, or q itself: never s x s
    """

    def __init__(self) -> None:
        super().__init__()
        self.numel, self.shape, self.op = 0, (), ""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.numel() > self.numel:
                self.numel, self.shape, self.op = tensor.numel(), tuple(tensor.shape), str(func)
        return out


def measure_training_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                          loss_fn: Callable[[], torch.Tensor]) -> dict[str, int]:
    """Run one step (``loss_fn()`` under an :class:`ActivationMeter`, backward, ``optimizer.step()``) and
    return the bytes measured in each of ``labkit.costmodel.memory.memory_per_rank``'s categories, plus ``optimizer_other``
    (:func:`model_state_bytes`).  The gradients are left in place, as they are held until the next step."""
    with ActivationMeter(exclude=model.parameters()) as meter:
        loss = loss_fn()
    loss.backward()
    optimizer.step()
    measured = model_state_bytes(model, optimizer)
    measured["activations"] = meter.bytes
    measured["total"] = sum(measured.values())
    return measured


def measure_cuda_memory(fn: Callable[[], Any],
                        device: torch.device | str | int | None = None) -> dict[str, int] | None:
    """Run ``fn()`` on a CUDA device and return ``torch.cuda`` byte counts: ``before``, ``after``, ``peak``
    (``max_memory_allocated`` since just before the call), ``retained`` (``after - before``) and
    ``peak_increase`` (``peak - before``).  ``fn``'s return value is kept until ``after`` is read, so a
    forward pass that returns its loss is measured with its activations.

    ``None``, without calling ``fn``, when CUDA is unavailable or ``device`` is not a CUDA device.
    """
    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        return None
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    result = fn()
    torch.cuda.synchronize(device)
    after, peak = torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
    del result
    return {"before": before, "after": after, "peak": peak, "retained": after - before,
            "peak_increase": peak - before}


# --------------------------------------------------------------------------------------------------------
# Links and collectives


def measure_copy_bandwidth(nbytes: int = 1 << 20, repeats: int = 7) -> float:
    """Bytes per second at which one thread copies ``nbytes`` (``Tensor.copy_``), the median of ``repeats``
    timed batches of copies (each batch ~16 MiB of them, after one warm-up batch).

    The ceiling on a loopback link (:func:`measure_alpha_beta` over gloo): a TCP send over loopback copies each
    byte at least twice, from the sender's buffer into the kernel's socket buffer and from there into the
    receiver's, each copy a memcpy on one core; even with the two copies overlapped on two cores, ``m`` bytes
    take at least ``m / copy rate``.  Measured at the size of the messages timed, the buffer reused as theirs
    are: a message that fits in the caches is copied at the caches' rate (on the reference machine 42 GB/s at
    1 MiB, 9.7 GB/s at 64 MiB, which is memory's), and the bound must hold for it too.  The caller sets the
    threads (:func:`labkit.calibrate.calibrate` runs it on one, as its ranks run)."""
    if nbytes < 1 or repeats < 1:
        raise ValueError(f"nbytes and repeats must be >= 1, got {nbytes!r} and {repeats!r}")
    source = torch.ones(nbytes, dtype=torch.uint8)
    target = torch.empty_like(source)
    copies = max(1, (16 << 20) // nbytes)
    samples = []
    for _ in range(repeats + 1):  # the first is a warm-up: page faults, the caches filled
        begin = time.perf_counter()
        for _ in range(copies):
            target.copy_(source)
        samples.append((time.perf_counter() - begin) / copies)
    return nbytes / statistics.median(samples[1:])


def measure_alpha_beta(sizes: tuple[int, ...] = (8, 1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22),
                       iterations: int = 10, group: torch_dist.ProcessGroup | None = None,
                       pattern: str = "ring", max_bandwidth_bytes_per_s: float | None = None) -> LinkModel:
    """Fit the alpha-beta model to timed messages (call it on every rank; every rank returns the same fit).

    ``pattern="ring"`` times one *ring step*: every rank sends ``m`` bytes to its right neighbour while
    receiving ``m`` from its left, all at once — the links used the way the ring algorithms use them.
    ``pattern="ping-pong"`` times ranks 0 and 1 alone, bouncing a message back and forth (half a round trip
    per message), as latency benchmarks do.  On dedicated links (NVLink, InfiniBand) the two agree; on one
    machine's CPUs (gloo over loopback) all ranks share the same cores and memory, so the ring's beta is larger
    and is the one that predicts a ring collective.

    Each of ``iterations`` rounds (after a warm-up round) sends every size once, in turn, so that a burst of
    load from elsewhere slows one sample of each size rather than every sample of one; :func:`fit_alpha_beta`
    fits rank 0's median per size, which every rank receives and fits alike.  ``max_bandwidth_bytes_per_s``:
    the fit's ceiling (:func:`measure_copy_bandwidth` at the largest size); a fit above it, or flat, raises
    the same ``ValueError`` on every rank.
    """
    if pattern not in ("ring", "ping-pong"):
        raise ValueError(f"pattern must be 'ring' or 'ping-pong', got {pattern!r}")
    group = require_group(group)
    rank, world_size = torch_dist.get_rank(group), torch_dist.get_world_size(group)
    if world_size < 2:
        raise ValueError("measure_alpha_beta needs at least 2 ranks to send messages between")

    def send(tensor: torch.Tensor, peer: int) -> Any:
        return torch_dist.isend(tensor, global_rank(group, peer), group=group)

    def receive(tensor: torch.Tensor, peer: int) -> Any:
        return torch_dist.irecv(tensor, global_rank(group, peer), group=group)

    medians = torch.zeros(len(sizes), dtype=torch.float64, device=device())
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    if pattern == "ring" or rank in (0, 1):
        buffers = [(torch.zeros(nbytes, dtype=torch.uint8, device=medians.device),
                    torch.empty(nbytes, dtype=torch.uint8, device=medians.device)) for nbytes in sizes]
        samples: list[list[float]] = [[] for _ in sizes]
        for round_ in range(iterations + 1):  # the first round is a warm-up
            for (outgoing, incoming), timed in zip(buffers, samples, strict=True):
                begin = time.perf_counter()
                if pattern == "ring":
                    arriving = receive(incoming, left)
                    send(outgoing, right).wait()
                    arriving.wait()
                elif rank == 0:
                    send(outgoing, 1).wait()
                    receive(incoming, 1).wait()
                else:
                    receive(incoming, 0).wait()
                    send(outgoing, 0).wait()
                if outgoing.is_cuda:  # under NCCL, wait() only orders streams; the clock needs the GPU done
                    torch.cuda.synchronize(outgoing.device)
                if round_:
                    timed.append((time.perf_counter() - begin) / (1 if pattern == "ring" else 2))
        medians = torch.tensor([statistics.median(timed) for timed in samples], dtype=torch.float64,
                               device=medians.device)
    torch_dist.broadcast(medians, src=global_rank(group, 0), group=group)
    return fit_alpha_beta(sizes, medians.tolist(), max_bandwidth_bytes_per_s)


def time_collectives(algorithms: dict[str, Callable[[torch.Tensor], object]], sizes: list[int],
                     batches: int = 5, dtype: torch.dtype = torch.float32,
                     group: torch_dist.ProcessGroup | None = None) -> dict[str, list[float]]:
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
                             device=device())
        calls = max(2, min(20, (32 << 20) // max(nbytes, 1)))
        for run in algorithms.values():  # warm-up: connections, buffers, page faults
            run(tensor)
        samples: dict[str, list[float]] = {name: [] for name in algorithms}
        for _ in range(batches):
            for name, run in algorithms.items():
                torch_dist.barrier(group=group)
                begin = time.perf_counter()
                for _ in range(calls):
                    run(tensor)
                if tensor.is_cuda:
                    torch.cuda.synchronize(tensor.device)
                elapsed = torch.tensor([(time.perf_counter() - begin) / calls], dtype=torch.float64,
                                       device=tensor.device)
                torch_dist.all_reduce(elapsed, op=torch_dist.ReduceOp.MAX, group=group)  # the slowest rank's time
                samples[name].append(float(elapsed))
        for name in algorithms:
            timed[name].append(statistics.median(samples[name]))
    return timed


# --------------------------------------------------------------------------------------------------------
# Steps


def time_step(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor], dtype: torch.dtype | None = None,
              repeats: int = 5, warmup: int = 1) -> float:
    """Median seconds of one forward + backward of ``loss_fn(model)`` under autocast to ``dtype`` (``None``:
    plain fp32).  The model is deep-copied, so its gradients are untouched.  On a GPU the clock waits for the
    device."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    model = copy.deepcopy(model)
    device_type = next(model.parameters()).device.type

    def synchronize() -> None:
        if device_type == "cuda":
            torch.cuda.synchronize()

    times = []
    for index in range(warmup + repeats):
        model.zero_grad(set_to_none=True)
        synchronize()
        start = time.perf_counter()
        with torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = loss_fn(model)
        loss.backward()
        synchronize()
        if index >= warmup:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]
