"""Full replication: every GPU holds every expert of the layers that fit, each batch paired at
dispatch (dispatch.py). The memory-is-free reference of the frontier: what dispatch-time pairing
reaches when copies cost nothing, against which a planner's copies per GB are read.

Layers are filled in order while every GPU has a slot per expert (a layer is replicated whole or
not at all); the others keep static EP's blocks. Each expert's home (static EP's GPU) is listed
first with share 1, its copies after it with share 0: the data plane's pairing moves tokens.
"""

from __future__ import annotations

import numpy as np

from moeless.placement.cluster import Cluster
from moeless.placement.types import LayerPlacement, Placement


def plan_full_replication(forecast: np.ndarray, cluster: Cluster, previous: Placement | None, config) -> Placement:
    """The plan function (forecast [L, E] only gives the shape): see the module docstring."""
    num_layers, num_experts = forecast.shape
    num_gpus = cluster.num_gpus
    cluster.check_fits(num_layers, num_experts)
    free = cluster.slots().copy()
    cap = cluster.layer_replica_cap()
    home = np.arange(num_experts) * num_gpus // num_experts
    layers = []
    for l in range(num_layers):
        later = num_experts * (num_layers - l - 1)  # static EP's slots kept for every later layer
        whole = (free - num_experts >= np.ceil(later / num_gpus)).all() and (cap is None or cap >= num_experts * num_gpus)
        if whole:
            expert = np.concatenate([np.arange(num_experts), np.repeat(np.arange(num_experts), num_gpus - 1)])
            gpu = np.concatenate([home, [g for e in range(num_experts) for g in range(num_gpus) if g != home[e]]])
            share = np.concatenate([np.ones(num_experts), np.zeros(num_experts * (num_gpus - 1))])
        else:
            expert, gpu, share = np.arange(num_experts), home, np.ones(num_experts)
        free -= np.bincount(gpu, minlength=num_gpus)
        layers.append(LayerPlacement(expert, np.asarray(gpu, np.int64), share))
    return Placement(tuple(layers), num_experts, num_gpus)
