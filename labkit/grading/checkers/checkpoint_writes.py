"""Exercise 09's checks of how the checkpoint is written: who writes, and whether a crash could leave half a file.

Both watch the student's save with :func:`labkit.grading.files.watching` on every rank (see
:mod:`labkit.grading.checkers.checkpointing` for what each check asks, and :mod:`labkit.grading.files` for how
the writes are seen whatever name they were made through).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from labkit.grading import CheckFailed, files, guard
from labkit.grading.checkers import checkpoint_run as training
from labkit.grading.checkers.checkpoint_run import BUILT_INS, CHECKER_TOOLS, LAUNCH_TIMEOUT
from labkit.launch import RankFailed, launch

SLOW_RANK_ZERO = 0.3  # seconds rank 0 waits before the save and before each of its writes, in the write check
REFUSED = "bytes to a file (the kernel refused them)"
RECIPE = "write path + '.tmp' beside it, flush and os.fsync it, os.replace it onto path, then fsync the folder"


def _save_watched(module, path: str, slow: bool, relative: bool = False) -> dict[str, Any]:
    """The student's save, every file event of this rank recorded (rank 0 slowed when ``slow``; the other ranks
    may not write a byte), then a load the moment it returns; ``relative``: the save is given a bare file name,
    from the folder as working directory."""
    run = training.build(training.FIRST_RUN)
    training.train_step(run)
    rank = dist.get_rank()
    if relative:
        os.chdir(os.path.dirname(path))
    if slow and rank == 0:
        time.sleep(SLOW_RANK_ZERO)
    with files.watching(module, may_write=rank == 0, slow_s=SLOW_RANK_ZERO if slow and rank == 0 else 0.0) as log:
        try:
            module.save_checkpoint(os.path.basename(path) if relative else path, run.model, run.optimizer,
                                   run.generator, 1)
        except Exception:
            if files.refused(log):  # the kernel refused this rank's bytes: say so, not what failed after
                folder = os.path.dirname(os.path.abspath(path))
                raise files.WroteAFile(", ".join(log.touched(folder)) or REFUSED) from None
            raise
    try:
        digest = _digest(path)
        torch.load(path, weights_only=True)
        problem = None
    except FileNotFoundError:
        problem = "found no file at path"
    except Exception as error:  # noqa: BLE001 — half a file fails in many ways; each is the same mistake
        problem = f"could not load it ({type(error).__name__})"
    facts = [os.stat(where) if os.path.exists(where) else None for where in (path, os.path.dirname(path))]
    dist.barrier()
    return {"log": list(log), "problem": problem, "digest": None if problem else digest,
            "identities": [None if fact is None else (fact.st_dev, fact.st_ino) for fact in facts],
            "state": None if facts[0] is None else files.state(facts[0])}


def _digest(path: str) -> str:
    with open(path, "rb") as file:
        return hashlib.sha256(file.read()).hexdigest()


def _launch(module, path: str, world_size: int, slow: bool, relative: bool = False) -> list[dict[str, Any]]:
    try:
        return launch(_save_watched, module, path, slow, relative, nprocs=world_size, timeout=LAUNCH_TIMEOUT,
                      rank_output="none")
    except RankFailed as failure:
        last = failure.remote_traceback.strip().splitlines()[-1]
        if "WroteAFile: " in last:
            raise CheckFailed(_wrote(world_size, failure.rank, last.partition("WroteAFile: ")[2])) from None
        raise


def _wrote(world_size: int, rank: int, what: str) -> str:
    return (f"{world_size} ranks: rank {rank} wrote {what} during save_checkpoint: the replicas are identical, so "
            f"rank 0 alone writes (if rank == 0: ...); {world_size} ranks writing one file clobber each other")


@guard.no_shortcuts(allow=CHECKER_TOOLS, built_ins=BUILT_INS)
def check_writes(module) -> None:
    """only rank 0 writes, and the new file is there when save returns on every rank"""
    world_size = 3
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "checkpoint.pt")
        torch.save({"step": 0, "note": "an older checkpoint, which the save replaces"}, path)
        runs = _launch(module, path, world_size, slow=True)
        for rank, run in enumerate(runs[1:], start=1):
            log = files.Log(run["log"])
            if log.touched(directory):
                raise CheckFailed(_wrote(world_size, rank, ", ".join(log.touched(directory))))
            if files.refused(log):
                raise CheckFailed(_wrote(world_size, rank, REFUSED))
        if not os.path.exists(path):
            raise CheckFailed(f"{world_size} ranks: after save_checkpoint returned on every rank there is no file at "
                              "path: rank 0 writes it there (torch.save to path + '.tmp', then os.replace)")
        try:
            torch.load(path, weights_only=True)
        except Exception as error:  # noqa: BLE001
            raise CheckFailed(f"torch.load(path, weights_only=True) refuses your checkpoint ({type(error).__name__}: "
                              f"{str(error).strip().splitlines()[-1][:200]}): save only tensors, numbers, strings, "
                              "lists and dicts (state_dict(), get_rng_state() and get_state() are all of these), "
                              "no other objects") from None
        late = [(rank, run["problem"]) for rank, run in enumerate(runs) if run["problem"]]
        if late:
            rank, problem = late[0]
            raise CheckFailed(f"{world_size} ranks, rank 0 slower to write: the moment save_checkpoint returned on "
                              f"rank {rank}, torch.load(path) there {problem}: rank {rank} went on before rank 0 had "
                              "finished writing; end save_checkpoint with dist.barrier() on every rank")
        final = _digest(path)
        stale = [rank for rank, run in enumerate(runs) if run["digest"] != final]
        if stale:
            raise CheckFailed(f"{world_size} ranks, rank 0 slower to write, an older checkpoint at path: the moment "
                              f"save_checkpoint returned on rank {stale[0]}, path there still held the older "
                              "checkpoint: a rank that only waits for a file at path finds the previous one; end "
                              "save_checkpoint with dist.barrier() on every rank, after rank 0's rename")
        leftovers = sorted(name for name in os.listdir(directory) if name != Path(path).name)
        if leftovers:
            raise CheckFailed(f"save_checkpoint left {', '.join(leftovers)} beside the checkpoint: write to path + "
                              "'.tmp' and os.replace it onto path, which leaves one file")


check_writes.timeout = 90.0


def _in_place(path: str, log: files.Log, kernel: list[tuple[str, str, int]] | None) -> str | None:
    """How ``path`` itself was written, if it was: by rank 0's log, then by the kernel's record."""
    for event in log:
        if event[0] in ("write", "truncate") and event[1] == path:
            return "rank 0 opened path itself for writing"
    for name, kind, _ in kernel or ():
        if name == os.path.basename(path) and kind in ("CREATE", "MODIFY", "CLOSE_WRITE"):
            return f"the kernel saw path itself {'created' if kind == 'CREATE' else 'written'}"
    return None


@guard.no_shortcuts(allow=CHECKER_TOOLS, built_ins=BUILT_INS)
def check_atomic(module) -> None:
    """path appears only by a rename of a complete temporary file beside it, fsynced before, the folder after"""
    world_size = 2
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "checkpoint.pt")
        with files.FolderEvents(directory) as seen:  # a bare file name, from the folder: save("checkpoint.pt")
            try:
                runs = _launch(module, path, world_size, slow=False, relative=True)
            except RankFailed as failure:
                if failure.remote_traceback.strip().splitlines()[-1].startswith(("NotImplementedError", "labkit.")):
                    raise
                raise CheckFailed(f"save_checkpoint(\"checkpoint.pt\", ...), a path without a folder, raised on rank "
                                  f"{failure.rank}: {failure.remote_traceback.strip().splitlines()[-1]} (the folder "
                                  "of a bare file name is os.path.dirname(os.path.abspath(path)), not \"\")") from None
        log, (file, folder) = files.Log(runs[0]["log"]), runs[0]["identities"]
        directory, path = os.path.realpath(directory), os.path.realpath(path)  # as the log names them
        if file is None:
            raise CheckFailed("after save_checkpoint returned there is no file at path: rank 0 writes it there "
                              f"({RECIPE})")
        how = _in_place(path, log, seen.events)
        if how:
            raise CheckFailed(f"{how}: while it is written, path holds half a checkpoint, and a crash then leaves "
                              f"that where the previous checkpoint was whole; {RECIPE}")
        renames = [index for index, event in enumerate(log) if event[0] == "rename" and event[2] == path]
        if not renames:
            raise CheckFailed(f"rank 0 never renamed a file onto path (os.replace): {RECIPE}")
        index, source = renames[-1], log[renames[-1]][1]
        moved_in = {cookie for name, kind, cookie in seen.events or () if kind == "MOVED_FROM"}
        outside = os.path.dirname(source or "") != directory or any(
            name == os.path.basename(path) and kind == "MOVED_TO" and cookie not in moved_in
            for name, kind, cookie in seen.events or ())
        if outside:
            raise CheckFailed(f"rank 0 renamed {source} onto path, from another folder: the temporary file belongs "
                              "beside path, in the same folder (a rename is atomic only within one file system, and "
                              "the folder is what is fsynced after it)")
        if not files.synced(log, file, runs[0]["state"], before=index):
            synced = [i for i, event in enumerate(log) if event[0] == "sync" or event[0] == "fsync" and
                      tuple(event[1]) == tuple(file)]
            what = ("rank 0 renamed the temporary file onto path without fsyncing it first (you fsync it after the "
                    "rename: too late, the rename may reach the disk first)" if synced and min(synced) > index else
                    "rank 0 fsynced (or synced) the temporary file before its last bytes were written, then renamed "
                    "it onto path: an fsync covers what the file held at that moment, not what is written after it"
                    if synced else "rank 0 renamed the temporary file onto path without fsyncing it first")
            raise CheckFailed(what + ": the "
                              "data may still sit in the page cache, and a power cut then leaves an empty or partial "
                              "file under the final name; torch.save into an open file object, then f.flush() and "
                              "os.fsync(f.fileno()), before os.replace")
        if not any(event[0] == "sync" or event[0] == "fsync" and event[2] and tuple(event[1]) == tuple(folder)
                   for event in log[index + 1:]):
            raise CheckFailed("rank 0 did not fsync the folder after the rename: the rename is an entry in the "
                              "folder, which a power cut can lose until the folder is fsynced (fd = "
                              "os.open(folder, os.O_RDONLY); os.fsync(fd); os.close(fd))")


check_atomic.timeout = 90.0
