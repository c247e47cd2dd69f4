"""``python -m labkit.train`` / ``torchrun -m labkit.train``: one trainer, every strategy chosen by a flag.

- ``config``: :class:`TrainConfig`, its checks and the command line's flags (everything that runs before any
  process starts);
- ``loop``: the model built and wrapped once (:data:`STRATEGIES`, or a 3D mesh), then the training loop on the
  wrapper contract alone (:func:`train`, :func:`main`);
- ``report``: the progress line, a failure named by rank, the checkpoint to resume from, a step's model FLOPs.
"""

from labkit.train.config import MODELS, PRECISIONS, TrainConfig, parse_arguments
from labkit.train.loop import STRATEGIES, build, main, train
from labkit.train.report import model_flops

__all__ = ["MODELS", "PRECISIONS", "STRATEGIES", "TrainConfig", "build", "main", "model_flops", "parse_arguments",
           "train"]
