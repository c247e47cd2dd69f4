"""A student's ``sample_seed`` run as on other machines and other days: a script for a fresh interpreter.

Exercise 12 asks for a seed that depends on the key alone, the same wherever and whenever it is computed.  One
machine cannot show that: its host name, machine id and date are the same in every process the checks start.
So the check runs ``python another_machine.py FILE KEYS`` (in a fresh interpreter, whose ``hash`` salt it sets)
and this script imports the student's file again under each :data:`SITUATIONS`: Python reports another host name
wherever a program asks for one (``socket.gethostname``, ``getfqdn``, ``gethostbyname`` of it, ``os.uname``,
``platform.node``, ``$HOSTNAME``, ``/etc/hostname``, ``/proc/sys/kernel/hostname``) and another machine id
(``uuid.getnode``, ``/etc/machine-id``), or a clock some days ahead (``time.time``, ``time_ns``, ``localtime``,
``gmtime``, ``strftime``, ``ctime``, ``datetime``).  It prints, as JSON, each situation's seeds of KEYS (or the
error it raised).  Like the guard it fools the calls a student makes, not an adversary (``ctypes`` reaches the C
library's ``gethostname`` unseen).  It imports nothing of labkit, nor torch: it starts in a moment.
"""

from __future__ import annotations

import builtins
import datetime
import importlib.util
import io
import json
import os
import platform
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

# (what changed, host name, days ahead): two other hosts, a day in another week, another year
SITUATIONS = (("runs on this host, today", None, 0), ("reports the host name 'labkit-node-7'", "labkit-node-7", 0),
              ("reports the host name 'gpu-a100-042'", "gpu-a100-042", 0), ("runs 9 days later", None, 9),
              ("runs 400 days later", None, 400))
MACHINE_FILES = ("/etc/hostname", "/proc/sys/kernel/hostname", "/etc/machine-id", "/var/lib/dbus/machine-id",
                 "/proc/sys/kernel/random/boot_id")


def _patch(stack: ExitStack, owner: Any, name: str, value: Any) -> None:
    if hasattr(owner, name):  # (os.uname is POSIX's; platform's cache an implementation's)
        stack.callback(setattr, owner, name, getattr(owner, name))
        setattr(owner, name, value)


@contextmanager
def pretend(host: str | None, days: float) -> Iterator[None]:
    """Within the block, Python reports ``host`` as this machine's name (and a machine id of its own) and a clock
    ``days`` ahead."""
    with ExitStack() as stack:
        if host is not None:
            _another_host(stack, host)
        if days:
            _another_day(stack, days * 86400.0)
        yield


def _another_host(stack: ExitStack, host: str) -> None:
    here, real_uname = socket.gethostname(), os.uname() if hasattr(os, "uname") else None
    getfqdn, gethostbyname, real_open = socket.getfqdn, socket.gethostbyname, io.open
    identity = sum(map(ord, host))  # a machine id, MAC address and boot id of this pretended host
    texts = {path: host + "\n" for path in MACHINE_FILES[:2]}
    texts.update({path: f"{identity:032x}\n" for path in MACHINE_FILES[2:]})

    def opened(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, (str, bytes, os.PathLike)) and "r" in mode and os.path.realpath(os.fsdecode(file)) in texts:
            text = texts[os.path.realpath(os.fsdecode(file))]
            return io.BytesIO(text.encode()) if "b" in mode else io.StringIO(text)
        return real_open(file, mode, *args, **kwargs)

    _patch(stack, socket, "gethostname", lambda: host)
    _patch(stack, socket, "getfqdn", lambda name="": host if name in ("", here, host) else getfqdn(name))
    _patch(stack, socket, "gethostbyname", lambda name: f"10.{identity % 256}.7.42" if name in (here, host)
           else gethostbyname(name))
    _patch(stack, os, "uname", lambda: os.uname_result((real_uname.sysname, host, *real_uname[2:])))
    _patch(stack, platform, "_uname_cache", None)
    _patch(stack, uuid, "getnode", lambda: identity)
    _patch(stack, uuid, "_node", identity)
    _patch(stack, builtins, "open", opened)
    _patch(stack, io, "open", opened)
    for name in ("HOSTNAME", "HOST", "COMPUTERNAME"):
        if name in os.environ:
            stack.callback(os.environ.__setitem__, name, os.environ[name])
        else:
            stack.callback(os.environ.pop, name, None)
        os.environ[name] = host


def _another_day(stack: ExitStack, seconds: float) -> None:
    now, now_ns = time.time, time.time_ns
    _patch(stack, time, "time", lambda: now() + seconds)
    _patch(stack, time, "time_ns", lambda: now_ns() + int(seconds * 1e9))
    for name in ("localtime", "gmtime", "ctime"):
        real = getattr(time, name)
        _patch(stack, time, name, lambda when=None, real=real: real(time.time() if when is None else when))
    strftime = time.strftime
    _patch(stack, time, "strftime", lambda form, when=None: strftime(form, time.localtime() if when is None else when))

    class Date(datetime.date):
        @classmethod
        def today(cls) -> Date:
            return cls.fromtimestamp(time.time())

    class DateTime(datetime.datetime):
        @classmethod
        def now(cls, tz: Any = None) -> DateTime:
            return cls.fromtimestamp(time.time(), tz)

        @classmethod
        def today(cls) -> DateTime:
            return cls.fromtimestamp(time.time())

        @classmethod
        def utcnow(cls) -> DateTime:
            return cls.fromtimestamp(time.time(), datetime.timezone.utc).replace(tzinfo=None)

    _patch(stack, datetime, "date", Date)
    _patch(stack, datetime, "datetime", DateTime)


def seeds(path: str, keys: list[list[int]]) -> dict[str, Any]:
    """Each situation's seeds of ``keys`` (ints as given, so that the check sees their type), the student's file
    imported afresh in each; or the error it raised there."""
    found: dict[str, Any] = {}
    for what, host, days in SITUATIONS:
        with pretend(host, days):
            try:
                spec = importlib.util.spec_from_file_location(f"answer_{len(found)}", path)
                answer = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(answer)
                found[what] = [answer.sample_seed(*key) for key in keys]
            except Exception as error:  # the check reports it
                found[what] = f"{type(error).__name__}: {error}"
    return found


if __name__ == "__main__":
    print(json.dumps(seeds(sys.argv[1], json.loads(sys.argv[2])), default=repr))  # the last line: after any print
