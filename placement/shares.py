"""A layer's shares on the loads it actually got, once the gate has run: what a serving replica
routes each MoE-layer call with and the twin prices it by (microseconds; free, since every
replica is resident). `actual_shares` pairs the batch with the replicas (placement/dispatch.py)
only where that can pay, else routes the better of the planned and static EP's split. moeless's
planner (placement/resident_planner.py) re-levels its plans with `relevel_tokens`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from moeless.placement import resident_kernels
from moeless.placement.dispatch import pair_tokens
from moeless.placement.latency_model import LatencyModel
from moeless.placement.types import LayerPlacement

GAIN_EPSILON_S = 1e-12  # a gain must beat its cost by more than rounding


class Routed(NamedTuple):
    """A layer call's shares: the layer (replicas, shares), whether the batch was paired with the
    replicas (placement/dispatch.py), whether the check ran (what the call paid: relevel_s if
    paired, check_s if checked), and what the check reckons its choice saves over static EP's
    split, net of relevel_s (a pairing counted at its bound, the most it can save)."""

    layer: LayerPlacement
    paired: bool
    checked: bool
    saved_s: float = 0.0


def actual_shares(load: np.ndarray, layer: LayerPlacement, model: LatencyModel, num_gpus: int,
                  relevel_s: float, split: bool = True) -> Routed:
    """The shares a serving replica routes one layer's actual loads with, once its gate has run:
    the same rule in the twin and in the data plane. load: [E] whole tokens per expert.

    A check (`resident_kernels.route_check`, 2-3.5 us measured) times the planned shares and the
    unsplit ones (each expert on its first replica: static EP's split, since a moeless plan lists
    its home replicas first) and bounds what any split can reach. The pairing runs where the most it can save over the better of the two beats relevel_s, its own seconds;
    otherwise the better of the two is routed, so a forecast that split the wrong expert costs the
    check, not the miss. One replica per expert: nothing to choose, no check. split=False: every
    expert's tokens stay on one replica (the pairing moves whole experts; a plan that splits one is
    not routed: static EP's split is), for hosts where a part of an expert's rows would round
    differently (hardware/host_profile.split_exact).
    """
    if layer.num_replicas == load.shape[0]:
        return Routed(layer, False, False)
    planned_s, unsplit_s, floor_s, unsplit_share = resident_kernels.route_check(
        np.asarray(load, dtype=np.int64), layer.expert, layer.gpu, layer.share, num_gpus,
        model.alpha, model.call_overhead, model.beta)
    if not split and (np.bincount(layer.expert, weights=layer.share > 0) > 1).any():
        planned_s = np.inf  # the plan splits an expert: not routable here
    if min(planned_s, unsplit_s) - floor_s > relevel_s:
        return Routed(pair_tokens(load, layer, model, num_gpus, split), True, True, unsplit_s - floor_s - relevel_s)
    if unsplit_s < planned_s:
        return Routed(LayerPlacement(layer.expert, layer.gpu, unsplit_share), False, True)
    return Routed(layer, False, True, unsplit_s - planned_s)


def routable(layer: LayerPlacement, num_experts: int) -> LayerPlacement:
    """Every expert with a share summing to 1: an expert without tokens routes to its first replica."""
    share = layer.share.copy()
    missing = np.bincount(layer.expert, weights=share, minlength=num_experts) == 0
    if missing.any():
        experts, first = np.unique(layer.expert, return_index=True)
        share[first[missing[experts]]] = 1.0
    return LayerPlacement(layer.expert, layer.gpu, share)


def with_stand_ins(layer: LayerPlacement, usable: np.ndarray, resident: np.ndarray) -> tuple[LayerPlacement, np.ndarray]:
    """The layer plus, for each expert none of whose planned replicas is usable ([R] bool), its
    replicas resident off the plan (resident: [E, G] bool) with no share, usable: they stand in
    (a move's old home serves until the new one has landed). Returns (layer, usable [R'])."""
    lacking = np.bincount(layer.expert[usable], minlength=resident.shape[0]) == 0
    extra_e, extra_g = np.nonzero(resident & lacking[:, None])
    if not extra_e.size:
        return layer, usable
    return (LayerPlacement(np.concatenate([layer.expert, extra_e]), np.concatenate([layer.gpu, extra_g]),
                           np.concatenate([layer.share, np.zeros(extra_e.shape[0])])),
            np.concatenate([usable, np.ones(extra_e.shape[0], dtype=bool)]))


def landed(layer: LayerPlacement, usable: np.ndarray, num_experts: int) -> LayerPlacement:
    """The layer on its usable replicas only (usable: [R] bool; each expert keeps at least one),
    each expert's shares scaled back to 1 over them."""
    expert, gpu, share = layer.expert[usable], layer.gpu[usable], layer.share[usable]
    total = np.bincount(expert, weights=share, minlength=num_experts)
    return routable(LayerPlacement(expert, gpu, token_shares(share, total[expert])), num_experts)


def relevel_tokens(tokens_in: np.ndarray, expert, gpu, tokens, num_gpus, model: LatencyModel) -> float:
    """Re-level tokens [R] (in place) over fixed replicas; returns the layer time."""
    return resident_kernels.relevel(tokens_in, expert, gpu, tokens, num_gpus, model.call_tokens, model.alpha,
                                    model.call_overhead, model.beta, GAIN_EPSILON_S)


def token_shares(tokens: np.ndarray, expert_tokens: np.ndarray) -> np.ndarray:
    return np.divide(tokens, expert_tokens, out=np.zeros(tokens.shape[0]), where=expert_tokens > 0)
