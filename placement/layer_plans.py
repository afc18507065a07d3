"""Plan every layer of a placement in turn, one layer's plan at a time (placement/planner.py's
planners share it): later layers get the memory earlier ones left."""

from __future__ import annotations

from typing import Callable

import numpy as np

from moeless.placement.cluster import Cluster
from moeless.placement.types import LayerPlacement, Placement, PlacementError

# A whole plan of one layer: (load [E], free slots [G], previous layer, budget) -> (layer, free slots [G]).
LayerPlan = Callable[[np.ndarray, np.ndarray, "LayerPlacement | None", "int | None"], tuple[LayerPlacement, np.ndarray]]


def plan_layers(forecast: np.ndarray, cluster: Cluster, previous: Placement | None, plan_layer: LayerPlan,
                homes: np.ndarray | None = None) -> Placement:
    """Plan every layer in turn; later layers get the memory earlier ones left.

    forecast: [L, E] (or [L, B, E]: a layer's samples); previous: the placement now resident (its
    replicas are warm), or None; homes: [L, E] each expert's home GPU, or None. With homes, a
    layer's plan also leaves each GPU the slots of the later layers' homes on it: the totals alone
    let early layers fill a GPU that a later layer's home needs, which then loads its expert
    elsewhere, cold, and waits for it (the last layer, with memory free: +10% in decode).
    """
    num_layers, num_experts = forecast.shape[0], forecast.shape[-1]
    cluster.check_fits(num_layers, num_experts)
    if previous is not None and (previous.num_layers, previous.num_experts) != (num_layers, num_experts):
        raise PlacementError(
            f"previous placement is {previous.num_layers} x {previous.num_experts}, the forecast {num_layers} x {num_experts}"
        )
    free = cluster.slots()
    cap = cluster.layer_replica_cap()
    later = _later_homes(homes, num_layers, cluster.num_gpus)
    layers = []
    for l in range(num_layers):
        # 1. The layer's budget: its memory cap, keeping a slot for every later layer's experts
        #    (on its home's GPU, where the homes are known).
        budget = int(free.sum()) - num_experts * (num_layers - l - 1)
        budget = budget if cap is None else min(budget, cap)
        kept = np.minimum(later[l], free)
        before = previous.layers[l] if previous is not None else None
        # 2. Replica counts, their GPUs and shares.
        layer, left = plan_layer(forecast[l], free - kept, before, budget)
        free = left + kept
        layers.append(layer)
    return Placement(tuple(layers), num_experts, cluster.num_gpus)


def _later_homes(homes: np.ndarray | None, num_layers: int, num_gpus: int) -> np.ndarray:
    """[L, G]: per layer, the homes the layers after it keep on each GPU (zeros without homes)."""
    if homes is None:
        return np.zeros((num_layers, num_gpus), np.int64)
    per_layer = np.stack([np.bincount(h, minlength=num_gpus) for h in np.asarray(homes, np.int64)])
    after = np.cumsum(per_layer[::-1], axis=0)[::-1]  # [L, G]: layers l.. together
    return np.concatenate([after[1:], np.zeros((1, num_gpus), np.int64)])
