"""What a rank does to files while a student's code runs, seen where a name bound early cannot hide it.

Exercise 09's checks must know which rank wrote what, whether the checkpoint's final path was ever written in
place, and whether the data reached the disk before the rename.  Patching ``torch.save`` or ``builtins.open``
sees none of it once a student writes ``from torch import save``, ``pathlib.Path.write_bytes`` or ``from os
import replace``, and torch.save of a path writes through its C++ ``PyTorchFileWriter``, which calls no Python
``open`` at all.  So :func:`watching` observes one layer down, on every rank:

- **Python's audit hooks** (PEP 578): every ``open`` for writing (``open``, ``io.open``, ``os.open``,
  ``pathlib``), every rename or replace, removal, truncation and link raises an audit event in C, from the call
  itself, however the function was imported.  A hook cannot be removed, so one per process forwards to the
  watcher in use, if any;
- **torch's writer**: the Python constructor of the writer a path goes to is observed with
  :func:`observe`, which swaps its code as the guard does, so every ``torch.save`` to a path is seen;
- **fsync**: ``os.fsync``, ``os.fdatasync`` and ``os.sync`` raise no audit event and have no code to swap: they
  are wrapped in ``os`` and ``posix`` and wherever the student's module holds them (its globals, and the
  defaults and closures of its functions).  Each is recorded by the identity of the file (device, inode),
  which a rename keeps, with the file's size and modification time at that moment: an fsync counts for the
  bytes the file held then, not for those written after it (an fsync of an empty file, or of a descriptor
  another writer has not yet written through).  ``os.sync`` records the same for every file this process
  has opened for writing so far;
- **the kernel**, on a rank that must not write: its file-size limit (``RLIMIT_FSIZE``) is 0 for the duration,
  so any byte it writes to any file, from Python or C++, fails (EFBIG) and raises SIGXFSZ, which is recorded.

On Linux :class:`FolderEvents` adds the kernel's own order of what happened to each name in the checkpoint's
folder (inotify), opened by the checker around the launch: the final file must arrive by a rename (MOVED_TO),
never be created or modified in place.  Like the guard, this stops honest mistakes, not an adversary (ctypes
can still write a file unseen).
"""

from __future__ import annotations

import functools
import os
import signal
import stat
import struct
import sys
import time
import types
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from labkit.grading import guard

try:
    import resource
except ImportError:  # Windows: no file-size limit; the audit hooks and the writer's observer still see writes
    resource = None

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
CHANGES = {"os.rename": "rename", "os.remove": "remove", "os.truncate": "truncate", "os.link": "link",
           "os.symlink": "link"}


class WroteAFile(Exception):
    """A rank that was not to write any file wrote to one (the kernel refused the bytes)."""


class Log(list):
    """One rank's events, in order: ``("write", path)``, ``("rename", source, target)``, ``("remove", path)``,
    ``("truncate", path)``, ``("link", source, target)``, ``("fsync", (device, inode), is_folder, (size,
    mtime_ns))``, ``("sync", {(device, inode): (size, mtime_ns)})`` (the files written so far) and
    ``("refused bytes",)``; paths are absolute, symbolic links resolved."""

    def touched(self, folder: str) -> list[str]:
        """The names under ``folder`` this rank wrote, renamed, removed, truncated or linked, in order."""
        folder, names = os.path.realpath(folder), []
        for event in self:
            for path in event[1:3] if event[0] in ("write", "rename", "remove", "truncate", "link") else ():
                if isinstance(path, str) and path.startswith(folder + os.sep):
                    name = os.path.relpath(path, folder)
                    if name not in names:
                        names.append(name)
        return names


def synced(log: Log, identity: tuple[int, int], state: tuple[int, int], before: int | None = None) -> bool:
    """Whether an fsync of the file ``identity`` (or an ``os.sync``) recorded it in ``state`` (size,
    modification time), among the first ``before`` events: its bytes as they are now reached the disk."""
    for event in log[:before]:
        if event[0] == "fsync" and tuple(event[1]) == tuple(identity) and tuple(event[3]) == tuple(state) or \
                event[0] == "sync" and tuple(event[1].get(tuple(identity), ())) == tuple(state):
            return True
    return False


def state(facts: os.stat_result) -> tuple[int, int]:
    """What an fsync is held to: the file's size and modification time (ns)."""
    return facts.st_size, facts.st_mtime_ns


def refused(log: Log) -> bool:
    """Whether the kernel refused bytes this process wrote while ``log`` watched.  Ask it through this function,
    not ``in log`` inline: SIGXFSZ's handler runs at the next Python call, so a check straight after the failed
    write, in the same frame, could come too early."""
    return ("refused bytes",) in log


_active: list[tuple[Log, Callable[[], None]]] = []  # the watcher in use in this process, if any
_hooked = False


def _path(value: Any) -> str | None:
    if isinstance(value, int) or value is None:  # a descriptor: not a path
        return None
    try:
        value = os.fsdecode(os.fspath(value))
    except TypeError:
        return None
    return os.path.realpath(value)  # /tmp and /private/tmp (macOS) are one folder


def _audit(event: str, args: tuple) -> None:
    if not _active or (event != "open" and event not in CHANGES):
        return
    try:
        _record(event, args, *_active[-1])
    except Exception:  # noqa: BLE001 — an error here would fail the student's open or rename itself
        pass


def _record(event: str, args: tuple, log: Log, slow: Callable[[], None]) -> None:
    if event == "open":
        path, mode, flags = (tuple(args) + (None, None))[:3]
        writing = flags & WRITE_FLAGS if isinstance(flags, int) else any(c in (mode or "") for c in "wax+")
        if writing and _path(path) is not None:
            log.append(("write", _path(path)))
            slow()
    elif event in CHANGES:
        paths = [_path(value) for value in args[:2 if CHANGES[event] in ("rename", "link") else 1]]
        log.append((CHANGES[event], *paths))
        slow()


@contextmanager
def watching(student: types.ModuleType | None = None, *, may_write: bool = True,
             slow_s: float = 0.0) -> Iterator[Log]:
    """Within the block, record this process's file events in the :class:`Log` yielded.  ``may_write=False``:
    the kernel refuses every byte this process writes to a file (recorded as ``("refused bytes",)``; the call
    that wrote fails with EFBIG).  ``slow_s``: each write, rename or removal waits that long first."""
    global _hooked
    if not _hooked:
        sys.addaudithook(_audit)
        _hooked = True
    log = Log()

    def slow() -> None:
        if slow_s:
            time.sleep(slow_s)

    def saw_fsync(descriptor: Any, *_: Any) -> None:
        try:
            facts = os.fstat(descriptor if isinstance(descriptor, int) else descriptor.fileno())
        except (OSError, AttributeError, TypeError, ValueError):
            return
        log.append(("fsync", (facts.st_dev, facts.st_ino), stat.S_ISDIR(facts.st_mode), state(facts)))

    def saw_sync(*_: Any) -> None:
        written = {}
        for event in log:
            if event[0] == "write":
                try:
                    facts = os.stat(event[1])
                except OSError:
                    continue
                written[(facts.st_dev, facts.st_ino)] = state(facts)
        log.append(("sync", written))

    def saw_writer(writer: Any, name: Any, *_: Any, **__: Any) -> None:
        if _path(name) is not None:
            log.append(("write", _path(name)))
            slow()

    with ExitStack() as restore:
        posix = sys.modules.get("posix") or sys.modules.get("nt")
        for name in ("fsync", "fdatasync"):
            restore.enter_context(_observe_builtin((os, posix), name, saw_fsync, student))
        restore.enter_context(_observe_builtin((os, posix), "sync", saw_sync, student))
        restore.enter_context(observe(torch.serialization._open_zipfile_writer_file.__init__, saw_writer))
        if not may_write:
            restore.enter_context(_no_bytes(log))
        _active.append((log, slow))
        restore.callback(_active.pop)
        yield log


@contextmanager
def _no_bytes(log: Log) -> Iterator[None]:
    if resource is None or not hasattr(signal, "SIGXFSZ"):
        yield
        return

    def record(signum: int, frame: Any) -> None:
        log.append(("refused bytes",))

    try:
        previous_handler = signal.signal(signal.SIGXFSZ, record)
    except ValueError:  # not the main thread: no handler, no limit; the audit hooks still see the writes
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous_handler)


@contextmanager
def _observe_builtin(modules: tuple, name: str, observer: Callable[..., None],
                     student: types.ModuleType | None) -> Iterator[None]:
    """``module.name`` in each of ``modules``, and every reference to it the student's module holds (globals,
    defaults and closures of its functions and its classes' methods), calls ``observer``, then the original."""
    modules = tuple(module for module in modules if module is not None and hasattr(module, name))
    if not modules:
        yield
        return
    original = getattr(modules[0], name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        observer(*args, **kwargs)
        return original(*args, **kwargs)

    with ExitStack() as restore:
        for owner in (*modules, *([student] if student is not None else [])):
            for key, value in list(vars(owner).items()):
                if value is original:
                    restore.callback(setattr, owner, key, value)
                    setattr(owner, key, wrapper)
        for function in _student_functions(student):
            if function.__defaults__ and any(value is original for value in function.__defaults__):
                restore.callback(setattr, function, "__defaults__", function.__defaults__)
                function.__defaults__ = tuple(wrapper if value is original else value for value in
                                              function.__defaults__)
            if function.__kwdefaults__ and any(value is original for value in function.__kwdefaults__.values()):
                restore.callback(setattr, function, "__kwdefaults__", dict(function.__kwdefaults__))
                function.__kwdefaults__ = {key: wrapper if value is original else value for key, value in
                                           function.__kwdefaults__.items()}
            for cell in function.__closure__ or ():
                if _full(cell) and cell.cell_contents is original:
                    restore.callback(setattr, cell, "cell_contents", original)
                    cell.cell_contents = wrapper
        yield


def _full(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 — an empty cell raises
    except ValueError:
        return False
    return True


def _student_functions(student: types.ModuleType | None) -> list[types.FunctionType]:
    if student is None:
        return []
    found = []
    for value in vars(student).values():
        if getattr(value, "__module__", None) != student.__name__:
            continue
        members = vars(value).values() if isinstance(value, type) else [value]
        for member in members:
            member = getattr(member, "__func__", member)  # staticmethod, classmethod
            if isinstance(member, types.FunctionType):
                found.append(member)
    return found


# --------------------------------------------------------------------------------------------------------
# Watching without refusing: what a checker must see every call of (torch's writer)

_OBSERVED: dict[int, Callable[..., Any]] = {}


@contextmanager
def observe(function: types.FunctionType, observer: Callable[..., None]) -> Iterator[None]:
    """Within the block ``function`` calls ``observer`` with its arguments, then runs as before.  Its code is
    swapped, as :func:`labkit.grading.guard.forbid` swaps it, so a reference bound before the block (``from torch import save``)
    is observed as surely as an attribute looked up at call time."""
    twin = types.FunctionType(function.__code__, function.__globals__, function.__name__, function.__defaults__,
                              function.__closure__)
    twin.__kwdefaults__ = function.__kwdefaults__
    key = id(twin)

    def observed(*args: Any, **kwargs: Any) -> Any:
        observer(*args, **kwargs)
        return twin(*args, **kwargs)

    _OBSERVED[key] = observed
    code = guard.code_running(function, f"return __import__({__name__!r}, fromlist=['_'])._OBSERVED"
                                          f"[{guard.HOLE!r}](*args, **kwargs)", "observed", key)
    with ExitStack() as restore:
        restore.callback(_OBSERVED.pop, key, None)
        if not guard.swap_code(function, "", restore, code):
            raise TypeError(f"cannot observe {function.__qualname__}")
        yield


# --------------------------------------------------------------------------------------------------------
# The kernel's record of one folder (Linux)

IN_EVENTS = {0x2: "MODIFY", 0x8: "CLOSE_WRITE", 0x40: "MOVED_FROM", 0x80: "MOVED_TO", 0x100: "CREATE",
             0x200: "DELETE"}


class FolderEvents:
    """``with FolderEvents(folder) as seen:`` ... ``seen.events``: what happened to each name in ``folder`` during
    the block, in the kernel's order, as ``(name, kind, cookie)`` (a rename's MOVED_FROM and MOVED_TO share a
    cookie).  ``events`` is None where inotify is not available (not Linux)."""

    def __init__(self, folder: str) -> None:
        self.folder, self.events, self._descriptor = folder, None, -1

    def __enter__(self) -> FolderEvents:
        if not sys.platform.startswith("linux"):
            return self
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            descriptor = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
            if descriptor < 0:
                return self
            if libc.inotify_add_watch(descriptor, os.fsencode(self.folder), sum(IN_EVENTS)) < 0:
                os.close(descriptor)
                return self
        except (OSError, AttributeError):
            return self
        self._descriptor = descriptor
        return self

    def __exit__(self, *_: Any) -> None:
        if self._descriptor < 0:
            return
        data = b""
        try:
            while True:
                data += os.read(self._descriptor, 1 << 16)
        except BlockingIOError:
            pass
        finally:
            os.close(self._descriptor)
        self.events, offset = [], 0
        while offset + 16 <= len(data):
            _, mask, cookie, length = struct.unpack_from("iIII", data, offset)
            name = os.fsdecode(data[offset + 16:offset + 16 + length].rstrip(b"\0"))
            offset += 16 + length
            self.events += [(name, kind, cookie) for bit, kind in IN_EVENTS.items() if mask & bit]
