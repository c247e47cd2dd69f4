"""Run a function on N ranks — from a notebook cell, a script, pytest, or under ``torchrun``.

A distributed training job is N copies of one program, each told its *rank* and the *world size*, that meet
through a rendezvous (here: a key-value store on 127.0.0.1) and then talk through a *backend* (gloo on CPUs,
NCCL on GPUs).  On a cluster ``torchrun`` starts the copies.  In a notebook we want the same thing from a
single cell, with a function defined in that cell::

    from labkit import launch
    import torch.distributed as dist

    def hello():
        t = torch.tensor([dist.get_rank()])
        dist.all_reduce(t)
        return t.item()

    launch.launch(hello, nprocs=4)        # -> [6, 6, 6, 6]

How it works, and what it guarantees:

- **Start.** Ranks are forked (so a function defined in a notebook cell works without pickling).  Rank 0
  hosts the rendezvous store on a port the operating system picks, so concurrent launches never collide.  Each rank gets ``cpu_count // nprocs`` threads, as ``torchrun``'s ``OMP_NUM_THREADS=1`` does, so
  four ranks on a two-core laptop do not fight over cores.  OpenMP's worker threads are released before the
  fork (a forked rank would otherwise wait for its parent's, which it does not inherit).
- **Output.** Whatever a rank prints reaches the caller prefixed with ``[rank r]`` — live, or grouped by rank
  at the end (``rank_output="grouped"``, deterministic), or not at all (``"none"``).
- **Results.** ``launch`` returns ``fn``'s return value from every rank, as a list indexed by rank.  Tensors
  come back on the CPU.
- **Failure.** A rank that raises becomes :class:`RankFailed` in the caller, with the rank and its traceback;
  the other ranks are stopped.  Ranks that do not finish within ``timeout`` seconds (typically: stuck in a
  collective that not every rank called) become :class:`CollectiveTimeout`, naming the stuck ranks and the
  line each was stuck on.  Either way no process of the launch is left alive.  With ``check_collectives=True``
  each rank records the collectives it calls (:mod:`labkit.launch.record`, tens to hundreds of µs a call: off by
  default, so that timings stay comparable with PyTorch's); when the ranks disagree (a collective only some call, another
  order, other shapes), the error opens with the first disagreement.
- **torchrun.** When this process is already one rank of a job (``RANK``/``WORLD_SIZE`` set, or a default
  process group exists), ``launch`` runs ``fn`` in place and all-gathers the results, so notebook code runs
  unchanged under ``torchrun --nproc_per_node=8`` (recording is then not armed: wrap ``fn``'s body in
  ``labkit.launch.record_collectives`` for that).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as torch_dist

from labkit import dist
from labkit.launch import compare, worker
from labkit.launch.worker import RankConfig, rank_main, send_quietly, to_cpu

RANK_OUTPUT_MODES = ("live", "grouped", "none")


class LaunchError(RuntimeError):
    """Base class for a launch that did not complete on every rank.  ``.disagreement``: where the ranks' sequences
    of collectives first differed (:class:`labkit.launch.compare.Disagreement`), or ``None``."""

    disagreement = None


class RankFailed(LaunchError):
    """A rank raised (or died).  ``.rank`` is its number, ``.remote_traceback`` its traceback as text."""

    def __init__(self, rank: int, remote_traceback: str, pids: list[int], also_failed: list[int] | None = None):
        self.rank, self.remote_traceback, self.pids, self.also_failed = rank, remote_traceback, pids, also_failed or []
        others = f" (rank(s) {self.also_failed} failed too)" if self.also_failed else ""
        body = _indent(remote_traceback.rstrip())
        super().__init__(f"rank {rank} failed{others}; the other ranks were stopped. Its traceback:\n{body}")


class CollectiveTimeout(LaunchError):
    """Some ranks did not finish within the timeout.  ``.stuck_ranks`` lists them, ``.stacks`` where they were."""

    def __init__(self, timeout: float, stuck_ranks: list[int], finished_ranks: list[int],
                 stacks: dict[int, str], pids: list[int]):
        self.timeout, self.stuck_ranks, self.finished_ranks = timeout, stuck_ranks, finished_ranks
        self.stacks, self.pids = stacks, pids
        lines = [
            f"rank(s) {stuck_ranks} did not finish within {timeout:g} s"
            + (f" (rank(s) {finished_ranks} had finished and were waiting)." if finished_ranks else "."),
            "A rank stuck in a collective usually means the ranks disagree on which collectives they call, in which "
            "order, or on which group; a long but healthy run needs a larger timeout=.",
        ]
        for rank_number in stuck_ranks:
            if stacks.get(rank_number):
                lines.append(f"rank {rank_number} was here (most recent call last):")
                lines.append(_indent(stacks[rank_number]))
        lines.append("All ranks were stopped.")
        super().__init__("\n".join(lines))


# --------------------------------------------------------------------------------------------------------
# The public entry point


def launch(fn: Callable[..., Any], *args: Any, nprocs: int = 4, backend: str = "auto",
           timeout: float | None = 60.0, rank_output: str = "live", check_collectives: bool = False,
           **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` ranks and return the per-rank results (index = rank).

    Args:
        fn: the function each rank runs, after the default process group is initialised.
        nprocs: number of ranks (processes) to start.
        backend: ``"auto"`` (NCCL when every rank can have its own GPU, else gloo), ``"gloo"`` or ``"nccl"``.
        timeout: wall-clock seconds the whole run may take before :class:`CollectiveTimeout`; ``None`` waits
            for ever.
        rank_output: ``"live"`` forwards each rank's printed lines as they come, prefixed ``[rank r]``;
            ``"grouped"`` prints them rank by rank when the run ends (reproducible order); ``"none"`` drops them
            and what C++ libraries write to the rank's stdout and stderr (gloo's messages when it aborts).
        check_collectives: record each rank's collectives (lesson 09 measures the cost) to name, in a failure's message,
            the first place where the ranks disagree (default off: timings stay comparable).  Not under torchrun.

    Raises:
        ValueError: bad arguments, before any process starts.
        RankFailed: a rank raised or died.
        CollectiveTimeout: ranks were still running after ``timeout`` seconds.
    """
    _validate(fn, nprocs, backend, timeout, rank_output)
    if dist.in_torchrun():
        return _run_in_place(fn, args, kwargs, nprocs, backend)
    resolved = dist.resolve_backend(backend, nprocs)
    start_method = _start_method(resolved, fn, args, kwargs)
    if start_method == "fork":
        prepare_to_fork()
    return _Launcher(fn, args, kwargs, nprocs, resolved, timeout, rank_output, start_method, check_collectives).run()


def prepare_to_fork() -> None:
    """Make this process safe to fork: ``launch`` calls it, and so does anything else that forks a process which
    may launch ranks (``labkit.grading``'s isolated checks).  Import ``torch._dynamo`` once here: the first
    optimizer a process builds imports it (seconds of CPU), and forked ranks inherit it (lesson 03's live
    experiment went from about 105 s to under 20 s of launches).  Stop GNU OpenMP's worker threads (OpenMP 5.0's
    ``omp_pause_resource_all``; the next parallel region starts new ones): a forked process inherits the pool's
    bookkeeping, not its threads, and would wait for them, even to pause the pool before forking ranks of its
    own (a grading check forked after a backward pass in the notebook hung there)."""
    import ctypes

    import torch._dynamo  # noqa: F401
    for path in (os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1"), "libgomp.so.1"):
        try:  # RTLD_NOLOAD: only a runtime this process has loaded (Intel's OpenMP is fork-safe already)
            ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL).omp_pause_resource_all(2)
            return
        except (OSError, AttributeError):
            continue


def _validate(fn: Any, nprocs: Any, backend: Any, timeout: Any, rank_output: Any) -> None:
    if not callable(fn):
        raise ValueError(f"fn must be callable (a function each rank runs), got {fn!r}")
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be an integer >= 1, got {nprocs!r}")
    if not isinstance(backend, str) or backend.lower() not in dist.BACKENDS:
        raise ValueError(f"backend must be one of {dist.BACKENDS}, got {backend!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    if rank_output not in RANK_OUTPUT_MODES:
        raise ValueError(f"rank_output must be one of {RANK_OUTPUT_MODES}, got {rank_output!r}")


def _run_in_place(fn: Callable[..., Any], args: tuple, kwargs: dict, nprocs: int, backend: str) -> list[Any]:
    """Under torchrun (or inside a rank): run on this rank, all-gather every rank's result."""
    if not dist.is_initialized():
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        chosen = dist.resolve_backend(backend, local_world)
        if chosen == "nccl":
            torch.cuda.set_device(dist.local_rank())
        # One prefix per attempt: a restart reusing torchrun's store would read the last attempt's keys (#135712,
        # NCCL's unique ID; newer torchrun starts a fresh store per retry, #135957).  Ranks share the count.
        store, rank, world_size = next(torch_dist.rendezvous("env://"))
        prefix = f"labkit/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        torch_dist.init_process_group(chosen, store=torch_dist.PrefixStore(prefix, store), rank=rank,
                                      world_size=world_size)
        atexit.register(_destroy_group_at_exit)  # a live group at interpreter exit can abort the process
    if nprocs != dist.world_size() and dist.is_main():
        print(f"labkit.launch: running on the job's {dist.world_size()} ranks (nprocs={nprocs} ignored)")
    result = to_cpu(fn(*args, **kwargs))
    gathered: list[Any] = [None] * dist.world_size()
    torch_dist.all_gather_object(gathered, result)
    return gathered


def _destroy_group_at_exit() -> None:
    if dist.is_initialized():
        torch_dist.destroy_process_group()


def _start_method(backend: str, fn: Callable, args: tuple, kwargs: dict) -> str:
    """Fork where we can (cell-defined functions need no pickling); spawn where fork is unsafe or missing."""
    fork_ok = "fork" in mp.get_all_start_methods()
    if fork_ok and not (backend == "nccl" and torch.cuda.is_initialized()):
        return "fork"
    try:
        pickle.dumps((fn, args, kwargs))
    except Exception as error:
        why = ("CUDA is already initialised in this process, so ranks must be spawned, not forked"
               if fork_ok else "this platform cannot fork, so ranks must be spawned")
        raise ValueError(f"{why}, and fn {fn!r} or its arguments cannot be pickled ({error}); define fn at the "
                         "top level of a module (not in a notebook cell)") from error
    return "spawn"


# --------------------------------------------------------------------------------------------------------
# The parent side


class _Launcher:
    def __init__(self, fn, args, kwargs, nprocs, backend, timeout, rank_output, start_method, check_collectives):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.nprocs, self.backend, self.timeout = nprocs, backend, timeout
        self.rank_output, self.check_collectives = rank_output, check_collectives
        self.context = mp.get_context(start_method)
        self.processes: list[Any] = []
        self.readers: dict[int, Any] = {}
        self.output: dict[int, list[tuple[str, str]]] = {rank: [] for rank in range(nprocs)}

    def run(self) -> list[Any]:
        threads = max(1, _cpu_count() // self.nprocs)
        # A generous process-group timeout: the launcher's own deadline fires first and says more.
        group_timeout = (self.timeout or 1800.0) + 60.0
        self.scratch = tempfile.mkdtemp(prefix="labkit-launch-")
        released = False
        try:
            for rank in range(self.nprocs):
                parent_end, child_end = self.context.Pipe(duplex=True)
                config = RankConfig(rank, self.nprocs, self.backend, group_timeout, threads,
                                    os.path.join(self.scratch, f"stack-{rank}.txt"), os.getpid(), self._log(rank),
                                    quiet=self.rank_output == "none")
                process = self.context.Process(target=rank_main, name=f"labkit-rank-{rank}",
                                               args=(config, self.fn, self.args, self.kwargs, child_end))
                process.start()
                child_end.close()
                self.processes.append(process)
                self.readers[rank] = parent_end
            results = self._collect()
            released = True
            for reader in self.readers.values():
                send_quietly(reader, ("release",))
            return results
        finally:
            self._stop_all(grace=10.0 if released else 0.0)
            if self.rank_output == "grouped":
                self._print_grouped()
            for name in os.listdir(self.scratch):
                os.unlink(os.path.join(self.scratch, name))
            os.rmdir(self.scratch)

    def _log(self, rank: int) -> str | None:
        return os.path.join(self.scratch, f"collectives-{rank}.jsonl") if self.check_collectives else None

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def _collect(self) -> list[Any]:
        results: list[Any] = [None] * self.nprocs
        finished: set[int] = set()
        failures: dict[int, tuple[str, bool]] = {}  # rank -> (what happened, did the process die?)
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        grace_end = None
        while len(finished) + len(failures) < self.nprocs:
            now = time.monotonic()
            if grace_end is not None and now >= grace_end:
                break
            if deadline is not None and now >= deadline and not failures:
                stuck = [rank for rank in range(self.nprocs) if rank not in finished]
                stacks = self._stacks_of(stuck)
                error = CollectiveTimeout(self.timeout, stuck, sorted(finished), stacks, self.pids)
                raise compare.explain(error, {rank: self._log(rank) for rank in range(self.nprocs)})
            limits = [limit - now for limit in (deadline, grace_end) if limit is not None]
            open_ranks = [rank for rank in range(self.nprocs) if rank not in finished and rank not in failures]
            sentinels = {self.processes[rank].sentinel: rank for rank in open_ranks}
            readers = {self.readers[rank]: rank for rank in open_ranks if rank in self.readers}
            ready = wait(list(readers) + list(sentinels), timeout=min(limits) if limits else None)
            # Messages first, then exits: a rank that reported and then exited has reported.
            for handle in ready:
                if handle in readers:
                    self._take(readers[handle], results, finished, failures)
            for handle in ready:
                rank = sentinels.get(handle)
                if rank is not None and rank not in finished and rank not in failures:
                    self._take(rank, results, finished, failures)
                    if rank not in finished and rank not in failures:
                        self.processes[rank].join(1.0)  # the sentinel can fire a moment before the exit code is in
                        failures[rank] = (_describe_exit(self.processes[rank].exitcode), True)
            if failures and grace_end is None:
                # One failure often makes its peers fail too (their connections to it break).  Listen a moment
                # longer, then blame the root cause rather than whichever report arrived first.
                grace_end = time.monotonic() + 1.0
        if failures:
            culprit = _root_cause(failures)
            others = sorted(set(failures) - {culprit})
            error = RankFailed(culprit, failures[culprit][0], self.pids, others)
            raise compare.explain(error, {rank: self._log(rank) for rank in range(self.nprocs)}, failures)
        return results

    def _take(self, rank: int, results: list[Any], finished: set[int], failures: dict) -> None:
        for kind, payload in self._drain(rank):
            if kind == "result":
                results[rank] = pickle.loads(payload)
                finished.add(rank)
            elif kind == "error":
                failures[rank] = (payload, False)

    def _drain(self, rank: int) -> list[tuple[str, Any]]:
        """Read every message waiting on a rank's pipe; print/collect output, return results and errors."""
        reader = self.readers.get(rank)
        messages = []
        while reader is not None and reader.poll():
            try:
                kind, *payload = reader.recv()
            except (EOFError, OSError):
                reader.close()
                del self.readers[rank]
                break
            if kind == "out":
                self._emit(rank, *payload)
            elif kind == "port":  # rank 0 hosts the rendezvous store; tell the others where it is
                for other_rank, other in self.readers.items():
                    if other_rank != rank:
                        send_quietly(other, ("port", payload[0]))
            else:
                messages.append((kind, payload[0]))
        return messages

    def _emit(self, rank: int, stream: str, text: str) -> None:
        if self.rank_output == "live":
            target = sys.stderr if stream == "stderr" else sys.stdout
            print(f"[rank {rank}] {text}", file=target, flush=True)
        elif self.rank_output == "grouped":
            self.output[rank].append((stream, text))

    def _print_grouped(self) -> None:
        for rank in range(self.nprocs):
            for stream, text in self.output[rank]:
                print(f"[rank {rank}] {text}", file=sys.stderr if stream == "stderr" else sys.stdout)
        sys.stdout.flush()

    def _stacks_of(self, ranks: list[int]) -> dict[int, str]:
        """Ask each stuck rank to dump its Python stack (faulthandler on SIGUSR1) and read it back."""
        if not hasattr(signal, "SIGUSR1"):
            return {}
        for rank in ranks:
            if self.processes[rank].is_alive():
                try:
                    os.kill(self.processes[rank].pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        time.sleep(0.5)
        stacks = {rank: worker.read_stack_dump(os.path.join(self.scratch, f"stack-{rank}.txt")) for rank in ranks}
        return {rank: stack for rank, stack in stacks.items() if stack is not None}

    def _stop_all(self, grace: float) -> None:
        """Let finished ranks exit cleanly; terminate, then kill, whatever is left.  Reap every process."""
        grace = time.monotonic() + grace
        for process in self.processes:
            process.join(max(0.0, grace - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        deadline = time.monotonic() + 3.0
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join()
        for rank in list(self.readers):
            self._drain(rank)
        for reader in self.readers.values():
            reader.close()
        self.readers.clear()


# --------------------------------------------------------------------------------------------------------
# Helpers


def _cpu_count() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


_PEER_FAILURE_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "DistBackendError",
                       "DistNetworkError", "Socket Timeout", "NCCL communicator was aborted")


def _root_cause(failures: dict[int, tuple[str, bool]]) -> int:
    """The rank to blame: one whose process died, else one whose error is not a broken connection to a peer,
    else the lowest rank."""
    died = [rank for rank, (_text, dead) in failures.items() if dead]
    if died:
        return min(died)
    original = [rank for rank, (text, _dead) in failures.items()
                if not any(sign in text for sign in _PEER_FAILURE_SIGNS)]
    return min(original) if original else min(failures)


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"the process was killed by {name} before it could report (exit code {exitcode})"
    return f"the process exited with code {exitcode} before returning a result"


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())
