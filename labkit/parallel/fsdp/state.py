"""Full (unsharded) model and optimizer states of a :class:`~labkit.parallel.fsdp.FullyShardedDataParallel`, and
loading them back into its shards: what a full checkpoint needs (``labkit.checkpoint``, lesson 09).

Each rank holds, per flat parameter, the rows ``FlatShards.local_rows`` of every parameter, and an optimizer over
those pieces keeps its per-parameter state (Adam's ``exp_avg``, ``exp_avg_sq``) in the pieces' shapes.  Gathering
a state is the parameters' own gather: copy each rank's pieces into a padded shard buffer, all-gather the buffers,
unpack the rows into full tensors.  Loading is the reverse without communication: every rank reads the full
tensors and keeps its rows.  Scalar states (Adam's ``step``) are the same on every rank and pass through.
A replicated flat parameter's layout has one "rank" (``labkit.parallel.fsdp.units``): its rows are all of them,
so it needs no gather, and a sharded checkpoint takes it (and its optimizer states) from the first rank only.

The full optimizer state is what a plain optimizer over the unsharded model would hold, indexed the same way
(the ``i``-th parameter of the optimizer's groups is the ``i``-th piece), so a single process can load it too.
"""

from __future__ import annotations

from typing import Any

import torch

from labkit.parallel.base import Piece, all_gather_tensor, per_optimizer_parameter


def _flats(model: Any) -> list[Any]:
    return [flat for unit in model.units for flat in unit.flats]


def _gather(model: Any, flat: Any, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    """The full tensors of ``flat``'s parameters whose local pieces (this rank's rows) are ``pieces``."""
    if flat.replicated:  # every rank holds them whole, and the same
        return [piece.detach().clone() for piece in pieces]
    shard = pieces[0].new_zeros(flat.shards.shard_numel)
    for view, piece in zip(flat.shards.shard_views(shard), pieces, strict=True):
        view.copy_(piece.reshape(view.shape))
    gathered = shard.new_empty(flat.shards.padded_numel)
    all_gather_tensor(gathered, shard, group=model.group)
    tensors = [shard.new_empty(shape) for shape in flat.shards.shapes]
    flat.shards.unpack(gathered, tensors)
    return tensors


@torch.no_grad()
def full_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """Collective: the unsharded model's ``state_dict()`` (the shards' dtype, and the buffers) on every rank."""
    full: dict[str, torch.Tensor] = {}
    for flat in _flats(model):
        tensors = _gather(model, flat, [piece.detach() for piece in flat.pieces])
        full.update((name, tensor) for tensor, names in zip(tensors, flat.names, strict=True) for name in names)
    full.update((name, buffer.detach().clone()) for name, buffer in model.module.named_buffers())
    return {name: full[name] for name in model.module.state_dict()}


def _piece_places(model: Any, optimizer: torch.optim.Optimizer) -> list[tuple[Any, int]]:
    """For each parameter of ``optimizer`` (in its groups' order), its flat parameter and index there."""
    where = {id(piece): (flat, index) for flat in _flats(model) for index, piece in enumerate(flat.pieces)}
    return per_optimizer_parameter(optimizer, where, "this FSDP model's shards")


@torch.no_grad()
def full_optimizer_state_dict(model: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Collective: ``optimizer``'s state as a plain optimizer over the unsharded model would hold it."""
    saved = optimizer.state_dict()
    places = _piece_places(model, optimizer)
    keys = sorted({key for state in optimizer.state.values() for key, value in state.items()
                   if torch.is_tensor(value) and value.dim() > 0})  # the per-element states
    full_state: dict[int, dict[str, Any]] = {}
    for flat in _flats(model):
        members = [position for position, (owner, _) in enumerate(places) if owner is flat]
        if not members:
            continue
        for key in keys:  # every rank runs the same gathers, in the same order
            pieces = [piece.detach().new_zeros(piece.shape) for piece in flat.pieces]
            for position in members:
                value = saved["state"].get(position, {}).get(key)
                if value is not None:
                    pieces[places[position][1]] = value
            tensors = _gather(model, flat, pieces)
            for position in members:
                if key in saved["state"].get(position, {}):
                    full_state.setdefault(position, {})[key] = tensors[places[position][1]]
    for position, state in saved["state"].items():  # scalar states: the same on every rank
        full_state.setdefault(position, {}).update(
            (key, value) for key, value in state.items() if not (torch.is_tensor(value) and value.dim() > 0))
    return {"state": full_state, "param_groups": saved["param_groups"]}


@torch.no_grad()
def load_full_state_dict(model: Any, state: dict[str, torch.Tensor]) -> None:
    """Copy this rank's rows of the full ``state`` into its shards, and the buffers whole."""
    for flat in _flats(model):
        for index, (piece, names) in enumerate(zip(flat.pieces, flat.names, strict=True)):
            full = state[names[0]]
            if full.shape != flat.shards.shapes[index]:
                raise ValueError(f"{names[0]}: shape {tuple(full.shape)} in the state, "
                                 f"{tuple(flat.shards.shapes[index])} in the model")
            piece.copy_(_rows(flat.shards, index, full))
    for name, buffer in model.module.named_buffers():
        if name in state:
            buffer.copy_(state[name])


def _rows(shards: Any, index: int, full: torch.Tensor) -> torch.Tensor:
    start, stop = shards.local_rows(index)
    return full.reshape(shards.rows[index], *shards.shapes[index][1:])[start:stop].reshape(
        shards.local_shape(index))


def load_full_optimizer_state_dict(model: Any, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a full optimizer state (from :func:`full_optimizer_state_dict`, or a plain optimizer's over the
    unsharded model) into ``optimizer``: each per-element state cut to this rank's rows."""
    places = _piece_places(model, optimizer)
    local: dict[int, dict[str, Any]] = {}
    for position, entries in state["state"].items():
        flat, index = places[int(position)]
        local[int(position)] = {key: _rows(flat.shards, index, value).clone()
                                if torch.is_tensor(value) and value.dim() > 0 else value
                                for key, value in entries.items()}
    optimizer.load_state_dict({"state": local, "param_groups": state["param_groups"]})


@torch.no_grad()
def sharded_state(model: Any, optimizer: torch.optim.Optimizer) -> dict[str, Piece]:
    """This rank's pieces for a sharded checkpoint (the contract's ``sharded_state``): its rows of every parameter
    (under each of its names: a tied weight appears twice) and of every per-element optimizer state, no
    communication; the buffers and the replicated parameters whole, on the first rank."""
    pieces: dict[str, Piece] = {}
    for flat in _flats(model):
        if flat.replicated and model.rank != 0:
            continue
        for index, (piece, names) in enumerate(zip(flat.pieces, flat.names, strict=True)):
            begin = flat.shards.local_rows(index)[0] * flat.shards.row_numel[index]
            pieces.update((f"model/{name}", (piece.detach(), list(flat.shards.shapes[index]), begin, 0))
                          for name in names)
    for position, (flat, index) in enumerate(_piece_places(model, optimizer)):
        if flat.replicated and model.rank != 0:
            continue
        begin = flat.shards.local_rows(index)[0] * flat.shards.row_numel[index]
        pieces.update((f"optimizer/{position}/{key}", (value, list(flat.shards.shapes[index]), begin, 0))
                      for key, value in optimizer.state.get(flat.pieces[index], {}).items()
                      if torch.is_tensor(value) and value.dim() > 0)
    if model.rank == 0:
        pieces.update((f"model/{name}", (buffer.detach(), list(buffer.shape), 0, 0))
                      for name, buffer in model.module.named_buffers() if name in model.module.state_dict())
    return pieces
