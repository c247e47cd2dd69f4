"""A hung job: which rank, which collective, which sequence number, from torch's flight recorder.

A rank that skips a collective does not fail: the others wait in it until the process group's timeout (NCCL's
default is 10 minutes, gloo's 30), and the error, when it comes, says only that a receive timed out.  PyTorch's
*flight recorder* keeps, on every rank, a ring buffer of the last ``TORCH_FR_BUFFER_SIZE`` collectives it issued
(set the variable before the process group starts; 0, the default, records nothing): for each, its process group,
its sequence number in that group (``collective_seq_id``, from 1), its operation (``profiling_name``, such as
``gloo:all_reduce``), its tensors' sizes and whether it finished (``retired``).  NCCL's watchdog writes the buffer
to ``TORCH_FR_DUMP_TEMP_FILE<rank>`` on a timeout; on any backend a rank can read it itself
(:func:`flight_record`, from ``torch._C._distributed_c10d._dump_fr_trace``), for instance when its collective
raises the timeout.  torch's analyser (``python -m torch.distributed.flight_recorder.fr_trace DIR``) lines the ranks'
dumps up (in torch 2.14 it stops with a ``KeyError`` on gloo's dumps, whose group configuration is keyed otherwise);
:func:`hang_report` does the same for the question a hang asks: the first sequence number that some ranks of a group
called and others never reached, or called as another operation.

``TORCH_DISTRIBUTED_DEBUG=DETAIL`` asks the other question, before the hang: every collective first exchanges a
fingerprint (sequence number, operation, shapes) over a helper group, so a rank that calls another collective than
the others raises "Detected mismatch between collectives on ranks" at once, at the cost of an extra collective per
collective.  A rank that calls *nothing* more is not a mismatch it can see: the flight recorder is the tool then.
"""

from __future__ import annotations

import datetime
import os
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as torch_dist


def watched_group(timeout_s: float = 60.0, detail: bool = False, buffer: int = 64, backend: str = "gloo") -> Any:
    """A new process group of every rank (collective: every rank calls it), watched: the flight recorder keeps its
    last ``buffer`` collectives (``TORCH_FR_BUFFER_SIZE``, set here where it is not), a collective that a rank never
    joins raises after ``timeout_s`` rather than gloo's 30 minutes, and with ``detail`` the group runs under
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (its collectives' fingerprints compared first), which is put back afterwards:
    the other groups run as before."""
    if not (isinstance(timeout_s, int | float) and not isinstance(timeout_s, bool) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 1:
        raise ValueError(f"buffer must be a positive number of collectives, got {buffer!r}")
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(buffer))
    previous = os.environ.get("TORCH_DISTRIBUTED_DEBUG")
    if detail:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        torch._C._distributed_c10d.set_debug_level_from_env()  # read once at import; read it again now
    try:
        return torch_dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    finally:
        if detail:
            if previous is None:
                os.environ.pop("TORCH_DISTRIBUTED_DEBUG")
            else:
                os.environ["TORCH_DISTRIBUTED_DEBUG"] = previous
            torch._C._distributed_c10d.set_debug_level_from_env()


def flight_record() -> dict[str, Any]:
    """This rank's flight recorder: ``{"entries": [...], "pg_status": {...}, "pg_config": {...}, ...}`` as torch
    dumps it (``entries`` empty unless ``TORCH_FR_BUFFER_SIZE`` was set before the process group started)."""
    return pickle.loads(torch._C._distributed_c10d._dump_fr_trace())


@dataclass(frozen=True)
class Hang:
    """Where a group's ranks parted: collective ``seq`` (from 1) of process group ``group``, called as ``ops``
    (``{rank: "gloo:all_reduce", ...}``, the operation each rank called there) by the ranks that reached it, never
    called by ``absent``; ``message`` says it in words."""

    group: str
    seq: int
    ops: dict[int, str]
    absent: tuple[int, ...]
    message: str


def hang_report(records: dict[int, dict[str, Any]], group: str | None = None) -> Hang | None:
    """The first collective at which the ranks of ``records`` (``{rank: flight_record()}``, every rank of the groups
    looked at) parted, in ``group`` (a process group's id, ``"0"`` the default group; default: every group, in the
    order of their ids): a sequence number some ranks called and others never did, or called as different
    operations.  ``None`` if every rank called the same collectives.  Not whether a collective finished: gloo marks
    an entry ``retired`` when its work object is released, which can come after the dump."""
    by_group: dict[str, dict[int, dict[int, str]]] = {}
    for rank, record in records.items():
        for entry in record["entries"]:
            if not entry.get("is_p2p"):
                by_group.setdefault(entry["process_group"][0], {}).setdefault(rank, {})[
                    entry["collective_seq_id"]] = entry["profiling_name"]
    for name in sorted(by_group, key=lambda key: (len(key), key)):
        if group is not None and name != group:
            continue
        called = {rank: by_group[name].get(rank, {}) for rank in sorted(records)}
        for seq in sorted({seq for ops in called.values() for seq in ops}):
            ops = {rank: ops[seq] for rank, ops in called.items() if seq in ops}
            absent = tuple(rank for rank in called if rank not in ops)
            if not absent and len(set(ops.values())) == 1:
                continue
            where = f"collective #{seq} of process group {name}"
            if absent:
                callers = ", ".join(map(str, ops))
                message = (f"{where}: ranks {callers} called it ({', '.join(sorted(set(ops.values())))}) and wait; "
                           f"rank{'s' if len(absent) > 1 else ''} {', '.join(map(str, absent))} never did")
            else:
                message = f"{where}: the ranks called different operations (" + ", ".join(
                    f"rank {rank} {op}" for rank, op in ops.items()) + ")"
            return Hang(name, seq, ops, absent, message)
    return None
