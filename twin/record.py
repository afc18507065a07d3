"""What one replay of the twin did: per iteration and layer, the layer times under both execution
models, cold starts (exposed and hidden), loads, evictions, replicas and GB·s under both billing
models (twin/twin.py fills it; evaluation/ and the benches read it)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

GB = 1e9
EXECUTIONS = ("serial", "paper")
BILLINGS = ("resident", "per-layer")


@dataclass
class TwinRecord:
    """What one replay did, per iteration [I] and per iteration and layer [I, L].

    time_s, window_s [I]: an iteration's start and the seconds until the next one; phase [I];
    paper_s, serial_s [I, L]: layer time under each execution model, cold starts not included;
    cold_s, exposed_s [I, L]: cold-start seconds of the layer (the GPU that loads the most) and the
    part the layer waited for (hidden = cold - exposed); loads, evictions [I, L]: replicas loaded,
    evicted; resident, planned [I, L]: replicas resident after the loads, used by the plan;
    gb_s_resident, gb_s_per_layer [I, L]: expert GB·s under each billing model;
    non_expert_gb_s: non-expert weights over the run (both billing models).
    """

    time_s: np.ndarray
    window_s: np.ndarray
    phase: np.ndarray
    paper_s: np.ndarray
    serial_s: np.ndarray
    cold_s: np.ndarray
    exposed_s: np.ndarray
    loads: np.ndarray
    evictions: np.ndarray
    resident: np.ndarray
    planned: np.ndarray
    gb_s_resident: np.ndarray
    gb_s_per_layer: np.ndarray
    non_expert_gb_s: float = 0.0
    settings: dict = field(default_factory=dict)

    @property
    def hidden_s(self) -> np.ndarray:
        return np.maximum(self.cold_s - self.exposed_s, 0.0)

    def layer_time(self, execution: str = "serial", cold: bool = True) -> np.ndarray:
        """[I, L] seconds per layer under `execution`, with the exposed cold starts or without."""
        if execution not in EXECUTIONS:
            raise ValueError(f"unknown execution model {execution!r}; use one of {EXECUTIONS}")
        base = self.serial_s if execution == "serial" else self.paper_s
        return base + self.exposed_s if cold else base

    def gb_s(self, billing: str = "resident") -> np.ndarray:
        """[I, L] expert GB·s under `billing`."""
        if billing not in BILLINGS:
            raise ValueError(f"unknown billing model {billing!r}; use one of {BILLINGS}")
        return self.gb_s_resident if billing == "resident" else self.gb_s_per_layer

    def summary(self, mask: np.ndarray | None = None) -> dict:
        """Means over the iterations in mask (all by default) of the per-layer figures, and the
        total MoE-layer seconds (the time-weighted view of prefill and decode together)."""
        m = np.ones(len(self.time_s), dtype=bool) if mask is None else np.asarray(mask)
        out: dict = {"iterations": int(m.sum())}
        if not m.any():
            return out
        for execution in EXECUTIONS:
            out[f"{execution}_s"] = float(self.layer_time(execution, cold=False)[m].mean())
            out[f"{execution}_cold_s"] = float(self.layer_time(execution)[m].mean())
        out["total_serial_cold_s"] = float(self.layer_time("serial")[m].sum())
        out.update({
            "cold_s": float(self.cold_s[m].mean()), "exposed_s": float(self.exposed_s[m].mean()),
            "hidden_s": float(self.hidden_s[m].mean()),
            "loads": float(self.loads[m].mean()), "evictions": float(self.evictions[m].mean()),
            "resident": float(self.resident[m].mean()), "planned": float(self.planned[m].mean()),
            # replicas per layer weighted by the seconds they are held: what the memory bill sees
            "resident_time_weighted": float((self.resident[m] * self.window_s[m, None]).sum() / (self.window_s[m].sum() * self.resident.shape[1])),
            "gb_s_resident": float(self.gb_s_resident[m].sum()), "gb_s_per_layer": float(self.gb_s_per_layer[m].sum()),
        })
        return out
