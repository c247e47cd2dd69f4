"""GPU check of the pipeline runtime (``labkit.parallel.pipeline``) on ``cuda:0`` through NCCL.

    python3 benchmarks/gpu_check_pipeline.py          (gpu_check.sh runs it after gpu_check.py)

One GPU allows one NCCL rank (NCCL refuses two ranks on one device), so the pipeline has one rank: ``p = 1``,
one stage holding the whole TinyGPT "10m" (untied), ``m = 8`` micro-batches.  What runs on the GPU is
everything but the messages: the runtime's loop, its timeline gathered over NCCL (``all_gather_object``), the
stage's forward and backward, and the split backward of ZB-H1 (``I``: ``autograd.grad`` for the layer outputs;
``W``: the weight gradients from them).  Checked: GPipe's, 1F1B's and ZB-H1's gradients against the plain
model with gradient accumulation (fp32, same kernels: within 1e-4 relative), and the step time of each beside
the plain model's accumulation loop.  The messages themselves are checked on gloo by the test suite.
Exits non-zero when a path is broken.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from labkit import launch  # noqa: E402
from labkit.models import GPTConfig, TinyGPT  # noqa: E402
from labkit.parallel.pipeline import PipelineStage, build_stage, gpipe, one_f_one_b, run_schedule, zb_h1  # noqa: E402

TOLERANCE = 1e-4
M, MICRO_BATCH, SEQUENCE = 8, 4, 256


def _timed(fn, device: torch.device, steps: int = 5, warmup: int = 2) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for step in range(warmup + steps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def pipeline_paths(device_type: str = "cuda") -> dict:
    """On the one rank: every schedule's gradients and step time beside the plain model (``"cpu"`` to try the
    script without a GPU, on gloo)."""
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    config = GPTConfig.preset("10m", tie_weights=False)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (M * MICRO_BATCH, SEQUENCE + 1), generator=generator).to(device)
    ids, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    plain = TinyGPT(config, 0).to(device)

    def accumulate() -> None:
        for x, y in zip(ids.chunk(M), targets.chunk(M), strict=True):
            (plain(x, y)[1] / M).backward()

    accumulate()
    reference = {name: parameter.grad.clone() for name, parameter in plain.named_parameters()}
    report = {"plain ms": 1e3 * _timed(lambda: (plain.zero_grad(), accumulate()), device)}
    for schedule in (gpipe(1, M), one_f_one_b(1, M), zb_h1(1, M)):
        stage = PipelineStage(build_stage(config, 0, 0, 1).to(device), 0, 1, micro_batch_size=MICRO_BATCH,
                              seq_len=SEQUENCE, num_microbatches=M)
        run = run_schedule(schedule, [stage], ids, targets)
        worst = max(((parameter.grad - reference[name]).abs().max() / reference[name].abs().max()).item()
                    for name, parameter in stage.module.named_parameters())
        def step(stage: PipelineStage = stage, schedule=schedule) -> None:
            stage.module.zero_grad()
            run_schedule(schedule, [stage], ids, targets, timeline=False)

        step_ms = 1e3 * _timed(step, device)
        report[schedule.name] = {"worst": worst, "ms": step_ms, "actions": len(run.timeline.events[0]),
                                 "peak": run.timeline.peak_activations[0], "loss": run.loss}
    return report


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check_pipeline: no CUDA device visible; nothing to check here")
        return 1
    print(f"\n4. Pipeline runtime on cuda:0 through NCCL, p = 1, TinyGPT 10m (untied), m = {M} micro-batches of "
          f"{MICRO_BATCH} x {SEQUENCE} tokens")
    try:
        report = launch.launch(pipeline_paths, nprocs=1, backend="nccl", timeout=300)[0]
    except launch.LaunchError as error:
        print(f"BROKEN: {error}")
        return 1
    print(f"plain model, gradient accumulation over {M}: {report['plain ms']:.1f} ms/step")
    print(f"{'schedule':<8} {'ms/step':>8} {'vs plain':>8} {'grad diff':>10} {'actions':>7} {'peak held':>9}")
    broken = []
    for name in ("GPipe", "1F1B", "ZB-H1"):
        row = report[name]
        print(f"{name:<8} {row['ms']:>8.1f} {row['ms'] / report['plain ms']:>7.2f}x {row['worst']:>10.1e} "
              f"{row['actions']:>7} {row['peak']:>9}")
        if not row["worst"] <= TOLERANCE:
            broken.append(f"{name}: gradients differ from the plain model by {row['worst']:.1e} (> {TOLERANCE})")
    for problem in broken:
        print(f"BROKEN: {problem}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
