"""The GPU inventory a planner places replicas on: memory per GPU, counted in replica slots.

All replicas of one model have the same size (one expert's weights), so memory is tracked as
whole replica slots per GPU: slots = floor(bytes a GPU offers to expert replicas / expert_bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class ClusterError(ValueError):
    """A cluster that cannot host any placement (no GPU, no room for an expert, bad numbers)."""


@dataclass(frozen=True)
class Cluster:
    """G GPUs (expert hosts) and the memory rules replicas obey.

    gpu_memory:       [G] bytes each GPU offers to expert replicas (non-expert weights excluded)
    expert_bytes:     bytes one replica holds (one expert's weights)
    layer_memory_cap: bytes all replicas of one layer may hold together (the paper's M_cap);
                      None means only the GPUs' memory limits replicas
    """

    gpu_memory: np.ndarray
    expert_bytes: int
    layer_memory_cap: float | None = None

    def __post_init__(self) -> None:
        memory = np.asarray(self.gpu_memory, dtype=np.float64)
        object.__setattr__(self, "gpu_memory", memory)
        if memory.ndim != 1 or memory.size == 0:
            raise ClusterError(f"a cluster needs at least one GPU; got gpu_memory of shape {memory.shape}")
        if not np.isfinite(memory).all() or (memory < 0).any():
            raise ClusterError("gpu_memory must be finite, non-negative bytes per GPU")
        if self.expert_bytes <= 0:
            raise ClusterError(f"expert_bytes must be positive, got {self.expert_bytes}")
        if memory.max() < self.expert_bytes:
            raise ClusterError(
                f"one expert ({self.expert_bytes} bytes) is larger than every GPU's expert memory "
                f"(largest {int(memory.max())} bytes); give the GPUs more memory or use smaller experts"
            )
        if self.layer_memory_cap is not None and self.layer_memory_cap < 0:
            raise ClusterError(f"layer_memory_cap must be non-negative, got {self.layer_memory_cap}")

    @property
    def num_gpus(self) -> int:
        return int(self.gpu_memory.shape[0])

    def slots(self) -> np.ndarray:
        """Replicas each GPU can hold: [G] int."""
        return (self.gpu_memory // self.expert_bytes).astype(np.int64)

    def layer_replica_cap(self) -> int | None:
        """Replicas one layer may hold in all (M_cap / M_e), or None without a cap."""
        if self.layer_memory_cap is None:
            return None
        return int(self.layer_memory_cap // self.expert_bytes)

    def check_fits(self, num_layers: int, num_experts: int) -> None:
        """Raise ClusterError unless one replica of every expert of every layer fits."""
        need, have = num_layers * num_experts, int(self.slots().sum())
        if need > have:
            raise ClusterError(
                f"the cluster holds {have} replicas but {num_layers} layers x {num_experts} experts need {need}; "
                f"add GPUs or GPU memory"
            )
        cap = self.layer_replica_cap()
        if cap is not None and cap < num_experts:
            raise ClusterError(
                f"layer_memory_cap allows {cap} replicas per layer, fewer than the {num_experts} experts; raise it"
            )

    @staticmethod
    def uniform(num_gpus: int, slots_per_gpu: int, expert_bytes: int, layer_cap_replicas: int | None = None) -> "Cluster":
        """num_gpus identical GPUs with room for slots_per_gpu replicas each."""
        if num_gpus <= 0:
            raise ClusterError(f"a cluster needs at least one GPU, got num_gpus={num_gpus}")
        cap = None if layer_cap_replicas is None else float(layer_cap_replicas * expert_bytes)
        return Cluster(np.full(num_gpus, float(slots_per_gpu * expert_bytes)), expert_bytes, cap)
