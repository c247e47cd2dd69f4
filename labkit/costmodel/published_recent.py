"""Published runs of 2022-2025, as data, written down before labkit's step model predicted any of them.

Five sources give dense transformers' layouts and measured throughput.  Which rows each set holds was fixed by
a rule stated here before the rows were read, and no prediction of any row was computed in writing this module
(the step model's rules were being rewritten meanwhile): the sets are out of sample for what is fitted next.  Each table is reproduced below as the literal rows it
was read into, in the table's order, with what it printed beside each (memory, MFU, HFU) even where no field of
:class:`~labkit.costmodel.published.PublishedRun` takes it.

- **torchtitan** (PyTorch, https://github.com/pytorch/torchtitan).  *Rule: every bf16 row of its published
  performance tables*, none of its float8 rows.  (1) ``benchmarks/llama3_h100_202412_torchtitan.md`` (commit
  ``820504e2``; the same tables as ``docs/performance.md`` at ``d4c86e37``, 2025-01-30; runs of December 2024 at
  torchtitan ``9dec370a``): the bf16 rows of Tables 1 and 3 (Llama 3.1 8B, FSDP on 8 and 128 GPUs, with and
  without ``torch.compile``); Tables 2, 4, 5 and 6 are all float8.  (2) ``docs/performance.md`` at ``3faaa1a0``
  (2024-08-23): the 405B table's bf16 row ("Optimizations: None"; FSDP 16 x TP 8 on 128 H100s), and every row
  of its two A100 tables (Llama 3 8B and 70B, Llama 2 13B and 70B, FSDP on 64 A100s, first printed 2024-04-24,
  ``1ea476e9``).  :data:`TORCHTITAN_H100` (5 rows) and :data:`TORCHTITAN_A100` (8 rows).  Separately,
  :data:`TORCHTITAN_CP`: every row of (1)'s Table 2, Llama 3.1 8B at 32k to 256k tokens with context
  parallelism over 8 GPUs; **float8** (``torch.compile`` + Float8 on the linear layers), kept apart for that.
- **Korthikanti et al. 2022** (V. Korthikanti, J. Casper, S. Lym, L. McAfee, M. Andersch, M. Shoeybi, B.
  Catanzaro, "Reducing Activation Recomputation in Large Transformer Models", arXiv 2205.05198, MLSys 2023).
  *Rule: every cell of the end-to-end iteration-time table* (Table 5: full recomputation, and sequence
  parallelism with selective recomputation, for 22B, 175B, 530B and 1T GPTs), with the configurations of Table
  3: :data:`KORTHIKANTI_2022`, 8 rows.  The MFU and HFU columns are also Megatron-LM's README's (commit
  ``2e90a342f5``, 2022-05-19: "measured using a data parallel size of one"), read there.  **The paper's
  tables were not re-read for this module** (its PDF could not be opened from the machine that wrote it): the
  layouts and times are as transcribed, and the tests hold every column against the others and against the
  README, which they all match within rounding.
- **Smith et al. 2022** (S. Smith, M. Patwary, B. Norick et al., "Using DeepSpeed and Megatron to Train
  Megatron-Turing NLG 530B", arXiv 2201.11990), section 2.4: batch 1,920 on 280, 350 and 420 DGX A100 nodes,
  60.1, 50.2 and 44.4 s an iteration, 126, 121 and 113 TFLOP/s a GPU, every point: :data:`MTNLG_530B`.  Read
  as quoted by cli99/llm-analysis (``examples/megatron-turing-nlg/README.md``, commit ``eb2d5c03``); one replica
  is 280 GPUs, 8-way tensor and 35-way pipeline parallel (section 2).
- **BLOOM** (BigScience, tr11-176B-ml; https://github.com/bigscience-workshop/bigscience at ``9e64edec``):
  ``train/tr11-176B-ml/README.md`` and ``tr11-176B-ml.slurm`` for the layout, ``chronicles.md`` for the
  throughput: its first logged iteration at the full batch (12,695: 105.22 s, "TFLOPs: 149.02"; "149-150
  TFLOPs per GPU", March 2022): :data:`BLOOM_176B`, 1 row.

:data:`RECENT_RUNS` is the 25 rows of 16-bit runs together.

**How the counts compare.**  torchtitan's MFU is ``6 N + 12 l h s`` FLOPs a token (``get_num_flop_per_token``);
in April 2024 ``N`` counted every parameter, from August 2024 all but the input embedding, which is labkit's
count (:func:`~labkit.costmodel.compute.model_flops_per_step`) to the norms' few parameters: the A100 rows'
printed MFU is labkit's plus the embedding's ``6 V h`` (tested).  Rows that print tokens/s take their TFLOP/s
a GPU as that times labkit's FLOPs a token (as :mod:`labkit.costmodel.published_fsdp` does).  Korthikanti et
al. print MFU (model FLOPs, their ``72 B s l h^2 (1 + s/6h + V/12lh)``, labkit's count exactly) and HFU
(``1 + s/3h`` for ``1 + s/6h``); their rows' TFLOP/s are the model FLOPs over the printed time.  MT-NLG's and
BLOOM's TFLOP/s are hardware FLOPs, Megatron's ``96 B s l h^2 (...)`` with recomputation (``hardware_flops``).

**How they ran, and what is inferred** (not printed where it says *inferred* or *assumed*):

- *torchtitan*: FSDP2 (ZeRO-3: ``zero=3``, each layer gathered before use, no gather behind the next
  forward), bf16 weights, gradients reduced in fp32 (``mixed_precision_reduce`` defaults to float32), SDPA's
  flash kernel, no dropout, no gradient accumulation (none existed then): the local batch is the micro-batch.
  The Llama shapes are the released ones (the FFN widths torchtitan computes from ``multiple_of`` and
  ``ffn_dim_multiplier``).  "selective op" saves every matrix product's and attention's output but every second
  product's; "selective layer" checkpoints every 2nd layer (*inferred*: the default of ``selective_ac_option``,
  the table names no number); Tables 1 and 3 print "Selective", the 8B config's option is "op" (*inferred*).
  ``torch.compile`` off where the table does not name it (*inferred*: the configs' default); in the 405B bf16
  row *unknown*, recorded off (the commit that printed it set the preset to compile, for the async-TP row).
  The H100 rows ran on Grand Teton's 96 GB HBM2e H100s at 500 W (the 405B page: "94GB"/"95GB"), whose peak
  NVIDIA does not give: the ``"H100 96GB HBM2e"`` preset prices them at the SXM's 989 TFLOP/s, as torchtitan's
  MFU does.  The A100
  pages name no interconnect (labkit's DGX A100 preset, *assumed*).  Context parallelism: PyTorch's ring
  attention with the K/V shards all-gathered (``context_parallel_rotate_method`` defaults to ``"allgather"``),
  FSDP over ``dp x cp``, local batch 1 per FSDP rank (``dp`` here), full recomputation.
- *Korthikanti et al.*: data parallelism 1, micro-batches of 1 (*assumed*), no interleaving (*assumed*),
  fp16 gradients, dropout on, no flash attention (2022), output layer tied, vocabulary 51,200; the full
  recomputation column is the paper's baseline, tensor parallelism without sequence parallelism.
- *MT-NLG*: the vocabulary 51,200 (GPT-2's 50,257 padded as Megatron pads, *inferred*; the TFLOP/s move by
  0.003 % either way), tied output layer, recomputation on (*inferred*: the printed TFLOP/s are the 4-pass count,
  126.0 against 125.7 computed, where 3 passes give 94), DeepSpeed's 1F1B pipeline, micro-batches of 1, plain
  data parallelism, fp16 gradients, dropout on (*assumed*); Selene's DGX A100 nodes of 80 GB GPUs (Microsoft's
  and NVIDIA's announcement of October 2021; not re-read).
- *BLOOM*: TP 4, PP 12, DP 8, micro-batch 2, batch 2,048 of 2,048 tokens, ALiBi (no position table), an extra
  LayerNorm on the embedding (2 h parameters labkit does not count), vocabulary padded to 250,880, tied
  embedding, ``--checkpoint-activations``, bf16 with DeepSpeed's ZeRO-1-like bf16 optimizer (``zero=1``; fp32
  gradients *assumed*), dropout 0.1 (Megatron's defaults), pipeline stages of 5, 6 x 10 and 5 layers (the
  README's ``type:transformer|embedding`` partition); ``CUDA_LAUNCH_BLOCKING=1`` was set ("or the training
  will hang").  Jean Zay's nodes: 8 A100s on NVLink and 4 Omni-Path links, the ``"A100 80GB (Omni-Path)"``
  preset.

**Found and left out**: OPT-175B (Zhang et al. 2022: "up to 147 TFLOP/s" is a maximum, and neither the
tensor-parallel degree nor how the "2M"-token batch splits over the 992 GPUs is printed); the BLOOM paper's
"156 TFLOPs in our fastest configuration" (not the configuration trained; the layout is not printed);
Korthikanti et al.'s 2,240-GPU 530B run (54.2 % against 42.1 % MFU: its batch is not printed); torchtitan's
async-TP page of June 2025 (its bf16 results are only in a figure not read here), Trainy's H200 page and Tables
4-6 (float8); PaLM and Gopher (TPUs).  DeepSeek-V3 prints no step: its pre-training is :data:`DEEPSEEK_V3`.

**DeepSeek-V3** (DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv 2412.19437): an MoE (671B, 37B active:
``TransformerShape.preset("deepseek-v3")``) pre-trained in FP8 on 2,048 H800s at "180K H800 GPU hours" per
trillion tokens, "3.7 days on our cluster" (section 1), 2,664K GPU hours for 14.8T tokens, 119K for the
context extension, 5K for post-training, 2,788K in all, $5.576M at $2 an hour (Table 1); 16-way pipeline
parallelism (DualPipe), 64-way expert parallelism over 8 nodes, ZeRO-1 data parallelism, no tensor
parallelism (section 3.2); each token sent to at most 4 nodes, and NVLink's 160 GB/s "roughly 3.2 times" IB's
50 GB/s (3.2.2); batch raised from 3,072 to 15,360 sequences of 4,096 tokens over the first 469B tokens (4.2).
The multi-token prediction module (one more layer's work a token) is outside the 671B and the shape.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from labkit.costmodel.compute import model_flops_per_step
from labkit.costmodel.published import A100, PublishedRun
from labkit.costmodel.shapes import TransformerShape

TORCHTITAN = "PyTorch, torchtitan, https://github.com/pytorch/torchtitan, "
TORCHTITAN_2024_12 = TORCHTITAN + "benchmarks/llama3_h100_202412_torchtitan.md (commit 820504e2)"
TORCHTITAN_2024_08 = TORCHTITAN + "docs/performance.md (commit 3faaa1a0, 2024-08-23)"
KORTHIKANTI_PAPER = ("Korthikanti et al., 'Reducing Activation Recomputation in Large Transformer Models', 2022, "
                     "arXiv 2205.05198, Tables 3 and 5; MFU/HFU also Megatron-LM README at 2e90a342f5")
MTNLG_PAPER = ("Smith et al., 'Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B', 2022, "
               "arXiv 2201.11990, section 2.4")
BLOOM_REPO = ("BigScience, https://github.com/bigscience-workshop/bigscience (9e64edec), train/tr11-176B-ml: "
              "README.md, tr11-176B-ml.slurm, chronicles.md (iteration 12695)")
DEEPSEEK_V3_REPORT = "DeepSeek-AI, 'DeepSeek-V3 Technical Report', 2024, arXiv 2412.19437"
H100_HBM2E, A100_OMNI_PATH, H800 = "H100 96GB HBM2e", "A100 80GB (Omni-Path)", "H800 80GB"

# --------------------------------------------------------------------------------------------------------
# torchtitan

# name: (layers, dim, heads, kv heads, FFN, vocabulary, torchtitan's sequence length): the released shapes
LLAMA_SHAPES = {"Llama 3 8B": (32, 4096, 32, 8, 14336, 128256, 8192),
                "Llama 3 70B": (80, 8192, 64, 8, 28672, 128256, 8192),
                "Llama 3 405B": (126, 16384, 128, 8, 53248, 128256, 8192),
                "Llama 2 13B": (40, 5120, 40, 40, 13824, 32000, 4096),
                "Llama 2 70B": (80, 8192, 64, 8, 28672, 32000, 4096)}

# (1) Tables 1 and 3, the bf16 rows, Llama 3.1 8B at 8,192 tokens, FSDP over every GPU, local batch 2, selective
# (op) checkpointing: (table, GPUs, torch.compile, TPS/GPU, memory GiB)
TORCHTITAN_2024_12_ROWS = ((1, 8, False, 5762, 82.4), (1, 8, True, 6667, 77.0),
                           (3, 128, False, 5605, 67.0), (3, 128, True, 6514, 62.0))
# (1)'s prose on those rows: "33% to 39% MFU"
TORCHTITAN_2024_12_MFU_RANGE = (0.33, 0.39)
# (2) The 405B table's bf16 row: 128 GPUs, FSDP 16 x TP 8, local batch 2, full checkpointing: (WPS, MFU %)
TORCHTITAN_405B_ROW = (109, 29.0)
# (2) The A100 tables, every row, FSDP over 64 A100s (Llama 3 at 8,192 tokens, Llama 2 at 4,096):
# (model, size, local batch, activation checkpointing, WPS, MFU %)
TORCHTITAN_A100_ROWS = (
    ("Llama 3 8B", "8B", 1, "selective layer", 2904, 56.8),
    ("Llama 3 8B", "8B", 1, "selective op", 2973, 58.2),
    ("Llama 3 70B", "70B", 1, "full", 331, 51.7),
    ("Llama 2 13B", "13B", 2, "none", 2162, 61.1),
    ("Llama 2 13B", "13B", 2, "selective layer", 1914, 54.1),
    ("Llama 2 13B", "13B", 2, "selective op", 1904, 53.8),
    ("Llama 2 70B", "70B", 1, "selective op", 355, 50.8),
    ("Llama 2 70B", "70B", 2, "full", 353, 50.5),
)
# (1) Table 2, every row (float8, torch.compile, full checkpointing, local batch 1, 8 GPUs):
# (FSDP, CP, sequence length, TPS/GPU, memory GiB)
TORCHTITAN_CP_ROWS = ((8, 1, 32768, 3890, 83.9), (4, 2, 65536, 2540, 84.2), (2, 4, 131072, 1071, 84.0),
                      (1, 8, 262144, 548, 84.5))


def flops_per_token(run: PublishedRun) -> float:
    """labkit's model FLOPs a token of ``run`` (no recomputation)."""
    return model_flops_per_step(run.shape(), 1) / run.seq_len


def _torchtitan(name: str, source: str, model: str, size: str, gpu: str, gpus: int, dp: int, tp: int,
                local_batch: int, checkpointing: str, compiled: bool, tokens: float, percent: float | None,
                cp: int = 1, seq_len: int | None = None, float8: bool = False) -> PublishedRun:
    layers, dim, heads, kv_heads, ffn, vocab, default_seq_len = LLAMA_SHAPES[model]
    seq_len = seq_len or default_seq_len
    run = PublishedRun(name, source, layers, dim, heads, seq_len, vocab, size, gpus, tp, 1, dp, dp * local_batch,
                       0.0, 0.0, None if percent is None else percent / 100, cp=cp, ffn_hidden_size=ffn,
                       num_kv_heads=kv_heads, architecture="llama", gpu=gpu, micro_batch=local_batch, zero=3,
                       dropout=False, overlap_gather=False, recompute=checkpointing == "full",
                       recompute_mode=checkpointing, tokens_per_s_per_gpu=tokens, compiled=compiled, float8=float8)
    per_token = flops_per_token(run)
    return dataclasses.replace(run, tflops_per_gpu=tokens * per_token / 1e12,
                               tflops_resolution=0.5 * per_token / 1e12)


TORCHTITAN_H100 = tuple(
    _torchtitan(f"Llama 3.1 8B, FSDP {gpus}{' + compile' if compiled else ''}",
                f"{TORCHTITAN_2024_12}, Table {table}",
                "Llama 3 8B", "8B", H100_HBM2E, gpus, gpus, 1, 2, "selective op", compiled, tokens, None)
    for table, gpus, compiled, tokens, _ in TORCHTITAN_2024_12_ROWS) + (
    _torchtitan("Llama 3.1 405B, FSDP 16 x TP 8", TORCHTITAN_2024_08 + ", 'Llama 3.1 performance numbers'",
                "Llama 3 405B", "405B", H100_HBM2E, 128, 16, 8, 2, "full", False, *TORCHTITAN_405B_ROW),)
TORCHTITAN_A100 = tuple(
    _torchtitan(f"{model}, FSDP 64, {checkpointing.replace('none', 'no')} checkpointing, local batch {batch}",
                TORCHTITAN_2024_08 + ", 'Llama 3/Llama 2 performance numbers' (A100)", model, size, A100, 64, 64, 1,
                batch, checkpointing, False, tokens, percent)
    for model, size, batch, checkpointing, tokens, percent in TORCHTITAN_A100_ROWS)
TORCHTITAN_CP = tuple(
    _torchtitan(f"Llama 3.1 8B, FSDP {dp} x CP {cp}, seq {seq_len} (float8)", f"{TORCHTITAN_2024_12}, Table 2",
                "Llama 3 8B", "8B", H100_HBM2E, 8, dp, 1, 1, "full", True, tokens, None, cp, seq_len, float8=True)
    for dp, cp, seq_len, tokens, _ in TORCHTITAN_CP_ROWS)

# --------------------------------------------------------------------------------------------------------
# Korthikanti et al. 2022: Table 3's configurations (sequence 2,048, vocabulary 51,200, A100 80GB) and Table 5's
# iteration times: (size, heads, hidden, layers, TP, PP, GPUs, batch, full recompute s, present work s,
# throughput increase %, MFU %, HFU %); "present work" is sequence parallelism with selective recomputation.
KORTHIKANTI_ROWS = (
    ("22B", 64, 6144, 48, 8, 1, 8, 4, 1.42, 1.10, 29.0, 41.5, 43.7),
    ("175B", 96, 12288, 96, 8, 8, 64, 64, 18.13, 13.75, 31.8, 51.4, 52.8),
    ("530B", 128, 20480, 105, 8, 35, 280, 280, 49.05, 37.83, 29.7, 56.0, 57.0),
    ("1T", 160, 25600, 128, 8, 64, 512, 512, 94.42, 71.49, 32.1, 56.3, 57.0),
)
SEQ_2048, VOCAB_51200 = 2048, 51200
TIME_RESOLUTION_S = 0.005  # half a unit of the last digit of Table 5's seconds


def _korthikanti(size: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int,
                 step_s: float, selective: bool, percent: float | None) -> PublishedRun:
    mode = "selective" if selective else "full"
    run = PublishedRun(f"{size} (A100), {'sequence parallel + selective' if selective else 'full'} recomputation",
                       KORTHIKANTI_PAPER, layers, hidden, heads, SEQ_2048, VOCAB_51200, size, gpus, tp, pp,
                       gpus // (tp * pp), batch, 0.0, 0.0, None if percent is None else percent / 100, gpu=A100,
                       zero=0, flash_attention=False, gradient_bytes=2, overlap_gather=False, overlap_dp=False,
                       recompute=not selective, tied_embeddings=True, recompute_mode=mode,
                       sequence_parallel=selective, step_s=step_s)
    tflops = run.model_flops() / (step_s * gpus) / 1e12
    return dataclasses.replace(run, tflops_per_gpu=tflops, tflops_resolution=tflops * TIME_RESOLUTION_S / step_s)


KORTHIKANTI_2022 = tuple(
    _korthikanti(size, heads, hidden, layers, tp, pp, gpus, batch, time, selective, mfu if selective else None)
    for size, heads, hidden, layers, tp, pp, gpus, batch, full_s, present_s, _, mfu, _ in KORTHIKANTI_ROWS
    for selective, time in ((False, full_s), (True, present_s)))

# --------------------------------------------------------------------------------------------------------
# MT-NLG 530B: 105 layers, hidden 20,480, 128 heads, sequence 2,048, batch 1,920, TP 8 x PP 35 a replica:
# (DGX A100 nodes, seconds an iteration, TFLOP/s a GPU)
MTNLG_ROWS = ((280, 60.1, 126), (350, 50.2, 121), (420, 44.4, 113))
MTNLG_TIME_RESOLUTION_S = 0.05

MTNLG_530B = tuple(
    PublishedRun(f"MT-NLG 530B on {nodes * 8} GPUs", MTNLG_PAPER, 105, 20480, 128, SEQ_2048, VOCAB_51200, "530B",
                 nodes * 8, 8, 35, nodes * 8 // 280, 1920, tflops, 0.5, None, gpu=A100, zero=0, flash_attention=False,
                 gradient_bytes=2, overlap_gather=False, overlap_dp=False, recompute=True, tied_embeddings=True,
                 hardware_flops=True, step_s=step_s)
    for nodes, step_s, tflops in MTNLG_ROWS)

# --------------------------------------------------------------------------------------------------------
# BLOOM 176B: 70 layers, hidden 14,336, 112 heads, sequence 2,048, vocabulary 250,880; TP 4 x PP 12 x DP 8 on
# 384 GPUs, micro-batch 2, batch 2,048; the chronicle's log line: 105.22 s an iteration, "TFLOPs: 149.02"
BLOOM_STAGE_LAYERS = (5,) + (6,) * 10 + (5,)
BLOOM_176B = (
    PublishedRun("BLOOM 176B on 384 GPUs", BLOOM_REPO, 70, 14336, 112, SEQ_2048, 250880, "176B", 384, 4, 12, 8,
                 2048, 149.02, 0.005, None, gpu=A100_OMNI_PATH, micro_batch=2, zero=1,
                 stage_layers=BLOOM_STAGE_LAYERS, flash_attention=False, gradient_bytes=4, overlap_gather=False,
                 overlap_dp=False, recompute=True, tied_embeddings=True, hardware_flops=True,
                 learned_positions=False, recompute_mode="full", step_s=105.22),
)

RECENT_RUNS = TORCHTITAN_H100 + TORCHTITAN_A100 + KORTHIKANTI_2022 + MTNLG_530B + BLOOM_176B

# --------------------------------------------------------------------------------------------------------
# DeepSeek-V3's pre-training


@dataclass(frozen=True)
class DeepSeekV3Pretraining:
    """DeepSeek-V3's pre-training as its report prints it (module docstring; section of the report beside each
    field).  Not a :class:`PublishedRun`: it prints GPU hours per trillion tokens, not a step, and trains in FP8.
    ``dp`` is the 2,048 GPUs over the 16 pipeline stages (the report names ZeRO-1 data parallelism and no
    degree); expert parallelism is folded over it, 64 GPUs (8 nodes) holding one copy of the 256 experts."""

    gpus: int = 2048  # 3.1
    gpus_per_node: int = 8  # 3.1
    gpu: str = H800
    pp: int = 16  # 3.2, DualPipe
    ep: int = 64  # 3.2, "spanning 8 nodes"
    ep_nodes: int = 8
    tp: int = 1  # 3.2, "we do not use costly Tensor Parallelism"
    zero: int = 1  # 3.2
    schedule: str = "dualpipe"
    max_nodes_per_token: int = 4  # 3.2.2, node-limited routing
    experts_per_node: float = 3.2  # 3.2.2: routed experts a token can pick per node at no extra NVLink cost
    nvlink_bytes_per_s: float = 160e9  # 3.2.2, as measured
    infiniband_bytes_per_s: float = 50e9  # 3.2.2
    precision: str = "fp8"  # 3.3
    seq_len: int = 4096  # 4.2
    global_batch: int = 15360  # 4.2, after the ramp
    ramp_start_batch: int = 3072
    ramp_tokens: float = 469e9
    gpu_hours_per_trillion_tokens: float = 180e3  # 1
    days_per_trillion_tokens: float = 3.7  # 1 (as printed, rounded)
    pretraining_tokens: float = 14.8e12
    pretraining_gpu_hours: float = 2664e3  # Table 1
    context_extension_gpu_hours: float = 119e3
    post_training_gpu_hours: float = 5e3
    total_gpu_hours: float = 2788e3
    dollars_per_gpu_hour: float = 2.0
    total_dollars: float = 5.576e6
    source: str = DEEPSEEK_V3_REPORT

    @property
    def dp(self) -> int:
        return self.gpus // (self.pp * self.tp)

    def shape(self) -> TransformerShape:
        """The model (labkit's preset: 61 layers, MLA, 256 routed experts of which 8 a token, 1 shared)."""
        return TransformerShape.preset("deepseek-v3")

    def tokens_per_gpu_second(self) -> float:
        """Pre-training throughput a GPU, from the GPU hours per trillion tokens."""
        return 1e12 / (self.gpu_hours_per_trillion_tokens * 3600)


DEEPSEEK_V3 = DeepSeekV3Pretraining()
