"""The RemoteExecutor's per-call shares on the layer's actual loads (`relevel_for`): the rule the
planner asks for (placement.planner.relevels) and the twin prices (placement/shares.py, behind
placement/check_gate.py)."""

from __future__ import annotations

from typing import Callable

import numpy as np

from moeless.model.interface import Routing
from moeless.placement.check_gate import CheckGate
from moeless.placement.latency_model import LatencyModel
from moeless.placement.shares import Routed, actual_shares
from moeless.placement.types import LayerPlacement
from moeless.serving.executor import Relevel

PairingCost = Callable[[int, int, int], float]  # (replicas, experts, hosts) -> seconds: CostProfile.relevel_for


def relevel_for(model: LatencyModel, cost_s: float | PairingCost, split: bool = True, gate: CheckGate | None = None,
                phase: Callable[[], str] = lambda: "prefill") -> Relevel:
    """The RemoteExecutor's per-call shares on the layer's actual tokens per expert
    (`actual_shares`: re-levelled where that can save more than cost_s, the pairing's own seconds,
    else the better of the planned shares and static EP's split), the rule the twin prices it by;
    cost_s: seconds, or the profile's relevel_for (they grow with the layer's replicas);
    split=False: whole experts only (the hosts' kernel is not split-exact); gate: the twin's
    per-layer, per-phase gate in front of the check (phase() names the batch's phase)."""

    def relevel(layer: int, placement: LayerPlacement, routing: Routing, num_hosts: int) -> LayerPlacement:
        num_experts = int(placement.expert.max()) + 1
        pairing_s = cost_s(placement.num_replicas, num_experts, num_hosts) if callable(cost_s) else cost_s
        return routed_shares(placement, routing, num_hosts, model, pairing_s, split, gate, layer, phase()).layer

    return relevel


def routed_shares(placement: LayerPlacement, routing: Routing, num_hosts: int, model: LatencyModel, cost_s: float,
                  split: bool = True, gate: CheckGate | None = None, layer: int = 0, phase: str = "prefill") -> Routed:
    """`actual_shares` on the tokens per expert the gate's routing gives this layer call (behind
    `gate`, layer `layer`'s in `phase`, where one is given)."""
    load = _call_load(placement, routing)
    if gate is None:
        return actual_shares(load, placement, model, num_hosts, cost_s, split)
    return gate.route(layer, phase, load, placement, model, num_hosts, cost_s, split)


def _call_load(placement: LayerPlacement, routing: Routing) -> np.ndarray:
    """[E] tokens per expert of this layer call, E the placement's experts."""
    return np.bincount(routing.idx.numpy().reshape(-1), minlength=int(placement.expert.max()) + 1)
