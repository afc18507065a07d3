"""One planner interface: plan(forecast [L, E], cluster, resident) -> Placement.

Every policy, moeless's default, the paper-faithful pair, each baseline and each ablation, is
a plan function `(forecast, cluster, previous, config) -> Placement` (config: a PlannerConfig,
placement/planner_config.py), selectable by name (see PLANNERS) or by a "module:function" string
naming such a function. `get_planner` binds the
config and returns a `Planner` called as planner(forecast, cluster, previous). `previous` is what
is resident (every warm replica, whether the last plan used it or not), or None.

Names (PLANNERS groups them and DEFAULT_PLANNER names the default): moeless (default: plans against the resident replicas and adds one only where its priced
gain beats its cold start and memory) | paper | static | eplb | eplb-global | eplb-window | oracle,
and ablations moeless-no-scaler (one replica per expert), moeless-no-placer (moeless's counts
placed round-robin), moeless-cold (ignores what is resident), moeless-free-memory (memory unpriced),
moeless-fill and moeless-greedy (earlier generations of moeless, kept as named baselines: the
lowest per-GPU work level re-planned every iteration; the straggler scaler then the priced placer), paper-no-scaler, paper-no-placer, and
both parts off together: moeless-no-scaler-no-placer, paper-no-scaler-no-placer.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import numpy as np

from moeless.placement.scaler import cv_below, greedy_scale, straggler_within, with_dead_band
from moeless.placement.cluster import Cluster
from moeless.placement.names import DEFAULT_PLANNER
from moeless.placement.oracle import oracle_load
from moeless.placement.placer import place_jsq_warm, place_round_robin
from moeless.placement.planner_config import PlannerConfig
from moeless.placement.eplb_planners import check_memory, plan_eplb, plan_eplb_window
from moeless.placement.eplb_production import production_eplb, production_eplb_with_state
from moeless.placement.fill_placer import place_fill
from moeless.placement.full_replication import plan_full_replication
from moeless.placement.layer_plans import plan_layers
from moeless.placement.moeless_planners import Fresh, PlanFn, PlannerState, moeless_planner, moeless_sets
from moeless.placement.priced_placer import place_priced
from moeless.placement.types import LayerPlacement, Placement


# A scaler for one layer: (load [E], previous logcnt [E] or None, budget, G) -> logcnt [E].
LayerScaler = Callable[[np.ndarray, "np.ndarray | None", "int | None", int], np.ndarray]
# A placer for one layer: (load [E], logcnt [E], free slots [G], previous layer, budget) -> (layer, free slots [G]).
LayerPlacer = Callable[[np.ndarray, np.ndarray, np.ndarray, "LayerPlacement | None", "int | None"], tuple[LayerPlacement, np.ndarray]]


@dataclass(frozen=True)
class Planner:
    """A plan function bound to its config. lossy_load, set only for the Oracle, is the load
    rewrite ([..., E] -> [..., E]) its placement must be evaluated on."""

    name: str
    plan_fn: PlanFn
    config: PlannerConfig
    lossy_load: Callable[[np.ndarray], np.ndarray] | None = None
    state: PlannerState | None = None

    def __call__(self, forecast: np.ndarray, cluster: Cluster, previous: Placement | None = None) -> Placement:
        return self.plan_fn(check_forecast(forecast), cluster, previous, self.config)

    def learn(self, *actual: np.ndarray) -> None:
        """Iterations that ran, in order: each one's actual loads [L, E] (what its gates reported).
        Planners that keep statistics of them learn (moeless's homes); the others ignore them."""
        for loads in actual if self.state is not None else ():
            self.state.learn(check_forecast(np.asarray(loads, dtype=np.float64)))

    def adopt(self, resident: np.ndarray) -> None:
        """What the hosts hold, for a planner made while replicas are resident (a restarted loop):
        resident [L, E, G] bool, loaded replicas on live hosts. moeless takes its homes from it and
        production EPLB its layout; the others ignore it."""
        if self.state is not None:
            self.state.adopt(np.asarray(resident, dtype=bool))

    def describe(self) -> list[str]:
        """What a planner with state has decided so far and why (moeless: its home moves), one line each."""
        return self.state.describe() if self.state is not None else []

    @property
    def relevels(self) -> bool:
        """Whether the data plane re-levels this planner's shares on each layer's actual loads."""
        return relevels(self.name)

    @property
    def samples(self) -> bool:
        """Whether it plans on samples of the batches to come ([B, L, E]) rather than one forecast."""
        return self.name in SAMPLE_PLANNERS


def relevels(planner_name: str) -> bool:
    """Whether serving replicas pair each layer call's tokens with the published replicas on its
    actual loads (placement/dispatch.py): moeless's planners plan the resident set and leave the
    shares to the data plane, and so does full replication; the baselines (static EP, EPLB, the
    paper, the Oracle) keep their own shares."""
    return planner_name.startswith("moeless") or planner_name == "full-replication"


def check_forecast(forecast: np.ndarray) -> np.ndarray:
    """forecast: [L, E] (or [B, L, E] samples of the batches to come) non-negative finite token counts, as float64."""
    forecast = np.asarray(forecast, dtype=np.float64)
    if forecast.ndim not in (2, 3) or 0 in forecast.shape:
        raise ValueError(f"a forecast must be [L, E] (or [B, L, E] samples) with L, E >= 1; got shape {forecast.shape}")
    if not np.isfinite(forecast).all() or (forecast < 0).any():
        raise ValueError("forecast loads must be finite, non-negative token counts")
    return forecast


def _scaler(kind: str, config: PlannerConfig) -> LayerScaler:
    """"straggler" (moeless-greedy), "cv" (paper) or "off" (one replica per expert)."""

    def scale(load: np.ndarray, previous: np.ndarray | None, budget: int | None, num_gpus: int) -> np.ndarray:
        if kind == "off":
            return np.ones(load.shape[0], dtype=np.int64)
        if kind == "straggler":
            call = config.model.call_tokens if config.model is not None else 0.0
            strict = straggler_within(num_gpus, config.slack, call)
            relaxed = straggler_within(num_gpus, config.slack + config.dead_band, call)
        else:
            strict, relaxed = cv_below(config.cv_threshold), cv_below(config.cv_threshold + config.dead_band)
        limit = config.max_replicas or num_gpus

        def fresh(w: np.ndarray) -> np.ndarray:
            return greedy_scale(w, budget, strict, config.min_replicas, limit)

        if config.dead_band > 0:
            return with_dead_band(fresh, relaxed, budget)(load, previous)
        return fresh(load)

    return scale


def _placer(kind: str, config: PlannerConfig) -> LayerPlacer:
    """"priced" (moeless-greedy), "warm" (paper's JSQ with warm reuse) or "off" (round-robin)."""
    if kind == "priced" and config.model is None:
        raise ValueError("moeless's placer needs a latency model: PlannerConfig(model=LatencyModel(...))")

    def place(load, logcnt, free, before, budget):
        if kind == "priced":
            layer, free, _ = place_priced(load, logcnt, free, before, config.model, config.horizon, budget)
            return layer, free
        if kind == "warm":
            return place_jsq_warm(load, logcnt, free, before)
        return place_round_robin(load, logcnt, free)

    return place


def _layered(scaler: str, placer: str) -> PlanFn:
    """A scaler (replica counts), then a placer (their GPUs and shares), layer by layer."""

    def plan(forecast: np.ndarray, cluster: Cluster, previous: Placement | None, config: PlannerConfig) -> Placement:
        scale, place = _scaler(scaler, config), _placer(placer, config)

        def plan_layer(load, free, before, budget):
            logcnt = scale(load, None if before is None else before.logcnt(load.shape[0]), budget, cluster.num_gpus)
            # with the scaler off the placer gets no budget for extra replicas either
            return place(load, logcnt, free, before, None if scaler == "off" else budget)

        return plan_layers(forecast, cluster, previous, plan_layer)

    return plan


def _filled(split: bool = True, warm: bool = True) -> PlanFn:
    """moeless-fill: the lowest work level every GPU fits under decides counts and GPUs together
    (placement/fill_placer.py), re-planned every iteration with its cold starts spread over the horizon."""

    def plan(forecast: np.ndarray, cluster: Cluster, previous: Placement | None, config: PlannerConfig) -> Placement:
        if config.model is None:
            raise ValueError("moeless's planner needs a latency model: PlannerConfig(model=LatencyModel(...))")

        def plan_layer(load, free, before, budget):
            layer, left, _ = place_fill(load, free, before, config.model, config.horizon, budget, split, warm)
            return layer, left

        return plan_layers(forecast, cluster, previous, plan_layer)

    return plan


def plan_static(forecast: np.ndarray, cluster: Cluster, previous: Placement | None, config: PlannerConfig) -> Placement:
    """Static EP (Megatron-LM): one replica per expert in contiguous blocks; ignores loads."""
    num_layers, num_experts = forecast.shape
    placement = Placement.static(num_layers, num_experts, cluster.num_gpus)
    check_memory(placement, cluster)
    return placement


# Every planner by name, in four groups: the default; the baselines it is measured against (the
# paper's planner, static EP, EPLB, the lossy Oracle); earlier moeless generations, kept as named
# baselines because docs/ compares with them (moeless-fill: re-plans every iteration by the lowest
# per-GPU work level; moeless-greedy: the straggler scaler then the priced placer); and ablations.
PLANNERS: dict[str, PlanFn | Fresh] = {
    DEFAULT_PLANNER: moeless_planner(),
    "paper": _layered("cv", "warm"),
    "static": plan_static,
    "eplb": plan_eplb(global_only=False),
    "eplb-global": plan_eplb(global_only=True),
    "oracle": plan_static,
    "moeless-no-scaler": moeless_planner(additions=False),
    "moeless-no-placer": moeless_planner(placer="off"),
    "moeless-no-scaler-no-placer": moeless_planner(additions=False, placer="off"),
    "moeless-cold": moeless_planner(warm=False),
    "moeless-free-memory": moeless_planner(price_memory=False),
    "moeless-no-moves": moeless_planner(moves=False),
    "moeless-fill": _filled(),
    "moeless-fill-no-scaler": _filled(split=False),
    "moeless-fill-cold": _filled(warm=False),
    "moeless-greedy": _layered("straggler", "priced"),
    "paper-no-scaler": _layered("off", "warm"),
    "paper-no-placer": _layered("cv", "off"),
    "paper-no-scaler-no-placer": _layered("off", "off"),
    "moeless-sets": moeless_sets(),
    "full-replication": plan_full_replication,
}
SAMPLE_PLANNERS = frozenset({"moeless-sets"})


# Planners with state: a fresh plan function per get_planner call.
# A factory returns the plan function, or (plan function, PlannerState) where its state learns or adopts.
STATEFUL_PLANNERS: dict[str, Callable[[], "PlanFn | tuple[PlanFn, PlannerState]"]] = {
    "eplb-window": plan_eplb_window, "eplb-production": production_eplb_with_state}


def initial_placement(planner: Planner, cluster: Cluster, num_layers: int, num_experts: int) -> Placement:
    """What a deployment has loaded before its first request: the planner's own layout where it
    keeps a fixed one (full replication; production EPLB's start, SGLang's trivial layout), else static EP's."""
    if planner.name == "full-replication":
        return plan_full_replication(np.zeros((num_layers, num_experts)), cluster, None, planner.config)
    if planner.name == "eplb-production":
        return production_eplb()(np.ones((num_layers, num_experts)), cluster, None, planner.config)
    return Placement.static(num_layers, num_experts, cluster.num_gpus)


def get_planner(spec: str, config: PlannerConfig | None = None) -> Planner:
    """A planner by name (a key of PLANNERS or STATEFUL_PLANNERS) or "module:function" naming a PlanFn."""
    config = config or PlannerConfig()
    if spec in STATEFUL_PLANNERS:
        made = STATEFUL_PLANNERS[spec]()
        plan_fn, state = made if isinstance(made, tuple) else (made, None)
        return Planner(spec, plan_fn, config, state=state)
    if spec in PLANNERS:
        fn = PLANNERS[spec]
        if isinstance(fn, Fresh):
            plan_fn, state = fn.make()
            return Planner(spec, plan_fn, config, state=state)
        return Planner(spec, fn, config, oracle_load if spec == "oracle" else None)
    if ":" not in spec:
        raise ValueError(f"unknown planner {spec!r}; use one of {sorted([*PLANNERS, *STATEFUL_PLANNERS])} or 'module:function'")
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot load planner {spec!r}: {err}") from err
    if not callable(fn):
        raise ValueError(f"planner {spec!r} is not callable; it must be (forecast, cluster, previous, config) -> Placement")
    return Planner(spec, fn, config)
