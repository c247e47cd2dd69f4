"""What checkpointing costs, and how often to pay it (lesson 09).  Pure arithmetic, no process group.

**The size.**  A checkpoint that resumes exactly holds the model states, not just the weights: with Adam(W),
``4`` bytes per parameter of fp32 weights and ``8`` of its two moments, ``12 Psi`` for ``Psi`` parameters; mixed
precision adds nothing (the 16-bit weights are a rounding of the fp32 master weights, which are saved), so
``12 Psi`` either way, whatever the data-parallel wrapper (gradients are not saved: the next step recomputes
them).  Random states and sampler positions add kilobytes per rank.

**The time to write it.**  The *full* layout gathers everything to one rank, which writes ``12 Psi`` bytes
alone: ``C = 12 Psi / b`` at one writer's bandwidth ``b``.  The *sharded* layout lets each of ``N`` ranks write
its ``1/N`` (FSDP, ZeRO: its shard; replicated data-parallel states can be spread the same way, each piece
written once by one of the ranks that hold it, as PyTorch's DCP and Megatron-Core's fully parallel save do): ``C = 12 Psi / min(N b, B)``, until the storage's aggregate
bandwidth ``B`` is the limit.  At 70 billion parameters that is 840 GB: about 7 minutes from one writer at 2
GB/s, a few seconds from a thousand.

**How often.**  Failures strike at random, at a rate that grows with the number of GPUs: Meta reports 466 job
interruptions in a 54-day snapshot of Llama 3 405B's pre-training on 16,384 GPUs (Dubey et al. 2024, "The Llama 3
Herd of Models", section 3.3.4), 47 of them planned maintenance and 419 unexpected: one unexpected interruption
every 3.1 hours.  A planned stop can be preceded by a checkpoint, so it costs a restart but no work; the unexpected
ones set the mean time between failures ``M``.  Checkpointing every ``tau`` seconds of training costs ``C`` per
interval, a fraction ``C / tau``; a failure loses on average half an interval's work (and the restart ``R``),
``(tau / 2 + R) / M`` of the time.  The sum is smallest at Young's interval (J. W. Young 1974, "A first order
approximation to the optimum checkpoint interval")::

    tau* = sqrt(2 C M),  lost fraction at tau*  ~ sqrt(2 C / M) + R / M

first order in ``C / M``.  A 10x faster save allows checkpoints sqrt(10) ~ 3.2x more often and cuts the loss
by the same factor: this is why large jobs write sharded, asynchronous checkpoints.

**Against Llama 3.**  The same paper reports more than 90 % effective training time over those 54 days, and a
storage fabric (Tectonic) that sustains 2 TB/s for checkpoint writes (section 3.3.1).  Its 405B model's states,
``12 x 405e9`` bytes, take 2.4 s at that rate.  The paper gives no restart time: :func:`longest_restart` finds
the longest restart that still leaves a given share to training (:func:`kept_share`), and :func:`longest_write`
the longest write.

For failures that arrive as a Poisson process (during training, writing and restarts alike) the expected time
is known exactly (Daly 2006, "A higher order estimate of the optimum checkpoint interval for restart dumps"): an
interval of ``tau + C`` that must run without a failure takes ``M e^(R/M) (e^((tau+C)/M) - 1)`` on average, so
the lost share is ``1 - tau / (M e^(R/M) (e^((tau+C)/M) - 1))`` (:func:`expected_lost_fraction`), which Young's
first-order terms approach when ``tau``, ``C`` and ``R`` are small beside ``M``.  :func:`simulate_lost_fraction`
plays failures and checkpoints in time, to hold both to.
"""

from __future__ import annotations

import math
import random

BYTES_PER_PARAMETER = {"adam": 12, "momentum": 8, "sgd": 4}  # fp32 weights (or master weights) + moments
LAYOUTS = ("full", "sharded")
HOST_MEMORY_BYTES = 2e12  # one large GPU host's memory, where a full checkpoint is gathered (NVIDIA DGX H100: 2 TB)

# Llama 3 405B's pre-training (Dubey et al. 2024): 466 job interruptions in a 54-day snapshot on 16,384 GPUs, 47
# of them planned maintenance and 419 unexpected, with "higher than 90 %" effective training time (section
# 3.3.4); checkpoints go to Tectonic, which sustains 2 TB/s (7 TB/s peak; section 3.3.1).
LLAMA3_GPUS, LLAMA3_DAYS, LLAMA3_PLANNED, LLAMA3_UNEXPECTED = 16_384, 54, 47, 419
LLAMA3_EFFECTIVE_TIME = 0.90  # a lower bound: "higher than 90 %"
LLAMA3_STORAGE_BYTES_S = 2e12  # sustained
LLAMA3_SECONDS = LLAMA3_DAYS * 24 * 3600
LLAMA3_MTBF_S = LLAMA3_SECONDS / LLAMA3_UNEXPECTED  # the job's mean time between unexpected interruptions
LLAMA3_PLANNED_PER_S = LLAMA3_PLANNED / LLAMA3_SECONDS  # planned stops: a checkpoint first, then a restart
# Not one GPU's mean time between failures: the job's rate of unexpected interruptions (GPUs, but also hosts,
# network, software: GPUs are 58.7 % of them) spread over its GPUs, in GPU-years per interruption.
LLAMA3_GPU_YEARS_PER_FAILURE = LLAMA3_MTBF_S * LLAMA3_GPUS / (365.25 * 24 * 3600)


def _positive(**values: float) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a number > 0, got {value!r}")


def checkpoint_bytes(num_parameters: float, optimizer: str = "adam") -> float:
    """Bytes of the model states a checkpoint must hold to resume exactly: fp32 weights and the optimizer's
    per-parameter states (``12`` per parameter for Adam, ``8`` with momentum, ``4`` for plain SGD)."""
    if optimizer not in BYTES_PER_PARAMETER:
        raise ValueError(f"optimizer must be one of {tuple(BYTES_PER_PARAMETER)}, got {optimizer!r}")
    _positive(num_parameters=num_parameters)
    return BYTES_PER_PARAMETER[optimizer] * num_parameters


def write_seconds(size_bytes: float, writer_bandwidth: float, layout: str = "full", ranks: int = 1,
                  storage_bandwidth: float | None = None) -> float:
    """Seconds to write ``size_bytes``: one writer at ``writer_bandwidth`` bytes/s (``"full"``), or ``ranks``
    writers of ``1/ranks`` each (``"sharded"``), together at most ``storage_bandwidth`` bytes/s."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be an integer >= 1, got {ranks!r}")
    _positive(size_bytes=size_bytes, writer_bandwidth=writer_bandwidth)
    bandwidth = writer_bandwidth * (ranks if layout == "sharded" else 1)
    if storage_bandwidth is not None:
        _positive(storage_bandwidth=storage_bandwidth)
        bandwidth = min(bandwidth, storage_bandwidth)
    return size_bytes / bandwidth


def young_interval(write_s: float, mtbf_s: float) -> float:
    """Young's optimum checkpoint interval ``sqrt(2 C M)`` (seconds of training between checkpoints)."""
    _positive(write_s=write_s, mtbf_s=mtbf_s)
    return math.sqrt(2 * write_s * mtbf_s)


def lost_fraction(interval_s: float, write_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """First-order share of the wall-clock time not spent on training: writing (``C / tau``) plus the work a
    failure throws away and the restart (``(tau / 2 + R) / M``)."""
    _positive(interval_s=interval_s, write_s=write_s, mtbf_s=mtbf_s)
    if restart_s < 0:
        raise ValueError(f"restart_s must be >= 0, got {restart_s!r}")
    return write_s / interval_s + (interval_s / 2 + restart_s) / mtbf_s


def expected_lost_fraction(interval_s: float, write_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """The expected share of wall-clock time not spent on training when failures arrive as a Poisson process
    of mean gap ``mtbf_s`` (Daly 2006; exact for that model, every interval of training followed by a write)."""
    _positive(interval_s=interval_s, write_s=write_s, mtbf_s=mtbf_s)
    if restart_s < 0:
        raise ValueError(f"restart_s must be >= 0, got {restart_s!r}")
    exponent = (interval_s + write_s) / mtbf_s
    if exponent + restart_s / mtbf_s > 700:  # e^700: an interval almost never finishes between two failures
        return 1.0  # (what the formula gives in floats, without overflowing)
    per_interval = mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1(exponent)
    return 1 - interval_s / per_interval


def simulate_lost_fraction(interval_s: float, write_s: float, mtbf_s: float, restart_s: float = 0.0,
                           work_s: float | None = None, seed: int = 0) -> float:
    """Play a run that needs ``work_s`` seconds of training (default ``1000 M``), checkpointing after every
    ``interval_s`` of it (``write_s`` each), with failures arriving as a Poisson process of mean gap
    ``mtbf_s`` (during training, writing or a restart alike); a failure costs ``restart_s`` and resumes from
    the last finished checkpoint.  Returns the share of wall-clock time that was not kept training."""
    _positive(interval_s=interval_s, write_s=write_s, mtbf_s=mtbf_s)
    work_s = 1000 * mtbf_s if work_s is None else work_s
    _positive(work_s=work_s)
    chance = random.Random(seed)
    clock, saved = 0.0, 0.0  # wall-clock time, training kept by the last checkpoint
    next_failure = chance.expovariate(1 / mtbf_s)
    while saved < work_s:
        segment = min(interval_s, work_s - saved)
        # One interval: restart (if any, handled below), train the segment, then write it out.
        finish = clock + segment + (write_s if saved + segment < work_s else 0.0)
        if next_failure >= finish:
            clock, saved = finish, saved + segment
            continue
        clock = next_failure + restart_s  # the segment is lost; the restart itself may be struck again
        while True:
            next_failure = clock - restart_s + chance.expovariate(1 / mtbf_s)
            if next_failure >= clock:
                break
            clock = next_failure + restart_s
    return 1 - work_s / clock


def kept_share(write_s: float, mtbf_s: float, restart_s: float = 0.0, planned_per_s: float = 0.0) -> float:
    """The share of wall-clock time kept training when checkpointing at Young's interval: Daly's expectation for
    failures of mean gap ``mtbf_s``, less a restart for each of ``planned_per_s`` planned stops per second (each
    preceded by a checkpoint: no work lost)."""
    if planned_per_s < 0:
        raise ValueError(f"planned_per_s must be >= 0, got {planned_per_s!r}")
    return (1 - expected_lost_fraction(young_interval(write_s, mtbf_s), write_s, mtbf_s, restart_s)
            - planned_per_s * restart_s)


def _largest(kept, share: float, high: float) -> float:
    """The largest ``x`` in ``[0, high]`` with ``kept(x) >= share``, for ``kept`` decreasing (bisection)."""
    if not 0 < share < 1:
        raise ValueError(f"share must lie in (0, 1), got {share!r}")
    low = 0.0
    if kept(low) < share:
        return 0.0
    while kept(high) >= share:
        high *= 2
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if kept(middle) >= share else (low, middle)
    return low


def longest_restart(write_s: float, mtbf_s: float, share: float, planned_per_s: float = 0.0) -> float:
    """The longest restart (seconds) that still keeps ``share`` of the time training (:func:`kept_share`); 0 if
    even instant restarts keep less."""
    return _largest(lambda restart_s: kept_share(write_s, mtbf_s, restart_s, planned_per_s), share, mtbf_s)


def longest_write(restart_s: float, mtbf_s: float, share: float, planned_per_s: float = 0.0) -> float:
    """The longest checkpoint write (seconds) that still keeps ``share`` of the time training at Young's interval
    (:func:`kept_share`); 0 if even an instant write keeps less."""
    return _largest(lambda write_s: kept_share(max(write_s, 1e-12), mtbf_s, restart_s, planned_per_s), share,
                    mtbf_s)
