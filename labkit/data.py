"""Generated data sets (nothing is downloaded), how a sampler shards them over ranks, and per-rank seeding.

**Why generated data.**  A lesson on data parallelism needs data whose answer is known.  Two sets are built
here from a seed, in milliseconds, identically on every machine:

- :func:`make_classification` — Gaussian blobs, one per class, for :class:`labkit.models.TinyMLP`.
- :class:`MarkovChain` — a character-level "language" for :class:`labkit.models.TinyGPT`.  It is an
  **order-1** Markov chain over the ``VOCAB_SIZE = 32`` characters of :data:`ALPHABET`: the next character
  depends only on the current one, through a fixed random transition matrix ``P``.  Because we wrote the
  generator, we know the best loss any model can reach: the chain's **entropy rate**
  ``H = -sum_i pi_i sum_j P_ij log P_ij`` (``pi`` the stationary distribution), the expected cross-entropy of the
  true next-character probabilities.  A loss curve can therefore be drawn against its floor, and "has the model
  learned?" has a number for an answer.

  The default chain (``MarkovChain()``: seed 0, 4 likely successors per character, 2% of each row spread
  evenly over all 32 characters so that every transition is possible and the chain is ergodic) has an entropy
  rate of **1.2491 nats = 1.8021 bits per character**, against ``log 32 = 3.4657 nats`` (5 bits) for a model that
  has learned nothing.  A 0.1M-parameter TinyGPT gets within 0.1 nats of the floor in 150 steps of AdamW.
  Order 1 is a deliberate choice: the lessons are about how training is *distributed*, so the workload should
  be learned quickly and predictably on a laptop CPU.  (It also means attention has little to do: a model
  that looks only at the current character is already optimal.)

**Sharding.**  Data parallelism gives every rank a different slice of each epoch.  PyTorch's
``DistributedSampler`` does it by (optionally) shuffling all indices with a seed that mixes ``seed`` and the
*epoch*, padding the list by repeating indices from its start until it divides by the world size
(``drop_last=False``) — so a few samples are seen twice per epoch — or cutting the tail (``drop_last=True``) — so a
few are never seen — and giving rank ``r`` every ``world_size``-th index from ``r``.  Forgetting
``sampler.set_epoch(epoch)`` silently replays the same order every epoch.
:func:`shard_with_distributed_sampler` shows all of that without a process group.

**Shard by the data-parallel rank, not the global rank.**  Only data-parallel replicas take different data.
The ``t`` ranks of a tensor-parallel group compute one replica together, each holding part of every matrix, so
they must see the *same* batch; so must the stages of one pipeline (the first needs the inputs, the last the
targets).  On a mesh of ``dp x tp x pp`` ranks there are ``dp`` different batches per step, and the global batch
is the per-replica batch times ``dp``, not times the world size.  :func:`data_parallel_shard` and
:func:`data_parallel_generator` take the data-parallel rank and size (``mesh.rank("dp")``,
``mesh.size("dp")``); under plain data parallelism they are the global rank and world size.  Seeding by the
global rank instead gives two tensor-parallel peers different batches, and the row-parallel all-reduce adds up
partial results of two different batches: no error, just a wrong model.

**Per-rank seeds.**  Model initialisation must be *identical* on every rank (or broadcast from rank 0), but
randomness applied to *data* — augmentation, noise, dropout masks — must *differ*, or the ranks make the same
"random" choice for their samples in lock-step and a world of N ranks explores no more augmentations than
one.  :func:`seed_for_rank` is the usual fix (given the data-parallel rank, for the reason above);
:func:`augmentation_overlap` measures the bug.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field

import torch
from torch.utils.data import Dataset, DistributedSampler, TensorDataset

# 32 characters: a small vocabulary keeps the embedding tables of the tiny models tiny.
ALPHABET = "abcdefghijklmnopqrstuvwxyz .,;!?"
VOCAB_SIZE = len(ALPHABET)
_CHARACTER_INDEX = {character: index for index, character in enumerate(ALPHABET)}


def encode(text: str) -> torch.Tensor:
    """Characters of :data:`ALPHABET` -> a 1-D LongTensor of token ids."""
    unknown = sorted(set(text) - set(ALPHABET))
    if unknown:
        raise ValueError(f"characters {unknown!r} are not in the alphabet {ALPHABET!r}")
    return torch.tensor([_CHARACTER_INDEX[character] for character in text], dtype=torch.long)


def decode(tokens: torch.Tensor | list[int]) -> str:
    """Token ids -> text."""
    ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
    return "".join(ALPHABET[index] for index in ids)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


# --------------------------------------------------------------------------------------------------------
# Classification: Gaussian blobs


def make_classification(num_samples: int, num_features: int, num_classes: int, seed: int = 0,
                        separation: float = 3.0) -> TensorDataset:
    """Gaussian blobs: class ``c`` is ``N(center_c, I)``, centres drawn from ``N(0, (separation/sqrt(d))^2 I)``.

    Classes are balanced (sample ``i`` has class ``i % num_classes`` before shuffling).  Returns a
    ``TensorDataset(features float32 [num_samples, num_features], labels int64 [num_samples])``; the same
    arguments give the same tensors, and the global random state is not touched.
    """
    _check_positive(num_samples=num_samples, num_features=num_features, num_classes=num_classes)
    generator = torch.Generator().manual_seed(seed)
    centers = torch.randn(num_classes, num_features, generator=generator) * (separation / math.sqrt(num_features))
    labels = torch.arange(num_samples) % num_classes
    labels = labels[torch.randperm(num_samples, generator=generator)]
    features = centers[labels] + torch.randn(num_samples, num_features, generator=generator)
    return TensorDataset(features, labels)


# --------------------------------------------------------------------------------------------------------
# A character-level language whose best possible loss is known


@dataclass
class MarkovChain:
    """An order-1 Markov chain over ``vocab_size`` characters, built deterministically from ``seed``.

    Row ``i`` of ``transition`` is the distribution of the character after ``i``: ``successors`` randomly chosen
    characters share ``1 - smoothing`` with Dirichlet(1, ..., 1) weights, and ``smoothing`` is spread evenly
    over all characters.  ``transition`` is float64; rows sum to 1.
    """

    seed: int = 0
    vocab_size: int = VOCAB_SIZE
    successors: int = 4
    smoothing: float = 0.02
    transition: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check_positive(vocab_size=self.vocab_size, successors=self.successors)
        if self.successors > self.vocab_size:
            raise ValueError(f"successors must be <= vocab_size ({self.vocab_size}), got {self.successors}")
        if not 0.0 <= self.smoothing <= 1.0:
            raise ValueError(f"smoothing must be in [0, 1], got {self.smoothing!r}")
        generator = torch.Generator().manual_seed(self.seed)
        transition = torch.zeros(self.vocab_size, self.vocab_size, dtype=torch.float64)
        for row in transition:
            likely = torch.randperm(self.vocab_size, generator=generator)[: self.successors]
            # -log(uniform) is Exponential(1); normalised exponentials are a Dirichlet(1, ..., 1) draw.
            weights = -torch.rand(self.successors, generator=generator, dtype=torch.float64).log()
            row[likely] = (1.0 - self.smoothing) * weights / weights.sum()
        self.transition = transition + self.smoothing / self.vocab_size

    def stationary_distribution(self) -> torch.Tensor:
        """``pi`` with ``pi P = pi`` and ``sum(pi) = 1``, solved exactly (float64)."""
        size = self.vocab_size
        # (P^T - I) pi = 0 has a one-dimensional solution space; replace one equation by sum(pi) = 1.
        system = self.transition.T - torch.eye(size, dtype=torch.float64)
        system[-1] = 1.0
        right_hand_side = torch.zeros(size, dtype=torch.float64)
        right_hand_side[-1] = 1.0
        return torch.linalg.solve(system, right_hand_side)

    def entropy_rate(self) -> float:
        """The best achievable next-character loss, in nats per token: ``-sum_i pi_i sum_j P_ij log P_ij``."""
        p = self.transition
        row_entropy = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(dim=1)
        return float((self.stationary_distribution() * row_entropy).sum())

    def sample(self, length: int, seed: int = 0) -> torch.Tensor:
        """A 1-D LongTensor of ``length`` characters; the first is drawn from the stationary distribution.

        Sampling walks the chain one step at a time (inverse CDF with ``bisect``), about a million characters per
        second: plain Python beats a tensor op per step here.
        """
        _check_positive(length=length)
        generator = torch.Generator().manual_seed(seed)
        uniforms = torch.rand(length, generator=generator, dtype=torch.float64).tolist()
        rows = torch.cat([self.stationary_distribution()[None], self.transition]).cumsum(dim=1)
        rows[:, -1] = 1.0  # rounding must not leave a uniform draw above the last bucket
        cumulative = rows.tolist()
        state = bisect.bisect_right(cumulative[0], uniforms[0])
        tokens = [state]
        for uniform in uniforms[1:]:
            state = bisect.bisect_right(cumulative[state + 1], uniform)
            tokens.append(state)
        return torch.tensor(tokens, dtype=torch.long)

    def cross_entropy(self, tokens: torch.Tensor) -> float:
        """Mean ``-log P[x_t, x_t+1]`` over a sample: the loss of a perfect model.  Tends to ``entropy_rate()``."""
        if tokens.dim() != 1 or tokens.numel() < 2:
            raise ValueError(f"tokens must be 1-D with at least 2 entries, got shape {tuple(tokens.shape)}")
        return float(-self.transition[tokens[:-1], tokens[1:]].log().mean())


class CharDataset(Dataset):
    """Every window of ``block_size`` tokens as ``x``, the same window moved on by one as ``y`` (the targets)."""

    def __init__(self, tokens: torch.Tensor, block_size: int):
        _check_positive(block_size=block_size)
        if tokens.dim() != 1 or tokens.numel() <= block_size:
            raise ValueError(f"tokens must be 1-D and longer than block_size={block_size}, "
                             f"got shape {tuple(tokens.shape)}")
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return self.tokens.numel() - self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} windows")
        index %= len(self)
        window = self.tokens[index: index + self.block_size + 1]
        return window[:-1], window[1:]


def batches(tokens: torch.Tensor, batch_size: int, block_size: int,
            generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One random batch: ``batch_size`` windows at random offsets, ``x`` and ``y`` both ``[batch_size, block_size]``.

    The training loops' sampler (nanoGPT's ``get_batch``): cheaper than a DataLoader over :class:`CharDataset`,
    and a ``generator`` from :func:`data_parallel_generator` gives each data-parallel replica its own batches.
    """
    _check_positive(batch_size=batch_size, block_size=block_size)
    if tokens.dim() != 1 or tokens.numel() <= block_size:
        raise ValueError(f"tokens must be 1-D and longer than block_size={block_size}, got shape {tuple(tokens.shape)}")
    starts = torch.randint(tokens.numel() - block_size, (batch_size,), generator=generator)
    offsets = torch.arange(block_size + 1)
    windows = tokens[starts[:, None] + offsets]
    return windows[:, :-1], windows[:, 1:]


# --------------------------------------------------------------------------------------------------------
# Sharding and per-rank seeds


def data_parallel_shard(dataset_len: int, dp_rank: int, dp_size: int, epoch: int, shuffle: bool = True,
                        seed: int = 0, drop_last: bool = False) -> list[int]:
    """The indices data-parallel replica ``dp_rank`` of ``dp_size`` reads in ``epoch``: what its
    ``DistributedSampler(num_replicas=dp_size, rank=dp_rank)`` yields.

    Every rank with the same data-parallel rank (its tensor- and pipeline-parallel peers) gets the same list.
    ``ceil(dataset_len / dp_size)`` indices (``drop_last=False``: the list is padded with indices from its
    start) or ``floor(...)`` (``drop_last=True``: the tail is dropped).  No process group is needed.
    """
    _check_positive(dataset_len=dataset_len)
    _check_data_parallel_rank(dp_rank, dp_size)
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
    sampler = DistributedSampler(range(dataset_len), num_replicas=dp_size, rank=dp_rank, shuffle=shuffle,
                                 seed=seed, drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(sampler)


def shard_with_distributed_sampler(dataset_len: int, world_size: int, epoch: int, shuffle: bool = True,
                                   seed: int = 0, drop_last: bool = False) -> list[list[int]]:
    """The indices each rank's ``DistributedSampler`` yields in ``epoch``: ``result[rank]`` is rank's list
    (:func:`data_parallel_shard` for every rank of a plain data-parallel world)."""
    _check_positive(world_size=world_size)
    return [data_parallel_shard(dataset_len, rank, world_size, epoch, shuffle, seed, drop_last)
            for rank in range(world_size)]


def data_parallel_generator(seed: int, dp_rank: int, dp_size: int) -> torch.Generator:
    """The generator a rank draws its batches from (``batches(tokens, ..., generator)``), seeded with
    ``seed_for_rank(seed, dp_rank)``: different for each data-parallel replica, the same for the tensor- and
    pipeline-parallel ranks within one, which therefore draw identical batches step after step.

    ``dp_rank`` and ``dp_size`` are ``mesh.rank("dp")`` and ``mesh.size("dp")`` (under plain data
    parallelism: ``dist.rank()`` and ``dist.world_size()``).
    """
    _check_data_parallel_rank(dp_rank, dp_size)
    return torch.Generator().manual_seed(seed_for_rank(seed, dp_rank))


def _check_data_parallel_rank(dp_rank: int, dp_size: int) -> None:
    _check_positive(dp_size=dp_size)
    if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be an integer in [0, dp_size={dp_size}), got {dp_rank!r} (pass the "
                         f"data-parallel rank, e.g. mesh.rank('dp'), not the global rank)")


def seed_for_rank(seed: int, rank: int) -> int:
    """``seed + rank``: the seed for rank ``rank``'s *data* randomness (augmentation, noise, batch sampling).

    Distinct per rank, so the ranks draw different augmentations; reproducible, so a rerun with the same world
    size replays every rank exactly.  Never use it for parameter initialisation, which must be the same on all
    ranks.  The cost of the simple formula: (seed 0, rank 1) and (seed 1, rank 0) share a stream, so runs meant to
    be independent should use seeds further apart than the world size.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be an integer >= 0, got {rank!r}")
    return seed + rank


def augmentation_overlap(num_ranks: int, same_seed: bool, samples_per_rank: int = 64, seed: int = 0) -> float:
    """The fraction of augmentation draws that are identical between ranks; 1.0 exposes the shared-seed bug.

    Simulates ``num_ranks`` ranks, each augmenting its own ``samples_per_rank`` samples as an image pipeline
    would: a random crop offset (top, left) in a 4-pixel padding, a random horizontal flip and a brightness
    factor in [0.8, 1.2].  Each rank's generator is seeded with ``seed`` (``same_seed=True``, the bug) or
    :func:`seed_for_rank` (the fix).  The ranks hold different samples, but with one seed sample ``i`` on every
    rank gets the same crop, flip and brightness.  Returns the fraction, over all pairs of ranks and all sample
    positions, of draws that are identical: 1.0 with a shared seed, about 0 with per-rank seeds.
    """
    _check_positive(samples_per_rank=samples_per_rank)
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 2:
        raise ValueError(f"num_ranks must be an integer >= 2 (overlap is between ranks), got {num_ranks!r}")
    draws = []
    for rank in range(num_ranks):
        generator = torch.Generator().manual_seed(seed if same_seed else seed_for_rank(seed, rank))
        crop = torch.randint(0, 9, (samples_per_rank, 2), generator=generator).double()
        flip = torch.randint(0, 2, (samples_per_rank, 1), generator=generator).double()
        brightness = 0.8 + 0.4 * torch.rand(samples_per_rank, 1, generator=generator, dtype=torch.float64)
        draws.append(torch.cat([crop, flip, brightness], dim=1))
    identical = [(draws[a] == draws[b]).all(dim=1).double().mean()
                 for a, b in itertools.combinations(range(num_ranks), 2)]
    return float(torch.stack(identical).mean())
