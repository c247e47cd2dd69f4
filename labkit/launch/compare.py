"""The collective-sequence check, part 2: compare the ranks' recorded calls; name the first place they disagree.

:mod:`labkit.launch.record` records, on each rank, every collective and point-to-point call with a sequence
number per process group.  Here the ranks' logs are lined up: for each group, the k-th collective of every member
(op, tensor shapes and dtypes, root) must be the same; for each point-to-point channel (group, sender, receiver,
tag), the k-th send must meet the k-th receive, with as many elements of the same dtype.  This is the check that
PyTorch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` makes before every collective (each rank's fingerprint of the call
compared over a helper group, in ``ProcessGroupWrapper``), made instead when something went wrong:

- :func:`explain`: ``labkit.launch`` calls it on :class:`~labkit.launch.CollectiveTimeout` and
  :class:`~labkit.launch.RankFailed`, so a hang or a size error says which ranks disagreed, on what, and where;
- :func:`check_collectives`: on demand inside a running job.  The logs travel through the rendezvous store, with
  a timeout, not through a collective: if the ranks disagree, a collective could itself hang.

What is compared: the op; every tensor argument's dtype and shape, except those only the root holds (``gather``'s
``gather_list``, ``scatter``'s ``scatter_list``) and ``all_to_all``'s, whose splits may differ by rank (dtypes and
list lengths only); the root of ``broadcast``/``reduce``/``gather``/``scatter`` and their object variants; the
length of ``broadcast_object_list``'s list.  Not checked: the reduction op, devices, receives from any source (a
channel into a rank that posts one is skipped), and what was not recorded (see
:mod:`labkit.launch.record`).  With several disagreements, the one whose first call comes earliest in some
rank's log is reported (the cause, usually; what follows it is its consequence).
"""

from __future__ import annotations

import datetime
import json
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch.distributed as torch_dist
from torch.distributed import distributed_c10d as c10d

from labkit.launch.record import RECEIVES, ROOTED, SENDS, Entry, read_log, recording_path

# Arguments compared across ranks, where not all of them are: only the root holds these lists.
COMPARED = {"gather": ("tensor",), "scatter": ("tensor",), "gather_object": (), "scatter_object_list": ()}
UNEVEN = ("all_to_all", "all_to_all_single")  # per-rank splits may differ: dtypes and list lengths only
_rounds: dict[tuple[str, str], int] = defaultdict(int)  # (log, group name) -> check_collectives calls so far


@dataclass(frozen=True)
class Disagreement:
    """The first place where the ranks' sequences differ.  ``calls`` holds each rank's call there (``None``: it
    made none): for a collective every member of ``group_ranks`` at collective ``seq``; for point-to-point the
    sender's send and the receiver's receive.  ``message`` says it in words."""

    kind: str  # "collective" or "point-to-point"
    group_ranks: tuple[int, ...]
    seq: int
    calls: dict[int, Entry | None]
    message: str


class CollectiveMismatch(RuntimeError):
    """:func:`check_collectives` found ranks that disagree (``.disagreement``) or that never reached the check
    (``.absent_ranks``)."""

    def __init__(self, message: str, disagreement: Disagreement | None, absent_ranks: list[int]):
        super().__init__(message)
        self.disagreement, self.absent_ranks = disagreement, absent_ranks


def first_disagreement(logs: dict[int, list[Entry]], failed: Iterable[int] = ()) -> Disagreement | None:
    """The first place where the ranks' logs (global rank -> its entries) disagree, or ``None``.

    Each process group is compared only when the logs of all its members are given, collective by collective
    (sequence number k of every member), and each point-to-point channel when both ends are.  A member without a
    k-th call while others made one disagrees too, unless it is in ``failed`` (its sequence ended because it
    raised).  Of several disagreements, the one whose earliest call comes first in some rank's log is returned.
    """
    failed = set(failed)
    collectives: dict[str, dict[int, dict[int, Entry]]] = defaultdict(lambda: defaultdict(dict))
    members: dict[str, tuple[int, ...]] = {}
    sends: dict[tuple, dict[int, Entry]] = defaultdict(dict)
    receives: dict[tuple, dict[int, Entry]] = defaultdict(dict)
    any_source = set()
    for rank, entries in logs.items():
        for entry in entries:
            if entry.op in SENDS:
                sends[(entry.group, rank, entry.peer, entry.tag)][entry.seq] = entry
            elif entry.op in RECEIVES and entry.seq is None:
                any_source.add((entry.group, rank))
            elif entry.op in RECEIVES:
                receives[(entry.group, entry.peer, rank, entry.tag)][entry.seq] = entry
            else:
                members[entry.group] = entry.ranks
                collectives[entry.group][rank][entry.seq] = entry
    found = []
    for group, ranks in sorted(members.items(), key=repr):
        if set(ranks) <= logs.keys():
            found.extend(_first_collective_difference(ranks, collectives[group], failed))
    for channel in sorted(sends.keys() | receives.keys(), key=repr):  # sorted: ties go the same way every run
        group, source, destination, _tag = channel
        if {source, destination} <= logs.keys() and (group, destination) not in any_source:
            found.extend(_first_message_difference(channel, sends[channel], receives[channel], failed))
    return min(found, key=lambda pair: pair[0])[1] if found else None


def _first_collective_difference(ranks, calls_of, failed) -> list[tuple[int, Disagreement]]:
    last = max((max(calls, default=-1) for calls in calls_of.values()), default=-1)
    for seq in range(last + 1):
        calls = {rank: calls_of[rank].get(seq) for rank in ranks}
        made = {rank: call for rank, call in calls.items() if call is not None}
        missing = [rank for rank, call in calls.items() if call is None and rank not in failed]
        if missing or len({_signature(call) for call in made.values()}) > 1:
            message = _collective_message(ranks, seq, calls, calls_of)
            return [(min(call.index for call in made.values()),
                     Disagreement("collective", tuple(ranks), seq, calls, message))]
    return []


def _first_message_difference(channel, sends, receives, failed) -> list[tuple[int, Disagreement]]:
    group, source, destination, tag = channel
    for seq in range(max(max(sends, default=-1), max(receives, default=-1)) + 1):
        send, receive = sends.get(seq), receives.get(seq)
        if (send is None and source in failed) or (receive is None and destination in failed):
            return []
        if send is None or receive is None or _payload(send) != _payload(receive):
            made = send or receive
            what = f"message #{seq + 1} from rank {source} to rank {destination}" + (f" (tag {tag})" if tag else "")
            lines = [f"ranks {source} and {destination} disagree on point-to-point {what} on group "
                     f"{list(made.ranks)}:",
                     f"    rank {source} sends:    " + (send.describe() if send else "nothing (no such send)"),
                     f"    rank {destination} receives: " + (receive.describe() if receive else
                                                          "nothing (no such receive)")]
            calls = {source: send, destination: receive}
            return [(made.index, Disagreement("point-to-point", made.ranks, seq, calls, "\n".join(lines)))]
    return []


def _signature(entry: Entry) -> tuple:
    """What must be equal across the members of a group for the same collective."""
    names = COMPARED.get(entry.op, tuple(entry.tensors))
    tensors = [(name, entry.tensors.get(name)) for name in names]
    if entry.op in UNEVEN:
        tensors = [(name, _dtypes(value)) for name, value in tensors]
    return entry.op, entry.peer if entry.op in ROOTED else None, json.dumps(tensors)


def _dtypes(value: Any) -> Any:
    return [_dtypes(item) for item in value] if isinstance(value, list) else str(value).split("[")[0]


def _payload(entry: Entry) -> Any:
    """A message's dtype and element count (a send of float32[4] may land in a float32[2, 2] buffer)."""
    value = next(iter(entry.tensors.values()), None)
    if not isinstance(value, str) or "[" not in value:
        return value
    dtype, shape = value.split("[", 1)
    return dtype, math.prod(int(size) for size in shape.rstrip("]").split(",") if size.strip())


def _collective_message(ranks, seq, calls, calls_of) -> str:
    made = {rank: call for rank, call in calls.items() if call is not None}
    missing = [rank for rank, call in calls.items() if call is None]
    by_call: dict[str, list[int]] = defaultdict(list)
    for rank, call in made.items():
        by_call[call.describe()].append(rank)
    if missing and len(by_call) == 1:
        (described, callers), = by_call.items()
        head = (f"{_ranks(missing)} never called collective #{seq + 1} on group {list(ranks)}, which "
                f"{_ranks(callers)} called: {described}")
    else:
        head = f"ranks disagree at collective #{seq + 1} on group {list(ranks)}:"
    lines = [head] + [f"    {_ranks(callers)}: {described}" for described, callers in by_call.items()]
    for rank in missing:
        earlier = calls_of[rank]
        last = f"#{max(earlier) + 1}, {earlier[max(earlier)].describe()}" if earlier else "none"
        lines.append(f"    {_ranks([rank])}: no collective #{seq + 1} (its last on this group: {last})")
    return "\n".join(lines)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, sorted(ranks)))


# --------------------------------------------------------------------------------------------------------
# Using it: after a failed launch, and on demand inside a job


def explain(error: BaseException, paths: dict[int, str | None], failed: Iterable[int] = ()) -> BaseException:
    """Read each rank's log (``paths``: global rank -> file), set ``error.disagreement`` to the first
    disagreement (or ``None``) and put its report at the head of the error's message.  ``launch`` calls it."""
    found = first_disagreement({rank: read_log(path) for rank, path in paths.items() if path}, failed)
    error.disagreement = found
    if found is not None and error.args:
        error.args = (f"{found.message}\n\n{error.args[0]}", *error.args[1:])
    return error


def check_collectives(group: Any = None, timeout_s: float = 30.0) -> int:
    """Compare this group's ranks' recorded calls so far; raise :class:`CollectiveMismatch` on the first
    disagreement, or naming the ranks that did not reach this check within ``timeout_s`` seconds.

    Every member must call it at the same point of the program (a point where they should agree).  The logs go
    through the rendezvous store with a timeout, never through a collective, so ranks that disagree get an
    error, not a hang.  Compared: the groups all of whose members are in ``group`` and the point-to-point
    channels between them.  Returns how many calls of this rank were compared.
    """
    path = recording_path()
    if path is None:
        raise RuntimeError("check_collectives needs recording: run inside labkit.launch.record_collectives(path) "
                           "or labkit.launch.launch(..., check_collectives=True)")
    resolved = c10d._get_default_group() if group is None else group
    ranks = tuple(torch_dist.get_process_group_ranks(resolved))
    me = torch_dist.get_rank()
    if me not in ranks:
        raise ValueError(f"this process (global rank {me}) is not a member of the group it was given")
    name, store = str(resolved.group_name), c10d._get_default_store()
    round_ = _rounds[(path, name)]
    _rounds[(path, name)] += 1
    keys = {rank: f"labkit/collective_check/{name}/{round_}/{rank}" for rank in ranks}
    mine = [entry for entry in read_log(path) if set(entry.ranks) <= set(ranks)
            and (entry.peer is None or entry.peer in ranks)]
    store.set(keys[me], json.dumps([entry.__dict__ for entry in mine]))
    absent = []
    try:
        store.wait(list(keys.values()), datetime.timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 — torch raises DistStoreError / RuntimeError on a timeout
        absent = [rank for rank, key in keys.items() if not store.check([key])]
    logs = {rank: [Entry(**{**fields, "ranks": tuple(fields["ranks"])}) for fields in json.loads(store.get(key))]
            for rank, key in keys.items() if rank not in absent}
    if round_ > 0 and not absent:
        store.delete_key(f"labkit/collective_check/{name}/{round_ - 1}/{me}")  # every member has read it
    found = first_disagreement(logs)
    if found is None and not absent:
        return len(mine)
    lines = [found.message] if found else []
    if absent:
        lines.append(f"{_ranks(absent)} did not reach check_collectives within {timeout_s:g} s (stuck in a "
                     "collective the others do not call, or slower than the timeout)")
    raise CollectiveMismatch("\n".join(lines), found, absent)
