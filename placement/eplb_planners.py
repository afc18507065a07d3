"""DeepSeek's EPLB as planners: on the forecast ("eplb", "eplb-global") and re-planned every period
from a window of past loads ("eplb-window"); and the memory check of fixed layouts."""

from __future__ import annotations

from collections import deque
from typing import Callable

import numpy as np

from moeless.placement.cluster import Cluster
from moeless.placement.eplb import rebalance_experts
from moeless.placement.planner_config import PlannerConfig
from moeless.placement.types import Placement, PlacementError


def plan_eplb(global_only: bool) -> Callable:
    def plan(forecast: np.ndarray, cluster: Cluster, previous: Placement | None, config: PlannerConfig) -> Placement:
        """DeepSeek's EPLB on the forecast, with config.eplb_replicas replicas per layer."""
        num_experts, num_gpus = forecast.shape[1], cluster.num_gpus
        replicas = config.eplb_replicas or -(-num_experts // num_gpus) * num_gpus
        groups, nodes = (1, 1) if global_only else (config.eplb_groups, config.eplb_nodes)
        phy2log, _, _ = rebalance_experts(forecast, replicas, groups, nodes, num_gpus)
        placement = Placement.from_eplb(phy2log, num_experts, num_gpus)
        check_memory(placement, cluster)
        return placement

    return plan


def plan_eplb_window() -> Callable:
    """A fresh stateful EPLB that only sees past loads (one per Planner: it keeps a history and its plan)."""
    history: deque[np.ndarray] = deque()
    calls = [0]
    last: list[Placement] = []
    eplb = plan_eplb(global_only=False)

    def plan(forecast: np.ndarray, cluster: Cluster, previous: Placement | None, config: PlannerConfig) -> Placement:
        """EPLB re-planned every eplb_period calls from the summed loads of the last eplb_window
        calls; before any history it balances uniform loads. Between re-plans it keeps its own
        last plan (what is resident may hold more)."""
        due = calls[0] % config.eplb_period == 0 or not last
        window = np.sum(history, axis=0) if history else np.ones_like(forecast)
        calls[0] += 1
        history.append(forecast)
        while len(history) > config.eplb_window:
            history.popleft()
        if due:
            last[:] = [eplb(window, cluster, previous, config)]
        return last[0]

    return plan


def check_memory(placement: Placement, cluster: Cluster) -> None:
    held = np.zeros(cluster.num_gpus, dtype=np.int64)
    for layer in placement.layers:
        held += np.bincount(layer.gpu, minlength=cluster.num_gpus)
    over = np.flatnonzero(held > cluster.slots())
    if over.size:
        raise PlacementError(f"GPUs {over.tolist()} cannot hold their replicas ({held[over].tolist()} > {cluster.slots()[over].tolist()} slots)")
