"""How ``python -m labkit.train`` reports its progress (one line on rank 0 with every rank's loss) and what went wrong: a failure as one line naming the rank and the error (its
traceback kept in a file, or printed with ``--traceback``) and the checkpoint to resume from; a stop by a signal;
what a save killed mid-write left behind, removed.  The trainer is :mod:`labkit.train`."""

from __future__ import annotations

import os
import re
import signal
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist

from labkit import checkpoint, dist, launch
from labkit.costmodel.compute import model_flops_per_step
from labkit.costmodel.shapes import TransformerShape
from labkit.parallel.experts.layer import moe_layers
from labkit.train.config import MiB, TrainConfig


class Stopped(Exception):
    """A signal asked the trainer to stop (``SIGTERM``: a scheduler's, ``kill``'s, torchrun's)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def stop(signum: int, _frame: Any) -> None:
    raise Stopped(signum)


def remove_stale_partial_files(directory: str) -> None:
    """Delete what saves killed mid-write left in ``directory`` (a temporary file whose writer is gone), and say so."""
    for path, size in checkpoint.remove_stale_partial_files(directory):
        print(f"labkit.train: removed {path} ({size / MiB:.1f} MiB), left by a save whose process was killed "
              "while it wrote", flush=True)


def last_checkpoint(config: TrainConfig) -> str:
    """Where a stopped or failed run can continue from, as the end of its message."""
    if config.checkpoint_dir is None:
        return " (no --checkpoint-dir: nothing was saved)"
    newest = checkpoint.latest(config.checkpoint_dir)
    if newest is None:
        return f"; no checkpoint finished in {config.checkpoint_dir} yet"
    return f"; the last checkpoint is {newest} (--resume latest continues from it)"


_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w]*\.)*(?P<name>[A-Za-z_]\w*(?:Error|Exception|Failed|Timeout|Exit))"
                             r"(?::\s*(?P<message>.*))?$")


def headline(text: str) -> str:
    """A traceback's exception as one line (``CheckpointError: ...``, the module path left out), or the text's last
    line where it is not a traceback (``the process was killed by SIGKILL ...``)."""
    lines = [line.rstrip() for line in text.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        match = _EXCEPTION_LINE.match(line)
        if match:
            return match["name"] + (f": {match['message']}" if match["message"] else "")
    return lines[-1].strip() if lines else "no message"


def failure(config: TrainConfig, error: Exception) -> str:
    """One line naming the rank and the problem; the full traceback printed (``--traceback``) or kept in a file."""
    others = ""
    if isinstance(error, launch.RankFailed):
        rank, text = error.rank, error.remote_traceback
        others = f"rank(s) {', '.join(map(str, error.also_failed))} failed too; " if error.also_failed else ""
        who = f"rank {rank}"
    else:
        rank, text = dist.rank(), "".join(traceback.format_exception(error))
        who = f"rank {rank}" if dist.is_initialized() or dist.in_torchrun() else "the run"
    problem = headline(text)
    line = f"labkit.train: {who} failed: {problem}"
    resume = "" if problem.startswith("CheckpointError") else last_checkpoint(config)  # not that checkpoint
    if config.traceback or len(text.strip().splitlines()) == 1:  # nothing more to keep (a killed rank)
        shown = f"{text.rstrip()}\n" if config.traceback else ""
        return f"{shown}{line}" + (f" ({others.removesuffix('; ')})" if others else "") + resume
    folder = Path(config.log_dir) if config.log_dir is not None else Path(tempfile.gettempdir())
    kept = folder / f"labkit-train-{os.getpid()}-rank-{rank}.traceback"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        kept.write_text(text)
        where = f"its traceback: {kept}"
    except OSError:
        where = "--traceback prints its traceback"
    return f"{line} ({others}{where}){resume}"


def moe_summary(module: torch.nn.Module) -> str:
    """What this rank's MoE layers did in their last forward pass: the share of the choices the capacity dropped
    and the busiest expert's load over the mean (the worst layer); "" without MoE layers."""
    layers = [layer.last for layer in moe_layers(module) if layer.last]
    if not layers:
        return ""
    choices = sum(int(last["assigned"].sum()) for last in layers)
    dropped = sum(last["dropped"] for last in layers) / max(1, choices)
    busiest = max(float(last["assigned"].max()) / float(last["assigned"].float().mean()) for last in layers)
    return f"MoE: {dropped:.1%} of the choices dropped, busiest expert {busiest:.2f}x the mean"


def log_progress(step: int, start: int, config: TrainConfig, loss: torch.Tensor, floor: float | None, elapsed: float,
                 communication: dict[str, int], extra: str = "") -> None:
    """Gather every rank's loss to rank 0 and print one progress line there (``elapsed``: seconds since the
    run, or its resume at step ``start``, began; ``extra``: rank 0's own note, e.g. :func:`moe_summary`)."""
    if dist.is_initialized():
        losses = [torch.zeros_like(loss) for _ in range(dist.world_size())]
        torch_dist.all_gather(losses, loss)
    else:
        losses = [loss]
    if dist.is_main():
        print(progress_line(step, start, config.steps, [value.item() for value in losses], floor, elapsed,
                            communication, extra), flush=True)


def progress_line(step: int, start: int, steps: int, losses: list[float], floor: float | None, elapsed: float,
                  communication: dict[str, int], extra: str = "") -> str:
    """The progress line of ``step`` (of ``steps``; this run began, or resumed, at ``start``): the mean of the
    ranks' ``losses`` and its distance to the loss ``floor``, each rank's loss, the bytes sent per step, and the
    time per step since the start (``elapsed`` seconds over ``step - start`` steps)."""
    done = step / steps
    bar = "#" * round(20 * done) + "." * (20 - round(20 * done))
    mean = sum(losses) / len(losses)
    gap = ""
    if floor is not None:
        # The floor is the loss's expectation under the best model; one batch's loss scatters around its own
        # expectation, so a batch can land below it: noise, not a model better than the best.
        gap = (f", {mean - floor:+.3f} above the floor" if mean >= floor
               else f", {floor - mean:.3f} below the floor (one batch's noise)")
    per_rank = " ".join(f"{value:.3f}" for value in losses) if len(losses) > 1 else ""
    sent = ", ".join(f"{kind} {nbytes / MiB:.2f}" for kind, nbytes in sorted(communication.items()))
    return (f"[{bar}] step {step:>5}/{steps} loss {mean:.4f}{gap}"
            + (f" | per rank: {per_rank}" if per_rank else "")
            + (f" | MiB/step: {sent}" if sent else "")
            + (f" | {extra}" if extra else "")
            + f" | {1e3 * elapsed / max(1, step - start):.1f} ms/step")


def model_flops(config: TrainConfig) -> float:
    """The model FLOPs of one step of one data-parallel rank's batch (forward and backward, no recomputation), as
    MFU counts them: TinyGPT's by :func:`labkit.costmodel.compute.model_flops_per_step` (Narayanan et al.'s count,
    the active experts of an MoE block included), TinyMLP's 6 FLOPs per weight per sample."""
    if config.model != "tiny-gpt":
        weights = sum(parameter.numel() for name, parameter in config.meta_model().named_parameters()
                      if name.endswith("weight"))
        return 6.0 * weights * config.batch_size
    return model_flops_per_step(TransformerShape.from_gpt_config(config.gpt_config()), config.batch_size)
