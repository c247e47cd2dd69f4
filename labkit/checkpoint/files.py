"""The files of a labkit checkpoint (lesson 09): atomic writes, the manifest with sizes and SHA-256, checked
reads with ``torch.load(weights_only=True)``, finding the newest finished checkpoint, and this process's random
number generators as plain values.  ``labkit.checkpoint`` builds the training state on these; see its docstring
for why each step is there.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT = "labkit-checkpoint/1"
MANIFEST = "manifest.json"
STEP_DIRECTORY = re.compile(r"^step-(\d+)$")
# A file being written: ".NAME.pidPID@HOST.partial" (the writer's process and machine: a shared file system sees
# several), or labkit 0.x's ".NAME.PID.partial" (this machine's).
PARTIAL = re.compile(r"^\..+?\.(?:pid(?P<pid>\d+)@(?P<host>.+)|(?P<old_pid>\d+))\.partial$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the message names the file and what is wrong with it."""


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
    temporary = path.with_name(f".{path.name}.pid{os.getpid()}@{socket.gethostname()}.partial")
    with open(temporary, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    _fsync_directory(path.parent)
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def stale_partial_files(root: str | os.PathLike) -> list[Path]:
    """The temporary files under ``root`` (itself and its ``step-NNNNNNNN`` directories) whose writer is gone: a
    process of this machine that no longer exists, killed while it wrote (``SIGKILL``, a lost node: no
    ``finally`` ran).  A writer on another machine, or a live one, is left alone."""
    root = Path(root)
    if not root.is_dir():
        return []
    folders = [root] + [child for child in root.iterdir() if STEP_DIRECTORY.match(child.name) and child.is_dir()]
    here, stale = socket.gethostname(), []
    for folder in folders:
        for file in folder.iterdir():
            match = PARTIAL.match(file.name)
            if match is None or (match["host"] is not None and match["host"] != here):
                continue
            if not _process_exists(int(match["pid"] or match["old_pid"])):
                stale.append(file)
    return sorted(stale)


def remove_stale_partial_files(root: str | os.PathLike) -> list[tuple[Path, int]]:
    """Delete :func:`stale_partial_files` under ``root``; return each one removed with its size in bytes."""
    removed = []
    for file in stale_partial_files(root):
        try:
            size = file.stat().st_size
            file.unlink()
        except FileNotFoundError:  # another process cleaned it first
            continue
        removed.append((file, size))
    return removed


def serialise(value: Any) -> bytes:
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


def _check_size(file: Path, expected: Mapping[str, Any]) -> None:
    """:class:`CheckpointError` unless ``file`` exists with the manifest's size: one ``stat``, no read."""
    try:
        size = file.stat().st_size if file.is_file() else None
    except OSError:
        size = None
    if size is None:
        raise CheckpointError(f"{file}: missing (the manifest lists it, {expected['bytes']:,} bytes)")
    if size != expected["bytes"]:
        raise CheckpointError(f"{file}: truncated or overwritten: {size:,} bytes, the manifest says "
                              f"{expected['bytes']:,}")


def check_files(path: str | os.PathLike, manifest: Mapping[str, Any]) -> None:
    """Every file the manifest of checkpoint ``path`` lists is there, at its size (:class:`CheckpointError`
    naming the first that is not).  A ``stat`` a file: cheap enough to run before any rank starts, where a lost
    shard would otherwise be found by the rank that reads it (the checksums are read with the files)."""
    for name, expected in manifest["files"].items():
        _check_size(Path(path) / name, expected)


def read_file(path: str | os.PathLike, name: str, manifest: Mapping[str, Any] | None = None) -> Any:
    """File ``name`` of checkpoint ``path``, checked against the manifest (present, its size, its SHA-256),
    then loaded with ``torch.load(weights_only=True)`` onto the CPU."""
    path = Path(path)
    manifest = read_manifest(path) if manifest is None else manifest
    expected = manifest["files"].get(name)
    file = path / name
    if expected is None:
        raise CheckpointError(f"{file}: not listed in {path / MANIFEST}")
    _check_size(file, expected)
    data = file.read_bytes()  # a file changed since the stat fails the checksum
    if hashlib.sha256(data).hexdigest() != expected["sha256"]:
        raise CheckpointError(f"{file}: corrupted: its SHA-256 differs from the manifest's")
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
