"""Back-of-the-envelope models of training cost: how much compute and memory a model needs.

Lesson 00 starts here, with the two reasons training is distributed at all:

- **Memory.** Training with Adam in mixed precision keeps, per parameter, 2 bytes of bf16/fp16 weights, 2 bytes
  of gradients and 12 bytes of optimizer state (fp32 master weights, momentum, variance): **16 bytes per
  parameter** before a single activation.  A 7B-parameter model needs 112 GB; the largest GPUs hold 80-141 GB.
- **Time.** A transformer's forward and backward pass cost about **6 FLOPs per parameter per token** (2 for the
  forward multiply-add, 4 for the backward), so training on D tokens costs ``6 N D`` FLOPs.  A GPU delivers
  its peak only in part: the *model FLOPs utilisation* (MFU) of good large-scale runs is 35-55 %.

So ``time = 6 N D / (GPUs x peak x MFU)`` — and the rest of the course is about keeping MFU high while the
GPUs count grows.  (``labkit.costmodel.memory`` has the full memory model, ``labkit.costmodel.step`` the
time of one step.)
"""

from __future__ import annotations

from dataclasses import dataclass

SECONDS_PER_DAY = 86_400.0
BYTES_PER_PARAMETER_MIXED_ADAM = 16  # 2 (bf16 weights) + 2 (bf16 gradients) + 12 (fp32 master, m, v)


@dataclass(frozen=True)
class GPU:
    """A GPU's memory and dense bf16 peak (vendor datasheet figures, without sparsity)."""

    name: str
    memory_bytes: float
    peak_bf16_flops: float


GPUS = {
    "V100 32GB": GPU("V100 32GB", 32e9, 125e12),
    "A100 80GB": GPU("A100 80GB", 80e9, 312e12),
    "H100 80GB": GPU("H100 80GB", 80e9, 989e12),
    "H200 141GB": GPU("H200 141GB", 141e9, 989e12),
}


def training_flops(parameters: float, tokens: float) -> float:
    """FLOPs to train a dense transformer with ``parameters`` on ``tokens``: about 6 N D."""
    if parameters <= 0 or tokens <= 0:
        raise ValueError(f"parameters and tokens must be positive, got {parameters!r} and {tokens!r}")
    return 6.0 * parameters * tokens


def training_time_seconds(parameters: float, tokens: float, gpus: int, peak_flops_per_gpu: float,
                          utilization: float = 0.4) -> float:
    """Wall-clock seconds for ``training_flops`` on ``gpus`` GPUs running at ``utilization`` of their peak.

    This is the ideal: it assumes communication is perfectly hidden, which later lessons show is the hard part.
    """
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus!r}")
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    return training_flops(parameters, tokens) / (gpus * peak_flops_per_gpu * utilization)


def model_state_bytes(parameters: float, bytes_per_parameter: float = BYTES_PER_PARAMETER_MIXED_ADAM) -> float:
    """Bytes of weights + gradients + optimizer state, before activations (16 B/param for mixed-precision Adam)."""
    if parameters <= 0:
        raise ValueError(f"parameters must be positive, got {parameters!r}")
    return parameters * bytes_per_parameter
