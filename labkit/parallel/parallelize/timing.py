"""Time 3D layouts on launched ranks: what lesson 11's predictions are held to on this machine.

:func:`time_layouts` launches ``dp x tp x pp`` ranks once (gloo on a CPU, one thread each) and, for each layout
in turn, builds :func:`labkit.parallel.parallelize.parallelize` of one ``TinyGPT`` and times training steps the
way ``labkit.train`` runs them: fp32, DDP over dp, 1F1B over ``2 pp`` micro-batches (one without a pipeline),
the data-parallel reduction after the schedule, AdamW.  A step's time is the slowest rank's (a barrier before
each); the median over ``steps`` after two warm-up steps is reported, with one traced step split into its parts
(:func:`step_breakdown`, the mean over ranks) and the bytes each dimension's
collectives moved.  ``benchmarks/bench_3d.py`` and notebook 11 both call it.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from labkit import trace
from labkit.data import MarkovChain, batches
from labkit.launch import launch
from labkit.mesh import Mesh
from labkit.models import GPTConfig, TinyGPT
from labkit.parallel.parallelize.model import parallelize

PARTS = ("compute", "tp communication", "bubble", "dp reduction", "optimizer", "other")
_ACTION = re.compile(r"\d+[FBIW]\d+")  # a pipeline action's span: stage, kind, micro-batch (e.g. 1B3)
_TP_COLLECTIVES = ("all_reduce ", "all_gather ", "reduce_scatter ")  # tensor parallelism's f and g


def step_breakdown(spans: Sequence[trace.Span]) -> dict[int, dict[str, float]]:
    """Per rank, the seconds of one traced step (``labkit.train --trace``, or :func:`labkit.trace.gather` around
    :meth:`Parallel3D.forward_backward` and the optimizer step), split into :data:`PARTS`:

    - ``compute``: the pipeline's F/B/I/W actions, less the tensor-parallel collectives inside them;
    - ``tp communication``: those collectives (``f`` and ``g``, all-reduces, on the critical path);
    - ``bubble``: the waits for a neighbouring stage's activation or gradient;
    - ``dp reduction``: the data-parallel reduction after the schedule, or, overlapped with the last backward
      (one stage per rank), the wait for it that DDP records at that backward's end; ``optimizer``: its step;
    - ``other``: the rest of the step (from the rank's first span to its last): sends, Python, gathers.
    """
    by_rank: dict[int, list[trace.Span]] = {}
    for span in spans:
        by_rank.setdefault(span.rank, []).append(span)
    result = {}
    for rank, mine in sorted(by_rank.items()):
        actions = [s for s in mine if s.kind == "compute" and _ACTION.fullmatch(s.name)]

        def within(span: trace.Span, actions: list[trace.Span] = actions) -> bool:
            return any(a.start_s <= span.start_s and span.end_s <= a.end_s for a in actions)

        inside = [s for s in mine if s.kind == "comm" and s.name.startswith(_TP_COLLECTIVES) and within(s)]
        # DP's wait at the end of an overlapped last backward (DDP records it) sits inside that action too
        waits = [s for s in mine if s.kind == "idle" and s.name == "wait for gradients" and within(s)]
        parts = {"compute": sum(a.seconds for a in actions) - sum(s.seconds for s in inside + waits),
                 "tp communication": sum(s.seconds for s in inside),
                 "bubble": sum(s.seconds for s in mine if s.kind == "bubble"),
                 "dp reduction": sum(s.seconds for s in mine if s.kind == "comm" and s.name.startswith("dp "))
                 + sum(s.seconds for s in waits),
                 "optimizer": sum(s.seconds for s in mine if s.kind == "compute" and s.name == "optimizer step")}
        step = max(s.end_s for s in mine) - min(s.start_s for s in mine)
        parts["other"] = max(0.0, step - sum(parts.values()))
        parts["step"] = step
        result[rank] = parts
    return result


LR = 3e-4


@dataclass(frozen=True)
class LayoutTiming:
    """One layout's measured step: its degrees, micro-batches, median seconds, the traced step's parts (mean over
    ranks, seconds) and the bytes per step each dimension's collectives sent (mean over ranks)."""

    dp: int
    tp: int
    pp: int
    global_batch: int
    microbatches: int
    median_s: float
    steps_s: tuple[float, ...]
    parts: dict[str, float]
    sent_bytes: dict[str, float]

    @property
    def label(self) -> str:
        return f"{self.dp}x{self.tp}x{self.pp}"

    @property
    def micro_batch(self) -> int:
        """Sequences per micro-batch of the run that gave this timing (``global_batch`` over ``dp`` and ``m``)."""
        return self.global_batch // (self.dp * self.microbatches)


def microbatches_for(pp: int) -> int:
    """``2 pp`` micro-batches with a pipeline (the bubble below a third), one without."""
    return 2 * pp if pp > 1 else 1


def step_batch(config: GPTConfig, global_batch: int, dp: int, dp_rank: int, step: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """This replica's rows of step ``step``'s global batch (the same data for every layout)."""
    generator = torch.Generator().manual_seed(step)
    tokens = MarkovChain(seed=0).sample(20_000, seed=0)
    x, y = batches(tokens, global_batch, config.block_size, generator)
    rows = slice(dp_rank * global_batch // dp, (dp_rank + 1) * global_batch // dp)
    return x[rows], y[rows]


def slowest_rank_seconds(fn, *args) -> float:
    """The slowest rank's seconds for ``fn(*args)``, every rank starting together (a barrier first)."""
    dist.barrier()
    start = time.perf_counter()
    fn(*args)
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _time_one(config: GPTConfig, dp: int, tp: int, pp: int, steps: int, global_batch: int) -> LayoutTiming | None:
    mesh = Mesh(dp=dp, tp=tp, pp=pp)
    micro = microbatches_for(pp)
    model = parallelize(TinyGPT(config, seed=0), mesh, microbatches=micro,
                        micro_batch_size=global_batch // dp // micro, seq_len=config.block_size)
    optimizer = model.make_optimizer(torch.optim.AdamW, lr=LR)

    def step_of(step: int) -> None:
        x, y = step_batch(config, global_batch, dp, mesh.rank("dp"), step)
        optimizer.zero_grad(set_to_none=True)
        model.forward_backward(x, y)
        with trace.span("optimizer step", "compute"):
            optimizer.step()

    times = [slowest_rank_seconds(step_of, step) for step in range(steps + 2)][2:]
    trace.enable(coords=mesh)
    step_of(steps + 2)
    spans = trace.gather()
    trace.disable()
    sent: list = [None] * dist.get_world_size()
    dist.all_gather_object(sent, model.communication_per_step())
    if dist.get_rank() != 0:
        return None
    parts = step_breakdown(spans)
    mean = {part: statistics.mean(p[part] for p in parts.values()) for part in (*PARTS, "step")}
    kinds = sorted({kind for per_rank in sent for kind in per_rank})
    return LayoutTiming(dp, tp, pp, global_batch, micro, statistics.median(times), tuple(times), mean,
                        {kind: statistics.mean(r.get(kind, 0) for r in sent) for kind in kinds})


def _time_all(config: GPTConfig, layouts: Sequence[tuple[int, int, int]], steps: int, global_batch: int,
              progress: bool) -> list[LayoutTiming | None]:
    torch.set_num_threads(1)
    results = []
    for dp, tp, pp in layouts:
        results.append(_time_one(config, dp, tp, pp, steps, global_batch))
        if progress and dist.get_rank() == 0:
            print(f"  {dp}x{tp}x{pp}: {1e3 * results[-1].median_s:.0f} ms per step", flush=True)
    return results


def time_layouts(config: GPTConfig, layouts: Sequence[tuple[int, int, int]], steps: int = 5,
                 global_batch: int = 32, progress: bool = False, timeout: float = 1800.0) -> list[LayoutTiming]:
    """Time each ``(dp, tp, pp)`` of ``layouts`` (all on the same ``dp * tp * pp`` ranks) for ``steps`` steps
    after two warm-up steps; see the module docstring.  ``progress`` prints each layout's median as it ends."""
    if not layouts:
        raise ValueError("time_layouts needs at least one (dp, tp, pp) layout")
    sizes = {dp * tp * pp for dp, tp, pp in layouts}
    if len(sizes) != 1:
        raise ValueError(f"every layout must use the same number of ranks, got {sorted(sizes)} for {list(layouts)}")
    for dp, tp, pp in layouts:
        micro = microbatches_for(pp)
        if global_batch % (dp * micro):
            raise ValueError(f"global_batch={global_batch} does not split into dp={dp} replicas of {micro} "
                             f"micro-batches (layout {dp}x{tp}x{pp})")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps!r}")
    return launch(_time_all, config, list(layouts), steps, global_batch, progress, nprocs=sizes.pop(),
                  timeout=timeout, rank_output="none")[0]
