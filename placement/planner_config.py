"""The knobs of every planner in one PlannerConfig (placement/planner.py binds it to a plan function)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from moeless.placement.fill_placer import HORIZON
from moeless.placement.latency_model import LatencyModel
from moeless.placement.resident_planner import MARGIN


@dataclass(frozen=True)
class PlannerConfig:
    """Knobs of all planners (each planner reads the ones it needs).

    model: measured latency model (moeless prices replicas with it; its cold_start is one load from
           the host memory tier);
    cv_threshold: the paper's V; slack: moeless's straggler slack over the balanced GPU load;
    dead_band: hysteresis added to the stopping rule before a layer's counts are re-planned;
    min_replicas / max_replicas: per expert (max defaults to the GPU count);
    horizon: iterations over which moeless counts a new replica's gain (and moeless-fill spreads a
             new plan's cold starts); fill_placer.HORIZON = 30, about 1.5 s of serving;
    prefetch_layers: d, layers a forecast looks ahead (a load started then hides d layer times);
    keep_alive_s: how long an unused replica stays resident (memory a new replica holds at least);
    gb_s_price: seconds of layer time one GB·s of replica memory is worth (0: memory is free; the
                benches and the live loop set it: knob memoryPrice, by default
                CostProfile.memory_neutral_price);
    iteration_s: seconds one serving iteration takes (memory held over the horizon);
    static_margin: the fraction of static EP's time (on the forecast) moeless must save before it
                   leaves static EP's split (resident_planner.MARGIN);
    eplb_replicas: EPLB's replicas per layer (default: the smallest multiple of G >= E);
    eplb_groups / eplb_nodes: EPLB's expert groups and nodes (hierarchical packing);
    eplb_window / eplb_period: "eplb-window" re-plans every period iterations from the loads of
    the last window iterations (DeepSeek's usage; never the current iteration's loads);
    dispatch_s: what each call of a layer with copies pays the data plane (its pairing and the
    check whether it pays; the cost profile's relevel_s + check_s): moeless-sets prices it;
    eplb_redundant / eplb_rebalance_every / eplb_first_rebalance: "eplb-production" (production
    EPLB: eplb_production.py): redundant experts per layer (None: E / 8), iterations between
    rebalances, iterations of statistics before the first;
    home_moves_first / home_moves_every: moeless's home moves (home_moves.py): plans of statistics
    before the first chance to move, plans between chances (a layer moves only where it pays; on
    FLAME's 8 A6000 and 16 H100 cells 10 / 50 was best or within a point of the best of seven
    schedules, production EPLB's 50 / 1000 among them: docs/deployments.md);
    home_moves_submit: runs a chance's candidate homes elsewhere, an Executor's submit (f, *args) ->
    a future; judged at the first plan after it is done (the live loop's thread; None: in place, as
    the twin and `moeless plan` do).
    """

    model: LatencyModel | None = None
    cv_threshold: float = 0.2
    slack: float = 0.0
    dead_band: float = 0.0
    min_replicas: int = 1
    max_replicas: int | None = None
    horizon: float = HORIZON
    prefetch_layers: int = 1
    keep_alive_s: float = 60.0
    gb_s_price: float = 0.0
    iteration_s: float = 0.05
    static_margin: float = MARGIN
    eplb_replicas: int | None = None
    eplb_groups: int = 1
    eplb_nodes: int = 1
    eplb_window: int = 10
    eplb_period: int = 10
    dispatch_s: float = 0.0
    eplb_redundant: int | None = None
    eplb_rebalance_every: int = 1000
    eplb_first_rebalance: int = 50
    home_moves_first: int = 10
    home_moves_every: int = 50
    home_moves_submit: Callable[..., Any] | None = None
