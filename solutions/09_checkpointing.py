"""Exercise 09 — Checkpointing: save a data-parallel run and resume it bit for bit (solution).

A long run is interrupted — a pre-empted node, a crashed rank, a wall-clock limit — and restarts in new
processes.  A *checkpoint* is everything that the rest of the run depends on, and resuming from it is correct only
if the resumed run is the run that would have happened: the same losses, the same weights, to the last bit.
That is more than the weights:

- the **model** and the **optimizer** (AdamW's ``exp_avg``, ``exp_avg_sq`` and step count, and each parameter
  group's ``lr`` and ``weight_decay``): without the moments the first steps after a restart are Adam's first
  steps again, bias correction and all.  Under data parallelism these are *replicated* — every rank holds the
  same bytes — so one rank, rank 0, writes them: ``N`` ranks writing one file clobber each other, and ``N``
  files would hold ``N`` copies of the same ``12 Psi`` bytes (4 for each fp32 weight, 8 for its two
  moments);
- the **random state of every rank**, which is *not* replicated: each rank seeds torch differently so that its
  dropout masks differ, and each rank's data sampler draws its own batches from its own ``torch.Generator``.
  Rank 1's ``torch.get_rng_state()`` and ``generator.get_state()`` (a few kB each) exist only on rank 1, so
  they are gathered to rank 0 (``dist.all_gather_object``) and saved with the rest, one pair per rank; on
  resume each rank takes back *its own* pair;
- the **learning-rate schedule** and the **loss scaler**, when the run has them: a scheduler's position
  (``last_epoch``) sets every later learning rate, and a ``GradScaler``'s scale is what the run's overflows and
  growth (one doubling per 2000 good steps, by default) have found; restarted, the schedule replays its warm-up
  and the scaler starts again from its initial scale.  Both have a ``state_dict()``, saved when given and
  restored on load;
- the **step**, so the loop carries on where it stopped.

Two details make the file trustworthy.  Rank 0 writes it *atomically*: the bytes go to a temporary file beside
``path`` (``path + ".tmp"``), which is flushed and ``os.fsync``-ed, then ``os.replace``-d onto ``path``, and
the folder is fsynced after the rename.  A rename is atomic, so a crash half-way through a write leaves the
previous checkpoint whole, never a truncated one; but the kernel may write a rename to disk before the data it
names, so without the first fsync a power cut can leave an empty file under the final name, and without the
second the rename itself may be lost.  And no rank returns before the file exists: a ``dist.barrier()`` at the
end of the save, or a rank that loads (or deletes an older checkpoint) straight after would find nothing
there.  Load with ``torch.load(path, weights_only=True)``: a file of tensors, numbers, strings, lists and
dicts, which runs no pickled code — so keep the checkpoint to those.

The checks train a small TinyGPT with dropout under a DistributedDataParallel wrapper (labkit's; PyTorch's
takes the same calls) on 2 and 3 gloo ranks, with AdamW over two parameter groups: 6 steps straight, and 3
steps, your save, then new processes with freshly built objects, your load and 3 more steps — which must give
the straight run's losses and weights exactly; that run also has a learning-rate schedule and a GradScaler,
whose states must come back too (the scaler skips a step on an overflow, so the optimizer has counted one step
fewer than the run), and a file saved without them must refuse them on load.  They also watch, on every rank,
which files are written, renamed and fsynced during the save, and in what order, with an older checkpoint
already at ``path``, and once with a bare file name for ``path``.  ``labkit.checkpoint`` (labkit's own) and
``torch.distributed.checkpoint`` are switched off while they run: the answer must be yours.
"""

import os
from typing import Any

import torch
import torch.distributed as dist


def save_checkpoint(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    generator: torch.Generator, step: int, scheduler: Any = None, scaler: Any = None) -> None:
    """Called on every rank of a data-parallel run (the model replicas are identical) after ``step`` steps: write
    one file at ``path`` holding the model's and the optimizer's state, the ``scheduler``'s and the ``scaler``'s
    when given, every rank's torch RNG state and sampler ``generator`` state, and ``step``.  Only rank 0 writes,
    atomically (a temporary file beside ``path``, fsynced, renamed onto it, the folder fsynced); return on no
    rank before the file is there."""
    mine = {"rng": torch.get_rng_state(), "sampler": generator.get_state()}  # this rank's alone
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:  # the model and optimizer are replicas: one copy is all of them
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "scheduler": None if scheduler is None else scheduler.state_dict(),
                 "scaler": None if scaler is None else scaler.state_dict(), "ranks": ranks, "step": step}
        with open(path + ".tmp", "wb") as file:  # beside path: a rename is atomic within one file system
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())  # the bytes on disk before a name points at them
        os.replace(path + ".tmp", path)  # a rename: a crash mid-write never leaves a truncated checkpoint
        folder = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(folder)  # the rename is an entry in the folder: on disk too
        finally:
            os.close(folder)
    dist.barrier()  # no rank goes on (to load it, or delete an older one) before the file is there


def load_checkpoint(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    generator: torch.Generator, scheduler: Any = None, scaler: Any = None) -> int:
    """Called on every rank of a new run (new processes, the same number of ranks, freshly built objects):
    restore the model, the optimizer, the ``scheduler`` and the ``scaler`` when given, this rank's own torch RNG
    state and sampler ``generator`` state from the file ``save_checkpoint`` wrote; return the step it was saved
    at.  Raises ``ValueError`` when a scheduler or scaler is given and the file holds none."""
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    for name, thing in (("scheduler", scheduler), ("scaler", scaler)):
        if thing is not None:
            if state.get(name) is None:
                raise ValueError(f"{path} holds no {name} state: it was saved without {name}=")
            thing.load_state_dict(state[name])
    mine = state["ranks"][dist.get_rank()]
    torch.set_rng_state(mine["rng"])
    generator.set_state(mine["sampler"])
    return state["step"]
