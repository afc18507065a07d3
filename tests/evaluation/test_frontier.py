"""The frontier of a cell (evaluation/frontier.py): a way of spending memory that does not fit the
cluster is reported as such, with the reason, and the other points still run."""

from __future__ import annotations

import numpy as np

from moeless.evaluation.deployment_report import _frontier
from moeless.evaluation.frontier import frontier_cell, frontier_points, frontier_rows
from moeless.placement.cluster import Cluster
from moeless.placement.planner import PlannerConfig
from moeless.placement.profile import CostProfile
from moeless.twin.iterations import Iteration
from moeless.twin.twin import TwinSettings

PROFILE = CostProfile(alpha=1e-6, beta=0.0, call_overhead=1e-6, load_s={"disk": 1e-3, "host": 1e-4},
                      expert_bytes=10**6, non_expert_bytes=10**6, relevel_s=1e-6, source="a test")
L, E, G = 2, 4, 2


def test_a_point_that_does_not_fit_says_why_and_the_others_run():
    rng = np.random.default_rng(0)
    its = [Iteration("prefill" if i % 2 else "decode", rng.integers(0, 30, (L, E)), 1, (), 0.05 * i) for i in range(12)]
    loads = np.stack([it.load for it in its]).astype(np.float64)
    forecasts = {(kind, 1): loads for kind in ("history", "previous", "perfect")}
    cluster = Cluster.uniform(G, L * E // G, PROFILE.expert_bytes, E)  # static EP's blocks and not one slot more
    config = PlannerConfig(model=PROFILE.latency_model(), iteration_s=0.05)
    seconds = np.full((len(its), L), 1e-5)
    frontier = frontier_cell(its, forecasts, cluster, PROFILE, config, TwinSettings(), 1.0,
                             {"bound": seconds, "offline": seconds, "hindsight": seconds})
    assert set(frontier) == {key for key, *_ in frontier_points(E, G)} | {"bound", "offline", "hindsight"}
    unfit = {key for key, point in frontier.items() if "unfit" in point}
    assert unfit == {"eplb-production-2"} and "slots on a GPU" in frontier["eplb-production-2"]["unfit"]
    cell = {"model": "m", "gpu": "H100", "count": G, "workload": "w", "frontier": frontier}
    rows = frontier_rows(cell)
    assert {r["point"] for r in rows} == set(frontier) - unfit and {r["phase"] for r in rows} == {"prefill", "decode"}
    table = "\n".join(_frontier([cell]))
    assert "| production EPLB, N = 2 | does not fit: EPLB with 6 replicas per layer" in table
    assert "| hindsight homes |" in table
