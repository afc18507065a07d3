"""moeless's planner for one layer: plan against what is resident, add a replica only where it pays.

Balancing is free among resident replicas; a new one costs a cold start (exposed unless a
forecast d layers ahead started it in time) and the memory it then holds (docs/design.md, "What a
plan costs"). The forecast is counted in whole tokens, and an expert counts a call unless the
forecast makes it idle with IDLE_CONFIDENCE (90%): a plan does not bet on a token staying away.
So, for one layer and one forecast:

1. Base: each expert's home replica (static EP's block, GPU e * G // E, until
   placement/home_moves.py moves it; home replicas always stay in the plan, so one replica of
   every expert is always resident) and every other resident replica of the layer (warm, inside
   its keep-alive) that fits the layer's free slots and budget; the tokens re-levelled over them
   (`kernels.reshare`, then `resident_kernels.relevel`: whole tokens, a replica may get none).
   Costs nothing. Unless that beats the homes' split (every token at home; static EP's split
   while the homes are static EP's) by a margin of its time on the forecast (5%, or the relative
   noise of the forecast's counts, 1 / sqrt(tokens per expert), when that is more), the base is
   the homes' split: forecasts err, and a small predicted gain is a loss about as often as not
   (decode).
2. Additions in steps (compiled: resident_kernels.grow). Only a replica of an expert on the
   busiest GPU can lower the layer's (serial) time, so the candidates are each of that GPU's
   experts with tokens on each other GPU with a free slot, within the budget, the expert's tokens
   re-levelled over its GPUs. A replica's cost is `ReplicaCost.cost`: the part of its cold start
   that prefetching cannot hide on that GPU plus the GB·s it will hold, priced. A step tries a few
   candidates in a row (several GPUs can tie as the straggler: one replica alone then gains
   nothing) and keeps the prefix whose gain, (layer time before - after) x horizon iterations,
   beats its summed cost by the most; when none pays, the layer stays where it is. A last
   re-level polishes the shares, and a grown plan that does not beat the homes' split by the
   margin is dropped.
3. The plan is the replicas that take tokens and the home replicas. Other resident replicas stay
   warm until keep-alive evicts them and can be used again for free meanwhile: adding needs gain >
   cost, keeping needs only a token, which is the hysteresis that stops plans from flapping.

Golden example (a call costs 1 token, 2 GPUs, static EP resident: experts 0 and 1 at home on GPU 0,
2 and 3 on GPU 1; forecast [10, 6, 0, 0]; a cold start costs one token's time, nothing hidden,
memory free, horizon 1): GPU 0 works 10 + 1 + 6 + 1 = 18, GPU 1 nothing. A replica of expert 0
on GPU 1, its tokens re-levelled, takes 9 of them (9 + 1 = 10) and leaves 1 beside expert 1 on
GPU 0 (1 + 1 + 6 + 1 = 9): time 10, gain 8 > cost 1, and 10 beats static EP's 18 by more than the
margin: added. The busiest GPU then holds only expert 0, which is on both GPUs: stop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moeless.placement import kernels, resident_kernels
from moeless.placement.home_fits import static_homes
from moeless.placement.latency_model import LatencyModel
from moeless.placement.shares import GAIN_EPSILON_S, relevel_tokens, routable, token_shares
from moeless.placement.types import LayerPlacement, PlacementError

GB = 1e9
# A plan leaves static EP's split only when the forecast says it saves a fraction of static EP's
# time (on the forecast) beyond what forecast noise moves: max(MARGIN, NOISE / sqrt(n)), n the mean
# forecast tokens of the experts with tokens. Routing counts are multinomial: an expert's count
# varies by about sqrt(count), so a predicted gain below that relative noise is a loss as often as
# not (decode, ~16 tokens an expert: 25%; a prefill of 300: 6%). PlannerConfig.static_margin.
MARGIN = 0.05
NOISE = 1.0
LOOKAHEAD = 4  # replicas a step may try in a row before one pays (several GPUs can tie as the straggler)
# A plan may count on an expert getting no token (no call, no weight read) only where the forecast
# makes that this likely: with f forecast tokens, P(no token) = exp(-f) (Poisson), so an expert
# with f >= -ln(IDLE_CONFIDENCE) = 0.105 counts a call. Rounding (f < 0.5: idle) bet on a 61% chance;
# on the deployment cells such bets gained up to 0.9% of decode time where they won and made one
# cell slower than static EP where they lost (docs/deployments.md, notes): moeless does not bet.
IDLE_CONFIDENCE = 0.9


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
        return self.gb_s_price * (self.expert_bytes / GB * (self.horizon * self.iteration_s + self.keep_alive_s))

    def exposed_s(self, loads: int, layer_s: float) -> float:
        """Cold-start seconds a GPU loading `loads` replicas for a layer of `layer_s` still waits."""
        return max(loads * self.model.cold_start - self.prefetch_layers * layer_s, 0.0)

    def cost(self, loads_before: int, layer_s: float) -> float:
        """One more replica on a GPU that already loads `loads_before` for this layer."""
        return self.exposed_s(loads_before + 1, layer_s) - self.exposed_s(loads_before, layer_s) + self.memory_s


@dataclass(frozen=True)
class Addition:
    """A replica the planner added: expert, gpu, its own gain (seconds x horizon) and cost
    (seconds), the layer's time before it, the cold loads its GPU already had for the layer, and
    the step it was added in (a step's additions pay together)."""

    expert: int
    gpu: int
    gain_s: float
    cost_s: float
    before_s: float
    loads_before: int
    step: int


@dataclass(frozen=True)
class ResidentDecision:
    """Layer times on the forecast: static_s with every token at its expert's home (the homes'
    split); base_s on the resident replicas re-levelled (or static_s, when that is not below it by
    the margin); grown_s after the additions; final_s the plan's (grown_s re-levelled)."""

    static_s: float
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
    margin: float = MARGIN,
    homes: np.ndarray | None = None,
) -> tuple[LayerPlacement, np.ndarray, ResidentDecision]:
    """moeless's plan of one layer. load: [E] forecast tokens, free_slots: [G] replicas each GPU
    can still take, resident: the layer's resident replicas (None: static EP's blocks), budget:
    most replicas the plan may use (None: the slots), margin: the least fraction of static EP's
    time (on the forecast) a plan must save before it leaves the homes' split (more where the
    forecast tokens are few: see NOISE), homes: [E] each expert's home GPU, the replica that
    serves it when nothing pays more (None: static EP's blocks; placement/home_moves.py moves them).

    Returns the placement (the replicas that take tokens, and every home replica), the free slots
    left [G] and the decision.
    """
    load = np.asarray(load, dtype=np.float64)
    free = np.asarray(free_slots, dtype=np.int64).reshape(-1)
    num_experts, num_gpus = load.shape[0], free.shape[0]
    if load.ndim != 1 or num_experts == 0 or not np.isfinite(load).all() or (load < 0).any():
        raise ValueError(f"a layer's load must be a non-empty [E] vector of finite token counts >= 0, got {load}")
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    if int(free.sum()) < num_experts:
        raise PlacementError(f"{int(free.sum())} free replica slots cannot hold {num_experts} experts; add GPU memory or GPUs")
    budget = int(free.sum()) if budget is None else min(budget, int(free.sum()))
    if budget < num_experts:
        raise PlacementError(f"a budget of {budget} replicas cannot hold {num_experts} experts; raise the layer memory cap")
    # 1. The base: home replicas and the resident ones that fit, re-levelled, in whole tokens;
    #    the homes' split (every token at home) unless re-levelling beats it by the margin.
    tokens_in = _whole_tokens(load)
    homes = static_homes(num_experts, num_gpus) if homes is None else np.asarray(homes, dtype=np.int64)
    expert, gpu, home = _base(load, free, resident, budget, homes)
    model, call = cost.model, cost.model.call_tokens
    active = tokens_in[tokens_in > 0]
    margin = max(margin, NOISE / np.sqrt(active.mean())) if active.size else margin
    at_home = np.where(home, tokens_in[expert], 0)
    static_s = _time(tokens_in, expert, gpu, token_shares(at_home, tokens_in[expert]), num_gpus, model)
    tokens = kernels.largest_remainder(tokens_in, expert, kernels.reshare(load, expert, gpu, call, num_gpus))
    base_s = relevel_tokens(tokens_in, expert, gpu, tokens, num_gpus, model)
    if base_s > (1.0 - margin) * static_s:
        tokens, base_s = at_home.copy(), static_s
    # 2. Additions in steps, each step's priced gain beating its cost (compiled), then a last re-level.
    grown_e, grown_g, grown_t, rows = resident_kernels.grow(
        tokens_in, expert, gpu, tokens, free, budget, call, model.alpha, model.call_overhead, model.beta,
        model.cold_start, float(cost.prefetch_layers), cost.memory_s, float(cost.horizon), GAIN_EPSILON_S, LOOKAHEAD)
    grown_s = _time(tokens_in, grown_e, grown_g, token_shares(grown_t, tokens_in[grown_e]), num_gpus, model)
    final_s = relevel_tokens(tokens_in, grown_e, grown_g, grown_t, num_gpus, model) if rows.shape[0] else grown_s
    if final_s <= (1.0 - margin) * static_s or not rows.shape[0]:
        expert, gpu, tokens = grown_e, grown_g, grown_t
    else:  # the additions leave too little of a gain over the homes' split to trust the forecast with: none
        final_s, grown_s, rows = base_s, base_s, rows[:0]
    share = token_shares(tokens, tokens_in[expert])
    added = tuple(Addition(int(e), int(g), float(gain), float(price), float(before), int(n), int(step))
                  for e, g, gain, price, before, n, step in rows)
    # 3. The plan: replicas with tokens, and every home replica (one replica of each expert stays resident).
    home = np.arange(expert.shape[0]) < num_experts  # _base put them first; grow appends
    used = share > 0
    keep = used | home | ~_has_used(expert, used | home, num_experts)
    layer = LayerPlacement(expert[keep], gpu[keep], np.where(used[keep], share[keep], 0.0))
    layer = routable(layer, num_experts)
    left = free - np.bincount(layer.gpu, minlength=num_gpus)
    return layer, left, ResidentDecision(static_s, base_s, grown_s, final_s, added)


def _base(load: np.ndarray, free: np.ndarray, resident: LayerPlacement | None, budget: int,
          homes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Home and resident replicas that fit the free slots and the budget: (expert [R], gpu [R],
    home [R] bool), the E home replicas first, in expert order.

    Steps: 1. each expert's home replica: its home [E] where it is resident (or nothing is),
    else its first resident replica (a move in flight), else the home (a cold load); the first of
    those with room, else the GPU with the most room; 2. the other resident replicas, most loaded
    expert first, while slots and budget last. (Vectorised when everything fits, the usual case.)
    """
    num_gpus, num_experts = free.shape[0], homes.shape[0]
    warm = np.zeros((num_experts, num_gpus), dtype=bool)
    if resident is not None:
        warm[resident.expert, resident.gpu] = True
    at_home = warm[np.arange(num_experts), homes] | (resident is None)
    anchor = np.where(at_home | ~warm.any(axis=1), homes, warm.argmax(axis=1))
    warm[np.arange(num_experts), anchor] = False
    extra_e, extra_g = np.nonzero(warm)
    order = np.argsort(-load[extra_e], kind="stable")
    extra_e, extra_g = extra_e[order], extra_g[order]
    held = np.bincount(anchor, minlength=num_gpus) + np.bincount(extra_g, minlength=num_gpus)
    if (held <= free).all() and num_experts + extra_e.shape[0] <= budget:
        expert = np.concatenate([np.arange(num_experts), extra_e])
        return expert, np.concatenate([anchor, extra_g]), np.arange(expert.shape[0]) < num_experts
    return _base_tight(load, free, resident, budget, homes)


def _base_tight(load: np.ndarray, free: np.ndarray, resident: LayerPlacement | None, budget: int,
                homes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """_base when slots or the budget are short: the same steps, one replica at a time."""
    num_gpus, num_experts = free.shape[0], homes.shape[0]
    pairs = [] if resident is None else sorted(set(zip(resident.expert.tolist(), resident.gpu.tolist())))
    warm_at: dict[int, list[int]] = {}
    for e, g in pairs:
        warm_at.setdefault(e, []).append(g)
    kept: list[tuple[int, int]] = []
    held = np.zeros(num_gpus, np.int64)
    for e in range(num_experts):
        home = int(homes[e])
        warm = warm_at.get(e, [])
        order = [home, *warm] if resident is None or home in warm else [*warm, home]
        room = [g for g in order if held[g] < free[g]]
        g = room[0] if room else int(np.argmax(free - held))
        kept.append((e, g))
        held[g] += 1
    taken = set(kept)
    for e, g in sorted((p for p in pairs if p not in taken), key=lambda p: -load[p[0]]):
        if held[g] < free[g] and len(kept) < budget:
            kept.append((e, g))
            held[g] += 1
    expert = np.array([e for e, _ in kept], dtype=np.int64)
    return expert, np.array([g for _, g in kept], dtype=np.int64), np.arange(len(kept)) < num_experts


def _whole_tokens(load: np.ndarray) -> np.ndarray:
    """[E] forecast tokens -> [E] whole tokens the plan counts: rounded, and at least one (a call)
    where the expert is not idle with IDLE_CONFIDENCE."""
    called = load >= -np.log(IDLE_CONFIDENCE)
    return np.where(called, np.maximum(np.rint(load), 1.0), 0.0).astype(np.int64)


def _time(tokens: np.ndarray, expert, gpu, share, num_gpus, model: LatencyModel) -> float:
    return kernels.serial_time(tokens, expert, gpu, share, num_gpus, model.alpha, model.call_overhead, model.beta)


def _has_used(expert: np.ndarray, used: np.ndarray, num_experts: int) -> np.ndarray:
    """Per replica: whether some replica of its expert takes tokens."""
    return np.bincount(expert[used], minlength=num_experts)[expert] > 0
