"""Plan every layer of a placement in turn, one layer's plan at a time (placement/planner.py's
planners share it): later layers get the memory earlier ones left."""

from __future__ import annotations

from typing import Callable

import numpy as np

from moeless.placement.cluster import Cluster
from moeless.placement.types import LayerPlacement, Placement, PlacementError

# A whole plan of one layer: (load [E], free slots [G], previous layer, budget) -> (layer, free slots [G]).
LayerPlan = Callable[[np.ndarray, np.ndarray, "LayerPlacement | None", "int | None"], tuple[LayerPlacement, np.ndarray]]


def plan_layers(forecast: np.ndarray, cluster: Cluster, previous: Placement | None, plan_layer: LayerPlan) -> Placement:
    """Plan every layer in turn; later layers get the memory earlier ones left.

    forecast: [L, E] (or [L, B, E]: a layer's samples); previous: the placement now resident (its
    replicas are warm), or None.
    """
    num_layers, num_experts = forecast.shape[0], forecast.shape[-1]
    cluster.check_fits(num_layers, num_experts)
    if previous is not None and (previous.num_layers, previous.num_experts) != (num_layers, num_experts):
        raise PlacementError(
            f"previous placement is {previous.num_layers} x {previous.num_experts}, the forecast {num_layers} x {num_experts}"
        )
    free = cluster.slots()
    cap = cluster.layer_replica_cap()
    layers = []
    for l in range(num_layers):
        # 1. The layer's budget: its memory cap, keeping a slot for every later layer's experts.
        budget = int(free.sum()) - num_experts * (num_layers - l - 1)
        budget = budget if cap is None else min(budget, cap)
        before = previous.layers[l] if previous is not None else None
        # 2. Replica counts, their GPUs and shares.
        layer, free = plan_layer(forecast[l], free, before, budget)
        layers.append(layer)
    return Placement(tuple(layers), num_experts, cluster.num_gpus)
