"""Checkpoints that resume a run exactly, and survive a crash in the middle of a save (lesson 09).

**What a run needs to continue as if it had never stopped.**  Not only the weights: the optimizer's state
(Adam's moments and step counts), the learning-rate schedule's position, the loss scaler's scale and growth
counter, the step, the position of every data sampler, and every random number generator, on *every* rank:
dropout draws different masks on each rank, and each data-parallel rank samples its own batches.  Leave out any
one of them and the resumed run drifts from the uninterrupted one, usually without any error: a resume that
forgets the RNG redraws the same dropout masks again, one that forgets the sampler trains on batches it has
already seen.  :func:`save` takes all of them, :func:`load` puts all of them back, and the tests hold a resumed
run to the uninterrupted one *bit for bit*.

**The full layout** (``layout="full"``): the unsharded model and optimizer state, gathered through the wrapper
contract (``full_state_dict()``, ``full_optimizer_state_dict(optimizer)``: collectives where the state is
sharded) and written by the first rank only, the rule of thumb "checkpoint only on rank 0".  The per-rank parts
(RNG and sampler states) travel to the first rank with ``all_gather_object``, so it resumes on the same number of
ranks, where every part has its owner.

**The sharded layout** (``layout="sharded"``): each rank writes the pieces of the states it holds
(``sharded_state(optimizer)`` of the contract) to ``shard-RRRRR-of-NNNNN.pt``, with its RNG and sampler states.
FSDP writes its rows of every parameter and of Adam's moments, and gathers nothing; replicated states are written
whole, once, by the first rank (ZeRO's optimizer state too, gathered: its own pieces are not written yet); the first rank writes what every rank shares (``common.pt``: the optimizer's hyperparameters and step
counts, the schedule, the scaler, the step) and the manifest, which says for every tensor which file holds which
flat range of it.  Loading on ``M`` ranks, any ``M``, assembles each tensor from its pieces and hands it to the
wrapper's ``load_full_*`` methods, which keep this rank's part: that is *resharding*.  On another number of ranks
the per-rank RNG and sampler states have no owner, so they are left as they are (``Resumed.resharded``).  The
price of this simple loader: every rank reads every shard file and holds the whole state while it loads.

**Atomic.**  A checkpoint is a directory.  Each file is written under a temporary name in that directory,
flushed and ``fsync``-ed, then renamed (``os.replace`` is atomic on POSIX), and the directory is ``fsync``-ed.
``manifest.json`` comes last, with every file's size and SHA-256: a directory without a manifest is a save that
did not finish, and :func:`latest` never picks it.  A process killed at any moment (``SIGKILL``: no ``finally``
runs) leaves at worst a half-written temporary file, never a damaged checkpoint.

**Loading is defensive.**  Files are read with ``torch.load(weights_only=True)`` (no pickled code runs), and
before that checked against the manifest: a missing file, a truncated one (its size) and a corrupted one (its
checksum) are each a :class:`CheckpointError` naming the file; so is a model of another shape (naming the
tensor and both shapes) or a rank count the per-rank parts do not cover.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist

from labkit.checkpoint.files import (
    FORMAT,
    MANIFEST,
    CheckpointError,
    check_files,
    read_file,
    read_manifest,
    rng_state,
    serialise,
    set_rng_state,
    write_atomically,
)

__all__ = ["COMMON", "LAYOUTS", "STATE", "Resumed", "check_compatible", "load", "load_dcp_model", "save", "shard_file"]

STATE, COMMON = "state.pt", "common.pt"
LAYOUTS = ("full", "sharded")


def shard_file(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.pt"


@dataclass
class Resumed:
    """What :func:`load` restored besides the objects it was given: the step, the caller's ``extra``, and whether
    the checkpoint came from another number of ranks (then this rank's RNG and samplers were left alone)."""

    step: int
    extra: dict[str, Any] = field(default_factory=dict)
    resharded: bool = False


def _world(group: Any) -> tuple[int, int]:
    if group is None and not torch_dist.is_initialized():
        return 0, 1
    return torch_dist.get_rank(group), torch_dist.get_world_size(group)


def _gather_objects(value: Any, group: Any) -> list[Any]:
    if _world(group)[1] == 1:
        return [value]
    everyone: list[Any] = [None] * _world(group)[1]
    torch_dist.all_gather_object(everyone, value, group=group)
    return everyone


def _per_rank(model: Any, generators: Mapping[str, torch.Generator] | None) -> dict[str, Any]:
    return {"rng": rng_state(), "generators": {name: g.get_state() for name, g in (generators or {}).items()},
            "wrapper": {name: state.cpu() for name, state in model.random_states().items()}}


def _shapes(model_state: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    return {name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
            for name, t in model_state.items()}


def _split_optimizer(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[int, dict[str, torch.Tensor]]]:
    """An optimizer state dict as (what every rank shares: groups and scalar states, per-element tensors)."""
    shared = {"param_groups": state["param_groups"], "scalars": {}}
    tensors: dict[int, dict[str, torch.Tensor]] = {}
    for position, entries in state["state"].items():
        for key, value in entries.items():
            if torch.is_tensor(value) and value.dim() > 0:
                tensors.setdefault(int(position), {})[key] = value
            else:
                shared["scalars"].setdefault(int(position), {})[key] = value
    return shared, tensors


def save(path: str | os.PathLike, model: Any, optimizer: torch.optim.Optimizer, step: int, *,
         scheduler: Any = None, scaler: Any = None, generators: Mapping[str, torch.Generator] | None = None,
         extra: Mapping[str, Any] | None = None, layout: str = "full", group: Any = None) -> Path:
    """Save the training state to directory ``path`` in ``layout`` (see the module docstring).  Every rank of
    ``group`` calls it (it gathers); ``model`` is a parallel wrapper (the contract of ``labkit.parallel.base``);
    ``generators`` the data samplers' ``torch.Generator`` s by name; ``extra`` plain values to keep."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    path = Path(path)
    rank, world = _world(group)
    shared = {"scheduler": scheduler.state_dict() if scheduler is not None else None, "step": step,
              "scaler": scaler.state_dict() if scaler is not None else None, "extra": dict(extra or {})}
    manifest = {"format": FORMAT, "layout": layout, "step": step, "world_size": world, "files": {}}
    if layout == "full":
        model_state = model.full_state_dict()
        manifest["model"] = _shapes(model_state)
        shared.update(model={k: v.detach().cpu() for k, v in model_state.items()},
                      optimizer=model.full_optimizer_state_dict(optimizer), ranks=_gather_objects(
                          _per_rank(model, generators), group))
        if rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            manifest["files"][STATE] = write_atomically(path / STATE, serialise(shared))
    else:
        common, _ = _split_optimizer(optimizer.state_dict())
        pieces = model.sharded_state(optimizer)  # key -> (piece, whole shape, first element, dimension)
        path.mkdir(parents=True, exist_ok=True)
        name = shard_file(rank, world)
        written = write_atomically(path / name, serialise(
            {"pieces": {key: piece.detach().cpu().movedim(dim, 0).reshape(-1)
                        for key, (piece, _, _, dim) in pieces.items()},
             "rank": _per_rank(model, generators)}))
        table = {key: (list(shape), str(piece.dtype).removeprefix("torch."), begin, begin + piece.numel(), dim)
                 for key, (piece, shape, begin, dim) in pieces.items()}
        everyone = _gather_objects((name, written, table), group)
        if rank == 0:
            tensors: dict[str, Any] = {}
            for file, digest, entries in everyone:
                manifest["files"][file] = digest
                for key, (shape, dtype, begin, end, dim) in entries.items():
                    tensors.setdefault(key, {"shape": shape, "dtype": dtype, "dim": dim, "pieces": []})[
                        "pieces"].append([file, begin, end])
            manifest["tensors"] = tensors
            manifest["model"] = {key[len("model/"):]: {"shape": info["shape"], "dtype": info["dtype"]}
                                 for key, info in tensors.items() if key.startswith("model/")}
            manifest["files"][COMMON] = write_atomically(path / COMMON, serialise({**shared, "optimizer": common}))
    if rank == 0:
        write_atomically(path / MANIFEST, json.dumps(manifest, indent=1).encode())
    if world > 1:
        torch_dist.barrier(group=group)  # nobody reads it before it is complete
    return path


def check_compatible(path: str | os.PathLike, shapes: Mapping[str, Any], world: int) -> dict[str, Any]:
    """The manifest of checkpoint ``path``, if a model whose tensors have ``shapes`` (name -> shape) can resume
    from it on ``world`` ranks and every file it lists is there at its size (:func:`check_files`: a ``stat`` a
    file); else :class:`CheckpointError` naming what differs or which file.  :func:`load` checks this first, and
    so does ``python -m labkit.train --resume``, before any process starts."""
    path = Path(path)
    manifest = read_manifest(path)
    check_files(path, manifest)
    saved = manifest["model"]
    missing, unexpected = sorted(set(shapes) - set(saved)), sorted(set(saved) - set(shapes))
    if missing or unexpected:
        raise CheckpointError(f"{path / MANIFEST}: a different model: missing {missing[:5]}, unexpected "
                              f"{unexpected[:5]}")
    for name, shape in shapes.items():
        if list(shape) != saved[name]["shape"]:
            raise CheckpointError(f"{path / MANIFEST}: a different model shape: {name} is "
                                  f"{tuple(saved[name]['shape'])} in the checkpoint, {tuple(shape)} here")
    if manifest["layout"] == "full" and manifest["world_size"] != world:
        raise CheckpointError(f"{path / MANIFEST}: saved on {manifest['world_size']} rank(s), loading on {world}: "
                              "each rank's RNG and sampler states have no owner (the full layout resumes exactly on "
                              "the same number of ranks; the sharded layout reshards)")
    return manifest


def _assemble(path: Path, manifest: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every tensor of a sharded checkpoint, whole, from its pieces; and each shard file's per-rank part."""
    shards = {name: read_file(path, name, manifest) for name in manifest["files"] if name.startswith("shard-")}
    whole: dict[str, torch.Tensor] = {}
    for key, info in manifest["tensors"].items():
        numel = math.prod(info["shape"])
        flat = torch.empty(numel, dtype=getattr(torch, info["dtype"]))
        covered = 0
        for file, begin, end in info["pieces"]:
            flat[begin:end] = shards[file]["pieces"][key]
            covered += end - begin
        if covered != numel:
            raise CheckpointError(f"{path / MANIFEST}: {key}'s pieces cover {covered} of its {numel} elements")
        dim = info.get("dim", 0)  # the pieces' elements are counted with this dimension moved first
        moved = [info["shape"][dim], *info["shape"][:dim], *info["shape"][dim + 1:]]
        whole[key] = flat.view(moved).movedim(0, dim).contiguous()
    return whole, {name: shard["rank"] for name, shard in shards.items()}


def load(path: str | os.PathLike, model: Any, optimizer: torch.optim.Optimizer, *, scheduler: Any = None,
         scaler: Any = None, generators: Mapping[str, torch.Generator] | None = None, group: Any = None) -> Resumed:
    """Restore what :func:`save` wrote (either layout) into the given objects, on every rank of ``group``, and
    this rank's RNG and sampler states; return the step and ``extra``.  Checks the files and shapes first."""
    path = Path(path)
    rank, world = _world(group)
    manifest = check_compatible(path, {name: t.shape for name, t in model.full_state_dict().items()}, world)
    saved_world = manifest["world_size"]
    if manifest["layout"] == "full":
        state = read_file(path, STATE, manifest)
        model_state, optimizer_state, mine = state["model"], state["optimizer"], state["ranks"][rank]
    else:
        state = read_file(path, COMMON, manifest)
        whole, ranks = _assemble(path, manifest)
        model_state = {key[len("model/"):]: tensor for key, tensor in whole.items() if key.startswith("model/")}
        per_element: dict[int, dict[str, Any]] = {}
        for key, tensor in whole.items():
            if key.startswith("optimizer/"):
                _, position, name = key.split("/", 2)
                per_element.setdefault(int(position), {})[name] = tensor
        for position, scalars in state["optimizer"]["scalars"].items():
            per_element.setdefault(int(position), {}).update(scalars)
        optimizer_state = {"state": per_element, "param_groups": state["optimizer"]["param_groups"]}
        mine = ranks.get(shard_file(rank, world)) if saved_world == world else None
    model.load_full_state_dict(model_state)
    model.load_full_optimizer_state_dict(optimizer, optimizer_state)
    for name, thing in (("scheduler", scheduler), ("scaler", scaler)):
        if thing is not None:
            if state[name] is None:
                raise CheckpointError(f"{path}: has no {name} state (it was saved without one)")
            thing.load_state_dict(state[name])
    if mine is not None:
        for name, generator in (generators or {}).items():
            if name not in mine["generators"]:
                raise CheckpointError(f"{path}: no generator {name!r} (saved: {sorted(mine['generators'])})")
            generator.set_state(mine["generators"][name])
        set_rng_state(mine["rng"])
        model.load_random_states(mine.get("wrapper", {}))
    return Resumed(state["step"], state["extra"], resharded=mine is None)


def load_dcp_model(path: str | os.PathLike, model: Any, key: str = "model") -> None:
    """Load the model weights of a ``torch.distributed.checkpoint`` (DCP) directory, saved by any number of ranks
    as ``dcp.save({key: model_state_dict})`` (e.g. from ``fully_shard``), into ``model``, a labkit wrapper on any
    number of ranks: every rank reads the whole tensors with DCP's own reader (no collective) and keeps its part
    (``load_full_state_dict``).  The interoperation of lesson 09: DCP writes, labkit resumes."""
    import torch.distributed.checkpoint as dcp

    if not (Path(path) / ".metadata").is_file():
        raise CheckpointError(f"{Path(path) / '.metadata'}: missing; {path} is not a torch.distributed.checkpoint")
    full = model.full_state_dict()
    target = {key: {name: torch.empty_like(tensor, device="cpu") for name, tensor in full.items()}}
    dcp.load(target, checkpoint_id=str(path), no_dist=True)
    model.load_full_state_dict(target[key])
