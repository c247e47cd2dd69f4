"""Plausible wrong answers to every exercise: each is the solution with one mistake a student is likely to make.

``tests/test_grading.py`` writes each one into a temporary folder (the solution with ``old`` replaced by
``new``) and proves that the checker rejects it, naming the checks that must fail, so no checker can pass
everything.  Keeping them as edits of the solution, rather than as copies, means a change to a solution carries
over to its wrong answers — and an edit that no longer applies fails loudly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SOLUTIONS = Path(__file__).resolve().parents[1] / "solutions"


@dataclass(frozen=True)
class WrongAnswer:
    name: str
    topic: str
    file: str  # the exercise file, as in solutions/
    old: str  # text that occurs exactly once in the solution
    new: str  # the mistake (marked "# WRONG:" where a comment fits)
    caught_by: tuple[int, ...] = ()  # indices into the checker's CHECKS that must fail (the others must pass)

    def write(self, directory: Path) -> Path:
        """Write the wrong file into ``directory`` (which then grades like a student's folder)."""
        solution = (SOLUTIONS / self.file).read_text()
        if solution.count(self.old) != 1:
            raise AssertionError(f"wrong answer {self.name!r} no longer applies to solutions/{self.file}: "
                                 f"its text occurs {solution.count(self.old)} times")
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / self.file
        path.write_text(solution.replace(self.old, self.new))
        return path


WRONG_ANSWERS = [
    WrongAnswer('setup_crash', 'setup', '00_setup.py',
                '    one: the first ``n % world_size`` ranks take one extra item.\n    """\n',
                '    one: the first ``n % world_size`` ranks take one extra item.\n    """\n    import os\n    os._exit(3)  # WRONG: ends the process (stands in for a segfault in an extension)\n',
                caught_by=()),
    WrongAnswer('setup_endless_loop', 'setup', '00_setup.py',
                '    one: the first ``n % world_size`` ranks take one extra item.\n    """\n',
                '    one: the first ``n % world_size`` ranks take one extra item.\n    """\n    while True:  # WRONG: never terminates\n        pass\n',
                caught_by=()),
    WrongAnswer('setup_mean_of_means', 'setup', '00_setup.py',
                '    sum_and_count = torch.stack([local.sum(), torch.tensor(float(local.numel()), dtype=local.dtype)])\n    dist.all_reduce(sum_and_count, op=dist.ReduceOp.SUM)\n    return sum_and_count[0] / sum_and_count[1]\n',
                '    # WRONG: the mean of the per-rank means weighs every rank equally, not every item\n    mean = local.mean()\n    dist.all_reduce(mean, op=dist.ReduceOp.SUM)\n    return mean / dist.get_world_size()\n',
                caught_by=(3,)),
    WrongAnswer('setup_no_all_reduce', 'setup', '00_setup.py',
                "    total = local.sum()  # a new tensor: all_reduce works in place, so never reduce the caller's data\n    dist.all_reduce(total, op=dist.ReduceOp.SUM)\n    return total\n",
                "    # WRONG: reduces a temporary, then returns only this rank's sum\n    dist.all_reduce(local.sum(), op=dist.ReduceOp.SUM)\n    return local.sum()\n",
                caught_by=(2,)),
    WrongAnswer('setup_rank_zero_only', 'setup', '00_setup.py',
                "    total = local.sum()  # a new tensor: all_reduce works in place, so never reduce the caller's data\n    dist.all_reduce(total, op=dist.ReduceOp.SUM)\n",
                '    # WRONG: only rank 0 joins the collective, so it waits for ever\n    total = local.sum()\n    if dist.get_rank() == 0:\n        dist.all_reduce(total, op=dist.ReduceOp.SUM)\n',
                caught_by=()),
    WrongAnswer('setup_syntax_error', 'setup', '00_setup.py',
                'def shard_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:\n',
                'def shard_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]  # WRONG: missing colon\n',
                caught_by=()),
    WrongAnswer('setup_unbalanced', 'setup', '00_setup.py',
                '    base, extra = divmod(n, world_size)\n    start = rank * base + min(rank, extra)\n    stop = start + base + (1 if rank < extra else 0)\n    return start, stop\n',
                '    # WRONG: ceil-sized chunks cover every item, but the last ranks get less (or nothing)\n    chunk = -(-n // world_size)\n    return min(rank * chunk, n), min((rank + 1) * chunk, n)\n',
                caught_by=(1,)),
    WrongAnswer('collectives_all_gather_missed_step', 'collectives', '01_collectives.py',
                '    """Rank ``r``\'s chunk ``r`` of the 1-D tensor ``flat`` is valid; fill every other chunk in place; return ``flat``."""\n    rank, world_size = dist.get_rank(), dist.get_world_size()\n    bounds = chunk_bounds(flat.numel(), world_size)\n    for step in range(world_size - 1):\n',
                '    """Rank ``r``\'s chunk ``r`` of the 1-D tensor ``flat`` is valid; fill every other chunk in place; return ``flat``."""\n    rank, world_size = dist.get_rank(), dist.get_world_size()\n    bounds = chunk_bounds(flat.numel(), world_size)\n    for step in range(world_size - 2):  # WRONG: one step short, one chunk never arrives\n',
                caught_by=(1, 2, 3)),
    WrongAnswer('collectives_built_in', 'collectives', '01_collectives.py',
                '    ring_reduce_scatter(flat)\n    return ring_all_gather(flat)\n',
                '    dist.all_reduce(flat)  # WRONG: the built-in collective, not the ring\n    return flat\n',
                caught_by=(3,)),
    WrongAnswer('collectives_missed_step', 'collectives', '01_collectives.py',
                '    """\n    rank, world_size = dist.get_rank(), dist.get_world_size()\n    bounds = chunk_bounds(flat.numel(), world_size)\n    for step in range(world_size - 1):\n',
                '    """\n    rank, world_size = dist.get_rank(), dist.get_world_size()\n    bounds = chunk_bounds(flat.numel(), world_size)\n    for step in range(world_size - 2):  # WRONG: one step short, a chunk misses one rank\'s contribution\n',
                caught_by=(0, 2, 3)),
    WrongAnswer('collectives_wrong_chunk', 'collectives', '01_collectives.py',
                '        send_start, send_stop = bounds[(rank - step - 1) % world_size]\n        receive_start, receive_stop = bounds[(rank - step - 2) % world_size]\n',
                '        # WRONG: off by one — sends chunk (r - s) and receives (r - s - 1), so rank r finishes chunk r + 1\n        send_start, send_stop = bounds[(rank - step) % world_size]\n        receive_start, receive_stop = bounds[(rank - step - 1) % world_size]\n',
                caught_by=(0, 2, 3)),
    WrongAnswer('data_parallel_buckets_forward', 'data_parallel', '02_data_parallel.py',
                '    for index in reversed(range(len(sizes_in_bytes))):\n',
                '    for index in range(len(sizes_in_bytes)):  # WRONG: forward order, not the order gradients arrive\n',
                caught_by=(3,)),
    WrongAnswer('data_parallel_buckets_overflow', 'data_parallel', '02_data_parallel.py',
                '        if current and filled + sizes_in_bytes[index] > bucket_cap_bytes:\n',
                '        if current and filled >= bucket_cap_bytes:  # WRONG: closes after overflowing, not before\n',
                caught_by=(3,)),
    WrongAnswer('data_parallel_no_broadcast', 'data_parallel', '02_data_parallel.py',
                '    with torch.no_grad():\n        for tensor in [*module.parameters(), *module.buffers()]:\n            dist.broadcast(tensor, src=0)\n',
                '    pass  # WRONG: missed broadcast — each rank keeps its own random initialisation\n',
                caught_by=(0, 2)),
    WrongAnswer('data_parallel_params_only', 'data_parallel', '02_data_parallel.py',
                '        for tensor in [*module.parameters(), *module.buffers()]:\n',
                '        for tensor in module.parameters():  # WRONG: buffers are left as each rank made them\n',
                caught_by=(0, 2)),
    WrongAnswer('data_parallel_sum_not_average', 'data_parallel', '02_data_parallel.py',
                '    dist.all_reduce(parameter.grad, op=dist.ReduceOp.SUM)\n    parameter.grad /= dist.get_world_size()\n',
                '    dist.all_reduce(parameter.grad, op=dist.ReduceOp.SUM)  # WRONG: the sum, not the average\n',
                caught_by=(1, 2)),
    WrongAnswer('lr_scaling_ignores_accumulation', 'lr_scaling', '03_lr_scaling.py',
                '    return per_rank_batch * world_size * accumulation_steps\n',
                '    return per_rank_batch * world_size  # WRONG: scales by world size, ignoring accumulation_steps\n',
                caught_by=(0, 2)),
    WrongAnswer('lr_scaling_lr_times_world_size', 'lr_scaling', '03_lr_scaling.py',
                '    peak = scaled_lr(base_lr, base_batch, global_batch(per_rank_batch, world_size, accumulation_steps))\n',
                '    peak = base_lr * world_size  # WRONG: "k GPUs, k times the rate" forgets the batches and accumulation\n',
                caught_by=(2,)),
    WrongAnswer('lr_scaling_no_decay', 'lr_scaling', '03_lr_scaling.py',
                '    progress = (step - warmup_steps) / (total_steps - warmup_steps)\n    return peak * (1 + math.cos(math.pi * progress)) / 2\n',
                '    return peak  # WRONG: no decay after warmup\n',
                caught_by=(4,)),
    WrongAnswer('lr_scaling_sqrt_rule', 'lr_scaling', '03_lr_scaling.py',
                '    return base_lr * global_batch / base_batch\n',
                '    return base_lr * math.sqrt(global_batch / base_batch)  # WRONG: the square-root rule, not the linear one\n',
                caught_by=(1, 2)),
    WrongAnswer('lr_scaling_warmup_from_zero', 'lr_scaling', '03_lr_scaling.py',
                '        return peak * (warmup_start_factor + (1 - warmup_start_factor) * step / warmup_steps)\n',
                '        return peak * step / warmup_steps  # WRONG: starts at 0, ignoring warmup_start_factor\n',
                caught_by=(3,)),
    WrongAnswer('lr_scaling_warmup_off_by_one', 'lr_scaling', '03_lr_scaling.py',
                '        return peak * (warmup_start_factor + (1 - warmup_start_factor) * step / warmup_steps)\n',
                '        return peak * (warmup_start_factor + (1 - warmup_start_factor) * (step + 1) / warmup_steps)  # WRONG: peaks a step early\n',
                caught_by=(3,)),
    WrongAnswer('mixed_precision_grows_every_step', 'mixed_precision', '04_mixed_precision.py',
                '    good_steps += 1\n    if good_steps == growth_interval:\n        return scale * growth_factor, 0\n    return scale, good_steps\n',
                '    return scale * growth_factor, 0  # WRONG: grows after every good step, ignoring growth_interval\n',
                caught_by=(2, 3)),
    WrongAnswer('mixed_precision_misses_nan', 'mixed_precision', '04_mixed_precision.py',
                '        if not torch.isfinite(parameter.grad).all():\n',
                '        if torch.isinf(parameter.grad).any():  # WRONG: a nan is not an inf, and it overflowed too\n',
                caught_by=(0, 3)),
    WrongAnswer('mixed_precision_multiplies', 'mixed_precision', '04_mixed_precision.py',
                '        parameter.grad.div_(scale)\n',
                '        parameter.grad.mul_(scale)  # WRONG: multiplies by the scale instead of dividing\n',
                caught_by=(0, 3)),
    WrongAnswer('mixed_precision_never_grows', 'mixed_precision', '04_mixed_precision.py',
                '    if good_steps == growth_interval:\n        return scale * growth_factor, 0\n    return scale, good_steps\n',
                '    return scale, good_steps  # WRONG: the scale never grows\n',
                caught_by=(2, 3)),
    WrongAnswer('mixed_precision_no_reset', 'mixed_precision', '04_mixed_precision.py',
                '        return scale * backoff_factor, 0\n',
                '        return scale * backoff_factor, good_steps  # WRONG: keeps counting good steps across an overflow\n',
                caught_by=(2, 3)),
    WrongAnswer('mixed_precision_steps_on_overflow', 'mixed_precision', '04_mixed_precision.py',
                '    if found_inf:\n        return False\n    optimizer.step()\n    return True\n',
                '    optimizer.step()  # WRONG: steps even when a gradient overflowed\n    return not found_inf\n',
                caught_by=(1, 3)),
    WrongAnswer('zero_adam_not_adamw', 'zero', '05_zero.py',
                '    return torch.optim.AdamW(mine, lr=lr, weight_decay=weight_decay)\n',
                "    return torch.optim.Adam(mine, lr=lr, weight_decay=weight_decay)  # WRONG: Adam's L2 penalty, not AdamW's decay\n",
                caught_by=(1,)),
    WrongAnswer('zero_broadcast_from_rank_zero', 'zero', '05_zero.py',
                '            dist.broadcast(parameter, src=owner)\n',
                "            dist.broadcast(parameter, src=0)  # WRONG: rank 0's stale copy overwrites the owner's update\n",
                caught_by=(2,)),
    WrongAnswer('zero_counts_parameters', 'zero', '05_zero.py',
                '        load[rank] += parameters[index].numel()\n',
                '        load[rank] += 1  # WRONG: balances the number of parameters, not their elements\n',
                caught_by=(0,)),
    WrongAnswer('zero_missing_gather', 'zero', '05_zero.py',
                'import torch.distributed as dist\n\n\ndef shard_parameters(parameters: list[torch.Tensor], world_size: int) -> list[int]:\n    """Choose the rank that owns each parameter (and holds its optimizer state): ``owners[i]`` for\n    ``parameters[i]``.\n\n    Balance the number of *elements* (``numel()``) per rank greedily: take the parameters from the largest to\n    the smallest (parameters of equal size in index order, i.e. a stable sort) and give each to the rank that\n    holds the fewest elements so far (the lowest such rank on a tie).  This is ``ZeroRedundancyOptimizer``\'s\n    rule.  Examples (sizes -> owners): ``[100, 1, 1, 1]`` over 2 ranks -> ``[0, 1, 1, 1]``;\n    ``[1, 2, 3, 4, 5, 6]`` over 3 ranks -> ``[0, 1, 2, 2, 1, 0]``.\n    """\n    load = [0] * world_size\n    owners = [0] * len(parameters)\n    for index in sorted(range(len(parameters)), key=lambda i: parameters[i].numel(), reverse=True):\n        rank = load.index(min(load))\n        owners[index] = rank\n        load[rank] += parameters[index].numel()\n    return owners\n\n\ndef make_local_optimizer(parameters: list[torch.Tensor], owners: list[int], rank: int, lr: float,\n                         weight_decay: float) -> torch.optim.AdamW:\n    """This rank\'s optimizer: ``torch.optim.AdamW(lr=lr, weight_decay=weight_decay)`` (other arguments at\n    their defaults) over the parameters that ``rank`` owns, in their order in ``parameters`` — and no other,\n    so that optimizer state exists only for them.  Every rank owns at least one parameter here."""\n    mine = [parameter for parameter, owner in zip(parameters, owners, strict=True) if owner == rank]\n    return torch.optim.AdamW(mine, lr=lr, weight_decay=weight_decay)\n\n\ndef zero1_step(parameters: list[torch.Tensor], owners: list[int],\n               local_optimizer: torch.optim.Optimizer) -> None:\n    """One ZeRO-1 step, called on every rank after the gradients have been averaged: step ``local_optimizer``\n    (this rank\'s parameters), then broadcast each parameter from its owner, in place, so that every rank ends\n    with all the updated parameters.  Every rank must issue the same broadcasts in the same order."""\n    local_optimizer.step()\n    with torch.no_grad():\n        for parameter, owner in zip(parameters, owners, strict=True):\n            dist.broadcast(parameter, src=owner)\n',
                'import torch.distributed as dist  # noqa: F401\n\n\ndef shard_parameters(parameters: list[torch.Tensor], world_size: int) -> list[int]:\n    """Choose the rank that owns each parameter (and holds its optimizer state): ``owners[i]`` for\n    ``parameters[i]``.\n\n    Balance the number of *elements* (``numel()``) per rank greedily: take the parameters from the largest to\n    the smallest (parameters of equal size in index order, i.e. a stable sort) and give each to the rank that\n    holds the fewest elements so far (the lowest such rank on a tie).  This is ``ZeroRedundancyOptimizer``\'s\n    rule.  Examples (sizes -> owners): ``[100, 1, 1, 1]`` over 2 ranks -> ``[0, 1, 1, 1]``;\n    ``[1, 2, 3, 4, 5, 6]`` over 3 ranks -> ``[0, 1, 2, 2, 1, 0]``.\n    """\n    load = [0] * world_size\n    owners = [0] * len(parameters)\n    for index in sorted(range(len(parameters)), key=lambda i: parameters[i].numel(), reverse=True):\n        rank = load.index(min(load))\n        owners[index] = rank\n        load[rank] += parameters[index].numel()\n    return owners\n\n\ndef make_local_optimizer(parameters: list[torch.Tensor], owners: list[int], rank: int, lr: float,\n                         weight_decay: float) -> torch.optim.AdamW:\n    """This rank\'s optimizer: ``torch.optim.AdamW(lr=lr, weight_decay=weight_decay)`` (other arguments at\n    their defaults) over the parameters that ``rank`` owns, in their order in ``parameters`` — and no other,\n    so that optimizer state exists only for them.  Every rank owns at least one parameter here."""\n    mine = [parameter for parameter, owner in zip(parameters, owners, strict=True) if owner == rank]\n    return torch.optim.AdamW(mine, lr=lr, weight_decay=weight_decay)\n\n\ndef zero1_step(parameters: list[torch.Tensor], owners: list[int],\n               local_optimizer: torch.optim.Optimizer) -> None:\n    """One ZeRO-1 step, called on every rank after the gradients have been averaged: step ``local_optimizer``\n    (this rank\'s parameters), then broadcast each parameter from its owner, in place, so that every rank ends\n    with all the updated parameters.  Every rank must issue the same broadcasts in the same order."""\n    local_optimizer.step()  # WRONG: no broadcast — each rank only ever sees its own parameters move\n',
                caught_by=(2,)),
    WrongAnswer('zero_round_robin', 'zero', '05_zero.py',
                '    load = [0] * world_size\n    owners = [0] * len(parameters)\n    for index in sorted(range(len(parameters)), key=lambda i: parameters[i].numel(), reverse=True):\n        rank = load.index(min(load))\n        owners[index] = rank\n        load[rank] += parameters[index].numel()\n    return owners\n',
                '    return [index % world_size for index in range(len(parameters))]  # WRONG: round-robin, ignores the sizes\n',
                caught_by=(0,)),
    WrongAnswer('zero_unsharded_state', 'zero', '05_zero.py',
                '    mine = [parameter for parameter, owner in zip(parameters, owners, strict=True) if owner == rank]\n    return torch.optim.AdamW(mine, lr=lr, weight_decay=weight_decay)\n',
                "    return torch.optim.AdamW(parameters, lr=lr, weight_decay=weight_decay)  # WRONG: every parameter, DDP's full state\n",
                caught_by=(1,)),
    WrongAnswer('zero_unsorted_greedy', 'zero', '05_zero.py',
                '    for index in sorted(range(len(parameters)), key=lambda i: parameters[i].numel(), reverse=True):\n',
                '    for index in range(len(parameters)):  # WRONG: greedy in index order, without taking the largest first\n',
                caught_by=(0,)),
]

BY_NAME = {answer.name: answer for answer in WRONG_ANSWERS}
