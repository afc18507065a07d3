"""moeless-fill's planner for one layer (an earlier generation of moeless, kept as a named baseline;
the default is resident_planner.py): the lowest per-GPU work level its experts fit under.

A GPU's work is the sum over its replicas of tokens + c, with c the per-call overhead in tokens
(replicas on one GPU run one after another). For a level M, the fill (`kernels.fill`) walks the
experts and fills GPU after GPU up to M, cutting an expert that does not fit into whole-token
pieces, one replica per piece (McNaughton's wrap-around rule, paying a call per piece). The fill
is within about one call of the level a perfect split would reach, so bisection on M
(`kernels.lowest_level`) decides the replica counts and the placement together: an expert gets
more replicas exactly where its tokens would otherwise hold a GPU above the level.

Cold starts are priced with the latency model:
1. experts are walked in the order the resident placement holds them, so a fill at a similar
   level cuts them into similar groups;
2. each group (bin) goes to the GPU where most of its replicas are already warm;
3. two whole plans are priced, each as its layer time plus its cold starts (those of the GPU
   that loads the most) spread over `horizon` iterations: the fill, and the resident replicas
   with their tokens re-levelled for today's loads (`kernels.reshare`; nothing to load). The
   cheaper wins. (A third, the fill without cuts, never helped on the benchmark: dropped.)

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
# Iterations a new plan is expected to serve, over which its cold starts are spread. Measured
# (docs/planner.md): 30 keeps the serial gains within 1% (prefill) and 7% (decode) of ignoring
# cold starts while cutting decode churn 5x; 1 locks in the first layout, 1000 churns freely.
HORIZON = 30.0


@dataclass(frozen=True)
class FillDecision:
    """Why a layer's plan is what it is. kind: "fill" (cuts where they lower the level), "whole"
    (the fill with split=False) or "resident" (the replicas already loaded, re-shared); level: the
    fill's level (work in tokens); saved_s: predicted seconds per iteration the chosen plan saves
    against the resident replicas re-shared, cold_s: the cold starts it costs (the GPU that loads
    the most; every replica when nothing is resident)."""

    kind: str
    level: float
    saved_s: float = 0.0
    cold_s: float = 0.0

    @property
    def stayed(self) -> bool:
        return self.kind == "resident"


def place_fill(
    load: np.ndarray,
    free_slots: np.ndarray,
    previous: LayerPlacement | None,
    model: LatencyModel,
    horizon: float = HORIZON,
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
    call = model.call_tokens
    resident = previous if warm else None
    # 1. Walk order: as the resident placement holds the experts (its replica order), else most loaded first.
    if resident is not None:
        order = kernels.resident_order(resident.expert, num_experts)
    else:
        order = np.argsort(-load, kind="stable")
    active = load[order] > 0
    idle, order = order[~active], order[active]
    # 2. Two candidates, each priced as its layer time plus its cold starts (the GPU that loads the
    #    most) amortised over the horizon: the fill at its lowest level, and the resident replicas
    #    re-shared (nothing to load). Ties keep the resident ones.
    was_warm = np.zeros((num_experts, num_gpus), dtype=np.int64)
    if resident is not None:
        was_warm[resident.expert, resident.gpu] = 1

    layer, left, level = _fill(load, order, idle, free, was_warm, call, budget, split)
    if layer is None:
        raise PlacementError(
            f"{order.size} experts with tokens and {idle.size} without do not fit {num_gpus} GPUs' {slots} free slots "
            f"within a budget of {budget} replicas; add GPU memory or raise the layer memory cap"
        )
    kind = "fill" if split else "whole"
    time_s = model.layer_time(load, layer, num_gpus, "serial")
    cold_s = model.cold_start * kernels.most_cold_loads(layer.expert, layer.gpu, was_warm, num_gpus)
    if resident is None or not _fits(resident, free, budget, num_experts):
        return layer, left, FillDecision(kind, level, 0.0, cold_s)
    # 3. The cheaper; a stay reports what the fill would have saved and cost.
    kept = LayerPlacement(resident.expert, resident.gpu, kernels.reshare(load, resident.expert, resident.gpu, call, num_gpus))
    saved = model.layer_time(load, kept, num_gpus, "serial") - time_s
    if saved * horizon <= cold_s:
        return kept, free - np.bincount(resident.gpu, minlength=num_gpus), FillDecision("resident", level, saved, cold_s)
    return layer, left, FillDecision(kind, level, saved, cold_s)


def _fill(load: np.ndarray, order: np.ndarray, idle: np.ndarray, free: np.ndarray, was_warm: np.ndarray, call: float,
          budget: int, split: bool) -> tuple[LayerPlacement | None, np.ndarray, float]:
    """The fill at its lowest level, on GPUs (kernels.fill_plan): (layer or None, free slots left [G], level)."""
    level, expert, gpu, share, left = kernels.fill_plan(load, order, idle, free, was_warm, call, budget, split, LEVEL_TOLERANCE)
    return (LayerPlacement(expert, gpu, share) if level >= 0 else None), left, level


def _fits(resident: LayerPlacement, free: np.ndarray, budget: int, num_experts: int) -> bool:
    """The resident replicas still fit this layer's slots and budget and hold every expert."""
    held = np.bincount(resident.gpu, minlength=free.shape[0])
    return (
        held.shape[0] == free.shape[0] and bool((held <= free).all())
        and resident.num_replicas <= budget and bool(np.bincount(resident.expert, minlength=num_experts).all())
    )
