"""The trainer's configuration: :class:`TrainConfig`, its checks, and ``python -m labkit.train``'s flags.

Everything here runs before any process starts, so that a bad flag or a layout that cannot work (a product of
degrees that is not the world size, a tensor-parallel degree that does not divide the heads, a pipeline that
does not divide the layers, FSDP with a schedule it cannot run) is a ``ValueError`` naming the value, not a
rank that fails later.  The trainer itself is :mod:`labkit.train`.
"""

from __future__ import annotations

import argparse
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from labkit import checkpoint, dist, monitor
from labkit.costmodel.shapes import check_amount
from labkit.degrees import check_degree
from labkit.models import GPTConfig, MLPConfig, TinyGPT, TinyMLP
from labkit.parallel.parallelize import check_3d
from labkit.parallel.pipeline.catalog import SCHEDULES

STRATEGY_NAMES = ("single", "ddp", "zero1", "zero2", "fsdp")  # labkit.train.STRATEGIES' keys
MODELS = ("tiny-gpt", "tiny-mlp")
PRECISIONS = ("fp32", "bf16", "fp16")
ZERO_STAGES = (0, 1, 2, 3)
MLP_CONFIG = MLPConfig(in_features=16, hidden_sizes=(64, 64), num_classes=4)  # --model tiny-mlp
# A checkpoint's bytes per parameter: the fp32 weights and AdamW's two fp32 moments (labkit.checkpoint).
CHECKPOINT_BYTES_PER_PARAMETER = 12
MiB = 1024 * 1024


@dataclass
class TrainConfig:
    strategy: str = "single"
    model: str = "tiny-gpt"
    preset: str = "100k"
    steps: int = 200
    batch_size: int = 16  # per rank
    lr: float = 3e-3
    seed: int = 0
    bucket_cap_mb: float = 25.0
    clip_grad_norm: float | None = None
    log_every: int = 20
    checkpoint_dir: str | None = None
    save_every: int | None = None
    checkpoint_layout: str = "full"  # or "sharded": every rank writes its own shard (labkit.checkpoint)
    resume: str | None = None  # a checkpoint directory, or "latest" (the newest in checkpoint_dir)
    dp: int | None = None  # 3D parallelism (any of dp, tp, pp given): the mesh's degrees
    tp: int | None = None
    pp: int | None = None
    cp: int | None = None  # context parallelism: each sequence split over cp ranks (labkit.parallel.context)
    cp_strategy: str = "ring"  # or "all_gather" (Llama 3), "ulysses" (all-to-all)
    cp_split: str = "zigzag"  # or "contiguous" (the causal imbalance, for comparison)
    ep: int | None = None  # expert parallelism, folded over dp x cp (labkit.parallel.experts)
    experts: int = 0  # MoE: experts per block (0: dense MLPs)
    top_k: int = 2  # MoE: experts per token
    capacity_factor: float | None = None  # MoE: None drops nothing
    router: str = "softmax"  # MoE: or "sigmoid" (DeepSeek-V3)
    aux_loss_weight: float = 0.0  # MoE: Switch's load-balancing loss weight
    bias_update_rate: float = 0.0  # MoE: DeepSeek-V3's bias balancing step (0: off)
    zero: int = 0  # 3D: the data-parallel wrapper, 0 DDP, 1/2 ZeRO-1/2, 3 FSDP
    schedule: str = "1f1b"
    microbatches: int | None = None  # per step; default 2 pp (1 without a pipeline)
    virtual_stages: int = 2  # stages per rank of the interleaved schedules (zb-v and dualpipev: always 2)
    precision: str = "fp32"
    trace: str | None = None  # write a Chrome trace of the last step here
    log_dir: str | None = None  # each rank's progress in DIR/rank-R.log
    tensorboard: str | None = None  # each rank's scalars in DIR/rank-R, a TensorBoard run each (labkit.monitor)
    tensorboard_ranks: str = "every"  # or "summary": rank 0 writes DIR/min, mean and max over every rank
    alarm_every: int = 1  # the divergence alarm compares the data-parallel ranks every N steps (0: never)
    workers: int | None = None  # the input pipeline (labkit.loader): a DataLoader with this many worker processes
    data_ms: float = 0.0  # CPU time to make each sample (decoding, simulated), in milliseconds
    prefetch_factor: int = 2  # batches each worker may make ahead
    persistent_workers: bool = False  # keep the workers from one epoch to the next
    traceback: bool = False  # a failure prints its full traceback, not one line and a file

    @property
    def input_pipeline(self) -> bool:
        """Batches come through a ``DataLoader`` (``--workers`` or ``--data-ms`` given)."""
        return self.workers is not None or self.data_ms > 0

    @property
    def three_d(self) -> bool:
        return any(degree is not None for degree in (self.dp, self.tp, self.pp, self.cp, self.ep))

    def gpt_config(self) -> GPTConfig:
        """The model's config; a pipeline of several stages cannot tie the embedding to the head."""
        moe = {"n_experts": self.experts, "top_k": self.top_k, "capacity_factor": self.capacity_factor,
               "router": self.router, "aux_loss_weight": self.aux_loss_weight,
               "bias_update_rate": self.bias_update_rate} if self.experts else {}
        return GPTConfig.preset(self.preset, **({"tie_weights": False} if (self.pp or 1) > 1 else {}), **moe)

    def meta_model(self) -> torch.nn.Module:
        """The model, built on the ``meta`` device: its shapes, without memory or initialisation."""
        with torch.device("meta"):
            return TinyGPT(self.gpt_config()) if self.model == "tiny-gpt" else TinyMLP(MLP_CONFIG)

    def check_files(self, world_size: int) -> None:
        """Everything about the files a run reads and writes that can be known before it starts (``ValueError``
        naming the flag): ``--checkpoint-dir``, ``--log-dir`` and ``--trace``'s folder are directories or can be
        made, and writable; the checkpoint directory's disk holds a checkpoint; ``--resume`` is a finished
        checkpoint of this model that ``world_size`` ranks can load (:func:`labkit.checkpoint.check_compatible`)."""
        if (self.checkpoint_dir is None and self.resume is None and self.log_dir is None and self.trace is None
                and self.tensorboard is None):
            return
        model = self.meta_model()
        shapes = {name: tensor.shape for name, tensor in model.state_dict().items()}
        if self.checkpoint_dir is not None:
            size = CHECKPOINT_BYTES_PER_PARAMETER * sum(parameter.numel() for parameter in model.parameters())
            _check_output_directory("--checkpoint-dir", self.checkpoint_dir, size)
        if self.log_dir is not None:
            _check_output_directory("--log-dir", self.log_dir)
        if self.tensorboard is not None:
            _check_output_directory("--tensorboard", self.tensorboard)
        if self.trace is not None:
            if Path(self.trace).is_dir():
                raise ValueError(f"--trace {self.trace}: a directory; give the trace's file name")
            _check_output_directory("--trace's folder", str(Path(self.trace).parent))
        path = checkpoint.latest(self.checkpoint_dir) if self.resume == "latest" else self.resume
        if path is not None:
            try:
                checkpoint.check_compatible(path, shapes, world_size)
            except checkpoint.CheckpointError as error:
                raise ValueError(f"--resume {self.resume}: {error}") from None

    def default_microbatches(self) -> int:
        """``--microbatches``, or by default two per pipeline stage (1 without a pipeline)."""
        if self.microbatches is not None:
            return self.microbatches
        return 2 * self.pp if (self.pp or 1) > 1 else 1

    def resolve(self, world_size: int) -> None:
        """3D: fill in the degrees left out (1, or for dp what ``world_size`` leaves) and the micro-batches,
        then check the layout against ``world_size`` (``ValueError`` naming what does not fit)."""
        if not self.three_d:
            return
        tp, pp, cp = self.tp or 1, self.pp or 1, self.cp or 1
        for name, value in (("tp", tp), ("pp", pp), ("cp", cp), ("dp", self.dp or 1), ("ep", self.ep or 1)):
            check_degree(name, value, f"--{name}")
        if self.dp is None:
            if world_size % (tp * pp * cp):
                raise ValueError(f"--tp {tp} * --pp {pp} * --cp {cp} = {tp * pp * cp} does not divide the "
                                 f"{world_size} ranks, so no data-parallel degree fits")
            self.dp = world_size // (tp * pp * cp)
        self.tp, self.pp, self.cp, self.ep = tp, pp, cp, self.ep or 1
        self.microbatches = self.default_microbatches()
        self._check_layout(world_size)

    def _check_layout(self, world_size: int | None = None) -> None:
        config = self.gpt_config()
        check_3d(config, self.dp or 1, self.tp or 1, self.pp or 1, zero=self.zero, schedule=self.schedule,
                 microbatches=self.default_microbatches(), virtual_stages=self.virtual_stages,
                 batch_size=self.batch_size, world_size=world_size, cp=self.cp or 1, cp_strategy=self.cp_strategy,
                 cp_split=self.cp_split, seq_len=config.block_size,
                 ep=(self.ep or 1) if self.dp is not None else 1)  # ep divides dp: checked once dp is known

    def validate(self) -> None:
        """Raise ValueError naming the bad value, before any process starts."""
        if self.strategy not in STRATEGY_NAMES:
            raise ValueError(f"--strategy must be one of {STRATEGY_NAMES}, got {self.strategy!r}")
        moe_flags = (self.top_k, self.capacity_factor, self.router, self.aux_loss_weight, self.bias_update_rate)
        if not self.experts and moe_flags != (2, None, "softmax", 0.0, 0.0):
            raise ValueError("--top-k, --capacity-factor, --router, --aux-loss-weight and --bias-update-rate "
                             "configure MoE blocks: give --experts E too")
        if self.experts and self.model != "tiny-gpt":
            raise ValueError(f"--experts replaces a transformer's MLPs: use --model tiny-gpt, not {self.model}")
        if self.model == "tiny-gpt":
            self.gpt_config()  # the MoE settings' own checks (ValueError naming the value)
        if self.model not in MODELS:
            raise ValueError(f"--model must be one of {MODELS}, got {self.model!r}")
        if self.model == "tiny-gpt":
            GPTConfig.preset(self.preset)  # raises on an unknown preset
        for name in ("steps", "batch_size", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.zero not in ZERO_STAGES:
            raise ValueError(f"--zero must be one of {ZERO_STAGES} (0 DDP, 1 ZeRO-1, 2 ZeRO-2, 3 FSDP), got "
                             f"{self.zero!r}")
        if isinstance(self.alarm_every, bool) or not isinstance(self.alarm_every, int) or self.alarm_every < 0:
            raise ValueError(f"--alarm-every must be an integer >= 0 (0: no alarm), got {self.alarm_every!r}")
        if self.workers is not None and (isinstance(self.workers, bool) or not isinstance(self.workers, int)
                                         or self.workers < 0):
            raise ValueError(f"--workers must be an integer >= 0, got {self.workers!r}")
        if isinstance(self.prefetch_factor, bool) or not isinstance(self.prefetch_factor, int) or self.prefetch_factor < 1:
            raise ValueError(f"--prefetch-factor must be an integer >= 1, got {self.prefetch_factor!r}")
        if not self.workers and (self.prefetch_factor != 2 or self.persistent_workers):
            raise ValueError("--prefetch-factor and --persistent-workers need worker processes: give --workers N, "
                             "N >= 1")
        if monitor.fault_from_environment() is not None and (self.three_d or self.strategy == "single"):
            raise ValueError(f"{monitor.FAULT_VARIABLE} needs a data-parallel --strategy (ddp, zero1, zero2, fsdp)")
        if (monitor.fault_from_environment() or ("",))[0] == "nan" and self.model != "tiny-mlp":
            raise ValueError(f"{monitor.FAULT_VARIABLE}=nan writes an infinite feature: it needs --model tiny-mlp")
        if self.tensorboard_ranks not in monitor.LOG_RANKS:
            raise ValueError(f"--tensorboard-ranks must be one of {monitor.LOG_RANKS}, got {self.tensorboard_ranks!r}")
        # The numbers: finite, or an inf learning rate trains to NaN and a nan bucket size fails inside every rank.
        # --bucket-cap-mb 0 is one all-reduce a parameter; --data-ms 0 makes samples at no cost.
        for flag, value, positive in (("--lr", self.lr, True), ("--clip-grad-norm", self.clip_grad_norm, True),
                                      ("--bucket-cap-mb", self.bucket_cap_mb, False),
                                      ("--data-ms", self.data_ms, False)):
            if value is not None:  # --clip-grad-norm left out: no clipping
                check_amount(flag, value, minimum_exclusive=positive)
        if self.save_every is not None and (self.save_every < 1 or self.checkpoint_dir is None):
            raise ValueError(f"--save-every must be >= 1 and needs --checkpoint-dir, got {self.save_every} with "
                             f"--checkpoint-dir {self.checkpoint_dir}")
        if self.checkpoint_layout not in checkpoint.LAYOUTS:
            raise ValueError(f"--checkpoint-layout must be one of {checkpoint.LAYOUTS}, got {self.checkpoint_layout!r}")
        if self.resume == "latest" and self.checkpoint_dir is None:
            raise ValueError("--resume latest needs --checkpoint-dir (where to look for the newest checkpoint)")
        if self.resume not in (None, "latest") and not Path(self.resume).is_dir():
            raise ValueError(f"--resume {self.resume}: no such checkpoint directory")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.precision == "fp16" and (self.strategy == "zero2" or (self.three_d and self.zero == 2)):
            raise ValueError("--precision fp16 needs a loss scaler, which unscales the optimizer's gradients; ZeRO-2 "
                             "keeps them in its shards where it does not look: use bf16, or another --zero")
        if self.three_d:
            if self.strategy != "single":
                raise ValueError(f"--strategy {self.strategy} and --dp/--tp/--pp: choose one (with the degrees, "
                                 "--zero picks the data-parallel wrapper: 0 DDP, 1 ZeRO-1, 2 ZeRO-2, 3 FSDP)")
            if self.model != "tiny-gpt":
                raise ValueError(f"--dp/--tp/--pp split a transformer: use --model tiny-gpt, not {self.model}")
            if self.checkpoint_layout != "full":
                raise ValueError("a 3D run saves the full checkpoint layout only (--checkpoint-layout full)")
            self._check_layout()
        elif (self.zero, self.schedule, self.microbatches) != (0, "1f1b", None):
            raise ValueError("--zero, --schedule and --microbatches belong to 3D runs: give --dp/--tp/--pp too")
        elif (self.cp_strategy, self.cp_split) != ("ring", "zigzag"):
            raise ValueError("--cp-strategy and --cp-split belong to context-parallel runs: give --cp too")


def parse_arguments(argv: list[str] | None = None) -> tuple[TrainConfig, int]:
    parser = argparse.ArgumentParser(prog="python -m labkit.train", description="one trainer, every strategy chosen by a flag (see labkit.train)")
    parser.add_argument("--strategy", default="single", help=f"one of {', '.join(STRATEGY_NAMES)}")
    parser.add_argument("--model", default="tiny-gpt", help=f"one of {', '.join(MODELS)}")
    parser.add_argument("--preset", default="100k", help="TinyGPT size: 100k, 1m, 10m or 50m")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="ddp, zero1, zero2: MiB per bucket")
    parser.add_argument("--clip-grad-norm", type=float, default=None,
                        help="clip the gradients' global norm to this value (every strategy; default: no clipping)")
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--checkpoint-dir", default=None,
                        help="directory of checkpoints (step-NNNNNNNN), saved every --save-every steps and at the end")
    parser.add_argument("--save-every", type=int, default=None, help="steps between checkpoints")
    parser.add_argument("--checkpoint-layout", default="full", help="full (rank 0 writes) or sharded (every rank)")
    parser.add_argument("--resume", default=None, help="a checkpoint directory, or 'latest' in --checkpoint-dir")
    parser.add_argument("--dp", type=int, default=None, help="3D: data-parallel degree (default: what is left)")
    parser.add_argument("--tp", type=int, default=None, help="3D: tensor-parallel degree (default 1)")
    parser.add_argument("--pp", type=int, default=None, help="3D: pipeline stages (ranks; default 1)")
    parser.add_argument("--cp", type=int, default=None,
                        help="context parallelism: each sequence split over CP ranks (default 1)")
    parser.add_argument("--cp-strategy", default="ring", help="with --cp: ring, all_gather or ulysses")
    parser.add_argument("--cp-split", "--cp-layout", dest="cp_split", default="zigzag",
                        help="with --cp: how a sequence is split over the cp ranks, zigzag (balanced) or contiguous "
                             "(--cp-layout: its earlier name)")
    parser.add_argument("--ep", type=int, default=None,
                        help="expert parallelism: the experts split over EP of the dp x cp ranks (default 1)")
    parser.add_argument("--experts", type=int, default=0, help="MoE: experts per block (default 0: dense MLPs)")
    parser.add_argument("--top-k", type=int, default=2, help="MoE: experts each token goes to")
    parser.add_argument("--capacity-factor", type=float, default=None,
                        help="MoE: an expert takes at most ceil(C T k / E) of T tokens' choices (default: no limit)")
    parser.add_argument("--router", default="softmax", help="MoE: softmax (Switch, Mixtral) or sigmoid (DeepSeek-V3)")
    parser.add_argument("--aux-loss-weight", type=float, default=0.0, help="MoE: load-balancing loss weight")
    parser.add_argument("--bias-update-rate", type=float, default=0.0,
                        help="MoE: DeepSeek-V3's auxiliary-loss-free balancing step, per step (default 0: off)")
    parser.add_argument("--zero", type=int, default=0, help="3D: over dp, 0 DDP, 1 ZeRO-1, 2 ZeRO-2, 3 FSDP")
    parser.add_argument("--schedule", default="1f1b", help=f"3D: pipeline schedule, one of {', '.join(SCHEDULES)}")
    parser.add_argument("--microbatches", type=int, default=None,
                        help="3D: micro-batches per step, dividing --batch-size (default 2 x pp, or 1)")
    parser.add_argument("--virtual-stages", type=int, default=2,
                        help="3D, interleaved and interleaved-zb: stages per rank")
    parser.add_argument("--precision", default="fp32", help=f"one of {', '.join(PRECISIONS)}")
    parser.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace of the last step to this file")
    parser.add_argument("--log-dir", default=None, help="each rank appends its progress to DIR/rank-R.log")
    parser.add_argument("--tensorboard", default=None, metavar="DIR",
                        help="each rank writes its scalars to DIR/rank-R (tensorboard --logdir DIR overlays them)")
    parser.add_argument("--tensorboard-ranks", default="every", metavar="every|summary",
                        help="with --tensorboard: every rank its own run, or (many ranks) rank 0's min, mean and max "
                             "over every rank in DIR/min, DIR/mean, DIR/max")
    parser.add_argument("--alarm-every", type=int, default=1, metavar="N",
                        help="compare the data-parallel ranks' loss, gradient norm and weights every N steps (0: off)")
    parser.add_argument("--workers", type=int, default=None, metavar="N",
                        help="read batches through a DataLoader with N worker processes (0: in the training process)")
    parser.add_argument("--data-ms", type=float, default=0.0, metavar="MS",
                        help="CPU time to make each sample (decoding, simulated), in ms; implies a DataLoader")
    parser.add_argument("--prefetch-factor", type=int, default=2, help="with --workers: batches each worker makes ahead")
    parser.add_argument("--persistent-workers", action="store_true",
                        help="with --workers: keep the worker processes from one epoch to the next")
    parser.add_argument("--traceback", action="store_true",
                        help="when a rank fails, print its full traceback (default: one line, the traceback in a file)")
    parser.add_argument("--nprocs", type=int, default=None,
                        help="ranks to fork on this machine (default: 2 for ddp, 1 for single, dp x cp x tp x pp "
                             "for 3D with --dp given; ignored under torchrun)")
    args = parser.parse_args(argv)
    config = TrainConfig(**{key: value for key, value in vars(args).items() if key != "nprocs"})
    config.validate()
    if args.nprocs is not None:
        nprocs = args.nprocs
    elif config.three_d:
        # The degrees given say how many ranks to fork: a degree left out is 1, except dp, which is what the
        # others leave of the ranks, so it must be given (ep adds none: it is folded over dp x cp).  Under torchrun
        # WORLD_SIZE is the world, and resolve() checks the degrees against it.
        if config.dp is None and not dist.in_torchrun():
            raise ValueError("a 3D run without --dp needs --nprocs N (dp is what --tp, --pp and --cp leave of the "
                             "N ranks), or give --dp D: the ranks are then dp x cp x tp x pp")
        nprocs = (config.dp or 1) * (config.tp or 1) * (config.pp or 1) * (config.cp or 1)
    else:
        nprocs = 1 if config.strategy == "single" else 2
    if nprocs < 1:
        raise ValueError(f"--nprocs must be >= 1, got {nprocs}")
    world = int(os.environ["WORLD_SIZE"]) if dist.in_torchrun() and "WORLD_SIZE" in os.environ else nprocs
    config.resolve(world)  # every check of the layout, before any process starts
    config.check_files(world)
    return config, nprocs


def _check_output_directory(flag: str, value: str, needed_bytes: int = 0) -> None:
    """``ValueError`` unless directory ``value`` exists or can be made, is writable, and its disk has
    ``needed_bytes`` free."""
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {value}: a file, not a directory")
    existing = path.absolute()
    while not existing.exists():  # the nearest folder that exists: where the directory would be made
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{flag} {value}: cannot be made, {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {value}: {existing} is not writable")
    free = shutil.disk_usage(existing).free
    if free < needed_bytes:
        raise ValueError(f"{flag} {value}: its disk has {free / MiB:,.1f} MiB free, and one checkpoint of this model "
                         f"takes about {needed_bytes / MiB:,.1f} MiB")
