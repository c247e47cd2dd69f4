"""The guard that checkers run student code under: no answer may come from a built-in or from labkit itself.

Every exercise asks for something that already exists.  ``torch.distributed`` has the all-reduce that exercise
01 builds from messages, and labkit implements each exercise in full: ``labkit.collectives`` the ring and
``chunk_bounds`` the shard rule, ``labkit.parallel`` DDP's broadcast and buckets and ZeRO's sharded optimizer,
``labkit.lr`` the scaled schedule, ``labkit.precision`` the loss scaler.  An answer that calls them gets the
right numbers without the work, so every check runs the student's code inside :func:`forbid`, which makes those
implementations raise :class:`Forbidden` for as long as it lasts, however the student reached them:

- each function of a forbidden module, and each method of its classes, has its ``__code__`` swapped for code
  that raises.  The function *object* stays the same, so a reference bound before the guard — ``from labkit.lr
  import lr_factor`` at the top of the file, a default argument, a ``functools.partial`` — refuses as surely as
  an attribute looked up at call time;
- with ``collectives=True`` (:func:`point_to_point_only`) the same is done to every collective of
  ``torch.distributed`` (``all_reduce``, ``broadcast``, ... and the functional collectives when loaded), to the
  collective methods of ``ProcessGroup`` and of its backends, and, one layer below all of them, a
  ``TorchDispatchMode`` refuses every ``c10d`` operator except ``send``, ``recv`` and ``barrier``.  That mode also
  records the peer and the size of each message in a :class:`Traffic`, which a checker compares with the
  algorithm's schedule: data that moved any other way is missing from it;
- the student's module's globals are scanned for forbidden callables whose code could not be swapped (none in
  labkit today), which are replaced there;
- a copy of a forbidden function (its code loaded again, however) refuses too: :mod:`labkit.grading.copies`.

A check may forbid torch's own answer to its exercise as well, by module, the same way
(``@no_shortcuts(built_ins=[...])``): exercise 06 forbids DTensor's tensor parallelism and the differentiable
collectives of ``torch.distributed.nn`` (not ``dist.all_reduce``, which its operators are built from), 07 the 1F1B
schedules of ``torch.distributed.pipelining``, 13 torch's context parallelism (its load balancers and merger).

:func:`graders_off_limits` keeps the checkers' own references (and any import of ``labkit.grading``) from the
student's code; :func:`labkit.grading.files.observe` uses the swap to watch rather than refuse.  Everything is
put back when the block ends (ranks a check forks inherit the swap).  Cost: a few ms to swap the ~500 functions
(by code compiled once); under the dispatch mode every tensor operation makes one extra Python call.  The guard
stops the shortcuts an honest student takes, not an adversary (who can put back what it swapped).
"""

from __future__ import annotations

import builtins
import functools
import importlib
import pkgutil
import re
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from labkit.grading import DEFAULT_REASON, Forbidden, copies

# Where labkit implements an exercise.  A package stands for all its modules; a dotted name for one function
# or class.  Only what is *defined* in a module counts: labkit.collectives re-exports chunk_bounds, which stays
# usable there unless named itself, as it is here (it is exercise 00's shard_bounds, verbatim).
LABKIT_IMPLEMENTATIONS = (
    "labkit.collectives",  # 01: the ring reduce-scatter, all-gather, all-reduce; broadcast; naive and tree
    "labkit.costmodel.collectives.chunk_bounds",  # 00: shard_bounds
    "labkit.parallel",  # 02: DDP's broadcast, hook and buckets; 05: ZeRO's sharding and sharded optimizer;
    # 06: tensor parallelism's f and g and its split layers; 07: the 1F1B schedule; 08: the server's rule (Gate);
    # 11: a schedule placed in time (labkit.parallel.pipeline.engine, which the step model places with)
    "labkit.lr",  # 03: the global batch, the linear rule, warmup and decay
    "labkit.precision",  # 04: the dynamic loss scaler
    "labkit.checkpoint",  # 09: saving and resuming a run (state.py), the atomic write and the RNG helpers (files.py)
    "labkit.mesh",  # 10: the 3D layout (mesh_coordinates and mesh_groups, in "tp-dp-pp") and the Mesh built on it
    "labkit.costmodel.step",  # 11: the step model (predict_step, stage_times, closed_form_makespan)
    "labkit.costmodel.stages",  # 11: the step model's per-stage costs (chunk_costs, stage_times)
    "labkit.costmodel.planner",  # 11: the planner, which ranks layouts by predict_step
    "labkit.costmodel.simulator",  # 11: the same step simulated event by event (its parts, the bubble included)
    "labkit.loader.sample_seed",  # 12: the seed of one sample's augmentation
    "labkit.loader._splitmix64",  # 12: the mixing function it is built from
    # 13: labkit.parallel (above) holds context parallelism's merge, layouts and blockwise kernel
)

# Collective functions and methods, by name: torch.distributed's all_reduce, all_gather_into_tensor,
# _reduce_scatter_base, broadcast_object_list, gather_object, ...; ProcessGroup's allreduce, allgather,
# alltoall_base, ...; the functional collectives' all_gather_tensor, permute_tensor, ...  Point-to-point
# (send, recv, isend, irecv, batch_isend_irecv, send_object_list) and barrier do not match.
COLLECTIVE_NAME = re.compile(r"_?(all_?reduce|all_?gather|reduce_scatter|reduce|broadcast|all_?to_?all|gather"
                             r"|scatter|permute_tensor)(_|$)")
# The c10d operators a point-to-point algorithm may use; every other operator of these namespaces is refused.
COMMUNICATION_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd", "symm_mem", "_dtensor")
POINT_TO_POINT_OPERATORS = ("send", "recv_", "recv_any_source_", "barrier", "monitored_barrier_")
# Modules whose collectives are swapped when they are loaded (the dispatch mode catches them when not).
TORCH_COLLECTIVE_MODULES = ("torch.distributed.distributed_c10d", "torch.distributed._functional_collectives",
                            "torch.distributed.nn.functional")

POINT_TO_POINT_REASON = "build it from point-to-point messages (dist.isend / dist.irecv)"
HOLE = "<labkit.grading.guard: the value>"  # a constant in a swapped function's statement: code_running's value
# A swapped function runs with its own globals: it reaches the exception class through __import__.
_REFUSED = f"raise __import__({__name__!r}, fromlist=['_']).Forbidden({HOLE!r})"


# --------------------------------------------------------------------------------------------------------
# The traffic a point-to-point algorithm generates


@dataclass(frozen=True)
class Message:
    """One point-to-point message seen by this rank: ``"send"`` to ``peer`` or ``"recv"`` from it (a rank in
    the message's process group; ``None`` for a receive from any source), and its payload in bytes."""

    direction: str
    peer: int | None
    nbytes: int


class Traffic(list):
    """The :class:`Message`\\ s of one rank, in the order they were posted."""


class _PointToPointOnly(TorchDispatchMode):
    """Refuses every communication operator except send/recv/barrier, and records each message."""

    def __init__(self, traffic: Traffic, reason: str) -> None:
        super().__init__()
        self.traffic, self.reason = traffic, reason

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Nothing here is compiled, and the wrapper that skips dynamo imports torch._dynamo (seconds) in each rank.
        return False

    def __torch_dispatch__(self, func, op_types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in COMMUNICATION_NAMESPACES:
            if func._opname not in POINT_TO_POINT_OPERATORS:
                raise Forbidden(f"used the collective {func.namespace}.{func._opname} (through torch.distributed "
                                f"or a process group): {self.reason}")
            if func._opname in ("send", "recv_", "recv_any_source_"):
                nbytes = sum(tensor.numel() * tensor.element_size() for tensor in args[0])
                peer = args[2] if func._opname != "recv_any_source_" else None
                self.traffic.append(Message("send" if func._opname == "send" else "recv", peer, nbytes))
        return func(*args, **kwargs)


# --------------------------------------------------------------------------------------------------------
# The guard


@contextmanager
def forbid(student: types.ModuleType | None = None, *, library: Iterable[str] = LABKIT_IMPLEMENTATIONS,
           allow: Iterable[str] = (), collectives: bool = False, reason: str = DEFAULT_REASON,
           traffic: Traffic | None = None) -> Iterator[None]:
    """Within the block, labkit's implementations in ``library`` (less those named in ``allow``) raise
    :class:`Forbidden`; with ``collectives=True`` so do torch's built-in collectives, and the point-to-point
    messages are recorded in ``traffic``.  ``student`` is the student's module, whose globals are also scanned.
    """
    loaded = tuple(name for name in TORCH_COLLECTIVE_MODULES if collectives and sys.modules.get(name))
    with ExitStack() as restore:
        unswapped = [(function, message) for function, message, code in _refusals(tuple(library), tuple(allow),
                                                                                   reason, loaded)
                     if not swap_code(function, message, restore, code)]
        if collectives:
            _refuse_process_group_collectives(reason, restore)
        if student is not None:
            _replace_in_module(student, unswapped, restore)
        if collectives:
            restore.enter_context(_PointToPointOnly(Traffic() if traffic is None else traffic, reason))
        yield


@contextmanager
def point_to_point_only(student: types.ModuleType | None = None, *, reason: str = POINT_TO_POINT_REASON,
                        library: Iterable[str] = (), allow: Iterable[str] = ()) -> Iterator[Traffic]:
    """Within the block only point-to-point messages move data: every built-in collective raises
    :class:`Forbidden`.  Yields the :class:`Traffic` of this rank, for a checker to compare with the schedule."""
    traffic = Traffic()
    with forbid(student, library=library, allow=allow, collectives=True, reason=reason, traffic=traffic):
        yield traffic


def no_shortcuts(check: Callable[[types.ModuleType], None] | None = None, *,
                 allow: Iterable[str] = (), built_ins: Iterable[str] = ()) -> Callable:
    """Decorate a check so that it runs under :func:`forbid` with labkit's implementations (less ``allow``) and
    the torch modules named in ``built_ins``: ``@no_shortcuts`` or ``@no_shortcuts(allow=[...])``.  Ranks the
    check launches inherit the guard."""
    allow, library = tuple(allow), LABKIT_IMPLEMENTATIONS + tuple(built_ins)
    watched = copies.Refused.of(_refusals(library, allow, DEFAULT_REASON),  # now, at the checker's import, from the
                                [f for name in allow for f in _functions(_resolve(name))])  # code the guard swaps

    def decorate(check: Callable[[types.ModuleType], None]) -> Callable[[types.ModuleType], None]:
        @functools.wraps(check)
        def guarded(module: types.ModuleType) -> None:
            with copies.refused(watched, swap_code), forbid(module, library=library, allow=allow), \
                    graders_off_limits(module):
                check(module)

        guarded.guarded = True  # tests/test_grading.py asserts every check has it
        return guarded

    return decorate if check is None else decorate(check)


# --------------------------------------------------------------------------------------------------------
# The grader is labkit's implementation too

GRADERS = "labkit.grading"
_CALLS: dict[int, Callable[..., Any]] = {}  # the calls the swapped functions forward to, by key
_STUDENTS: list[types.ModuleType] = []  # the modules graders_off_limits keeps the graders from
_SERVED = f"return __import__({__name__!r}, fromlist=['_'])._CALLS[{HOLE!r}](*args, **kwargs)"
REASON = "the grader itself: the answer must be yours"


@contextmanager
def graders_off_limits(student: types.ModuleType | None) -> Iterator[None]:
    """A checker's own references (``_digits``...) answer its exercise as surely as labkit's.  Within the block the
    student's module may hold nothing of ``labkit.grading`` (module, function, class, or a class built on one),
    its ``import`` of anything there raises, and each function of a loaded checker module raises when called from
    the student's code (by its caller's globals), still serving the checker, its ranks and labkit.  What a checker
    hands to student code on purpose stays: methods (exercise 06's reference f and g) and the functions it puts in
    the student's module to grade one part alone (exercise 04's reference unscale)."""
    if student is None:
        yield
        return
    for name, value in vars(student).items():
        if _grader_name(value):
            raise Forbidden(f"your file holds {_grader_name(value)} (as {name}), {REASON}")
    with ExitStack() as restore:
        _refuse_imports(student.__name__, restore)
        _STUDENTS.append(student)
        restore.callback(_STUDENTS.remove, student)
        for module_name, module in list(sys.modules.items()):
            if module_name.startswith(f"{GRADERS}.checkers.") and module is not None:
                for function in vars(module).values():  # functions, not methods
                    if type(function) is types.FunctionType and function.__module__ == module_name and \
                            not getattr(function, "guarded", False) and (code := _served(function)) is not None:
                        swap_code(function, "", restore, code)
        yield


def _grader_name(value: Any) -> str | None:
    if isinstance(value, types.ModuleType):
        return value.__name__ if value.__name__.startswith(GRADERS) else None
    for thing in getattr(value, "__mro__", None) or (value,):
        if str(getattr(thing, "__module__", None)).startswith(GRADERS):
            return f"{thing.__module__}.{getattr(thing, '__qualname__', type(thing).__name__)}"
    return None


def _refuse_imports(student: str, restore: ExitStack) -> None:
    original = builtins.__import__

    def guarded_import(name: str, globals: dict | None = None, locals: Any = None, fromlist: Any = (),
                       level: int = 0) -> Any:
        if globals is not None and globals.get("__name__") == student and level == 0 and (
                name.startswith(GRADERS) or name == "labkit" and "grading" in (fromlist or ())):
            raise Forbidden(f"imported {name}, {REASON}")
        return original(name, globals, locals, fromlist, level)

    builtins.__import__ = guarded_import
    restore.callback(setattr, builtins, "__import__", original)


@functools.cache
def _served(function: types.FunctionType) -> types.CodeType | None:
    """Code for ``function`` that refuses a call from a student's module and runs the original for any other."""
    twin = types.FunctionType(function.__code__, function.__globals__, function.__name__, function.__defaults__,
                              function.__closure__)
    twin.__kwdefaults__, message = function.__kwdefaults__, f"used {_public_name(function)}, {REASON}"

    def call(*args: Any, **kwargs: Any) -> Any:  # frame 0: here, 1: the swapped function, 2: its caller
        caller = sys._getframe(2).f_globals  # (one the checker put in the student's module, to grade a part, serves)
        if any(caller is vars(student) and function not in vars(student).values() for student in _STUDENTS):
            raise Forbidden(message)
        return twin(*args, **kwargs)

    _CALLS[id(function)] = call
    return code_running(function, _SERVED, "served", id(function))


# --------------------------------------------------------------------------------------------------------
# What is forbidden


@functools.cache
def _resolve(name: str) -> tuple[Any, ...]:
    """A module (with every submodule of a package), or one function or class, by dotted name."""
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError:
        module_name, _, attribute = name.rpartition(".")
        return (getattr(importlib.import_module(module_name), attribute),)
    found = [module]
    if hasattr(module, "__path__"):
        for info in pkgutil.walk_packages(module.__path__, prefix=f"{name}."):
            try:
                found.append(importlib.import_module(info.name))
            except Exception:  # a module that cannot be imported cannot be a shortcut either
                continue
    return tuple(found)


def _functions(objects: Iterable[Any]) -> list[types.FunctionType]:
    """The functions defined by these modules, classes or functions, and the methods of their classes."""
    functions: list[types.FunctionType] = []
    for thing in objects:
        if isinstance(thing, types.ModuleType):
            for value in vars(thing).values():
                if getattr(value, "__module__", None) == thing.__name__:
                    functions.extend(_functions([value]) if isinstance(value, type) else _as_function(value))
        elif isinstance(thing, type):
            for name, value in vars(thing).items():
                if not name.startswith("__") or name in ("__init__", "__new__", "__call__", "__post_init__"):
                    functions.extend(_as_function(value))
        else:
            functions.extend(_as_function(thing))
    return functions


def _as_function(value: Any) -> list[types.FunctionType]:
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    return [value] if isinstance(value, types.FunctionType) else []


@functools.lru_cache(maxsize=64)
def _refusals(library: tuple[str, ...], allow: tuple[str, ...], reason: str,
              loaded: tuple[str, ...] = ()) -> list[tuple[Any, str, Any]]:
    """``(function, message, refusing code)`` for each function :func:`forbid` swaps: those of ``library`` less
    ``allow``, and the collectives of the modules of :data:`TORCH_COLLECTIVE_MODULES` in ``loaded``.  Worked out
    once per guard and process (a check enters its guard once; exercise 01's ranks at every call)."""
    allowed = {id(function) for name in allow for function in _functions(_resolve(name))}
    chosen = [(function, "labkit's own implementation" if function.__module__.startswith("labkit") else "a built-in")
              for name in library for function in _functions(_resolve(name)) if id(function) not in allowed]
    chosen += [(function, "a built-in collective") for module_name in loaded
               for name, function in vars(sys.modules[module_name]).items()
               if type(function) is types.FunctionType and function.__module__ == module_name
               and COLLECTIVE_NAME.match(name)]
    messages = [(function, f"used {_public_name(function)}, {whose}: {reason}") for function, whose in chosen]
    return [(function, message, code_running(function, _REFUSED, value=message)) for function, message in messages]


def _public_name(function: types.FunctionType) -> str:
    if getattr(dist, function.__name__, None) is function:
        return f"torch.distributed.{function.__name__}"
    return f"{function.__module__}.{function.__qualname__}"


# --------------------------------------------------------------------------------------------------------
# Making it refuse


def code_running(function: types.FunctionType, statement: str, name: str = "refused",
                 value: Any = None) -> types.CodeType | None:
    """Code of a function ``name(*args, **kwargs)`` that runs ``statement``, with ``function``'s free variables
    (tests tell a swapped function by its code's name), ``value`` in place of :data:`HOLE`: compiled once per set of
    free variables, as a check swaps hundreds of functions each time it enters the guard (01's ranks: every call)."""
    code = _template(function.__code__.co_freevars, statement, name)
    return code if code is None or value is None else code.replace(co_consts=tuple(
        value if type(constant) is str and constant == HOLE else constant for constant in code.co_consts))


@functools.lru_cache(maxsize=256)
def _template(free: tuple[str, ...], statement: str, name: str) -> types.CodeType | None:
    lines = ["def outer():", *(f"    {free_name} = None" for free_name in free), f"    def {name}(*args, **kwargs):",
             *([f"        ({', '.join(free)},)"] if free else []), f"        {statement}", f"    return {name}"]
    namespace: dict[str, Any] = {}
    try:
        exec("\n".join(lines), namespace)
    except SyntaxError:
        return None
    code = namespace["outer"]().__code__
    return code if code.co_freevars == free else None


def swap_code(function: types.FunctionType, message: str, restore: ExitStack,
              code: types.CodeType | None = None) -> bool:
    """Give ``function`` the code that refuses with ``message`` (or ``code``), undone by ``restore``; False where
    its code cannot be swapped (a builtin, a closure whose free variables differ)."""
    code = code_running(function, _REFUSED, value=message) if code is None else code
    if code is None:
        return False
    original = function.__code__
    try:
        function.__code__ = code
    except (TypeError, ValueError):
        return False
    restore.callback(setattr, function, "__code__", original)
    return True


def _refuse_process_group_collectives(reason: str, restore: ExitStack) -> None:
    """Collective methods of ``ProcessGroup`` and of its backends (``ProcessGroupGloo``...) raise."""
    c10d = torch._C._distributed_c10d
    for cls in [value for value in vars(c10d).values() if isinstance(value, type)
                and issubclass(value, (c10d.ProcessGroup, c10d.Backend))]:
        for name in list(vars(cls)):
            if COLLECTIVE_NAME.match(name):
                restore.callback(setattr, cls, name, vars(cls)[name])
                setattr(cls, name, _refusing_function(f"used ProcessGroup.{name}, a built-in collective: {reason}"))


def _refusing_function(message: str) -> Callable[..., Any]:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise Forbidden(message)
    return refused


def _replace_in_module(student: types.ModuleType, unswapped: list[tuple[Callable, str]], restore: ExitStack) -> None:
    """Forbidden callables that kept their code are replaced where the student's module holds them."""
    messages = {id(function): message for function, message in unswapped}
    for name, value in list(vars(student).items()):
        if id(value) in messages:
            restore.callback(setattr, student, name, value)
            setattr(student, name, _refusing_function(messages[id(value)]))


for _name in LABKIT_IMPLEMENTATIONS:  # import them now, so that the check processes forked later need not
    _resolve(_name)
