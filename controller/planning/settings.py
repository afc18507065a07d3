"""What the planning loop (controller/planning/actor.py) plans for: its LoopSettings, plain data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moeless.controller.knobs import Knobs
from moeless.placement.profile import CostProfile


@dataclass(frozen=True)
class LoopSettings:
    """What the loop plans for: the hosts (`pool`, a PoolSource read every pool_period_s; slot i
    is the placement's GPU i), the model's shape,
    the knobs, the cost profile (None: measured on host 0 at start, hardware/host_profile.py), the
    board to publish on; period_s: seconds between passes (a pass plans when reports came in or
    loads are pending, else only refreshes what the hosts hold every idle_s; without traffic in the
    window it sends no loads, so keep-alive can evict idle replicas, except on the first pass and
    when a host comes or goes); window_s: the reports
    a forecast merges; stall_s: a heartbeat older than this is a stall; status_timeout_s: a host
    slower than this to answer Status counts as down for the pass; replicas: serving replicas
    (non-expert memory); planner_extra: other PlannerConfig fields."""

    pool: Any
    num_layers: int
    num_experts: int
    knobs: Knobs
    profile: CostProfile | None
    board: str
    hidden_size: int = 0
    non_expert_bytes: int = 0
    replicas: int = 1
    period_s: float = 0.25
    idle_s: float = 1.0
    window_s: float = 2.0
    stall_s: float = 3.0
    status_timeout_s: float = 1.0
    planner_extra: dict = field(default_factory=dict)
    pool_period_s: float = 1.0
    first_host_wait_s: float = 60.0  # measuring the profile needs a ready host: how long to wait for one (PoolFollower.first_ready_address)
    knob_source: Any = None  # controller/planning/knob_sources.py: knobs followed while running (None: fixed)
    host_model: str | None = None  # the name the hosts serve this model by (None: their only one)
    knob_period_s: float = 1.0
    width_floor: int | None = None  # the step scaler: hosts always planned over (None: every ready host; step_scaler.py)
    width_hold_s: float = 2.0  # ... and how long a widening outlives the last batch that needed it
