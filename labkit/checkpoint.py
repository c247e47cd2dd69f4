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
(RNG and sampler states) travel to the first rank with ``all_gather_object``.  Any world size can load it.

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

import hashlib
import json
import os
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as torch_dist

FORMAT = "labkit-checkpoint/1"
MANIFEST = "manifest.json"
STATE = "state.pt"
STEP_DIRECTORY = re.compile(r"^step-(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the message names the file and what is wrong with it."""


@dataclass
class Resumed:
    """What :func:`load` restored besides the objects it was given: the step, and the caller's ``extra``."""

    step: int
    extra: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------------------
# Random number generators: this process's, as tensors and plain values (weights_only-safe)


def rng_state() -> dict[str, Any]:
    """This process's generators: torch's CPU generator, every CUDA device's (where CUDA is initialised),
    Python's ``random`` and NumPy's global generator."""
    kind, keys, position, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, gauss)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Put back what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, position, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------------------------------------
# Files: atomic writes, the manifest, checked reads


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_atomically(path: Path, data: bytes) -> dict[str, Any]:
    """Write ``data`` to ``path`` so that ``path`` is either absent, or old, or complete: a temporary file in
    the same directory, flushed and fsynced, renamed over ``path``.  Returns its size and SHA-256."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.partial")
    with open(temporary, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    _fsync_directory(path.parent)
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _serialise(value: Any) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of checkpoint directory ``path``; :class:`CheckpointError` if there is none (a save that did
    not finish, or not a checkpoint) or it is not labkit's."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not manifest_path.is_file():
        raise CheckpointError(f"{manifest_path}: missing; {path} is not a finished checkpoint (a save that was "
                              "interrupted leaves no manifest)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{manifest_path}: unreadable ({error})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def read_file(path: str | os.PathLike, name: str, manifest: Mapping[str, Any] | None = None) -> Any:
    """File ``name`` of checkpoint ``path``, checked against the manifest (present, its size, its SHA-256),
    then loaded with ``torch.load(weights_only=True)`` onto the CPU."""
    path = Path(path)
    manifest = read_manifest(path) if manifest is None else manifest
    expected = manifest["files"].get(name)
    file = path / name
    if expected is None:
        raise CheckpointError(f"{file}: not listed in {path / MANIFEST}")
    if not file.is_file():
        raise CheckpointError(f"{file}: missing (the manifest lists it, {expected['bytes']:,} bytes)")
    data = file.read_bytes()
    if len(data) != expected["bytes"]:
        raise CheckpointError(f"{file}: truncated or overwritten: {len(data):,} bytes, the manifest says "
                              f"{expected['bytes']:,}")
    if hashlib.sha256(data).hexdigest() != expected["sha256"]:
        raise CheckpointError(f"{file}: corrupted: its SHA-256 differs from the manifest's")
    import io

    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def step_directory(root: str | os.PathLike, step: int) -> Path:
    """Where the checkpoint of ``step`` goes under ``root``: ``root/step-00000100``."""
    return Path(root) / f"step-{step:08d}"


def latest(root: str | os.PathLike) -> Path | None:
    """The finished checkpoint of the highest step under ``root`` (``step-NNNNNNNN`` directories with a
    manifest), or None.  Unfinished saves (no manifest) are passed over."""
    root = Path(root)
    if not root.is_dir():
        return None
    found = []
    for child in root.iterdir():
        match = STEP_DIRECTORY.match(child.name)
        if match and child.is_dir() and (child / MANIFEST).is_file():
            found.append((int(match.group(1)), child))
    return max(found)[1] if found else None


# --------------------------------------------------------------------------------------------------------
# Save and load the training state


def _world(group: Any) -> tuple[int, int]:
    if group is None and not torch_dist.is_initialized():
        return 0, 1
    return torch_dist.get_rank(group), torch_dist.get_world_size(group)


def _gather_objects(value: Any, group: Any) -> list[Any]:
    rank, world = _world(group)
    if world == 1:
        return [value]
    everyone: list[Any] = [None] * world
    torch_dist.all_gather_object(everyone, value, group=group)
    return everyone


def _per_rank(generators: Mapping[str, torch.Generator] | None) -> dict[str, Any]:
    return {"rng": rng_state(), "generators": {name: g.get_state() for name, g in (generators or {}).items()}}


def save(path: str | os.PathLike, model: Any, optimizer: torch.optim.Optimizer, step: int, *,
         scheduler: Any = None, scaler: Any = None, generators: Mapping[str, torch.Generator] | None = None,
         extra: Mapping[str, Any] | None = None, group: Any = None) -> Path:
    """Save the training state to directory ``path`` (full layout; see the module docstring).  Every rank of
    ``group`` calls it (the gathers are collectives); the first rank writes.  ``model`` is a parallel wrapper
    (``labkit.parallel``: anything with ``full_state_dict`` and ``full_optimizer_state_dict``); ``generators``
    the data samplers' ``torch.Generator`` s by name; ``extra`` anything else picklable as plain values."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    path = Path(path)
    model_state = model.full_state_dict()
    optimizer_state = model.full_optimizer_state_dict(optimizer)
    ranks = _gather_objects(_per_rank(generators), group)
    rank, world = _world(group)
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        state = {"model": {k: v.detach().cpu() for k, v in model_state.items()}, "optimizer": optimizer_state,
                 "scheduler": scheduler.state_dict() if scheduler is not None else None,
                 "scaler": scaler.state_dict() if scaler is not None else None, "ranks": ranks,
                 "step": step, "extra": dict(extra or {})}
        files = {STATE: write_atomically(path / STATE, _serialise(state))}
        manifest = {"format": FORMAT, "layout": "full", "step": step, "world_size": world, "files": files,
                    "model": {name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                              for name, t in model_state.items()}}
        write_atomically(path / MANIFEST, json.dumps(manifest, indent=1).encode())
    if world > 1:
        torch_dist.barrier(group=group)  # nobody reads it before it is complete
    return path


def _check_model(path: Path, saved: Mapping[str, Any], model_state: Mapping[str, torch.Tensor]) -> None:
    missing = sorted(set(model_state) - set(saved))
    unexpected = sorted(set(saved) - set(model_state))
    if missing or unexpected:
        raise CheckpointError(f"{path / MANIFEST}: a different model: missing {missing[:5]}, unexpected "
                              f"{unexpected[:5]}")
    for name, tensor in model_state.items():
        if list(tensor.shape) != saved[name]["shape"]:
            raise CheckpointError(f"{path / MANIFEST}: a different model shape: {name} is "
                                  f"{tuple(saved[name]['shape'])} in the checkpoint, {tuple(tensor.shape)} here")


def load(path: str | os.PathLike, model: Any, optimizer: torch.optim.Optimizer, *, scheduler: Any = None,
         scaler: Any = None, generators: Mapping[str, torch.Generator] | None = None, group: Any = None) -> Resumed:
    """Restore what :func:`save` wrote into the given objects, on every rank of ``group``, and this rank's RNG
    and sampler states; return the step and ``extra``.  Checks the files and the model's shapes first."""
    path = Path(path)
    manifest = read_manifest(path)
    rank, world = _world(group)
    _check_model(path, manifest["model"], model.full_state_dict())
    if manifest["world_size"] != world:
        raise CheckpointError(f"{path / MANIFEST}: saved on {manifest['world_size']} rank(s), loading on {world}: "
                              "each rank's RNG and sampler states have no owner (the full layout resumes "
                              "exactly on the same number of ranks)")
    state = read_file(path, STATE, manifest)
    model.load_full_state_dict(state["model"])
    model.load_full_optimizer_state_dict(optimizer, state["optimizer"])
    for name, thing in (("scheduler", scheduler), ("scaler", scaler)):
        if thing is not None:
            if state[name] is None:
                raise CheckpointError(f"{path / STATE}: has no {name} state (it was saved without one)")
            thing.load_state_dict(state[name])
    mine = state["ranks"][rank]
    for name, generator in (generators or {}).items():
        if name not in mine["generators"]:
            raise CheckpointError(f"{path / STATE}: no generator {name!r} (saved: {sorted(mine['generators'])})")
        generator.set_state(mine["generators"][name])
    set_rng_state(mine["rng"])
    return Resumed(state["step"], state["extra"])
