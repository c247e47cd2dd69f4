"""Where the memory of training goes: the analytical model, and measurements to hold it to.

**Model states** are what lives for the whole run, per parameter (``Psi`` parameters in all):

- *weights*: 4 bytes each in fp32, 2 in fp16/bf16;
- *gradients*: the same size as the weights;
- *optimizer states*: Adam keeps two moments (``exp_avg``, ``exp_avg_sq``), SGD with momentum one, plain SGD
  none, each in fp32; mixed precision adds the fp32 master copy of every weight (``labkit.precision``).

So Adam in fp32 holds ``4 + 4 + 8 = 16`` bytes per parameter and mixed-precision Adam ``2 + 2 + 12 = 16``
(:func:`bytes_per_parameter`; ZeRO, Rajbhandari et al. 2020, writes ``2 Psi + 2 Psi + K Psi`` with
``K = 12``).  A 1.5B-parameter GPT-2 thus needs 24 GB before the first activation.  Adam also keeps a
one-element ``step`` counter per parameter *tensor* (4 bytes each): :func:`model_state_bytes` reports those
apart, as ``optimizer_other``, because the per-parameter model ignores them.

**Activations** are the tensors the forward pass saves for the backward pass (inputs of matrix
multiplications, attention probabilities, normalisation statistics, ...).  They grow with batch size ``b``,
sequence length ``s`` and depth, not with ``Psi``: Korthikanti et al. ("Reducing Activation Recomputation in
Large Transformer Models", 2022) count ``s b h (34 + 5 a s / h)`` bytes per transformer layer at 16 bits
(``h`` hidden size, ``a`` heads; the ``5 a s / h`` term is the attention matrix, which fused attention kernels
do not store).  :class:`ActivationMeter` measures them instead of trusting a formula: a
``torch.autograd.graph.saved_tensors_hooks`` pair sees every tensor autograd saves, and the meter adds up the
storages behind them once each (a view shares its base's storage; the parameters, also saved by every
linear layer, are model states and are left out).  Under autocast the 16-bit copies of the weights that the
matrix multiplications save *are* counted: they are extra memory that exists only for the backward pass.

**Activation checkpointing** (Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016) keeps only
each checkpointed block's *input* (``s b h`` values) and re-runs the block's forward during the backward pass
to rebuild the rest, one block at a time.  For ``L`` blocks with ``A`` bytes of activations each, checkpointing
all of them cuts ``L A`` to about ``L s b h x bytes + A``, at the price of a second forward through them: about
a third more compute, since a backward costs about two forwards.  :func:`checkpoint_blocks` applies it to the
first ``count`` blocks (``torch.utils.checkpoint`` with ``use_reentrant=False``); recomputation is
deterministic, so the gradients are the same bit for bit.

**Counting storage, not tensors.**  :func:`storage_bytes` counts each ``untyped_storage()`` once, by address,
so a tied weight, a view, or a parameter that is also an optimizer's parameter is not counted twice.  It is what
the tensors *hold*; allocator caching and fragmentation, which ``torch.cuda.memory_allocated`` and
``max_memory_reserved`` show on a GPU, come on top.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

# Optimizer states (fp32 tensors the size of the parameter) per optimizer.
OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adam": 2}
PRECISIONS = ("fp32", "mixed")

# --------------------------------------------------------------------------------------------------------
# The analytical model


def bytes_per_parameter(precision: str = "fp32", optimizer: str = "adam") -> dict[str, int]:
    """Model-state bytes per parameter, as ``{"weights", "gradients", "optimizer_states"}``.

    ``precision``: ``"fp32"``, or ``"mixed"`` (16-bit weights and gradients, fp32 master weights);
    ``optimizer``: ``"adam"`` (Adam/AdamW), ``"momentum"`` (SGD with momentum) or ``"sgd"`` (plain SGD).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {tuple(OPTIMIZER_STATES)}, got {optimizer!r}")
    moments = 4 * OPTIMIZER_STATES[optimizer]
    if precision == "fp32":
        return {"weights": 4, "gradients": 4, "optimizer_states": moments}
    return {"weights": 2, "gradients": 2, "optimizer_states": 4 + moments}  # + the fp32 master copy


def predicted_model_state_bytes(num_parameters: int, precision: str = "fp32",
                                optimizer: str = "adam") -> dict[str, int]:
    """:func:`bytes_per_parameter` times ``num_parameters``."""
    return {name: num_parameters * size for name, size in bytes_per_parameter(precision, optimizer).items()}


# --------------------------------------------------------------------------------------------------------
# Measuring


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
    optimizer's parameters' included), ``optimizer_states`` (state tensors shaped like their parameter, and the
    optimizer's parameters when they are not the model's: fp32 master copies) and ``optimizer_other`` (any
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


# --------------------------------------------------------------------------------------------------------
# Activation checkpointing


def checkpoint_blocks(blocks: Sequence[nn.Module], count: int) -> None:
    """Make the first ``count`` of ``blocks`` (e.g. ``TinyGPT.blocks``) recompute their activations during
    backward; the others save them as usual.  ``count=0`` turns checkpointing off.

    Each checkpointed block's ``forward`` is replaced, on that instance only, by
    ``torch.utils.checkpoint.checkpoint(type(block).forward, block, ...)``: parameter names, ``state_dict``
    and the model's code are unchanged.
    """
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= len(blocks):
        raise ValueError(f"count must be an integer in [0, {len(blocks)}], got {count!r}")
    for index, block in enumerate(blocks):
        block.__dict__.pop("forward", None)  # back to the class's forward
        if index < count:
            block.forward = functools.partial(checkpoint, type(block).forward, block, use_reentrant=False)


def checkpointed_blocks(blocks: Sequence[nn.Module]) -> int:
    """How many of ``blocks``, from the first, :func:`checkpoint_blocks` has made recompute."""
    count = 0
    while count < len(blocks) and "forward" in blocks[count].__dict__:
        count += 1
    return count
