"""A layer's shares on the loads it actually got, once the gate has run: what a serving replica
routes each MoE-layer call with and the twin prices it by (microseconds; free, since every
replica is resident). `relevel_layer` re-levels them; `actual_shares` re-levels only where that
can pay, else routes the better of the planned and static EP's split. moeless's planner
(placement/resident_planner.py) re-levels its plans with the same kernels.
"""

from __future__ import annotations

import numpy as np

from moeless.placement import kernels, resident_kernels
from moeless.placement.latency_model import LatencyModel
from moeless.placement.types import LayerPlacement

GAIN_EPSILON_S = 1e-12  # a gain must beat its cost by more than rounding


def relevel_layer(load: np.ndarray, layer: LayerPlacement, model: LatencyModel, num_gpus: int) -> LayerPlacement:
    """The layer's replicas with shares re-levelled for the load it actually got: what a serving
    replica does per MoE layer once the gate has run (microseconds; free, since every replica is
    resident). load: [E] whole tokens per expert -> the same replicas (expert, gpu), new shares.

    Experts water-filled over their replicas least-loaded GPU first (`kernels.reshare`), whole
    tokens, then the busiest GPU's experts re-levelled while that shortens the layer
    (`resident_kernels.relevel`); replicas may get no token; an expert without tokens routes to
    its first replica. One replica per expert: nothing to re-level, the layer comes back as is. An
    expert twice on one GPU (EPLB's packing can do that) is one replica there: the first takes its
    tokens, the others none.
    """
    num_experts = load.shape[0]
    if layer.num_replicas == num_experts:
        return layer
    pair = layer.expert * num_gpus + layer.gpu
    _, first, which = np.unique(pair, return_index=True, return_inverse=True)
    if first.shape[0] < layer.num_replicas:
        once = relevel_layer(load, LayerPlacement(layer.expert[first], layer.gpu[first],
                                                  np.bincount(which, weights=layer.share)), model, num_gpus)
        share = np.zeros(layer.num_replicas)
        share[first] = once.share
        return LayerPlacement(layer.expert, layer.gpu, share)
    tokens_in = np.asarray(load, dtype=np.int64)
    expert, gpu = layer.expert, layer.gpu
    tokens = kernels.largest_remainder(tokens_in, expert, kernels.reshare(tokens_in.astype(np.float64), expert, gpu,
                                                                          model.call_tokens, num_gpus))
    relevel_tokens(tokens_in, expert, gpu, tokens, num_gpus, model)
    return routable(LayerPlacement(expert, gpu, token_shares(tokens, tokens_in[expert])), num_experts)


def actual_shares(load: np.ndarray, layer: LayerPlacement, model: LatencyModel, num_gpus: int,
                  relevel_s: float) -> tuple[LayerPlacement, bool]:
    """The shares a serving replica routes one layer's actual loads with, once its gate has run:
    the same rule in the twin and in the data plane. load: [E] whole tokens per expert.

    A check (`resident_kernels.route_check`, 2-3.5 us measured) times the planned shares and the
    unsplit ones (each expert on its first replica: static EP's split, since a moeless plan lists
    its home replicas first) and bounds what any split can reach. A re-level runs where the most it
    can save over the better of the two beats relevel_s, its own seconds; otherwise the better of
    the two is routed, so a forecast that split the wrong expert costs the check, not the miss.
    One replica per expert: nothing to choose, no check. Returns (shares, whether it re-levelled).
    """
    if layer.num_replicas == load.shape[0]:
        return layer, False
    planned_s, unsplit_s, floor_s, unsplit_share = resident_kernels.route_check(
        np.asarray(load, dtype=np.int64), layer.expert, layer.gpu, layer.share, num_gpus,
        model.alpha, model.call_overhead, model.beta)
    if min(planned_s, unsplit_s) - floor_s > relevel_s:
        return relevel_layer(load, layer, model, num_gpus), True
    if unsplit_s < planned_s:
        return LayerPlacement(layer.expert, layer.gpu, unsplit_share), False
    return layer, False


def routable(layer: LayerPlacement, num_experts: int) -> LayerPlacement:
    """Every expert with a share summing to 1: an expert without tokens routes to its first replica."""
    share = layer.share.copy()
    missing = np.bincount(layer.expert, weights=share, minlength=num_experts) == 0
    if missing.any():
        experts, first = np.unique(layer.expert, return_index=True)
        share[first[missing[experts]]] = 1.0
    return LayerPlacement(layer.expert, layer.gpu, share)


def relevel_tokens(tokens_in: np.ndarray, expert, gpu, tokens, num_gpus, model: LatencyModel) -> float:
    """Re-level tokens [R] (in place) over fixed replicas; returns the layer time."""
    return resident_kernels.relevel(tokens_in, expert, gpu, tokens, num_gpus, model.call_tokens, model.alpha,
                                    model.call_overhead, model.beta, GAIN_EPSILON_S)


def token_shares(tokens: np.ndarray, expert_tokens: np.ndarray) -> np.ndarray:
    return np.divide(tokens, expert_tokens, out=np.zeros(tokens.shape[0]), where=expert_tokens > 0)
