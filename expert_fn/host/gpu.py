"""Which device an expert host computes on and how much memory it may fill with replicas.

Where NVML (nvidia-ml-py, the `gpu` extra) finds a GPU, the host learns its name and free memory
from it; otherwise (no driver, no package, CPU-only torch) it runs on the CPU with the memory
given in configuration. Nothing here requires a GPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

DEFAULT_CPU_MEMORY_BYTES = 4 * 10**9  # replica memory on a CPU host when none is configured
GPU_MEMORY_FRACTION = 0.9  # of the GPU's free memory, leaving room for activations


@dataclass(frozen=True)
class DeviceInfo:
    torch_device: str  # "cuda:<i>" or "cpu"
    name: str
    total_bytes: int
    free_bytes: int
    source: str  # "nvml" or "config"


def nvml_gpu(index: int) -> DeviceInfo | None:
    """GPU `index` as NVML sees it, or None where there is no NVML, driver or such GPU."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # NVMLError_LibraryNotFound where there is no driver
        return None
    try:
        if index >= pynvml.nvmlDeviceGetCount():
            return None
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        name = pynvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else name
        return DeviceInfo(f"cuda:{index}", name, int(memory.total), int(memory.free), "nvml")
    except pynvml.NVMLError as err:
        log.warning("NVML failed on GPU %d (%s); running on the CPU", index, err)
        return None
    finally:
        pynvml.nvmlShutdown()


def detect_device(gpu_index: int | None = 0, memory_bytes: int | None = None) -> tuple[DeviceInfo, int]:
    """(device, replica memory capacity in bytes) for a host.

    memory_bytes, when given, is the capacity; otherwise GPU_MEMORY_FRACTION of the GPU's free
    memory, or DEFAULT_CPU_MEMORY_BYTES on the CPU. gpu_index is NVML's index, which matches
    torch's only when CUDA_VISIBLE_DEVICES is unset.
    """
    import torch

    gpu = nvml_gpu(gpu_index) if gpu_index is not None else None
    if gpu is not None and not torch.cuda.is_available():
        log.warning("NVML sees %s but this torch has no CUDA; running on the CPU", gpu.name)
        gpu = None
    if gpu is None:
        capacity = memory_bytes or DEFAULT_CPU_MEMORY_BYTES
        return DeviceInfo("cpu", "cpu", capacity, capacity, "config"), capacity
    return gpu, memory_bytes or int(gpu.free_bytes * GPU_MEMORY_FRACTION)
