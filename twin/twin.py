"""The digital twin: serving iterations replayed through a planner on a cluster, every cost counted.

Pure (numpy; no Ray, gRPC or Kubernetes). In: iterations (timestamps, phases, actual loads
[L, E]), the forecasts the planner sees ([I, L, E]), a planner, a cluster (replica slots per GPU,
expert bytes) and a measured cost profile; settings: keep-alive, prefetch distance d, the tier
cold loads come from. Out: per-iteration, per-layer records (`TwinRecord`). `moeless bench
planner` and `moeless eval` are built on it.

The model, per iteration (docs/design.md, "What a plan costs" and "The paper's model"):
1. Resident set. Every planner starts with static EP's replicas resident (pre-warmed when the
   deployment starts, not counted as loads). A replica the current plan uses stays resident; one
   the plan leaves out stays keep_alive_s after it was last planned, then is evicted (checked
   before each iteration). A load onto a GPU without a free slot evicts the replica there that
   was planned longest ago among those this iteration's plan does not use.
2. Plan. The planner gets the forecast [L, E] and what is resident (a Placement of every
   resident replica) and returns the plan; its replicas that are not resident are cold loads.
3. Time, layer by layer: `serial` and `paper` layer times on the actual loads (the Oracle's on its
   lossy loads). moeless's planners leave the shares to the data plane, as `moeless serve` runs
   them (`actual_shares`): a layer with a split expert is re-levelled over the plan's replicas on
   its actual loads where the most that can save beats relevel_s, paying relevel_s for it, and
   otherwise keeps the better of its planned shares and static EP's split; every such layer pays
   the profile's check_s for the check. The baselines keep their shares.
   Layer t's cold loads are issued when layer max(t - d, 0) starts (a forecast made d layers
   ahead); each GPU loads one replica after another (load_s each); layer t waits for the
   last of its loads: exposed_t = max(0, done - start_t). Its cold-start time is the most any GPU
   loads for it (n x load_s); hidden = cold - exposed. Layer t + 1 starts when layer t ends
   (serial time + exposed).
4. Memory, two billing models: `resident`, every resident replica's bytes for the seconds it is
   held (load to eviction, or the end); `per-layer` (the paper's C), a layer's planned replicas'
   bytes for its time. Non-expert weights are held the whole run under both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from moeless.twin.iterations import Iteration
from moeless.placement.planner import Planner
from moeless.placement.profile import CostProfile
from moeless.placement.cluster import Cluster
from moeless.placement.shares import actual_shares
from moeless.placement.types import LayerPlacement, Placement

GB = 1e9
EXECUTIONS = ("serial", "paper")
BILLINGS = ("resident", "per-layer")


@dataclass(frozen=True)
class TwinSettings:
    """keep_alive_s: seconds an unplanned replica stays resident; distance: d, layers a forecast
    (and so a load) starts ahead; tier: where cold loads come from ("host" memory or "disk")."""

    keep_alive_s: float = 1.0
    distance: int = 1
    tier: str = "host"

    def __post_init__(self) -> None:
        if self.keep_alive_s < 0 or self.distance < 0:
            raise ValueError(f"keep_alive_s and distance must be >= 0, got {self.keep_alive_s}, {self.distance}")
        if self.tier not in ("host", "disk"):
            raise ValueError(f"tier must be 'host' or 'disk', got {self.tier!r}")


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


def replay(planner: Planner, iterations: Sequence[Iteration], forecasts: np.ndarray, cluster: Cluster,
           profile: CostProfile, settings: TwinSettings = TwinSettings(), progress=None) -> TwinRecord:
    """Replay `iterations` with `planner` seeing `forecasts` [I, L, E]; see the module docstring."""
    num_iter = len(iterations)
    forecasts = np.asarray(forecasts, dtype=np.float64)
    if num_iter == 0 or forecasts.shape[0] != num_iter:
        raise ValueError(f"need one forecast [L, E] per iteration: {num_iter} iterations, forecasts {forecasts.shape}")
    num_layers, num_experts = forecasts.shape[1:]
    num_gpus, slots = cluster.num_gpus, cluster.slots()
    model = profile.latency_model(settings.tier)
    load_s = model.cold_start
    times = np.array([it.time_s for it in iterations], dtype=np.float64)
    gaps = np.diff(times)
    window = np.append(gaps, np.median(gaps) if gaps.size else 0.0)
    shape = (num_iter, num_layers)
    rec = TwinRecord(times, window, np.array([it.phase for it in iterations]), *(np.zeros(shape) for _ in range(4)),
                     *(np.zeros(shape, dtype=np.int64) for _ in range(4)), np.zeros(shape), np.zeros(shape),
                     settings={"keep_alive_s": settings.keep_alive_s, "distance": settings.distance, "tier": settings.tier,
                               "load_s": load_s, "planner": planner.name, "num_experts": num_experts})
    # Resident replicas: last_planned[l, e, g] (NaN: not resident); planned[l, e, g]: in the current plan.
    last_planned = np.full((num_layers, num_experts, num_gpus), np.nan)
    static = Placement.static(num_layers, num_experts, num_gpus)
    for l, lp in enumerate(static.layers):
        last_planned[l, lp.expert, lp.gpu] = times[0]
    in_plan = ~np.isnan(last_planned)
    bytes_gb = cluster.expert_bytes / GB
    for i, it in enumerate(iterations):
        now = times[i]
        # 1. Expiry: unplanned replicas whose keep-alive ran out.
        expired = ~in_plan & (last_planned + settings.keep_alive_s <= now)
        rec.evictions[i] += expired.sum(axis=(1, 2))
        last_planned[expired] = np.nan
        # 2. Plan against what is resident.
        plan = planner(forecasts[i], cluster, _placement(last_planned, num_experts, num_gpus))
        actual = planner.lossy_load(it.load) if planner.lossy_load else it.load
        wanted = np.zeros_like(in_plan)
        for l, lp in enumerate(plan.layers):
            wanted[l, lp.expert, lp.gpu] = True
        # 3. Loads (making room), then time layer by layer with each GPU's loads in a queue.
        start, engine = 0.0, np.zeros(num_gpus)
        starts = np.zeros(num_layers)
        for l, lp in enumerate(plan.layers):
            starts[l] = start
            cold = wanted[l] & np.isnan(last_planned[l])
            per_gpu = cold.sum(axis=0)
            for e, g in zip(*np.nonzero(cold)):
                rec.evictions[i] += _make_room(last_planned, wanted, g, slots[g])
                last_planned[l, e, g] = now
            issued = starts[max(l - settings.distance, 0)]
            busy = per_gpu > 0
            engine[busy] = np.maximum(engine[busy], issued) + per_gpu[busy] * load_s
            done = float(engine[busy].max()) if busy.any() else 0.0
            rec.loads[i, l] = int(per_gpu.sum())
            rec.cold_s[i, l] = float(per_gpu.max()) * load_s
            rec.exposed_s[i, l] = max(done - start, 0.0)
            dispatch = 0.0
            if planner.relevels and lp.num_replicas > num_experts:
                lp, relevelled = actual_shares(np.rint(actual[l]).astype(np.int64), lp, model, num_gpus, profile.relevel_s)
                dispatch = profile.check_s + (profile.relevel_s if relevelled else 0.0)
            rec.serial_s[i, l] = model.layer_time(actual[l], lp, num_gpus, "serial") + dispatch
            rec.paper_s[i, l] = model.layer_time(actual[l], lp, num_gpus, "paper") + dispatch
            start += rec.serial_s[i, l] + rec.exposed_s[i, l]
            rec.planned[i, l] = lp.num_replicas
            rec.gb_s_per_layer[i, l] = (rec.serial_s[i, l] + rec.exposed_s[i, l]) * lp.num_replicas * bytes_gb
        # 4. The plan's replicas were used now; memory held until the next iteration (or expiry).
        last_planned[wanted] = now
        in_plan = wanted
        resident = ~np.isnan(last_planned)
        rec.resident[i] = resident.sum(axis=(1, 2))
        until = np.where(in_plan, now + window[i], np.minimum(now + window[i], last_planned + settings.keep_alive_s))
        rec.gb_s_resident[i] = np.where(resident, until - now, 0.0).sum(axis=(1, 2)) * bytes_gb
        if progress is not None:
            progress.update(1)
    rec.non_expert_gb_s = profile.non_expert_bytes / GB * float(window.sum())
    return rec


def _placement(last_planned: np.ndarray, num_experts: int, num_gpus: int) -> Placement:
    """The resident replicas as a Placement (even shares): [L] layers of (expert, gpu)."""
    layers = []
    for resident in ~np.isnan(last_planned):
        expert, gpu = np.nonzero(resident)
        layers.append(LayerPlacement.even(expert, gpu, num_experts))
    return Placement(tuple(layers), num_experts, num_gpus)


def _make_room(last_planned: np.ndarray, wanted: np.ndarray, gpu: int, slots: int) -> np.ndarray:
    """Evict (from GPU `gpu`) the unwanted replica planned longest ago if the GPU is full; returns
    the evictions per layer [L]."""
    held = ~np.isnan(last_planned[:, :, gpu])
    evicted = np.zeros(last_planned.shape[0], dtype=np.int64)
    if held.sum() < slots:
        return evicted
    idle = held & ~wanted[:, :, gpu]
    if not idle.any():
        raise RuntimeError(f"GPU {gpu} is full of planned replicas: the plan does not fit its {slots} slots")
    ages = np.where(idle, last_planned[:, :, gpu], np.inf)
    l, e = np.unravel_index(np.argmin(ages), ages.shape)
    last_planned[l, e, gpu] = np.nan
    evicted[l] += 1
    return evicted
