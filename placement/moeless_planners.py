"""moeless's planners, each a plan function (placement/planner.py's interface): the default, which
plans the resident replicas around each expert's home, adds a copy only where it pays
(placement/resident_planner.py) and moves homes where the gates' loads say a new pairing pays
(placement/home_moves.py); its ablations; and moeless-sets, copies chosen for dispatch room per GB
(placement/replica_sets.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from moeless.placement.cluster import Cluster
from moeless.placement.home_fits import static_homes
from moeless.placement.home_moves import HomeMoves, add_moves
from moeless.placement.layer_plans import plan_layers
from moeless.placement.placer import place_round_robin
from moeless.placement.planner_config import PlannerConfig
from moeless.placement.replica_sets import choose_replicas
from moeless.placement.resident_planner import ReplicaCost, place_resident
from moeless.placement.types import Placement

PlanFn = Callable[[np.ndarray, Cluster, "Placement | None", PlannerConfig], Placement]


@dataclass(frozen=True)
class PlannerState:
    """A planner's state seen from outside: learn (an iteration's actual loads [L, E]), adopt (what
    the hosts hold [L, E, G] at its start), describe (its decisions, one line each)."""

    learn: Callable[[np.ndarray], None]
    adopt: Callable[[np.ndarray], None]
    describe: Callable[[], list[str]]


@dataclass(frozen=True)
class Fresh:
    """A planner with state of its own (its homes, its statistics): get_planner makes a new
    (plan, state) per planner, so two planners never share what they learnt."""

    make: Callable[[], tuple[PlanFn, PlannerState]]


def moeless_planner(additions: bool = True, warm: bool = True, placer: str = "resident", price_memory: bool = True,
                    moves: bool = True) -> Fresh:
    """moeless: the resident replicas re-levelled around each expert's home, a replica added only
    where it pays (placement/resident_planner.py), homes moved where the forecasts say a new pairing
    pays (placement/home_moves.py). additions=False: one replica per expert (scaler off);
    warm=False: ignores what is resident; placer="off": its counts placed round-robin;
    price_memory=False: memory is free; moves=False: static EP's homes for good."""

    def make() -> tuple[PlanFn, PlannerState]:
        state: dict = {"homes": None, "actual": [], "held": None}

        def learn(actual: np.ndarray) -> None:
            if moves:
                state["actual"].append(actual)

        def adopt(held: np.ndarray) -> None:  # taken by the homes made at the next plan
            state["held"] = held

        def plan(forecast: np.ndarray, cluster: Cluster, previous: Placement | None, config: PlannerConfig) -> Placement:
            if config.model is None:
                raise ValueError("moeless's planner needs a latency model: PlannerConfig(model=LatencyModel(...))")
            num_layers, num_experts = forecast.shape
            moved = state["homes"]
            if moves and (moved is None or not moved.fits(num_layers, num_experts, cluster.num_gpus)):
                moved = state["homes"] = HomeMoves(num_layers, num_experts, cluster.num_gpus,
                                                   config.home_moves_first, config.home_moves_every,
                                                   config.home_moves_submit)
                held, state["held"] = state["held"], None  # what the hosts held at the planner's start: used once
                if held is not None and held.shape == (num_layers, num_experts, cluster.num_gpus):
                    moved.adopt(held)
            if moves:  # a live knob (homeMovesEvery; 0: the homes stay where they are)
                moved.every = config.home_moves_every
            if moves:  # what ran since the last plan (the forecast itself where no gate reports)
                for actual in state["actual"] or ([] if moved.learnt else [forecast]):
                    moved.learn(actual)
                state["actual"] = []
            homes = moved.plan_call(config.model) if moves else np.tile(static_homes(num_experts, cluster.num_gpus),
                                                                         (num_layers, 1))
            # Layer l's loads can start at most l layers ahead (the iteration's first layer hides nothing).
            costs = iter([ReplicaCost(config.model, min(config.prefetch_layers, l), cluster.expert_bytes,
                                      config.keep_alive_s, config.gb_s_price if price_memory else 0.0, config.horizon,
                                      config.iteration_s) for l in range(num_layers)])
            layer_index = iter(range(num_layers))

            def plan_layer(load, free, before, budget):
                l = next(layer_index)
                before, serving = moved.settle(l, before) if moves else (before, None)
                layer, left, _ = place_resident(load, free, before if warm else None, next(costs),
                                                budget if additions else num_experts, config.static_margin, serving)
                if placer == "off":
                    layer, left = place_round_robin(load, layer.logcnt(num_experts), free)
                if moves:  # the new homes load behind serving, or the move is called off
                    layer, left, fits = add_moves(layer, homes[l], serving, left, budget - layer.num_replicas)
                    if not fits:
                        moved.cancel(l, serving)
                return layer, left

            placement = plan_layers(forecast, cluster, previous, plan_layer, homes)
            return replace(placement, release=moved.released()) if moves else placement

        def describe() -> list[str]:
            return state["homes"].describe() if state["homes"] is not None else []

        return plan, PlannerState(learn, adopt, describe)

    return Fresh(make)


def moeless_sets() -> PlanFn:
    """moeless-sets: each layer's copies chosen for dispatch room per GB on samples of the batches
    to come (placement/replica_sets.py), homes and resident copies kept; the data plane pairs each
    call's tokens with them. A single forecast [L, E] is one sample."""

    def plan(forecast: np.ndarray, cluster: Cluster, previous: Placement | None, config: PlannerConfig) -> Placement:
        if config.model is None:
            raise ValueError("moeless's planner needs a latency model: PlannerConfig(model=LatencyModel(...))")
        samples = forecast if forecast.ndim == 3 else forecast[None]
        costs = iter([ReplicaCost(config.model, min(config.prefetch_layers, l), cluster.expert_bytes, config.keep_alive_s,
                                  config.gb_s_price, config.horizon, config.iteration_s)
                      for l in range(samples.shape[1])])

        def plan_layer(layer_samples, free, before, budget):
            layer, left, _ = choose_replicas(layer_samples, free, before, next(costs), budget, config.dispatch_s)
            return layer, left

        return plan_layers(samples.transpose(1, 0, 2), cluster, previous, plan_layer)

    return plan
