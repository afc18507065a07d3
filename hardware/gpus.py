"""GPU datasheet figures for the twin's roofline profiles (pure data; twin/roofline.py uses them).

Every figure is the vendor's datasheet value (URL in `source`), per GPU, one direction for links:
peak dense BF16 tensor FLOP/s (without sparsity), memory bandwidth and size, GPU-GPU link
bandwidth and how GPUs are linked, host-GPU (PCIe) bandwidth. Bidirectional datasheet figures are
halved (a token's hidden state moves one way per all-to-all).

    gpu_spec("h100")             # GpuSpec(name="H100", ...)
    parse_gpu_arg("A6000x8")     # (GpuSpec A6000, 8)
    spec.all_to_all_bw(8)        # bytes/s one GPU sends in an all-to-all over 8 GPUs
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GB = 1e9
TFLOPS = 1e12
NODE_GPUS = 8  # GPUs of one node (HGX/DGX: 8 on one NVSwitch); more GPUs span nodes
# Between nodes, each GPU's own NIC: 400 Gb/s (InfiniBand NDR / ConnectX-7 per GPU in a DGX H100,
# https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html), one way.
NETWORK_BW = 400e9 / 8
LINKS = ("nvswitch", "nvlink-pairs", "pcie")


class GpuError(ValueError):
    """An unknown GPU name or a bad NAME[xCOUNT] argument."""


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator's datasheet figures (FLOP/s, bytes/s, bytes)."""

    name: str
    peak_flops: float  # dense BF16 tensor FLOP/s (float32 FLOP/s for a CPU)
    mem_bw: float  # device memory bandwidth, bytes/s
    memory: float  # device memory, bytes
    link: str  # "nvswitch" (every GPU to every GPU), "nvlink-pairs" (bridged pairs, PCIe otherwise), "pcie"
    link_bw: float  # GPU-GPU bytes/s one way over NVLink (0: none)
    pcie_bw: float  # host-GPU bytes/s one way
    source: str

    def __post_init__(self):
        if self.link not in LINKS:
            raise GpuError(f"{self.name}: link must be one of {LINKS}, got {self.link!r}")

    def all_to_all_bw(self, count: int) -> float:
        """Bytes/s one GPU sends in an all-to-all over `count` GPUs, traffic spread evenly over peers.
        nvswitch: the NVLink bandwidth to the peers of its node (NODE_GPUS) and the network
        (NETWORK_BW) to the others, in parallel; the slower part sets the time. pcie: the PCIe
        bandwidth. nvlink-pairs (the paper's A6000s): 1/(count-1) of the traffic goes to the
        bridged peer over NVLink while the rest shares PCIe, in parallel."""
        if count < 1:
            raise GpuError(f"a deployment needs at least one GPU, got {count}")
        if count == 1 or self.link == "pcie":
            return self.link_bw if self.link != "pcie" else self.pcie_bw
        if self.link == "nvswitch":
            near = min(count, NODE_GPUS) - 1
            return 1 / max(near / (count - 1) / self.link_bw, (count - 1 - near) / (count - 1) / NETWORK_BW)
        peer = 1 / (count - 1)
        return 1 / max(peer / self.link_bw, (1 - peer) / self.pcie_bw)

    def peer_copy_bw(self, count: int) -> float:
        """Bytes/s of one expert copied from a GPU that holds it (BlitzScale's scale-out): over
        NVLink inside a node (a holder there: every expert's home is in its node when count <= 8,
        else the network), over PCIe where there is no NVLink."""
        if self.link == "pcie" or self.link_bw <= 0:
            return self.pcie_bw
        if self.link == "nvlink-pairs":
            return self.pcie_bw if count > 2 else self.link_bw
        return self.link_bw if count <= NODE_GPUS else NETWORK_BW


GPUS: dict[str, GpuSpec] = {s.name.lower(): s for s in (
    # RTX A6000: 154.8 TFLOPS BF16 tensor dense (309.7 sparse), 48 GB GDDR6 at 768 GB/s; NVLink bridge
    # 112.5 GB/s bidirectional between two cards; PCIe Gen4 x16 64 GB/s bidirectional.
    GpuSpec("A6000", 154.8 * TFLOPS, 768 * GB, 48 * GB, "nvlink-pairs", 56.25 * GB, 32 * GB,
            "https://www.nvidia.com/en-us/design-visualization/rtx-a6000/ (datasheet linked there)"),
    # A100 80GB SXM: 312 TFLOPS BF16 dense (624 sparse), 2,039 GB/s HBM2e; NVLink 600 GB/s
    # bidirectional through NVSwitch (HGX A100); PCIe Gen4 64 GB/s bidirectional.
    GpuSpec("A100", 312 * TFLOPS, 2039 * GB, 80 * GB, "nvswitch", 300 * GB, 32 * GB,
            "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"),
    # H100 SXM5 80GB: 989.4 TFLOPS BF16 dense (1,979 sparse), 3.35 TB/s HBM3; NVLink 900 GB/s
    # bidirectional (HGX H100, NVSwitch); PCIe Gen5 128 GB/s bidirectional.
    GpuSpec("H100", 989.4 * TFLOPS, 3350 * GB, 80 * GB, "nvswitch", 450 * GB, 64 * GB,
            "https://www.nvidia.com/en-us/data-center/h100/ (specifications, H100 SXM)"),
    # H200 SXM 141GB: 989 TFLOPS BF16 dense (1,979 sparse), 4.8 TB/s HBM3e; NVLink 900 GB/s
    # bidirectional; PCIe Gen5 128 GB/s bidirectional.
    GpuSpec("H200", 989.4 * TFLOPS, 4800 * GB, 141 * GB, "nvswitch", 450 * GB, 64 * GB,
            "https://www.nvidia.com/en-us/data-center/h200/ (specifications, H200 SXM)"),
    # L40S: 362.05 TFLOPS BF16 dense (733 sparse), 48 GB GDDR6 at 864 GB/s; no NVLink; PCIe Gen4
    # x16 64 GB/s bidirectional.
    GpuSpec("L40S", 362.05 * TFLOPS, 864 * GB, 48 * GB, "pcie", 0.0, 32 * GB,
            "https://www.nvidia.com/en-us/data-center/l40s/ (datasheet linked there)"),
)}


def known_gpus() -> list[str]:
    return [s.name for s in GPUS.values()]


def gpu_spec(name: str) -> GpuSpec:
    """A GPU by name, case-insensitive ("h100", "A6000")."""
    spec = GPUS.get(name.strip().lower())
    if spec is None:
        raise GpuError(f"unknown GPU {name!r}; known: {', '.join(known_gpus())}")
    return spec


def parse_gpu_arg(text: str) -> tuple[GpuSpec, int]:
    """"NAME" or "NAMExCOUNT" ("H100x8", "a6000X4"; COUNT defaults to 8, the paper's testbed size)."""
    match = re.fullmatch(r"\s*([A-Za-z0-9]+?)(?:[xX](\d+))?\s*", text)
    if not match:
        raise GpuError(f"--gpu: expected NAME or NAMExCOUNT (e.g. H100x8), got {text!r}; known: {', '.join(known_gpus())}")
    count = int(match.group(2)) if match.group(2) else 8
    if count < 1:
        raise GpuError(f"--gpu: the count must be at least 1, got {text!r}")
    return gpu_spec(match.group(1)), count


def gpu_from_device_name(device_name: str) -> GpuSpec | None:
    """The datasheet of a CUDA device by its name ("NVIDIA H100 80GB HBM3" -> H100), None if unknown."""
    upper = device_name.upper()
    return next((s for s in GPUS.values() if re.search(rf"\b{s.name.upper()}\b", upper.replace("-", " "))), None)
