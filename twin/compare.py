"""Every planner replayed through the digital twin on the same iterations, every cost counted: the
comparison engine of `moeless bench planner` and `moeless eval`.

In: iterations (real per-request loads batched by request arrivals), the forecasts of each kind
(twin/forecasts.py), a cluster, the measured cost profile and the twin's settings. For every
prefetch distance d the runs are: static EP; the Oracle (lossy bound); EPLB re-planned every 10
iterations from the last 10 iterations' loads (DeepSeek's usage; it sees no forecast); and, with
each forecast kind (perfect, the previous iteration's loads, the predictor at d), EPLB re-planned
every iteration, the paper's planner, moeless-fill (an earlier generation, a named baseline) and moeless. moeless's
ablations run with the predictor at the first distance. EPLB gets the replicas moeless holds per
layer in the same condition (the smallest multiple of G at least its time-weighted resident
replicas). Every run is summarised for prefill, decode and all iterations (totals are time-weighted).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from moeless.twin.iterations import Iteration
from moeless.placement.planner import PlannerConfig, get_planner
from moeless.placement.profile import CostProfile
from moeless.twin.record import TwinRecord
from moeless.twin.twin import TwinSettings, replay
from moeless.placement.cluster import Cluster

FORECAST_PLANNERS = ("eplb", "paper", "moeless-fill", "moeless")  # replayed with every forecast kind
FIXED_PLANNERS = (("static", "perfect"), ("oracle", "perfect"), ("eplb-window", "previous"))  # forecast-blind
ABLATIONS = ("moeless-no-scaler", "moeless-no-placer", "moeless-no-moves", "moeless-cold", "moeless-free-memory", "moeless-greedy")
PHASES = ("prefill", "decode", "all")


@dataclass(frozen=True)
class Run:
    """One replay: a planner fed one forecast kind, loads started d layers ahead."""

    planner: str
    forecast: str
    distance: int

    @property
    def key(self) -> str:
        return f"{self.planner}|{self.forecast}|d={self.distance}"


def plan_runs(distances: Sequence[int], kinds: Sequence[str], ablations: bool = True) -> list[Run]:
    """Every run of the benchmark, moeless's before EPLB's (EPLB's budget is moeless's memory)."""
    runs = []
    for d in distances:
        runs += [Run(p, f, d) for p, f in FIXED_PLANNERS if p != "eplb-window"]
        runs += [Run(p, k, d) for p in ("moeless", *(p for p in FORECAST_PLANNERS if p != "moeless")) for k in kinds]
        runs.append(Run("eplb-window", "previous", d))
    if ablations:
        runs += [Run(p, "predictor" if "predictor" in kinds else kinds[-1], distances[0]) for p in ABLATIONS]
    return runs


def run_all(runs: Sequence[Run], iterations: Sequence[Iteration], forecasts: dict[tuple[str, int], np.ndarray],
            cluster: Cluster, profile: CostProfile, config: PlannerConfig, settings: TwinSettings,
            progress=None) -> dict[Run, TwinRecord]:
    """Replay every run. forecasts[(kind, d)]: [I, L, E]; config: the planners' knobs (its
    prefetch_layers and eplb_replicas are set per run)."""
    records: dict[Run, TwinRecord] = {}
    for run in runs:
        knobs = replace(config, prefetch_layers=run.distance)
        if run.planner.startswith("eplb") and run.planner != "eplb-production":  # production EPLB: its own N
            knobs = replace(knobs, eplb_replicas=_eplb_budget(records, run, cluster))
        record = replay(get_planner(run.planner, knobs), iterations, forecasts[(run.forecast, run.distance)], cluster,
                        profile, replace(settings, distance=run.distance), progress)
        records[run] = record
    return records


def _eplb_budget(records: dict[Run, TwinRecord], run: Run, cluster: Cluster) -> int:
    """The smallest multiple of G at least moeless's time-weighted resident replicas per layer in
    the same condition (the predictor's at that distance for EPLB-window), at most the largest
    multiple of G that every layer's slots hold."""
    kind = "predictor" if run.forecast == "previous" and run.planner == "eplb-window" else run.forecast
    same = [r for k, r in records.items() if k.planner == "moeless" and k.distance == run.distance]
    match = [r for k, r in records.items() if k.planner == "moeless" and k.distance == run.distance and k.forecast == kind]
    record = (match or same)[0]
    held = record.summary()["resident_time_weighted"]
    num_experts, num_gpus = record.settings["num_experts"], cluster.num_gpus
    fits = int(cluster.slots().sum()) // record.serial_s.shape[1] // num_gpus * num_gpus
    return max(num_experts, min(-(-int(np.ceil(held - 1e-9)) // num_gpus) * num_gpus, fits))


def summarise(records: dict[Run, TwinRecord]) -> dict:
    """Per run key, per phase: the twin's summary plus ratios to static EP at the same distance
    (layer times with exposed cold starts, total time, time-weighted resident replicas)."""
    out: dict = {}
    for run, record in records.items():
        static = next(r for k, r in records.items() if k.planner == "static" and k.distance == run.distance)
        row = {}
        for phase in PHASES:
            mask = None if phase == "all" else record.phase == phase
            mine, base = record.summary(mask), static.summary(mask)
            if mine["iterations"] == 0:
                continue
            for key in ("serial_s", "serial_cold_s", "paper_s", "paper_cold_s", "total_serial_cold_s", "resident_time_weighted",
                        "gb_s_resident", "gb_s_per_layer"):
                mine[f"{key}_vs_static"] = mine[key] / base[key] if base[key] > 0 else float("nan")
            row[phase] = mine
        row["non_expert_gb_s"] = record.non_expert_gb_s
        out[run.key] = row
    return out
