"""Checks for exercise 12 (``12_input_pipeline.py``): sample_seed, the seed of one sample's augmentation.

Four checks, building up:

1. a seed: what ``torch.Generator().manual_seed`` takes, a Python ``int`` (numpy's integers and 0-d tensors are
   refused there) in ``[0, 2**63)``, the same when asked twice, for small keys and for keys up to ``2**62``;
2. distinct, at a run's scale, and 63 bits wide: no two of 4.5 million keys share a seed: 4,194,304 of a run (8
   ranks x 8 epochs x 65,536 indices; a real one draws more: ImageNet's 90 epochs are 115 million), values just
   around powers of 2 and 10 and common primes (a number that spills into its neighbour's place: fixed bit fields,
   a polynomial in a base), numbers whose digits read two ways once written out ("1" + "23" and "12" + "3"),
   values from 2**61 - 1 up (Python's ``hash`` of an int works modulo 2**61 - 1; odd powers wrap at 2**61), swapped
   values, and 300,000 keys at random over the whole range.  A sum or an xor collides on keys whose coordinates
   trade places; a key that leaves out the rank or the epoch collides across them; a 32-bit hash (CRC-32) has
   about 2,000 collisions among 4.5 million keys by the birthday bound (n^2 / 2^33), a 40-bit one about 9
   (n^2 / 2^41: it passes 700,000 keys four times in five), a 63-bit one a chance of 1e-6.  And every one of the
   63 bits is 0 in some seed and 1 in others: a 40-bit hash, or one shifted left, is seen at once;
3. the same in every process: in ``DataLoader`` workers, and in two fresh interpreters with other ``hash`` salts
   (``PYTHONHASHSEED``), each of which also imports the file as on two other hosts and 9 and 400 days later
   (:mod:`labkit.grading.checkers.another_machine`): a seed that mixes in the host name, the machine id or the
   date differs there;
4. what it is for: a data set that augments each sample with a generator seeded by the student's function, read by
   three ranks over two epochs through real ``DataLoader`` workers: no two of the draws are alike (ranks, epochs,
   samples), 0 and 3 workers draw the same, and a loader resumed mid-epoch replays the rest.  The seed goes to
   ``manual_seed`` as returned, in the workers too.

While the checks run, :mod:`labkit.grading.guard` switches off labkit's own ``labkit.loader.sample_seed`` and
its mixing function, however their code was loaded (:mod:`labkit.grading.copies`).

A seed is 63 bits here, but torch's CPU generator (Mersenne Twister) keeps only its low 32: distinct seeds give at
most 2**32 distinct streams, so among n samples about n^2 / 2^33 pairs draw the same augmentation by chance (18 in
400,000), harmless noise, unlike the lock-step of every rank or epoch that the checks exist for.
"""

from __future__ import annotations

import array
import itertools
import json
import os
import subprocess
import sys

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from labkit import loader
from labkit.grading import CheckFailed, copies, guard
from labkit.grading.checkers import another_machine

TOP = 2**63
LARGEST_INPUT = 2**62


def _seed(module, key: tuple[int, int, int, int], in_range: bool = False) -> int:
    """The student's seed of ``key``, an int as returned (``in_range``: checked to lie in ``[0, 2**63)``)."""
    call = f"sample_seed{key}"
    value = module.sample_seed(*key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckFailed(f"{call} returned {value!r} ({type(value).__module__}.{type(value).__name__}); expected an "
                          "int: torch.Generator().manual_seed takes a Python int only (not numpy's integers, not a "
                          "tensor): return int(...) of it")
    if in_range and not 0 <= value < TOP:
        raise CheckFailed(f"{call} returned {value}, outside [0, 2**63): torch.Generator().manual_seed takes 63 "
                          "bits (a hash can be negative; a product of the inputs can outgrow 64 bits)")
    return value


SAMPLE_KEYS = [(0, 0, 0, 0), (0, 1, 0, 0), (7, 3, 2, 11), (LARGEST_INPUT, LARGEST_INPUT, LARGEST_INPUT, LARGEST_INPUT),
               (1, 2**40, 3, 2**33), (2**62 - 1, 0, 0, 2**62 - 1)]


@guard.no_shortcuts
def check_a_seed(module) -> None:
    """sample_seed returns an int in [0, 2**63), the same each time, for small and large keys"""
    _refuse_copies_of_labkit()
    for key in SAMPLE_KEYS:
        first, second = _seed(module, key, in_range=True), _seed(module, key)
        if first != second:
            raise CheckFailed(f"sample_seed{key} returned {first}, then {second}: a seed must not be random itself")
        torch.Generator().manual_seed(first)  # as returned
    _refuse_copies_of_labkit()


BIG = (2**61 - 1, 2**61, 2**62 - 1, 2**62)  # Python's int hash works modulo 2**61 - 1; powers wrap at 2**61
SHIFTS = sorted({base + offset for base in [10**k for k in range(3, 13)] + [2**k for k in range(8, 62, 4)]
                 + [2**31 - 1, 10**6 + 3, 10**9 + 7] for offset in range(-1, 3)})
TEXT_TRAPS = (1, 2, 3, 4, 12, 23, 34, 123, 234)  # "1" + "23" reads as "12" + "3" once the numbers are written out
RANDOM_KEYS = 300_000
RUN = (8, 8, 65_536)  # a run's ranks, epochs and indices: 4,194,304 keys, seed 0
BITS = 63


def _traps() -> list[tuple[int, int, int, int]]:
    """Keys that catch arithmetic: values around common bases and powers (a number that spills into its
    neighbour's place), digits that read two ways, large and swapped values (none of them the run's)."""
    keys = [(seed, rank, epoch, shift) for seed in (0, 1) for rank in (0, 1) for epoch in (0, 1) for shift in SHIFTS]
    keys += [(seed, rank, shift, 0) for seed in (0, 1) for rank in (0, 1) for shift in SHIFTS]
    keys += [(0, rank, epoch, index) for rank in TEXT_TRAPS for epoch in TEXT_TRAPS for index in TEXT_TRAPS]
    keys += [tuple(value if place == where else 0 for place in range(4)) for where in range(4) for value in BIG]
    keys += [(seed, rank, epoch, index) for seed, rank, epoch, index in itertools.permutations((0, 1, 2, 2**32))]
    keys += SAMPLE_KEYS
    in_run = {key for key in keys if key[0] == 0 and all(value < n for value, n in zip(key[1:], RUN, strict=True))}
    return sorted(set(keys) - in_run)


def _random_keys() -> list[tuple[int, ...]]:
    """300,000 keys drawn at random over the whole range."""
    drawn = np.random.default_rng(12).integers(0, LARGEST_INPUT, size=(RANDOM_KEYS, 4), endpoint=True)
    return [tuple(key) for key in drawn.tolist()]


def _run_keys() -> itertools.product:
    """The run's keys, in order: (0, rank, epoch, index) for 8 ranks x 8 epochs x 65,536 indices."""
    return itertools.product((0,), *(range(n) for n in RUN))


def _key(position: int, traps: list[tuple[int, ...]], drawn: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The key at ``position`` among the traps, then the keys drawn at random, then the run's."""
    if position < len(traps) + len(drawn):
        return traps[position] if position < len(traps) else drawn[position - len(traps)]
    rank, rest = divmod(position - len(traps) - len(drawn), RUN[1] * RUN[2])
    return (0, rank, *divmod(rest, RUN[2]))


def _collision_hint(first: tuple[int, ...], second: tuple[int, ...]) -> str:
    names = ("seed", "dp_rank", "epoch", "index")
    differ = [name for name, a, b in zip(names, first, second, strict=True) if a != b]
    if len(differ) == 1:
        return (f" — the keys differ only in {differ[0]}: your seed does not tell these two values apart (is it "
                "left out, or are only some of its bits kept?)")
    if sum(first) == sum(second):
        return (" — the keys have the same sum: adding the numbers (or anything that lets a rank trade with an index) "
                "maps many keys to one seed; mix each number in so that no two keys combine alike")
    return (" — two different samples would draw the same augmentation (a hash of fewer than 63 bits collides by "
            "chance at a run's scale: among n keys about n^2 / 2^(bits + 1) pairs)")


def _collided(module, seen: dict[int, tuple[int, int, int, int]], key: tuple[int, int, int, int]) -> None:
    value = _seed(module, key, in_range=True)
    if value in seen and seen[value] != key:
        raise CheckFailed(f"sample_seed{seen[value]} and sample_seed{key} both returned {value}"
                          f"{_collision_hint(seen[value], key)}")
    seen[value] = key


@guard.no_shortcuts
def check_distinct(module) -> None:
    """no two of 4.5 million keys share a seed (a run's ranks, epochs, indices; shifted, large, random), 63 bits wide"""
    seen: dict[int, tuple[int, int, int, int]] = {}
    for key in _traps():  # one by one, each checked: the first collision stops the check, with its keys
        _collided(module, seen, key)
    drawn = _random_keys()
    seeds = array.array("Q", seen)
    try:  # the others at C speed, kept as 8 bytes each (36 MB), then sorted
        seeds.extend(itertools.starmap(module.sample_seed, itertools.chain(drawn, _run_keys())))
    except (TypeError, OverflowError):  # not an int in [0, 2**64): found again, one by one, to name it
        for key in itertools.chain(drawn, _run_keys()):
            _seed(module, key, in_range=True)
        raise
    values = torch.frombuffer(seeds, dtype=torch.int64)  # the same bytes: a seed past 2**63 reads negative
    if bool((values < 0).any()):
        for key in itertools.chain(drawn, _run_keys()):
            _seed(module, key, in_range=True)
    bits = np.frombuffer(seeds, dtype=np.uint64)
    ones, zeros = int(np.bitwise_or.reduce(bits)), int(np.bitwise_and.reduce(bits))
    constant = [bit for bit in range(BITS) if not ones >> bit & 1 or zeros >> bit & 1]
    if constant:
        raise CheckFailed(f"bit(s) {constant[:8]}{'...' if len(constant) > 8 else ''} of the seed are the same in all "
                          f"{len(seeds):,} seeds: they use {BITS - len(constant)} of the 63 bits, and a hash of b bits "
                          "has about n^2 / 2^(b + 1) collisions among n samples (a run draws hundreds of millions): "
                          "keep all 63 bits of your hash (take 8 bytes, shift right by 1)")
    ordered, where = torch.sort(values)
    same = torch.nonzero(ordered[1:] == ordered[:-1])
    if same.numel():
        keys = list(seen.values())
        pair = [_key(int(where[int(same[0]) + step]), keys, drawn) for step in (0, 1)]
        _collided(module, {_seed(module, pair[0]): pair[0]}, pair[1])
    _refuse_copies_of_labkit()


check_distinct.timeout = 180.0  # 4.5 million calls: ~5 s on a quiet laptop core, more on a busy one


class _Seeds(Dataset):
    """Item ``i``: the student's seed of key ``KEYS[i]``, computed wherever the DataLoader runs it."""

    def __init__(self, module, keys: list[tuple[int, int, int, int]]):
        self.module, self.keys = module, keys

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> str:
        value = self.module.sample_seed(*self.keys[index])  # a string, which torch's collation keeps whole
        return str(value) if type(value) is int else f"{value!r} ({type(value).__name__})"


PROCESS_KEYS = SAMPLE_KEYS + [(3, rank, epoch, index) for rank in range(3) for epoch in range(2) for index in range(4)]


ELSEWHERE = another_machine.__file__  # run as a script: the student's file as on other machines and days


@guard.no_shortcuts
def check_every_process(module) -> None:
    """sample_seed gives the same seeds in DataLoader workers and in other interpreters, hosts and days"""
    here = [_seed(module, key) for key in PROCESS_KEYS]
    loader = DataLoader(_Seeds(module, PROCESS_KEYS), batch_size=4, num_workers=2)
    in_workers = [value for batch in loader for value in batch]
    if in_workers != [str(value) for value in here]:
        first = next(i for i, (a, b) in enumerate(zip(here, in_workers, strict=True)) if str(a) != b)
        raise CheckFailed(f"sample_seed{PROCESS_KEYS[first]} is {here[first]} here but {in_workers[first]} in a "
                          "DataLoader worker: each worker process must compute the same seed")
    for salt in ("1", "2"):  # a new session too: nothing of this process (its group, its hash salt) carries over
        done = subprocess.run([sys.executable, ELSEWHERE, os.path.abspath(module.__file__),
                               json.dumps(PROCESS_KEYS)], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYTHONHASHSEED": salt}, start_new_session=True)
        if done.returncode != 0:
            raise CheckFailed(f"importing your file in a fresh interpreter failed: {done.stderr.strip()[-300:]}")
        for situation, there in json.loads(done.stdout.strip().splitlines()[-1]).items():
            where = f"a fresh interpreter (PYTHONHASHSEED={salt}) that {situation}"
            if isinstance(there, str):
                raise CheckFailed(f"your file raised {there[:200]} in {where}")
            if there != here:
                first = next(i for i, (a, b) in enumerate(zip(here, there, strict=True)) if a != b)
                raise CheckFailed(f"sample_seed{PROCESS_KEYS[first]} is {here[first]} here but {there[first]} in "
                                  f"{where}: {_why(*CHANGED[situation])}")
    _refuse_copies_of_labkit()


CHANGED = {what: (host, days) for what, host, days in another_machine.SITUATIONS}


def _why(host: str | None, days: float) -> str:
    if host is not None:
        return ("your seed depends on the machine (its host name, address or id): every node of a run must draw "
                "alike for the same sample, and a rerun on other nodes must replay")
    if days:
        return "your seed depends on the date or the clock: a rerun next week must draw what this one drew"
    return ("Python's hash() of a string or bytes is salted per process; use a hash that is not (hashlib) or "
            "arithmetic of your own, and nothing of the process (its id, group or clock)")


class _Augmented(Dataset):
    """Samples keyed ``(epoch, index)``: three noise values drawn from the student's per-sample generator."""

    def __init__(self, module, dp_rank: int, length: int):
        self.module, self.dp_rank, self.length = module, dp_rank, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key: tuple[int, int]) -> torch.Tensor:
        epoch, index = key
        seed = self.module.sample_seed(5, self.dp_rank, epoch, index)  # as returned, as a data set would use it
        return torch.rand(3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _draws(module, dp_rank: int, workers: int, epoch: int, start: int = 0, ranks: int = 3,
           length: int = 60) -> torch.Tensor:
    sampler = loader.EpochSampler(length, dp_rank, ranks, seed=5)  # (epoch, index) pairs, from `start` on
    sampler.set_epoch(epoch, start=start)
    reader = DataLoader(_Augmented(module, dp_rank, length), batch_size=4, sampler=sampler, num_workers=workers)
    return torch.cat(list(reader))


@guard.no_shortcuts
def check_augmentation(module) -> None:
    """3 ranks x 2 epochs through DataLoader workers: no two draws alike, the same with 0 or 3 workers and on resume"""
    _seed(module, (5, 0, 0, 0))  # a failure here reads better than one inside a worker
    draws = {(rank, epoch): _draws(module, rank, 2, epoch) for rank in range(3) for epoch in range(2)}
    rows = [(where, tuple(row.tolist())) for where, block in draws.items() for row in block]
    seen: dict[tuple[float, ...], tuple[int, int]] = {}
    for (rank, epoch), row in rows:
        if row in seen:
            other = seen[row]
            what = ("the same rank's other epoch" if other[0] == rank else
                    "another rank's sample" if other[1] == epoch else "another rank and epoch")
            raise CheckFailed(f"rank {rank}, epoch {epoch} drew the same augmentation as {what} (rank {other[0]}, "
                              f"epoch {other[1]}): two samples share a seed")
        seen[row] = (rank, epoch)
    for rank, workers in ((0, 0), (2, 3)):
        if not torch.equal(_draws(module, rank, workers, 1), draws[rank, 1]):
            raise CheckFailed(f"rank {rank}'s epoch 1 drew other augmentations with {workers} workers than with 2: "
                              "a seed must not depend on the process that computes it")
    resumed = _draws(module, 1, 2, 1, start=8)
    if not torch.equal(resumed, draws[1, 1][8:]):
        raise CheckFailed("a loader resumed 8 samples into rank 1's epoch 1 drew other augmentations for the rest")
    _refuse_copies_of_labkit()




def _refuse_copies_of_labkit() -> None:
    """A fresh copy of ``labkit/loader.py`` loaded under another name escapes the guard: refuse it."""
    copies.refuse_copies_of_labkit()


CHECKS = [check_a_seed, check_distinct, check_every_process, check_augmentation]
