"""The live planning loop in the twin, with the loop's own rules (controller/planning/rules.py), so
the twin plans when and as `moeless serve` does (TwinSettings.cadence "loop").

A pass every period_s of twin time (the first at the first iteration):
1. What the hosts hold (twin/hosts.py) as the loop reads it from their Status (`HostView`).
2. What to plan for (`forecast_groups`, `held_forecasts`): each phase's forecast merged (the
   mean; a planner on samples gets the reports themselves) over the reports of the last window_s, the reports being the past iterations' entries
   of the forecast kind (a serving replica reports each iteration's forecast); a phase without
   reports keeps its last forecast for keep-alive seconds. A stateful planner (EPLB's window)
   gets every reported iteration's entry since the last pass, one at a time. No report yet: the
   home replicas (`plan_groups`).
3. The plan (`plan_groups`: one plan per phase, their union resident), its loads sent at once
   (each GPU loads one after another), and what is published: the plan's loaded replicas
   (`publishable`), refreshed every iteration as loads land (the loop re-plans while loads are
   pending and publishes what landed).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from moeless.controller.planning.host_view import HostView
from moeless.controller.planning.rules import forecast_groups, held_forecasts, is_stateful, plan_groups, publishable
from moeless.placement.cluster import Cluster
from moeless.placement.planner import Planner
from moeless.placement.types import Placement
from moeless.twin.hosts import TwinHosts


class LoopMirror:
    """The loop's passes over one replay (module docstring). `step(i, now)` runs a pass when one
    is due; `published()` is what serving routes with now."""

    def __init__(self, planner: Planner, cluster: Cluster, hosts: TwinHosts, forecasts: np.ndarray,
                 phases: np.ndarray, times: np.ndarray, settings) -> None:
        self.planner, self.cluster, self.hosts = planner, cluster, hosts
        self.forecasts, self.phases, self.times, self.s = forecasts, phases, times, settings
        self.stateful = is_stateful(planner.name)
        self.layer_cap = cluster.layer_replica_cap()
        self.held: dict = {}
        self.plan: Placement | None = None
        self.last_pass = -np.inf
        self.reported = 0  # iterations reported so far (a stateful planner's next one to learn from)

    def step(self, i: int, now: float) -> tuple[np.ndarray, np.ndarray]:
        """A pass if one is due: (loads it sent, evictions they made), each per layer [L]."""
        loads = np.zeros(self.hosts.resident.shape[0], dtype=np.int64)
        evicted = loads.copy()
        if self.plan is not None and now - self.last_pass < self.s.period_s - 1e-12:
            return loads, evicted
        first, self.last_pass = self.plan is None, now
        view = HostView(self.hosts.resident, self.hosts.loading, np.ones(self.cluster.num_gpus, dtype=bool),
                        self.cluster.gpu_memory)
        reported = range(self.reported, i)
        self.reported = i
        recent = [j for j in range(i) if self.times[j] > now - self.s.window_s]
        groups = forecast_groups(first, False, bool(recent), self.stateful, [self.forecasts[j] for j in reported],
                                 lambda: self._phase_forecasts(recent, now))
        decision = plan_groups(self.planner, groups, view, self.cluster.expert_bytes, self.layer_cap, None, False)
        if decision is None:
            return loads, evicted
        for layer, expert, gpu in decision.loads:
            evicted += self.hosts.load(layer, expert, gpu, now)[1]
            loads[layer] += 1
        evicted += self.hosts.evict(np.array(decision.release, dtype=np.int64).reshape(-1, 3))
        self.plan = decision.plan
        return loads, evicted

    def published(self) -> Placement:
        """The plan's replicas that have landed (an expert none of whose planned replicas has keeps
        them: loaded on demand)."""
        return publishable(self.plan, self.hosts.resident)

    def _phase_forecasts(self, recent: Sequence[int], now: float) -> list[np.ndarray]:
        merged = {}
        for phase in ("prefill", "decode"):
            mine = [j for j in recent if self.phases[j] == phase]
            if mine:  # a sample planner plans on the reports themselves, the others on their mean
                merged[phase] = self.forecasts[mine] if self.planner.samples else np.mean(self.forecasts[mine], axis=0)
            else:
                merged[phase] = None
        out, self.held = held_forecasts(merged, self.held, now, self.s.keep_alive_s)
        return out
