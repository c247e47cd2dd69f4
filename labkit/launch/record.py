"""The collective-sequence check, part 1: record which collectives each rank calls, in order, as it calls them.

A collective is a promise every rank of a group makes: *the k-th collective I call on this group is the same
operation, on tensors of the same shapes and dtypes, as your k-th*.  Break it and the job does not fail, it
hangs: rank 0 skips an ``all_reduce`` that the others call and waits in its next collective for ever; two ranks
call ``all_reduce`` then ``broadcast`` in opposite orders; a ``[4]`` tensor meets a ``[5]`` one.  A timeout only
says *that* the ranks got stuck.  PyTorch's answer is ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: every process group is
wrapped in a ``ProcessGroupWrapper`` that, before each collective, has the ranks exchange a *fingerprint* of it
(operation, tensor shapes, dtypes and devices) over a helper gloo group and raises on the first difference.  That
costs an extra collective per collective.  labkit makes the same check after the fact, for free on the wire:

- :func:`record_collectives` wraps the functions of ``torch.distributed`` (``all_reduce``, ``broadcast``, ...,
  ``send``, ``isend``, ``batch_isend_irecv``) so that each call is first appended to a per-rank JSON-lines file:
  the op, its tensors as ``dtype[shape]``, the group's global ranks, the root or peer, a *sequence number per
  process group* (the k-th collective this rank called on it) and the caller's ``file:line`` (the first frame
  outside torch; when that is inside labkit, also the first frame outside labkit, as ``user``).  The line is
  written *before* the real op runs and with one unbuffered ``write``, so the entry of a call that hangs is on
  disk, and a parent can read it while the rank is stuck or after it was killed.  Cost: tens to hundreds of µs a
  call on a busy 2-core machine (lesson 09 measures it beside an unrecorded all-reduce).
- :mod:`labkit.launch.compare` lines the logs up, group by group and sequence number by sequence number,
  and reports the first place where the members differ (``first_disagreement``), after a failed launch
  (``labkit.launch`` records on every rank by default and puts the disagreement at the head of its
  ``CollectiveTimeout`` or ``RankFailed``) or on demand inside a job (``check_collectives``).

Only calls made while recording, through these module attributes, are seen: a function bound earlier by ``from
torch.distributed import all_reduce`` is not, nor are calls below this Python layer (functional collectives,
DTensor, the C++ reducer of PyTorch's DDP).  torch's own nested calls (``all_gather_object`` runs an
``all_gather``) are recorded once, as the outer call.  ``P2POp(dist.isend, ...)`` built while recording works:
the wrapper compares equal to the function it wraps.  What is compared: see :mod:`labkit.launch.compare`.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as torch_dist
from torch.distributed import distributed_c10d as c10d

ROOTED = {"broadcast": "src", "reduce": "dst", "gather": "dst", "scatter": "src", "broadcast_object_list": "src",
          "gather_object": "dst", "scatter_object_list": "src"}
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "all_to_all", "all_to_all_single", "barrier", "monitored_barrier", "all_gather_object",
               *ROOTED)
SENDS = ("send", "isend", "send_object_list")
RECEIVES = ("recv", "irecv", "recv_object_list")
RECORDED = (*COLLECTIVES, *SENDS, *RECEIVES, "batch_isend_irecv")

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_LAUNCH_DIR = os.path.dirname(os.path.abspath(__file__))
_LABKIT_DIR = os.path.dirname(_LAUNCH_DIR) + os.sep
_STDLIB_DIR = os.path.dirname(os.__file__) + os.sep
_LAUNCHER = (os.path.join(_LAUNCH_DIR, "worker.py"), os.path.join(_LAUNCH_DIR, "launcher.py"))


@dataclass(frozen=True)
class Entry:
    """One recorded call.  ``seq`` is 0-based: the k-th collective this rank called on ``group``, or for a
    point-to-point op the k-th message on its (group, sender, receiver, tag) channel (``None``: from any source).
    ``tensors`` maps argument names to ``"float32[4, 2]"`` (a list for list arguments, ``"3 objects"`` for object
    lists); ``peer`` is the root's or the peer's global rank; ``index`` the call's place in this rank's log."""

    rank: int
    index: int
    group: str
    ranks: tuple[int, ...]
    seq: int | None
    op: str
    tensors: dict[str, Any]
    peer: int | None
    tag: int | None
    where: str
    function: str
    user: str | None = None  # the first frame outside labkit, when ``where`` is inside it

    def describe(self) -> str:
        args = [f"{name}={_short(value)}" for name, value in self.tensors.items()]
        if self.peer is not None:
            args.append(f"{ROOTED.get(self.op) or ('dst' if self.op in SENDS else 'src')}={self.peer}")
        via = f" (called from {_path(self.user)})" if self.user else ""
        return f"{self.op}({', '.join(args)}) at {_path(self.where)} in {self.function}{via}"


# --------------------------------------------------------------------------------------------------------
# Recording


class _Recorder:
    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        self.count = 0
        self.next_seq: dict[Any, int] = defaultdict(int)
        self.lock = threading.Lock()

    def write(self, entry: dict, channel: Any) -> None:
        with self.lock:
            if channel is not None:
                entry["seq"] = self.next_seq[channel]
                self.next_seq[channel] += 1
            entry["index"] = self.count
            self.count += 1
            os.write(self.fd, (json.dumps(entry) + "\n").encode())


_active: list[_Recorder] = []
_patched: list[tuple[Any, str, Any]] = []
_groups: dict[Any, tuple[str, tuple[int, ...]]] = {}
_state = threading.local()  # .inside: a recorded call is running (torch's own nested calls are not recorded)


class _Wrapper:
    """Stands in for one ``torch.distributed`` function: records the call, then makes it.  Compares equal to the
    function it wraps, so that ``P2POp(dist.isend, ...)`` passes torch's ``op in [isend, irecv]`` check."""

    def __init__(self, original: Any):
        functools.update_wrapper(self, original)
        self.original, self.op = original, original.__name__
        self.names = list(inspect.signature(original).parameters)

    def __eq__(self, other: object) -> bool:
        return other is self or other is self.original

    def __hash__(self) -> int:
        return hash(self.original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not _active or getattr(_state, "inside", False):
            return self.original(*args, **kwargs)
        _state.inside = True
        try:
            try:
                _record(self, {**dict(zip(self.names, args, strict=False)), **kwargs}, sys._getframe(1))
            except Exception:  # noqa: BLE001 — a call recording cannot describe is left to torch to reject
                pass
            return self.original(*args, **kwargs)
        finally:
            _state.inside = False


@contextmanager
def record_collectives(path: str | os.PathLike) -> Iterator[str]:
    """Write every ``torch.distributed`` collective and point-to-point call this process makes while the block
    runs to ``path`` (emptied first; JSON lines, one :class:`Entry` each); put the original functions back
    afterwards.  Blocks may nest (each file gets every call, numbered from its own start)."""
    recorder = _Recorder(os.fspath(path))
    if not _active:
        _install()
    _active.append(recorder)
    try:
        yield recorder.path
    finally:
        _active.remove(recorder)
        os.close(recorder.fd)
        if not _active:
            _uninstall()


def _install() -> None:
    for name in RECORDED:
        wrapper = _Wrapper(getattr(torch_dist, name))
        # torch's batch_isend_irecv tells a send from a receive with `op is isend`: keep c10d's own isend/irecv
        for module in (torch_dist,) if name in ("isend", "irecv") else (torch_dist, c10d):
            _patched.append((module, name, getattr(module, name)))
            setattr(module, name, wrapper)


def _uninstall() -> None:
    while _patched:
        module, name, original = _patched.pop()
        setattr(module, name, original)
    _groups.clear()


def _record(wrapper: _Wrapper, named: dict[str, Any], frame: Any) -> None:
    where, function, user = _caller(frame)
    me = torch_dist.get_rank()
    if wrapper.op == "batch_isend_irecv":
        for p2p in named["p2p_op_list"]:
            if isinstance(p2p.op, _Wrapper):
                p2p.op = p2p.op.original  # what torch's `op is isend` expects
            op = p2p.op.__name__
            _write_call(op, {"tensor": p2p.tensor, "group": p2p.group, "tag": p2p.tag,
                             "dst" if op in SENDS else "src": p2p.peer}, me, where, function, user)
    else:
        _write_call(wrapper.op, named, me, where, function, user)


def _write_call(op: str, named: dict[str, Any], me: int, where: str, function: str, user: str | None) -> None:
    group_name, ranks = _group_of(named.get("group"))
    if me not in ranks:
        return  # torch makes a collective on a group this rank is not in a no-op
    tensors = {}
    for name, value in named.items():
        if isinstance(value, torch.Tensor):
            tensors[name] = _tensor(value)
        elif isinstance(value, (list, tuple)) and "object" in name:
            tensors[name] = f"{len(value)} objects"
        elif isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            tensors[name] = [_tensor(item) for item in value]
    peer, tag, channel = None, None, (group_name,)
    side = ROOTED.get(op) or ("dst" if op in SENDS else "src" if op in RECEIVES else None)
    if side is not None:
        peer = named.get(side)
        if peer is None and named.get(f"group_{side}") is not None:
            peer = ranks[named[f"group_{side}"]]
    if op in SENDS or op in RECEIVES:
        tag = named.get("tag", 0)
        channel = None if peer is None else (group_name, me, peer, tag) if op in SENDS else (group_name, peer, me, tag)
    entry = {"rank": me, "group": group_name, "ranks": ranks, "seq": None, "op": op, "tensors": tensors,
             "peer": peer, "tag": tag, "where": where, "function": function, "user": user}
    for recorder in _active:
        recorder.write(dict(entry), channel)


def _group_of(group: Any) -> tuple[str, tuple[int, ...]]:
    if group not in _groups:
        resolved = c10d._get_default_group() if group is None else group
        _groups[group] = (str(resolved.group_name), tuple(torch_dist.get_process_group_ranks(resolved)))
    return _groups[group]


def _tensor(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"


def _caller(frame: Any) -> tuple[str, str, str | None]:
    """The first frame outside torch and this module; and, when that one is labkit's, the first outside labkit."""
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH_DIR):
        frame = frame.f_back
    if frame is None:
        return "?", "?", None
    where, function = f"{frame.f_code.co_filename}:{frame.f_lineno}", frame.f_code.co_name
    user = frame
    while user is not None and user.f_code.co_filename.startswith(_LABKIT_DIR):
        if user.f_code.co_filename in _LAUNCHER:
            return where, function, None  # labkit's own code, started by launch (labkit.train, a checker)
        user = user.f_back
    if user is frame or user is None or user.f_code.co_filename.startswith(_STDLIB_DIR):
        return where, function, None
    return where, function, f"{user.f_code.co_filename}:{user.f_lineno}"


def recording_path() -> str | None:
    """The file this process is recording into (the innermost :func:`record_collectives`), or ``None``."""
    return _active[-1].path if _active else None


def read_log(path: str | os.PathLike) -> list[Entry]:
    """The entries recorded at ``path`` ( ``[]`` when there is no file: the rank recorded nothing).  A last line
    cut short by a killed rank is ignored."""
    try:
        with open(path) as handle:
            lines = handle.read().splitlines()
    except OSError:
        return []
    entries = []
    for line in lines:
        try:
            fields = json.loads(line)
        except json.JSONDecodeError:
            continue
        entries.append(Entry(**{**fields, "ranks": tuple(fields["ranks"])}))
    return entries


def _short(value: Any) -> str:
    if isinstance(value, list):
        return f"[{', '.join(value)}]" if len(set(value)) > 1 or len(value) < 3 else f"[{value[0]}] * {len(value)}"
    return str(value)


def _path(where: str) -> str:
    relative = os.path.relpath(where)
    return relative if not relative.startswith("..") else os.path.basename(where)

