"""One place for the hardware the course prices: GPUs (memory, peak, links) and the links between them.

Every lesson, widget, planner and grader reads these constants from here, so that a figure quoted in lesson 01
is the one lesson 11 plans with.  Each constant says where it comes from: a vendor datasheet for bandwidths and
peaks, NVIDIA's NCCL for latencies.

**Bandwidths** are bytes per second that one GPU sends in *one direction*.  NVLink 4 on an H100 SXM moves 900
GB/s in both directions together, so 450 GB/s each way; an H100 node's InfiniBand gives each GPU one 400 Gb/s
NDR port, 50 GB/s.  A ring all-reduce is limited by the one-way bandwidth of its slowest link.

**Latencies** (the alpha of lesson 01's alpha-beta model) are not on any datasheet.  labkit takes them from NCCL's
own tuning model, which prices every collective it might run as a base latency per call plus a hardware latency
per step of the algorithm (``src/graph/tuning.cc`` of NVIDIA/nccl, version 2.30.7, commit ``5067397c``:
``baseLatencies`` and ``hwLatencies``).  For a ring under the *Simple* protocol, the one NCCL uses for the
megabytes a training step moves, those constants are 8.4 us a call, and per ring step 3.4 us over NVLink, 5.7 us
over PCIe and 14 us over the network.  labkit's per-message ``alpha`` is NCCL's per-step latency
(:data:`NVLINK_LATENCY_S`, :data:`PCIE_LATENCY_S`, :data:`INFINIBAND_LATENCY_S`), and the step model adds
:data:`NCCL_CALL_LATENCY_S` once per collective; 50 us over TCP on Ethernet is a kernel socket's round trip.  A
ring of ``N`` ranks takes ``2 (N - 1)`` steps to all-reduce, so its latency grows with the group: 3.6 ms for an
all-reduce over 128 nodes, whatever its size.  (NCCL also multiplies a multi-node ring all-reduce's latency by
1.4 on A100s and later, its "plateau effect of ring", and switches to trees where they are faster; labkit
prices the ring only.)

**Overlap is not free.**  Communication hidden behind computation still takes the GPU's streaming
multiprocessors and memory bandwidth from it: measured on four A100s and four H100s (and AMD GPUs) training GPT
and Llama models, computation overlapped with collectives ran 18.9 % slower on average (at most 40 %) than alone
("Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning: Performance and
Power Implications", 2025, arXiv 2507.03114, abstract).  :data:`OVERLAP_SLOWDOWN` is that average: the step
model charges each second of hidden communication 0.189 s of compute.

**Which link a group uses** (ranks numbered node by node, as ``torchrun`` does; a group's ranks ``stride`` apart
in the (pp, dp, cp, tp) grid).  A group inside one node talks over NVLink.  A group that crosses nodes depends on
what it runs.  A *ring collective* (all-reduce, reduce-scatter, all-gather) over ``k`` members a node drives ``k``
network adapters at once on DGX-like nodes (one adapter per GPU, NCCL's rings on several channels), so
:func:`link_of` prices it at ``k`` times one GPU's network bandwidth, at most NVLink's.  An *all-to-all* or a
*point-to-point send* has no such help: every GPU's off-node bytes leave through its own adapter, one GPU's network
bandwidth (50 GB/s on H100 nodes) whatever the group's size, while its bytes to the ``k - 1`` members of its node
go over NVLink at the same time (:func:`node_members`; :func:`labkit.costmodel.collectives.all_to_all_seconds`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from labkit.costmodel.collectives import LinkModel

# Per-message latencies: one ring step under NCCL's Simple protocol (module docstring: tuning.cc's hwLatencies), and
# a socket's round trip for TCP; NCCL's base latency of a ring call (baseLatencies, Ring/Simple).
NVLINK_LATENCY_S = 3.4e-6
PCIE_LATENCY_S = 5.7e-6
INFINIBAND_LATENCY_S = 14e-6
ETHERNET_TCP_LATENCY_S = 50e-6
NCCL_CALL_LATENCY_S = 8.4e-6
# The compute slowdown per second of communication hidden behind it (module docstring: arXiv 2507.03114).
OVERLAP_SLOWDOWN = 0.189


@dataclass(frozen=True)
class GPU:
    """A GPU's memory, dense bf16 peak (fp16 on the V100) and links (vendor datasheet figures, without
    sparsity).  Bandwidths are bytes per second one GPU can send in one direction: ``nvlink_bandwidth`` to the
    GPUs of its node, ``network_bandwidth`` (its share of the node's InfiniBand NICs) to other nodes.
    ``memory_bandwidth``: its HBM's, bytes per second; ``multiprocessors``: its streaming multiprocessors (SMs),
    the units a kernel's tiles are spread over (:mod:`labkit.costmodel.kernels`)."""

    name: str
    memory_bytes: float
    peak_bf16_flops: float
    nvlink_bandwidth: float = 0.0
    network_bandwidth: float = 0.0
    gpus_per_node: int = 8
    source: str = ""
    memory_bandwidth: float = 0.0
    multiprocessors: int = 0

    def intra_node_link(self) -> LinkModel:
        """The link between two GPUs of one node (NVLink), per direction."""
        return LinkModel(NVLINK_LATENCY_S, 1 / self.nvlink_bandwidth)

    def inter_node_link(self) -> LinkModel:
        """The link between GPUs of different nodes (InfiniBand), per GPU and direction."""
        return LinkModel(INFINIBAND_LATENCY_S, 1 / self.network_bandwidth)


GPUS = {
    # V100 SXM2: 125 TFLOP/s fp16 tensor, NVLink 2 300 GB/s total; DGX-2 nodes of 16, 8x EDR 100 Gb/s per node
    # (HBM bandwidth and SMs: the same datasheets, and NVIDIA's architecture whitepapers for the SM counts)
    "V100 32GB": GPU("V100 32GB", 32e9, 125e12, 150e9, 6.25e9, 16, "NVIDIA V100 datasheet; DGX-2 user guide",
                     900e9, 80),
    # A100 SXM: 312 TFLOP/s bf16, NVLink 3 600 GB/s total (300 each way); DGX A100: 8x HDR 200 Gb/s per node
    "A100 80GB": GPU("A100 80GB", 80e9, 312e12, 300e9, 25e9, 8, "NVIDIA A100 datasheet; DGX A100 user guide",
                     2039e9, 108),
    # H100 SXM: 989 TFLOP/s bf16 dense, NVLink 4 900 GB/s total (450 each way); DGX H100: 8x NDR 400 Gb/s
    "H100 80GB": GPU("H100 80GB", 80e9, 989e12, 450e9, 50e9, 8, "NVIDIA H100 datasheet; DGX H100 user guide",
                     3.35e12, 132),
    "H200 141GB": GPU("H200 141GB", 141e9, 989e12, 450e9, 50e9, 8, "NVIDIA H200 datasheet (H100's compute)",
                      4.8e12, 132),
    # H800 SXM: the H100's compute, HBM and SMs, NVLink cut to 400 GB/s total (200 each way); DeepSeek-V3's nodes:
    # 8 GPUs, one 400 Gb/s InfiniBand NIC a GPU; DeepSeek measured 160 GB/s over NVLink, 50 GB/s over IB
    "H800 80GB": GPU("H800 80GB", 80e9, 989e12, 200e9, 50e9, 8, "NVIDIA H800 SXM5 datasheet (H100's compute, NVLink "
                     "400 GB/s); DeepSeek-AI, DeepSeek-V3 Technical Report, arXiv 2412.19437, section 3.1",
                     3.35e12, 132),
    # torchtitan's benchmark H100s (Meta's Grand Teton): 96 GB of HBM2e at 2.4 TB/s, 500 W; NVIDIA gives no peak
    # for this part ("between SXM and NVL"): torchtitan prices its MFU at the SXM's 989 TFLOP/s, and so does this
    # preset, with the SXM's 132 SMs (assumed: torchtitan calls it an SXM H100)
    "H100 96GB HBM2e": GPU("H100 96GB HBM2e", 96e9, 989e12, 450e9, 50e9, 8, "pytorch/torchtitan, benchmarks/"
                           "llama3_h100_202412_torchtitan.md: 8 GPUs a host on NVLink, 400 Gb/s RDMA a GPU",
                           2.4e12, 132),
    # BLOOM's Jean Zay A100 nodes: 8 GPUs on NVLink, 4 Omni-Path links (100 Gb/s each) a node, 6.25 GB/s a GPU
    "A100 80GB (Omni-Path)": GPU("A100 80GB (Omni-Path)", 80e9, 312e12, 300e9, 6.25e9, 8,
                                 "bigscience-workshop/bigscience, train/tr11-176B-ml/README.md 'Hardware'; Intel "
                                 "Omni-Path: 100 Gb/s a port", 2039e9, 108),
}


@dataclass(frozen=True)
class Link:
    """A kind of link, per direction: its latency, its bandwidth and where both come from."""

    name: str
    latency_s: float
    bandwidth_bytes_per_s: float
    source: str

    def model(self) -> LinkModel:
        return LinkModel(alpha_s=self.latency_s, beta_s_per_byte=1 / self.bandwidth_bytes_per_s)


H100 = GPUS["H100 80GB"]
LINKS = {
    "NVLink 4 (H100, inside a node)": Link("NVLink 4", NVLINK_LATENCY_S, H100.nvlink_bandwidth,
                                           "NVIDIA H100 datasheet: 900 GB/s both ways, 450 GB/s each way"),
    "InfiniBand NDR (across nodes)": Link("InfiniBand NDR", INFINIBAND_LATENCY_S, H100.network_bandwidth,
                                          "NVIDIA DGX H100 datasheet: one 400 Gb/s ConnectX-7 port per GPU"),
    "PCIe 4.0 x16": Link("PCIe 4.0 x16", PCIE_LATENCY_S, 25e9,
                         "PCI-SIG: 16 GT/s x 16 lanes, 32 GB/s raw each way, about 25 GB/s in practice"),
    "10 Gb Ethernet (TCP)": Link("10 Gb Ethernet", ETHERNET_TCP_LATENCY_S, 1.25e9, "IEEE 802.3ae: 10 Gb/s"),
    "25 Gb Ethernet (TCP)": Link("25 Gb Ethernet", ETHERNET_TCP_LATENCY_S, 3.125e9, "IEEE 802.3by: 25 Gb/s"),
}
NVLINK, INFINIBAND = LINKS["NVLink 4 (H100, inside a node)"], LINKS["InfiniBand NDR (across nodes)"]


def node_members(gpus_per_node: int, stride: int, size: int) -> int:
    """How many of a group's ``size`` ranks, ``stride`` apart, share a node: the fewest on any node the group
    touches (the group starting on a node's first GPU, or a tp offset past it; ranks numbered node by node).
    ``size`` when the group fits one node, ``G / stride`` when it spans whole nodes, 1 when ``stride >= G``."""
    return min(Counter(index * stride // gpus_per_node for index in range(size)).values())


def link_of(hardware: Any, stride: int, size: int) -> LinkModel:
    """The link a *ring collective* of a group of ``size`` ranks ``stride`` apart in the (pp, dp, cp, tp) grid
    runs on (``hardware``: a :class:`labkit.costmodel.stages.Hardware`): its ranks span ``stride * size``
    consecutive ranks from a multiple of that, so it lies inside one node of ``G`` GPUs when that span divides
    ``G``; else it crosses nodes, where with ``hardware.rails`` a group of ``G / stride`` members a node (whole
    nodes' worth, ``stride`` dividing ``G``) runs that many times faster, at most at the NVLink's bandwidth.
    All-to-alls and point-to-point sends cross nodes through one GPU's adapter instead (module docstring); the
    step model still prices the pipeline's sends on this link, where the two agree once the pp stride ``d cp t``
    is a node or more (one member a node)."""
    span, nodes = stride * size, hardware.gpus_per_node
    if span <= nodes and nodes % span == 0:
        return hardware.intra_node
    members = nodes // stride if hardware.rails and stride < nodes and nodes % stride == 0 and span % nodes == 0 \
        else 1
    if members == 1:
        return hardware.inter_node
    return LinkModel(hardware.inter_node.alpha_s,
                     max(hardware.inter_node.beta_s_per_byte / members, hardware.intra_node.beta_s_per_byte))
