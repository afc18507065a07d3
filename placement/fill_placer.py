"""moeless's default planner for one layer: the lowest per-GPU work level its experts fit under.

A GPU's work is the sum over its replicas of tokens + c, with c the per-call overhead in tokens
(replicas on one GPU run one after another). For a level M, `fill` walks the experts and fills
GPU after GPU up to M, cutting an expert that does not fit into whole-token pieces, one replica
per piece (McNaughton's wrap-around rule, paying a call per piece). The fill is within about one
call of the level a perfect split would reach, so bisection on M (`lowest_level`) decides the
replica counts and the placement together: an expert gets more replicas exactly where its tokens
would otherwise hold a GPU above the level.

Warm replicas are priced with the latency model, as every cold start is:
1. experts are walked in the order the previous placement holds them, so a fill at a similar
   level cuts them into similar groups;
2. each group (bin) goes to the GPU where most of its replicas are already warm;
3. the whole plan replaces the previous one only when the layer time it saves, over `horizon`
   iterations, outweighs its cold starts (those of the GPU that loads the most); else the
   previous replicas stay and only the token shares change.

Tiny example (a call costs 1 token, 2 GPUs with 4 free slots each, loads [10, 6, 2, 0]): level
11 (10 + 1 = 6 + 1 + 2 + 1 + 1 wasted); GPU 0 runs experts 1 and 2 (the bin with more replicas
picks first), GPU 1 runs expert 0 and holds idle expert 3 (it has more slots left).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeless.placement import kernels
from moeless.placement.latency_model import LatencyModel
from moeless.placement.types import LayerPlacement, PlacementError

LEVEL_TOLERANCE = 0.5  # tokens: bisection stops when the bracket is narrower (finer gains round away)


@dataclass(frozen=True)
class FillDecision:
    """Why a layer's plan is what it is: the fill's level (work in tokens), and when a previous
    placement existed, the predicted seconds the new plan saves per iteration against keeping the
    previous replicas (re-shared), and the cold-start seconds it would cost (the slowest GPU's)."""

    level: float
    stayed: bool = False
    saved_s: float = 0.0
    cold_s: float = 0.0


def place_fill(
    load: np.ndarray,
    free_slots: np.ndarray,
    previous: LayerPlacement | None,
    model: LatencyModel,
    horizon: float = 1000.0,
    budget: int | None = None,
    split: bool = True,
    warm: bool = True,
) -> tuple[LayerPlacement, np.ndarray, FillDecision]:
    """moeless's plan of one layer. load: [E] tokens (>= 0), free_slots: [G] replicas each GPU can
    still take, previous: the layer's resident placement or None, budget: most replicas (None: no cap).

    split=False never cuts an expert (the "scaler off" ablation); warm=False ignores the previous
    placement (walks experts from most to least loaded and never keeps the old plan).
    Returns the placement, the free slots left [G] and the decision.
    """
    load = np.asarray(load, dtype=np.float64)
    free = np.asarray(free_slots, dtype=np.int64).reshape(-1)
    num_experts, num_gpus = load.shape[0], free.shape[0]
    if load.ndim != 1 or num_experts == 0:
        raise ValueError(f"a layer's load must be a non-empty [E] vector, got shape {load.shape}")
    if num_gpus == 0:
        raise ValueError("placement needs at least one GPU; got zero GPUs")
    if not np.isfinite(load).all() or (load < 0).any():
        raise ValueError("loads must be finite, non-negative token counts; check the forecast")
    slots = int(free.sum())
    if slots < num_experts:
        raise PlacementError(f"{slots} free replica slots cannot hold {num_experts} experts; add GPU memory or GPUs")
    budget = slots if budget is None else min(budget, slots)
    call = model.call_overhead / model.alpha if model.alpha > 0 else 0.0
    resident = previous if warm else None
    # 1. Walk order: as the resident placement holds the experts (its replica order), else most loaded first.
    if resident is not None:
        order = kernels.resident_order(resident.expert, num_experts)
    else:
        order = np.argsort(-load, kind="stable")
    active = load[order] > 0
    idle, order = order[~active], order[active]
    # 2. The lowest level that fits, keeping one slot per idle expert. Later bins get more slots:
    #    walked most loaded first, they end with the many small experts.
    caps = np.sort(free)
    level, expert, bin_, tokens = kernels.lowest_level(load, order, caps, call, budget - idle.size, split, LEVEL_TOLERANCE)
    if level < 0 or slots - expert.size < idle.size:
        raise PlacementError(
            f"{order.size} experts with tokens and {idle.size} without do not fit {num_gpus} GPUs' {slots} free slots "
            f"within a budget of {budget} replicas; add GPU memory or raise the layer memory cap"
        )
    # 3. Bins onto GPUs, most warm replicas first; idle experts stay warm where a slot is left.
    was_warm = np.zeros((num_experts, num_gpus), dtype=np.int64)
    if resident is not None:
        was_warm[resident.expert, resident.gpu] = 1
    gpu = kernels.assign_bins(bin_, expert, was_warm, free)[bin_]
    left = free - np.bincount(gpu, minlength=num_gpus)
    idle_gpu = kernels.place_idle(idle, was_warm, left)
    layer = LayerPlacement(
        np.concatenate([expert, idle]), np.concatenate([gpu, idle_gpu]),
        np.concatenate([tokens / load[expert], np.ones(idle.size)]),
    )
    # 4. The new plan only when it pays for its cold starts; else keep the resident replicas.
    if resident is None:
        return layer, left, FillDecision(level)
    cold = layer.gpu[was_warm[layer.expert, layer.gpu] == 0]
    cold_loads = int(np.bincount(cold, minlength=num_gpus).max()) if cold.size else 0
    resident_held = np.bincount(resident.gpu, minlength=num_gpus)
    can_stay = (
        resident_held.shape[0] == num_gpus and bool((resident_held <= free).all())
        and resident.num_replicas <= budget and bool(np.bincount(resident.expert, minlength=num_experts).all())
    )
    if not cold_loads or not can_stay:
        return layer, left, FillDecision(level)
    share = resident.share / np.bincount(resident.expert, weights=resident.share)[resident.expert]
    kept = LayerPlacement(resident.expert, resident.gpu, share)
    saved = model.layer_time(load, kept, num_gpus, "serial") - model.layer_time(load, layer, num_gpus, "serial")
    cold_s = model.cold_start * cold_loads
    if saved * horizon <= cold_s:
        return kept, free - resident_held, FillDecision(level, True, saved, cold_s)
    return layer, left, FillDecision(level, False, saved, cold_s)
