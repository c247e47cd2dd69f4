"""Published large-scale runs, as data: what lesson 11's models (``compute``, ``step``, ``planner``) are held to.

Three sources give, for dense GPT-style models on hundreds to thousands of GPUs, the layout and the throughput
measured (:mod:`labkit.costmodel.validation` fits the step model's one constant on the first and tests it on
the others):

- **Megatron-LM** (NVIDIA, README "Performance Benchmarking" / "Training Speed and Scalability", added 2024-07-15
  by D. Narayanan in commit ``f2e5db402c`` "New scaling figures on H100 GPUs", figures labelled "Megatron-Core
  r0.8.0"; https://github.com/NVIDIA/Megatron-LM, ``images/model_table.png``, ``weak_scaling.png``,
  ``strong_scaling.png``).  GPT models from 1.7B to 462B parameters, vocabulary 131,072, sequence 4,096, with
  data-parallel (``--overlap-grad-reduce --overlap-param-gather``), tensor-parallel (``--tp-comm-overlap``) and
  pipeline communication overlapped.  :data:`MEGATRON_WEAK_SCALING` is the model table, every row;
  :data:`MEGATRON_STRONG_SCALING` the strong-scaling figure (no table: read off the plot, below).
- **Llama 3** (Llama Team, AI @ Meta: A. Dubey et al., "The Llama 3 Herd of Models", 2024, arXiv 2407.21783,
  https://arxiv.org/abs/2407.21783).  :data:`LLAMA3_405B` is Table 4 ("Scaling configurations and MFU for each
  stage of Llama 3 405B pre-training"), every row; the shape is Table 3's 405B column.
- **Narayanan et al. 2021** (D. Narayanan, M. Shoeybi, J. Casper, P. LeGresley, M. Patwary, V. Korthikanti, D.
  Vainbrand, P. Kashinkunti, J. Bernauer, B. Catanzaro, A. Phanishayee, M. Zaharia, "Efficient Large-Scale
  Language Model Training on GPU Clusters Using Megatron-LM", SC21, arXiv 2104.04473).  :data:`NARAYANAN_2021`
  is Table 1 ("Weak-scaling throughput for GPT models ranging from 1 billion to 1 trillion parameters"), every
  row: GPT models of vocabulary 51,200 and sequence 2,048 on Selene's DGX A100 nodes (eight 80 GB A100s joined by
  NVLink and NVSwitch, eight 200 Gb/s HDR InfiniBand adapters a node, section 5).

Megatron-LM's model table (``images/model_table.png``; "MFU" against the H100's 989 TFLOP/s):

==========  =====  ======  ======  ==  ==  ==  ====  =====  ==========  ===  ============
model size  heads  hidden  layers  TP  PP  DP  GPUs  batch  TFLOP/s/GPU MFU  PFLOP/s total
==========  =====  ======  ======  ==  ==  ==  ====  =====  ==========  ===  ============
1.7B        16     2048    24      1   1   48  48    192    408.8       41%  19.6
7.1B        32     4096    30      2   1   48  96    192    465.9       47%  44.7
16B         48     6144    32      4   1   48  192   192    489.1       49%  93.9
32B         56     7168    48      8   1   48  384   192    459.6       46%  176.5
70B         64     8192    84      8   2   48  768   384    419.7       42%  322.3
119B        80     10240   92      8   4   48  1536  768    420.5       43%  645.9
177B        96     12288   96      8   6   48  2304  1152   432.8       44%  997.2
314B        128    16384   96      8   8   48  3072  1536   474.4       48%  1457.4
462B        144    18432   112     8   16  48  6144  3072   459.9       47%  2825.6
==========  =====  ======  ======  ==  ==  ==  ====  =====  ==========  ===  ============

Llama 3's Table 4 (405B: 126 layers, model dimension 16,384, FFN 53,248, 128 heads, 8 key/value heads; SwiGLU,
RoPE; Table 3 gives the vocabulary as 128,000, the released tokenizer has 128,256):

======  ==  ==  ==  ===  ========  =============  ============  ==========  ========
GPUs    TP  CP  PP  DP   seq. len  batch size/DP  tokens/batch  TFLOPs/GPU  BF16 MFU
======  ==  ==  ==  ===  ========  =============  ============  ==========  ========
8,192   8   1   16  64   8,192     32             16M           430         43%
16,384  8   1   16  128  8,192     16             16M           400         41%
16,384  8   16  16  8    131,072   16             16M           380         38%
======  ==  ==  ==  ===  ========  =============  ============  ==========  ========

The paper prints DP = 4 in the last row (copies of the PDF and of arXiv's HTML page read 4; one transcription of
arXiv version 3 reads 8); 8 x 16 x 16 x 4 is 8,192 GPUs, not 16,384, and 4 x 16 x 131,072 tokens is 8M, not 16M:
DP = 8 is the row that adds up, and :class:`PublishedRun` refuses the other.

Narayanan et al. 2021's Table 1 (teraFLOP/s and "percentage of theoretical peak" count the FLOPs of the
paper's equation 3, which includes the recomputed forward: they are *hardware* FLOPs; labkit's MFU of a row is
its TFLOP/s times the model's FLOPs over equation 3's, over the A100's 312 TFLOP/s):

=========  =====  ======  ======  ==  ==  ====  =====  ===========  ========  =============
model      heads  hidden  layers  TP  PP  GPUs  batch  TFLOP/s/GPU  % peak    PFLOP/s total
=========  =====  ======  ======  ==  ==  ====  =====  ===========  ========  =============
1.7B       24     2304    24      1   1   32    512    137          44%       4.4
3.6B       32     3072    30      2   1   64    512    138          44%       8.8
7.5B       32     4096    36      4   1   128   512    142          46%       18.2
18.4B      48     6144    40      8   1   256   1024   135          43%       34.6
39.1B      64     8192    48      8   2   512   1536   138          44%       70.8
76.1B      80     10240   60      8   4   1024  1792   140          45%       143.8
145.6B     96     12288   80      8   8   1536  2304   148          47%       227.1
310.1B     128    16384   96      8   16  1920  2160   155          50%       297.4
529.6B     128    20480   105     8   35  2520  2520   163          52%       410.2
1008.0B    160    25600   128     8   64  3072  3072   163          52%       502.0
=========  =====  ======  ======  ==  ==  ====  =====  ===========  ========  =============

**Strong scaling, read off a figure.**  The README strong-scales "the standard GPT-3 model (slightly more than 175
billion parameters due to larger vocabulary size)" from 96 to 4,608 H100s at 1,152 sequences per step, "MFU from
47% to 42%", and plots aggregate PFLOP/s on log-log axes without printing the numbers.  The points were read from
the PNG's pixels (dot centres against the axes' grid lines); the same reading of the weak-scaling figure gives
the table's PFLOP/s within 0.9 %, so each value here is good to about 1 %.  The GPU counts (96, 144, ..., 4,608)
read within 0.2 % of whole multiples of 48.  No layouts are given: TP 8, PP 6 (DP = GPUs / 48) is inferred, not
published: it is the model table's 177B layout, whose 2,304-GPU row is this figure's 2,304-GPU point at the same
batch (997.2 PFLOP/s in the table, 1,003.6 read), and it divides every point.

**How the runs were run** (:meth:`PublishedRun.memory_options`, :meth:`~PublishedRun.step_options`), where
the sources say so:

- *flash attention* (memory model: no ``s x s`` attention matrix stored).  Megatron-Core r0.8 builds its GPT
  layers with Transformer Engine by default (``--transformer-impl transformer_engine``, ``arguments.py`` at
  ``f2e5db402c``; ``pretrain_gpt.py``, ``gpt_layer_specs.py``), whose attention is ``TEDotProductAttention``,
  "Transformer-Engine's ``DotProductAttention`` layer that also has 'flash attention' enabled"
  (``megatron/core/transformer/custom_layers/transformer_engine.py``); every row's heads are 128 wide, the
  most the README says FlashAttention supports.  Llama 3: *inferred*, the paper's pre-training sections name
  no attention kernel, but it trains 8K sequences "without activation checkpointing" (section 3.3.2), and the
  first row's layout stores 418 GB per GPU of activations and states by labkit's memory model with the attention
  matrices, 111 GB without (more than an H100 holds even so: labkit's memory model cannot fit the layout Meta
  ran, and its planner rejects it);
- *dropout*: Megatron's ``--attention-dropout`` and ``--hidden-dropout`` default to 0.1 (``arguments.py``;
  ``TransformerConfig`` too) and the README disables neither: masks stored.  Llama 3: *inferred*, the paper
  names no dropout and Meta's reference model (https://github.com/meta-llama/llama3, ``llama/model.py``) has
  none: no masks;
- *gradients reduced in fp32* (``gradient_bytes=4``): Megatron's ``arguments.py`` turns
  ``accumulate_allreduce_grads_in_fp32`` on for bf16 ("bfloat16 requires gradient accumulation and all-reduce
  to be done in fp32"), which ``training.py`` passes as ``grad_reduce_in_fp32``; Llama 3 (3.3.2, "Numerical
  stability") "reduce-scatter[s] gradients in FP32 across data parallel workers in FSDP";
- *ZeRO-2 traffic, the weights' gather behind the next forward* (``zero=2``, ``overlap_gather``).  Megatron:
  ``--overlap-grad-reduce --overlap-param-gather`` (README), and ``--overlap-param-gather`` asserts the
  distributed optimizer (``arguments.py``), which reduce-scatters the gradients and all-gathers the updated
  weights.  Llama 3's FSDP "shards optimizer states and gradients, but for model shards we do not reshard
  after forward computation", and DP tolerates latency "by asynchronously prefetching sharded model weights
  and reducing gradients" (3.3.2): the same traffic.
- *TP communication overlapped* (``overlap_tp``): the README's ``--tp-comm-overlap`` (not Llama 3, not 2021).
- *Llama 3's pipeline balanced* (``stage_layers``): "we reduce one Transformer layer each from the first and
  the last stages" (3.3.2): 128 chunks of one layer, the first holding only the embedding, the last the output.
- *Narayanan et al. 2021*: activation recomputation (their equation 3 "assumes activation recomputation" and
  Table 1's FLOP/s are counted with it); the interleaved schedule with the scatter/gather optimisation
  (section 5.1: each TP rank sends ``1 / t`` of a boundary's activations); a GPT with the output layer tied to
  the embedding (the table's sizes are equation 2's ``12 l h^2 (1 + 13 / 12h + (V + s) / 12lh)``, which counts
  the vocabulary once); no flash attention (2021), dropout on (Megatron's defaults); plain data parallelism
  (ZeRO 0: no distributed optimizer in 2021) with fp16 gradients, reduced after the pipeline's schedule
  (Megatron's ``--DDP-impl local`` of the time all-reduced once ``forward_backward`` returned).

**Unverifiable, assumed the same for every row:** *micro-batches* of 1 sequence (Megatron's own
``examples/gpt3/train_gpt3_175b_distributed.sh`` uses ``--micro-batch-size 1``; Llama 3 and Narayanan et al.
do not say); *the interleaved schedule with one layer per virtual stage* wherever PP > 1 (Megatron overlaps
pipeline sends, as the README says they were, only when interleaving, and the 119B and 462B rows, 23 and 7
layers per stage, allow no other count; Llama 3 interleaves with chunks of one layer; Narayanan et al. name the
interleaved schedule, not its ``v``); *no recomputation* in the README's and Llama 3's runs (the README does not
say; Llama 3 says none at 8K).  The README's GPT shape is Megatron's default (GELU MLP of 4h, LayerNorm,
biases, learned positions) with an untied output layer: tied, "7.1B" and "16B" would be 6.6B and 15.3B; without
the position table, 32B, 119B and 462B would round to 31B, 118B and 461B.

**Memory, as labkit's model counts it** (:meth:`PublishedRun.memory`: fp32 gradients held whole while a step
accumulates them, the fullest pipeline rank): every Megatron-LM and Narayanan et al. layout fits in 72 of 80 GB;
Llama 3's does not (111 and 101 GB: the interleaved warm-up holds 18 micro-batches of 8K tokens, whose
activations labkit keeps whole where the paper frees each stage's input and output early, 3.3.2).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from labkit.costmodel.compute import GPUS, model_flops_per_step, narayanan_flops
from labkit.costmodel.planner import Cluster
from labkit.costmodel.rank_memory import layout_memory
from labkit.costmodel.shapes import TransformerShape
from labkit.costmodel.step import Layout
from labkit.degrees import check_degree

MEGATRON_README = ("NVIDIA, Megatron-LM README, 'Performance Benchmarking' (commit f2e5db402c, 2024-07-15, "
                   "Megatron-Core r0.8.0), https://github.com/NVIDIA/Megatron-LM")
LLAMA3_PAPER = ("Llama Team, AI @ Meta (Dubey et al.), 'The Llama 3 Herd of Models', 2024, arXiv 2407.21783, "
                "https://arxiv.org/abs/2407.21783")
NARAYANAN_PAPER = ("Narayanan et al., 'Efficient Large-Scale Language Model Training on GPU Clusters Using "
                   "Megatron-LM', SC21, arXiv 2104.04473, https://arxiv.org/abs/2104.04473")
H100, A100 = "H100 80GB", "A100 80GB"
ARCHITECTURES = ("gpt", "llama")
RECOMPUTE_MODES = ("none", "full", "selective", "selective op", "selective layer")


@dataclass(frozen=True)
class PublishedRun:
    """One published run: the model, the layout, the throughput measured, how it was run, and the unpublished
    choices that a prediction needs (sources and assumptions in the module docstring).

    ``tflops_per_gpu`` and ``mfu`` are as printed (``mfu`` a fraction; of hardware FLOPs, recomputation
    included, where ``hardware_flops``); ``tflops_resolution`` is half a unit of the last digit printed (0.05
    for 408.8, 5 for 430).  ``global_batch`` counts sequences of ``seq_len``.  ``flash_attention`` and
    ``dropout`` go to the memory model; ``gradient_bytes`` (4: accumulated and reduced in fp32) to both;
    ``overlap_gather`` (ZeRO-1/2's gather of the weights behind the next forward), ``overlap_tp``,
    ``overlap_dp`` and ``stage_layers`` (each pipeline chunk's layers, where not even) to the step model.  As
    printed: ``recompute_mode`` (the layout's selective recomputation), ``sequence_parallel`` (the step model's),
    ``step_s``, ``tokens_per_s_per_gpu``."""

    name: str
    source: str
    num_layers: int
    hidden_size: int
    num_heads: int
    seq_len: int
    vocab_size: int
    parameters: str  # the model size as printed, e.g. "462B"
    gpus: int
    tp: int
    pp: int
    dp: int
    global_batch: int
    tflops_per_gpu: float
    tflops_resolution: float
    mfu: float | None  # None where the source prints none
    cp: int = 1
    ffn_hidden_size: int | None = None
    num_kv_heads: int | None = None
    architecture: str = "gpt"
    aggregate_pflops: float | None = None
    gpu: str = H100
    micro_batch: int = 1
    zero: int = 2
    virtual_stages: int = 1
    stage_layers: tuple[int, ...] | None = None
    flash_attention: bool = True
    dropout: bool = True
    gradient_bytes: int = 4
    overlap_gather: bool = True
    overlap_tp: bool = False
    overlap_dp: bool = True
    recompute: bool = False
    tied_embeddings: bool = False
    hardware_flops: bool = False
    learned_positions: bool = True  # a GPT's position table (False: ALiBi, as BLOOM)
    recompute_mode: str = ""  # "", or one of RECOMPUTE_MODES
    sequence_parallel: bool | None = None  # None: the step model's default (on with TP)
    step_s: float | None = None
    tokens_per_s_per_gpu: float | None = None
    compiled: bool = False  # torch.compile
    float8: bool = False

    def __post_init__(self) -> None:
        if self.recompute_mode and (self.recompute_mode not in RECOMPUTE_MODES
                                    or self.recompute != (self.recompute_mode == "full")):
            raise ValueError(f"{self.name}: recompute_mode {self.recompute_mode!r} with recompute={self.recompute}")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"{self.name}: architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")
        for field in ("tp", "pp", "dp", "cp"):
            check_degree(field, getattr(self, field), f"{self.name}: {field}")
        for field in ("gpus", "global_batch", "micro_batch", "virtual_stages", "gradient_bytes"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{self.name}: {field} must be an integer >= 1, got {value!r}")
        if self.tp * self.cp * self.pp * self.dp != self.gpus:
            raise ValueError(f"{self.name}: tp={self.tp} x cp={self.cp} x pp={self.pp} x dp={self.dp} = "
                             f"{self.tp * self.cp * self.pp * self.dp} GPUs, not gpus={self.gpus}")
        if self.global_batch % (self.dp * self.micro_batch):
            raise ValueError(f"{self.name}: global_batch={self.global_batch} does not split into dp={self.dp} "
                             f"replicas of micro-batches of {self.micro_batch}")

    @property
    def modelled(self) -> bool:
        """Whether labkit's step model can express the layout: every row since it models context parallelism
        (Llama 3's all-gather: section 3.3.2, "we first all-gather the K and V tensors, and then compute attention
        output for the local Q tensor chunk")."""
        return True

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def shape(self) -> TransformerShape:
        """The model as built: Megatron-LM's GPT (see the module docstring) or Llama's (RMSNorm, SwiGLU, RoPE, no
        biases, untied output layer)."""
        if self.architecture == "gpt":
            style = {"learned_positions": self.learned_positions, "tied_embeddings": self.tied_embeddings}
        else:
            style = {"mlp": "swiglu", "norm": "rmsnorm", "bias": False, "learned_positions": False,
                     "tied_embeddings": False}
        return TransformerShape(self.num_layers, self.hidden_size, self.num_heads, self.seq_len, self.vocab_size,
                                ffn_hidden_size=self.ffn_hidden_size, num_kv_heads=self.num_kv_heads, **style)

    def layout(self) -> Layout:
        """The published degrees as a :class:`~labkit.costmodel.step.Layout`, completed as the module docstring
        says (context parallelism: all-gather, as Llama 3 runs it)."""
        schedule = "interleaved" if self.virtual_stages > 1 else "1f1b"
        selective = {"selective": "attention", "selective op": "op", "selective layer": "layer"}
        return Layout(self.dp, self.tp, self.pp, self.zero, self.micro_batch, self.recompute, schedule,
                      self.virtual_stages, self.cp, "all_gather", selective=selective.get(self.recompute_mode, ""))

    def memory_options(self) -> dict[str, bool | int]:
        """How the run held its activations and gradients: :func:`~labkit.costmodel.rank_memory.layout_memory`'s."""
        return {"flash_attention": self.flash_attention, "dropout": self.dropout,
                "gradient_bytes": self.gradient_bytes}

    def step_options(self) -> dict[str, int | bool]:
        """How the run communicated: :func:`~labkit.costmodel.planner.plan`'s options for the step model."""
        return {"gradient_bytes": self.gradient_bytes, "overlap_gather": self.overlap_gather,
                "overlap_tp": self.overlap_tp, "flash_attention": self.flash_attention, "dropout": self.dropout,
                **({} if self.sequence_parallel is None else {"sequence_parallel": self.sequence_parallel})}

    def plan_options(self) -> dict[str, int | bool]:
        """Both, for :func:`~labkit.costmodel.planner.plan`."""
        return self.memory_options() | self.step_options()

    def memory(self, layout: Layout | None = None) -> dict[str, float]:
        """Bytes on the fullest GPU by labkit's memory model of ``layout`` (default: :meth:`layout`)."""
        layout = self.layout() if layout is None else layout
        layers = self.stage_layers if layout == self.layout() else None
        return layout_memory(self.shape(), layout, self.global_batch, stage_layers=layers, **self.memory_options())

    def cluster(self, efficiency: float | tuple[float, float, float]) -> Cluster:
        """The run's GPUs (:data:`labkit.costmodel.compute.GPUS`) at ``(matrices, attention, memory)`` efficiencies
        (:class:`~labkit.costmodel.kernels.Kernels`), or with one number every FLOP at it (the earlier model)."""
        if self.gpu not in GPUS:
            raise ValueError(f"{self.name}: unknown GPU {self.gpu!r}; choose one of {sorted(GPUS)}")
        rates = (efficiency, None, None) if isinstance(efficiency, (int, float)) else tuple(efficiency)
        return Cluster(GPUS[self.gpu], self.gpus, *rates)

    def model_flops(self) -> float:
        """The model's FLOPs per step (:func:`~labkit.costmodel.compute.model_flops_per_step`)."""
        return model_flops_per_step(self.shape(), self.global_batch)

    def counted_flops(self) -> float:
        """The FLOPs per step behind the published TFLOP/s: the model's, or with ``hardware_flops`` Narayanan et
        al.'s equation 3, recomputation included."""
        if not self.hardware_flops:
            return self.model_flops()
        return narayanan_flops(self.global_batch, self.seq_len, self.num_layers, self.hidden_size, self.vocab_size)

    def implied_step_s(self) -> float:
        """The step time the published TFLOP/s per GPU imply."""
        return self.counted_flops() / (self.gpus * self.tflops_per_gpu * 1e12)

    @property
    def model_mfu(self) -> float:
        """The measured MFU as labkit counts it: the model's FLOPs (no recomputation) over the implied step, over
        the GPUs' peak.  For Narayanan et al.'s rows, about three quarters of the printed percentage."""
        return self.model_flops() / self.implied_step_s() / (self.gpus * GPUS[self.gpu].peak_bf16_flops)


def _megatron(size: str, heads: int, hidden: int, layers: int, tp: int, pp: int, dp: int, gpus: int, batch: int,
              tflops: float, percent: int, pflops: float) -> PublishedRun:
    return PublishedRun(size, MEGATRON_README + ", images/model_table.png", layers, hidden, heads, 4096, 131072,
                        size, gpus, tp, pp, dp, batch, tflops, 0.05, percent / 100, aggregate_pflops=pflops,
                        virtual_stages=layers // pp if pp > 1 else 1, overlap_tp=True)


MEGATRON_WEAK_SCALING = (
    #         size    heads hidden layers TP PP  DP  GPUs batch TFLOP/s MFU PFLOP/s
    _megatron("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8, 41, 19.6),
    _megatron("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9, 47, 44.7),
    _megatron("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1, 49, 93.9),
    _megatron("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6, 46, 176.5),
    _megatron("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7, 42, 322.3),
    _megatron("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5, 43, 645.9),
    _megatron("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8, 44, 997.2),
    _megatron("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4, 48, 1457.4),
    _megatron("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9, 47, 2825.6),
)


def _llama(gpus: int, tp: int, cp: int, pp: int, dp: int, seq_len: int, batch_per_dp: int, tflops: float,
           percent: int) -> PublishedRun:
    return PublishedRun(f"405B, {gpus} GPUs, seq {seq_len}", LLAMA3_PAPER + ", Table 4 (shape: Table 3)", 126,
                        16384, 128, seq_len, 128256, "405B", gpus, tp, pp, dp, dp * batch_per_dp, tflops, 5.0,
                        percent / 100, cp=cp, ffn_hidden_size=53248, num_kv_heads=8, architecture="llama",
                        virtual_stages=8, stage_layers=(0,) + (1,) * 126 + (0,), dropout=False)


LLAMA3_405B = (
    #      GPUs   TP CP  PP  DP   seq     batch/DP TFLOPs MFU
    _llama(8192, 8, 1, 16, 64, 8192, 32, 430, 43),
    _llama(16384, 8, 1, 16, 128, 8192, 16, 400, 41),
    _llama(16384, 8, 16, 16, 8, 131072, 16, 380, 38),
)
LLAMA3_TRAINING_FLOPS = 3.8e25  # section 1: "pre-trained using 3.8 x 10^25 FLOPs", on "15.6T text tokens"
LLAMA3_TRAINING_TOKENS = 15.6e12


def _narayanan(size: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int,
               tflops: int, percent: int, pflops: float) -> PublishedRun:
    return PublishedRun(f"{size} (A100)", NARAYANAN_PAPER + ", Table 1", layers, hidden, heads, 2048, 51200, size,
                        gpus, tp, pp, gpus // (tp * pp), batch, tflops, 0.5, percent / 100, aggregate_pflops=pflops,
                        gpu=A100, zero=0, virtual_stages=layers // pp if pp > 1 else 1, flash_attention=False,
                        gradient_bytes=2, overlap_gather=False, overlap_dp=False, recompute=True,
                        tied_embeddings=True, hardware_flops=True)


NARAYANAN_2021 = (
    #           size      heads hidden layers TP PP  GPUs batch TFLOP/s %peak PFLOP/s
    _narayanan("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 44, 4.4),
    _narayanan("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, 44, 8.8),
    _narayanan("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, 46, 18.2),
    _narayanan("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135, 43, 34.6),
    _narayanan("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138, 44, 70.8),
    _narayanan("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140, 45, 143.8),
    _narayanan("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148, 47, 227.1),
    _narayanan("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155, 50, 297.4),
    _narayanan("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163, 52, 410.2),
    _narayanan("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163, 52, 502.0),
)

RUNS = MEGATRON_WEAK_SCALING + LLAMA3_405B + NARAYANAN_2021


@dataclass(frozen=True)
class FigurePoint:
    """One point read off a figure: GPUs and aggregate PFLOP/s (to :data:`FIGURE_READING_ERROR`)."""

    gpus: int
    pflops: float

    @property
    def mfu(self) -> float:
        return self.pflops * 1e15 / (self.gpus * GPUS[H100].peak_bf16_flops)


FIGURE_READING_ERROR = 0.01  # relative; the weak-scaling figure read the same way gives its table within 0.9 %
MEGATRON_STRONG_SCALING = tuple(FigurePoint(gpus, pflops) for gpus, pflops in (
    (96, 44.5), (144, 66.7), (288, 132.4), (576, 263.1), (1152, 517.5), (2304, 1003.6), (3072, 1309.2),
    (4608, 1911.9)))


def strong_scaling_run(point: FigurePoint) -> PublishedRun:
    """The 177B row of the model table at ``point``'s GPU count: TP 8, PP 6 and the rest inferred (module
    docstring); its throughput is the figure's reading."""
    row = MEGATRON_WEAK_SCALING[6]
    tflops = point.pflops * 1e3 / point.gpus
    return dataclasses.replace(row, name=f"177B on {point.gpus} GPUs (read off the strong-scaling figure)",
                               source=MEGATRON_README + ", images/strong_scaling.png", gpus=point.gpus,
                               dp=point.gpus // (row.tp * row.pp), tflops_per_gpu=tflops,
                               tflops_resolution=FIGURE_READING_ERROR * tflops, mfu=point.mfu,
                               aggregate_pflops=point.pflops)


def megatron_flops_per_step(shape: TransformerShape, batch: int) -> float:
    """Megatron-LM's own count behind its TFLOP/s (``num_floating_point_operations`` in
    ``megatron/training/training.py`` at commit f2e5db402c), transcribed: ``12 B s L h^2 ((1 + g/a + s/h) q/h +
    f/h m + V / (2 L h))`` with ``g`` key/value heads, ``q`` the query width, ``m`` 3/2 for a gated MLP."""
    b, s, layers, h = batch, shape.seq_len, shape.num_layers, shape.hidden_size
    query_ratio = (h // shape.num_heads) * shape.num_heads / h
    gated = 3 / 2 if shape.mlp == "swiglu" else 1
    return 12 * b * s * layers * h * h * ((1 + shape.num_kv_heads / shape.num_heads + s / h) * query_ratio
                                          + shape.ffn_hidden_size / h * gated + shape.vocab_size / (2 * layers * h))
