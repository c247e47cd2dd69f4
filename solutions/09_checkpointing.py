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
- the **step**, so the loop (and a learning-rate schedule) carries on where it stopped.

Two details make the file trustworthy.  Rank 0 writes it *atomically*: ``torch.save`` to ``path + ".tmp"``, then
``os.replace`` onto ``path`` — a rename, so a crash half-way through a write leaves the previous checkpoint
whole, never a truncated one.  And no rank returns before the file exists: a ``dist.barrier()`` at the end of
the save, or a rank that loads (or deletes an older checkpoint) straight after would find nothing there.  Load
with ``torch.load(path, weights_only=True)``: a file of tensors, numbers, strings, lists and dicts, which runs
no pickled code — so keep the checkpoint to those.

The checks train a small TinyGPT with dropout under a DistributedDataParallel wrapper (labkit's; PyTorch's
takes the same calls) on 2 and 3 gloo ranks, with AdamW over two parameter groups: 6 steps straight, and 3
steps, your save, then new processes with freshly built objects, your load and 3 more steps — which must give
the straight run's losses and weights exactly.  They also watch which rank writes what during the save.  ``labkit.checkpoint`` (labkit's own) and
``torch.distributed.checkpoint`` are switched off while they run: the answer must be yours.
"""

import os

import torch
import torch.distributed as dist


def save_checkpoint(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    generator: torch.Generator, step: int) -> None:
    """Called on every rank of a data-parallel run (the model replicas are identical) after ``step`` steps: write
    one file at ``path`` holding the model's and the optimizer's state, every rank's torch RNG state and sampler
    ``generator`` state, and ``step``.  Only rank 0 writes, atomically; return on no rank before the file is
    there."""
    mine = {"rng": torch.get_rng_state(), "sampler": generator.get_state()}  # this rank's alone
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:  # the model and optimizer are replicas: one copy is all of them
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "ranks": ranks, "step": step}
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)  # a rename: a crash mid-write never leaves a truncated checkpoint
    dist.barrier()  # no rank goes on (to load it, or delete an older one) before the file is there


def load_checkpoint(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    generator: torch.Generator) -> int:
    """Called on every rank of a new run (new processes, the same number of ranks, freshly built objects):
    restore the model, the optimizer, this rank's own torch RNG state and sampler ``generator`` state from the
    file ``save_checkpoint`` wrote; return the step it was saved at."""
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    mine = state["ranks"][dist.get_rank()]
    torch.set_rng_state(mine["rng"])
    generator.set_state(mine["sampler"])
    return state["step"]
