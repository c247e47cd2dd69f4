"""The training run exercise 09's checks save and resume (:mod:`labkit.grading.checkers.checkpointing`).

A TinyGPT with dropout (one block of 16 features: what is checked is state, which a larger model only makes
slower to train, send and load) under labkit's ``DistributedDataParallel`` on gloo ranks, with
AdamW over two parameter groups (weight decay and a larger learning rate for the matrices, neither for the
rest), a learning-rate schedule (``LambdaLR``, a decay that changes every step), a ``GradScaler`` that grows its
scale every two steps and skips step 2 (its loss made infinite: the scaler finds the overflow, halves its scale
and skips the optimizer, so AdamW has counted one step fewer than the run when it is saved), a sampler ``torch.Generator`` seeded by rank and a torch seed by rank, so that every rank
draws other batches and other dropout masks: a checkpoint that restores one rank's random state everywhere, or
none, resumes another run.  The scaler multiplies and divides by powers of two, exact in float32, so a scaler
restored wrong changes no loss: the checks compare its state itself.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

# Building a torch optimizer imports torch._dynamo, seconds in every check process and rank that lacks it:
# import it once, here, and the checks and ranks forked later inherit it.
import torch._dynamo  # noqa: F401
import torch.distributed as dist

from labkit.models import GPTConfig, TinyGPT
from labkit.parallel import base, ddp

# torch.distributed.checkpoint's save and load, named one by one: the whole package would also swap Enum.__new__
# (its enums').  Its state_dict helpers stay: with plain DDP they are model.state_dict() by another name.
_DCP = "torch.distributed.checkpoint"
BUILT_INS = tuple(f"{_DCP}.{module}.{name}" for module, names in (
    ("state_dict_saver", ("save", "async_save", "save_state_dict")),
    ("state_dict_loader", ("load", "load_state_dict"))) for name in names)
# The checks train under labkit's own DistributedDataParallel, whose buckets keep one layout for the whole run.
# PyTorch's rebuilds its buckets after a wrapper's first step, so a resumed run's first step packs the gradients
# in another order than the straight run's; on 3 ranks gloo's ring then adds each element's three values in
# another order, and the runs part by 1 ulp: not a student's mistake, and it would hide every one.
CHECKER_TOOLS = tuple(f"{module.__name__}.{name}" for module in (ddp, base) for name, value in vars(module).items()
                      if getattr(value, "__module__", None) == module.__name__)
LAUNCH_TIMEOUT = 60.0  # seconds a launch may take before the ranks count as hung
CONFIG = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16, dropout=0.1)
STEPS, SAVE_AT, OVERFLOW_AT = 6, 3, 2  # steps are counted from 1; step OVERFLOW_AT's gradients are infinite
BATCH, TOKENS = 4, 16
LR_MATRICES, LR_OTHERS, WEIGHT_DECAY = 3e-3, 1e-3, 0.1
INITIAL_SCALE, GROWTH_INTERVAL = 2.0 ** 10, 2
# (model initialisation seed, sampler seed + rank, torch seed + rank): the first run's, then the resumed run's
# fresh objects', which a load must overwrite.
FIRST_RUN, RESUMED_RUN = (0, 100, 1000), (1, 500, 5000)
CORPUS = torch.randint(CONFIG.vocab_size, (4096,), generator=torch.Generator().manual_seed(7))


@dataclass
class Run:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    generator: torch.Generator
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    steps: int = 0  # taken so far (a resumed run starts at the step it was saved at)


def _decay(step: int) -> float:
    return 1.0 / (1.0 + 0.5 * step)


def build(seeds: tuple[int, int, int]) -> Run:
    init_seed, sampler_seed, torch_seed = seeds
    rank = dist.get_rank()
    torch.set_num_threads(1)  # the same kernels in every run: the comparison is exact
    model = ddp.DistributedDataParallel(TinyGPT(CONFIG, seed=init_seed))
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": matrices, "lr": LR_MATRICES, "weight_decay": WEIGHT_DECAY},
                                   {"params": others, "lr": LR_OTHERS, "weight_decay": 0.0}], betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _decay)
    scaler = torch.amp.GradScaler("cpu", init_scale=INITIAL_SCALE, growth_interval=GROWTH_INTERVAL)
    generator = torch.Generator().manual_seed(sampler_seed + rank)
    torch.manual_seed(torch_seed + rank)  # each rank its own dropout masks
    return Run(model, optimizer, generator, scheduler, scaler)


def train_step(run: Run) -> float:
    starts = torch.randint(len(CORPUS) - TOKENS - 1, (BATCH,), generator=run.generator)  # the sampler's draw
    window = torch.stack([CORPUS[start:start + TOKENS + 1] for start in starts.tolist()])
    _, loss = run.model(window[:, :-1], window[:, 1:])
    run.optimizer.zero_grad(set_to_none=True)
    run.steps += 1
    run.scaler.scale(loss * (float("inf") if run.steps == OVERFLOW_AT else 1.0)).backward()
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.scheduler.step()
    return loss.item()


def weights(run: Run) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in run.model.state_dict().items()}


def snapshot(run: Run) -> dict[str, Any]:
    return {"model": weights(run), "optimizer": copy.deepcopy(run.optimizer.state_dict()),
            "scheduler": copy.deepcopy(run.scheduler.state_dict()), "scaler": run.scaler.state_dict(),
            "rng": torch.get_rng_state(), "sampler": run.generator.get_state()}


def same(a: Any, b: Any) -> bool:
    """Exact equality of nested dicts, lists and tensors (``torch.equal``, dtypes included)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b
