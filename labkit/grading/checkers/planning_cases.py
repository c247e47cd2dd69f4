"""Exercise 11's configurations (``labkit.grading.checkers.planning`` holds the student's parts to
``predict_step``'s on each): the models, the machines, and the hand-picked cases and the sweep, as data."""

from __future__ import annotations

from labkit.costmodel.compute import GPUS
from labkit.costmodel.hardware import LINKS, Link
from labkit.costmodel.shapes import TransformerShape
from labkit.costmodel.step import Hardware

SHAPES = {name: TransformerShape.preset(name) for name in ("gpt2", "gpt2-xl", "llama-2-7b", "llama-2-70b",
                                                            "gpt3-175b")}
SHAPES["gpt-64-layers"] = TransformerShape(64, 8192, 64, 2048, 50304)  # 52B parameters: 64 stages of one layer


def _machine(gpu: str, efficiency: float, intra: Link | None = None, network: Link | None = None,
             gpus_per_node: int | None = None) -> Hardware:
    """A node of ``gpu`` (:data:`labkit.costmodel.compute.GPUS`: its peak, NVLink and network share per GPU, with
    NCCL's latencies) reaching ``efficiency`` of its peak; ``intra`` and ``network``: other links of
    :data:`labkit.costmodel.hardware.LINKS` in their place (a PCIe node behind Ethernet)."""
    preset = GPUS[gpu]
    return Hardware(efficiency * preset.peak_bf16_flops, intra.model() if intra else preset.intra_node_link(),
                    network.model() if network else preset.inter_node_link(), gpus_per_node or preset.gpus_per_node)


PCIE, ETHERNET_25G, ETHERNET_10G = (LINKS[name] for name in ("PCIe 4.0 x16", "25 Gb Ethernet (TCP)",
                                                            "10 Gb Ethernet (TCP)"))
MACHINES = {
    "A100 nodes of 8 (NVLink 300 GB/s, network 25 GB/s)": _machine("A100 80GB", 0.5),
    "H100 nodes of 8 (NVLink 450 GB/s, network 50 GB/s)": _machine("H100 80GB", 0.45),
    "V100 nodes of 16 (NVLink 150 GB/s, network 6.25 GB/s)": _machine("V100 32GB", 0.4),
    "A100 PCIe nodes of 4 (PCIe 25 GB/s, 25 Gb Ethernet 3.125 GB/s)": _machine("A100 80GB", 0.5, PCIE, ETHERNET_25G, 4),
    "A100 PCIe nodes of 8 (PCIe 25 GB/s, 10 Gb Ethernet 1.25 GB/s)": _machine("A100 80GB", 0.5, PCIE, ETHERNET_10G, 8),
}
A100, H100, V100, SLOW, SLOW8 = MACHINES

# (model, machine, dp, tp, pp, micro-batch b, micro-batches m, schedule, virtual stages v, recompute)
SPECS = [
    # one dimension at a time
    ("gpt2", A100, 1, 1, 1, 1, 1, "1f1b", 1, False),
    ("gpt2", A100, 8, 1, 1, 4, 2, "1f1b", 1, False),
    ("gpt2", SLOW, 16, 1, 1, 1, 4, "1f1b", 1, False),  # DP across nodes of 4, partly exposed
    ("gpt2", A100, 1, 2, 1, 2, 4, "1f1b", 1, False),
    ("gpt2", A100, 1, 1, 4, 1, 8, "1f1b", 1, False),
    ("gpt2", A100, 1, 1, 4, 1, 8, "gpipe", 1, False),
    ("gpt2", A100, 1, 1, 2, 2, 6, "interleaved", 3, False),
    ("gpt2", H100, 1, 1, 4, 2, 8, "zb-h1", 1, False),
    # two and three at a time
    ("gpt2", A100, 2, 2, 2, 4, 8, "1f1b", 1, False),
    ("gpt2", A100, 2, 3, 2, 2, 6, "1f1b", 1, False),  # t = 3: ranks 6, 7, 8 cross a node
    ("gpt2", H100, 1, 4, 3, 1, 6, "gpipe", 1, False),
    ("gpt2", H100, 2, 1, 4, 1, 8, "zb-h1", 1, False),
    ("gpt2", A100, 4, 2, 1, 8, 2, "1f1b", 1, True),
    ("gpt2", SLOW, 4, 2, 2, 1, 2, "1f1b", 1, False),
    ("gpt2", SLOW, 2, 2, 3, 4, 3, "interleaved", 2, True),
    ("gpt2-xl", H100, 2, 5, 2, 1, 4, "1f1b", 1, False),  # t = 5 does not divide 8
    ("gpt2", SLOW, 2, 6, 1, 2, 4, "1f1b", 1, False),  # t = 6 on nodes of 4
    ("gpt2", H100, 1, 12, 2, 1, 4, "gpipe", 1, True),  # t = 12 on nodes of 8
    ("gpt2-xl", V100, 4, 1, 8, 1, 16, "1f1b", 1, False),
    ("gpt2-xl", A100, 2, 1, 4, 2, 8, "interleaved", 3, False),
    ("gpt2-xl", SLOW, 8, 2, 2, 1, 4, "gpipe", 1, True),
    ("llama-2-7b", H100, 8, 8, 1, 1, 4, "1f1b", 1, False),
    ("llama-2-7b", H100, 4, 4, 2, 2, 8, "interleaved", 4, False),  # DP spans t d = 16 ranks: two nodes
    ("llama-2-7b", V100, 2, 16, 2, 1, 4, "1f1b", 1, False),  # t = 16 inside a node of 16
    ("llama-2-7b", H100, 1, 16, 2, 1, 4, "1f1b", 1, False),  # t = 16 across two nodes of 8
    ("llama-2-7b", A100, 2, 4, 4, 8, 4, "zb-h1", 1, True),
    ("llama-2-7b", SLOW, 32, 1, 1, 1, 2, "1f1b", 1, False),
    ("llama-2-7b", SLOW, 4, 8, 1, 1, 4, "1f1b", 1, True),  # t = 8 on nodes of 4
    ("llama-2-70b", H100, 8, 8, 8, 1, 16, "1f1b", 1, True),
    ("llama-2-70b", A100, 4, 8, 8, 1, 8, "interleaved", 5, False),
    ("llama-2-70b", H100, 16, 8, 4, 1, 8, "gpipe", 1, False),
    ("llama-2-70b", V100, 2, 16, 2, 2, 4, "zb-h1", 1, True),
    ("gpt3-175b", A100, 8, 8, 16, 1, 8, "1f1b", 1, True),
    ("gpt3-175b", H100, 64, 8, 12, 1, 12, "1f1b", 1, False),  # 6144 GPUs
    ("gpt3-175b", H100, 16, 8, 8, 1, 8, "interleaved", 2, True),
    ("gpt3-175b", V100, 4, 16, 4, 2, 8, "gpipe", 1, False),
    ("gpt3-175b", H100, 4, 16, 4, 1, 8, "1f1b", 1, False),  # t = 16 across two nodes of 8
    ("gpt-64-layers", H100, 1, 1, 64, 1, 4, "1f1b", 1, False),  # m < p: the bubble dominates
    ("gpt-64-layers", A100, 2, 64, 1, 2, 2, "1f1b", 1, False),  # TP over eight nodes
    ("gpt-64-layers", V100, 64, 1, 1, 1, 1, "1f1b", 1, False),  # DP over four nodes of 16
    ("gpt-64-layers", H100, 2, 4, 8, 1, 8, "zb-h1", 1, False),
    ("gpt-64-layers", SLOW, 4, 2, 2, 8, 2, "gpipe", 1, False),
    ("gpt-64-layers", A100, 8, 8, 8, 1, 8, "interleaved", 4, True),
    ("gpt-64-layers", H100, 2, 8, 32, 1, 2, "gpipe", 1, True),
    # groups whose span fits in a node of 8 without dividing it (12 ranks: the second block crosses), the DP
    # reduction exposed: a rule that asks "t d <= G", "d divides G" or "t <= G" instead of "divides G" fails here
    ("gpt2", SLOW8, 3, 1, 4, 1, 4, "1f1b", 1, False),  # DP of 3 consecutive ranks: 6, 7, 8 cross
    ("gpt2", SLOW8, 6, 1, 2, 1, 2, "1f1b", 1, True),  # DP of 6: ranks 6-11 cross
    ("gpt2", SLOW8, 3, 2, 2, 1, 4, "zb-h1", 1, False),  # DP spans t d = 6, TP of 2 inside
    ("gpt2", SLOW8, 3, 2, 2, 1, 4, "gpipe", 1, True),
    ("gpt2", A100, 1, 6, 2, 1, 4, "zb-h1", 1, True),  # TP of 6 on nodes of 8: ranks 6-11 cross
    ("gpt2", H100, 2, 3, 2, 2, 6, "interleaved", 2, False),  # TP of 3: ranks 6, 7, 8 cross
    ("gpt2-xl", SLOW8, 2, 5, 1, 1, 4, "1f1b", 1, True),  # TP of 5, DP spans 10
    # t d = G exactly: inside, where "t d < G" would say across
    ("gpt2", SLOW, 2, 2, 2, 1, 2, "1f1b", 1, False),
    ("llama-2-7b", SLOW8, 2, 4, 2, 1, 2, "1f1b", 1, False),
]
# A sweep on GPT-2 and Llama-2 7B: every (dp, tp, pp) of 1, 2, 4 with each schedule, m = p (interleaved: the
# fewest chunks, 2 or 3, that divide a stage's layers).
SPECS += [(model, machine, d, t, p, b, p, schedule, next(v for v in (2, 3) if SHAPES[model].num_layers % (p * v)
                                                            == 0) if schedule == "interleaved" else 1, recompute)
          for model, machine, b, recompute in (("gpt2", SLOW, 2, False), ("llama-2-7b", H100, 1, True))
          for d in (1, 2, 4) for t in (1, 2, 4) for p in (1, 2, 4)
          for schedule in (("1f1b", "gpipe", "interleaved", "zb-h1") if p > 1 else ("1f1b",))]
