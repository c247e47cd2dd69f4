"""labkit.loader: per-sample augmentation seeds, the epoch sampler, the step loader (the same batches whatever the
workers, and on resume), the seeding pitfall shown with real DataLoader workers, the stall's model and simulation,
and the trainer's --workers/--data-ms flags."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from labkit import data, loader, train
from labkit.launch import launch
from tests.conftest import REPO


def test_sample_seeds_are_distinct_on_a_grid_of_ranks_epochs_and_indices_and_fit_a_generator():
    keys = [(rank, epoch, index) for rank in range(8) for epoch in range(4) for index in range(300)]
    seeds = [loader.sample_seed(7, *key) for key in keys]
    assert len(set(seeds)) == len(keys)
    assert all(0 <= seed < 2**63 for seed in seeds)
    huge = loader.sample_seed(2**62, 10**6, 10**4, 10**9)  # large values neither overflow nor fail
    torch.Generator().manual_seed(huge)
    assert loader.sample_seed(0, 1, 0, 0) != loader.sample_seed(0, 0, 0, 1)  # seed + rank + index would collide


def test_sample_seeds_are_the_same_in_another_process_whatever_its_hash_salt():
    here = [loader.sample_seed(3, rank, 1, 11) for rank in range(4)]
    code = "from labkit import loader; print([loader.sample_seed(3, rank, 1, 11) for rank in range(4)])"
    for salt in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                             env={**os.environ, "PYTHONHASHSEED": salt}).stdout
        assert out.strip() == str(here)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_sample_seed_refuses_what_is_not_a_non_negative_integer(bad):
    with pytest.raises(ValueError, match="must be an integer >= 0"):
        loader.sample_seed(0, 0, bad, 0)


def test_the_epoch_sampler_pairs_the_distributed_samplers_indices_with_the_epoch_and_resumes_mid_epoch():
    sampler = loader.EpochSampler(103, dp_rank=1, dp_size=4, seed=5)
    sampler.set_epoch(2)
    expected = data.data_parallel_shard(103, 1, 4, 2, seed=5, drop_last=True)
    assert list(sampler) == [(2, index) for index in expected] and len(sampler) == 25
    sampler.set_epoch(2, start=10)
    assert list(sampler) == [(2, index) for index in expected[10:]] and len(sampler) == 15


def dataset(units: int = 0, dp_rank: int = 0, seeding: str = "per-sample") -> loader.CostlyDataset:
    samples = data.make_classification(40, 3, 2, seed=1)
    return loader.CostlyDataset(loader.JitteredSamples(*samples.tensors), units, seed=3, dp_rank=dp_rank,
                                seeding=seeding)


def batches(steps: range, **settings) -> list[torch.Tensor]:
    step_loader = loader.StepLoader(dataset(), 4, dp_rank=1, dp_size=2, seed=3, **settings)  # 5 batches an epoch
    try:
        return [step_loader(step)[0] for step in steps]
    finally:
        step_loader.close()


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("settings", [{"num_workers": 2}, {"num_workers": 3, "persistent_workers": True,
                                                           "prefetch_factor": 1}])
def test_the_step_loader_gives_the_same_batches_with_or_without_workers_and_from_any_starting_step(settings):
    alone = batches(range(1, 13))  # three epochs: 5 + 5 + 2 batches
    assert all(not torch.equal(a, b) for a, b in zip(alone, alone[5:], strict=False))  # epochs reshuffle, re-augment
    assert all(torch.equal(a, b) for a, b in zip(alone, batches(range(1, 13), **settings), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(alone[6:], batches(range(7, 13), **settings), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(alone[3:], batches(range(4, 13)), strict=True))


def test_the_step_loader_refuses_a_shard_smaller_than_one_batch():
    with pytest.raises(ValueError, match="fewer than one batch of 32"):
        loader.StepLoader(dataset(), 32, dp_rank=0, dp_size=2)


def test_torchs_worker_seeding_repeats_every_ranks_augmentation_and_per_sample_seeds_do_not():
    for workers in (0, 2):
        shared = loader.augmentation_draws("worker", ranks=3, workers=workers)
        assert loader.identical_fraction(shared[:, 0]) == 1.0  # every rank drew the same noise, sample by sample
        assert loader.identical_fraction(shared[0]) == 0.0  # but the epochs differ...
        reseeded = loader.augmentation_draws("worker", ranks=2, workers=workers, reseed_each_epoch=True)
        assert loader.identical_fraction(reseeded[0]) == 1.0  # ... unless the generator is reseeded each epoch
        keyed = loader.augmentation_draws("per-sample", ranks=3, workers=workers, reseed_each_epoch=True)
        assert loader.identical_fraction(keyed[:, 0]) == 0.0 and loader.identical_fraction(keyed[0]) == 0.0
        assert keyed.flatten().unique().numel() == keyed.numel()  # every rank, epoch and worker draws its own
    assert torch.equal(loader.augmentation_draws("per-sample", workers=4), loader.augmentation_draws("per-sample",
                                                                                                      workers=0))


def test_the_stall_model_and_the_simulated_loaders_steady_state_agree():
    assert loader.stall_model(0.04, 0.01, 0) == 0.04
    assert loader.stall_model(0.04, 0.01, 2) == pytest.approx(0.01)
    assert loader.stall_model(0.04, 0.01, 4) == 0.0
    assert loader.stall_model(0.04, 0.02, 4, cores=2) == pytest.approx(0.01)  # 60 ms of work on 2 cores: 30 ms
    for t_data, t_compute, workers, prefetch in [(0.04, 0.01, 1, 2), (0.04, 0.01, 3, 1), (0.01, 0.03, 2, 2),
                                                  (0.05, 0.02, 2, 4), (0.02, 0.02, 0, 2)]:
        timeline = loader.simulate_loader(t_data, t_compute, workers, prefetch, steps=40)
        assert timeline.waits[0] == pytest.approx(t_data)  # the first batch is waited for in full
        steady = timeline.waits[-12:]  # whole cycles of 1, 2, 3 or 4 workers: the waits repeat with the workers
        assert sum(steady) / 12 == pytest.approx(loader.stall_model(t_data, t_compute, workers), abs=1e-12)


def test_the_simulated_loader_keeps_the_dataloaders_rules():
    timeline = loader.simulate_loader(0.01, 0.05, workers=2, prefetch_factor=2, steps=20)
    for batch, (worker, start, end) in enumerate(timeline.batches):
        assert worker == batch % 2 and end - start == pytest.approx(0.01)
        if batch >= 4:  # requested when batch - 4 was taken: never more than workers x prefetch ahead
            assert start >= timeline.step_starts[batch - 4] + timeline.waits[batch - 4] - 1e-12
    with pytest.raises(ValueError, match="workers must be an integer >= 0"):
        loader.simulate_loader(0.01, 0.01, workers=-1)


def test_measure_stall_runs_a_real_loop_and_reports_seconds():
    measured = loader.measure_stall(0.002, 0.001, workers=1, steps=6, warmup=2)
    assert set(measured) == {"wait_s", "step_s"} and measured["step_s"] > 0 and measured["wait_s"] >= 0


def trained(**settings) -> list[dict]:
    config = train.TrainConfig(strategy="ddp", model="tiny-mlp", log_every=100, batch_size=1024, **settings)
    config.validate()
    return launch(train.train, config, nprocs=2, rank_output="none")


def test_the_trainer_reads_the_same_batches_through_any_number_of_workers_and_resumes_them(tmp_path):
    alone = trained(steps=5, workers=0)  # 2 batches an epoch per rank: five steps cross two epoch boundaries
    workers = trained(steps=5, workers=2, data_ms=0.2, persistent_workers=True)
    assert [result["losses"] for result in workers] == [result["losses"] for result in alone]
    assert alone[0]["losses"] != alone[1]["losses"]  # each rank its own shard
    trained(steps=3, workers=1, checkpoint_dir=str(tmp_path), save_every=3)
    resumed = trained(steps=5, workers=2, resume="latest", checkpoint_dir=str(tmp_path))
    assert [result["losses"] for result in resumed] == [result["losses"][3:] for result in alone]


@pytest.mark.parametrize("flags, message", [
    (["--workers", "-1"], "--workers must be an integer >= 0"),
    (["--data-ms", "-2"], "--data-ms must be a finite number >= 0"),
    (["--workers", "1", "--prefetch-factor", "0"], "--prefetch-factor must be an integer >= 1"),
    (["--persistent-workers"], "need worker processes"),
    (["--workers", "0", "--prefetch-factor", "4"], "need worker processes"),
])
def test_bad_input_pipeline_flags_are_refused_before_any_process_starts(flags, message, capsys):
    assert train.main(["--model", "tiny-mlp", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("t_data, t_compute", [(0.060, 0.020), (0.0907, 0.0308), (0.050, 0.020), (0.068, 0.020)])
def test_the_lessons_stall_checks_reject_the_rival_model_each_names(t_data, t_compute):
    """Lesson 12's costs (nominal, as measured, and either side): a step measured at the core-limited model's time
    passes STEP_BANDS[W], one at the unlimited-core model's or the no-overlap baseline's fails it at 2 and 4 workers on
    2 cores; the formula's wait
    with one worker passes OVERLAP_LIMIT, a worker that overlapped a twentieth of the batch (and none) fails it."""
    for workers in (2, 4):
        cored = t_compute + loader.stall_model(t_data, t_compute, workers, cores=2)
        unlimited = t_compute + loader.stall_model(t_data, t_compute, workers)
        assert loader.STEP_BANDS[workers].contains(cored, cored)
        assert not loader.STEP_BANDS[workers].contains(unlimited, cored), (workers, unlimited / cored)
        assert not loader.STEP_BANDS[workers].contains(t_data + t_compute, cored)  # workers that change nothing
    formula = loader.stall_model(t_data, t_compute, 1) / loader.stall_model(t_data, t_compute, 0)
    assert formula < loader.OVERLAP_LIMIT <= 0.95 <= 1.0
