"""What the expert hosts hold, as the planning loop reads it from their Status replies: one
array per fact over (layer, expert, host), so a pass's rules (rules.py) and the step scaler's
widenings (widenings.py) ask the same view."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from moeless.placement.cluster import Cluster


@dataclass(frozen=True)
class HostView:
    """What the hosts hold, from their Status replies. resident, loading: [L, E, G] bool (a replica
    loaded / loading on host g); live: [G] bool (the host answered); memory: [G] replica bytes
    each host offers (0 for a dead host); keep_left: [L, E, G] seconds until a resident replica's
    keep-alive runs out (inf while it computes; None: not read)."""

    resident: np.ndarray
    loading: np.ndarray
    live: np.ndarray
    memory: np.ndarray
    keep_left: np.ndarray | None = None

    def lasting(self, for_s: float) -> np.ndarray:
        """[L, E, G] bool: the resident replicas whose keep-alive has at least for_s left (a host's
        keep-warm set may keep one longer: this errs on the side of counting it gone)."""
        return self.resident if self.keep_left is None else self.resident & (self.keep_left >= for_s)

    @staticmethod
    def from_status(statuses: Sequence[dict | None], num_layers: int, num_experts: int) -> "HostView":
        """statuses[g]: host g's status() (ExpertHostClient.status) or None when it did not answer."""
        num_hosts = len(statuses)
        resident = np.zeros((num_layers, num_experts, num_hosts), dtype=bool)
        loading = np.zeros_like(resident)
        live = np.array([s is not None and s.get("health", "serving") == "serving" for s in statuses])
        memory, keep_left = np.zeros(num_hosts), np.zeros(resident.shape)
        for g, status in enumerate(statuses):
            if not live[g]:
                continue
            memory[g] = float(status["memory_bytes"])
            for r in status["replicas"]:
                if r["layer"] >= num_layers or r["expert"] >= num_experts:
                    continue
                if r["state"] in ("warm", "idle"):
                    resident[r["layer"], r["expert"], g] = True
                    keep_left[r["layer"], r["expert"], g] = (np.inf if r["state"] == "warm" else
                                                             status["keep_alive_s"] - r.get("idle_s", 0.0))
                elif r["state"] == "loading":
                    loading[r["layer"], r["expert"], g] = True
        return HostView(resident, loading, live, memory, keep_left)

    def cluster(self, expert_bytes: int, layer_cap: int | None) -> Cluster:
        """The live hosts as a Cluster (a dead host: no memory). Raises ClusterError when none is live."""
        cap = None if layer_cap is None else float(layer_cap * expert_bytes)
        return Cluster(self.memory, expert_bytes, cap)
