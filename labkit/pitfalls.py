"""The pitfalls of distributed training, each made measurable so that it can be shown and caught (lesson 09).

- **Replicas that drift apart.**  Data parallelism assumes every rank holds the same weights.  Ranks that
  initialise with different seeds, and nothing that broadcasts the first rank's weights (labkit's and PyTorch's
  DDP both do at construction), train N different models while all-reducing their gradients: nothing fails, the
  loss even goes down.  :func:`replica_differences` measures how far each tensor is from the first rank's copy,
  and :func:`check_replicas_identical` turns any difference into an error naming the tensors.
- **The same data on every rank.**  A sampler seeded with the same seed on every rank draws the same samples
  everywhere: N ranks do the work of one.  :func:`duplicate_fraction` counts the samples another rank drew too.
- **Floating-point addition is not associative.**  The same global batch, averaged over 2 ranks or over 4, is
  summed in another order and gives other bits: a run is reproducible on a fixed world size (and fixed kernels),
  not across them.  :func:`reduction_order_gaps` measures the difference for one vector of per-sample gradients.
- **Every rank saving "the" checkpoint.**  Every rank runs the same script, so a save meant once runs N times.
  Where each rank's state is its own (its random states, its sampler's position, its shard), N ranks saving to
  one path leave one rank's state at most: every save returns without an error, and all but one are lost (with
  in-place writes, a reader may even meet a file whose parts come from different ranks).  A temporary file and a
  rename keep the file whole, never torn, but still one rank's.  The fix is to gather the per-rank parts and
  have one rank write them (or give every rank a file of its own, as a sharded checkpoint does).
  :func:`save_from_every_rank` does each on purpose and reports whose state the file holds, and whose state
  each rank reads back as its own.
- **gloo is not NCCL.**  The same program meets different rules on each backend: NCCL moves CUDA tensors
  (PyTorch's NCCL backend: one GPU per rank), gloo CPU tensors (and a few collectives of CUDA ones); each
  supports its own set of collectives and reduction operations.  :func:`probe_collectives` tries each one on the group's backend, with
  tensors on ``labkit.dist.device()``, and reports what it refused.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn

from labkit import dist
from labkit.dist import global_rank


@torch.no_grad()
def replica_differences(module: nn.Module, group: Any = None) -> dict[str, float]:
    """Collective: for every tensor of ``module.state_dict()``, the largest absolute difference, over the ranks
    of ``group``, between a rank's copy and the first rank's (all zeros when the replicas are identical)."""
    found = {}
    for name, tensor in module.state_dict().items():
        first = tensor.detach().clone()
        torch_dist.broadcast(first, src=global_rank(group, 0), group=group)
        gap = (tensor.detach().double() - first.double()).abs().max() if tensor.numel() else torch.zeros(())
        gap = gap.reshape(1).to(tensor.device)
        torch_dist.all_reduce(gap, op=torch_dist.ReduceOp.MAX, group=group)
        found[name] = gap.item()
    return found


def check_replicas_identical(module: nn.Module, group: Any = None, tolerance: float = 0.0) -> None:
    """Collective: raise ``RuntimeError`` naming the tensors whose copies differ across ``group`` by more than
    ``tolerance`` (what to run after construction, and now and then during a data-parallel run)."""
    differences = replica_differences(module, group)
    differing = {name: gap for name, gap in differences.items() if gap > tolerance}
    if differing:
        shown = ", ".join(f"{name} (up to {gap:.3g})" for name, gap in list(differing.items())[:5])
        raise RuntimeError(f"the replicas differ: {len(differing)} of {len(differences)} tensors are not the same "
                           f"on every rank: {shown}.  Initialise with the same seed on every rank, or broadcast the "
                           "first rank's weights before training (DDP does)")


def duplicate_fraction(samples_per_rank: Sequence[Sequence[int]]) -> float:
    """Of all the samples the ranks drew (``samples_per_rank[r]``: rank ``r``'s sample indices), the fraction
    that some other rank drew as well: 0 for disjoint shards, 1 when every rank draws the same samples."""
    if len(samples_per_rank) < 2:
        raise ValueError(f"duplicates need at least two ranks, got {len(samples_per_rank)}")
    owners: Counter = Counter()
    for samples in samples_per_rank:
        owners.update(set(samples))
    total = sum(len(samples) for samples in samples_per_rank)
    if total == 0:
        raise ValueError("no samples")
    shared = sum(1 for samples in samples_per_rank for sample in samples if owners[sample] > 1)
    return shared / total


def reduction_order_gaps(per_sample: torch.Tensor, world_sizes: Sequence[int]) -> dict[int, float]:
    """The mean of ``per_sample`` (``[samples, ...]``: per-sample gradients) computed as data parallelism does on
    each world size ``W`` (each rank sums its contiguous share, the ranks' sums are added in rank order, then
    divided): the largest absolute difference from the one-rank result, per ``W``.  Float32 arithmetic."""
    samples = per_sample.shape[0]
    bad = [w for w in world_sizes if isinstance(w, bool) or not isinstance(w, int) or w < 1 or samples % w]
    if bad:
        raise ValueError(f"world sizes {bad} do not divide the {samples} samples into equal shares")
    values = per_sample.float()

    def mean_over(world: int) -> torch.Tensor:
        total = torch.zeros_like(values[0])
        for share in values.split(samples // world):
            partial = torch.zeros_like(values[0])
            for row in share:  # a rank adds its samples one by one, as a gradient accumulates
                partial = partial + row
            total = total + partial
        return total / samples

    one = mean_over(1)
    return {world: (mean_over(world) - one).abs().max().item() for world in world_sizes}


SAVES = ("in place", "through a rename", "gathered to rank 0")


def save_from_every_rank(path: str | os.PathLike, how: str, group: Any = None, size: int = 1 << 18) -> dict[str, Any]:
    """Collective: every rank of ``group`` saves its own state (``size`` bytes of its rank number, as a rank's
    random states or shard would differ) as "the checkpoint" ``path``, at the same moment, ``how``:

    - ``"in place"``: every rank ``torch.save`` s onto ``path`` (the mistake);
    - ``"through a rename"``: every rank writes a temporary file of its own and renames it onto ``path``;
    - ``"gathered to rank 0"``: the states travel to the first rank (``all_gather_object``), which alone writes
      them all, through a rename (the fix).

    Then every rank reads ``path`` back, and takes what it finds there as its own state (from the gathered file:
    the entry at its rank).  Returns ``{"returned": ranks whose save returned, "holds": ranks whose whole state the
    file holds, "torn": whether the file was unreadable or mixed ranks' parts}`` (the same on every rank) and
    ``"read"``: the rank whose whole state this rank read back as its own (``None``: a torn file or entry)."""
    if how not in SAVES:
        raise ValueError(f"how must be one of {SAVES}, got {how!r}")
    path = Path(path)
    rank, world = torch_dist.get_rank(group), torch_dist.get_world_size(group)
    state = {"rank": rank, "payload": torch.full((size,), rank % 256, dtype=torch.uint8)}
    torch_dist.barrier(group=group)
    if how == "in place":
        torch.save(state, path)
    elif how == "through a rename":
        temporary = path.with_name(f".{path.name}.{rank}.partial")
        torch.save(state, temporary)
        os.replace(temporary, path)
    else:
        everyone: list[Any] = [None] * world
        torch_dist.all_gather_object(everyone, state, group=group)
        if rank == 0:
            temporary = path.with_name(f".{path.name}.partial")
            torch.save(everyone, temporary)
            os.replace(temporary, path)
    returned: list[Any] = [None] * world
    torch_dist.all_gather_object(returned, rank, group=group)  # every save has returned: nobody reads too early
    try:
        found = torch.load(path, weights_only=True)
        states = found if isinstance(found, list) else [found]
        whole = [bool((one["payload"] == one["rank"] % 256).all()) and one["payload"].numel() == size
                 for one in states]
        holds, torn = sorted(one["rank"] for one, ok in zip(states, whole, strict=True) if ok), not all(whole)
        position = rank if isinstance(found, list) else 0  # a gathered file: each rank's entry at its rank
        read = states[position]["rank"] if position < len(states) and whole[position] else None
    except Exception:  # noqa: BLE001 — a torn file fails in whichever way its parts happen to fail
        holds, torn, read = [], True, None
    torch_dist.barrier(group=group)  # nobody rewrites the file before every rank has read it
    return {"returned": sorted(returned), "holds": holds, "torn": torn, "read": read}


def probe_collectives(group: Any = None) -> dict[str, str | None]:
    """Collective: try each collective (and the reduction operations beside ``SUM``) on ``group``'s backend
    with 4-element float32 tensors on this rank's ``labkit.dist.device()``; ``{name: None}`` for what ran,
    ``{name: "Error: message"}`` for what the backend refused (a refusal comes before any message is sent,
    on every rank alike, so the ranks stay in step).  Needs at least two ranks."""
    rank, world = torch_dist.get_rank(group), torch_dist.get_world_size(group)
    if world < 2:
        raise ValueError(f"probing collectives needs at least 2 ranks, the group has {world}")
    first, second = global_rank(group, 0), global_rank(group, 1)
    device = dist.device()

    def ones(count: int = 1) -> torch.Tensor:
        return torch.ones(4 * count, device=device)

    def pieces() -> list[torch.Tensor]:
        return [ones() for _ in range(world)]

    def send_recv() -> None:
        if rank == 0:
            torch_dist.send(ones(), dst=second, group=group)
        elif rank == 1:
            torch_dist.recv(ones(), src=first, group=group)

    probes = {
        "send / recv": send_recv,
        "broadcast": lambda: torch_dist.broadcast(ones(), src=first, group=group),
        "all_reduce": lambda: torch_dist.all_reduce(ones(), group=group),
        "reduce": lambda: torch_dist.reduce(ones(), dst=first, group=group),
        "all_gather": lambda: torch_dist.all_gather(pieces(), ones(), group=group),
        "gather": lambda: torch_dist.gather(ones(), pieces() if rank == 0 else None, dst=first, group=group),
        "scatter": lambda: torch_dist.scatter(ones(), pieces() if rank == 0 else None, src=first, group=group),
        "reduce_scatter": lambda: torch_dist.reduce_scatter(ones(), pieces(), group=group),
        "all_to_all": lambda: torch_dist.all_to_all(pieces(), pieces(), group=group),
        "barrier": lambda: torch_dist.barrier(group=group),
    }
    for name, op in (("AVG", torch_dist.ReduceOp.AVG), ("MAX", torch_dist.ReduceOp.MAX),
                     ("PRODUCT", torch_dist.ReduceOp.PRODUCT)):
        probes[f"all_reduce ({name})"] = lambda op=op: torch_dist.all_reduce(ones(), op=op, group=group)
    probes["all_reduce (PREMUL_SUM)"] = lambda: torch_dist.all_reduce(
        ones(), op=torch_dist._make_nccl_premul_sum(0.5), group=group)
    found: dict[str, str | None] = {}
    for name, probe in probes.items():
        try:
            probe()
            found[name] = None
        except (RuntimeError, ValueError, NotImplementedError) as error:
            found[name] = f"{type(error).__name__}: {str(error).strip().splitlines()[0]}"
    return found
