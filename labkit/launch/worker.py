"""What each rank forked by ``labkit.launch`` runs: the child side of the launcher.

A rank redirects its output to the parent line by line, arms a stack dump on ``SIGUSR1`` (so the parent can show
where a hung rank is stuck) and, unless told not to, records its collectives (so the parent can show where the
ranks disagree), asks the kernel to kill it if the parent dies, joins the rendezvous (rank 0 hosts the
store on a port the operating system picks and tells the parent, which tells the others), runs the user's
function, and sends back its result or its traceback.  It then waits for the parent's word before leaving, so
that no peer sees a connection break while it is still finishing.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import faulthandler
import io
import os
import pickle
import signal
import socket
import sys
import threading
import traceback
from typing import Any

import torch
import torch.distributed as torch_dist

from labkit.launch import record


class RankConfig:
    def __init__(self, rank, world_size, backend, group_timeout, threads, stack_path, parent_pid, log_path=None,
                 quiet=False):
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.group_timeout, self.threads, self.stack_path, self.parent_pid = group_timeout, threads, stack_path, parent_pid
        self.log_path = log_path  # where this rank records its collectives (record.py); None: it does not
        self.quiet = quiet  # rank_output="none": what C++ writes to the file descriptors (gloo's aborts) goes too


def rank_main(config: RankConfig, fn, args, kwargs, connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C / kernel interrupts and stops us
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # how the parent stops us, whatever handler it had when it forked
    _die_with_parent(config.parent_pid)
    if config.quiet:
        silent = os.open(os.devnull, os.O_WRONLY)
        os.dup2(silent, 1)
        os.dup2(silent, 2)
    sender = _Sender(connection)
    sys.stdout = _LineForwarder(sender, "stdout")
    sys.stderr = _LineForwarder(sender, "stderr")
    stack_file = open(config.stack_path, "w")  # noqa: SIM115 — kept open for faulthandler until exit
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False)
    os.environ.update({
        "RANK": str(config.rank), "WORLD_SIZE": str(config.world_size),
        "LOCAL_RANK": str(config.rank), "LOCAL_WORLD_SIZE": str(config.world_size),
        "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": str(config.threads),
    })
    loopback = _loopback_interface()
    if loopback:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback)
    torch.set_num_threads(config.threads)
    try:
        if config.backend == "nccl":
            torch.cuda.set_device(config.rank)
        timeout = datetime.timedelta(seconds=config.group_timeout)
        # Rendezvous: rank 0 hosts the store on a port the OS picks (so concurrent launches never collide) and
        # the parent forwards the port to the other ranks.  The parent itself runs no store thread, which
        # would make forking unsafe.
        if config.rank == 0:
            store = torch_dist.TCPStore("127.0.0.1", 0, config.world_size, True, timeout=timeout,
                                        wait_for_workers=False)
            sender.send(("port", store.port))
            port = store.port
        else:
            message = connection.recv()
            port = message[1]
            store = torch_dist.TCPStore("127.0.0.1", port, config.world_size, False, timeout=timeout)
        os.environ["MASTER_PORT"] = str(port)
        torch_dist.init_process_group(config.backend, store=store, rank=config.rank,
                                      world_size=config.world_size, timeout=timeout)
        log_path = config.log_path
        with record.record_collectives(log_path) if log_path else contextlib.nullcontext():
            result = fn(*args, **kwargs)
        try:
            payload = pickle.dumps(to_cpu(result))
        except Exception as error:
            raise TypeError(f"rank {config.rank} returned {type(result).__name__}, which cannot be sent back to "
                            f"the caller ({error}); return tensors, numbers or other picklable values") from error
    except BaseException:
        sys.stdout.flush()
        sys.stderr.flush()
        sender.send(("error", _format_remote_exception()))
        _wait_for_release(connection)  # stay connected so peers do not fail on our exit; the parent stops us
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    sender.send(("result", payload))
    _wait_for_release(connection)
    try:
        torch_dist.destroy_process_group()
    finally:
        os._exit(0)


def _wait_for_release(connection) -> None:
    """Block until the parent says every rank is done (or goes away)."""
    try:
        while connection.recv()[0] != "release":
            pass
    except (EOFError, OSError):
        pass


def send_quietly(connection, message: tuple) -> None:
    try:
        connection.send(message)
    except (BrokenPipeError, ConnectionResetError, OSError):
        pass


class _Sender:
    """Thread-safe messages to the parent (a rank's threads may print concurrently)."""

    def __init__(self, writer):
        self.writer = writer
        self.lock = threading.Lock()

    def send(self, message: tuple) -> None:
        with self.lock:
            try:
                self.writer.send(message)
            except (BrokenPipeError, OSError):
                pass


class _LineForwarder(io.TextIOBase):
    """A stand-in for sys.stdout/sys.stderr that forwards complete lines to the parent."""

    def __init__(self, sender: _Sender, stream: str):
        self.sender, self.stream, self.pending = sender, stream, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            self.sender.send(("out", self.stream, line))
        return len(text)

    def flush(self) -> None:
        if self.pending:
            self.sender.send(("out", self.stream, self.pending))
            self.pending = ""



# --------------------------------------------------------------------------------------------------------
# Helpers


def to_cpu(value: Any) -> Any:
    """Move tensors in (nested) results to the CPU, so the caller never initialises CUDA to read them."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu() if value.device.type != "cpu" else value.detach()
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(to_cpu(item) for item in value)
    if isinstance(value, dict) and type(value) is dict:
        return {key: to_cpu(item) for key, item in value.items()}
    return value


def _loopback_interface() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    for candidate in ("lo", "lo0"):
        if candidate in names:
            return candidate
    return None


def _die_with_parent(parent_pid: int) -> None:
    """Linux: ask the kernel to kill this rank if the launching process dies (e.g. a restarted kernel)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            return
    if os.getppid() != parent_pid:
        os._exit(1)


def read_stack_dump(path: str) -> str | None:
    """The stack a rank dumped on ``SIGUSR1`` (``None``: no file), like a traceback: faulthandler prints the most
    recent call first; show it last, from the user's function on."""
    try:
        with open(path) as handle:
            text = handle.read()
    except OSError:
        return None
    frames = [line.strip() for line in reversed(text.splitlines())
              if line.strip().startswith("File ") and record.__file__ not in line]  # its wrapper: noise
    launcher = [index for index, frame in enumerate(frames) if frame.startswith(f'File "{__file__}"')]
    if launcher:
        frames = frames[launcher[-1] + 1:]
    return "\n".join(frames)


def _format_remote_exception() -> str:
    """The current exception's traceback, starting at the user's code (the launcher's frames are noise)."""
    error_type, error, tb = sys.exc_info()
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(error_type, error, tb))
