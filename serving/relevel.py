"""The RemoteExecutor's per-call shares on the layer's actual loads (`relevel_for`): the rule the
planner asks for (placement.planner.relevels) and the twin prices (placement/shares.py)."""

from __future__ import annotations

import numpy as np

from moeless.model.interface import Routing
from moeless.placement.latency_model import LatencyModel
from moeless.placement.shares import Routed, actual_shares
from moeless.placement.types import LayerPlacement
from moeless.serving.executor import Relevel


def relevel_for(model: LatencyModel, cost_s: float, split: bool = True) -> Relevel:
    """The RemoteExecutor's per-call shares on the layer's actual tokens per expert
    (`actual_shares`: re-levelled where that can save more than cost_s, the profile's relevel_s,
    else the better of the planned shares and static EP's split), the rule the twin prices it by;
    split=False: whole experts only (the hosts' kernel is not split-exact)."""

    def relevel(layer: int, placement: LayerPlacement, routing: Routing, num_hosts: int) -> LayerPlacement:
        return routed_shares(placement, routing, num_hosts, model, cost_s, split).layer

    return relevel


def routed_shares(placement: LayerPlacement, routing: Routing, num_hosts: int, model: LatencyModel, cost_s: float,
                  split: bool = True) -> Routed:
    """`actual_shares` on the tokens per expert the gate's routing gives this layer call."""
    num_experts = int(placement.expert.max()) + 1
    load = np.bincount(routing.idx.numpy().reshape(-1), minlength=num_experts)
    return actual_shares(load, placement, model, num_hosts, cost_s, split)
