"""The ``labkit`` command: ``labkit doctor | grade | bench | plan``.

- ``labkit doctor [--no-calibrate]`` — what this machine offers (torch, backends, GPUs, CPUs) and a 2-rank gloo
  all-reduce as a smoke test.  The first thing to run when something is off.  Then it calibrates the cost model
  (``labkit.calibrate.calibrate``: FLOP/s, the gloo links' alpha-beta, AdamW's step) and saves the constants that
  lesson 11 predicts this machine's runs from (``labkit.costmodel.calibration``).
- ``labkit grade [--solutions] [--dir PATH] [--json]`` — score every exercise: a table for a person, JSON
  for an instructor's tooling.
- ``labkit bench [--quick] [NAME ...]`` — run the benchmarks in ``benchmarks/`` (each compares a labkit
  technique with PyTorch's built-in, measured in the same run).
- ``labkit plan --model NAME --gpu NAME --gpus N --global-batch B [--top K] [--efficiency E]`` — the fastest
  3D configurations that fit (``labkit.costmodel.planner``), as a table with each term of the predicted step
  (``E`` defaults to the efficiency lesson 11 fits to published runs, ``labkit.costmodel.validation``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as torch_dist

from labkit import __version__, dist, grading, launch


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
        print(f"ok ({values}, on {', '.join(devices)}, {seconds:.2f} s including process start)")
    if under_torchrun or not getattr(args, "calibrate", True):
        return 0
    return _calibrate()


def _calibrate() -> int:
    """Measure this machine's constants for the cost model (lesson 11) and save them."""
    from labkit.calibrate import calibrate
    from labkit.costmodel import calibration

    print("calibration for lesson 11's predictions (about half a minute; --no-calibrate skips it):", flush=True)
    try:
        measured = calibrate(progress=lambda line: print(f"  {line}", flush=True))
    except Exception as error:  # the doctor reports, it does not crash
        print(f"calibration FAILED\n{error}")
        return 1
    path = calibration.save(measured)
    print(f"  {measured.describe()}\n  saved to {path}")
    return 0


def grade(args: argparse.Namespace) -> int:
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


def bench(args: argparse.Namespace) -> int:
    folder = Path(__file__).resolve().parents[1] / "benchmarks"
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
    status = 0
    for script in scripts:
        print(f"\n=== {script.stem.removeprefix('bench_')} ({script.name}) ===", flush=True)
        command = [sys.executable, str(script)] + (["--quick"] if args.quick else [])
        status |= subprocess.call(command)
    return status


def plan(args: argparse.Namespace) -> int:
    """Print the planner's top configurations for a published model shape on a cluster of one GPU kind, each
    term of the predicted step apart (the DP reduction and ZeRO's gathers: what is exposed, and the slowdown of
    the compute that hid the rest)."""
    from labkit.costmodel import compute, memory, planner, validation

    efficiency = validation.EFFICIENCY if args.efficiency is None else args.efficiency
    try:
        shape = memory.TransformerShape.preset(args.model)
        if args.gpu not in compute.GPUS:
            raise ValueError(f"unknown GPU {args.gpu!r}; choose one of {sorted(compute.GPUS)}")
        cluster = planner.Cluster(compute.GPUS[args.gpu], args.gpus, efficiency)
        result = planner.plan(shape, cluster, args.global_batch, top=args.top)
    except ValueError as error:
        print(f"labkit plan: {error}", file=sys.stderr)
        return 2
    print(f"{args.model} ({memory.num_parameters(shape) / 1e9:.1f}B parameters) on {args.gpus} x {args.gpu}, "
          f"global batch {args.global_batch} x {shape.seq_len} tokens, {efficiency:.1%} of peak on the "
          f"matrices, {cluster.usable_bytes / 1e9:.0f} of {cluster.gpu.memory_bytes / 1e9:.0f} GB planned: "
          f"{result.reason()}")
    if not result.candidates:
        return 1
    parts = list(result.candidates[0].step.parts())
    print(f"{'layout':<46} {'step s':>7} {'MFU':>5} {'GB/GPU':>6}  " + " ".join(f"{part:>8}" for part in parts))
    for candidate in result.candidates:
        print(f"{candidate.layout.label():<46} {candidate.step.step_s:>7.2f} {candidate.mfu:>5.0%} "
              f"{candidate.memory['total'] / 1e9:>6.1f}  "
              + " ".join(f"{seconds:>8.3f}" for seconds in candidate.step.parts().values()))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="labkit", description="labkit: learn distributed training by building it.")
    commands = parser.add_subparsers(dest="command", required=True)
    doctor_parser = commands.add_parser("doctor", help="check this machine, run a 2-rank smoke test, calibrate")
    doctor_parser.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                               help="skip measuring FLOP/s and the gloo links for lesson 11's predictions")
    doctor_parser.set_defaults(run=doctor)
    grade_parser = commands.add_parser("grade", help="score every exercise")
    grade_parser.add_argument("--solutions", action="store_true", help="grade solutions/ instead of exercises/")
    grade_parser.add_argument("--dir", metavar="PATH", help="grade the exercise files in this folder")
    grade_parser.add_argument("--json", action="store_true", help="print JSON (for an instructor's tooling)")
    grade_parser.set_defaults(run=grade)
    bench_parser = commands.add_parser("bench", help="run the benchmarks against PyTorch's built-ins")
    bench_parser.add_argument("--quick", action="store_true", help="fewer sizes and iterations")
    bench_parser.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    bench_parser.set_defaults(run=bench)
    plan_parser = commands.add_parser("plan", help="the fastest 3D configurations that fit, predicted")
    plan_parser.add_argument("--model", default="gpt3-175b", help="a published shape (labkit.costmodel.memory)")
    plan_parser.add_argument("--gpu", default="A100 80GB", help="a GPU of labkit.costmodel.compute.GPUS")
    plan_parser.add_argument("--gpus", type=int, default=1024)
    plan_parser.add_argument("--global-batch", type=int, default=1536, help="sequences per step")
    plan_parser.add_argument("--top", type=int, default=10)
    plan_parser.add_argument("--efficiency", type=float, default=None,
                             help="fraction of peak the matrices reach (default: lesson 11's fitted one)")
    plan_parser.set_defaults(run=plan)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
