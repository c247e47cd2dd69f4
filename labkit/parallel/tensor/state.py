"""Full (dense) model and optimizer states of a :class:`~labkit.parallel.tensor.TensorParallel` model, loading them
back into its slices, and its pieces for a sharded checkpoint (``labkit.checkpoint``, lesson 09).

Each rank holds, of every split parameter, one slice along the split dimension: rows ``r n/t .. (r+1) n/t`` of a
column-parallel weight, of the embedding table and of the head (the vocabulary padded with zero rows to a
multiple of ``t``), columns of a row-parallel weight; norms, biases of row-parallel layers and the position
embedding are whole everywhere.  An optimizer over those slices (``TensorParallel.make_optimizer``) keeps
Adam's ``exp_avg`` and ``exp_avg_sq`` in the slices' shapes, so its state is split exactly like the weights:

- **gathering** a state is the weights' own all-gather along the split dimension, padding dropped;
- **loading** needs no communication: every rank reads the dense tensors and keeps its slice, padded with
  zeros (the padding rows never see a gradient, so their weights and moments are zeros after any step);
- **a sharded checkpoint** writes each rank's slice, without padding, as one piece cut along the split
  dimension; replicated tensors are written once, by the first rank.  Because a slice is a piece of the dense
  tensor, such a checkpoint loads on any tensor-parallel degree: that is resharding.

The optimizer's state is indexed as the optimizer indexes it: the ``i``-th parameter of its groups.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from labkit.parallel.base import Piece, per_optimizer_parameter


def _names(model: Any, optimizer: torch.optim.Optimizer) -> list[str]:
    """For each parameter of ``optimizer`` (in its groups' order), its name in the model."""
    names = {id(p): name for name, p in model.module.named_parameters()}
    return per_optimizer_parameter(optimizer, names, "this tensor-parallel model")


def _per_element(value: Any) -> bool:
    return torch.is_tensor(value) and value.dim() > 0


def _span(model: Any, name: str, local: torch.Size) -> tuple[int, int, int]:
    """``(dimension, first index, count)`` of the dense tensor ``name`` that this rank's slice holds (``count``
    leaves out the vocabulary padding, so it can be 0 on the last ranks)."""
    dim, size = model.split_parameters()[name]
    begin = model.rank * local[dim]
    return dim, begin, max(0, min(local[dim], size - begin))


def local_part(model: Any, name: str, dense: torch.Tensor, local: torch.Size) -> torch.Tensor:
    """This rank's slice (of shape ``local``, zero-padded) of the dense tensor ``dense`` of parameter ``name``."""
    dim, begin, count = _span(model, name, local)
    part = dense.new_zeros(local)
    if count:
        part.narrow(dim, 0, count).copy_(dense.narrow(dim, begin, count))
    return part


@torch.no_grad()
def load_full_state_dict(model: Any, state: dict[str, torch.Tensor]) -> None:
    """Copy this rank's slices of the dense ``state`` into the model, and what it holds whole."""
    mine = model.module.state_dict()
    missing, unexpected = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
    if missing or unexpected:
        raise ValueError(f"the state does not fit this model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    split = model.split_parameters()
    for name, tensor in mine.items():
        tensor.copy_(local_part(model, name, state[name], tensor.shape) if name in split else state[name])


@torch.no_grad()
def full_optimizer_state_dict(model: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Collective: ``optimizer``'s state with every split parameter's per-element states gathered (every rank
    runs the same gathers, in the optimizer's order)."""
    saved, split = optimizer.state_dict(), model.split_parameters()
    full: dict[int, dict[str, Any]] = {}
    for position, name in enumerate(_names(model, optimizer)):
        entries = saved["state"].get(position)
        if entries is not None:
            full[position] = {key: model._gather(name, value) if name in split and _per_element(value) else value
                              for key, value in entries.items()}
    return {"state": full, "param_groups": saved["param_groups"]}


def load_full_optimizer_state_dict(model: Any, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a dense optimizer state (a :func:`full_optimizer_state_dict`) into ``optimizer``: each split
    parameter's per-element states cut to this rank's slice."""
    names, split = _names(model, optimizer), model.split_parameters()
    parameters = dict(model.module.named_parameters())
    local: dict[int, dict[str, Any]] = {}
    for position, entries in state["state"].items():
        name = names[int(position)]
        local[int(position)] = {
            key: local_part(model, name, value, parameters[name].shape) if name in split and _per_element(value)
            else (value.clone() if torch.is_tensor(value) else value) for key, value in entries.items()}
    optimizer.load_state_dict({"state": local, "param_groups": state["param_groups"]})


@torch.no_grad()
def sharded_state(model: Any, optimizer: torch.optim.Optimizer) -> dict[str, Piece]:
    """This rank's pieces for a sharded checkpoint (the contract's ``sharded_state``), no communication: its
    slice of every split parameter and of its per-element optimizer states, cut along the split dimension and
    without padding; what every rank holds whole, on the first rank only."""
    split, first = model.split_parameters(), model.rank == 0
    pieces: dict[str, Piece] = {}

    def add(key: str, name: str, tensor: torch.Tensor, dense_shape: list[int]) -> None:
        if name in split:
            dim, begin, count = _span(model, name, tensor.shape)
            if count:  # its first element, counted with the split dimension moved first
                first_element = begin * math.prod(n for d, n in enumerate(tensor.shape) if d != dim)
                pieces[key] = (tensor.detach().narrow(dim, 0, count), dense_shape, first_element, dim)
        elif first:
            pieces[key] = (tensor.detach(), dense_shape, 0, 0)

    def dense_shape(name: str, tensor: torch.Tensor) -> list[int]:
        shape = list(tensor.shape)
        if name in split:
            dim, size = split[name]
            shape[dim] = size
        return shape

    for name, tensor in model.module.state_dict().items():
        add(f"model/{name}", name, tensor, dense_shape(name, tensor))
    saved = optimizer.state_dict()["state"]
    for position, name in enumerate(_names(model, optimizer)):
        for key, value in saved.get(position, {}).items():
            if _per_element(value):
                add(f"optimizer/{position}/{key}", name, value, dense_shape(name, value))
    return pieces
