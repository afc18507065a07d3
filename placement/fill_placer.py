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

import math
from dataclasses import dataclass

import numpy as np

from moeless.placement.latency_model import LatencyModel
from moeless.placement.placer import _warm_map
from moeless.placement.types import LayerPlacement, PlacementError

Piece = tuple[int, int, float]  # (expert, bin, tokens)
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


def fill(tokens: list[float], order: list[int], caps: list[int], call: float, level: float, budget: int, split: bool = True) -> list[Piece] | None:
    """Pieces of the experts in `order` (those with tokens), bins filled in turn up to `level` work.

    tokens: [E]; caps: [B] replicas each bin may hold; budget: most pieces in all. A piece has at
    least one token and so does the rest it leaves; with split=False an expert is never cut.
    Returns (expert, bin, tokens) per piece, or None when the pieces do not fit.
    """
    pieces: list[Piece] = []
    add, floor = pieces.append, math.floor
    cuts = (budget - len(order)) if split else 0  # pieces beyond one per expert
    if cuts < 0:
        return None
    num_bins, b, room, held, cap = len(caps), 0, level, 0, caps[0]
    for e in order:
        t = tokens[e]
        while True:
            if held < cap and t + call <= room:
                add((e, b, t))
                room -= t + call
                held += 1
                break
            cut = floor(room - call)
            if cuts > 0 and held < cap and cut >= 1 and t - cut >= 1:
                add((e, b, float(cut)))
                t -= cut
                cuts -= 1
            b += 1
            if b == num_bins:
                return None
            room, held, cap = level, 0, caps[b]
    return pieces


def lowest_level(tokens: list[float], order: list[int], caps: list[int], call: float, budget: int, split: bool = True) -> tuple[float, list[Piece]]:
    """The lowest level (bisected to LEVEL_TOLERANCE tokens) at which `fill` fits, and its pieces.

    Below max((total + c n) / B, c + 1) nothing fits (n experts with tokens, B bins); without
    splits, below c + the largest expert. Raises PlacementError when no level fits (slots or budget).
    """
    active = [tokens[e] for e in order]
    if not active:
        return 0.0, []
    low = max((sum(active) + call * len(active)) / len(caps), call + (max(active) if not split else 1.0))
    # Each GPU wastes less than a call and a token of room, so low + c + 1 usually fits.
    ceiling = max(low, sum(active) + call * len(active) + 1.0)  # one GPU could run them all
    high, step = min(low + call + 1.0, ceiling), call + 1.0
    best = fill(tokens, order, caps, call, high, budget, split)
    while best is None:  # 1. grow the bracket until a fill fits
        if high >= ceiling:
            raise PlacementError(
                f"{len(active)} experts with tokens do not fit {len(caps)} GPUs' free slots within a budget of "
                f"{budget} replicas; add GPU memory or raise the layer memory cap"
            )
        low, high, step = high, min(high + step, ceiling), 2 * step
        best = fill(tokens, order, caps, call, high, budget, split)
    while high - low > LEVEL_TOLERANCE:  # 2. bisect: the lowest level that still fits
        mid = (low + high) / 2
        pieces = fill(tokens, order, caps, call, mid, budget, split)
        if pieces is None:
            low = mid
        else:
            high, best = mid, pieces
    return high, best


def bins_to_gpus(pieces: list[Piece], caps: list[int], free: list[int], warm: list[list[int]]) -> list[int]:
    """GPU of each bin: bins with the most warm replicas choose first, each the free GPU (slots
    >= the bin's replicas) where most of its replicas are warm; cold bins, most replicas first,
    take the GPU with most free slots (so no GPU's memory runs out layers before the others').
    caps: [B] the bins' slot limits (free sorted from fewest, so the plain order always fits);
    free: [G]; warm: GPUs per expert. Returns [B] distinct GPUs."""
    num_bins = len(caps)
    held, overlap = [0] * num_bins, [dict() for _ in range(num_bins)]
    for e, b, _ in pieces:
        held[b] += 1
        for g in warm[e]:
            overlap[b][g] = overlap[b].get(g, 0) + 1
    by_slots = sorted(range(len(free)), key=lambda g: -free[g])
    taken, gpu_of = set(), [-1] * num_bins
    for b in sorted(range(num_bins), key=lambda b: (-max(overlap[b].values(), default=0), -held[b])):
        fits = [g for g, n in sorted(overlap[b].items(), key=lambda item: -item[1]) if g not in taken and free[g] >= held[b]]
        fits += [g for g in by_slots if g not in taken and free[g] >= held[b]]
        if not fits:  # the greedy choice painted itself into a corner: the order caps came from
            return by_slots[::-1][:num_bins]
        gpu_of[b] = fits[0]
        taken.add(fits[0])
    return gpu_of


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
    free = [int(s) for s in np.asarray(free_slots).reshape(-1)]
    num_experts, num_gpus = load.shape[0], len(free)
    if load.ndim != 1 or num_experts == 0:
        raise ValueError(f"a layer's load must be a non-empty [E] vector, got shape {load.shape}")
    if num_gpus == 0:
        raise ValueError("placement needs at least one GPU; got zero GPUs")
    if not np.isfinite(load).all() or (load < 0).any():
        raise ValueError("loads must be finite, non-negative token counts; check the forecast")
    if sum(free) < num_experts:
        raise PlacementError(f"{sum(free)} free replica slots cannot hold {num_experts} experts; add GPU memory or GPUs")
    budget = sum(free) if budget is None else min(budget, sum(free))
    call = model.call_overhead / model.alpha if model.alpha > 0 else 0.0
    tokens = load.tolist()
    warm_gpus = _warm_map(previous if warm else None, num_experts)
    # 1. Walk order: as the previous placement holds the experts (its replica order), else most loaded first.
    if warm and previous is not None:
        first = {}
        for e in previous.expert.tolist():
            first.setdefault(e, len(first))
        order = sorted(range(num_experts), key=lambda e: first.get(e, num_experts + e))
    else:
        order = sorted(range(num_experts), key=lambda e: -tokens[e])
    idle = [e for e in order if tokens[e] <= 0]
    order = [e for e in order if tokens[e] > 0]
    # 2. The lowest level that fits, keeping one slot per idle expert. Later bins get more slots:
    #    most loaded first, they end with the many small experts.
    caps = sorted(free)
    level, pieces = lowest_level(tokens, order, caps, call, budget - len(idle), split)
    held = np.bincount([b for _, b, _ in pieces], minlength=num_gpus).tolist()
    if sum(caps) - sum(held) < len(idle):
        raise PlacementError(f"no free slots left for {len(idle)} experts without tokens; add GPU memory or GPUs")
    # 3. Bins onto GPUs, most warm replicas first; idle experts stay warm where a slot is left.
    gpu_of = bins_to_gpus(pieces, caps, free, warm_gpus)
    left = list(free)
    experts, gpus, shares = [], [], []
    for e, b, t in pieces:
        experts.append(e)
        gpus.append(gpu_of[b])
        shares.append(t / tokens[e])
        left[gpu_of[b]] -= 1
    for e in idle:
        g = next((h for h in warm_gpus[e] if left[h] > 0), None)
        g = max(range(num_gpus), key=left.__getitem__) if g is None else g
        experts.append(e)
        gpus.append(g)
        shares.append(1.0)
        left[g] -= 1
    layer = LayerPlacement(np.array(experts, dtype=np.int64), np.array(gpus, dtype=np.int64), np.array(shares))
    decision = FillDecision(level)
    # 4. The new plan only when it pays for its cold starts; else keep the resident replicas.
    cold_loads = _most_cold_loads(previous, layer, num_gpus) if warm and previous is not None else 0
    if cold_loads and _can_stay(previous, free, budget, num_experts):
        kept = _reshared(previous, load)
        saved = model.layer_time(load, kept, num_gpus, "serial") - model.layer_time(load, layer, num_gpus, "serial")
        cold = model.cold_start * cold_loads
        if saved * horizon <= cold:
            held_before = np.bincount(previous.gpu, minlength=num_gpus)
            return kept, np.asarray(free) - held_before, FillDecision(level, True, saved, cold)
        decision = FillDecision(level, False, saved, cold)
    return layer, np.array(left, dtype=np.int64), decision


def _can_stay(previous: LayerPlacement, free: list[int], budget: int, num_experts: int) -> bool:
    held = np.bincount(previous.gpu, minlength=len(free))
    return (
        held.shape[0] == len(free)
        and bool((held <= np.asarray(free)).all())
        and previous.num_replicas <= budget
        and np.array_equal(np.unique(previous.expert), np.arange(num_experts))
    )


def _reshared(previous: LayerPlacement, load: np.ndarray) -> LayerPlacement:
    """The previous replicas with today's loads: shares kept, renormalised per expert."""
    share = previous.share / np.bincount(previous.expert, weights=previous.share)[previous.expert]
    return LayerPlacement(previous.expert, previous.gpu, share)


def _most_cold_loads(previous: LayerPlacement, layer: LayerPlacement, num_gpus: int) -> int:
    """Cold loads of the GPU that loads the most replicas going from previous to layer."""
    resident = set(zip(previous.expert.tolist(), previous.gpu.tolist()))
    cold = [g for e, g in zip(layer.expert.tolist(), layer.gpu.tolist()) if (e, g) not in resident]
    return int(np.bincount(cold, minlength=num_gpus).max()) if cold else 0
