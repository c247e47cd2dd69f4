"""labkit.dist: runtime facts with and without a process group, and backend choice."""

from __future__ import annotations

import pytest
import torch

from labkit import dist


def test_without_a_group_this_is_rank_zero_of_one(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert (dist.rank(), dist.world_size(), dist.local_rank(), dist.is_main()) == (0, 1, 0, True)
    assert dist.backend() is None
    expected = "cuda:0" if dist.gpus_available() else "cpu"
    assert str(dist.device()) == expected


def test_without_a_group_the_torchrun_environment_is_used(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert (dist.rank(), dist.world_size(), dist.local_rank(), dist.is_main()) == (5, 8, 1, False)
    assert "rank 5/8 (local 1)" in dist.describe()


@pytest.mark.parametrize("bad", ["mpi-ish", "", None, 3, "glooo"])
def test_resolve_backend_rejects_unknown_names(bad):
    with pytest.raises(ValueError, match="backend must be one of"):
        dist.resolve_backend(bad)


def test_resolve_backend_accepts_any_case_and_prefers_gloo_without_gpus():
    assert dist.resolve_backend("GLOO", 4) == "gloo"
    if not torch.cuda.is_available():
        assert dist.resolve_backend("auto", 1) == "gloo"
        with pytest.raises(ValueError, match="one GPU per rank"):
            dist.resolve_backend("nccl", 1)
