"""Checks for exercise 09 (``09_checkpointing.py``): save_checkpoint and load_checkpoint.

Every check trains a TinyGPT with dropout (the ``"100k"`` preset) under labkit's ``DistributedDataParallel`` on
gloo ranks, with AdamW over two parameter groups (weight decay and a larger learning rate for the matrices,
neither for the rest), a sampler ``torch.Generator`` seeded by rank and a torch seed by rank, so that every rank
draws other batches and other dropout masks: a checkpoint that restores one rank's random state everywhere, or
none, resumes another run.

- The resume check runs 6 steps straight, then 3 steps, the student's save, and in *new* processes (a second
  launch) freshly built objects — another initialisation, other seeds — the student's load and 3 more steps: the
  losses and the final weights must be the straight run's, bit for bit (``==``, ``torch.equal``; the same
  kernels on the same thread count).  When they are not, the state right after the load is compared, part by
  part, with the state the first run held when it saved, so the hint names the part missing (the step, the
  weights, the optimizer, this rank's RNG, this rank's sampler) and the first step and rank that differ.
- The write check wraps ``torch.save``, ``open`` (writing), ``os.replace`` and ``os.rename`` on every rank while
  the student saves: a rank other than 0 writing beside the checkpoint fails.  Rank 0 is made slow (it arrives
  0.3 s late and each of its writes waits 0.3 s), and every rank loads the file the moment save returns: without
  a barrier ranks 1 and 2 find no file, or half of one.  The file must load with ``weights_only=True``, and no
  temporary file may be left beside it.
- The per-rank check reads the file and looks, anywhere in it, for each rank's ``torch.get_rng_state()`` and
  sampler state as they were when save was called: three ranks, three distinct pairs.

``labkit.checkpoint`` and ``labkit.checkpoint_files`` are forbidden by :mod:`labkit.grading.guard`, and
``torch.distributed.checkpoint`` by these checks.
"""

from __future__ import annotations

import builtins
import copy
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

# Building a torch optimizer imports torch._dynamo, seconds in every check process and rank that lacks it:
# import it once, here, and the checks and ranks forked later inherit it.
import torch._dynamo  # noqa: F401
import torch.distributed as dist

from labkit.grading import CheckFailed, guard
from labkit.launch import launch
from labkit.models import GPTConfig, TinyGPT
from labkit.parallel import base, ddp

# torch.distributed.checkpoint's save and load, named one by one: the whole package would also swap Enum.__new__
# (its enums').  Its state_dict helpers stay: with plain DDP they are model.state_dict() by another name.
_DCP = "torch.distributed.checkpoint"
BUILT_INS = tuple(f"{_DCP}.{module}.{name}" for module, names in (
    ("state_dict_saver", ("save", "async_save", "save_state_dict")),
    ("state_dict_loader", ("load", "load_state_dict"))) for name in names)
# The checks train under labkit's own DistributedDataParallel, whose buckets keep one layout for the whole run.
# PyTorch's rebuilds its buckets after a wrapper's first step, so a resumed run's first step packs the gradients
# in another order than the straight run's; on 3 ranks gloo's ring then adds each element's three values in
# another order, and the runs part by 1 ulp: not a student's mistake, and it would hide every one.
CHECKER_TOOLS = tuple(f"{module.__name__}.{name}" for module in (ddp, base) for name, value in vars(module).items()
                      if getattr(value, "__module__", None) == module.__name__)
LAUNCH_TIMEOUT = 60.0  # seconds a launch may take before the ranks count as hung
CONFIG = GPTConfig.preset("100k", dropout=0.1)
STEPS, SAVE_AT = 6, 3
BATCH, TOKENS = 4, 32
LR_MATRICES, LR_OTHERS, WEIGHT_DECAY = 3e-3, 1e-3, 0.1
# (model initialisation seed, sampler seed + rank, torch seed + rank): the first run's, then the resumed run's
# fresh objects', which a load must overwrite.
FIRST_RUN, RESUMED_RUN = (0, 100, 1000), (1, 500, 5000)
SLOW_RANK_ZERO = 0.3  # seconds rank 0 waits before the save and before each of its writes, in the write check
CORPUS = torch.randint(CONFIG.vocab_size, (4096,), generator=torch.Generator().manual_seed(7))

# --------------------------------------------------------------------------------------------------------
# The training every check runs, on every rank


def _build(seeds: tuple[int, int, int]) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Generator]:
    init_seed, sampler_seed, torch_seed = seeds
    rank = dist.get_rank()
    torch.set_num_threads(1)  # the same kernels in every run: the comparison is exact
    model = ddp.DistributedDataParallel(TinyGPT(CONFIG, seed=init_seed))
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": matrices, "lr": LR_MATRICES, "weight_decay": WEIGHT_DECAY},
                                   {"params": others, "lr": LR_OTHERS, "weight_decay": 0.0}], betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(sampler_seed + rank)
    torch.manual_seed(torch_seed + rank)  # each rank its own dropout masks
    return model, optimizer, generator


def _train_step(model, optimizer, generator) -> float:
    starts = torch.randint(len(CORPUS) - TOKENS - 1, (BATCH,), generator=generator)  # the sampler's draw
    window = torch.stack([CORPUS[start:start + TOKENS + 1] for start in starts.tolist()])
    _, loss = model(window[:, :-1], window[:, 1:])
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def _snapshot(model, optimizer, generator) -> dict[str, Any]:
    return {"model": {name: tensor.detach().clone() for name, tensor in model.state_dict().items()},
            "optimizer": copy.deepcopy(optimizer.state_dict()), "rng": torch.get_rng_state(), "sampler": generator.get_state()}


def _first_run(save_checkpoint, path: str) -> dict[str, Any]:
    """6 steps straight; then, from scratch, 3 steps and the student's save.  What each rank saw."""
    model, optimizer, generator = _build(FIRST_RUN)
    straight = [_train_step(model, optimizer, generator) for _ in range(STEPS)]
    final = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    model, optimizer, generator = _build(FIRST_RUN)
    for _ in range(SAVE_AT):
        _train_step(model, optimizer, generator)
    saved = _snapshot(model, optimizer, generator)
    save_checkpoint(path, model, optimizer, generator, SAVE_AT)
    return {"losses": straight, "final": final, "saved": saved}


def _resumed_run(load_checkpoint, path: str) -> dict[str, Any]:
    model, optimizer, generator = _build(RESUMED_RUN)
    step = load_checkpoint(path, model, optimizer, generator)
    loaded = _snapshot(model, optimizer, generator)
    losses = [_train_step(model, optimizer, generator) for _ in range(STEPS - SAVE_AT)]
    return {"step": step, "loaded": loaded, "losses": losses,
            "final": {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}}


# --------------------------------------------------------------------------------------------------------
# Comparing states


def _same(a: Any, b: Any) -> bool:
    """Exact equality of nested dicts, lists and tensors (``torch.equal``, dtypes included)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _first_difference(saved: dict[str, Any], loaded: dict[str, Any]) -> str | None:
    """The part of the state that a load did not restore, in the student's terms (None: all restored)."""
    for name, tensor in saved["model"].items():
        if name not in loaded["model"] or not torch.equal(tensor, loaded["model"][name]):
            return (f"its weights are not those saved at step {SAVE_AT} ({name} differs): save model.state_dict() "
                    "and load it with model.load_state_dict")
    want, got = saved["optimizer"], loaded["optimizer"]
    if not _same(want["state"], got["state"]):
        return ("AdamW's state (exp_avg, exp_avg_sq, the step count) is not the one saved: without it the moments "
                "start again from zero, as on step 1; save optimizer.state_dict() and load it with "
                "optimizer.load_state_dict")
    if not _same(want["param_groups"], got["param_groups"]):
        return ("the optimizer's parameter groups (lr, weight_decay, betas of each) are not those saved: load the "
                "whole optimizer.state_dict(), param_groups included")
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
    """a resumed run continues bit for bit: the straight run's losses and weights on 2 and 3 ranks"""
    with tempfile.TemporaryDirectory() as directory:
        for world_size in (2, 3):
            path = os.path.join(directory, f"run-{world_size}.pt")
            first = launch(_first_run, module.save_checkpoint, path, nprocs=world_size, timeout=LAUNCH_TIMEOUT,
                           rank_output="none")
            if not os.path.exists(path):
                raise CheckFailed(f"{world_size} ranks: after save_checkpoint returned on every rank there is no file "
                                  f"at path: rank 0 writes it there (torch.save to path + '.tmp', then os.replace)")
            resumed = launch(_resumed_run, module.load_checkpoint, path, nprocs=world_size, timeout=LAUNCH_TIMEOUT,
                             rank_output="none")
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
                weights_differ = not _same(first[rank]["final"], run["final"])
                when = (f"from step {differs} on, rank {rank}'s loss is {run['losses'][differs - SAVE_AT - 1]:.6f} "
                        f"where the straight run's was {first[rank]['losses'][differs - 1]:.6f}" if differs else
                        f"rank {rank}'s weights after step {STEPS} differ from the straight run's" if weights_differ
                        else f"rank {rank} resumes without a visible difference in {STEPS - SAVE_AT} steps, but")
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


check_resume.timeout = 180.0

# --------------------------------------------------------------------------------------------------------
# Who writes, and when the file is there


def _under(directory: str, path: Any) -> bool:
    try:
        return os.path.abspath(os.fspath(path)).startswith(directory + os.sep)
    except TypeError:  # a file object or a descriptor: not a path
        return False


def _watched_save(save_checkpoint, path: str) -> dict[str, Any]:
    """The student's save, with every write under the checkpoint's folder recorded (and slowed on rank 0), then a
    load the moment it returns."""
    model, optimizer, generator = _build(FIRST_RUN)
    _train_step(model, optimizer, generator)
    rank = dist.get_rank()
    directory = os.path.dirname(os.path.abspath(path))
    written: list[str] = []
    originals = {"save": torch.save, "serialization_save": torch.serialization.save, "open": builtins.open,
                 "replace": os.replace, "rename": os.rename}

    def record(target: Any) -> None:
        if _under(directory, target):
            name = os.path.relpath(os.fspath(target), directory)
            if name not in written:
                written.append(name)
            if rank == 0:
                time.sleep(SLOW_RANK_ZERO)

    def save(obj, f, *args, **kwargs):
        record(f)
        return originals["save"](obj, f, *args, **kwargs)

    def open_(file, mode="r", *args, **kwargs):
        if any(letter in mode for letter in "wax+"):
            record(file)
        return originals["open"](file, mode, *args, **kwargs)

    def replace(src, dst, *args, **kwargs):
        record(dst)
        return originals["replace"](src, dst, *args, **kwargs)

    def rename(src, dst, *args, **kwargs):
        record(dst)
        return originals["rename"](src, dst, *args, **kwargs)

    if rank == 0:
        time.sleep(SLOW_RANK_ZERO)
    torch.save = torch.serialization.save = save
    builtins.open, os.replace, os.rename = open_, replace, rename
    try:
        save_checkpoint(path, model, optimizer, generator, 1)
    finally:
        torch.save, torch.serialization.save = originals["save"], originals["serialization_save"]
        builtins.open, os.replace, os.rename = originals["open"], originals["replace"], originals["rename"]
    try:
        torch.load(path, weights_only=True)
        problem = None
    except FileNotFoundError:
        problem = "found no file at path"
    except Exception as error:  # noqa: BLE001 — half a file fails in many ways; each is the same mistake
        problem = f"could not load it ({type(error).__name__})"
    dist.barrier()
    return {"written": written, "problem": problem}


@guard.no_shortcuts(allow=CHECKER_TOOLS, built_ins=BUILT_INS)
def check_writes(module) -> None:
    """only rank 0 writes, and the file is there when save returns on every rank"""
    world_size = 3
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "checkpoint.pt")
        runs = launch(_watched_save, module.save_checkpoint, path, nprocs=world_size, timeout=LAUNCH_TIMEOUT,
                      rank_output="none")
        for rank, run in enumerate(runs[1:], start=1):
            if run["written"]:
                raise CheckFailed(f"{world_size} ranks: rank {rank} wrote {', '.join(run['written'])} during "
                                  "save_checkpoint: the replicas are identical, so rank 0 alone writes (if rank == 0: "
                                  f"...); {world_size} ranks writing one file clobber each other")
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
        leftovers = sorted(name for name in os.listdir(directory) if name != Path(path).name)
        if leftovers:
            raise CheckFailed(f"save_checkpoint left {', '.join(leftovers)} beside the checkpoint: write to path + "
                              "'.tmp' and os.replace it onto path, which leaves one file")


check_writes.timeout = 90.0

# --------------------------------------------------------------------------------------------------------
# One random state per rank in the file


def _save_and_record(save_checkpoint, path: str) -> dict[str, torch.Tensor]:
    model, optimizer, generator = _build(FIRST_RUN)
    for _ in range(2):
        _train_step(model, optimizer, generator)
    states = {"rng": torch.get_rng_state(), "sampler": generator.get_state()}
    save_checkpoint(path, model, optimizer, generator, 2)
    return states


def _byte_tensors(value: Any) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value] if value.dtype == torch.uint8 else []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in _byte_tensors(item)]
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
            saved = _byte_tensors(torch.load(path, weights_only=True))
        except Exception as error:  # noqa: BLE001
            raise CheckFailed(f"torch.load(path, weights_only=True) could not read your checkpoint "
                              f"({type(error).__name__}): write one file at path on rank 0, of tensors, numbers, "
                              "strings, lists and dicts") from None
    for key, what, restore in (("rng", "torch RNG state (torch.get_rng_state())", "torch.set_rng_state"),
                               ("sampler", "sampler generator state (generator.get_state())", "generator.set_state")):
        found = [rank for rank in range(world_size) if any(
            tensor.shape == states[rank][key].shape and torch.equal(tensor, states[rank][key]) for tensor in saved)]
        if len(found) < world_size:
            missing = [rank for rank in range(world_size) if rank not in found]
            held = (f"the {what} of rank(s) {found} only, not that of rank(s) {missing}" if found else
                    f"no rank's {what}")
            raise CheckFailed(f"{world_size} ranks: the file holds {held}: each rank has its own, so gather them to "
                              f"rank 0 (dist.all_gather_object) and save all {world_size}, for each rank to restore "
                              f"its own with {restore}")


check_every_ranks_random_state.timeout = 90.0

CHECKS = [check_resume, check_writes, check_every_ranks_random_state]
