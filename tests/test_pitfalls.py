"""labkit.pitfalls: each pitfall measured, and caught where it can be."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as torch_dist

from labkit import pitfalls
from labkit.launch import launch
from labkit.models import MLPConfig, TinyMLP

CONFIG = MLPConfig(in_features=8, hidden_sizes=(16,), num_classes=3)


def _replicas(same_seed: bool) -> tuple[dict[str, float], str]:
    model = TinyMLP(CONFIG, seed=0 if same_seed else torch_dist.get_rank())
    differences = pitfalls.replica_differences(model)
    try:
        pitfalls.check_replicas_identical(model)
    except RuntimeError as error:
        return differences, str(error)
    return differences, ""


def test_replicas_initialised_with_different_seeds_are_measured_and_caught():
    for differences, message in launch(_replicas, False, nprocs=3, rank_output="none"):
        assert all(gap > 0 for name, gap in differences.items() if "weight" in name)
        assert "the replicas differ" in message and "weight" in message and "broadcast" in message
    for differences, message in launch(_replicas, True, nprocs=3, rank_output="none"):
        assert set(differences.values()) == {0.0} and message == ""


def test_the_duplicate_fraction_counts_samples_another_rank_drew_too():
    assert pitfalls.duplicate_fraction([[0, 1], [2, 3], [4, 5]]) == 0.0
    assert pitfalls.duplicate_fraction([[0, 1, 2]] * 4) == 1.0
    assert pitfalls.duplicate_fraction([[0, 1], [1, 2]]) == 0.5
    with pytest.raises(ValueError, match="at least two ranks"):
        pitfalls.duplicate_fraction([[1, 2]])


def test_averaging_over_more_ranks_changes_the_last_bits_but_one_rank_is_itself():
    per_sample = torch.randn(48, 2000, generator=torch.Generator().manual_seed(0))
    gaps = pitfalls.reduction_order_gaps(per_sample, [1, 2, 4, 8])
    assert gaps[1] == 0.0 and max(gaps[w] for w in (2, 4, 8)) > 0.0
    assert max(gaps.values()) < 1e-5  # the last bits, not the value
    with pytest.raises(ValueError, match=r"world sizes \[5, 0\] do not divide the 48 samples"):
        pitfalls.reduction_order_gaps(per_sample, [2, 5, 0])


def _write(path: str, atomic: bool) -> dict:
    return pitfalls.write_from_every_rank(path, size=1 << 16, atomic=atomic)


def test_every_rank_writing_one_file_leaves_one_ranks_bytes_or_a_mixture(tmp_path):
    for found in launch(_write, str(tmp_path / "atomic.pt"), True, nprocs=3, rank_output="none"):
        assert found["size"] == 1 << 16 and len(found["ranks"]) == 1  # the last rename wins, whole
    for found in launch(_write, str(tmp_path / "racy.pt"), False, nprocs=3, rank_output="none"):
        assert found["size"] == 1 << 16 and set(found["ranks"]) <= {0, 1, 2}
