"""The live planning loop's decisions, as pure functions: one plan for all traffic.

The planning loop (controller/planning/actor.py, a Ray actor) reads what every expert host holds (the
hosts are the truth of what is resident), merges the serving replicas' reports (controller/
planning/window.py) and, every period, decides what to plan for (`pass_due`, `forecast_groups`,
`held_forecasts`), plans it (`plan_groups`: `plan_step` per forecast) and what to publish
(`to_publish`). `plan_step`:

1. The cluster: every live host's replica memory; a dead host has none (its replicas are planned
   elsewhere; it re-joins, empty, when it answers again).
2. The resident set as a Placement (`resident_placement`): every replica loaded on a live host; an
   expert counts at its static EP home too where that host is live or it is resident nowhere (it
   is loaded there, below: a host that joins gets its static EP share).
3. The configured planner on the merged forecast against that resident set.
4. Loads to send (`loads_to_send`): every planned replica a live host neither holds nor is
   loading (prefetch, off the critical path). A replica the plan drops stops getting tokens and
   its host evicts it after keep-alive, except what the plan let go of (Placement.release: a
   moved home's old one), evicted once its expert's planned replica is resident.
5. What to publish (`publishable`): the plan's replicas whose load has finished, so no token is
   routed to a replica that must still load; an expert none of whose planned replicas is loaded
   keeps them (the host loads on demand: an exposed cold start, counted by the host).

Serving replicas re-level each expert's tokens over the published replicas per layer on the
actual loads (placement.shares.actual_shares: dispatch-time pairing); outputs never depend on the placement.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from moeless.placement.planner import STATEFUL_PLANNERS, Planner, PlannerConfig, get_planner, relevels
from moeless.placement.profile import CostProfile
from moeless.placement.shares import with_stand_ins
from moeless.controller.knobs import KnobError, Knobs
from moeless.placement.cluster import Cluster, ClusterError
from moeless.controller.planning.host_view import HostView
from moeless.placement.types import LayerPlacement, Placement, PlacementError

FAMILIES = ("moeless", "paper")  # planners with a scaler and a placer to switch off
GIB = 2**30


def live_planner_name(knobs: Knobs) -> str:
    """The planner the knobs select: `planner`, with its scaler and/or placer off for ablations."""
    if knobs.scaler and knobs.placer:
        return knobs.planner
    if knobs.planner not in FAMILIES:
        raise KnobError(f"scaler/placer: only the {' and '.join(FAMILIES)} planners have a scaler and a placer to "
                        f"switch off; planner is {knobs.planner!r}")
    return knobs.planner + ("" if knobs.scaler else "-no-scaler") + ("" if knobs.placer else "-no-placer")


@dataclass(frozen=True)
class LoopTerms:
    """What the loop plans by, derived from the knobs: the planner's name (ablations applied), whether
    it is stateful, a layer's replica cap and the memory price."""

    planner: str
    stateful: bool
    layer_cap: int
    memory_price: float


RESTART_KNOBS = ("predictor", "distance")  # built into every serving replica's forward: applied on its restart


def loop_terms(knobs: Knobs, profile: CostProfile, num_layers: int, num_experts: int, serving_replicas: int = 1) -> LoopTerms:
    """The loop's terms for `knobs`; KnobError (naming the knob) when they cannot serve this model."""
    knobs.check_for_model(num_layers)
    name = live_planner_name(knobs)
    return LoopTerms(name, is_stateful(name), layer_cap_replicas(knobs, num_experts, profile.expert_bytes),
                     memory_price(knobs, profile, num_layers, num_experts, serving_replicas))


def hosts_to_configure(statuses: list[dict | None], keep_alive_s: float, shared: bool) -> list[int]:
    """The hosts whose keep-alive is not the knobs' (statuses: each slot's Status, None for an empty
    one). A model alone on its hosts owns their keep-alive, so a live change reaches them without a
    restart; hosts shared by models keep the pool's (shared: none)."""
    if shared:
        return []
    return [i for i, st in enumerate(statuses) if st is not None and abs(st["keep_alive_s"] - keep_alive_s) > 1e-9]


def restart_knobs_changed(running: Knobs, new: Knobs) -> list[str]:
    """The knobs of RESTART_KNOBS that differ: the loop applies the rest at once."""
    return [name for name in RESTART_KNOBS if getattr(running, name) != getattr(new, name)]


def is_stateful(planner_name: str) -> bool:
    """Planners that learn from every iteration's loads themselves (EPLB's window): the loop feeds
    them each reported iteration's actual loads instead of the merged forecast."""
    return planner_name in STATEFUL_PLANNERS


def layer_cap_replicas(knobs: Knobs, num_experts: int, expert_bytes: int) -> int:
    """Replicas one layer may hold: layerMemoryCapGiB over one replica's bytes (default 2 per expert)."""
    if knobs.layer_memory_cap_gib is None:
        return 2 * num_experts
    cap = int(knobs.layer_memory_cap_gib * GIB // expert_bytes)
    if cap < num_experts:
        raise KnobError(f"layerMemoryCapGiB: {knobs.layer_memory_cap_gib} GiB holds {cap} replicas of {expert_bytes} "
                        f"bytes, fewer than the {num_experts} experts of a layer; raise it to at least "
                        f"{num_experts * expert_bytes / GIB:.4f}")
    return cap


def memory_price(knobs: Knobs, profile: CostProfile, num_layers: int, num_experts: int, serving_replicas: int = 1) -> float:
    """The memoryPrice knob, or when unset the deployment's memory-neutral price
    (CostProfile.memory_neutral_price: 1 / its GB)."""
    if knobs.memory_price is not None:
        return knobs.memory_price
    return profile.memory_neutral_price(num_layers, num_experts, serving_replicas)


def planner_config(knobs: Knobs, profile: CostProfile, iteration_s: float, extra: Mapping[str, Any] | None = None, *,
                   num_layers: int, num_experts: int, serving_replicas: int = 1) -> PlannerConfig:
    """The planners' settings from the knobs, the measured profile (cold starts from the host
    memory tier), the measured iteration time and the deployment's shape (its memory prices
    replicas when memoryPrice is unset); `extra`: other PlannerConfig fields."""
    config = PlannerConfig(model=profile.latency_model("host"), cv_threshold=knobs.cv_threshold,
                           prefetch_layers=knobs.distance, keep_alive_s=knobs.keep_alive_s,
                           gb_s_price=memory_price(knobs, profile, num_layers, num_experts, serving_replicas),
                           iteration_s=max(iteration_s, 1e-4), dispatch_s=profile.relevel_s + profile.check_s,
                           home_moves_every=knobs.home_moves_every)
    return replace(config, **dict(extra or {}))


def resident_placement(resident: np.ndarray, live: np.ndarray | None = None) -> Placement:
    """resident: [L, E, G] bool -> every resident replica (even shares); an expert resident
    nowhere counts at its static EP home (e * G // E). live: [G] bool, the hosts that take calls:
    an expert whose home is live counts there too, so a host that joins (scale-out, a restart)
    gets its static EP share back. Without it, experts that stood in elsewhere while their home
    was away would stay there for good: the plan would be worse than static EP on the pool it has."""
    num_layers, num_experts, num_hosts = resident.shape
    home = np.arange(num_experts) * num_hosts // num_experts
    layers = []
    for l in range(num_layers):
        held = resident[l].copy()
        rehome = ~held.any(axis=1) if live is None else ~held.any(axis=1) | live[home]
        held[np.flatnonzero(rehome), home[rehome]] = True
        expert, gpu = np.nonzero(held)
        layers.append(LayerPlacement.even(expert, gpu, num_experts))
    return Placement(tuple(layers), num_experts, num_hosts)


def loads_to_send(plan: Placement, view: HostView) -> list[tuple[int, int, int]]:
    """(layer, expert, host) of every planned replica on a live host that neither holds nor loads it."""
    out = []
    for l, lp in enumerate(plan.layers):
        for e, g in zip(lp.expert.tolist(), lp.gpu.tolist()):
            if view.live[g] and not view.resident[l, e, g] and not view.loading[l, e, g]:
                out.append((l, e, g))
    return out


def publishable(plan: Placement, resident: np.ndarray) -> Placement:
    """The plan's replicas that are loaded (resident: [L, E, G]). An expert none of whose planned
    replicas is loaded takes the replicas of it that are resident elsewhere (the plan's move has not
    happened yet), else keeps its planned ones (loaded on demand). Each expert's shares are
    renormalised over what is kept (even where they sum to zero); serving replicas re-level them
    on the actual loads anyway."""
    layers = []
    for l, lp in enumerate(plan.layers):
        lp, loaded = with_stand_ins(lp, resident[l, lp.expert, lp.gpu], resident[l])  # experts resident only off the plan
        has_loaded = np.bincount(lp.expert, weights=loaded, minlength=plan.num_experts) > 0
        keep = loaded | ~has_loaded[lp.expert]
        expert, gpu, share = lp.expert[keep], lp.gpu[keep], lp.share[keep]
        total = np.bincount(expert, weights=share, minlength=plan.num_experts)
        count = np.bincount(expert, minlength=plan.num_experts)
        share = np.where(total[expert] > 0, share / np.where(total[expert] > 0, total[expert], 1.0), 1.0 / count[expert])
        layers.append(LayerPlacement(expert, gpu, share))
    return Placement(tuple(layers), plan.num_experts, plan.num_gpus)


@dataclass(frozen=True)
class StepDecision:
    """One pass of the loop: the plan, the loads to send, the placement to publish, what to evict now (Placement.release)."""

    plan: Placement
    loads: list[tuple[int, int, int]]
    publish: Placement
    release: list[tuple[int, int, int]] = field(default_factory=list)


def plan_step(planner: Planner, forecast: np.ndarray, view: HostView, expert_bytes: int, layer_cap: int | None,
              known_memory: np.ndarray | None = None) -> StepDecision:
    """Steps 1-5 of the module docstring for one forecast [L, E]. A planner that places on every
    host whatever their memory (static EP, EPLB) cannot plan around a dead host: it plans on
    known_memory [G] (every host's last known memory) instead, and serving replicas move the dead
    host's replicas to live ones per call (RemoteExecutor's fault evacuation)."""
    resident = resident_placement(view.resident & view.live[None, None, :], view.live)
    try:
        plan = planner(forecast, view.cluster(expert_bytes, layer_cap), resident)
    except (PlacementError, ClusterError):
        if known_memory is None or view.live.all():
            raise
        whole = HostView(view.resident, view.loading, view.live, np.asarray(known_memory, dtype=np.float64))
        plan = planner(forecast, whole.cluster(expert_bytes, layer_cap), resident)
    return StepDecision(plan, loads_to_send(plan, view), publishable(plan, view.resident),
                        plan.releasable(view.resident & view.live[None, None, :]))


def union_placement(plans: Sequence[Placement], cluster: Cluster) -> Placement:
    """Every replica of any of `plans` (even shares: serving replicas re-level on the actual loads),
    layer by layer where the union fits the layer cap, else that layer of the first plan; the
    first plan whole when the union does not fit the hosts' slots."""
    first = plans[0]
    cap = cluster.layer_replica_cap()
    layers = []
    for l in range(first.num_layers):
        pairs = sorted({(int(e), int(g)) for p in plans for e, g in zip(p.layers[l].expert, p.layers[l].gpu)})
        if cap is not None and len(pairs) > cap:
            layers.append(first.layers[l])
            continue
        expert, gpu = (np.array(c, dtype=np.int64) for c in zip(*pairs))
        layers.append(LayerPlacement.even(expert, gpu, first.num_experts))
    union = Placement(tuple(layers), first.num_experts, first.num_gpus, plans[-1].release)  # one planner's: its latest
    held = sum(np.bincount(lp.gpu, minlength=first.num_gpus) for lp in union.layers)
    return replace(first, release=plans[-1].release) if (held > cluster.slots()).any() else union


def plan_phases(planner: Planner, forecasts: Sequence[np.ndarray], view: HostView, expert_bytes: int,
                layer_cap: int | None, known_memory: np.ndarray | None = None) -> StepDecision:
    """One pass for several forecasts [L, E] (one per phase: a prefill's loads and a decode step's
    differ ~100x, and their mean serves neither): each planned alone, the resident set their union
    (a replica that pays in one phase is resident; each call re-levels over the union on its own
    actual loads and leaves a replica without tokens where it does not pay)."""
    decisions = [plan_step(planner, f, view, expert_bytes, layer_cap, known_memory) for f in forecasts]
    if len(decisions) == 1:
        return decisions[0]
    plan = union_placement([d.plan for d in decisions], view.cluster(expert_bytes, layer_cap))
    return StepDecision(plan, loads_to_send(plan, view), publishable(plan, view.resident),
                        plan.releasable(view.resident & view.live[None, None, :]))


def same_placement(a: Placement | None, b: Placement, shares: bool = True) -> bool:
    """Whether two placements have the same replicas (and, with shares, the same shares)."""
    if a is None or (a.num_layers, a.num_experts, a.num_gpus) != (b.num_layers, b.num_experts, b.num_gpus):
        return False
    return all(x.num_replicas == y.num_replicas and np.array_equal(x.expert, y.expert) and np.array_equal(x.gpu, y.gpu)
               and (not shares or np.allclose(x.share, y.share)) for x, y in zip(a.layers, b.layers))


# ---- One pass of the loop: what to plan for, the plan, what to publish ----------------------------

def pass_due(fresh: bool, pending_loads: bool, since_read_s: float, idle_s: float) -> bool:
    """Whether a pass reads the hosts and plans: reports came in, loads are pending, or the hosts
    were last read idle_s ago (no traffic and nothing loading: nothing to re-plan)."""
    return fresh or pending_loads or since_read_s >= idle_s


def held_forecasts(merged: Mapping[str, np.ndarray | None], held: Mapping[str, tuple[float, np.ndarray]], now: float,
                   hold_s: float) -> tuple[list[np.ndarray], dict[str, tuple[float, np.ndarray]]]:
    """(each phase's forecast, what is held now): its merged forecast over the window; a phase without
    reports in it keeps its last one for hold_s (keep-alive) seconds (its replicas stay resident that
    long anyway), so a pause between prefills does not drop what they need."""
    held, out = dict(held), []
    for phase, forecast in merged.items():
        if forecast is not None:
            held[phase] = (now, forecast)
        elif phase in held and now - held[phase][0] <= hold_s:
            forecast = held[phase][1]
        if forecast is not None:
            out.append(forecast)
    return out, held


def forecast_groups(first: bool, joined: bool, traffic: bool, stateful: bool, actuals: Sequence[np.ndarray],
                    phases: Callable[[], list[np.ndarray]]) -> list[list[np.ndarray]]:
    """What a pass plans for: groups of forecasts [L, E], each one plan (plan_groups). Without traffic
    (no reports in the window, no pending iteration, not the first pass, no host came or went):
    none, as hosts evict idle replicas after keep-alive and re-loading them would churn. A stateful
    planner: every reported iteration's loads in order, one each (the first pass: the homes). Else
    one group, each phase's forecast (phases())."""
    if not (first or joined or traffic or actuals):
        return []
    if stateful:
        return [[a] for a in actuals] or ([[]] if first else [])
    return [phases()]


def plan_groups(planner: Planner, groups: Sequence[Sequence[np.ndarray]], view: HostView, expert_bytes: int,
                layer_cap: int | None, known: np.ndarray | None, predictor_off: bool) -> StepDecision | None:
    """Each group planned in turn (a stateful planner learns from every one), the last decision
    kept (None without groups): the home replicas (static EP's, planned around dead hosts; before
    traffic those the hosts hold where they moved) until there is traffic and always with the
    predictor off, else the planner on the group's forecasts
    (plan_phases)."""
    decision = None
    for forecasts in groups:
        if predictor_off or not forecasts:
            home = get_planner("moeless-no-scaler", planner.config)
            if not predictor_off:  # before traffic: the homes the hosts hold (a restarted loop's), not static EP's back
                home.adopt(view.resident & view.live[None, None, :])
            decision = plan_step(home, np.zeros(view.resident.shape[:2]), view, expert_bytes, layer_cap)
        else:
            decision = plan_phases(planner, forecasts, view, expert_bytes, layer_cap, known)
    return decision


def to_publish(published: Placement | None, decision: StepDecision, predictor_off: bool, planner: str) -> Placement | None:
    """The placement to publish on the board, or None: nothing with the predictor off (serving keeps
    static EP's) or when it has the published replicas (and shares, for a planner whose shares
    serving does not re-level: placement.planner.relevels)."""
    if predictor_off or same_placement(published, decision.publish, shares=not relevels(planner)):
        return None
    return decision.publish
