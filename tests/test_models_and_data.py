"""labkit.models and labkit.data: sizes, deterministic initialisation, tied weights, pipeline stages with the
whole model's names and values, heads from the local width, learning to the known floor of the Markov corpus,
DistributedSampler sharding, and data sharded and seeded by the data-parallel rank (one test on 4 ranks)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as torch_dist

from labkit.data import (
    ALPHABET,
    VOCAB_SIZE,
    CharDataset,
    MarkovChain,
    augmentation_overlap,
    batches,
    data_parallel_generator,
    data_parallel_shard,
    decode,
    encode,
    make_classification,
    seed_for_rank,
    shard_with_distributed_sampler,
)
from labkit.launch import launch
from labkit.models import PRESETS, GPTConfig, MLPConfig, TinyGPT, TinyMLP

# The counts stated in labkit/models.py's docstring, and the range each preset's name promises.
PRESET_COUNTS = {"100k": 117_792, "1m": 1_026_144, "10m": 9_956_480, "50m": 50_717_696}
PRESET_RANGES = {"100k": (80e3, 150e3), "1m": (0.8e6, 1.3e6), "10m": (8e6, 13e6), "50m": (40e6, 65e6)}


@pytest.fixture(autouse=True)
def one_thread():
    """Models this small gain nothing from intra-op threads, and on a busy machine spinning threads make the
    training test ten times slower; restore the setting afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def small_gpt(seed: int = 0, **overrides) -> TinyGPT:
    return TinyGPT(GPTConfig(**{"block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 16, **overrides}), seed=seed)


# --------------------------------------------------------------------------------------------------------
# Model sizes


@pytest.mark.parametrize("name", sorted(PRESET_COUNTS))
def test_preset_has_the_documented_parameter_count(name):
    config = GPTConfig.preset(name)
    count = TinyGPT(config).num_parameters()
    assert count == PRESET_COUNTS[name]
    low, high = PRESET_RANGES[name]
    assert low <= count <= high
    d, per_block = config.n_embd, 12 * config.n_embd ** 2 + 13 * config.n_embd
    assert count == config.n_layer * per_block + (config.vocab_size + config.block_size) * d + 2 * d


def test_every_preset_splits_over_two_and_four_stages_and_tensor_parallel_ranks():
    assert set(PRESETS) == set(PRESET_COUNTS)
    for config in PRESETS.values():
        assert config.n_layer % 4 == 0 and config.n_head % 4 == 0 and config.vocab_size == VOCAB_SIZE


def test_preset_overrides_replace_fields_without_changing_the_preset():
    config = GPTConfig.preset("1m", dropout=0.1, tie_weights=False)
    assert (config.dropout, config.tie_weights, config.n_embd) == (0.1, False, 144)
    assert PRESETS["1m"].dropout == 0.0 and PRESETS["1m"].tie_weights


def test_num_parameters_counts_the_tied_weight_once_and_bias_false_drops_biases():
    tied, untied = small_gpt(), small_gpt(tie_weights=False)
    assert untied.num_parameters() - tied.num_parameters() == VOCAB_SIZE * 16
    assert tied.num_parameters() == sum(p.numel() for p in set(tied.parameters()))
    no_bias = small_gpt(bias=False)
    biases = sum(p.numel() for name, p in tied.named_parameters() if name.endswith("bias"))
    assert biases > 0 and tied.num_parameters() - no_bias.num_parameters() == biases


# --------------------------------------------------------------------------------------------------------
# Deterministic initialisation and tied weights


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("build", [lambda seed: small_gpt(seed), lambda seed: TinyMLP(MLPConfig(), seed=seed)],
                         ids=["gpt", "mlp"])
def test_same_seed_gives_bit_identical_parameters_whatever_the_global_rng(build):
    torch.manual_seed(1)
    first = _state(build(7))
    torch.manual_seed(2)
    torch.rand(100)
    second = _state(build(7))
    other = _state(build(8))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    weights = [name for name in first if name.endswith("weight") and "norm" not in name]
    assert weights and all(not torch.equal(first[name], other[name]) for name in weights)


def test_building_models_does_not_consume_the_global_rng():
    torch.manual_seed(3)
    expected = torch.rand(5)
    torch.manual_seed(3)
    small_gpt(seed=0)
    TinyMLP(MLPConfig(), seed=0)
    assert torch.equal(torch.rand(5), expected)


def test_initialisation_follows_the_documented_scheme():
    model = TinyGPT(GPTConfig.preset("1m"), seed=0)
    residual_std = 0.02 / math.sqrt(2 * model.config.n_layer)
    assert model.token_embedding.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.blocks[0].attn.query.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.blocks[0].mlp.proj.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert torch.all(model.blocks[0].mlp.fc.bias == 0) and torch.all(model.final_norm.weight == 1)


def test_tied_lm_head_is_the_token_embedding_parameter_and_gets_both_gradients():
    tied = small_gpt()
    assert tied.lm_head.weight is tied.token_embedding.weight
    assert len([p for p in tied.parameters() if p is tied.token_embedding.weight]) == 1
    idx = torch.tensor([[1, 2, 3]])
    _, loss = tied(idx, torch.tensor([[2, 3, 4]]))
    loss.backward()
    grad = tied.token_embedding.weight.grad
    # Row 5 is never an input, so only the head contributes; row 1 is an input, so the embedding adds to it.
    assert grad[5].abs().sum() > 0 and grad[1].abs().sum() > 0
    untied = small_gpt(tie_weights=False)
    assert untied.lm_head.weight is not untied.token_embedding.weight


def test_blocks_are_a_module_list_of_n_layer_blocks():
    model = small_gpt(n_layer=3)
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 3
    assert model.block_indices == (0, 1, 2) and all(block is not None for block in model.blocks)


# --------------------------------------------------------------------------------------------------------
# Splitting: pipeline stages and tensor-parallel heads

SPLIT = GPTConfig(block_size=16, n_layer=4, n_head=2, n_embd=16, tie_weights=False)


def stages(config: GPTConfig, seed: int, cuts: tuple[int, ...]) -> list[TinyGPT]:
    """Pipeline stages holding blocks ``cuts[i] .. cuts[i + 1] - 1``, the first with the embedding, the last
    with the head."""
    bounds = (0, *cuts, config.n_layer)
    return [TinyGPT(config, seed, blocks=range(start, end), embedding=index == 0, head=index == len(cuts))
            for index, (start, end) in enumerate(zip(bounds, bounds[1:], strict=False))]


@pytest.mark.parametrize("cuts", [(2,), (1, 3), (1, 2, 3)], ids=["2 stages", "3 stages", "4 stages"])
def test_stages_hold_the_whole_models_parameters_by_name_and_value(cuts):
    whole = TinyGPT(SPLIT, seed=3).state_dict()
    parts = stages(SPLIT, 3, cuts)
    names = [name for part in parts for name in part.state_dict()]
    assert sorted(names) == sorted(whole)  # every parameter once, under the whole model's name
    for part in parts:
        assert all(torch.equal(tensor, whole[name]) for name, tensor in part.state_dict().items())
    assert parts[1].block_indices == tuple(range(cuts[0], (*cuts, 4)[1]))
    assert parts[-1].blocks[3] is not None and parts[-1].blocks[0] is None
    assert {name.split(".")[1] for name in parts[1].state_dict() if name.startswith("blocks.")} == \
        {str(index) for index in parts[1].block_indices}
    other = TinyGPT(SPLIT, seed=4, blocks=[2], embedding=False, head=False).state_dict()
    assert not torch.equal(other["blocks.2.attn.query.weight"], whole["blocks.2.attn.query.weight"])


def test_stages_in_sequence_compute_the_whole_models_loss_and_gradients():
    whole = TinyGPT(SPLIT, seed=1)
    parts = stages(SPLIT, 1, (1, 3))
    idx = torch.randint(VOCAB_SIZE, (2, 16), generator=torch.Generator().manual_seed(0))
    targets = idx.roll(-1, dims=1)
    logits, loss = whole(idx, targets)
    x = idx
    for part in parts[:-1]:
        x, nothing = part(x)
        assert nothing is None and x.shape == (2, 16, 16)
    stage_logits, stage_loss = parts[-1](x, targets)
    assert torch.equal(stage_logits, logits) and torch.equal(stage_loss, loss)
    loss.backward()
    stage_loss.backward()
    gradients = {name: p.grad for name, p in whole.named_parameters()}
    for part in parts:
        for name, parameter in part.named_parameters():
            assert torch.allclose(parameter.grad, gradients[name], rtol=0, atol=1e-7), name


def test_pieces_called_apart_compose_to_forward_on_a_tied_model():
    model = small_gpt(n_layer=3)
    idx = torch.randint(VOCAB_SIZE, (2, 16), generator=torch.Generator().manual_seed(0))
    x = model.embed(idx)
    for block in model.blocks:
        x = block(x)
    logits = model.head(x)
    expected_logits, expected_loss = model(idx, idx)
    assert torch.equal(logits, expected_logits) and torch.equal(model.loss(logits, idx), expected_loss)
    # A model with the embedding, the head and no blocks still composes (and ties).
    bare = TinyGPT(small_gpt().config, blocks=[])
    assert bare.block_indices == () and bare(idx)[0].shape == (2, 16, VOCAB_SIZE)
    assert bare.lm_head.weight is bare.token_embedding.weight


def test_column_sharded_attention_runs_fewer_heads_and_the_shards_sum_to_the_whole():
    """Tensor parallelism's view of attention: each of t ranks keeps n_head / t heads (rows of query, key and
    value, columns of the output projection); the partial outputs add up to the whole layer's output."""
    attention = TinyGPT(GPTConfig(block_size=16, n_layer=1, n_head=4, n_embd=16), seed=0).blocks[0].attn
    x = torch.randn(2, 10, 16, generator=torch.Generator().manual_seed(1))
    expected = attention(x)
    total = attention.proj.bias.detach().clone()
    for rows in (slice(0, 8), slice(8, 16)):  # two ranks, two heads each
        shard = copy.deepcopy(attention)
        for name in ("query", "key", "value"):
            full = getattr(attention, name)
            part = torch.nn.Linear(16, 8)
            part.weight.data, part.bias.data = full.weight.data[rows].clone(), full.bias.data[rows].clone()
            setattr(shard, name, part)
        shard.proj = torch.nn.Linear(8, 16, bias=False)
        shard.proj.weight.data = attention.proj.weight.data[:, rows].clone()
        total = total + shard(x)
    assert shard.head_dim == 8 // 2 and torch.allclose(total, expected, atol=1e-6)


@pytest.mark.parametrize("make, named", [
    (lambda: TinyGPT(GPTConfig(n_layer=2), blocks=[0], head=False), "tie_weights"),
    (lambda: TinyGPT(SPLIT, blocks=[4]), r"\[0, 4\).*got 4"),
    (lambda: TinyGPT(SPLIT, blocks=[1, 1]), "twice"),
    (lambda: TinyGPT(SPLIT, blocks=[True]), "True"),
    (lambda: TinyGPT(SPLIT, blocks=[], embedding=False, head=False), "nothing"),
    (lambda: TinyGPT(SPLIT, blocks=[0], head=False)(torch.zeros(1, 4, dtype=torch.long),
                                                    torch.zeros(1, 4, dtype=torch.long)), "targets"),
    (lambda: TinyGPT(SPLIT, blocks=[1], embedding=False).embed(torch.zeros(1, 4, dtype=torch.long)),
     "embedding"),
    (lambda: TinyGPT(SPLIT, blocks=[0], head=False).head(torch.zeros(1, 4, 16)), "head"),
    (lambda: TinyGPT(SPLIT, blocks=[0, 1]).generate(torch.zeros(1, 1, dtype=torch.long), 1), "whole model"),
], ids=["tied_stage", "out_of_range", "duplicate", "bool", "empty", "targets_no_head", "no_embedding",
        "no_head", "generate_part"])
def test_splitting_rejects_what_cannot_work_naming_it(make, named):
    with pytest.raises(ValueError, match=named):
        make()


# --------------------------------------------------------------------------------------------------------
# Forward


def test_forward_shapes_and_initial_loss_is_near_log_vocab():
    model = small_gpt()
    idx = torch.randint(VOCAB_SIZE, (3, 16), generator=torch.Generator().manual_seed(0))
    logits, loss = model(idx)
    assert logits.shape == (3, 16, VOCAB_SIZE) and loss is None
    logits, loss = model(idx, idx.roll(-1, dims=1))
    assert loss.shape == () and loss.item() == pytest.approx(math.log(VOCAB_SIZE), abs=0.1)
    shorter, _ = model(idx[:, :5])
    assert torch.allclose(shorter, logits[:, :5], atol=1e-6)


def test_attention_is_causal_future_tokens_do_not_change_earlier_logits():
    model = small_gpt()
    idx = torch.randint(VOCAB_SIZE, (2, 12), generator=torch.Generator().manual_seed(0))
    changed = idx.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % VOCAB_SIZE
    before, _ = model(idx)
    after, _ = model(changed)
    assert torch.allclose(before[:, :8], after[:, :8], atol=1e-6)
    assert not torch.allclose(before[:, 8:], after[:, 8:], atol=1e-4)


def test_sequence_longer_than_block_size_raises_naming_the_length():
    with pytest.raises(ValueError, match="17"):
        small_gpt()(torch.zeros(1, 17, dtype=torch.long))


def test_generate_appends_tokens_reproducibly_from_a_generator():
    model = small_gpt()
    prompt = torch.zeros(2, 3, dtype=torch.long)
    first = model.generate(prompt, 20, generator=torch.Generator().manual_seed(0))
    second = model.generate(prompt, 20, generator=torch.Generator().manual_seed(0))
    assert first.shape == (2, 23) and torch.equal(first, second) and torch.equal(first[:, :3], prompt)


def test_tiny_mlp_learns_gaussian_blobs():
    dataset = make_classification(512, 8, 4, seed=0)
    features, labels = dataset.tensors
    model = TinyMLP(MLPConfig(in_features=8, hidden_sizes=(32,), num_classes=4), seed=0)
    assert model(features).shape == (512, 4) and model.num_parameters() == 8 * 32 + 32 + 32 * 4 + 4
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(100):
        loss = torch.nn.functional.cross_entropy(model(features), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    accuracy = (model(features).argmax(dim=1) == labels).float().mean().item()
    assert accuracy > 0.9


# --------------------------------------------------------------------------------------------------------
# Training TinyGPT to the Markov corpus' entropy floor


def test_tiny_gpt_100k_learns_the_markov_corpus_close_to_its_entropy_floor():
    chain = MarkovChain()
    tokens = chain.sample(100_000, seed=1)
    config = GPTConfig.preset("100k")
    model = TinyGPT(config, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(150):
        x, y = batches(tokens, 16, config.block_size, generator)
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    # Held-out text, and the loss a perfect model (the true transition probabilities) gets on the same tokens.
    held_out = chain.sample(64 * config.block_size + 1, seed=2)
    x, y = held_out[:-1].view(64, -1), held_out[1:].view(64, -1)
    with torch.no_grad():
        _, held_out_loss = model(x, y)
    perfect = float(-chain.transition[x, y].log().mean())
    assert losses[0] > 3.2  # log 32 = 3.47: nothing learned yet
    assert held_out_loss.item() - perfect < 0.15, (held_out_loss.item(), perfect)


# --------------------------------------------------------------------------------------------------------
# The Markov chain


def test_markov_entropy_rate_matches_the_empirical_cross_entropy_of_a_long_sample():
    chain = MarkovChain()
    assert chain.entropy_rate() == pytest.approx(1.2491377, abs=1e-6)  # the value in the docstring
    sample = chain.sample(200_000, seed=3)
    assert chain.cross_entropy(sample) == pytest.approx(chain.entropy_rate(), abs=0.015)


def test_markov_chain_is_a_stochastic_matrix_with_a_stationary_distribution():
    chain = MarkovChain()
    assert torch.allclose(chain.transition.sum(dim=1), torch.ones(VOCAB_SIZE, dtype=torch.float64))
    pi = chain.stationary_distribution()
    assert torch.all(pi > 0) and torch.allclose(pi @ chain.transition, pi, atol=1e-12)
    # The uniform chain's entropy rate is log V exactly; a few likely successors make it far lower.
    assert MarkovChain(successors=VOCAB_SIZE, smoothing=1.0).entropy_rate() == pytest.approx(math.log(VOCAB_SIZE))
    assert chain.entropy_rate() < math.log(4) < math.log(VOCAB_SIZE)


def test_markov_samples_are_deterministic_and_follow_the_transition_matrix():
    chain = MarkovChain()
    sample = chain.sample(100_000, seed=4)
    assert torch.equal(sample, chain.sample(100_000, seed=4))
    assert not torch.equal(sample, chain.sample(100_000, seed=5))
    assert torch.equal(MarkovChain(seed=0).transition, chain.transition)
    assert not torch.equal(MarkovChain(seed=1).transition, chain.transition)
    counts = torch.zeros(VOCAB_SIZE, VOCAB_SIZE, dtype=torch.float64)
    counts.index_put_((sample[:-1], sample[1:]), torch.ones(sample.numel() - 1, dtype=torch.float64), accumulate=True)
    busiest = counts.sum(dim=1).argmax()
    empirical = counts[busiest] / counts[busiest].sum()
    assert (empirical - chain.transition[busiest]).abs().max() < 0.03


def test_encode_and_decode_round_trip_the_alphabet():
    assert decode(encode(ALPHABET)) == ALPHABET and encode("ba").tolist() == [1, 0]
    with pytest.raises(ValueError, match="'A'"):
        encode("A")


# --------------------------------------------------------------------------------------------------------
# Data sets and batches


def test_make_classification_is_deterministic_balanced_and_leaves_the_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    first = make_classification(100, 5, 4, seed=1)
    assert torch.equal(torch.rand(3), expected)
    second, other = make_classification(100, 5, 4, seed=1), make_classification(100, 5, 4, seed=2)
    assert first.tensors[0].shape == (100, 5) and first.tensors[0].dtype == torch.float32
    assert torch.equal(first.tensors[0], second.tensors[0]) and torch.equal(first.tensors[1], second.tensors[1])
    assert not torch.equal(first.tensors[0], other.tensors[0])
    assert torch.bincount(first.tensors[1]).tolist() == [25, 25, 25, 25]


def test_char_dataset_windows_are_shifted_by_one():
    tokens = torch.arange(10)
    dataset = CharDataset(tokens, block_size=4)
    assert len(dataset) == 6
    x, y = dataset[5]
    assert x.tolist() == [5, 6, 7, 8] and y.tolist() == [6, 7, 8, 9]
    with pytest.raises(IndexError):
        dataset[6]


def test_batches_are_shifted_windows_reproducible_from_the_generator():
    tokens = torch.arange(1000)
    x, y = batches(tokens, 8, 16, torch.Generator().manual_seed(0))
    again, _ = batches(tokens, 8, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (8, 16) and torch.equal(y, x + 1) and torch.equal(x, again)
    assert len(set(x[:, 0].tolist())) > 1


# --------------------------------------------------------------------------------------------------------
# Sharding and per-rank seeds


def test_distributed_sampler_pads_by_repeating_indices_when_length_does_not_divide():
    shards = shard_with_distributed_sampler(10, 4, epoch=0)
    flat = [index for shard in shards for index in shard]
    assert [len(shard) for shard in shards] == [3, 3, 3, 3]
    assert sorted(set(flat)) == list(range(10)) and len(flat) - len(set(flat)) == 2
    dropped = shard_with_distributed_sampler(10, 4, epoch=0, drop_last=True)
    dropped_flat = [index for shard in dropped for index in shard]
    assert [len(shard) for shard in dropped] == [2, 2, 2, 2] and len(set(dropped_flat)) == 8


def test_distributed_sampler_without_shuffle_deals_indices_round_robin():
    assert shard_with_distributed_sampler(8, 4, epoch=3, shuffle=False) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_set_epoch_reshuffles_and_the_same_epoch_replays_the_same_order():
    epoch_0 = shard_with_distributed_sampler(100, 4, epoch=0)
    assert shard_with_distributed_sampler(100, 4, epoch=0) == epoch_0
    assert shard_with_distributed_sampler(100, 4, epoch=1) != epoch_0
    assert shard_with_distributed_sampler(100, 4, epoch=0, seed=1) != epoch_0
    assert sorted(index for shard in epoch_0 for index in shard) == list(range(100))


def test_seed_for_rank_is_seed_plus_rank():
    assert [seed_for_rank(10, rank) for rank in range(4)] == [10, 11, 12, 13]


def test_data_parallel_shard_is_the_distributed_sampler_of_the_data_parallel_rank():
    shards = shard_with_distributed_sampler(50, 2, epoch=1)
    assert [data_parallel_shard(50, dp_rank, 2, epoch=1) for dp_rank in range(2)] == shards
    # On dp=2 x tp=2 (tp innermost), global ranks 0 and 1 are replica 0, ranks 2 and 3 replica 1.
    by_global_rank = [data_parallel_shard(50, rank // 2, 2, epoch=1) for rank in range(4)]
    assert by_global_rank[0] == by_global_rank[1] == shards[0] != by_global_rank[2] == by_global_rank[3]


def _draw_batches_on_a_dp_by_tp_mesh(steps: int) -> list[torch.Tensor]:
    """On 4 ranks laid out dp=2 x tp=2, tp innermost (TP groups {0, 1} and {2, 3}; DP groups {0, 2} and
    {1, 3}): the batches this rank draws when seeded by its data-parallel rank."""
    rank = torch_dist.get_rank()
    tp_groups = [torch_dist.new_group([0, 1]), torch_dist.new_group([2, 3])]
    dp_groups = [torch_dist.new_group([0, 2]), torch_dist.new_group([1, 3])]
    tp_group, dp_group = tp_groups[rank // 2], dp_groups[rank % 2]
    assert torch_dist.get_world_size(tp_group) == 2 and torch_dist.get_rank(tp_group) == rank % 2
    generator = data_parallel_generator(7, torch_dist.get_rank(dp_group), torch_dist.get_world_size(dp_group))
    tokens = MarkovChain().sample(2_000, seed=0)
    return [torch.cat(batches(tokens, 4, 8, generator)) for _ in range(steps)]


def test_tensor_parallel_peers_draw_the_same_batches_and_data_parallel_peers_different_ones():
    drawn = launch(_draw_batches_on_a_dp_by_tp_mesh, 3, nprocs=4)
    for step in range(3):
        assert torch.equal(drawn[0][step], drawn[1][step]) and torch.equal(drawn[2][step], drawn[3][step])
        assert not torch.equal(drawn[0][step], drawn[2][step])
    assert not torch.equal(drawn[0][0], drawn[0][1])  # and each replica moves on from step to step


def test_augmentation_overlap_is_total_with_a_shared_seed_and_near_zero_with_per_rank_seeds():
    assert augmentation_overlap(4, same_seed=True) == 1.0
    assert augmentation_overlap(4, same_seed=False) < 0.05


# --------------------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("make, named", [
    (lambda: GPTConfig(n_embd=50, n_head=4), "n_embd=50"),
    (lambda: GPTConfig(block_size=0), "block_size"),
    (lambda: GPTConfig(dropout=1.0), "dropout"),
    (lambda: GPTConfig.preset("2m"), "'2m'"),
    (lambda: MLPConfig(hidden_sizes=(8, 0)), r"hidden_sizes\[1\]"),
    (lambda: MarkovChain(successors=33), "successors"),
    (lambda: CharDataset(torch.arange(4), block_size=4), "block_size=4"),
    (lambda: CharDataset(torch.arange(10), block_size=0), "block_size"),
    (lambda: make_classification(0, 2, 2), "num_samples"),
    (lambda: shard_with_distributed_sampler(10, 0, epoch=0), "world_size"),
    (lambda: augmentation_overlap(1, same_seed=True), "num_ranks"),
    (lambda: seed_for_rank(0, -1), "rank"),
    (lambda: data_parallel_generator(0, 2, 2), r"dp_rank.*dp_size=2.*got 2"),
    (lambda: data_parallel_shard(10, 0, 0, epoch=0), "dp_size"),
], ids=["heads", "block_size", "dropout", "preset", "hidden", "successors", "short_tokens", "window", "samples",
        "world_size", "one_rank", "negative_rank", "dp_rank", "dp_size"])
def test_bad_input_raises_value_error_naming_the_value(make, named):
    with pytest.raises(ValueError, match=named):
        make()
