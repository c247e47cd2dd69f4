"""Exercise 12 — the seed of one sample's augmentation (solution).  See ``exercises/12_input_pipeline.py``."""

import hashlib
import struct


def sample_seed(seed: int, dp_rank: int, epoch: int, index: int) -> int:
    """The seed of the augmentation of sample ``index`` on data-parallel rank ``dp_rank`` in ``epoch`` of a run
    seeded ``seed``: distinct for distinct keys, the same in every process, in ``[0, 2**63)``."""
    key = struct.pack("<4Q", seed, dp_rank, epoch, index)  # 8 bytes each: two different keys never read alike
    digest = hashlib.blake2b(key, digest_size=8).digest()  # a hash with no per-process salt, unlike hash(str)
    return int.from_bytes(digest, "little") >> 1  # 63 bits, what torch.Generator.manual_seed takes
