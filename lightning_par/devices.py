"""What known GPUs and links can do, each number with its source beside it, and the :class:`Hardware` the layout
planner predicts with.

Two ways to get a :class:`Hardware`: :func:`known_hardware` builds it from the tables below (to plan a cluster you
are not on), ``lightning_par.planner.probe.probe_hardware`` measures it on the spot (to plan the run you are in).
Anything else can be written by hand: ``Hardware(device=..., matmul_flops=..., ...)``.

Conventions of the tables:

* FLOP/s are *dense* (no 2:4 sparsity). Datasheets print the tensor-core figures with sparsity, marked with an
  asterisk: the dense figure is half, rounded down to a whole TFLOP/s (1,979* -> 989). bf16/fp16: tensor cores
  with fp32 accumulate; tf32: tensor cores; fp32: CUDA cores.
* Memory is the capacity the datasheet prints, read as binary (80 GB of HBM3 is five 16 GiB stacks, so 80 GiB);
  what the driver reports is about 0.5 % less (nvidia-smi shows 81,559 MiB on an H100 80GB HBM3, seen on the
  project's lent GPU machine, 2026-11-13).
* Link bandwidth is per GPU and per direction: the datasheets print both directions together (NVLink 4 "900 GB/s"
  is 450 GB/s each way), and a ring collective sends and receives at once, so the per-direction figure is the
  ceiling of its bus bandwidth (nccl-tests' ``busbw``, the ``bytes * 2(n-1)/n / time`` of an all-reduce). Network
  links are one NIC per GPU (DGX/HGX nodes have 8); a node with fewer NICs shares them (``nics_per_node``).
* Latency is per message hop (one of the ``2(n-1)`` steps of a ring all-reduce): NCCL's own cost model for large
  messages, ``hwLat[...][Ring][Simple]`` in NVIDIA/nccl ``src/graph/tuning.cc`` (current versions; older ones had
  9.6 us for the network): NVLink 3.4 us, PCIe 5.7 us, network 14 us. NCCL uses the one network figure for
  InfiniBand, RoCE and sockets alike.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

import torch

GiB = 2**30

#: NCCL's per-step latency of a ring with the Simple protocol (large messages), in seconds; see the module docstring.
NCCL_TUNING = "NVIDIA/nccl src/graph/tuning.cc, hwLat[{}][Ring][Simple]"
NVLINK_HOP, PCIE_HOP, NET_HOP = 3.4e-6, 5.7e-6, 14e-6

#: Fraction of dense peak that the *model* FLOPs of a well-tuned bf16 training step reach on the compute alone
#: (communication and pipeline bubble excluded: the planner adds those), on an H100: other devices' steps reach
#: :data:`STEP_SHARE` of their own matmul rate (``DeviceSpec.matmul_efficiency``) instead. Published end-to-end
#: MFUs, which include exposed communication and bubble, sit just below: Megatron-LM's README "up to 47% MFU on
#: H100 clusters"; "The Llama 3 Herd of Models" (arXiv:2407.21783) table 4, 38-43 % bf16 MFU on 8-16 k H100s;
#: torchtitan's docs/performance.md, 33-39 % for Llama 3.1 8B on 8 and 128 H100s at 500 W; this project's GPT at 370 M
#: parameters on one H100, no communication, 0.36 eager and 0.43 compiled (shared/GPU_FACTS.md). Non-matmul
#: work (norms, activations, softmax, the optimizer, launches) is why it is far below :data:`MATMUL_EFFICIENCY`.
DEFAULT_EFFICIENCY = 0.45

#: Fraction of dense peak that one large bf16 matmul alone reaches on an H100: 8192 x 8192 x 8192 bf16 ran at
#: 769-798 TFLOP/s on an H100 80GB HBM3 and an H200 lent to the project (2026-11), 0.78-0.81 of 989 (MAMF's table,
#: :data:`MAMF_SOURCE`: 0.803, "H200 is the same"). This is what ``probe_matmul`` measures at large shapes; a
#: training step's model FLOPs reach :data:`DEFAULT_EFFICIENCY`. Other devices reach other fractions of their peak
#: (``DeviceSpec.matmul_efficiency``); this one is the figure for devices nobody measured.
MATMUL_EFFICIENCY = 0.8

#: The earlier rule, one share for all of a step's work: :data:`DEFAULT_EFFICIENCY` / :data:`MATMUL_EFFICIENCY`,
#: both H100 figures (0.45 / 0.8 = 0.5625) of a device's own matmul rate, so that a device whose matmuls reach more
#: of its peak (an A100 SXM: 0.869) computes a step at more of its peak too (0.489), as published A100 runs did
#: (MosaicML's MPT on A100 at 0.62-0.66 of peak counting recomputation, against 0.56-0.59 on H100). The table now
#: uses the GPU time model below; ``benchmarks/fit_time_model.py`` scores this rule beside it.
STEP_SHARE = DEFAULT_EFFICIENCY / MATMUL_EFFICIENCY

#: The GPU time model: a step's matmuls (attention kernels at ``planner.predict.ATTENTION_RATE`` of them) run at
#: :data:`MATMUL_STEP_SHARE` of the rate one large matmul reaches on the device (``DeviceSpec.matmul_efficiency``):
#: the training shapes, launch gaps and the SMs communication kernels take; and the bytes its other ops move
#: (norms, activations, casts, residual adds, the loss's softmax: ``costs.profile.Section.memory_traffic``, forward,
#: backward and recomputation) at :data:`BANDWIDTH_SHARE` of the datasheet's memory bandwidth. So a wide model's step
#: reaches more of the peak than a narrow one's (its matmuls grow as width squared, the rest as width), and a long
#: vocabulary's loss costs what its bytes cost. Both were fitted on the fitting half of the published set only
#: (``benchmarks/fit_time_model.py``; benchmarks/published/README.md, "The split"), replacing :data:`STEP_SHARE`,
#: one share for every model, as the table's rule.
MATMUL_STEP_SHARE = 0.65
BANDWIDTH_SHARE = 0.45
#: The share of those bytes that software fusing the non-matmul ops moves (torch.compile's generated kernels,
#: Megatron's fused kernels, Transformer Engine's norm-linear, SwiGLU, RoPE and cross-entropy kernels): a chain of
#: elementwise ops reads its inputs and writes its outputs once instead of once per op. The eager trace
#: (``Section.memory_traffic``) is what the engine moves without ``compile``; fitted with the shares above
FUSED_TRAFFIC = 0.35

#: Where the per-device matmul efficiencies come from: Stas Bekman's "Maximum Achievable Matmul FLOPS" (MAMF)
#: table, bf16, each the mean of 100 matmuls at the best of a search of shapes, on the torch of its row.
MAMF_SOURCE = ("stas00/ml-engineering compute/accelerator/README.md, 'Maximum Achievable Matmul FLOPS comparison "
               "table', BF16 (read 2026-11)")


@dataclass(frozen=True)
class LinkSpec:
    """A link between GPUs: bytes/s per GPU per direction (the ceiling of a ring's bus bandwidth) and seconds per
    message hop."""

    name: str
    bandwidth: float
    latency: float
    source: str


@dataclass(frozen=True)
class DeviceSpec:
    """One GPU model. ``pattern``: a regex on ``torch.cuda.get_device_name()``; the first device that matches wins,
    so :data:`DEVICES` lists the specific before the general (``GB200`` before ``B200``, ``H100 PCIe`` before
    ``H100``)."""

    name: str
    pattern: str
    peak_flops: dict[str, float]  # dense peak FLOP/s per precision kind: "bf16", "fp16", "tf32", "fp32"
    memory_bytes: int  # per GPU, the datasheet's capacity
    memory_bandwidth: float  # bytes/s
    intra_link: str  # the LINKS key of its usual node-internal link
    source: str
    #: the fraction of the dense peak one large matmul reaches (:data:`MAMF_SOURCE` where measured, else
    #: :data:`MATMUL_EFFICIENCY`, an H100's); a step from the table computes at :data:`STEP_SHARE` of it
    matmul_efficiency: float = MATMUL_EFFICIENCY


_NVL_LAT = NCCL_TUNING.format("NVLINK") + " = 3.4 us"
_PCI_LAT = NCCL_TUNING.format("PCI") + " = 5.7 us"
_NET_LAT = NCCL_TUNING.format("NET") + " = 14 us"

LINKS: dict[str, LinkSpec] = {link.name: link for link in (
    # NVLink: the datasheets print the sum of both directions per GPU
    LinkSpec("nvlink2", 150e9, NVLINK_HOP, f"V100 SXM2 datasheet: NVLink 300 GB/s (both directions); {_NVL_LAT}"),
    LinkSpec("nvlink3", 300e9, NVLINK_HOP, f"A100 datasheet: NVLink 600 GB/s (both directions); {_NVL_LAT}"),
    LinkSpec("nvlink3-a800", 200e9, NVLINK_HOP, f"A800 product page: NVLink 400 GB/s (both directions); {_NVL_LAT}"),
    LinkSpec("nvlink4", 450e9, NVLINK_HOP,
          f"H100/H200 datasheets: NVLink 900 GB/s (both directions), through NVSwitch in HGX nodes; {_NVL_LAT}"),
    LinkSpec("nvlink4-h800", 200e9, NVLINK_HOP, f"H800 product page: NVLink 400 GB/s (both directions); {_NVL_LAT}"),
    LinkSpec("nvlink5", 900e9, NVLINK_HOP,
          f"HGX B200 spec: 5th-gen NVLink 1.8 TB/s per GPU (both directions), through NVSwitch; {_NVL_LAT}"),
    LinkSpec("nvswitch-nvl72", 900e9, NVLINK_HOP,
          "GB200 NVL72 spec: NVLink Switch System, 130 TB/s over 72 GPUs = 1.8 TB/s per GPU (both directions) to "
          f"any GPU of the rack, so nodes (trays) of one rack talk at NVLink speed; {_NVL_LAT}"),
    # PCIe x16: the datasheets print both directions together
    LinkSpec("pcie3", 16e9, PCIE_HOP, f"V100 PCIe / T4 datasheets: PCIe Gen3 32 GB/s (both directions); {_PCI_LAT}"),
    LinkSpec("pcie4", 32e9, PCIE_HOP,
          f"A100 PCIe / L40S / L4 datasheets: PCIe Gen4 x16 64 GB/s (both directions); {_PCI_LAT}"),
    LinkSpec("pcie5", 64e9, PCIE_HOP, f"H100/H200 datasheets: PCIe Gen5 128 GB/s (both directions); {_PCI_LAT}"),
    # networks, one NIC per GPU: Gb/s / 8 = GB/s each way
    LinkSpec("ib-hdr200", 25e9, NET_HOP, f"DGX A100 datasheet: 8x ConnectX-6 HDR 200 Gb/s InfiniBand; {_NET_LAT}"),
    LinkSpec("ib-ndr400", 50e9, NET_HOP, f"DGX H100 datasheet: 8x ConnectX-7 NDR 400 Gb/s InfiniBand; {_NET_LAT}"),
    LinkSpec("ib-xdr800", 100e9, NET_HOP, f"ConnectX-8 SuperNIC (DGX B300, GB300 NVL72): 800 Gb/s; {_NET_LAT}"),
    LinkSpec("roce-400", 50e9, NET_HOP,
          f"The Llama 3 Herd of Models (arXiv:2407.21783), section 3.3.1: RoCE at 400 Gb/s between GPUs; torchtitan "
          f"docs/performance.md: 'RDMA network with 400 Gb/s per GPU'; {_NET_LAT}"),
    LinkSpec("efa-p5", 50e9, NET_HOP,
          f"AWS p5.48xlarge: 3,200 Gb/s EFAv2 for 8 H100 = 400 Gb/s per GPU; {_NET_LAT}"),
    LinkSpec("eth-100", 12.5e9, NET_HOP, f"100 GbE, per NIC; {_NET_LAT}"),
    LinkSpec("eth-200", 25e9, NET_HOP, f"200 GbE, per NIC; {_NET_LAT}"),
    LinkSpec("eth-400", 50e9, NET_HOP, f"400 GbE, per NIC; {_NET_LAT}"),
)}

_H100 = "H100 datasheet (resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet)"
_H200 = "H200 datasheet (nvdam.widen.net/s/nb5zzzsjdf/hpc-datasheet-sc23-h200-datasheet-3002446)"
_A100 = "A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf)"
_V100 = "V100 datasheet (volta-v100-datasheet-update-us-1165301-r5.pdf)"
_HOPPER = {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12}  # H100 SXM: 1,979*, 1,979*, 989*, 67
_HOPPER_NVL = {"bf16": 835e12, "fp16": 835e12, "tf32": 417e12, "fp32": 60e12}  # NVL: 1,671*, 1,671*, 835*, 60
_AMPERE = {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}  # A100: 312 (624*), 156 (312*), 19.5


def _device(name: str, pattern: str, peak: dict[str, float], memory_gb: float, bandwidth_tb: float, link: str,
            source: str, mamf: tuple[float, str] | None = None) -> DeviceSpec:
    """A table row: memory in the datasheet's GB (binary), bandwidth in TB/s; ``mamf``: the fraction of the bf16
    peak one large matmul reaches, with the row of :data:`MAMF_SOURCE` it comes from (None: not measured, an
    H100's :data:`MATMUL_EFFICIENCY`)."""
    efficiency, row = mamf if mamf is not None else (MATMUL_EFFICIENCY, "not measured: an H100's")
    return DeviceSpec(name, pattern, peak, int(memory_gb * GiB), bandwidth_tb * 1e12, link,
                      f"{source}; one large matmul: {efficiency:g} of peak ({row})", efficiency)


#: rows of :data:`MAMF_SOURCE` (MAMF TFLOP/s over the dense bf16 peak)
_MAMF_A100_SXM = (0.869, "MAMF row 'NVIDIA A100 SXM': 271.2 of 312")
_MAMF_A100_PCIE = (0.811, "MAMF row 'NVIDIA A100 PCIe': 252.9 of 312")
_MAMF_H100_SXM = (MATMUL_EFFICIENCY, "measured here 0.78-0.81; MAMF row 'NVIDIA H100 SXM': 794.5 of 989, 'H200 is "
                                     "the same'")
_MAMF_GH200 = (0.838, "MAMF row 'NVIDIA GH200 SXM', 900 W 141 GiB HBM3e version: 828.6 of 989")
_MAMF_B200 = (0.776, "MAMF row 'NVIDIA B200 SXM': 1,745 of 2,250")
_MAMF_GB200 = (0.729, "MAMF row 'NVIDIA GB200 SXM': 1,822 of 2,500")


#: Known GPUs, in matching order. Blackwell: only bf16/fp16 are tabulated.
DEVICES: dict[str, DeviceSpec] = {d.name: d for d in (
    _device("GB200", r"GB200", {"bf16": 2.5e15, "fp16": 2.5e15}, 186, 8.0, "nvswitch-nvl72",
            "GB200 NVL72 spec (nvidia.com/en-us/data-center/gb200-nvl72), 72 GPUs: FP16/BF16 360 PFLOPS* -> "
            "2.5 PFLOP/s dense per GPU; HBM3e 13.4 TB at 576 TB/s -> 186 GB, 8 TB/s per GPU", mamf=_MAMF_GB200),
    _device("B200", r"B200", {"bf16": 2.25e15, "fp16": 2.25e15}, 180, 8.0, "nvlink5",
            "HGX B200 spec (nvidia.com/en-us/data-center/hgx) and DGX B200 datasheet, 8 GPUs: FP16/BF16 "
            "36 PFLOPS* -> 2.25 PFLOP/s dense per GPU; 1,440 GB HBM3e at 64 TB/s -> 180 GB, 8 TB/s per GPU",
            mamf=_MAMF_B200),
    _device("H200-NVL", r"H200 NVL", _HOPPER_NVL, 141, 4.8, "pcie5",
            f"{_H200}: H200 NVL bf16 1,671*, tf32 835*, fp32 60; 141 GB HBM3e, 4.8 TB/s; NVLink bridges join 2 or "
            "4 GPUs only, so a node's ring runs over PCIe Gen5"),
    _device("GH200-144GB", r"GH200.*144G", _HOPPER, 144, 4.9, "nvlink4",
            "GH200 Grace Hopper datasheet (nvidia.com/en-us/data-center/grace-hopper-superchip): H100 SXM compute; "
            "144 GB HBM3e, 4.9 TB/s", mamf=_MAMF_GH200),
    _device("GH200", r"GH200", _HOPPER, 96, 4.0, "nvlink4",
            "GH200 Grace Hopper datasheet: H100 SXM compute; 96 GB HBM3, 4 TB/s (torch names it 'GH200 480GB', "
            "the 480 GB being the Grace CPU's LPDDR5X)"),
    _device("H200", r"H200", _HOPPER, 141, 4.8, "nvlink4",
            f"{_H200}: H200 SXM bf16 1,979*, tf32 989*, fp32 67; 141 GB HBM3e, 4.8 TB/s; NVLink 900 GB/s",
            mamf=_MAMF_H100_SXM),
    _device("H100-PCIe", r"H100.*PCIe|H100.*HBM2e", {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12,
                                                     "fp32": 51e12}, 80, 2.0, "pcie5",
            f"{_H100}: H100 PCIe bf16 1,513*, tf32 756*, fp32 51; 80 GB HBM2e, 2 TB/s; PCIe Gen5 (NVLink bridges "
            "pair GPUs only)"),
    _device("H100-NVL", r"H100 NVL", _HOPPER_NVL, 94, 3.9, "pcie5",
            f"{_H100}: H100 NVL bf16 1,671*, tf32 835*, fp32 60; 94 GB HBM3, 3.9 TB/s; PCIe Gen5 (NVLink bridges "
            "pair GPUs only)"),
    _device("H800", r"H800", _HOPPER, 80, 3.35, "nvlink4-h800",
            "H800 SXM5 product page: H100 SXM compute and memory (80 GB HBM3, 3.35 TB/s), NVLink 400 GB/s",
            mamf=_MAMF_H100_SXM),
    _device("H100-SXM", r"H100", _HOPPER, 80, 3.35, "nvlink4",
            f"{_H100}: H100 SXM bf16 1,979*, tf32 989*, fp32 67; 80 GB HBM3, 3.35 TB/s; NVLink 900 GB/s",
            mamf=_MAMF_H100_SXM),
    _device("A100-80GB-PCIe", r"A100.*80GB.*PCIe|A100.*PCIe.*80GB", _AMPERE, 80, 1.935, "pcie4",
            f"{_A100}: A100 80GB PCIe 1,935 GB/s; PCIe Gen4 (NVLink bridges pair GPUs only)", mamf=_MAMF_A100_PCIE),
    _device("A100-40GB-PCIe", r"A100.*PCIe", _AMPERE, 40, 1.555, "pcie4",
            f"{_A100}: A100 40GB PCIe 1,555 GB/s; PCIe Gen4 (NVLink bridges pair GPUs only)", mamf=_MAMF_A100_PCIE),
    _device("A100-40GB", r"A100.*40GB", _AMPERE, 40, 1.555, "nvlink3",
            f"{_A100}: A100 40GB SXM bf16 312 (624*), tf32 156, fp32 19.5; 1,555 GB/s; NVLink 600 GB/s",
            mamf=_MAMF_A100_SXM),
    _device("A800", r"A800", _AMPERE, 80, 2.039, "nvlink3-a800",
            "A800 product page: A100 80GB SXM compute and memory (2,039 GB/s), NVLink 400 GB/s", mamf=_MAMF_A100_SXM),
    _device("A100-80GB", r"A100", _AMPERE, 80, 2.039, "nvlink3",
            f"{_A100}: A100 80GB SXM bf16 312 (624*), tf32 156, fp32 19.5; 2,039 GB/s; NVLink 600 GB/s",
            mamf=_MAMF_A100_SXM),
    _device("L40S", r"L40S", {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12}, 48, 0.864, "pcie4",
            "L40S datasheet: bf16/fp16 362.05 (733*), tf32 183 (366*), fp32 91.6; 48 GB GDDR6, 864 GB/s; PCIe Gen4"),
    _device("L4", r"\bL4\b", {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12}, 24, 0.3, "pcie4",
            "L4 datasheet and nvidia-ada-gpu-architecture-whitepaper-v2.1.pdf: bf16/fp16 242*, tf32 120*, "
            "fp32 30.3; 24 GB GDDR6, 300 GB/s; PCIe Gen4"),
    _device("A10", r"\bA10G?\b", {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12}, 24, 0.6,
            "pcie4", "A10 datasheet (a10-datasheet.pdf): bf16/fp16 125 (250*), tf32 62.5 (125*), fp32 31.2; 24 GB "
            "GDDR6, 600 GB/s; PCIe Gen4. NVIDIA publishes none for AWS's A10G: the A10's figures"),
    _device("T4", r"\bT4\b", {"fp16": 65e12, "fp32": 8.1e12}, 16, 0.32, "pcie3",
            "T4 datasheet (t4-tensor-core-datasheet-951643.pdf): fp16 mixed 65, fp32 8.1 (Turing: no bf16, no "
            "tf32); 16 GB GDDR6, 320 GB/s; PCIe Gen3"),
    _device("V100S", r"V100S", {"fp16": 130e12, "fp32": 16.4e12}, 32, 1.134, "pcie3",
            f"{_V100}: V100S PCIe tensor 130, fp32 16.4 (Volta: no bf16, no tf32); 32 GB HBM2, 1,134 GB/s"),
    _device("V100-PCIe-32GB", r"V100.*PCIE.*32GB", {"fp16": 112e12, "fp32": 14e12}, 32, 0.9, "pcie3",
            f"{_V100}: V100 PCIe tensor 112, fp32 14; 32 GB HBM2, 900 GB/s"),
    _device("V100-PCIe-16GB", r"V100.*PCIE", {"fp16": 112e12, "fp32": 14e12}, 16, 0.9, "pcie3",
            f"{_V100}: V100 PCIe tensor 112, fp32 14; 16 GB HBM2, 900 GB/s"),
    _device("V100-SXM2-32GB", r"V100.*32GB", {"fp16": 125e12, "fp32": 15.7e12}, 32, 0.9, "nvlink2",
            f"{_V100}: V100 SXM2 tensor 125, fp32 15.7; 32 GB HBM2, 900 GB/s; NVLink 300 GB/s"),
    _device("V100-SXM2-16GB", r"V100", {"fp16": 125e12, "fp32": 15.7e12}, 16, 0.9, "nvlink2",
            f"{_V100}: V100 SXM2 tensor 125, fp32 15.7; 16 GB HBM2, 900 GB/s; NVLink 300 GB/s"),
)}

#: ``(regex on torch.cuda.get_device_name(), dense peak FLOP/s by precision)`` in matching order: the view of
#: :data:`DEVICES` that ``callbacks.flops`` and ``callbacks.utilization`` use for MFU.
PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = tuple((d.pattern, d.peak_flops) for d in DEVICES.values())

PRECISIONS = ("bf16", "fp16", "tf32", "fp32")

#: dense float8 peak FLOP/s by :data:`DEVICES` name (the datasheets' FP8 Tensor Core figures, printed with sparsity:
#: halved): the devices with float8 matmuls (compute capability 8.9 and up)
FLOAT8_PEAK: dict[str, float] = {
    "GB200": 5e15, "B200": 4.5e15,  # GB200 NVL72 spec: FP8 720 PFLOPS* / 72; HGX B200: 72 PFLOPS* / 8
    "H200-NVL": 1.671e15, "H100-NVL": 1.671e15,  # 3,341*
    "GH200-144GB": 1.979e15, "GH200": 1.979e15, "H200": 1.979e15, "H800": 1.979e15, "H100-SXM": 1.979e15,  # 3,958*
    "H100-PCIe": 1.513e15,  # 3,026*
    "L40S": 733e12, "L4": 242.5e12,  # 1,466*, 485*
}
#: the share of the float8 peak's gain over bf16 that float8 training's matmuls reach (their rate over the bf16
#: matmuls' at the same shapes, against the peaks' ratio, 2 on Hopper): fitted to one measurement, the H200's
#: compiled float8 at 6 of Llama-3.1-8B's layers, seq 2,048 x 8 (1.225x bf16's tokens/s, 2026-11-28), and checked
#: on its second, seq 2,048 x 2 (benchmarks/results/gpu_h200/vs_torchtitan_2026-11-28*.json; docs/planner.md)
FLOAT8_MATMUL_SHARE = 0.63


def find_device(name: str) -> DeviceSpec | None:
    """The device of a :data:`DEVICES` key (any case) or, failing that, the first whose pattern matches a torch
    device name ("NVIDIA H100 80GB HBM3" -> H100-SXM); None if none does."""
    by_key = {key.lower(): spec for key, spec in DEVICES.items()}
    if name.lower() in by_key:
        return by_key[name.lower()]
    return next((d for d in DEVICES.values() if re.search(d.pattern, name, flags=re.IGNORECASE)), None)


def _by_hand() -> str:
    return ("Pass the numbers by hand instead: lightning_par.devices.Hardware(device=..., matmul_flops=..., "
            "memory_bytes=..., gpus_per_node=..., intra_bandwidth=..., intra_latency=..., inter_bandwidth=..., "
            "inter_latency=..., source=...), or measure them on the machine with "
            "lightning_par.planner.probe.probe_hardware.")


def lookup_device(name: str) -> DeviceSpec:
    """:func:`find_device`, raising a ``ValueError`` that names the known devices for an unknown name."""
    if not isinstance(name, str):
        raise TypeError(f"device={name!r} must be a device name such as 'H100-SXM' or 'NVIDIA H100 80GB HBM3'.")
    spec = find_device(name)
    if spec is None:
        raise ValueError(f"device={name!r} is not a known device; known: {sorted(DEVICES)} (also matched against "
                         f"torch.cuda.get_device_name(), e.g. 'NVIDIA A100-SXM4-40GB'). {_by_hand()}")
    return spec


def lookup_link(name: str) -> LinkSpec:
    if not isinstance(name, str) or name.lower() not in LINKS:
        raise ValueError(f"link={name!r} is not a known link; known: {sorted(LINKS)}. {_by_hand()}")
    return LINKS[name.lower()]


def lookup_peak_flops(device_name: str, precision: str = "bf16") -> float | None:
    """Dense peak FLOP/s of a known GPU for ``precision`` ("bf16", "fp16", "tf32", "fp32"), else None."""
    spec = find_device(device_name)
    return spec.peak_flops.get(precision) if spec is not None else None


def precision_kind(precision: str | None) -> str | None:
    """The table's column for a Trainer ``precision``: bf16, fp16, tf32 or fp32 (32-bit matmuls use TF32 tensor
    cores only when ``torch.set_float32_matmul_precision`` allows it), None for others (fp64, fp8)."""
    p = str(precision or "")
    if p.startswith("bf16"):
        return "bf16"
    if p.startswith("16"):
        return "fp16"
    if p.startswith("32"):
        return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    return None


# ---------------------------------------------------------------------------------------------------------------
# what the planner consumes
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GroupedMatmulCurve:
    """How fast a mixture of experts' grouped matmuls run against a dense layer of the same shape, by the rows each
    expert gets: ``rate = (1 + (saturation / rows) ** 2) ** -0.5``, where ``saturation = saturation_rows x
    min(2, max(1, sqrt(wide / (local_experts x width))))``. Few rows per expert make skinny matmuls (a tile's rows half
    empty, too few tiles for the SMs); expert parallelism gives each rank's experts the rows of the whole ep group
    (``ep x`` more), context parallelism fewer. With ``local_experts x width`` small (a few narrow experts per rank)
    the device also idles: the saturation doubles from 250 rows towards 500.

    Fitted to :data:`GROUPED_MM_SOURCE`: the experts' forward and backward (SwiGLU, ``F.grouped_mm``) against the
    same MLP as dense matmuls over 16,384 rows, on an H100 in bf16, for the expert shapes of Qwen3-30B-A3B,
    gpt-oss-20b, DeepSeek-V3 and Mixtral-8x7B, 1-128 local experts, 64-8,192 rows each: 51 ratios, the formula off
    by 0.066 (root mean square), at most 0.20 (gpt-oss-20b's experts, which stay near 0.89 of its dense MLP however
    many rows they get); tests/test_planner_time.py checks it against the file."""

    saturation_rows: float = 250.0
    wide: float = 51200.0
    source: str = ""

    def rate(self, rows_per_expert: float, local_experts: int, width: float) -> float:
        """The experts' matmul rate as a share of the dense matmuls' (at most 1)."""
        if rows_per_expert <= 0:
            return 1.0
        # at most twice: the measurement reached 2.1 (4 experts 2880 wide); beyond it nothing says how it goes on
        saturation = self.saturation_rows * min(2.0, max(1.0, math.sqrt(self.wide / max(1.0, local_experts * width))))
        return (1.0 + (saturation / rows_per_expert) ** 2) ** -0.5


#: where :class:`GroupedMatmulCurve`'s figures come from
GROUPED_MM_SOURCE = ("benchmarks/results/gpu_h100/grouped_mm.json (benchmarks/bench_grouped_mm.py on an H100 80GB "
                     "HBM3, torch 2.11.0+cu130, bf16, 2026-11-26)")
#: the curve measured on an H100, relative to the device's own dense matmuls: the table's devices and probed GPUs
#: use it (nobody measured another GPU's; its shape comes from tiles and SM counts, alike on A100, H200, B200)
H100_GROUPED_MM = GroupedMatmulCurve(source=GROUPED_MM_SOURCE)


@dataclass(frozen=True)
class Hardware:
    """The constants the layout planner predicts with, per device. Bandwidths are bytes/s per device per direction
    as a ring uses them (``time = latency * 2(n-1) + bytes * 2(n-1)/n / bandwidth`` for an all-reduce of ``bytes``
    over ``n`` devices); ``math.inf`` bandwidth with 0 latency means "not measured, nothing to send" (one process)."""

    device: str  # a name for the report
    matmul_flops: float  # achievable FLOP/s per device for the run's precision (measured, or peak x efficiency)
    memory_bytes: int | None  # per device; None: unknown, the planner does not check fit
    gpus_per_node: int
    intra_bandwidth: float  # within a node, bytes/s
    intra_latency: float  # s per hop
    inter_bandwidth: float  # across nodes
    inter_latency: float
    source: str  # "measured on this machine (...)" or "table: H100-SXM, nvlink4, ib-ndr400, ..."
    #: the share of a pass's compute time its matmuls take at ``matmul_flops``; the rest is non-matmul work (norms,
    #: activations, launches) that selective checkpointing recomputes in full. 1: matmuls only (as the probe
    #: measures); from the table ``efficiency / DeviceSpec.matmul_efficiency`` (:data:`STEP_SHARE` by default: 56 %)
    matmul_share: float = 1.0
    #: links measured per shape of group within a node, ``((size, stride, bandwidth, latency), ...)``: the groups of
    #: ``size`` ranks ``stride`` apart, all communicating at once (as a mesh dimension's groups do). A mesh dimension
    #: whose groups have a measured shape uses its figures; any other the intra- or inter-node link
    group_links: tuple[tuple[int, int, float, float], ...] = ()
    #: matmul FLOP/s measured with the model's matmuls split as tensor parallelism of a degree splits them (each
    #: one's larger inner dimension divided by it: a column-parallel layer's outputs, a row-parallel one's inputs),
    #: ``((tp, flops), ...)``: a layout of a listed tp computes at its rate, any other at ``matmul_flops``
    matmul_by_tp: tuple[tuple[int, float], ...] = ()
    #: how the experts' grouped matmuls slow down with few rows per expert; None: at ``matmul_flops`` whatever
    #: their rows (the CPU, where the planner's figures are measured with the model's own matmuls)
    grouped_mm: GroupedMatmulCurve | None = None
    #: the FLOP rate of the engine's context-parallel attention blocks against ``matmul_flops`` where they run as
    #: fp32 matmuls over scores they materialize (``techniques/context/context.py``'s math path,
    #: ``CUDA_KERNELS = "math"``), whole blocks with a backward of five matmuls (:func:`cp_attention_rate`). None:
    #: priced as fused kernels, at their rate on the causal part: what the engine runs on a GPU by default (flash /
    #: memory-efficient per block, forward and backward), what the published runs' software ran, and the CPU, where
    #: the engine runs the math path but the fused pricing is what the planner's ranking of layouts was measured
    #: with (benchmarks/bench_planner.py, world 4)
    cp_attention_rate: float | None = None
    #: the bytes/s the non-matmul ops (norms, activations, casts, the loss's softmax) move at, priced apart from the
    #: matmuls (``Section.memory_traffic``); None: ``matmul_flops`` covers them (the CPU, where the probe measures
    #: the step's rate with the model's own work, and a table device given a step ``efficiency`` by hand)
    memory_bandwidth: float | None = None
    #: float8 training (``with_float8``): how many times faster the matmuls float8 converts run than at
    #: ``matmul_flops``, and the bytes/s its casts move at (their own kernels: not what ``fused`` assumes of the
    #: other ops); None: no float8
    float8_speedup: float | None = None
    float8_cast_bandwidth: float | None = None

    def matmul_rate(self, tp: int) -> float:
        """The matmul FLOP/s of a layout with tensor parallelism ``tp`` (see ``matmul_by_tp``)."""
        for degree, flops in self.matmul_by_tp:
            if degree == tp:
                return flops
        return self.matmul_flops

    def link(self, size: int, stride: int, within_node: bool, by_shape: bool = True,
             members_per_node: int = 1) -> tuple[float, float]:
        """(bandwidth, latency) of the groups of ``size`` ranks ``stride`` apart; ``by_shape=False``: the node's
        link whatever the shape.

        A group across nodes with ``members_per_node`` of its ranks in each node runs its ring collectives over
        that many NICs at once: NCCL's ring enters and leaves a node once per channel and spreads its channels over
        the node's NICs (one per GPU, each GPU's own), so the bytes that cross between nodes are one rank's share,
        carried by ``members_per_node`` NICs, up to the node-internal link that joins them. Multi-node nccl-tests on
        DGX H100 (8 x NDR 400 Gb/s) reach 400-450 GB/s all-reduce bus bandwidth, 8 x 50 GB/s, not one NIC's 50
        (saturncloud.io/blog/crusoe-nccl-cluster-validation, "Expected Performance"). Point-to-point sends and
        all-to-alls, whose bytes each rank sends over its own NIC, pass ``members_per_node=1``."""
        if not within_node:
            return min(self.intra_bandwidth, self.inter_bandwidth * max(1, members_per_node)), self.inter_latency
        for n, s, bandwidth, latency in self.group_links if by_shape else ():
            if (n, s) == (size, stride):
                return bandwidth, latency
        return self.intra_bandwidth, self.intra_latency

    def __post_init__(self) -> None:
        def positive(name: str, value: object, unit: str) -> None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isnan(value):
                raise ValueError(f"Hardware {name}={value!r} must be a positive number ({unit}).")

        positive("matmul_flops", self.matmul_flops, "FLOP/s per device")
        if isinstance(self.matmul_share, bool) or not isinstance(self.matmul_share, (int, float)) or not (
                0 < self.matmul_share <= 1):
            raise ValueError(f"Hardware matmul_share={self.matmul_share!r} must be in (0, 1]: the share of a pass's "
                             f"compute time its matmuls take.")
        positive("intra_bandwidth", self.intra_bandwidth, "bytes/s per device per direction")
        positive("inter_bandwidth", self.inter_bandwidth, "bytes/s per device per direction")
        for name in ("intra_latency", "inter_latency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"Hardware {name}={value!r} must be a finite number >= 0 (seconds per hop).")
        if self.memory_bandwidth is not None:
            positive("memory_bandwidth", self.memory_bandwidth, "bytes/s per device, or None")
        if self.memory_bytes is not None and (isinstance(self.memory_bytes, bool) or
                                              not isinstance(self.memory_bytes, int) or self.memory_bytes < 1):
            raise ValueError(f"Hardware memory_bytes={self.memory_bytes!r} must be a positive int (bytes per "
                             "device) or None (unknown: fit is not checked).")
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"Hardware gpus_per_node={self.gpus_per_node!r} must be a positive int.")
        for entry in self.group_links:
            if not (isinstance(entry, tuple) and len(entry) == 4 and all(isinstance(v, int) and v >= 1
                                                                          for v in entry[:2])):
                raise ValueError(f"Hardware group_links entry {entry!r} must be (size, stride, bandwidth, latency) "
                                 "with positive int size and stride.")
            positive("group_links bandwidth", entry[2], "bytes/s per device per direction")
        if self.cp_attention_rate is not None and (
                isinstance(self.cp_attention_rate, bool) or not isinstance(self.cp_attention_rate, (int, float))
                or not 0 < self.cp_attention_rate <= 1):
            raise ValueError(f"Hardware cp_attention_rate={self.cp_attention_rate!r} must be in (0, 1] (the context-"
                             f"parallel attention blocks' FLOP rate against matmul_flops) or None (fused kernels).")
        if (self.float8_speedup is None) != (self.float8_cast_bandwidth is None):
            raise ValueError("Hardware float8_speedup and float8_cast_bandwidth go together (devices.with_float8).")
        if self.float8_speedup is not None:
            positive("float8_speedup", self.float8_speedup, "times the matmul rate, or None")
            positive("float8_cast_bandwidth", self.float8_cast_bandwidth, "bytes/s, or None")
        for entry in self.matmul_by_tp:
            if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], int)
                    and not isinstance(entry[0], bool) and entry[0] >= 1):
                raise ValueError(f"Hardware matmul_by_tp entry {entry!r} must be (tp, FLOP/s) with a positive int tp.")
            positive("matmul_by_tp FLOP/s", entry[1], "FLOP/s per device")

    def summary(self) -> str:
        """One line for the planner's report."""
        memory = "memory unknown" if self.memory_bytes is None else f"{self.memory_bytes / GiB:.1f} GiB"

        def link(bandwidth: float, latency: float) -> str:
            return "-" if math.isinf(bandwidth) else f"{bandwidth / 1e9:.3g} GB/s, {latency * 1e6:.3g} us/hop"

        groups = "".join(f"; groups of {n} ranks {s} apart {link(b, lat)}" for n, s, b, lat in self.group_links)
        split = "".join(f", {f / 1e12:.4g} at tp {tp}" for tp, f in self.matmul_by_tp)
        return (f"{self.device}: {self.matmul_flops / 1e12:.4g} TFLOP/s{split}, {memory}, "
                f"{self.gpus_per_node} per node; intra-node {link(self.intra_bandwidth, self.intra_latency)}"
                f"{groups}; inter-node {link(self.inter_bandwidth, self.inter_latency)} ({self.source})")


def known_hardware(
    device: str,
    precision: str = "bf16",
    gpus_per_node: int = 8,
    inter_link: str = "ib-ndr400",
    efficiency: float | None = None,
    intra_link: str | None = None,
    nics_per_node: int | None = None,
    float32_matmul_precision: str | None = None,
    cp_math_path: bool = False,
    memory_efficiency: float | None = None,
) -> Hardware:
    """The :class:`Hardware` of a known device from the tables: ``matmul_flops`` is the dense peak for
    ``precision`` times ``efficiency``, the node-internal link is the device's usual one unless ``intra_link`` names
    another, and ``inter_link`` joins the nodes with one NIC per GPU unless ``nics_per_node`` says fewer (their
    bandwidth is then shared: ``bandwidth * nics_per_node / gpus_per_node``).

    By default the GPU time model (:data:`MATMUL_STEP_SHARE`): the matmuls at that share of the rate the device's
    matmuls reach alone (``DeviceSpec.matmul_efficiency``), the other ops' bytes at :data:`BANDWIDTH_SHARE` of its
    memory bandwidth. ``efficiency``: instead, the fraction of dense peak a training step's model FLOPs reach, all
    its work included (no separate memory term), unless ``memory_efficiency`` is given too: then ``efficiency`` is
    the matmuls' fraction of peak and ``memory_efficiency`` the memory bandwidth's share the other ops reach.

    ``cp_math_path``: the engine's context-parallel blocks run the fp32 math path (its ``CUDA_KERNELS = "math"``)
    rather than torch's fused kernels (its default on a GPU): priced at :func:`cp_attention_rate`, for which
    ``float32_matmul_precision`` is the training run's ``torch.set_float32_matmul_precision`` ("highest", "high",
    "medium"; default: this process's)."""
    spec = lookup_device(device)
    rule = ""
    if efficiency is None:
        efficiency = MATMUL_STEP_SHARE * spec.matmul_efficiency
        memory_efficiency = BANDWIDTH_SHARE if memory_efficiency is None else memory_efficiency
        rule = f" ({MATMUL_STEP_SHARE:g} of its matmuls' {spec.matmul_efficiency:g})"
    if memory_efficiency is not None and (isinstance(memory_efficiency, bool) or not isinstance(
            memory_efficiency, (int, float)) or not 0 < memory_efficiency <= 1):
        raise ValueError(f"memory_efficiency={memory_efficiency!r} must be in (0, 1]: the share of the memory "
                         f"bandwidth the non-matmul ops reach (default {BANDWIDTH_SHARE:g}).")
    if precision not in spec.peak_flops:
        raise ValueError(f"precision={precision!r}: {spec.name} has dense peaks for {sorted(spec.peak_flops)} only "
                         f"(of {list(PRECISIONS)}); pass one of those.")
    if isinstance(efficiency, bool) or not isinstance(efficiency, (int, float)) or not 0 < efficiency <= 1:
        raise ValueError(f"efficiency={efficiency!r} must be in (0, 1]: the fraction of dense peak the run reaches "
                         f"(default {STEP_SHARE:g} x the device's matmul efficiency, "
                         f"{STEP_SHARE * spec.matmul_efficiency:.3g} for {spec.name}).")
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ValueError(f"gpus_per_node={gpus_per_node!r} must be a positive int.")
    if nics_per_node is not None and (isinstance(nics_per_node, bool) or not isinstance(nics_per_node, int)
                                      or nics_per_node < 1):
        raise ValueError(f"nics_per_node={nics_per_node!r} must be a positive int or None (one NIC per GPU).")
    intra = lookup_link(intra_link or spec.intra_link)
    inter = lookup_link(inter_link)
    share = 1.0 if nics_per_node is None else min(1.0, nics_per_node / gpus_per_node)
    nics = "" if nics_per_node is None else f" x {nics_per_node} NICs/{gpus_per_node} GPUs"
    bandwidth = None if memory_efficiency is None else spec.memory_bandwidth * memory_efficiency
    memory = ("" if bandwidth is None
              else f", other ops at {memory_efficiency:g} of {spec.memory_bandwidth / 1e12:g} TB/s")
    return Hardware(
        device=spec.name,
        matmul_flops=spec.peak_flops[precision] * efficiency,
        memory_bytes=spec.memory_bytes,
        gpus_per_node=gpus_per_node,
        intra_bandwidth=intra.bandwidth,
        intra_latency=intra.latency,
        inter_bandwidth=inter.bandwidth * share,
        inter_latency=inter.latency,
        source=f"table: {spec.name} {precision} x {efficiency:.3g}{rule}{memory}, {intra.name}, {inter.name}{nics}",
        # the non-matmul work: its bytes priced apart, or inside the step's share of the matmuls' rate
        matmul_share=1.0 if bandwidth else min(1.0, efficiency / spec.matmul_efficiency),
        memory_bandwidth=bandwidth,
        grouped_mm=H100_GROUPED_MM,
        cp_attention_rate=cp_attention_rate(spec, precision, float32_matmul_precision) if cp_math_path else None,
    )


def with_float8(hardware: Hardware) -> Hardware:
    """``hardware`` for float8 training (the strategies' ``float8="tensorwise"``): the matmuls it converts at the
    device's float8 rate (:data:`FLOAT8_PEAK` over its bf16 peak, :data:`FLOAT8_MATMUL_SHARE` of that gain), its
    casts as bytes (``planner.predict.FLOAT8_CAST_BYTES``) at :data:`BANDWIDTH_SHARE` of the device's memory
    bandwidth, whether or not the rest is fused. Refused for a device without float8 matmuls (the CPU: float8 there
    is for correctness only)."""
    spec = find_device(hardware.device)  # a table name, or a probed GPU's torch name
    peak = FLOAT8_PEAK.get(spec.name) if spec is not None else None
    if peak is None or "bf16" not in spec.peak_flops:
        raise ValueError(f"float8 on {hardware.device}: it has no float8 matmuls the planner knows of (float8 needs "
                         f"a GPU of compute capability 8.9 or more: {sorted(FLOAT8_PEAK)}); plan without float8.")
    speedup = 1 + FLOAT8_MATMUL_SHARE * (peak / spec.peak_flops["bf16"] - 1)
    casts = spec.memory_bandwidth * BANDWIDTH_SHARE
    return dataclasses.replace(hardware, float8_speedup=speedup, float8_cast_bandwidth=casts,
                               source=f"{hardware.source}; float8 matmuls {speedup:.3g}x, casts at "
                                      f"{casts / 1e12:.3g} TB/s")


def fused(hardware: Hardware, traffic: float | None = None) -> Hardware:
    """``hardware`` for software that fuses the non-matmul ops (torch.compile, Transformer Engine): they move
    ``traffic`` (default :data:`FUSED_TRAFFIC`) of the bytes eager PyTorch moves, priced as the memory bandwidth
    that share of the bytes would need. Unchanged where the hardware prices no memory term (the CPU)."""
    share = FUSED_TRAFFIC if traffic is None else traffic
    if not 0 < share <= 1:
        raise ValueError(f"traffic={traffic!r} must be in (0, 1]: the share of eager PyTorch's bytes the fused "
                         f"kernels move (default {FUSED_TRAFFIC:g}).")
    if hardware.memory_bandwidth is None:
        return hardware
    return dataclasses.replace(hardware, memory_bandwidth=hardware.memory_bandwidth / share,
                               source=f"{hardware.source}; fused non-matmul ops ({share:g} of eager's bytes)")


def cp_attention_rate(spec: DeviceSpec, precision: str, float32_matmul_precision: str | None = None) -> float | None:
    """The FLOP rate of the engine's context-parallel attention blocks on ``spec`` against its dense matmuls at
    ``precision``: they multiply in fp32, at the fp32 peak where ``float32_matmul_precision`` (default: torch's
    setting in this process, ``torch.get_float32_matmul_precision()``) is "highest" (torch's default), TF32's
    where "high", bf16's where "medium". An H100 training in bf16: 67 / 989 = 0.068 (fused attention kernels:
    ``planner.predict.ATTENTION_RATE``, 0.5)."""
    setting = float32_matmul_precision or torch.get_float32_matmul_precision()
    kinds = {"highest": "fp32", "high": "tf32", "medium": "bf16"}
    if setting not in kinds:
        raise ValueError(f"float32_matmul_precision={setting!r} must be one of {list(kinds)} (torch's settings).")
    peaks = spec.peak_flops
    rate = peaks.get(kinds[setting], peaks.get("fp32"))
    if rate is None or precision not in peaks:
        return None
    return min(1.0, rate / peaks[precision])
