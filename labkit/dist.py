"""Runtime facts about the distributed job this process belongs to.

Every technique in labkit asks the same few questions: *which rank am I, how many ranks are there, which
device should my tensors live on, which backend moves them?*  This module answers them in one place, for any
initialised default process group, whoever created it: ``labkit.launch``, ``torchrun`` or a hand-written
``torch.multiprocessing.spawn``.

Vocabulary (the terms the rest of the course uses):

- **rank**: this process's number in the job, ``0 .. world_size - 1``.  Rank 0 is conventionally the "main"
  rank that logs, saves checkpoints and prints.
- **world size**: how many processes take part.
- **local rank**: this process's number *on its own machine*; it picks the GPU (``cuda:<local_rank>``).
- **backend**: the library that moves tensors between ranks.  NCCL drives GPUs over NVLink/InfiniBand; gloo
  runs on CPUs over TCP (on one machine: the loopback interface).  labkit code is written once and runs on both.
- **process group**: the set of ranks a collective runs over.  The *default* group holds every rank; subgroups
  (for tensor- or pipeline-parallel dimensions) are made with ``torch.distributed.new_group``.

Before a process group exists these functions fall back to the environment variables that ``torchrun`` sets
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), and then to a single process (rank 0 of 1).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as torch_dist

BACKENDS = ("auto", "gloo", "nccl")


def is_initialized() -> bool:
    """True when a default process group exists in this process."""
    return torch_dist.is_available() and torch_dist.is_initialized()


def rank() -> int:
    """This process's rank in the default group (or ``$RANK``, or 0)."""
    if is_initialized():
        return torch_dist.get_rank()
    return int(os.environ.get("RANK", 0))


def world_size() -> int:
    """Number of ranks in the default group (or ``$WORLD_SIZE``, or 1)."""
    if is_initialized():
        return torch_dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def local_rank() -> int:
    """This process's rank on its own machine: ``$LOCAL_RANK`` when set (torchrun, labkit.launch).

    A process group created by hand without ``LOCAL_RANK`` is assumed to live on one machine, so the global
    rank is used.
    """
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    return rank()


def is_main() -> bool:
    """True on rank 0, the rank that prints, logs and saves."""
    return rank() == 0


def backend() -> str | None:
    """The default group's backend (``"gloo"``, ``"nccl"``, ...), or ``None`` when there is no group."""
    if not is_initialized():
        return None
    return str(torch_dist.get_backend())


def gpus_available() -> int:
    """How many CUDA devices this process can see (0 on a CPU-only build or machine)."""
    if not torch.cuda.is_available():
        return 0
    return torch.cuda.device_count()


def resolve_backend(backend: str = "auto", nprocs: int = 1) -> str:
    """Turn a backend request into the backend to use for ``nprocs`` ranks on this machine.

    ``"auto"`` picks NCCL when CUDA offers a GPU for every local rank (one GPU per rank is what NCCL wants)
    and NCCL is compiled in; otherwise gloo, which works everywhere.  Asking for ``"nccl"`` explicitly on a
    machine that cannot honour it is an error, raised here, before any process starts.
    """
    if not isinstance(backend, str) or backend.lower() not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    backend = backend.lower()
    gpus = gpus_available()
    nccl_built = torch_dist.is_available() and torch_dist.is_nccl_available()
    if backend == "auto":
        return "nccl" if nccl_built and gpus >= nprocs else "gloo"
    if backend == "nccl":
        if not nccl_built:
            raise ValueError("backend='nccl' was requested but this PyTorch build has no NCCL support; use 'gloo'")
        if gpus < nprocs:
            raise ValueError(
                f"backend='nccl' needs one GPU per rank: nprocs={nprocs} but {gpus} CUDA device(s) are visible; "
                "use backend='gloo' (CPU) or fewer ranks"
            )
    if backend == "gloo" and not (torch_dist.is_available() and torch_dist.is_gloo_available()):
        raise ValueError("backend='gloo' was requested but this PyTorch build has no gloo support")
    return backend


def device() -> torch.device:
    """Where this rank's tensors live: ``cuda:<local_rank>`` under NCCL, ``cpu`` under gloo.

    Without a process group: the local GPU when there is one, else the CPU.  Code that allocates with
    ``device=labkit.dist.device()`` runs unchanged on a laptop and on a GPU cluster.
    """
    current = backend()
    if current is None:
        return torch.device(f"cuda:{local_rank()}") if gpus_available() > 0 else torch.device("cpu")
    if current == "nccl":
        return torch.device(f"cuda:{local_rank()}")
    return torch.device("cpu")


def describe() -> str:
    """One line naming this rank, e.g. ``rank 1/4 (local 1) gloo cpu`` — handy at the start of a log."""
    return f"rank {rank()}/{world_size()} (local {local_rank()}) {backend() or 'no-group'} {device()}"


# --------------------------------------------------------------------------------------------------------
# Groups: the one copy of the helpers every technique needs

def in_torchrun() -> bool:
    """True inside a job started by ``torchrun`` (or anything that sets ``RANK`` and ``WORLD_SIZE``), or when
    this process already belongs to a process group: then ``labkit.launch`` runs in place instead of forking."""
    return is_initialized() or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def require_group(group: Any = None) -> torch_dist.ProcessGroup | None:
    """Check that a process group exists and that this process belongs to ``group``; return the group.

    ``group`` may be ``None`` (every rank), a ``ProcessGroup``, or a one-dimensional ``DeviceMesh`` (such as
    ``Mesh.device_mesh["dp"]``), whose group is returned.  Raises ``RuntimeError`` without a process group and
    ``ValueError`` when this process is not a member, naming the global rank.
    """
    if not is_initialized():
        raise RuntimeError("no process group is initialised: run this inside labkit.launch.launch(fn, "
                           "nprocs=N) or call torch.distributed.init_process_group first")
    if group is torch_dist.GroupMember.NON_GROUP_MEMBER:  # what new_group hands a rank it does not include
        raise ValueError(f"this process (global rank {torch_dist.get_rank()}) is not a member of the group it was "
                         "given (new_group returned GroupMember.NON_GROUP_MEMBER on this rank)")
    if group is not None and not isinstance(group, torch_dist.ProcessGroup):
        get_group = getattr(group, "get_group", None)
        if get_group is None or getattr(group, "ndim", 1) != 1:
            raise TypeError(f"group must be None, a torch.distributed.ProcessGroup or a one-dimensional "
                            f"DeviceMesh (e.g. mesh.group('dp')), got {type(group).__name__}: {group!r:.80}")
        group = get_group()
    if group is not None and torch_dist.get_rank(group) < 0:
        raise ValueError(f"this process (global rank {torch_dist.get_rank()}) is not a member of group {group!r}")
    return group


def global_rank(group: torch_dist.ProcessGroup | None, group_rank: int) -> int:
    """The global rank of ``group``'s rank ``group_rank`` (what ``send``, ``recv``, ``broadcast(src=)`` and
    ``gather(dst=)`` expect, whatever group they are given)."""
    return group_rank if group is None else torch_dist.get_global_rank(group, group_rank)
