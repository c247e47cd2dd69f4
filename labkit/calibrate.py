"""Measure this machine's constants for lesson 11's predictions (``labkit doctor``, notebook 11, bench_3d).

:func:`calibrate` times, on this machine and in the conditions of the runs it will predict (gloo ranks, one
thread each), what :class:`labkit.costmodel.calibration.Calibration` holds:

- **compute**: one rank's forward and backward of a ``TinyGPT`` on one thread, at several micro-batch sizes and
  at two depths (the preset's layers, and one), fitted by least squares as
  ``seconds = FLOPs / flops + 3 (layers * layer_overhead_s + pass_overhead_s)``: the FLOP rate of the matrices,
  the fixed cost of each layer's operations, and that of a pass whatever its layers (embedding, loss, autograd's
  start), which a pipeline stage of one layer pays in full;
- **processor sharing**: ``n`` ranks running the same forward and backward at once (n = 1, 2, 4, 8, up and down
  again), as cores' worth of compute they get together, and how much longer than their mean the slowest of
  ``g`` of them takes when all start together (``straggle``);
- **links**: the gloo ring step's alpha-beta with every rank sending at once, and an all-reduce between pairs
  of ranks while every rank computes around it (as tensor parallelism's are); each held below the rate at which
  one thread copies the largest message (``copy_bytes_per_s``, :func:`labkit.measure.measure_copy_bandwidth`);
- **optimizer**: AdamW's step, seconds per parameter.

A link's fit reads its bandwidth off the slope of time against message size, and on 8 ranks sharing 2 cores
the noise can flatten that slope: a fit once read a 437 GB/s gloo link on a machine that copies memory at 8.7
GB/s, and lesson 11's 30 % gate on the 3D predictions could then pass through a wrong constant.  A loopback send
copies each byte at least twice (sender to kernel, kernel to receiver), so it cannot beat one copy: a fit faster
than the copy, or one whose times do not grow with the size, is measured again (``ATTEMPTS`` times in all, each
refusal a warning), each time with a message ``GROWTH`` times the largest added, whose bandwidth term stands
that much higher above the scheduler's noise (the ceiling, a copy of the first largest message, in cache, is
then looser but still a bound: larger copies are no faster); a calibration whose links never come out
physical raises ``ValueError`` rather than save a constant known to be wrong.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable

import numpy
import torch
import torch.distributed as torch_dist

from labkit.costmodel.calibration import Calibration
from labkit.costmodel.collectives import LinkModel, fit_alpha_beta
from labkit.costmodel.compute import model_flops_per_step
from labkit.costmodel.shapes import TransformerShape
from labkit.launch import launch
from labkit.measure import measure_alpha_beta, measure_copy_bandwidth, time_step
from labkit.models import GPTConfig, TinyGPT

# How many times a link is measured before a fit above the copy bandwidth (or a flat one) is refused for good.
ATTEMPTS = 3
# Each new measurement adds a message this many times the largest before: on a busy machine a flat fit means the
# scheduler's noise (milliseconds on 2 cores shared by 8 ranks and a browser) outweighs the largest message's
# bandwidth term, and a message 8 times larger lifts that term 8 times above it.
GROWTH = 8


def _until_physical(measure: Callable[[tuple[int, ...]], LinkModel], sizes: tuple[int, ...],
                    refused: list[str]) -> LinkModel | None:
    """``measure(sizes)`` again while its fit is refused (every rank fits the same times, so all retry
    together), ``ATTEMPTS`` times at most, each time with one message ``GROWTH`` times the largest so far added
    to ``sizes``; each refusal's message is kept in ``refused``; ``None`` if all were refused."""
    for _ in range(ATTEMPTS):
        try:
            return measure(sizes)
        except ValueError as error:
            refused.append(str(error))
            sizes = (*sizes, GROWTH * max(sizes))
    return None


def _loaded_all_reduce(sizes: tuple[int, ...], a: torch.Tensor, b: torch.Tensor, repeats: int,
                       pair: torch_dist.ProcessGroup | None, ceiling: float) -> LinkModel:
    """An all-reduce among pairs while every rank computes between them (as tensor parallelism does): its cost
    is the loop's time beyond the same loop without it (``sizes[0] == 0``), warmed up, the sizes interleaved
    over three rounds, each rank's medians averaged over the ranks (so every rank fits the same times)."""
    loops: dict[int, list[float]] = {nbytes: [] for nbytes in sizes}
    for round_ in range(4):
        for nbytes in sizes:
            message = torch.zeros(max(1, nbytes // 4))
            torch_dist.barrier()
            start = time.perf_counter()
            for _ in range(4 * repeats):
                torch.mm(a, b)
                if nbytes and pair is not None:
                    torch_dist.all_reduce(message, group=pair)
            if round_:  # the first round warms up
                loops[nbytes].append((time.perf_counter() - start) / (4 * repeats))
    torch_dist.barrier()
    baseline = statistics.median(loops[0])
    extra = torch.tensor([statistics.median(loops[n]) - baseline for n in sizes[1:]], dtype=torch.float64)
    torch_dist.all_reduce(extra)
    extra /= torch_dist.get_world_size()
    return fit_alpha_beta(list(sizes[1:]), [max(1e-9, float(e)) for e in extra], ceiling)


def _calibration_job(link_sizes: tuple[int, ...], preset: str, micro_batch: int, repeats: int,
                     ceiling: float) -> dict:
    """On each launched rank: the ring step's alpha-beta, the compute curve, the stragglers, the loaded
    all-reduce; each link below ``ceiling`` bytes per second (measured again while it is not)."""
    torch.set_num_threads(1)
    rank, world = torch_dist.get_rank(), torch_dist.get_world_size()
    refused: list[str] = []
    ring = _until_physical(lambda sizes: measure_alpha_beta(sizes, iterations=5, pattern="ring",
                                                            max_bandwidth_bytes_per_s=ceiling), link_sizes, refused)
    # compute: n ranks run the same forward+backward at once while the others wait in a barrier (asleep)
    config = GPTConfig.preset(preset, tie_weights=False)
    model = TinyGPT(config, seed=0)
    x = torch.randint(0, config.vocab_size, (micro_batch, config.block_size))
    levels = sorted({n for n in (1, 2, 4, 8, 16, 32) if n < world} | {world})
    samples: dict[int, list[float]] = {n: [] for n in levels}
    for n in levels + levels[::-1]:  # up and down again: a drift in the machine's load shows in both
        torch_dist.barrier()
        seconds = torch.zeros(1)
        if rank < n:
            seconds[0] = time_step(model, lambda net: net(x, x)[1], repeats=repeats, warmup=1)
        torch_dist.barrier()
        torch_dist.all_reduce(seconds)
        samples[n].append(seconds.item() / n)
    curve = {n: statistics.fmean(values) for n, values in samples.items()}
    rounds = []  # the slowest of the ranks: all run one forward+backward, started together, 2 * repeats times
    for _ in range(2 * repeats):
        model.zero_grad(set_to_none=True)
        torch_dist.barrier()
        start = time.perf_counter()
        model(x, x)[1].backward()
        mine, everyone = torch.tensor([time.perf_counter() - start]), [torch.zeros(1) for _ in range(world)]
        torch_dist.all_gather(everyone, mine)
        rounds.append([float(seconds) for seconds in everyone])
    pairs = [torch_dist.new_group([2 * k, 2 * k + 1]) for k in range(world // 2)]
    pair = pairs[rank // 2] if rank < 2 * len(pairs) else None
    a, b = torch.randn(4 * config.block_size, config.n_embd), torch.randn(config.n_embd, 4 * config.n_embd)
    # the largest two sizes: tensor parallelism's activations are 0.1 to a few MB
    loaded = _until_physical(lambda sizes: _loaded_all_reduce((0, *sizes), a, b, repeats, pair, ceiling),
                             link_sizes[-2:], refused)
    return {"ring": ring, "curve": curve, "rounds": rounds, "loaded": loaded, "refused": refused}


def _fit_compute(config: GPTConfig, micro_batches: tuple[int, ...], repeats: int,
                 say: Callable[[str], None]) -> tuple[float, float, float]:
    """``(flops, layer_overhead_s, pass_overhead_s)`` from forward+backward timings at each micro-batch size, on
    ``config``'s depth and on one layer (least squares; the overheads held at zero or more)."""
    rows, seconds = [], []
    for layers in sorted({config.n_layer, 1}, reverse=True):
        shallow = dataclasses.replace(config, n_layer=layers)
        shape, model = TransformerShape.from_gpt_config(shallow), TinyGPT(shallow, seed=0)
        for size in micro_batches:
            x = torch.randint(0, config.vocab_size, (size, config.block_size))
            seconds.append(time_step(model, lambda net, x=x: net(x, x)[1], repeats=repeats, warmup=2))
            rows.append((model_flops_per_step(shape, size), 3 * layers, 3))
            say(f"compute: {layers} layer(s), micro-batch {size}: {1e3 * seconds[-1]:.1f} ms forward+backward")
    design = numpy.array(rows, dtype=float)
    scale = design.max(axis=0)  # columns of comparable size for the solver
    solution = numpy.linalg.lstsq(design / scale, numpy.array(seconds), rcond=None)[0] / scale
    per_flop, per_layer, per_pass = (float(value) for value in solution)
    if per_layer < 0 or per_pass < 0:  # a noisy fit: keep the rate, put the fixed cost where it is positive
        keep = 1 if per_layer >= per_pass else 2
        columns = design[:, [0, keep]]
        per_flop, fixed = (float(v) for v in numpy.linalg.lstsq(columns, numpy.array(seconds), rcond=None)[0])
        per_layer, per_pass = (max(0.0, fixed), 0.0) if keep == 1 else (0.0, max(0.0, fixed))
    return 1 / max(per_flop, 1e-15), per_layer, per_pass


# ``labkit doctor --quick``: two micro-batch sizes (the fewest the fit takes) and two repeats of each timing, a
# third of the time, and noisier constants (the medians are of fewer samples).
QUICK = {"micro_batches": (1, 4), "repeats": 2}


def calibrate(preset: str = "1m", micro_batches: tuple[int, ...] = (1, 2, 4, 8), ranks: int = 8,
              link_sizes: tuple[int, ...] = (8, 1 << 14, 1 << 17, 1 << 20), repeats: int = 5,
              progress: Callable[[str], None] | None = None) -> Calibration:
    """Measure this machine's :class:`~labkit.costmodel.calibration.Calibration` (see the module docstring) with
    ``TinyGPT(GPTConfig.preset(preset))`` and ``ranks`` launched gloo ranks; ``progress`` gets a line per
    measurement.  Takes about half a minute on 2 cores."""
    if len(set(micro_batches)) < 2 or min(micro_batches) < 1:
        raise ValueError(f"micro_batches needs two or more distinct sizes >= 1, got {micro_batches!r}")
    if ranks < 2:
        raise ValueError(f"ranks must be >= 2 to measure a link, got {ranks!r}")
    say = progress or (lambda text: None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config = GPTConfig.preset(preset, tie_weights=False)
        flops, layer_overhead, pass_overhead = _fit_compute(config, micro_batches, repeats, say)
        model = TinyGPT(config, seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for parameter in model.parameters():
            parameter.grad = torch.zeros_like(parameter)
        stamps = [time.perf_counter()] + [optimizer.step() or time.perf_counter() for _ in range(repeats + 1)]
        steps = numpy.diff(stamps).tolist()
        parameters = sum(parameter.numel() for parameter in model.parameters())
        say(f"optimizer: AdamW {1e3 * statistics.median(steps[1:]):.1f} ms for {parameters:,} parameters")
        copy = measure_copy_bandwidth(max(link_sizes), repeats=2 * repeats + 1)
        say(f"memory: one thread copies a {max(link_sizes):,}-byte message at {copy / 1e9:.1f} GB/s, the ceiling "
            "on the links (a loopback send copies each byte at least twice)")
    finally:
        torch.set_num_threads(threads)
    say(f"compute: {ranks} ranks at once (micro-batch {micro_batches[len(micro_batches) // 2]}) ...")
    job = launch(_calibration_job, link_sizes, preset, micro_batches[len(micro_batches) // 2], repeats, copy,
                 nprocs=ranks, backend="gloo", timeout=300.0, rank_output="none")[0]
    for refusal in job["refused"]:
        say(f"links: REFUSED, measured again: {refusal}")
        warnings.warn(f"calibrate: a link's fit was refused and the link measured again: {refusal}", stacklevel=2)
    if job["ring"] is None or job["loaded"] is None:
        raise ValueError(f"the gloo links' fit stayed unphysical after {ATTEMPTS} measurements (one thread copies "
                         f"{copy / 1e9:.1f} GB/s, which no loopback send can beat); the last refusal: "
                         f"{job['refused'][-1]}")
    ring, loaded, curve = job["ring"], job["loaded"], job["curve"]
    levels = sorted(curve)
    measured = {n: n * curve[1] / curve[n] for n in levels}  # cores' worth of compute n busy ranks get
    throughput = numpy.interp(range(1, ranks + 1), levels, [measured[n] for n in levels]).tolist()
    say("compute: " + ", ".join(f"{n} ranks get {measured[n]:.2f} cores" for n in levels))
    straggle = [statistics.fmean(max(times[k:k + g]) / statistics.fmean(times) for times in job["rounds"]
                                 for k in range(0, ranks - g + 1, g)) for g in range(1, ranks + 1)]
    say("compute: the slowest of g ranks over their mean: " + ", ".join(
        f"g={g} {straggle[g - 1]:.2f}x" for g in (2, 4, ranks) if g <= ranks))
    say(f"links: gloo ring step over {ranks} ranks: alpha {1e6 * ring.alpha_s:.0f} us, "
        f"{ring.bandwidth_bytes_per_s / 1e9:.2f} GB/s; "
        f"an all-reduce of 2 ranks among {ranks} computing: alpha {1e6 * loaded.alpha_s:.0f} us, "
        f"{loaded.bandwidth_bytes_per_s / 1e9:.2f} GB/s (below the copy's {copy / 1e9:.1f} GB/s)")
    return Calibration(flops, layer_overhead, ring.alpha_s, ring.beta_s_per_byte,
                       statistics.median(steps[1:]) / parameters,
                       os.cpu_count() or 1, ranks, f"{platform.node()} ({platform.processor() or platform.machine()})",
                       loaded.alpha_s, loaded.beta_s_per_byte, tuple(throughput), tuple(straggle), pass_overhead,
                       copy_bytes_per_s=copy)
