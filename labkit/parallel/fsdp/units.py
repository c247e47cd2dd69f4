"""How :class:`~labkit.parallel.fsdp.FullyShardedDataParallel` cuts a model: into *units* (gathered one at a
time) and, within each unit, *flat parameters* (one collective each), sharded or replicated; the checks of its
arguments; and the model-state bytes a rank holds, predicted from that layout (:func:`predicted_memory`).

**Which parameters are sharded.**  ``shard_modules=None`` (the default) shards every parameter: ZeRO-3.  Otherwise
a parameter is sharded when it lies inside one of the chosen modules (each entry a module type, such as
``nn.Linear``, meaning every submodule of that type; a submodule's name as ``named_modules()`` spells it; or the
submodule itself), as FSDP2's ``fully_shard(module)`` takes charge of every parameter below ``module``; every
other parameter is *replicated*.  A parameter two modules share is sharded when either is chosen.

**A replicated flat parameter** uses the same machinery with a layout of one "rank" (``FlatShards(shapes, 1,
0)``): its shard is the whole of every parameter, so ``pieces`` are the full parameters, the unit's "gather" is a
local copy into the compute dtype, and its gradients are all-reduced (summed, then divided by ``N``, the order of
the reduce-scatter path) instead of reduce-scattered.  Checkpoints need no change: every rank's rows of a
replicated parameter are all of them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from labkit.costmodel.memory import predicted_model_state_bytes
from labkit.parallel.flat_shards import FlatShards


class FlatParameter:
    """A unit's parameters of one kind (sharded or replicated, dtype, ``requires_grad``): this rank's part
    (``pieces``, views of one flat ``shard`` buffer), and the full parameters while the unit is gathered."""

    def __init__(self, parameters: list[nn.Parameter], slots: list[list[tuple[nn.Module, str]]],
                 names: list[list[str]], world_size: int, rank: int, compute_dtype: torch.dtype,
                 replicated: bool = False):
        self.slots, self.names, self.requires_grad = slots, names, parameters[0].requires_grad
        self.replicated = replicated
        self.shards = FlatShards([p.shape for p in parameters], 1 if replicated else world_size,
                                  0 if replicated else rank)
        self.shard = self.shards.pack_shard([p.detach() for p in parameters])
        self.pieces = [nn.Parameter(view, requires_grad=self.requires_grad)
                       for view in self.shards.shard_views(self.shard)]
        self.full_parameters = [nn.Parameter(torch.empty(p.shape, dtype=compute_dtype, device=p.device),
                                             requires_grad=self.requires_grad) for p in parameters]
        for p in self.full_parameters:
            p.untyped_storage().resize_(0)
        self.accumulated: list[torch.Tensor | None] = [None] * len(parameters)  # unsharded, while sync is off
        self.gathering: torch.Tensor | None = None  # the padded all-gather output, while in flight
        self.handle, self.gathered = None, False


@dataclass(eq=False)
class Unit:
    module: nn.Module
    flats: list[FlatParameter]
    is_root: bool = False

    def use(self, full: bool) -> None:
        """Put the full parameters (or this rank's pieces) into the modules."""
        for flat in self.flats:
            for tensor, slots in zip(flat.full_parameters if full else flat.pieces, flat.slots, strict=True):
                for module, attribute in slots:
                    module._parameters[attribute] = tensor


def make_units(module: nn.Module, unit_modules: list[nn.Module], sharded: set[int], world_size: int, rank: int,
               compute_dtype: torch.dtype) -> list[Unit]:
    """The root unit (every parameter no single unit module holds), then one per unit module; each parameter
    sharded when its ``id`` is in ``sharded``.  Afterwards the module holds this rank's pieces."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}  # id(parameter) -> where the modules hold it
    names: dict[int, list[str]] = {}
    parameters: dict[int, nn.Parameter] = {}
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for attribute, p in owner._parameters.items():
            if p is not None and (owner, attribute) not in slots.get(id(p), []):
                slots.setdefault(id(p), []).append((owner, attribute))
                names.setdefault(id(p), []).append(f"{prefix}.{attribute}" if prefix else attribute)
                parameters[id(p)] = p
    holders = [{id(p) for p in unit_module.parameters()} for unit_module in unit_modules]
    members: list[list[nn.Parameter]] = [[] for _ in range(len(unit_modules) + 1)]  # root first
    for key, p in parameters.items():
        held_by = [index for index, held in enumerate(holders) if key in held]
        members[held_by[0] + 1 if len(held_by) == 1 else 0].append(p)  # shared or unclaimed: root
    units = []
    for index, unit_parameters in enumerate(members):
        flats = []
        for kind in dict.fromkeys((id(p) not in sharded, p.dtype, p.requires_grad) for p in unit_parameters):
            chosen = [p for p in unit_parameters if (id(p) not in sharded, p.dtype, p.requires_grad) == kind]
            flats.append(FlatParameter(chosen, [slots[id(p)] for p in chosen], [names[id(p)] for p in chosen],
                                       world_size, rank, compute_dtype, replicated=kind[0]))
        units.append(Unit(module if index == 0 else unit_modules[index - 1], flats, is_root=index == 0))
    for unit in units:
        unit.use(full=False)
    return units


def predicted_memory(units: list[Unit], master_dtype: torch.dtype, reduce_dtype: torch.dtype,
                     optimizer: str = "adam") -> dict[str, int]:
    """Model-state bytes a rank holds between steps (after an optimizer step), from the layout and
    ``labkit.costmodel.memory``'s bytes per parameter (fp32 shards): each flat parameter's shard buffer (its
    padded chunks; a replicated one: the whole parameters) in weights and, when trainable, gradients (one reduced
    buffer, viewed; reduced in another dtype, each piece's own copy); the optimizer's states for this rank's real
    elements.  With shards that divide evenly: ZeRO-3's ``16 Psi_s / N`` plus stage 0's ``16 Psi_r``."""
    if master_dtype != torch.float32:
        raise ValueError(f"predicted_memory models fp32 shards (bytes_per_parameter('fp32')), got {master_dtype}")
    held: Counter = Counter()
    for flat in (flat for unit in units for flat in unit.flats):
        real = sum(piece.numel() for piece in flat.pieces)
        held["weights"] += flat.shards.shard_numel
        if flat.requires_grad:
            held["gradients"] += flat.shards.shard_numel if reduce_dtype == master_dtype else real
            held["optimizer_states"] += real
    return {name: predicted_model_state_bytes(held[name], "fp32", optimizer)[name]
            for name in ("weights", "gradients", "optimizer_states")}


# --------------------------------------------------------------------------------------------------------
# The arguments


def check_arguments(module: Any, compute_dtype: Any, reduce_dtype: Any, units: Any, prefetch: Any,
                    shard_modules: Any) -> tuple[list[nn.Module], set[int]]:
    """Check the arguments; return the unit modules (given, or found) and the ids of the parameters to shard."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}: {module!r:.80}")
    parameters = list(module.parameters())
    if not parameters or any(not p.is_floating_point() for p in parameters):
        raise ValueError("module must have parameters, every one floating point, to shard and reduce them")
    for name, dtype in (("compute_dtype", compute_dtype), ("reduce_dtype", reduce_dtype)):
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"{name} must be None or a floating-point torch.dtype, got {dtype!r}")
    if len({p.dtype for p in parameters}) > 1 and (compute_dtype is None or reduce_dtype is None):
        raise ValueError("the module mixes parameter dtypes; pass compute_dtype and reduce_dtype explicitly")
    if not isinstance(prefetch, bool):
        raise TypeError(f"prefetch must be True or False, got {prefetch!r}")
    return _unit_modules(module, units), _sharded_parameters(module, shard_modules)


def _unit_modules(module: nn.Module, units: Any) -> list[nn.Module]:
    submodules = {id(m) for m in module.modules() if m is not module}
    if units is None:
        found = [child for name, lst in module.named_modules() if name.split(".")[-1] in ("blocks", "layers")
                 and isinstance(lst, (nn.ModuleList, nn.Sequential)) for child in lst if child is not None]
        return [m for m in found if not any(m is not other and any(m is sub for sub in other.modules())
                                            for other in found)]
    units = list(units)
    for index, unit in enumerate(units):
        if not isinstance(unit, nn.Module) or id(unit) not in submodules:
            raise ValueError(f"every unit must be a submodule of module (not module itself), got {unit!r:.80}")
        inner = [other for at, other in enumerate(units) if at != index and any(other is m for m in unit.modules())]
        if inner:
            raise ValueError(f"units must not nest or repeat: {type(inner[0]).__name__} is (inside) "
                             f"{type(unit).__name__}")
    return units


def _sharded_parameters(module: nn.Module, shard_modules: Any) -> set[int]:
    """The ids of the parameters inside the modules ``shard_modules`` chooses (``None``: every parameter)."""
    if shard_modules is None:
        return {id(p) for p in module.parameters()}
    if isinstance(shard_modules, (type, str, nn.Module)):
        shard_modules = [shard_modules]
    if not isinstance(shard_modules, Iterable):
        raise TypeError(f"shard_modules must be None or module types, submodule names or submodules (e.g. "
                        f"(nn.Linear, nn.Embedding)), got {shard_modules!r:.80}")
    named = dict(module.named_modules())
    chosen: set[int] = set()
    for entry in shard_modules:
        if isinstance(entry, type) and issubclass(entry, nn.Module):
            found, where = [m for m in module.modules() if isinstance(m, entry)], f"no {entry.__name__} in it"
        elif isinstance(entry, str):
            found = [named[entry]] if entry in named else []
            where = f"no submodule of that name (named_modules() has {[n for n in named if n][:4]}, ...)"
        elif isinstance(entry, nn.Module):
            found, where = [m for m in module.modules() if m is entry], "not a submodule of the module"
        else:
            raise TypeError(f"each entry of shard_modules must be a module type (nn.Linear), a submodule's name "
                            f"('blocks.0.mlp') or a submodule, got {type(entry).__name__}: {entry!r:.80}")
        selected = {id(p) for m in found for p in m.parameters()}
        if not selected:
            raise ValueError(f"shard_modules entry {getattr(entry, '__name__', entry)!r:.80} selects no parameter "
                             f"of the module: {where if not found else 'its modules hold none'}")
        chosen |= selected
    return chosen
