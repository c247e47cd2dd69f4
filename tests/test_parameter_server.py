"""The parameter server (``labkit.parallel.parameter_server``): its rule, its arithmetic, its records, its failures.

The rule (:class:`Gate`) is checked on its own, over random arrival orders (one worker slow in some): each mode
keeps its promise; SSP (Ho et al. 2013) keeps every worker within ``s`` clocks of the slowest when it pulls, so
its weights hold every gradient of clocks ``<= c - s - 1``, and reaches the bound, while its staleness passes
``s``; the bounded delay (Li et al. 2014) never applies a gradient staler than ``tau``, and reaches it, while its
clocks drift apart; so each rule's check rejects the other rule.  Then TinyMLP trains through the server on
launched ranks: asynchronous training with one worker is plain SGD bit for bit; synchronous training with 4
workers is SGD on the mean of their gradients (what all-reduce data parallelism computes) within 1e-6, and so are
SSP with s = 0 and the bounded delay with tau = 0; every gradient a worker sent is recorded once, applied or
dropped, in every mode and with stragglers; asynchronous staleness averages about N - 1; on launched ranks no SSP
worker runs more than s clocks ahead and no bounded-delay gradient is staler than tau.  Bad arguments raise
before any message; a hung worker becomes an error, not a hang.  Sharded over k servers (``servers=k``, shards of
uneven length included): sync, s = 0 and tau = 0 give one server's weights, asynchronous training with one worker
is still plain SGD bit for bit, every server records each gradient it was sent once and spends its budget, and no
shard breaks its bound.
"""

from __future__ import annotations

import multiprocessing
import random
import statistics
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from labkit.launch import RankFailed, launch
from labkit.models import MLPConfig, TinyMLP
from labkit.parallel.parameter_server import Gate, Received, ShardRecord, Stragglers, run_parameter_server
from labkit.parallel.parameter_server.simulate import clock_gap

CONFIG = MLPConfig(in_features=16, hidden_sizes=(32,), num_classes=4)
LR, UPDATES = 0.1, 12


def batches(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * worker + step)
    x = torch.randn(8, CONFIG.in_features, generator=generator)
    return x, x[:, :CONFIG.num_classes].argmax(1)


def _gradient(model: TinyMLP, worker: int, step: int) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x, y = batches(worker, step)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


# ---------------------------------------------------------------------------------------------------------
# The rule alone


def _play(gate: Gate, workers: int, arrivals: int, seed: int, slow: float = 1.0) -> list[tuple[int, int, int | None]]:
    """Workers finish in a random order (worker 0 ``slow`` times less often); (worker, pulled, applied at) for every
    gradient."""
    return [(r.worker, r.pulled, r.applied) for r in _records(gate, workers, arrivals, seed, slow)]


def _records(gate: Gate, workers: int, arrivals: int, seed: int, slow: float = 1.0) -> list[Received]:
    """The play as a server records it, and at every release the check of SSP's promise on the rule's own clocks."""
    rng = random.Random(seed)
    computing = dict.fromkeys(range(workers), 0)
    steps, held, out = [0] * workers, {}, []
    sent = [0] * workers
    for _ in range(arrivals):
        candidates = sorted(computing)
        worker = rng.choices(candidates, [1 / slow if w == 0 else 1.0 for w in candidates])[0]
        pulled = computing.pop(worker)
        held[worker] = pulled
        sent[worker] += 1
        decision = gate.arrive(worker, pulled)
        for index in decision.apply:
            out.append(Received(index, steps[index], held.pop(index), gate.version - 1, 0.0, 0.0))
            steps[index] += 1
        for index in decision.drop:
            out.append(Received(index, steps[index], held.pop(index), None, 0.0, 0.0))
            steps[index] += 1
        for index in decision.release:
            computing[index] = gate.version
            if gate.mode == "ssp":  # a worker c clocks in goes on only once the slowest is at c - s
                assert sent[index] - min(sent) <= gate.staleness_bound, (sent, index)
        assert computing or held == {}, "every worker held: the rule has deadlocked"
    return out


@pytest.mark.parametrize("seed", range(5))
def test_the_rule_keeps_every_mode_to_its_promise(seed):
    sync = _play(Gate("sync", 4), 4, 60, seed)
    assert all(applied == pulled for _, pulled, applied in sync)  # never stale
    assert set(Counter(applied for *_, applied in sync).values()) == {4}  # all four, every update
    for tau in (0, 1, 3):
        bounded = _play(Gate("bounded_delay", 4, max_delay=tau), 4, 60, seed)
        assert max(applied - pulled for _, pulled, applied in bounded) <= tau
    assert _play(Gate("bounded_delay", 4, max_delay=0), 4, 60, seed) == sync  # tau = 0 is synchronous
    asynchronous = _play(Gate("async", 4), 4, 60, seed)
    assert [applied for *_, applied in asynchronous] == list(range(60))  # one update per gradient
    for s in (0, 1, 3):
        assert [applied for *_, applied in _play(Gate("ssp", 4, staleness_bound=s), 4, 60, seed)] == list(range(60))
    backup = _play(Gate("backup", 5, backup_workers=2), 5, 60, seed)
    assert set(Counter(applied for *_, applied in backup if applied is not None).values()) == {3}  # first N = 3
    assert all(applied is None or applied == pulled for _, pulled, applied in backup)


def _staleness(records: list[Received]) -> int:
    return max(r.staleness for r in records if r.applied is not None)


@pytest.mark.parametrize("seed", range(4))
def test_ssp_bounds_the_clock_gap_not_the_staleness(seed):
    """Ho et al.: no worker pulls more than s clocks ahead of the slowest (so its weights hold every gradient of
    clocks <= c - s - 1), the bound binds when worker 0 is slow, and staleness, counted in updates, passes s."""
    for workers, s in ((4, 0), (4, 1), (3, 2), (6, 3)):
        records = _records(Gate("ssp", workers, staleness_bound=s), workers, 120, seed, slow=4.0)
        assert clock_gap(records, workers) == s, (workers, s)
        for r in records:  # the read guarantee, gradient by gradient
            missing = [q for q in records if q.step <= r.step - s - 1 and not q.applied < r.pulled]
            assert not missing, (r, missing[:3])
        assert _staleness(records) > s  # the others' gradients land while one is computed


@pytest.mark.parametrize("seed", range(4))
def test_the_bounded_delay_bounds_the_staleness_not_the_clock_gap(seed):
    for workers, tau in ((4, 1), (3, 2), (6, 3)):
        records = _records(Gate("bounded_delay", workers, max_delay=tau), workers, 120, seed, slow=4.0)
        assert _staleness(records) == tau, (workers, tau)  # never above, and reached
        assert clock_gap(records, workers) > tau + 1  # fast workers run ahead of worker 0 without bound


def test_each_rules_check_rejects_the_other_rule():
    """The confusable pair: an SSP that is really a bounded delay (or the reverse) fails the other's promise."""
    for seed in range(3):
        as_delay = _records(Gate("bounded_delay", 4, max_delay=2), 4, 120, seed, slow=4.0)  # posing as ssp, s = 2
        assert clock_gap(as_delay, 4) > 2
        as_ssp = _records(Gate("ssp", 4, staleness_bound=2), 4, 120, seed, slow=4.0)  # posing as tau = 2
        assert _staleness(as_ssp) > 2
        assert clock_gap(as_ssp, 4) == 2  # so an SSP one clock too lenient fails a check of s = 1


# ---------------------------------------------------------------------------------------------------------
# On launched ranks


def _train(mode: str, updates: int, options: dict) -> object:
    torch.set_num_threads(1)
    run = run_parameter_server(TinyMLP(CONFIG, seed=0), batches, mode=mode, updates=updates, lr=LR, **options)
    if isinstance(run, int):
        return run
    if isinstance(run, ShardRecord):
        return run
    return {"state": run.state, "received": run.received, "updates": len(run.update_times_s), "shards": run.shards}


def _sgd(workers: int, updates: int) -> dict[str, torch.Tensor]:
    """One process: SGD on the mean of the workers' gradients, step after step (all-reduce data parallelism)."""
    model = TinyMLP(CONFIG, seed=0)
    for step in range(updates):
        gradients = [_gradient(model, worker, step) for worker in range(workers)]
        with torch.no_grad():
            for index, parameter in enumerate(model.parameters()):
                parameter.add_(sum(g[index] for g in gradients) / workers, alpha=-LR)
    return model.state_dict()


@pytest.mark.parametrize("servers", [1, 2])
def test_async_with_one_worker_is_plain_sgd_bit_for_bit(servers):
    server, *shards, sent = launch(_train, "async", UPDATES, {"servers": servers}, nprocs=servers + 1,
                                   rank_output="none")
    model = TinyMLP(CONFIG, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(UPDATES):
        optimizer.zero_grad()
        x, y = batches(0, step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert sent == UPDATES
    assert all(isinstance(shard, ShardRecord) and len(shard.update_times_s) == UPDATES for shard in shards)
    for name, tensor in model.state_dict().items():
        assert torch.equal(server["state"][name], tensor), name


def test_sync_is_sgd_on_the_mean_gradient_and_so_are_ssp_with_s_zero_and_the_bounded_delay_with_tau_zero():
    reference = _sgd(4, UPDATES)
    for mode, options, updates in (("sync", {}, UPDATES), ("bounded_delay", {"max_delay": 0}, UPDATES),
                                   ("ssp", {"staleness_bound": 0}, 4 * UPDATES)):  # ssp: one gradient an update
        server, *sent = launch(_train, mode, updates, options, nprocs=5, rank_output="none")
        assert sent == [UPDATES] * 4 and server["updates"] == updates
        for name, tensor in reference.items():
            torch.testing.assert_close(server["state"][name], tensor, rtol=1e-6, atol=1e-7, msg=mode)


@pytest.mark.parametrize("servers", [1, 2, 3])
@pytest.mark.parametrize("mode, options", [("sync", {}), ("async", {}), ("ssp", {"staleness_bound": 1}),
                                           ("bounded_delay", {"max_delay": 2}), ("backup", {"backup_workers": 1})])
def test_every_gradient_sent_is_recorded_once_with_stragglers(mode, options, servers):
    """Each server records once every gradient it was sent: a worker sends each step to every server that has not
    stopped it yet, so each server has steps 0, 1, ... of it, and the last to stop it has them all."""
    stragglers = Stragglers(slow={1: 0.01}, exponential_mean_s=0.002, seed=3)
    server, *others = launch(_train, mode, 20, {**options, "stragglers": stragglers, "servers": servers},
                             nprocs=servers + 3, rank_output="none")
    sent = others[servers - 1:]
    assert len(server["shards"]) == servers and server["shards"][0].received == server["received"]
    assert [shard.received for shard in server["shards"][1:]] == [shard.received for shard in others[:servers - 1]]
    for shard in server["shards"]:
        for worker, count in enumerate(sent):
            steps = sorted(r.step for r in shard.received if r.worker == worker)
            assert steps == list(range(len(steps))) and len(steps) <= count, (mode, shard.server, worker)
            if servers == 1 or mode == "sync":  # sync: every server stops every worker in the same round
                assert len(steps) == count, (mode, shard.server, worker)
        applied = [r for r in shard.received if r.applied is not None]
        assert len({r.applied for r in applied}) == len(shard.update_times_s) == 20
        if mode == "bounded_delay":
            assert max(r.staleness for r in applied) <= 2
        if mode == "ssp":  # worker 1 is slow: the others wait for its clock
            assert clock_gap(shard.received, 2) <= 1
        if mode in ("sync", "backup"):
            assert all(r.staleness == 0 for r in applied)
    for worker, count in enumerate(sent):  # the server that stopped it last has every gradient it computed
        assert max(sum(r.worker == worker for r in shard.received) for shard in server["shards"]) == count


@pytest.mark.timing
def test_async_staleness_is_about_the_number_of_other_workers():
    server, *_ = launch(_train, "async", 60, {}, nprocs=5, rank_output="none")
    staleness = [r.staleness for r in server["received"] if r.applied is not None]
    assert abs(statistics.mean(staleness) - 3) <= 1, statistics.mean(staleness)


def _bad(options: dict) -> str:
    try:
        run_parameter_server(TinyMLP(CONFIG), batches, **options)
    except ValueError as error:
        return str(error)
    return "no error"


def test_bad_arguments_are_refused_on_every_rank_before_any_message():
    cases = [({"mode": "downpour", "updates": 3, "lr": 0.1}, "mode must be one of"),
             ({"updates": 0, "lr": 0.1}, "updates (the server's budget) must be an integer >= 1"),
             ({"updates": 3, "lr": -1}, "lr must be a number > 0"),
             ({"mode": "ssp", "updates": 3, "lr": 0.1}, "staleness_bound belongs to mode='ssp'"),
             ({"mode": "ssp", "updates": 3, "lr": 0.1, "staleness_bound": -1}, "staleness_bound must be"),
             ({"mode": "bounded_delay", "updates": 3, "lr": 0.1}, "max_delay belongs to mode='bounded_delay'"),
             ({"mode": "bounded_delay", "updates": 3, "lr": 0.1, "max_delay": 1.5}, "max_delay must be an integer"),
             ({"mode": "ssp", "updates": 3, "lr": 0.1, "staleness_bound": 1, "max_delay": 1},
              "max_delay belongs to mode='bounded_delay'"),
             ({"mode": "backup", "updates": 3, "lr": 0.1, "backup_workers": 2}, "backup_workers must be an integer"),
             ({"mode": "sync", "updates": 3, "lr": 0.1, "backup_workers": 1}, "backup_workers belongs to"),
             *(({"updates": 3, "lr": 0.1, "servers": bad}, f"servers must be an integer >= 1, got {bad!r}")
               for bad in (0, -1, True, 2.0, "2")),
             *(({"updates": 3, "lr": 0.1, "servers": bad}, f"servers={bad} leaves no worker among the group's 3")
               for bad in (3, 4)),
             ({"updates": 3, "lr": 0.1, "servers": 2, "stragglers": Stragglers(slow={1: 0.1})},
              "stragglers.slow names workers [1], but there are 1 workers, 0 .. 0 (group ranks 2 .. 2)"),
             ({"mode": "backup", "updates": 3, "lr": 0.1, "backup_workers": 1, "servers": 2},
              "backup_workers must be an integer in [0, 1)"),
             ({"updates": 3, "lr": 0.1, "servers": 2, "gate": Gate("sync", 1)}, "a custom gate is one server's rule")]
    for options, expected in cases:
        found = launch(_bad, options, nprocs=3, rank_output="none")
        assert all(expected in message for message in found), (options, found)


def _hangs(timeout_s: float, servers: int = 1) -> object:
    def stuck(worker: int, step: int):
        if worker == 1 and step == 1:
            dist.barrier()  # never answered: the worker hangs
        return batches(worker, step)
    return run_parameter_server(TinyMLP(CONFIG), stuck, mode="sync", updates=5, lr=0.1, timeout_s=timeout_s,
                                servers=servers)


def test_a_worker_that_hangs_is_an_error_in_the_caller_not_a_hang():
    with pytest.raises(RankFailed, match="heard from no worker for 2"):
        launch(_hangs, 2.0, nprocs=3, timeout=60, rank_output="none")


def test_a_worker_that_hangs_under_two_servers_is_an_error_and_leaves_no_process_behind():
    with pytest.raises(RankFailed, match=r"heard from no worker for 2\.0 s; waiting for workers \[1\] \(group ranks "
                                         r"\[3\]\)"):
        launch(_hangs, 2.0, 2, nprocs=4, timeout=60, rank_output="none")
    assert multiprocessing.active_children() == []


def _replay(received, workers_per_update: int, staleness_aware: bool) -> dict[str, torch.Tensor]:
    """One process redoes what the records say: each applied gradient, recomputed on the weights of the version
    it was pulled at, applied in the server's order with ``lr / N`` (divided by its staleness if aware)."""
    model = TinyMLP(CONFIG, seed=0)
    parameters = list(model.parameters())
    flat = torch.nn.utils.parameters_to_vector(parameters).detach().clone()
    versions = {0: flat.clone()}
    for record in received:
        if record.applied is None:
            continue
        versions.setdefault(record.applied, flat.clone())  # the weights before this update
        torch.nn.utils.vector_to_parameters(versions[record.pulled], parameters)
        gradient = torch.cat([g.reshape(-1) for g in _gradient(model, record.worker, record.step)])
        factor = LR / workers_per_update
        if staleness_aware and record.staleness > 0:
            factor /= record.staleness
        flat.add_(gradient, alpha=-factor)
    torch.nn.utils.vector_to_parameters(flat, parameters)
    return model.state_dict()


@pytest.mark.parametrize("mode, options, per_update", [
    ("async", {}, 3), ("async", {"staleness_aware_lr": True}, 3), ("ssp", {"staleness_bound": 1}, 3),
    ("bounded_delay", {"max_delay": 1}, 3), ("backup", {"backup_workers": 1}, 2)])
def test_the_server_applies_exactly_the_gradients_it_records(mode, options, per_update):
    stragglers = Stragglers(slow={0: 0.005}, exponential_mean_s=0.001, seed=1)
    server, *_ = launch(_train, mode, 15, {**options, "stragglers": stragglers}, nprocs=4, rank_output="none")
    assert any(r.staleness for r in server["received"] if r.applied is not None) or mode == "backup"
    replayed = _replay(server["received"], per_update, options.get("staleness_aware_lr", False))
    for name, tensor in replayed.items():
        torch.testing.assert_close(server["state"][name], tensor, rtol=1e-6, atol=1e-7, msg=f"{mode} {name}")
    if options.get("staleness_aware_lr"):  # the replay can tell: without the division it is another model
        unaware = _replay(server["received"], per_update, False)
        assert any(not torch.allclose(server["state"][name], tensor) for name, tensor in unaware.items())


class _Hoarder(Gate):
    """A broken rule: it holds every gradient and never applies or releases anything."""

    def arrive(self, worker: int, pulled: int):
        from labkit.parallel.parameter_server import Decision
        return Decision()


def _hoarded() -> object:
    return run_parameter_server(TinyMLP(CONFIG), batches, mode="sync", updates=3, lr=0.1,
                                gate=_Hoarder("sync", dist.get_world_size() - 1))


def test_a_rule_that_holds_everyone_stops_the_workers_and_says_so():
    with pytest.raises(RankFailed, match=r"made 0 of 3 updates, then held workers \[0, 1\]"):
        launch(_hoarded, nprocs=3, timeout=60, rank_output="none")


# ---------------------------------------------------------------------------------------------------------
# Sharded over k servers

# TinyMLP(CONFIG) has 676 trainable elements: 3 servers hold shards of 226, 225 and 225, one cutting a parameter.


@pytest.mark.parametrize("servers", [2, 3])
def test_sharded_sync_and_the_bounds_at_zero_give_one_servers_weights(servers):
    assert sum(p.numel() for p in TinyMLP(CONFIG).parameters()) % 3 != 0  # uneven shards
    one, *_ = launch(_train, "sync", UPDATES, {}, nprocs=4, rank_output="none")
    reference = _sgd(3, UPDATES)
    for mode, options, updates in (("sync", {}, UPDATES), ("bounded_delay", {"max_delay": 0}, UPDATES),
                                   ("ssp", {"staleness_bound": 0}, 3 * UPDATES)):
        server, *others = launch(_train, mode, updates, {**options, "servers": servers}, nprocs=servers + 3,
                                 rank_output="none")
        assert others[servers - 1:] == [UPDATES] * 3
        shards = server["shards"]
        expected = {2: [(0, 338), (338, 676)], 3: [(0, 226), (226, 451), (451, 676)]}[servers]
        assert [(shard.start, shard.stop) for shard in shards] == expected
        for shard in shards:  # each shard made the same updates from the same gradients as one server
            assert len(shard.update_times_s) == updates
            if mode != "ssp":  # ssp makes an update of each gradient, in the order they reach each server
                assert sorted((r.worker, r.step, r.pulled, r.applied) for r in shard.received) == \
                    sorted((r.worker, r.step, r.pulled, r.applied) for r in one["received"])
        for name, tensor in one["state"].items():
            torch.testing.assert_close(server["state"][name], tensor, rtol=1e-6, atol=1e-7, msg=f"{mode} {name}")
            torch.testing.assert_close(server["state"][name], reference[name], rtol=1e-6, atol=1e-7, msg=mode)


@pytest.mark.parametrize("servers", [2, 3])
@pytest.mark.timing
def test_no_shard_breaks_its_bound_and_the_bound_binds(servers):
    stragglers = Stragglers(slow={0: 0.01}, exponential_mean_s=0.001, seed=2)
    server, *_ = launch(_train, "bounded_delay", 20, {"max_delay": 1, "stragglers": stragglers, "servers": servers},
                        nprocs=servers + 3, rank_output="none")
    staleness = [r.staleness for shard in server["shards"] for r in shard.received if r.applied is not None]
    assert max(staleness) == 1  # the bound is reached (worker 0 is slow), and never passed
    server, *_ = launch(_train, "ssp", 40, {"staleness_bound": 1, "stragglers": stragglers, "servers": servers},
                        nprocs=servers + 3, rank_output="none")
    assert [clock_gap(shard.received, 3) for shard in server["shards"]] == [1] * servers
