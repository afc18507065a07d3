"""moeless's planner for one layer: plan against what is resident, add a replica only where it pays.

Balancing is free among resident replicas; a new one costs a cold start (exposed unless a
forecast d layers ahead started it in time) and the memory it then holds (DESIGN.md, "What a plan
costs"). So, for one layer and one forecast:

1. Base: every resident replica of the layer (warm, inside its keep-alive) that fits the layer's
   free slots and budget, the tokens re-levelled over them (`kernels.reshare`, then
   `resident_kernels.relevel`; whole tokens, a replica may get none). Costs nothing.
2. Greedy additions (compiled: resident_kernels.grow). Only a replica of an expert on the busiest
   GPU can lower the layer's (serial) time, so the candidates are each of that GPU's experts with
   tokens on each other GPU with a free slot, within the budget, the expert's tokens re-levelled
   over its GPUs. A candidate's gain is (layer time now - layer time with it) x horizon
   iterations; its cost is `ReplicaCost.cost`: the part of its cold start that prefetching cannot
   hide on that GPU plus the GB·s it will hold, priced. The best candidate by gain - cost is added
   while that is positive; when nothing pays, the layer stays where it is. Last, a full re-level
   (resident_kernels.relevel: local search moving the busiest GPU's tokens to other replicas of
   its experts) polishes the final shares.
3. The plan is the replicas that take tokens (and each expert's first replica, so every expert is
   routable). Resident replicas left out stay warm until keep-alive evicts them and can be used
   again for free meanwhile: adding needs gain > cost, keeping needs only a token, which is the
   hysteresis that stops plans from flapping.

Golden example (a call costs 1 token, 2 GPUs, experts 0 and 1 resident on GPU 0, forecast
[10, 6]; a cold start costs one token's time, nothing hidden, memory free, horizon 1): GPU 0 works
10 + 1 + 6 + 1 = 18. A replica of expert 0 on GPU 1, its tokens re-levelled, takes 9 of them
(9 + 1 = 10) and leaves 1 beside expert 1 on GPU 0 (1 + 1 + 6 + 1 = 9): time 10, gain 8 > cost 1,
added (moving expert 1 instead would give 11). The busiest GPU then holds only expert 0, which is
on every GPU: stop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moeless.placement import kernels, resident_kernels
from moeless.placement.latency_model import LatencyModel
from moeless.placement.types import LayerPlacement, PlacementError

GB = 1e9
# Seconds of MoE-layer time one GB·s of replica memory is worth, by default: the trade a user makes
# between latency and the memory bill (PlannerConfig.gb_s_price, `moeless bench planner --gb-s-price`).
GB_S_PRICE = 1.0
GAIN_EPSILON_S = 1e-12  # a gain must beat its cost by more than rounding


@dataclass(frozen=True)
class ReplicaCost:
    """What one more replica costs, in seconds of layer time.

    model:         the latency model; its cold_start is one replica's load from the host tier
    prefetch_layers: d, the layers a forecast looks ahead; a load started then hides d layer times
    expert_bytes:  memory one replica holds
    keep_alive_s:  how long an unused replica stays resident
    gb_s_price:    seconds of layer time one GB·s of replica memory is worth (0: memory is free)
    horizon:       iterations over which a replica's gain is counted and its memory held
    iteration_s:   seconds one iteration takes (memory held over the horizon)
    """

    model: LatencyModel
    prefetch_layers: int = 1
    expert_bytes: int = 0
    keep_alive_s: float = 0.0
    gb_s_price: float = 0.0
    horizon: float = 30.0
    iteration_s: float = 0.05

    def __post_init__(self) -> None:
        for name in ("prefetch_layers", "expert_bytes", "keep_alive_s", "gb_s_price", "iteration_s"):
            if not np.isfinite(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"ReplicaCost.{name} must be a finite number >= 0, got {getattr(self, name)}")
        if not self.horizon > 0:
            raise ValueError(f"ReplicaCost.horizon must be > 0 iterations, got {self.horizon}")

    @property
    def memory_s(self) -> float:
        """The GB·s one replica will hold (horizon x iteration_s + keep_alive_s), priced."""
        gb_s = self.expert_bytes / GB * (self.horizon * self.iteration_s + self.keep_alive_s)
        return self.gb_s_price * gb_s

    def exposed_s(self, loads: int, layer_s: float) -> float:
        """Cold-start seconds a GPU loading `loads` replicas for a layer of `layer_s` still waits."""
        return max(loads * self.model.cold_start - self.prefetch_layers * layer_s, 0.0)

    def cost(self, loads_before: int, layer_s: float) -> float:
        """One more replica on a GPU that already loads `loads_before` for this layer."""
        return self.exposed_s(loads_before + 1, layer_s) - self.exposed_s(loads_before, layer_s) + self.memory_s


@dataclass(frozen=True)
class Addition:
    """A replica the planner added: expert, gpu, its gain (seconds x horizon) and cost (seconds),
    the layer's time before it and the cold loads its GPU already had for the layer."""

    expert: int
    gpu: int
    gain_s: float
    cost_s: float
    before_s: float
    loads_before: int


@dataclass(frozen=True)
class ResidentDecision:
    """base_s: the layer time on the resident replicas re-levelled; grown_s: after the additions;
    final_s: the plan's (grown_s, or less when a full re-level of its replicas is faster)."""

    base_s: float
    grown_s: float
    final_s: float
    added: tuple[Addition, ...] = field(default=())

    @property
    def stayed(self) -> bool:
        return not self.added


def place_resident(
    load: np.ndarray,
    free_slots: np.ndarray,
    resident: LayerPlacement | None,
    cost: ReplicaCost,
    budget: int | None = None,
) -> tuple[LayerPlacement, np.ndarray, ResidentDecision]:
    """moeless's plan of one layer. load: [E] forecast tokens, free_slots: [G] replicas each GPU
    can still take, resident: the layer's resident replicas (None: nothing resident, static EP's
    blocks are the base), budget: most replicas the plan may use (None: the slots).

    Returns the placement (the replicas that take tokens), the free slots left [G] and the decision.
    """
    load = np.asarray(load, dtype=np.float64)
    free = np.asarray(free_slots, dtype=np.int64).reshape(-1)
    num_experts, num_gpus = load.shape[0], free.shape[0]
    if load.ndim != 1 or num_experts == 0 or not np.isfinite(load).all() or (load < 0).any():
        raise ValueError(f"a layer's load must be a non-empty [E] vector of finite token counts >= 0, got {load}")
    if int(free.sum()) < num_experts:
        raise PlacementError(f"{int(free.sum())} free replica slots cannot hold {num_experts} experts; add GPU memory or GPUs")
    budget = int(free.sum()) if budget is None else min(budget, int(free.sum()))
    if budget < num_experts:
        raise PlacementError(f"a budget of {budget} replicas cannot hold {num_experts} experts; raise the layer memory cap")
    # 1. The base: resident replicas that fit, re-levelled, in whole tokens.
    tokens_in = np.rint(load).astype(np.int64)
    expert, gpu = _base(load, free, resident, budget, num_experts)
    model, call = cost.model, cost.model.call_tokens
    tokens = kernels.largest_remainder(tokens_in, expert, kernels.reshare(load, expert, gpu, call, num_gpus))
    base_s = _relevel(tokens_in, expert, gpu, tokens, num_gpus, model)
    # 2. Greedy additions while the best one's priced gain beats its cost (compiled), then a last re-level.
    expert, gpu, tokens, rows = resident_kernels.grow(
        tokens_in, expert, gpu, tokens, free, budget, call, model.alpha, model.call_overhead, model.beta,
        model.cold_start, float(cost.prefetch_layers), cost.memory_s, float(cost.horizon), GAIN_EPSILON_S)
    grown_s = _time(tokens_in, expert, gpu, _shares(tokens, tokens_in[expert]), num_gpus, model)
    final_s = _relevel(tokens_in, expert, gpu, tokens, num_gpus, model) if rows.shape[0] else grown_s
    share = _shares(tokens, tokens_in[expert])
    added = tuple(Addition(int(e), int(g), float(gain), float(price), float(before), int(n)) for e, g, gain, price, before, n in rows)
    # 3. The plan: replicas with tokens, and each expert's first replica.
    used = share > 0
    first = np.zeros(expert.shape[0], dtype=bool)
    first[np.unique(expert, return_index=True)[1]] = True
    keep = used | (first & ~_has_used(expert, used, num_experts))
    layer = LayerPlacement(expert[keep], gpu[keep], np.where(used[keep], share[keep], 1.0))
    left = free - np.bincount(layer.gpu, minlength=num_gpus)
    return layer, left, ResidentDecision(base_s, grown_s, final_s, added)


def _base(load: np.ndarray, free: np.ndarray, resident: LayerPlacement | None, budget: int,
          num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Resident replicas (expert [R], gpu [R]) that fit the free slots and the budget.

    Steps: 1. each expert's first resident replica on a GPU with room; 2. an expert left without
    one goes to static EP's block when nothing is resident, else to the GPU with the most room (a
    cold load); 3. the other resident replicas, most loaded expert first, while slots and budget last.
    """
    num_gpus = free.shape[0]
    pairs = [] if resident is None else sorted(set(zip(resident.expert.tolist(), resident.gpu.tolist())))
    kept: set[tuple[int, int]] = set()
    held = np.zeros(num_gpus, np.int64)
    homes: dict[int, list[int]] = {}
    for e, g in pairs:
        homes.setdefault(e, []).append(g)
    for e in range(num_experts):
        room = [g for g in homes.get(e, []) if held[g] < free[g]]
        if room:
            g = room[0]
        elif resident is None and held[e * num_gpus // num_experts] < free[e * num_gpus // num_experts]:
            g = e * num_gpus // num_experts
        else:
            g = int(np.argmax(free - held))
        kept.add((e, g))
        held[g] += 1
    for e, g in sorted((p for p in pairs if p not in kept), key=lambda p: -load[p[0]]):
        if held[g] < free[g] and len(kept) < budget:
            kept.add((e, g))
            held[g] += 1
    ordered = sorted(kept)
    return np.array([e for e, _ in ordered], dtype=np.int64), np.array([g for _, g in ordered], dtype=np.int64)


def _relevel(tokens_in: np.ndarray, expert, gpu, tokens, num_gpus, model: LatencyModel) -> float:
    """Re-level tokens [R] (in place) over fixed replicas; returns the layer time."""
    return resident_kernels.relevel(tokens_in, expert, gpu, tokens, num_gpus, model.call_tokens, model.alpha,
                                    model.call_overhead, model.beta, GAIN_EPSILON_S)


def _shares(tokens: np.ndarray, expert_tokens: np.ndarray) -> np.ndarray:
    return np.divide(tokens, expert_tokens, out=np.zeros(tokens.shape[0]), where=expert_tokens > 0)


def _time(tokens: np.ndarray, expert, gpu, share, num_gpus, model: LatencyModel) -> float:
    return kernels.serial_time(tokens, expert, gpu, share, num_gpus, model.alpha, model.call_overhead, model.beta)


def _has_used(expert: np.ndarray, used: np.ndarray, num_experts: int) -> np.ndarray:
    """Per replica: whether some replica of its expert takes tokens."""
    return np.bincount(expert[used], minlength=num_experts)[expert] > 0
