"""The ``labkit`` command: ``labkit doctor | grade | bench | plan``.

- ``labkit doctor [--quick | --no-calibrate]`` — what this machine offers (torch, backends, GPUs, CPUs) and a 2-rank
  gloo all-reduce as a smoke test.  The first thing to run when something is off.  Then it calibrates the cost
  model (``labkit.calibrate.calibrate``: FLOP/s, the gloo links' alpha-beta beside one thread's memory copy, their
  ceiling, AdamW's step) and saves the constants that lesson 11 predicts this machine's runs from
  (``labkit.costmodel.calibration``); ``--quick`` measures fewer micro-batch sizes and repeats
  (``labkit.calibrate.QUICK``): faster, noisier constants.
- ``labkit grade [--solutions] [--dir PATH] [--json]`` — score every exercise: a table for a person, JSON
  for an instructor's tooling.  ``labkit grade --class DIR [--only TOPICS] [--jobs N] [--timeout S] [--out FILE]``
  grades every student folder in ``DIR`` in parallel into one CSV and prints a summary per exercise
  (``labkit.grading.gradebook``).
- ``labkit bench [--quick] [--report-only] [NAME ...]`` — run the benchmarks in ``benchmarks/`` (each compares a
  labkit technique with PyTorch's built-in, measured in the same run); exits 1 when a target is missed.
- ``labkit plan --model NAME --gpu NAME --gpus N --global-batch B [--top K] [--efficiency E]`` — the fastest
  3D configurations that fit (``labkit.costmodel.planner``), as a table with each term of the predicted step
  (``E``, the fraction of the peak large matrix products reach, defaults to the one lesson 11 fits to published
  runs with the attention and memory efficiencies, ``labkit.costmodel.validation``; one line under the table
  gives the published runs the model was validated on and its error there).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist

from labkit import __version__, dist, grading, launch
from labkit.grading import gradebook


def _smoke_all_reduce() -> tuple[float, str]:
    device = dist.device()
    tensor = torch.tensor([float(torch_dist.get_rank() + 1)], device=device)
    torch_dist.all_reduce(tensor)
    return tensor.item(), str(device)


def doctor(args: argparse.Namespace) -> int:
    """Print what this machine offers, then all-reduce once over 2 gloo ranks (or over the torchrun job)."""
    under_torchrun = dist.in_torchrun()
    available = torch_dist.is_available()
    rows = [
        ("labkit", __version__),
        ("python", platform.python_version()),
        ("platform", platform.platform()),
        ("torch", torch.__version__),
        ("torch.distributed", "available" if available else "NOT available"),
        ("gloo backend", "yes" if available and torch_dist.is_gloo_available() else "no"),
        ("nccl backend", "yes" if available and torch_dist.is_nccl_available() else "no"),
        ("mpi backend", "yes" if available and torch_dist.is_mpi_available() else "no"),
        ("CUDA GPUs", str(dist.gpus_available())),
        ("CPU cores", str(os.cpu_count())),
        ("backend='auto' for 2 ranks", dist.resolve_backend("auto", 2)),
    ]
    for index in range(dist.gpus_available()):
        rows.append((f"  cuda:{index}", torch.cuda.get_device_name(index)))
    if under_torchrun:
        rows.append(("torchrun job", f"RANK={os.environ['RANK']} WORLD_SIZE={os.environ['WORLD_SIZE']}"))
    width = max(len(name) for name, _ in rows)
    if dist.is_main():
        for name, value in rows:
            print(f"{name:<{width}}  {value}")
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else 2
    expected = float(world * (world + 1) // 2)
    if dist.is_main():
        where = "this torchrun job's" if under_torchrun else "2 gloo"
        print(f"smoke test: all_reduce of each rank's (rank + 1) over {where} ranks ... ", end="", flush=True)
    start = time.perf_counter()
    try:
        results = launch.launch(_smoke_all_reduce, nprocs=world, backend="auto" if under_torchrun else "gloo",
                                timeout=60.0)
    except Exception as error:  # the doctor reports, it does not crash
        print(f"FAILED\n{error}")
        return 1
    seconds = time.perf_counter() - start
    values = [value for value, _device in results]
    if values != [expected] * world:
        print(f"FAILED: expected {[expected] * world}, got {values}")
        return 1
    if dist.is_main():
        devices = sorted({device for _value, device in results})
        # Under torchrun the processes were there before the clock started: it times joining the group only.
        timed = "joining the process group included" if under_torchrun else "starting the processes included"
        print(f"ok ({values}, on {', '.join(devices)}, {seconds:.2f} s, {timed})")
    if under_torchrun or not getattr(args, "calibrate", True):
        return 0
    return _calibrate(quick=getattr(args, "quick", False))


def _calibrate(quick: bool = False) -> int:
    """Measure this machine's constants for the cost model (lesson 11) and save them; ``quick``: with
    ``labkit.calibrate.QUICK``'s fewer micro-batch sizes and repeats (faster, noisier)."""
    from labkit.calibrate import QUICK, calibrate
    from labkit.costmodel import calibration

    how = "quick: fewer samples, noisier constants" if quick else "about half a minute; --quick: fewer samples"
    print(f"calibration for lesson 11's predictions ({how}; --no-calibrate skips it):", flush=True)
    try:
        measured = calibrate(**(QUICK if quick else {}), progress=lambda line: print(f"  {line}", flush=True))
    except Exception as error:  # the doctor reports, it does not crash
        print(f"calibration FAILED\n{error}")
        return 1
    path = calibration.save(measured)
    print(f"  {measured.describe()}\n  saved to {path}")
    return 0


def grade(args: argparse.Namespace) -> int:
    if args.class_dir is not None:
        return _grade_class(args)
    class_only = [flag for flag in ("only", "jobs", "timeout", "out") if getattr(args, flag) is not None]
    if class_only:
        print(f"labkit grade: --{class_only[0]} goes with --class DIR", file=sys.stderr)
        return 2
    directory = args.dir
    if directory is not None and not Path(directory).is_dir():
        print(f"labkit grade: --dir {directory!r} is not a directory", file=sys.stderr)
        return 2

    def progress(topic: str) -> None:
        if not args.json:
            print(f"grading {grading.EXERCISES[topic][0]} ...", file=sys.stderr, flush=True)

    try:
        reports = grading.grade_all(solutions=args.solutions or None, directory=directory, progress=progress)
    except FileNotFoundError as error:
        print(f"labkit grade: {error}", file=sys.stderr)
        return 2
    if args.json:
        passed = sum(report.passed for report in reports)
        total = sum(report.total for report in reports)
        print(json.dumps({"passed": passed, "total": total,
                          "exercises": [report.to_dict() for report in reports]}, indent=2))
    else:
        print(grading.format_table(reports))
    return 0


def _grade_class(args: argparse.Namespace) -> int:
    """``labkit grade --class DIR``: every student folder in parallel, one CSV, a summary per exercise; a bad
    argument exits 2 naming it before any process starts."""
    out = Path(args.out) if args.out is not None else Path(args.class_dir) / "gradebook.csv"
    problem = ("--class grades a class's folders: not with --dir or --solutions" if args.dir or args.solutions
               else f"--out {str(out)!r} is a directory: name a file" if out.is_dir() else None)
    if problem:
        print(f"labkit grade: {problem}", file=sys.stderr)
        return 2
    try:
        topics = gradebook.parse_topics(args.only)
        book = gradebook.grade_class(args.class_dir, topics=topics, jobs=args.jobs, timeout=args.timeout,
                                     progress=lambda line: print(line, file=sys.stderr, flush=True))
    except ValueError as error:
        print(f"labkit grade: {error}", file=sys.stderr)
        return 2
    table, checks = gradebook.write_csv(book, out)
    where = f"gradebook: {table} (every check: {checks})"
    if args.json:
        print(json.dumps(book.to_dict(), indent=2))
        print(where, file=sys.stderr)
    else:
        print(f"{len(book.students)} students, {len(topics)} exercise(s), graded in {book.seconds:.0f} s by "
              f"{book.jobs} worker(s); {where}\n{gradebook.format_summary(book)}")
    return 0


def _benchmarks_folder() -> Path:
    return Path(__file__).resolve().parents[1] / "benchmarks"


def stored_benchmark(name: str) -> list[str]:
    """The lines of ``benchmarks/results/<name>.txt``, a benchmark's output kept with the repository (its first line
    says when and where it ran), for the lessons that quote it."""
    path = _benchmarks_folder() / "results" / f"{name}.txt"
    if not path.is_file():
        raise FileNotFoundError(f"no stored output of benchmark {name!r} at {path}: run "
                                f"`python benchmarks/{name}.py > {path}` in the repository")
    return path.read_text().splitlines()


def bench(args: argparse.Namespace) -> int:
    """Run the benchmarks, each printing its targets as ``PASS:``/``FAIL:`` lines; exit 1 when a target is missed
    or a benchmark fails (``--report-only``: only when one fails), so that a regression is seen."""
    folder = _benchmarks_folder()
    scripts = sorted(folder.glob("bench_*.py")) if folder.is_dir() else []
    if not scripts:
        print(f"labkit bench: no benchmarks found in {folder} (they ship with the repository)", file=sys.stderr)
        return 2
    if args.names:
        unknown = [name for name in args.names if not (folder / f"bench_{name}.py").is_file()]
        if unknown:
            known = ", ".join(script.stem.removeprefix("bench_") for script in scripts)
            print(f"labkit bench: unknown benchmark(s) {unknown}; known: {known}", file=sys.stderr)
            return 2
        scripts = [folder / f"bench_{name}.py" for name in args.names]
    missed, broken = [], []
    for script in scripts:
        name = script.stem.removeprefix("bench_")
        print(f"\n=== {name} ({script.name}) ===", flush=True)
        command = [sys.executable, str(script)] + (["--quick"] if args.quick else [])
        with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, bufsize=1) as process:
            for line in process.stdout:
                print(line, end="", flush=True)
                if line.lstrip().startswith("FAIL"):
                    missed.append(f"{name}: {line.strip()}")
        if process.returncode != 0:
            broken.append(f"{name}: exited with code {process.returncode}")
    if missed:
        print(f"\nlabkit bench: {len(missed)} target(s) missed"
              + (" (--report-only: not an error)" if args.report_only else "") + ":\n  " + "\n  ".join(missed))
    if broken:
        print("\nlabkit bench: failed:\n  " + "\n  ".join(broken), file=sys.stderr)
    if not missed and not broken:
        print(f"\nlabkit bench: every target met ({len(scripts)} benchmark(s))")
    return 1 if broken or (missed and not args.report_only) else 0


# What each column of ``labkit plan``'s table is (its legend, printed under it).
PLAN_COLUMNS = (
    ("layout", "dp x tp x pp: data-parallel replicas, tensor-parallel ways, pipeline stages; cp: ranks each sequence "
               "is split over (context parallelism, tried when nothing fits without it); ep: ranks of dp x cp a "
               "mixture of experts' experts are split over (expert parallelism); ZeRO-k: the stage "
               "over dp (0: plain DDP, 3: FSDP); b: the micro-batch, in sequences; recompute: activations "
               "recomputed (selective: the attention core only); the pipeline schedule (v: stages per GPU, "
               "interleaved); layers: each pipeline chunk's layers where they do not divide evenly (a/bxn/c: n "
               "chunks of b), the embedding and the output weighing a layer each, as torchtitan splits them"),
    ("step s", "the predicted step, in seconds: the sum of the terms on the right"),
    ("MFU", "model FLOPs utilisation: the model's FLOPs per step / (step time x GPUs x peak bf16 FLOP/s)"),
    ("GB/GPU", "the fullest GPU's memory at its peak, in GB (1e9 bytes)"),
    ("compute", "seconds of forward and backward on the slowest pipeline rank, without communication"),
    ("tp", "seconds of tensor-parallel all-reduces on the critical path"),
    ("bubble", "seconds the pipeline schedule leaves that rank idle"),
    ("pp send", "seconds the sends between pipeline stages add"),
    ("dp", "seconds of the data-parallel gradient reduction not hidden behind the backward"),
    ("zero", "seconds of ZeRO's and FSDP's all-gathers not hidden, and the slowdown of what hid them"),
    ("cp", "seconds of context parallelism's K/V exchange not hidden behind attention (shown with cp > 1)"),
    ("ep", "seconds of expert parallelism's all-to-alls, four a MoE layer and micro-batch (shown with ep > 1)"),
    ("optimizer", "seconds of Adam's step through GPU memory on the rank that updates the most parameters"),
)


def _plan_flags(args: argparse.Namespace) -> None:
    """``ValueError`` naming the flag, before the planner runs."""
    from labkit.costmodel import compute

    for flag, value in (("--gpus", args.gpus), ("--global-batch", args.global_batch), ("--top", args.top),
                        ("--seq-len", args.seq_len or 1)):
        if value < 1:
            raise ValueError(f"{flag} must be an integer >= 1, got {value}")
    if args.efficiency is not None and not 0 < args.efficiency <= 1:
        raise ValueError(f"--efficiency must be a fraction of the peak in (0, 1], got {args.efficiency}")
    if args.gpu not in compute.GPUS:
        raise ValueError(f"--gpu {args.gpu!r} is unknown; choose one of {', '.join(sorted(compute.GPUS))}")


def _degrees(flag: str, text: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> ``(1, 2, 4)``; ``ValueError`` naming the flag otherwise."""
    try:
        degrees = tuple(int(part) for part in text.split(","))
    except ValueError:
        degrees = ()
    if not degrees or min(degrees) < 1:
        raise ValueError(f"{flag} must be degrees >= 1 separated by commas, e.g. 1,2,4,8; got {text!r}")
    return degrees


def _usable_degrees(flag: str, degrees: tuple[int, ...], problem: Callable[[int], str | None]) -> None:
    """``ValueError`` naming ``flag`` and why, when no degree it lists can work (``problem``: the planner's rule
    for one degree); one that can is enough, the others are skipped as the planner skips them."""
    problems = [problem(degree) for degree in degrees]
    if all(problems):
        raise ValueError(f"{flag} {','.join(map(str, degrees))}: no layout can use it: "
                         + "; ".join(f"{degree} {why}" for degree, why in zip(degrees, problems, strict=True)))


def _validated(validation: Any, efficiency: float | None) -> str:
    """One line: the published runs the step model was held to, not fitted on, and its error there beside a
    constant's (:mod:`labkit.costmodel.validation`; lesson 11)."""
    if efficiency is not None:
        return (f"--efficiency {efficiency} replaces the fitted {validation.EFFICIENCIES[0]}: the model was validated "
                "on published runs at the fitted value only (lesson 11).")
    scores = validation.held_out() + [validation.unseen()]
    errors = "; ".join(f"{score.name} ({len(score.runs)} runs) {100 * score.rms:.1f} points against a constant's "
                       f"{100 * score.constant_rms:.1f}" for score in scores)
    return (f"Validated on published runs it was not fitted to (fitted on {len(validation.FIT_SET)} rows of "
            f"Megatron-LM's H100 table): RMS error of the predicted MFU, {errors} (lesson 11).")


def plan(args: argparse.Namespace) -> int:
    """Print the planner's top configurations for a published model shape on a cluster of one GPU kind, each
    term of the predicted step apart (the DP reduction and ZeRO's gathers: what is exposed, and the slowdown of
    the compute that hid the rest), and what each column means."""
    from labkit.costmodel import compute, planner, shapes, validation

    efficiency = validation.EFFICIENCIES[0] if args.efficiency is None else args.efficiency
    try:
        _plan_flags(args)
        if args.model not in shapes.MODEL_SHAPES:
            raise ValueError(f"--model {args.model!r} is unknown; choose one of {', '.join(sorted(shapes.MODEL_SHAPES))}")
        shape = shapes.TransformerShape.preset(args.model)
        if args.seq_len is not None:
            shape = dataclasses.replace(shape, seq_len=args.seq_len)
        cluster = planner.Cluster(compute.GPUS[args.gpu], args.gpus, efficiency)  # attention, memory: the fitted
        choices = {} if args.cp is None else {"context_parallel": _degrees("--cp", args.cp)}
        if args.cp is not None:
            _usable_degrees("--cp", choices["context_parallel"],
                            lambda cp: planner.cp_problem(shape, args.gpus, cp))
        if args.ep is not None:
            if not shape.num_experts:
                raise ValueError(f"--ep splits a mixture of experts' experts: {args.model} is dense")
            choices["expert_parallel"] = _degrees("--ep", args.ep)
            _usable_degrees("--ep", choices["expert_parallel"], lambda ep: planner.ep_problem(shape, args.gpus, ep))
        if args.schedules is not None:
            choices["schedules"] = tuple(name.strip() for name in args.schedules.split(","))
            unknown = [name for name in choices["schedules"] if name not in planner.ALL_SCHEDULES]
            if unknown:
                raise ValueError(f"--schedules takes names among {', '.join(planner.ALL_SCHEDULES)}, got {unknown[0]!r}")
        result = planner.plan(shape, cluster, args.global_batch, top=args.top, **choices)
    except ValueError as error:
        print(f"labkit plan: {error}", file=sys.stderr)
        return 2
    margin = cluster.memory_margin
    active = f", {shapes.num_parameters(shape, active=True) / 1e9:.1f}B active" if shape.num_experts else ""
    print(f"{args.model} ({shapes.num_parameters(shape) / 1e9:.1f}B parameters{active}) on {args.gpus} x {args.gpu}, "
          f"global batch {args.global_batch} x {shape.seq_len} tokens, each layer priced kernel by kernel "
          f"({efficiency:.0%} of peak on large matrix products); "
          f"plans fill at most {cluster.usable_bytes / 1e9:.0f} of {cluster.gpu.memory_bytes / 1e9:.0f} GB a GPU, "
          f"keeping {margin:.0%} for what the memory model does not count (CUDA context, NCCL buffers, the "
          f"allocator's fragmentation: lesson 04): {result.reason()}")
    if not result.candidates:
        if result.padded_seq_len is not None and args.seq_len is not None:
            print(f"--seq-len {args.seq_len} is that length: try --seq-len {result.padded_seq_len}")
        return 1
    parts = list(dict.fromkeys(part for candidate in result.candidates for part in candidate.step.parts()))
    wide = max(46, *(len(candidate.layout.label()) for candidate in result.candidates))
    print(f"\n{'layout':<{wide}} {'step s':>7} {'MFU':>5} {'GB/GPU':>6}  " + " ".join(f"{part:>8}" for part in parts))
    for candidate in result.candidates:
        print(f"{candidate.layout.label():<{wide}} {candidate.step.step_s:>7.3f} {candidate.mfu:>5.0%} "
              f"{candidate.memory['total'] / 1e9:>6.1f}  "
              + " ".join(f"{candidate.step.parts().get(part, 0.0):>8.3f}" for part in parts))
    print("\n" + textwrap.fill(_validated(validation, args.efficiency), 118))
    width = max(len(name) for name, _ in PLAN_COLUMNS)
    print("\n" + "\n".join(textwrap.fill(meaning, 110, initial_indent=f"{name:>{width}}  ",
                                         subsequent_indent=" " * (width + 2))
                           for name, meaning in PLAN_COLUMNS if name not in ("cp", "ep") or name in parts))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="labkit", description="labkit: learn distributed training by building it.")
    commands = parser.add_subparsers(dest="command", required=True)
    doctor_parser = commands.add_parser("doctor", help="check this machine, run a 2-rank smoke test, calibrate")
    doctor_parser.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                               help="skip measuring FLOP/s and the gloo links for lesson 11's predictions")
    doctor_parser.add_argument("--quick", action="store_true",
                               help="calibrate from fewer micro-batch sizes and repeats: faster, noisier constants")
    doctor_parser.set_defaults(run=doctor)
    grade_parser = commands.add_parser("grade", help="score every exercise")
    grade_parser.add_argument("--solutions", action="store_true", help="grade solutions/ instead of exercises/")
    grade_parser.add_argument("--dir", metavar="PATH", help="grade the exercise files in this folder")
    grade_parser.add_argument("--json", action="store_true", help="print JSON (for an instructor's tooling)")
    grade_parser.add_argument("--class", dest="class_dir", metavar="DIR",
                              help="grade every student folder in DIR (each a copy of exercises/) into one CSV")
    grade_parser.add_argument("--out", metavar="FILE", help="with --class: the CSV (default: DIR/gradebook.csv)")
    grade_parser.add_argument("--only", metavar="TOPICS", help="with --class: these exercises, e.g. setup,zero")
    grade_parser.add_argument("--jobs", type=int, metavar="N", help="with --class: workers (default: one per core)")
    grade_parser.add_argument("--timeout", type=float, metavar="SECONDS",
                              help="with --class: at most this long a check (default: each check's own limit)")
    grade_parser.set_defaults(run=grade)
    bench_parser = commands.add_parser("bench", help="run the benchmarks against PyTorch's built-ins")
    bench_parser.add_argument("--quick", action="store_true",
                              help="fewer sizes and iterations (the full set takes many minutes on a laptop)")
    bench_parser.add_argument("--report-only", action="store_true",
                              help="exit 0 when a target is missed (still 1 when a benchmark fails)")
    bench_parser.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    bench_parser.set_defaults(run=bench)
    plan_parser = commands.add_parser("plan", help="the fastest 3D configurations that fit, predicted")
    plan_parser.add_argument("--model", default="gpt3-175b", help="a published shape (labkit.costmodel.memory)")
    plan_parser.add_argument("--gpu", default="A100 80GB", help="a GPU of labkit.costmodel.compute.GPUS")
    plan_parser.add_argument("--gpus", type=int, default=1024, help="GPUs in the cluster")
    plan_parser.add_argument("--global-batch", type=int, default=1536, help="sequences per step")
    plan_parser.add_argument("--top", type=int, default=10)
    plan_parser.add_argument("--seq-len", type=int, default=None,
                             help="tokens per sequence (default: the model's); long ones may need context parallelism")
    plan_parser.add_argument("--cp", default=None, metavar="DEGREES",
                             help="context-parallel degrees to try, e.g. 1,2,4,8 (default: none unless nothing fits)")
    plan_parser.add_argument("--ep", default=None, metavar="DEGREES",
                             help="an MoE shape's expert-parallel degrees to try, e.g. 1,8,64 (default: powers of two)")
    plan_parser.add_argument("--schedules", default=None, metavar="NAMES",
                             help="pipeline schedules to try, e.g. 1f1b,zb-v,dualpipev (default: 1f1b, interleaved, "
                                  "gpipe, zb-h1; also interleaved-zb, zb-v, dualpipev)")
    plan_parser.add_argument("--efficiency", type=float, default=None,
                             help="fraction of peak large matrix products reach (default: lesson 11's fitted one)")
    plan_parser.set_defaults(run=plan)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
