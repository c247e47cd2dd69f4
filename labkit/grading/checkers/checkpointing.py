"""Checks for exercise 09 (``09_checkpointing.py``): save_checkpoint and load_checkpoint.

Every check trains the run of :mod:`labkit.grading.checkers.checkpoint_run` (a TinyGPT with dropout under
DistributedDataParallel, AdamW over two parameter groups, a learning-rate schedule, a GradScaler, a sampler
generator and a torch seed per rank) on gloo ranks.

- The resume check runs 6 steps straight, then 3 steps, the student's save, and in *new* processes (a second
  launch) freshly built objects — another initialisation, other seeds — the student's load and 3 more steps: the
  losses and the final weights must be the straight run's, bit for bit (``==``, ``torch.equal``; the same
  kernels on the same thread count), and the state right after the load the state the first run held when it
  saved, part by part, so the hint names the part missing (the weights, the optimizer, the schedule, the scaler,
  this rank's RNG, this rank's sampler) and the first step and rank that differ.  The scaler's powers of two
  change no float32 loss, so its state is compared even when every loss matches; it skips step 2 (an overflow),
  so AdamW's own step count is one behind the step load_checkpoint must return.  On 2 ranks a second file, saved
  without the scheduler and the scaler, must refuse each of them on load (``ValueError``, as the docstring says).
- The write check watches every rank's file operations while the student saves, where a name imported early
  cannot hide them (:mod:`labkit.grading.files`: audit hooks, torch's writer, and on ranks other than 0 a
  file-size limit of 0 that the kernel enforces): a rank other than 0 that writes, renames or removes anything
  beside the checkpoint, or writes any byte to any file, fails.  Rank 0 is made slow (it arrives 0.3 s late and
  each of its writes waits 0.3 s), and every rank loads the file the moment save returns: without a barrier
  ranks 1 and 2 find no file, or half of one; an older checkpoint is at ``path`` before the save, and each rank
  must find the new one there when its save returns (a rank that polls for a file finds the old one).  The file
  must load with ``weights_only=True``, and no temporary file may be left beside it.
- The atomic check holds rank 0's write to the crash-safe recipe: ``path`` itself is never created, opened for
  writing or modified (rank 0's log and, on Linux, the kernel's inotify record of the folder); it appears by a
  rename of a file from the same folder; that file was fsynced before the rename, after its last write (by its
  inode, which the rename keeps, and its size and modification time at the fsync, which must be the final
  file's), and the folder after it.  The save is given a bare file name, from the folder as working directory.
- The per-rank check reads the file and looks, anywhere in it, for each rank's ``torch.get_rng_state()`` and
  sampler state as they were when save was called, in any encoding (a tensor, a list of ints, bytes): three
  ranks, three distinct pairs.

``labkit.checkpoint`` and ``labkit.checkpoint.files`` are forbidden by :mod:`labkit.grading.guard`, and
``torch.distributed.checkpoint`` by these checks.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from labkit.grading import CheckFailed, compact, guard
from labkit.grading.checkers import checkpoint_run as training
from labkit.grading.checkers.checkpoint_run import BUILT_INS, CHECKER_TOOLS, LAUNCH_TIMEOUT, SAVE_AT, STEPS
from labkit.grading.checkers.checkpoint_writes import check_atomic, check_writes
from labkit.launch import launch

__all__ = ["BUILT_INS", "CHECKER_TOOLS", "CHECKS", "check_atomic", "check_every_ranks_random_state", "check_resume",
           "check_writes"]

# --------------------------------------------------------------------------------------------------------
# Saving and resuming, on every rank


def _first_run(save_checkpoint, path: str, bare: str | None) -> dict[str, Any]:
    """6 steps straight; then, from scratch, 3 steps and the student's save (and, at ``bare``, a save without the
    scheduler and the scaler).  What each rank saw."""
    run = training.build(training.FIRST_RUN)
    straight = [training.train_step(run) for _ in range(STEPS)]
    final = training.weights(run)
    run = training.build(training.FIRST_RUN)
    for _ in range(SAVE_AT):
        training.train_step(run)
    saved = training.snapshot(run)
    save_checkpoint(path, run.model, run.optimizer, run.generator, SAVE_AT, scheduler=run.scheduler,
                    scaler=run.scaler)
    if bare:
        save_checkpoint(bare, run.model, run.optimizer, run.generator, SAVE_AT)
    return compact({"losses": straight, "final": final, "saved": saved})


def _resumed_run(load_checkpoint, path: str, bare: str | None) -> dict[str, Any]:
    run = training.build(training.RESUMED_RUN)
    step = load_checkpoint(path, run.model, run.optimizer, run.generator, scheduler=run.scheduler, scaler=run.scaler)
    run.steps = SAVE_AT
    loaded = training.snapshot(run)
    losses = [training.train_step(run) for _ in range(STEPS - SAVE_AT)]
    refusals = {}
    for part in ("scheduler", "scaler") if bare else ():
        fresh = training.build(training.RESUMED_RUN)
        try:
            load_checkpoint(bare, fresh.model, fresh.optimizer, fresh.generator, **{part: getattr(fresh, part)})
            refusals[part] = "returned"
        except ValueError:
            refusals[part] = None
        except Exception as error:  # noqa: BLE001 — reported as the hint
            refusals[part] = f"raised {type(error).__name__}: {error}"
    return compact({"step": step, "loaded": loaded, "losses": losses, "final": training.weights(run),
                    "refusals": refusals})


# --------------------------------------------------------------------------------------------------------
# Comparing states


def _first_difference(saved: dict[str, Any], loaded: dict[str, Any]) -> str | None:
    """The part of the state that a load did not restore, in the student's terms (None: all restored)."""
    for name, tensor in saved["model"].items():
        if name not in loaded["model"] or not torch.equal(tensor, loaded["model"][name]):
            return (f"its weights are not those saved at step {SAVE_AT} ({name} differs): save model.state_dict() "
                    "and load it with model.load_state_dict")
    want, got = saved["optimizer"], loaded["optimizer"]
    if not training.same(want["state"], got["state"]):
        return ("AdamW's state (exp_avg, exp_avg_sq, the step count) is not the one saved: without it the moments "
                "start again from zero, as on step 1; save optimizer.state_dict() and load it with "
                "optimizer.load_state_dict")
    if not training.same(want["param_groups"], got["param_groups"]):
        return ("the optimizer's parameter groups (lr, weight_decay, betas of each) are not those saved: load the "
                "whole optimizer.state_dict(), param_groups included")
    if not training.same(saved["scheduler"], loaded["scheduler"]):
        return ("the learning-rate schedule is not where it was (scheduler.state_dict(): last_epoch "
                f"{saved['scheduler']['last_epoch']} saved, {loaded['scheduler']['last_epoch']} after the load), so "
                "its next step sets another learning rate: save_checkpoint is given scheduler=; save "
                "scheduler.state_dict() and load it with scheduler.load_state_dict")
    if not training.same(saved["scaler"], loaded["scaler"]):
        return ("the GradScaler's state is not the one saved (scale and growth tracker "
                f"{saved['scaler'].get('scale')}, {saved['scaler'].get('_growth_tracker')} saved; "
                f"{loaded['scaler'].get('scale')}, {loaded['scaler'].get('_growth_tracker')} after the load): its "
                "scale restarts and, under fp16, the first steps overflow again or underflow; save_checkpoint is "
                "given scaler=; save scaler.state_dict() and load it with scaler.load_state_dict")
    if not torch.equal(saved["rng"], loaded["rng"]):
        return "rng"
    if not torch.equal(saved["sampler"], loaded["sampler"]):
        return "sampler"
    return None


def _describe(part: str, rank: int, first: dict[str, Any]) -> str:
    if part == "rng":
        others = [other for other, run in enumerate(first) if other != rank
                  and torch.equal(run["saved"]["rng"], first[rank]["loaded_rng"])]
        return ("torch's RNG state (torch.get_rng_state()) is not the one this rank had when it saved, so its dropout "
                "masks differ from the straight run's"
                + (f" — it holds rank {others[0]}'s: each rank has its own (the seeds differ by rank), so gather every "
                   "rank's to rank 0, save them all, and let each rank restore its own with torch.set_rng_state"
                   if others else
                   ": each rank has its own (the seeds differ by rank); gather every rank's to rank 0 "
                   "(dist.all_gather_object), save them all, and let each rank restore its own with "
                   "torch.set_rng_state"))
    if part == "sampler":
        return ("the sampler position was not restored: its generator's state (generator.get_state()) is not the "
                "one this rank had when it saved, so it draws other batches than the straight run; gather every "
                "rank's generator state to rank 0, save them, and let each rank restore its own with "
                "generator.set_state")
    return part


@guard.no_shortcuts(allow=CHECKER_TOOLS, built_ins=BUILT_INS)
def check_resume(module) -> None:
    """a resumed run continues bit for bit (2 and 3 ranks); a file without a scheduler or scaler refuses them"""
    with tempfile.TemporaryDirectory() as directory:
        for world_size in (2, 3):
            path = os.path.join(directory, f"run-{world_size}.pt")
            bare = os.path.join(directory, "bare.pt") if world_size == 2 else None
            first = launch(_first_run, module.save_checkpoint, path, bare, nprocs=world_size, timeout=LAUNCH_TIMEOUT,
                           rank_output="none")
            if not os.path.exists(path):
                raise CheckFailed(f"{world_size} ranks: after save_checkpoint returned on every rank there is no file "
                                  f"at path: rank 0 writes it there (torch.save to path + '.tmp', then os.replace)")
            resumed = launch(_resumed_run, module.load_checkpoint, path, bare, nprocs=world_size,
                             timeout=LAUNCH_TIMEOUT, rank_output="none")
            where = f"{world_size} ranks, saved after step {SAVE_AT} and resumed in new processes"
            for rank, run in enumerate(resumed):
                if isinstance(run["step"], bool) or run["step"] != SAVE_AT:
                    raise CheckFailed(f"{where}: load_checkpoint returned {run['step']!r} on rank {rank}; return the "
                                      f"step that save_checkpoint was given ({SAVE_AT}), saved in the file")
            for rank, run in enumerate(resumed):
                first[rank]["loaded_rng"] = run["loaded"]["rng"]
            for rank, run in enumerate(resumed):
                part = _first_difference(first[rank]["saved"], run["loaded"])
                if part is None:
                    continue
                differs = next((step for step, (want, got) in enumerate(
                    zip(first[rank]["losses"][SAVE_AT:], run["losses"], strict=True), start=SAVE_AT + 1)
                    if want != got), None)
                weights_differ = not training.same(first[rank]["final"], run["final"])
                when = (f"from step {differs} on, rank {rank}'s loss is {run['losses'][differs - SAVE_AT - 1]:.6f} "
                        f"where the straight run's was {first[rank]['losses'][differs - 1]:.6f}" if differs else
                        f"rank {rank}'s weights after step {STEPS} differ from the straight run's" if weights_differ
                        else f"rank {rank} resumes with the straight run's losses and weights for {STEPS - SAVE_AT} "
                        "steps, but not its state")
                raise CheckFailed(f"{where}: {when}; right after load_checkpoint on rank {rank}, "
                                  + _describe(part, rank, first))
            for rank, run in enumerate(resumed):
                for step, (want, got) in enumerate(zip(first[rank]["losses"][SAVE_AT:], run["losses"], strict=True),
                                                   start=SAVE_AT + 1):
                    if want != got:
                        raise CheckFailed(f"{where}: at step {step} rank {rank}'s loss is {got:.6f} where the "
                                          f"straight run's was {want:.6f}, though everything load_checkpoint restores "
                                          "matches what was saved: does load_checkpoint change anything else?")
                for name, tensor in first[rank]["final"].items():
                    if not torch.equal(tensor, run["final"][name]):
                        raise CheckFailed(f"{where}: after step {STEPS}, {name} on rank {rank} differs from the "
                                          "straight run's")
                for part, outcome in run["refusals"].items():
                    if outcome:
                        raise CheckFailed(f"{world_size} ranks: load_checkpoint of a file saved without {part}=, "
                                          f"given {part}=, {outcome} on rank {rank}: raise ValueError (the docstring "
                                          f"says so), or the run resumes with a fresh {part} as if nothing were "
                                          "missing")


check_resume.timeout = 180.0

# --------------------------------------------------------------------------------------------------------
# One random state per rank in the file


def _save_and_record(save_checkpoint, path: str) -> dict[str, torch.Tensor]:
    run = training.build(training.FIRST_RUN)
    for _ in range(2):
        training.train_step(run)
    states = {"rng": torch.get_rng_state(), "sampler": run.generator.get_state()}
    save_checkpoint(path, run.model, run.optimizer, run.generator, 2)
    return compact(states)


def _byte_strings(value: Any) -> list[bytes]:
    """Every run of byte values the file holds, however encoded: a uint8 tensor (``get_rng_state()``), a tensor of
    another integer type, a list or tuple of ints (``.tolist()``), bytes."""
    if torch.is_tensor(value):
        integral = not value.dtype.is_floating_point and not value.dtype.is_complex and value.dtype != torch.bool
        if integral and value.numel() and 0 <= value.min().item() and value.max().item() <= 255:
            return [bytes(value.flatten().to(torch.uint8).tolist())]
        return []
    if isinstance(value, (bytes, bytearray)):
        return [bytes(value)]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(item, int) and not isinstance(item, bool) and 0 <= item <= 255 for item in value):
            return [bytes(value)]
        return [found for item in value for found in _byte_strings(item)]
    return []


@guard.no_shortcuts(allow=CHECKER_TOOLS, built_ins=BUILT_INS)
def check_every_ranks_random_state(module) -> None:
    """the file holds every rank's own RNG and sampler state (3 ranks: 3 of each)"""
    world_size = 3
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "checkpoint.pt")
        states = launch(_save_and_record, module.save_checkpoint, path, nprocs=world_size, timeout=LAUNCH_TIMEOUT,
                        rank_output="none")
        try:
            saved = set(_byte_strings(torch.load(path, weights_only=True)))
        except Exception as error:  # noqa: BLE001
            raise CheckFailed(f"torch.load(path, weights_only=True) could not read your checkpoint "
                              f"({type(error).__name__}): write one file at path on rank 0, of tensors, numbers, "
                              "strings, lists and dicts") from None
    for key, what, restore in (("rng", "torch RNG state (torch.get_rng_state())", "torch.set_rng_state"),
                               ("sampler", "sampler generator state (generator.get_state())", "generator.set_state")):
        found = [rank for rank in range(world_size) if bytes(states[rank][key].tolist()) in saved]
        if len(found) < world_size:
            missing = [rank for rank in range(world_size) if rank not in found]
            held = (f"the {what} of rank(s) {found} only, not that of rank(s) {missing}" if found else
                    f"no rank's {what}")
            raise CheckFailed(f"{world_size} ranks: the file holds {held}: each rank has its own, so gather them to "
                              f"rank 0 (dist.all_gather_object) and save all {world_size}, for each rank to restore "
                              f"its own with {restore}")


check_every_ranks_random_state.timeout = 90.0

CHECKS = [check_resume, check_writes, check_every_ranks_random_state, check_atomic]
