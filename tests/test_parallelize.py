"""3D parallelism (labkit.parallel.parallelize, labkit.train --dp/--tp/--pp) against one process.

Every layout of the issue runs on 8 gloo ranks with TinyGPT's 100k preset, 3 steps, over the same global batch
as one process: the loss trajectory within 1e-5 and the same final weights.  The layouts share one launch of 8
ranks (each makes its own Mesh), so the suite pays for the ranks' start-up once.
"""

from __future__ import annotations

import pytest
import torch

from labkit import launch
from labkit.costmodel.memory import memory_per_rank
from labkit.models import GPTConfig, TinyGPT
from labkit.train import TrainConfig, build, main, parse_arguments

CONFIG = GPTConfig.preset("100k", tie_weights=False)
STEPS, BATCH, MICRO = 3, 4, 2  # per data-parallel rank: BATCH sequences in MICRO micro-batches
LR = 0.3

# (dp, tp, pp, zero, schedule): the five layouts, then every data-parallel wrapper and schedule at 2x2x2
LAYOUTS = [(2, 2, 2, 0, "1f1b"), (1, 2, 4, 0, "1f1b"), (4, 1, 2, 0, "1f1b"), (2, 4, 1, 0, "1f1b"),
           (8, 1, 1, 0, "1f1b"), (2, 2, 2, 1, "1f1b"), (2, 2, 2, 2, "1f1b"), (2, 2, 2, 3, "1f1b"),
           (2, 2, 2, 0, "gpipe"), (2, 2, 2, 3, "gpipe"), (2, 2, 2, 0, "interleaved"), (2, 2, 2, 2, "interleaved"),
           (2, 2, 2, 0, "zb-h1"), (2, 2, 2, 1, "zb-h1"), (1, 2, 4, 2, "zb-h1")]


def _batch(step: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel rank ``dp_rank``'s rows of step ``step``'s global batch of ``dp * BATCH`` sequences."""
    generator = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(CONFIG.vocab_size, (dp * BATCH, CONFIG.block_size + 1), generator=generator)
    rows = ids[dp_rank * BATCH:(dp_rank + 1) * BATCH]
    return rows[:, :-1], rows[:, 1:]


def _optimizer(parameters, cls=torch.optim.SGD):
    return cls(parameters, lr=LR, momentum=0.9) if cls is torch.optim.SGD else cls(parameters, lr=3e-3)


def _one_process(dp: int, optimizer_cls=torch.optim.SGD, clip: float | None = None):
    model = TinyGPT(CONFIG, seed=0)
    optimizer = _optimizer(model.parameters(), optimizer_cls)
    losses = []
    for step in range(STEPS):
        parts = [_batch(step, rank, dp) for rank in range(dp)]
        _, loss = model(torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts]))
        optimizer.zero_grad()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _run_layouts(layouts, optimizer_cls=torch.optim.SGD, clip=None, overlap_dp=False):
    from labkit.mesh import Mesh
    from labkit.parallel.parallelize import parallelize
    from labkit.parallel.parallelize import state as threed_state

    out = []
    for dp, tp, pp, zero, schedule in layouts:
        torch.manual_seed(0)
        mesh = Mesh(dp=dp, tp=tp, pp=pp)
        model = parallelize(TinyGPT(CONFIG, seed=0), mesh, zero=zero, schedule=schedule, microbatches=MICRO,
                            micro_batch_size=BATCH // MICRO, seq_len=CONFIG.block_size, overlap_dp=overlap_dp)
        optimizer = model.make_optimizer(optimizer_cls, **({"lr": LR, "momentum": 0.9}
                                                          if optimizer_cls is torch.optim.SGD else {"lr": 3e-3}))
        losses = []
        for step in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            losses.append(model.forward_backward(*_batch(step, mesh.rank("dp"), dp)).item())
            if clip is not None:
                model.clip_grad_norm_(clip)
            optimizer.step()
        full = model.full_state_dict()
        local = sum(t.numel() for part in threed_state._local_dense(model) for t in part.values())
        out.append({"losses": losses, "local_parameters": local, "full": full if torch.distributed.get_rank() == 0 else None,
                    "memory": model.memory_breakdown(), "coords": mesh.coords(),
                    "communication": model.communication_per_step(),
                    "predicted": model.predicted_communication()})
    return out


@pytest.fixture(scope="module")
def runs():
    return launch.launch(_run_layouts, LAYOUTS, nprocs=8, timeout=600)


def _mean_losses(runs, index):
    """The global batch's loss: every rank of a replica reports its replica's, so the mean over all ranks."""
    return [sum(rank[index]["losses"][step] for rank in runs) / len(runs) for step in range(STEPS)]


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=["x".join(map(str, layout[:3]))
                                                            + f"-zero{layout[3]}-{layout[4]}" for layout in LAYOUTS])
def test_a_layout_trains_as_one_process_does(runs, index):
    dp = LAYOUTS[index][0]
    losses, state = _one_process(dp)
    assert _mean_losses(runs, index) == pytest.approx(losses, abs=1e-5, rel=0)
    full = runs[0][index]["full"]
    assert set(full) == set(state)
    worst = max((full[name] - state[name]).abs().max().item() for name in state)
    assert worst < 1e-6, f"final weights differ by {worst:.2e}"


def test_every_rank_of_a_replica_reports_the_same_loss(runs):
    dp, tp, pp, *_ = LAYOUTS[0]
    by_replica: dict[int, set] = {}
    for rank in runs:
        by_replica.setdefault(rank[0]["coords"]["dp"], set()).add(tuple(rank[0]["losses"]))
    assert len(by_replica) == dp and all(len(losses) == 1 for losses in by_replica.values())


def test_communication_counted_per_dimension_matches_the_prediction(runs):
    for index in (0, 5, 7):  # DDP, ZeRO-1, FSDP at 2x2x2
        for rank in runs:
            measured, predicted = rank[index]["communication"], rank[index]["predicted"]
            assert measured == predicted, (LAYOUTS[index], rank[index]["coords"])
            assert {"tp all_reduce", "pp send"} <= set(measured)


def test_memory_per_rank_beside_the_memory_model(runs, capsys):
    """Measured model-state bytes of 2x2x2 with ZeRO-1 and with FSDP (SGD with momentum: one state per parameter),
    beside ``memory_per_rank`` with those degrees.

    The model spreads the parameters evenly over the t p model-parallel ranks.  The real split is uneven (the
    embedding on the first stage, the head on the last, norms and some biases whole on every tp rank): so each
    rank is held to the model given its own parameter count, and the mean over ranks to the model given the
    whole model's."""
    psi = sum(p.numel() for p in TinyGPT(CONFIG).parameters())
    lines = []
    for index, zero in ((5, 1), (7, 3)):
        def model_bytes(parameters: float, zero: int = zero) -> float:
            model = memory_per_rank(parameters, precision="fp32", optimizer="momentum", zero_stage=zero,
                                    dp_degree=2, tp_degree=2, pp_degree=2)
            return model["weights"] + model["gradients"] + model["optimizer_states"]

        measured = [sum(v for k, v in rank[index]["memory"].items() if k != "optimizer_other") for rank in runs]
        own = [model_bytes(4 * rank[index]["local_parameters"]) for rank in runs]  # as if all t p held as many
        mean = sum(measured) / len(measured)
        lines.append(f"2x2x2 ZeRO-{zero}: measured per rank {[round(m / 1024, 1) for m in measured]} KiB (model "
                     f"with each rank's own parameters {[round(o / 1024, 1) for o in own]}); mean {mean / 1024:.1f}"
                     f" KiB against the model's {model_bytes(psi) / 1024:.1f} KiB for the whole model's")
        assert all(abs(m / o - 1) < 0.02 for m, o in zip(measured, own, strict=True)), lines[-1]
        assert abs(mean / model_bytes(psi) - 1) < 0.15, lines[-1]
    with capsys.disabled():
        print("\n" + "\n".join(lines))


def test_adamw_and_clipping_keep_the_trajectory():
    layouts = [(2, 2, 2, 1, "1f1b"), (2, 2, 2, 3, "1f1b"), (1, 2, 4, 2, "1f1b")]
    runs = launch.launch(_run_layouts, layouts, torch.optim.AdamW, 0.5, nprocs=8, timeout=600)
    for index, layout in enumerate(layouts):
        losses, _ = _one_process(layout[0], torch.optim.AdamW, clip=0.5)
        assert _mean_losses(runs, index) == pytest.approx(losses, abs=1e-5, rel=0), layout


# --------------------------------------------------------------------------------------------------------
# The trainer


def _train(configs):
    from labkit.train import train
    return [train(config) for config in configs]


def test_the_trainer_runs_3d_as_one_process_runs_the_global_batch():
    """labkit.train's 3D path (AdamW, its own data) against one process fed every replica's batches."""
    config = TrainConfig(dp=2, tp=2, pp=2, steps=4, batch_size=4, microbatches=2, log_every=100)
    result = launch.launch(_train, [config], nprocs=8, timeout=600, rank_output="none")
    reference = TrainConfig(steps=4, batch_size=4)
    model = TinyGPT(config.gpt_config(), seed=0)
    batches = [build(reference, rank, 2)[1] for rank in range(2)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    losses = []
    for step in range(1, 5):
        parts = [batch(step) for batch in batches]
        _, loss = model(torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    mean = [sum(rank[0]["losses"][k] for rank in result) / 8 for k in range(4)]
    assert mean == pytest.approx(losses, abs=1e-5, rel=0)
    # Adam divides by the root of the squared gradients: rounding-level differences of tiny gradients move the
    # weights by up to ~1e-4 (SGD, above, keeps them within 1e-6), so the sum is compared to 1e-6 relative.
    checksum = float(sum(t.double().sum() for t in model.state_dict().values()))
    assert result[0][0]["checksum"] == pytest.approx(checksum, rel=1e-6)


@pytest.mark.parametrize(("argv", "message"), [
    (["--dp", "2", "--tp", "2", "--pp", "2", "--nprocs", "4"], "dp * tp * pp must equal the number of ranks"),
    (["--tp", "3", "--nprocs", "3"], "n_head=4 and n_embd=48 must both be divisible by 3"),
    (["--pp", "3", "--nprocs", "3"], "n_layer=4 is not divisible by num_stages=3"),
    (["--tp", "2", "--pp", "2", "--nprocs", "6"], "does not divide the 6 ranks"),
    (["--dp", "2", "--pp", "2", "--zero", "3", "--schedule", "zb-h1"], "FSDP (zero=3) cannot run the zb-h1"),
    (["--dp", "2", "--pp", "2", "--zero", "3", "--schedule", "interleaved"], "FSDP (zero=3) cannot run the"),
    (["--dp", "2", "--pp", "2", "--microbatches", "3"], "must split into 3 equal micro-batches"),
    (["--dp", "1", "--pp", "2", "--schedule", "pipedream"], "schedule must be one of"),
    (["--dp", "2", "--zero", "4"], "zero must be one of"),
    (["--strategy", "ddp", "--tp", "2"], "--strategy ddp and --dp/--tp/--pp: choose one"),
    (["--tp", "2", "--model", "tiny-mlp", "--nprocs", "2"], "use --model tiny-gpt"),
    (["--dp", "2", "--zero", "2", "--precision", "fp16"], "ZeRO-2"),
    (["--tp", "2", "--nprocs", "2", "--checkpoint-layout", "sharded"], "full checkpoint layout only"),
    (["--tp", "2", "--pp", "2"], "needs --nprocs N"),
    (["--zero", "1"], "give --dp/--tp/--pp too"),
    (["--precision", "fp8"], "--precision must be one of"),
])
def test_bad_layouts_are_refused_before_any_process_starts(argv, message, capsys):
    with pytest.raises(ValueError, match=None) as error:
        parse_arguments(argv)
    assert message in str(error.value)
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_an_interleaved_layout_fills_in_dp_and_the_microbatches():
    config, nprocs = parse_arguments(["--tp", "2", "--pp", "2", "--nprocs", "8", "--schedule", "interleaved"])
    assert (config.dp, config.tp, config.pp, config.microbatches, nprocs) == (2, 2, 2, 4, 8)


def test_a_3d_run_resumes_bit_for_bit_and_its_checkpoint_moves_to_fsdp(tmp_path):
    """A full checkpoint of 2x2x2 with ZeRO-1 (saved at step 3 of 6): resumed as it was, the same losses and
    weights to the last bit as the run that never stopped; resumed with FSDP over dp instead (the optimizer's
    moments gathered over dp, tp and pp, then cut again), the same trajectory within 1e-5."""
    common = {"dp": 2, "tp": 2, "pp": 2, "zero": 1, "steps": 6, "batch_size": 4, "log_every": 100}
    straight = TrainConfig(**common)
    first = TrainConfig(**common, checkpoint_dir=str(tmp_path), save_every=3)
    saved = str(tmp_path / "step-00000003")
    again = TrainConfig(**common, resume=saved)
    moved = TrainConfig(**{**common, "zero": 3}, resume=saved)
    results = launch.launch(_train, [straight, first, again, moved], nprocs=8, timeout=600, rank_output="none")
    for rank in results:
        expected, _, resumed, as_fsdp = rank
        assert resumed["losses"] == expected["losses"][3:]
        assert resumed["checksum"] == expected["checksum"]
        assert as_fsdp["losses"] == pytest.approx(expected["losses"][3:], abs=1e-5, rel=0)


def test_a_traced_3d_step_shows_every_dimension_on_every_rank(tmp_path):
    """labkit.train --trace: one Chrome trace of the last step with every rank's pipeline actions, tensor-parallel
    all-reduces, bubbles and data-parallel reduction; step_breakdown splits each rank's step into them."""
    import json

    from labkit.parallel.parallelize.timing import PARTS, step_breakdown

    path = tmp_path / "step.json"
    config = TrainConfig(dp=2, tp=2, pp=2, steps=2, batch_size=4, microbatches=2, log_every=100, trace=str(path))
    results = launch.launch(_train, [config], nprocs=8, timeout=600, rank_output="none")
    spans = results[0][0]["trace"]
    assert all(result[0]["trace"] is None for result in results[1:])
    events = json.loads(path.read_text())["traceEvents"]
    assert {event["pid"] for event in events if event.get("ph") == "X"} == set(range(8))
    parts = step_breakdown(spans)
    assert sorted(parts) == list(range(8))
    for rank, seconds in parts.items():
        assert set(seconds) == {*PARTS, "step"}
        assert seconds["compute"] > 0 and seconds["tp communication"] > 0 and seconds["dp reduction"] > 0, rank
        assert sum(seconds[part] for part in PARTS) == pytest.approx(seconds["step"], rel=1e-6), rank
        names = {span.name for span in spans if span.rank == rank}
        stage = results[rank][0]["coords"]["pp"]
        assert {f"{stage}F0", f"{stage}F1", f"{stage}B0", f"{stage}B1"} <= names
        sent = "activation" if stage == 0 else "gradient"  # the pipeline's sends, forward and back
        assert any(name.startswith(f"send {sent} of micro-batch 1 to rank") for name in names), rank
    # the last stage waits for its first activation: a bubble on every rank of pp-rank 1
    assert all(parts[rank]["bubble"] > 0 for rank in range(4, 8))


def test_step_breakdown_subtracts_the_collectives_inside_an_action():
    from labkit.parallel.parallelize.timing import step_breakdown
    from labkit.trace import Span

    spans = [Span(0, "wait 0F0", "bubble", 0.0, 1.0), Span(0, "0F0", "compute", 1.0, 3.0),
             Span(0, "all_reduce blocks.0.attn g", "comm", 1.5, 2.0), Span(0, "dp all-reduce gradients", "comm",
                                                                            3.0, 4.0),
             Span(0, "all-reduce bucket 0", "comm", 3.1, 3.5), Span(0, "optimizer step", "compute", 4.0, 4.5)]
    parts = step_breakdown(spans)[0]
    assert parts == {"compute": 1.5, "tp communication": 0.5, "bubble": 1.0, "dp reduction": 1.0,
                     "optimizer": 0.5, "other": 0.0, "step": 4.5}


def test_bf16_and_fp16_train_a_3d_layout_close_to_fp32():
    """--precision bf16 (autocast) and fp16 (autocast and a dynamic loss scaler: the last stage back-propagates
    loss x S, every rank unscales and all agree on overflow) follow the fp32 trajectory of 2x1x2 within what
    their rounding allows."""
    configs = [TrainConfig(dp=2, pp=2, steps=6, batch_size=4, log_every=100, precision=precision)
               for precision in ("fp32", "bf16", "fp16")]
    results = launch.launch(_train, configs, nprocs=4, timeout=600, rank_output="none")
    fp32, bf16, fp16 = ([sum(rank[i]["losses"][k] for rank in results) / 4 for k in range(6)] for i in range(3))
    assert bf16 == pytest.approx(fp32, abs=0.05) and fp16 == pytest.approx(fp32, abs=0.02)
    assert bf16 != fp32 and fp16 != fp32  # the low precision did run
    assert fp32[-1] < fp32[0]


def test_overlapping_the_dp_reduction_with_the_last_backward_keeps_the_trajectory():
    """overlap_dp: each wrapper's sync turned on just before the rank's last backward, so DDP's buckets, ZeRO-2's
    and FSDP's reduce-scatters leave during it; ZB-H1 (its W passes) and interleaving keep the reduction after."""
    layouts = [(2, 2, 2, 0, "1f1b"), (2, 2, 2, 2, "gpipe"), (2, 2, 2, 3, "1f1b"), (4, 1, 2, 1, "zb-h1"),
               (2, 2, 2, 0, "interleaved")]
    runs = launch.launch(_run_layouts, layouts, torch.optim.SGD, None, True, nprocs=8, timeout=600)
    for index, layout in enumerate(layouts):
        losses, state = _one_process(layout[0])
        assert _mean_losses(runs, index) == pytest.approx(losses, abs=1e-5, rel=0), layout
        full = runs[0][index]["full"]
        assert max((full[name] - state[name]).abs().max().item() for name in state) < 1e-6, layout


def test_time_layouts_measures_each_layout_on_one_launch():
    """What bench_3d and notebook 11 hold the predictions to: each layout's median step, its traced parts and
    the bytes each dimension moved, every layout on the same launched ranks."""
    from labkit.parallel.parallelize.timing import time_layouts

    config = GPTConfig.preset("100k", tie_weights=False)
    timings = time_layouts(config, [(2, 1, 1), (1, 2, 1), (1, 1, 2)], steps=1, global_batch=8)
    assert [timing.label for timing in timings] == ["2x1x1", "1x2x1", "1x1x2"]
    assert all(timing.median_s > 0 and len(timing.steps_s) == 1 for timing in timings)
    assert [timing.micro_batch for timing in timings] == [4, 8, 2] and timings[2].microbatches == 4
    assert "tp all_reduce" in timings[1].sent_bytes and "pp send" in timings[2].sent_bytes
    assert "dp all_reduce" in timings[0].sent_bytes and timings[2].parts["bubble"] > 0
    with pytest.raises(ValueError, match="same number of ranks"):
        time_layouts(config, [(2, 1, 1), (4, 1, 1)])
    with pytest.raises(ValueError, match="global_batch=6 does not split"):
        time_layouts(config, [(1, 1, 2)], global_batch=6)
