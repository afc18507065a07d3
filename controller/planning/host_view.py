"""What the expert hosts hold and measure, as the planning loop reads it from their Status replies:
HostView, one array per fact over (layer, expert, host), so a pass's rules (rules.py) and the step
scaler's widenings (widenings.py) ask the same view; HostFigures, what the loop keeps of each pool
slot across passes (its memory, its meters, the GB·s its hosts held across their restarts)."""

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
    keep-alive runs out (inf while it computes or while the host keeps it past it; None: not read)."""

    resident: np.ndarray
    loading: np.ndarray
    live: np.ndarray
    memory: np.ndarray
    keep_left: np.ndarray | None = None

    def lasting(self, for_s: float) -> np.ndarray:
        """[L, E, G] bool: the resident replicas whose keep-alive has at least for_s left, or that their
        host keeps past it (a keep-warm set, family warmth: Status's `kept`)."""
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
                    keep_left[r["layer"], r["expert"], g] = (np.inf if r["state"] == "warm" or r.get("kept") else
                                                             status["keep_alive_s"] - r.get("idle_s", 0.0))
                elif r["state"] == "loading":
                    loading[r["layer"], r["expert"], g] = True
        return HostView(resident, loading, live, memory, keep_left)

    def cluster(self, expert_bytes: int, layer_cap: int | None) -> Cluster:
        """The live hosts as a Cluster (a dead host: no memory). Raises ClusterError when none is live."""
        cap = None if layer_cap is None else float(layer_cap * expert_bytes)
        return Cluster(self.memory, expert_bytes, cap)


class Accumulated:
    """GB·s of hosts whose counters restart with the host: the sum of every host's increases."""

    def __init__(self, hosts: int):
        self.last = [0.0] * hosts
        self.total = 0.0

    def update(self, host: int, value: float) -> None:
        self.total += value - self.last[host] if value >= self.last[host] else value  # a restart begins at 0
        self.last[host] = value

    def resize(self, hosts: int) -> None:
        """Slots added start from 0; a slot removed keeps what it added to the total."""
        self.last = self.last[:hosts] + [0.0] * (hosts - len(self.last))


def meter_totals(meters: list[dict]) -> dict:
    """The hosts' cold starts (hidden and exposed seconds, count), loads, and the resident replicas the
    model uses alone or shares with other models of the hosts (held once), summed over each host's last
    meters (hosts that never answered: {})."""
    return {"cold_hidden_s": sum(m.get("cold_hidden_s", 0.0) for m in meters),
            "cold_exposed_s": sum(m.get("cold_exposed_s", 0.0) for m in meters),
            "cold_starts": sum(m.get("cold_starts", 0) for m in meters), "loads": sum(m.get("loads", 0) for m in meters),
            **{key: sum(m.get(key, 0) for m in meters) for key in ("own_replicas", "shared_replicas", "shared_bytes")}}


class HostFigures:
    """What the loop keeps of each pool slot across passes, sized to the pool's slots (resize): its
    host's replica memory (a dead or spare host's as last seen), its last meters ({}: never answered)
    and the GB·s its hosts held (Accumulated)."""

    def __init__(self, slots: int) -> None:
        self.memory = np.zeros(slots)
        self.meters: list[dict] = [{} for _ in range(slots)]
        self._gb_s = Accumulated(slots)

    def resize(self, slots: int) -> bool:
        """Fit the figures to `slots` (a slot added starts empty); False where they fit already."""
        if slots == len(self.memory):
            return False
        keep = min(slots, len(self.memory))
        self.memory = np.concatenate([self.memory[:keep], np.zeros(slots - keep)])
        self.meters = self.meters[:keep] + [{} for _ in range(slots - keep)]
        self._gb_s.resize(slots)
        return True

    def update(self, statuses: Sequence[dict | None], planned: HostView) -> None:
        """One pass's Status replies (None: no answer) and the view it plans over (its live hosts' memory)."""
        self.memory = np.where(planned.live, planned.memory, self.memory)
        for i, status in enumerate(statuses):
            if status is not None:
                self.meters[i] = status["meters"]
                self._gb_s.update(i, status["meters"]["gb_s"])  # a model-bound client's: its own part

    def totals(self) -> dict:
        """meter_totals over the slots' last meters, and the GB·s held in all ("expert_gb_s")."""
        return {**meter_totals([m for m in self.meters if m]), "expert_gb_s": self._gb_s.total}
