"""labkit.pitfalls: each pitfall measured, and caught where it can be."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as torch_dist

from labkit import pitfalls
from labkit.launch import RankFailed, launch
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


def _save(path: str, how: str) -> dict:
    return pitfalls.save_from_every_rank(path, how, size=1 << 16)


def test_every_rank_saving_one_path_keeps_one_ranks_state_at_most_and_gathering_keeps_all(tmp_path):
    for how, expected_holds in (("in place", None), ("through a rename", 1), ("gathered to rank 0", 3)):
        found = launch(_save, str(tmp_path / f"{how}.pt"), how, nprocs=3, rank_output="none")
        reads = [one.pop("read") for one in found]  # what each rank took back as its own state
        assert all(one == found[0] for one in found)  # every rank read the same file
        assert found[0]["returned"] == [0, 1, 2]  # every rank's save returned, without an error
        if expected_holds is None:  # in place: one rank's whole state, or a torn file
            assert len(found[0]["holds"]) <= 1 and (found[0]["torn"] or len(found[0]["holds"]) == 1)
        else:
            assert len(found[0]["holds"]) == expected_holds and not found[0]["torn"]
        if how == "through a rename":  # every rank reads the one survivor's state: the other two, not their own
            assert reads == found[0]["holds"] * 3 and sum(read != rank for rank, read in enumerate(reads)) == 2
        elif expected_holds is None:
            assert reads == (found[0]["holds"] * 3 if found[0]["holds"] else [None] * 3)
    assert found[0]["holds"] == [0, 1, 2] and reads == [0, 1, 2]  # gathered: every rank reads its own back
    with pytest.raises(RankFailed, match="how must be one of"):
        launch(pitfalls.save_from_every_rank, str(tmp_path / "x.pt"), "twice", nprocs=2, rank_output="none")
