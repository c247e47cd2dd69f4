"""Exercise 12 — the seed of one sample's augmentation.

A data-parallel run augments every sample at random (a crop, a flip, noise), in ``DataLoader`` worker processes,
on every rank.  The randomness must be

- **different** for every data-parallel rank, epoch and sample: ranks that crop in lock-step, or epochs that
  repeat the last one's crops, see fewer augmentations than the run pays for;
- **the same** on a rerun, on a resume at any step, and whichever worker process (and however many) makes the
  sample: a run that cannot be replayed cannot be debugged.

PyTorch's default, a generator per worker seeded ``base_seed + worker_id`` with ``base_seed`` drawn from the
training process's generator, fails both on a distributed run (lesson 12 shows how).  The fix is to give each
sample its own generator, seeded from what identifies the sample in the run::

    generator = torch.Generator().manual_seed(sample_seed(seed, dp_rank, epoch, index))

Write ``sample_seed``.  It must return a Python ``int`` in ``[0, 2**63)``, what ``manual_seed`` takes (it refuses
numpy's integers), give two different keys two different seeds, and give the same seed in every process: in a
``DataLoader`` worker, in another interpreter (where Python's ``hash`` of a string is salted differently), on
another machine, next week.  ``seed``, ``dp_rank``, ``epoch`` and ``index`` are integers from 0 to ``2**62``.

The checks try 4.5 million keys, as many as a short run draws, and look for any two alike: think of what a sum,
an xor or numbers written out one after the other do there.  A hash of ``b`` bits gives about ``n^2 / 2^(b+1)``
pairs alike among ``n`` keys by chance (the birthday bound): a 32-bit one thousands, a 40-bit one about nine
(passing 700,000 keys by luck, failing a real run's hundreds of millions), so the checks also look at the width:
every one of the 63 bits must be 0 in some seeds and 1 in others.  And they import your file as on other hosts
and on later days: nothing of the machine or the clock may enter the seed.

(torch's CPU generator keeps only the low 32 bits of a seed, so distinct seeds give at most 2**32 distinct streams
and a few samples in a large run share their augmentation by chance.  That is the CPU generator's limit, harmless
noise; a generator that takes 64 bits (CUDA's Philox, numpy's) uses the whole seed, so the checks hold the seed
itself to 63 bits.)

Then run the grading cell of ``notebooks/12_monitoring_and_input_pipeline.ipynb`` (or ``labkit grade``).  While
the checks run, labkit's own ``labkit.loader.sample_seed`` is switched off, however it is loaded: the answer must
be yours.  The standard library has what you need (``hashlib``, ``struct``, or integer arithmetic of your own).
"""


def sample_seed(seed: int, dp_rank: int, epoch: int, index: int) -> int:
    """The seed of the augmentation of sample ``index`` on data-parallel rank ``dp_rank`` in ``epoch`` of a run
    seeded ``seed``: distinct for distinct keys, the same in every process, in ``[0, 2**63)``."""
    # TODO: turn the four numbers into one 63-bit integer so that no two keys share it and no process sees
    #       another value.
    raise NotImplementedError("sample_seed")
