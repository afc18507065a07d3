"""The frontier of a deployment cell: MoE-layer time against expert GB·s, one point per way of
spending memory, so a user reads off what each extra GB buys (issue 43, item 5).

Points, each replayed through the twin on the cell's iterations (serial execution, resident
billing, every cost paid: loads, moves, the data plane's pairing):
- static EP (Megatron-LM): every expert once, no extra memory;
- production EPLB (placement/eplb_production.py) with N redundant experts per layer, N in
  {0, E/8, E/4} (each rounded up so that every GPU holds as many slots): rebalanced every 1000 iterations on past loads, moves behind serving;
- moeless (the default planner, its own forecast: the history window) at memory prices
  x {0, 0.1, 1, 10} of the deployment's memory-neutral price; and moeless-sets (copies chosen
  for dispatch room per GB on the phase's recent batches) at the same prices;
- full replication (placement/full_replication.py): every GPU holds every expert of the layers
  that fit, each batch paired: the memory-is-free reference;
and, without memory of their own, the offline reference and the hindsight homes (twin/reference.py:
EPLB on each iteration's own loads with free moves; fixed homes fitted on the run's other batches)
and the lossless bound (twin/bound.py). Each point per phase: mean seconds per layer and GB·s, both also against
static EP's, and the share of the bound's gain.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from moeless.placement.cluster import Cluster
from moeless.placement.eplb_production import production_replicas
from moeless.placement.planner import PlannerConfig
from moeless.placement.types import PlacementError
from moeless.twin.compare import Run, run_all
from moeless.twin.iterations import Iteration
from moeless.twin.twin import TwinSettings

PRICES = (0.0, 0.1, 1.0, 10.0)  # x the memory-neutral price
LABELS = {"hindsight": "hindsight homes"}  # the references' labels where not their keys
PHASES = ("prefill", "decode")


def frontier_points(num_experts: int, num_gpus: int) -> list[tuple[str, str, str, dict]]:
    """(key, label, planner, config overrides) of every point that holds memory of its own; the
    memory price is given as a factor ("price_factor") the caller turns into seconds per GB·s.
    Production EPLB's N is what it really holds: E + N rounded up to fill every GPU alike (as
    SGLang requires), so two asked-for N that round alike are one point."""
    points = [("static", "static EP", "static", {})]
    held = {production_replicas(num_experts, n, num_gpus) - num_experts for n in (0, num_experts // 8, num_experts // 4)}
    for n in sorted(held):
        points.append((f"eplb-production-{n}", f"production EPLB, N = {n}", "eplb-production", {"eplb_redundant": n}))
    for planner in ("moeless", "moeless-sets"):
        for factor in PRICES:
            points.append((f"{planner}-x{factor:g}", f"{planner}, price x{factor:g}", planner, {"price_factor": factor}))
    points.append(("full-replication", "full replication", "full-replication", {}))
    return points


def frontier_cell(iterations: Sequence[Iteration], forecasts: dict, cluster: Cluster, profile, base: PlannerConfig,
                  settings: TwinSettings, neutral_price: float, bounds: dict[str, np.ndarray], progress=None) -> dict:
    """Every point replayed (the forecast kind: "history" for moeless, "previous" for EPLB, whose
    entry at i is the loads of i - 1, "perfect" for the forecast-blind) and summarised per phase,
    with the bound and the references (bounds: name -> [I, L] seconds). A point whose
    layout does not fit the cluster (production EPLB's E + N on GPUs too small) has no phases and
    says why ("unfit")."""
    d = settings.distance
    num_experts = iterations[0].load.shape[1]
    phase = np.array([it.phase for it in iterations])
    out: dict = {}
    for key, label, planner, extra in frontier_points(num_experts, cluster.num_gpus):
        extra = dict(extra)
        factor = extra.pop("price_factor", None)
        config = replace(base, **extra, **({} if factor is None else {"gb_s_price": neutral_price * factor}))
        kind = "history" if planner.startswith("moeless") else "previous" if planner.startswith("eplb") else "perfect"
        try:
            record = run_all([Run(planner, kind, d)], iterations, forecasts, cluster, profile, config, settings,
                             progress)[Run(planner, kind, d)]
        except PlacementError as err:  # this way of spending memory does not fit the cluster: said, not run
            out[key] = {"label": label, "planner": planner, "phases": {}, "unfit": str(err)}
            continue
        time, gb_s = record.layer_time("serial"), record.gb_s("resident")
        out[key] = {"label": label, "planner": planner, "phases": {p: {"mean_s": float(time[phase == p].mean()),
                                                                       "gb_s": float(gb_s[phase == p].sum())}
                                                                   for p in PHASES if (phase == p).any()}}
    for name, seconds in bounds.items():
        out[name] = {"label": LABELS.get(name, name), "planner": None,
                     "phases": {p: {"mean_s": float(seconds[phase == p].mean()), "gb_s": None}
                                for p in PHASES if (phase == p).any()}}
    return out


def frontier_rows(cell: dict) -> list[dict]:
    """The cell's points per phase, against static EP: time and GB·s ratios, share of the bound's gain."""
    rows = []
    frontier = cell["frontier"]
    for p in PHASES:
        static, bound = frontier["static"]["phases"].get(p), frontier["bound"]["phases"].get(p)
        if static is None:
            continue
        gap = static["mean_s"] - bound["mean_s"]
        for key, point in frontier.items():
            f = point["phases"].get(p)
            if f is None:  # a point that does not fit the cluster
                continue
            rows.append({"model": cell["model"], "gpu": f"{cell['count']}x{cell['gpu']}", "workload": cell["workload"],
                         "phase": p, "point": key, "label": point["label"], "mean_ms": 1e3 * f["mean_s"],
                         "vs_static": f["mean_s"] / static["mean_s"],
                         "gb_s_vs_static": None if f["gb_s"] is None else f["gb_s"] / static["gb_s"],
                         "share_of_bound_gain": (static["mean_s"] - f["mean_s"]) / gap if gap > 0 else None})
    return rows
