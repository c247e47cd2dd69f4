"""A published table of FSDP runs on H100s, as data: the set lesson 11's step model had never seen.

MosaicML's **MPT training benchmarks** (llm-foundry, ``scripts/train/benchmarking/README.md``, section "H100
80GB BF16", read at commit ``061f2c7ce64e655100286584a7629e2a09f827ba`` of https://github.com/mosaicml/llm-foundry)
time MPT models from 760M to 70B parameters under PyTorch FSDP (``FULL_SHARD``: ZeRO-3, every layer's weights
gathered before its forward and again before its backward), no tensor or pipeline parallelism, on 8 to 64
H100s, and print the throughput, the micro-batch, the gradient accumulation and whether activations were
checkpointed.  Nobody fitted anything of labkit to it, and which rows it holds, and what counts as the model
doing well on them (:mod:`labkit.costmodel.validation`), were written down before the first prediction of any
row was computed.

**The rows taken**, by a rule fixed in advance: every row of that table whose sequence length is 2,048 tokens
(the length of every MPT size's base configuration, ``scripts/train/yamls/pretrain/mpt-*.yaml``, and the only
one at which the table runs more than one node): 20 rows, seven model sizes.

**The models** (the yamls: ``d_model``, ``n_heads``, ``n_layers``, ``expansion_ratio: 4``, ``vocab_size:
50368``): GPT blocks with a GELU MLP of ``4h``, LayerNorm and biases, a learned position table of 2,048 rows
and the output layer tied to the embedding; labkit's :class:`~labkit.costmodel.shapes.TransformerShape` so
built counts exactly the table's ``NumParams`` for all seven (tested).  No dropout (MPT's defaults).

**The measurement**: the table's throughput in tokens a second a GPU.  labkit's MFU of a row is that times
labkit's FLOPs a token (:func:`~labkit.costmodel.compute.model_flops_per_step`), over the H100's 989 TFLOP/s;
the table's own MFU counts ``6 N`` with every parameter and gives the same within half a point (tested).

**How they ran, and what is assumed** (the README says no more): ZeRO-3 (``zero=3``) with each layer's weights
gathered in bf16 and the gradients reduce-scattered in fp32 (Composer's ``mixed_precision: DEFAULT`` as its
current ``get_mixed_precision`` sets it; older Composer versions gathered fp32 weights); activation
checkpointing as the table's column says (full recomputation); a flash attention kernel (``attn_impl:
triton``); the table's micro-batch and gradient accumulation (``m``); and nodes of 8 H100s with one 400 Gb/s
adapter a GPU, as labkit's H100 preset (the README gives the interconnect of its A100 cluster, 1,600 Gb/s a
node over RoCE, and none for the H100s).  Composer may reduce-scatter the gradients after every micro-batch
where labkit reduces them once a step: the two differ only in the rows with ``m > 1``.
"""

from __future__ import annotations

from labkit.costmodel.compute import model_flops_per_step
from labkit.costmodel.published import PublishedRun
from labkit.costmodel.shapes import TransformerShape

MOSAIC_README = ("MosaicML, llm-foundry, scripts/train/benchmarking/README.md, 'H100 80GB BF16' (commit 061f2c7c), "
                 "https://github.com/mosaicml/llm-foundry")
# size: (layers, d_model, heads, NumParams as printed)
MPT_SHAPES = {"760m": (24, 1536, 12, 760470528), "1b": (24, 2048, 16, 1315950592), "3b": (32, 2560, 20, 2651837440),
              "7b": (32, 4096, 32, 6658859008), "13b": (40, 5120, 40, 12853954560),
              "30b": (48, 7168, 56, 29975214080), "70b": (80, 8192, 64, 64862437376)}
SEQ_LEN, VOCAB = 2048, 50368

# Every H100 80GB BF16 row at sequence length 2048, in the table's order:
# (size, GPUs, MFU % as printed, micro-batch, gradient accumulation, global batch, tokens/s/GPU, checkpointing)
MPT_ROWS = (
    ("70b", 64, 42.57, 8, 4, 2048, 1039, True),
    ("70b", 32, 36.15, 2, 16, 1024, 882, True),
    ("30b", 32, 43.92, 14, 3, 1344, 2308, True),
    ("30b", 16, 43.07, 10, 3, 480, 2263, True),
    ("30b", 8, 38.11, 3, 21, 504, 2002, True),
    ("13b", 64, 39.86, 2, 1, 128, 4800, False),
    ("13b", 32, 39.95, 2, 1, 64, 4811, False),
    ("13b", 16, 39.58, 2, 1, 32, 4767, False),
    ("13b", 8, 39.79, 2, 1, 16, 4792, False),
    ("7b", 8, 46.44, 6, 1, 48, 10643, False),
    ("3b", 64, 40.8, 6, 3, 1152, 22525, False),
    ("3b", 32, 41.7, 6, 3, 576, 23021, False),
    ("3b", 16, 43.73, 10, 3, 480, 24142, False),
    ("1b", 64, 40.85, 20, 1, 1280, 44402, False),
    ("1b", 32, 41.52, 20, 1, 640, 45130, False),
    ("1b", 16, 42.36, 20, 1, 320, 46037, False),
    ("1b", 8, 41.82, 14, 1, 112, 45455, False),
    ("760m", 32, 37.57, 24, 1, 768, 67971, False),
    ("760m", 16, 37.89, 24, 1, 384, 68551, False),
    ("760m", 8, 34.9, 24, 2, 384, 63147, False),
)


def mpt_shape(size: str) -> TransformerShape:
    """An MPT size as labkit builds it (module docstring)."""
    layers, hidden, heads, _ = MPT_SHAPES[size]
    return TransformerShape(layers, hidden, heads, SEQ_LEN, VOCAB)


def _mpt(size: str, gpus: int, percent: float, micro: int, accumulation: int, batch: int, tokens: int,
         checkpointing: bool) -> PublishedRun:
    if micro * accumulation * gpus != batch:
        raise ValueError(f"MPT {size} on {gpus} GPUs: {micro} x {accumulation} x {gpus} is not the batch {batch}")
    flops_per_token = model_flops_per_step(mpt_shape(size), batch) / (batch * SEQ_LEN)
    layers, hidden, heads, _ = MPT_SHAPES[size]
    return PublishedRun(f"MPT-{size}, {gpus} GPUs", MOSAIC_README, layers, hidden, heads, SEQ_LEN, VOCAB, size,
                        gpus, 1, 1, gpus, batch, tokens * flops_per_token / 1e12, 0.5 * flops_per_token / 1e12,
                        percent / 100, micro_batch=micro, zero=3, dropout=False, gradient_bytes=4,
                        overlap_gather=False, recompute=checkpointing, tied_embeddings=True)


MOSAIC_FSDP = tuple(_mpt(*row) for row in MPT_ROWS)
