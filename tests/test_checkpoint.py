"""labkit.checkpoint: exact resume (bit for bit) across new processes, atomic saves that survive SIGKILL, and
clear errors for damaged or mismatched checkpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist

from labkit import checkpoint, data
from labkit.launch import RankFailed, launch
from labkit.lr import warmup_then_decay
from labkit.mesh import Mesh
from labkit.models import GPTConfig, TinyGPT
from labkit.parallel.base import SingleProcess
from labkit.parallel.ddp import DistributedDataParallel
from labkit.parallel.fsdp import FullyShardedDataParallel
from labkit.parallel.tensor import parallelize_tensor
from labkit.parallel.zero import ZeroDataParallel
from labkit.precision import DynamicLossScaler
from tests.conftest import REPO

TOTAL, HALF = 8, 4
VOCAB = 30  # tensor parallelism over 4 ranks pads it to 32: the checkpoints must leave the padding out
WRAPPERS = {"single": SingleProcess, "ddp": DistributedDataParallel,
            "zero1": lambda module: ZeroDataParallel(module, stage=1),
            "zero2": lambda module: ZeroDataParallel(module, stage=2), "fsdp": FullyShardedDataParallel,
            "tp": lambda module: parallelize_tensor(module, Mesh(tp=torch_dist.get_world_size()))}


def _data_rank() -> tuple[int, int]:
    """This rank's (rank, size) for data and dropout: every rank its own, except tensor parallelism's ranks,
    which share one batch and one default generator."""
    return (torch_dist.get_rank(), torch_dist.get_world_size()) if torch_dist.is_initialized() else (0, 1)


def _train(strategy: str, steps: int, save_at: int | None = None, resume: str | None = None,
           directory: str | None = None, layout: str = "full") -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train TinyGPT 100k with dropout, AdamW, warmup then cosine decay and a dynamic loss scaler whose scale
    grows every other step, each rank on its own batches; save at ``save_at``, or resume from ``resume``."""
    torch.set_num_threads(1)
    rank, world = (0, 1) if strategy == "tp" else _data_rank()
    torch.manual_seed(100 + rank)  # dropout's stream: different on every rank (tensor parallelism: its own)
    config = GPTConfig.preset("100k", dropout=0.1, vocab_size=VOCAB)
    model = WRAPPERS[strategy](TinyGPT(config, seed=0))
    optimizer = model.make_optimizer(torch.optim.AdamW, lr=3e-3, weight_decay=0.1)
    scheduler = warmup_then_decay(optimizer, total_steps=TOTAL, warmup_steps=3)
    scaler = DynamicLossScaler(init_scale=2.0 ** 8, growth_interval=2)
    generator = data.data_parallel_generator(0, rank, world)
    tokens = data.MarkovChain(vocab_size=config.vocab_size).sample(5_000, seed=0)
    start = 0
    if resume is not None:
        start = checkpoint.load(resume, model, optimizer, scheduler=scheduler, scaler=scaler,
                                generators={"data": generator}).step
    losses = []
    for step in range(start, steps):
        inputs, targets = data.batches(tokens, 4, config.block_size, generator)
        loss = model(inputs, targets)[1]
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        losses.append(loss.item())
        if save_at == step + 1:
            checkpoint.save(checkpoint.step_directory(directory, step + 1), model, optimizer, step + 1,
                            scheduler=scheduler, scaler=scaler, generators={"data": generator},
                            extra={"strategy": strategy}, layout=layout)
    return losses, {name: tensor.clone() for name, tensor in model.full_state_dict().items()}


@pytest.mark.parametrize("strategy, ranks, layout", [
    ("single", 1, "full"), ("ddp", 2, "full"), ("zero1", 2, "full"), ("zero2", 2, "full"), ("fsdp", 2, "full"),
    ("fsdp", 3, "full"), ("tp", 2, "full"), ("single", 1, "sharded"), ("ddp", 2, "sharded"),
    ("zero1", 2, "sharded"), ("fsdp", 3, "sharded"), ("tp", 4, "sharded")])
def test_a_resumed_run_is_bit_identical_to_one_that_never_stopped(strategy, ranks, layout, tmp_path):
    straight = launch(_train, strategy, TOTAL, nprocs=ranks, rank_output="none")
    first = launch(_train, strategy, HALF, HALF, None, str(tmp_path), layout, nprocs=ranks, rank_output="none")
    saved = checkpoint.latest(tmp_path)
    assert saved == checkpoint.step_directory(tmp_path, HALF)
    resumed = launch(_train, strategy, TOTAL, None, str(saved), nprocs=ranks, rank_output="none")
    for rank in range(ranks):
        assert first[rank][0] == straight[rank][0][:HALF]
        assert resumed[rank][0] == straight[rank][0][HALF:], (strategy, rank)  # floats: bit for bit
        for name, tensor in straight[rank][1].items():
            assert torch.equal(resumed[rank][1][name], tensor), (strategy, rank, name)
    distinct = 1 if strategy == "tp" else ranks  # each rank trained on its own batches (tp: the ranks' one)
    assert len({tuple(losses) for losses, _ in straight}) == distinct


def _forget(what: str, strategy: str, directory: str) -> list[float]:
    """Resume, then undo one part of the restore: what a resume that forgets it would do."""
    torch.set_num_threads(1)
    rank = torch_dist.get_rank() if torch_dist.is_initialized() else 0
    fresh_rng = torch.get_rng_state()
    fresh_generator = data.data_parallel_generator(0, rank, 1).get_state()
    original = checkpoint.load

    def forgetful(*args, **kwargs):
        resumed = original(*args, **kwargs)
        if what == "rng":
            torch.set_rng_state(fresh_rng)
        else:
            kwargs["generators"]["data"].set_state(fresh_generator)
        return resumed

    checkpoint.load = forgetful
    try:
        return _train(strategy, TOTAL, None, directory)[0]
    finally:
        checkpoint.load = original


@pytest.mark.parametrize("what", ["rng", "sampler"])
def test_forgetting_the_rng_or_the_sampler_position_changes_the_resumed_losses(what, tmp_path):
    straight = launch(_train, "single", TOTAL, nprocs=1, rank_output="none")[0][0]
    launch(_train, "single", HALF, HALF, None, str(tmp_path), nprocs=1, rank_output="none")
    resumed = launch(_forget, what, "single", str(checkpoint.latest(tmp_path)), nprocs=1, rank_output="none")[0]
    assert resumed != straight[HALF:]


def _single_save(directory: str, step: int = HALF, preset: str = "100k") -> None:
    model = SingleProcess(TinyGPT(GPTConfig.preset(preset), seed=0))
    optimizer = model.make_optimizer(torch.optim.AdamW, lr=1e-3)
    checkpoint.save(directory, model, optimizer, step)


def _single_load(directory: str, preset: str = "100k") -> int:
    model = SingleProcess(TinyGPT(GPTConfig.preset(preset), seed=1))
    optimizer = model.make_optimizer(torch.optim.AdamW, lr=1e-3)
    return checkpoint.load(directory, model, optimizer).step


def test_a_damaged_checkpoint_is_an_error_naming_the_file_and_what_is_wrong(tmp_path):
    _single_save(tmp_path / "good")
    assert _single_load(tmp_path / "good") == HALF
    state = tmp_path / "good" / checkpoint.STATE
    data_bytes = state.read_bytes()
    state.write_bytes(data_bytes[: len(data_bytes) // 2])
    with pytest.raises(checkpoint.CheckpointError, match=r"state\.pt: truncated or overwritten"):
        _single_load(tmp_path / "good")
    state.write_bytes(data_bytes[:100] + bytes([data_bytes[100] ^ 1]) + data_bytes[101:])
    with pytest.raises(checkpoint.CheckpointError, match=r"state\.pt: corrupted"):
        _single_load(tmp_path / "good")
    state.unlink()
    with pytest.raises(checkpoint.CheckpointError, match=r"state\.pt: missing"):
        _single_load(tmp_path / "good")
    (tmp_path / "good" / checkpoint.MANIFEST).unlink()
    with pytest.raises(checkpoint.CheckpointError, match="not a finished checkpoint"):
        _single_load(tmp_path / "good")
    with pytest.raises(checkpoint.CheckpointError, match="no such checkpoint directory"):
        _single_load(tmp_path / "absent")


def test_check_compatible_finds_every_missing_or_resized_file_without_reading_it(tmp_path, monkeypatch):
    """A sharded checkpoint's lost shard was found only by the rank that read it; check_compatible, run before any
    rank starts, now finds it with one stat a file, and opens none of them."""
    model = SingleProcess(TinyGPT(GPTConfig.preset("100k"), seed=0))
    checkpoint.save(tmp_path, model, model.make_optimizer(torch.optim.AdamW, lr=1e-3), HALF, layout="sharded")
    shapes = {name: tensor.shape for name, tensor in model.full_state_dict().items()}
    shard, common = tmp_path / checkpoint.shard_file(0, 1), tmp_path / checkpoint.COMMON
    sizes = {file: file.stat().st_size for file in (shard, common)}

    def no_read(*args, **kwargs):
        raise AssertionError("check_compatible read a file's bytes")

    monkeypatch.setattr(Path, "read_bytes", no_read)
    assert checkpoint.check_compatible(tmp_path, shapes, 1)["layout"] == "sharded"
    with open(common, "ab") as handle:
        handle.write(b"x")
    with pytest.raises(checkpoint.CheckpointError, match=rf"common\.pt: truncated or overwritten: "
                                                         rf"{sizes[common] + 1:,} bytes, the manifest says"):
        checkpoint.check_compatible(tmp_path, shapes, 1)
    shard.unlink()
    with pytest.raises(checkpoint.CheckpointError, match=rf"shard-00000-of-00001\.pt: missing \(the manifest lists it, "
                                                         rf"{sizes[shard]:,} bytes\)"):
        checkpoint.check_compatible(tmp_path, shapes, 1)


def test_a_checkpoint_of_another_model_shape_is_refused_naming_the_tensor(tmp_path):
    _single_save(tmp_path / "small")
    with pytest.raises(checkpoint.CheckpointError, match=r"a different model shape: .* is \(.*\) in the checkpoint"):
        _single_load(tmp_path / "small", preset="1m")


def test_a_full_checkpoint_refuses_another_world_size(tmp_path):
    _single_save(tmp_path / "one")
    with pytest.raises(RankFailed, match="saved on 1 rank"):
        launch(_load_on_two, str(tmp_path / "one"), nprocs=2, rank_output="none")


def _load_on_two(directory: str) -> None:
    model = DistributedDataParallel(TinyGPT(GPTConfig.preset("100k"), seed=0))
    checkpoint.load(directory, model, model.make_optimizer(torch.optim.AdamW, lr=1e-3))


def test_bad_steps_are_refused_before_anything_is_written(tmp_path):
    model = SingleProcess(TinyGPT(GPTConfig.preset("100k"), seed=0))
    optimizer = model.make_optimizer(torch.optim.AdamW, lr=1e-3)
    for step in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="step must be an integer >= 0"):
            checkpoint.save(tmp_path / "x", model, optimizer, step)
    assert not (tmp_path / "x").exists()


SAVER = """
import sys, torch
from labkit import checkpoint
state = {"weights": torch.randn(2_000_000)}
root = sys.argv[1]
step = 0
while True:
    step += 1
    directory = checkpoint.step_directory(root, step)
    directory.mkdir(parents=True)
    files = {"state.pt": checkpoint.write_atomically(directory / "state.pt", checkpoint.serialise(state))}
    manifest = {"format": checkpoint.FORMAT, "layout": "full", "step": step, "world_size": 1, "files": files,
                "model": {}}
    checkpoint.write_atomically(directory / "manifest.json", __import__("json").dumps(manifest).encode())
    print(step, flush=True)
"""


def test_a_process_killed_mid_save_leaves_the_last_checkpoint_whole_and_latest_skips_the_unfinished(tmp_path):
    for delay in (0.3, 0.55, 0.8):
        root = tmp_path / f"run-{delay}"
        saver = subprocess.Popen([sys.executable, "-c", SAVER, str(root)], cwd=REPO, stdout=subprocess.PIPE,
                                 text=True)
        assert saver.stdout.readline()  # one save finished
        time.sleep(delay)
        os.kill(saver.pid, signal.SIGKILL)  # no finally, no atexit: whatever was being written stays half-written
        saver.wait(10)
        found = checkpoint.latest(root)
        manifest = checkpoint.read_manifest(found)
        assert checkpoint.read_file(found, "state.pt", manifest)["weights"].numel() == 2_000_000
        newest = max(root.iterdir(), key=lambda path: path.name)
        if newest != found:  # the save that was cut short: no manifest, never picked
            assert not (newest / checkpoint.MANIFEST).exists()
            assert json.loads((found / checkpoint.MANIFEST).read_text())["step"] == int(newest.name[5:]) - 1


def test_latest_picks_the_highest_finished_step(tmp_path):
    assert checkpoint.latest(tmp_path / "nothing") is None
    for step in (2, 10, 7):
        _single_save(checkpoint.step_directory(tmp_path, step), step)
    checkpoint.step_directory(tmp_path, 12).mkdir()  # unfinished
    (tmp_path / "step-notanumber").mkdir()
    assert checkpoint.latest(tmp_path) == checkpoint.step_directory(tmp_path, 10)


def _fsdp_optimizer_against_plain() -> bool:
    torch.set_num_threads(1)
    config = GPTConfig.preset("100k")
    model = FullyShardedDataParallel(TinyGPT(config, seed=0))
    optimizer = model.make_optimizer(torch.optim.AdamW, lr=1e-3)
    plain = TinyGPT(config, seed=0)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    tokens = data.MarkovChain().sample(5_000, seed=0)
    generator = torch.Generator().manual_seed(5)  # the same batches on every rank: the mean gradient is one's
    for _ in range(3):
        inputs, targets = data.batches(tokens, 4, config.block_size, generator)
        for network, step_with in ((model, optimizer), (plain, plain_optimizer)):
            step_with.zero_grad()
            network(inputs, targets)[1].backward()
            step_with.step()
    full, reference = model.full_optimizer_state_dict(optimizer), plain_optimizer.state_dict()
    assert full["param_groups"] == reference["param_groups"]
    for index, state in reference["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(full["state"][index][key], value, rtol=1e-4, atol=1e-7, msg=f"{index} {key}")
    fresh = FullyShardedDataParallel(TinyGPT(config, seed=1))
    fresh_optimizer = fresh.make_optimizer(torch.optim.AdamW, lr=1e-3)
    fresh.load_full_state_dict(plain.state_dict())  # a single process's states load into the shards
    fresh.load_full_optimizer_state_dict(fresh_optimizer, reference)
    again = fresh.full_optimizer_state_dict(fresh_optimizer)
    assert all(torch.equal(again["state"][index][key], value) for index, state in reference["state"].items()
               for key, value in state.items())
    return all(torch.equal(fresh.full_state_dict()[name], tensor) for name, tensor in plain.state_dict().items())


@pytest.mark.parametrize("ranks", [2, 3])
def test_fsdp_full_optimizer_state_is_a_plain_optimizers_and_loads_back_into_the_shards(ranks):
    assert all(launch(_fsdp_optimizer_against_plain, nprocs=ranks, rank_output="none"))


FIXED = 123  # the generator seed of the batch every rank evaluates


def _loss_on_fixed_batch(model, config) -> float:
    tokens = data.MarkovChain(vocab_size=VOCAB).sample(5_000, seed=1)
    inputs, targets = data.batches(tokens, 4, config.block_size, torch.Generator().manual_seed(FIXED))
    return model(inputs, targets)[1].item()


def _reshard(strategy: str, directory: str, save: bool) -> tuple[dict[str, torch.Tensor], float, float, bool]:
    """On this world size: train 3 steps and save sharded (``save``), or load; then the full weights, the loss
    of a fixed batch, and that loss after one more step on it (every rank the same batch)."""
    torch.set_num_threads(1)
    config = GPTConfig.preset("100k", vocab_size=VOCAB)
    model = WRAPPERS[strategy](TinyGPT(config, seed=0))
    optimizer = model.make_optimizer(torch.optim.AdamW, lr=3e-3)
    resharded = False
    if save:
        generator = torch.Generator().manual_seed(0 if strategy == "tp" else torch_dist.get_rank())
        tokens = data.MarkovChain(vocab_size=VOCAB).sample(5_000, seed=0)
        for _ in range(3):
            optimizer.zero_grad()
            model(*data.batches(tokens, 4, config.block_size, generator))[1].backward()
            optimizer.step()
        checkpoint.save(directory, model, optimizer, 3, layout="sharded")
    else:
        resharded = checkpoint.load(directory, model, optimizer).resharded
    weights = {name: tensor.clone() for name, tensor in model.full_state_dict().items()}
    before = _loss_on_fixed_batch(model, config)
    optimizer.zero_grad()
    tokens = data.MarkovChain(vocab_size=VOCAB).sample(5_000, seed=1)
    model(*data.batches(tokens, 4, config.block_size, torch.Generator().manual_seed(FIXED)))[1].backward()
    optimizer.step()
    return weights, before, _loss_on_fixed_batch(model, config), resharded


@pytest.mark.parametrize("strategy, saved_on, loaded_on", [("fsdp", 4, 2), ("fsdp", 2, 4), ("zero1", 4, 2),
                                                           ("zero2", 2, 3), ("tp", 4, 2), ("tp", 2, 1)])
def test_a_sharded_checkpoint_reshards_to_another_number_of_ranks(strategy, saved_on, loaded_on, tmp_path):
    saved = launch(_reshard, strategy, str(tmp_path), True, nprocs=saved_on, rank_output="none")[0]
    manifest = checkpoint.read_manifest(tmp_path)
    assert sum(name.startswith("shard-") for name in manifest["files"]) == saved_on
    if strategy == "tp":  # each rank wrote its slices: a row-parallel weight's columns, the vocabulary's rows
        projection, table = (manifest["tensors"][f"model/{name}"] for name in ("blocks.0.mlp.proj.weight",
                                                                                "token_embedding.weight"))
        assert projection["dim"] == 1 and len(projection["pieces"]) == saved_on
        rows = -(-VOCAB // saved_on)  # per rank, the vocabulary padded to a multiple of the ranks
        expected = [min(rows, VOCAB - rank * rows) * 48 for rank in range(saved_on)]  # the padding left out
        assert table["dim"] == 0 and [end - begin for _, begin, end in table["pieces"]] == expected
    loaded = launch(_reshard, strategy, str(tmp_path), False, nprocs=loaded_on, rank_output="none")
    if strategy == "fsdp" and saved_on == 4:  # a shard file lost: an error naming it, on every rank
        (tmp_path / checkpoint.shard_file(2, 4)).rename(tmp_path / "elsewhere.pt")
        with pytest.raises(RankFailed, match=r"shard-00002-of-00004\.pt: missing"):
            launch(_reshard, strategy, str(tmp_path), False, nprocs=loaded_on, rank_output="none")
    # Tensor parallelism over another number of ranks sums its partial products in another order: the same
    # loss to rounding, where the data-parallel wrappers compute it on one rank, bit for bit.
    same_loss = pytest.approx(saved[1], rel=1e-6) if strategy == "tp" else saved[1]
    for weights, before, after, resharded in loaded:
        assert resharded
        assert all(torch.equal(weights[name], tensor) for name, tensor in saved[0].items())  # the same weights
        assert before == same_loss  # the same loss
        assert after == pytest.approx(saved[2], rel=1e-6)  # and the same next step (Adam's moments resharded)


def _dcp_save(directory: str) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    model = TinyGPT(GPTConfig.preset("100k"), seed=3)
    full = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    mesh = init_device_mesh("cpu", (torch_dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=directory)
    return full


def _dcp_load(directory: str, strategy: str) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    model = WRAPPERS[strategy](TinyGPT(GPTConfig.preset("100k"), seed=0))
    checkpoint.load_dcp_model(directory, model)
    return {name: tensor.clone() for name, tensor in model.full_state_dict().items()}


@pytest.mark.parametrize("strategy, ranks", [("fsdp", 3), ("ddp", 2)])
def test_a_torch_distributed_checkpoint_of_fully_shard_loads_into_labkit(strategy, ranks, tmp_path):
    expected = launch(_dcp_save, str(tmp_path / "dcp"), nprocs=2, rank_output="none")[0]
    for found in launch(_dcp_load, str(tmp_path / "dcp"), strategy, nprocs=ranks, rank_output="none"):
        assert all(torch.equal(found[name], tensor) for name, tensor in expected.items())
    with pytest.raises(checkpoint.CheckpointError, match="is not a torch.distributed.checkpoint"):
        checkpoint.load_dcp_model(tmp_path, SingleProcess(TinyGPT(GPTConfig.preset("100k"))))
