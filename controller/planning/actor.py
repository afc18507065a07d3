"""The planning loop: one plan for the traffic of every serving replica (a named Ray actor).

    serving replicas --IterationReport (fire and forget, ReportSender)--> PlanLoop
    PlanLoop, on each report: the latency model refitted to the calls' measured compute (cost_fit)
    PlanLoop, every period_s:  hosts' Status (what is resident) + the merged reports
        --> the planner, with the refitted model (controller/planning/rules.py: plan_groups)
        --> Load RPCs (prefetch) to the hosts
        --> the loaded replicas of the plan on the placement board --> every serving replica

The hosts are the serving replicas' pool (controller/pool/sources.py), followed the same way: a slot with
no ready host (scaled in, draining, not started) counts as down, so every pass plans over the ready hosts
only, and a host that joins is planned for on the next pass, as is a pool whose slots grew or shrank
(maxHosts changed). A step scaler's spares (ready, past its width) wait for a batch's widen (widenings.py).

The decisions are pure functions (controller/planning/rules.py; what it plans for: settings.py); this
module only talks: Status and Load RPCs to the hosts, publishing on the board, a heartbeat (/healthz: a
loop whose heartbeat is older than stall_s), the figures /metrics reads.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import ray

from moeless.controller.knobs import KnobError, Knobs
from moeless.controller.planning.board import publish_placement, publish_standby
from moeless.controller.planning.cost_fit import OnlineCostFit
from moeless.controller.planning.host_calls import configure_host, host_statuses, load_all, send_actions
from moeless.controller.planning.knob_sources import follow_knobs
from moeless.controller.planning.names import NAMESPACE
from moeless.controller.planning.host_view import HostFigures, HostView
from moeless.controller.planning.rules import (LoopTerms, forecast_groups, held_forecasts, hosts_to_configure, loop_terms,
                                               pass_due, plan_groups, planner_config, restart_knobs_changed, to_publish)
from moeless.controller.planning.settings import LoopSettings
from moeless.controller.planning.step_scaler import PlacementWidth
from moeless.controller.planning.widenings import Widenings
from moeless.controller.planning.window import PHASES, Heartbeat, IterationReport, LiveStats, ReportWindow
from moeless.controller.pool.sources import follow_pool
from moeless.expert_fn.client.client import ExpertHostClient
from moeless.hardware.host_profile import calibrate_host
from moeless.placement.planner import get_planner
from moeless.placement.profile import CostProfile
from moeless.placement.types import Placement

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0, max_concurrency=8)
class PlanLoop:
    """The loop (a thread) and what callers ask of it (other threads of the actor)."""

    def __init__(self, settings: LoopSettings):
        self.pool, self.follower = follow_pool(settings.pool,
                                               lambda a: ExpertHostClient(a, timeout_s=settings.status_timeout_s,
                                                                          model=settings.host_model),
                                               settings.pool_period_s)
        num_hosts = self.pool.slots
        self.host_call_s = 0.0  # a host call's fixed cost, when the profile was measured here
        if settings.profile is None:
            with ExpertHostClient(self.follower.first_ready_address(settings.first_host_wait_s), timeout_s=60,
                                  model=settings.host_model) as client:
                costs = calibrate_host(client, settings.hidden_size, settings.non_expert_bytes, settings.num_experts,
                                       num_hosts)
            settings, self.host_call_s = replace(settings, profile=costs.profile), costs.host_call_s
        self.s = settings
        self._use(loop_terms(settings.knobs, settings.profile, settings.num_layers, settings.num_experts, settings.replicas))
        self.generation = 0  # of the knob source, applied (0: as started)
        self.knob_error = ""  # why the last change was refused ("": none)
        self.restart_pending: list[str] = []  # changed knobs that only a serving restart applies
        self._refused = -1
        self.fit, self.window = OnlineCostFit(self.host_call_s), ReportWindow(settings.window_s)
        self.stats, self.heartbeat = LiveStats(settings.num_layers), Heartbeat(time.time, settings.stall_s)
        self.started = time.time()
        self._lock = threading.RLock()  # metrics() reads state() under it
        self._actuals: list[np.ndarray] = []  # for stateful planners: every iteration's loads, in order
        self._learn: list[np.ndarray] = []  # every iteration's loads since the last pass (Planner.learn)
        self._planned = False  # the first pass loads the home replicas (the hosts start empty)
        self._held: dict[str, tuple[float, np.ndarray]] = {}  # phase -> (when, its last merged forecast)
        self._planner, self._published, self._releasing = None, None, None  # _releasing: the last plan
        self._version, self._fresh, self._pending_loads = 0, False, False  # _published's; reports since; loads sent
        self._refreshed, self.resident_replicas = 0.0, 0  # when the hosts were last read; the replicas they held
        self.counts = {"passes": 0, "plans": 0, "publishes": 0, "loads_sent": 0, "errors": 0, "reports": 0}
        self.plan_s, self.last_error = {"last": 0.0, "sum": 0.0}, ""
        self.hosts_live: list[bool] = [True] * num_hosts  # the hosts planned over (ready, within the width)
        self._seen: tuple[list[bool], np.ndarray] = ([], np.zeros((0, 0, 0), bool))  # the last pass's ready slots, all resident
        self.host_figures = HostFigures(num_hosts)  # each slot's memory, meters and GB·s across passes
        self._swaps = ThreadPoolExecutor(1, "home-swaps")  # a chance's candidate homes (placement/home_moves.py)
        self._publisher = ThreadPoolExecutor(1, "widen-publish")  # widen's publishes, after its caller has the placement
        self.widenings = Widenings(PlacementWidth(settings.width_floor, settings.width_hold_s), self._lock)
        self._now, self._stop = threading.Event(), threading.Event()  # _now: a pass now (a widening)
        self._thread = threading.Thread(target=self._run, name="plan-loop", daemon=True)
        self._thread.start()
        if settings.knob_source is not None:
            threading.Thread(target=follow_knobs, args=(settings.knob_source, self.set_knobs, self._refuse, self._stop,
                                                        settings.knob_period_s, lambda: (self.generation, self._refused)),
                             name="knob-follower", daemon=True).start()

    # --- what the serving replicas and the ingress call ------------------------------------

    def report(self, report: IterationReport) -> None:
        with self._lock:
            self.window.add(report)
            ran = report.layers.host_calls > 0
            self.stats.add(report, self.fit.predict(report.layers.model_s, ran))  # before the fit sees it
            self.fit.add(report.ended_s, report.layers.model_s, ran, report.layers.compute_s)
            self.counts["reports"] += 1
            self._fresh = True
            if self.stateful:
                self._actuals.append(report.actual)
            self._learn.append(report.actual)

    def widen(self, hosts: int, timeout_s: float = 5.0) -> tuple[int, int, Placement | None]:
        """A batch needs `hosts` hosts (serving/step_gate.py): one over more published (widenings.py), after
        timeout_s at the latest: (the hosts planned over, at most the ready ones; the board version to follow;
        the placement to run at once where widen loaded it itself, published by a thread of the loop's, else None)."""
        with self._lock:
            ticket = self.widenings.ask(hosts, asked := time.monotonic())
            self._fresh = self._fresh or ticket is not None
        placement = None if ticket is None or self.s.knobs.predictor == "off" else self.widenings.answer(
            ticket, *self._seen, lambda replicas: load_all(self.pool, replicas, timeout_s, self._seen[1]), self._publish,
            time.monotonic, self._publisher.submit)  # by the hosts as the last pass read them
        if ticket is not None and placement is None:
            self._now.set()  # a pass answers it (with the predictor off, publishing nothing)
        version = self.widenings.wait(None if placement is not None else ticket, asked + timeout_s - time.monotonic())
        return min(self.widenings.hosts(time.monotonic()) or hosts, len(self.pool.clients())), version, placement

    def cost_scale(self) -> float:
        """The refitted compute scale (cost_fit.py's a: the planners' profile over the calibration's), for
        the step scaler's price (serving/step_gate.FittedPrice)."""
        with self._lock:
            return self.fit.coefficients[0]

    def set_knobs(self, knobs: Knobs, generation: int) -> bool:
        """Plan by `knobs` from the next pass on (generation: the source's); False, keeping the running
        knobs, when they cannot serve this model (knob_error says why). The knobs a serving replica
        builds into its forward (rules.RESTART_KNOBS) are listed in restart_pending instead."""
        try:
            knobs = knobs.for_model(self.s.num_layers)  # as at start-up: a tiny model's default distance shortened
            terms = loop_terms(knobs, self.s.profile, self.s.num_layers, self.s.num_experts, self.s.replicas)
        except KnobError as err:
            self._refuse(generation, err)
            return False
        with self._lock:
            self.restart_pending = restart_knobs_changed(self.s.knobs, knobs)
            kept = {name: getattr(self.s.knobs, name) for name in self.restart_pending}
            if terms.planner != self.name:
                self._planner, self._actuals = None, []  # made again on the next pass
            self.s = replace(self.s, knobs=replace(knobs, **kept))
            self._use(terms)
            self.generation, self.knob_error = generation, ""
        return True

    def state(self) -> dict:
        """The loop's state for /healthz: heartbeat (wall clock), its age, a stall line or None."""
        with self._lock:
            return {"planner": self.name, "predictor": self.s.knobs.predictor, "memory_price": self.memory_price,
                    "generation": self.generation, "knob_error": self.knob_error,
                    "restart_pending": list(self.restart_pending), "heartbeat_s": self.heartbeat.last,
                    "heartbeat_age_s": self.heartbeat.age(), "stalled": self.heartbeat.stalled(),
                    "stall_threshold_s": self.s.stall_s, "last_error": self.last_error, **self.counts,
                    "hosts_live": list(self.hosts_live), "width": self.widenings.hosts(time.monotonic())}

    def metrics(self) -> dict:
        """Everything /metrics shows (see app.py's LoopCollector)."""
        with self._lock:
            return {**self.state(), "stats": self.stats.as_dict(), "plan_s": dict(self.plan_s),
                    "latency_fit": self.fit.as_dict(), "resident_replicas": self.resident_replicas,
                    "widenings": self.widenings.as_dict(), **self.host_figures.totals(),
                    "non_expert_gb_s": self.s.profile.non_expert_bytes / 1e9 * self.s.replicas * (time.time() - self.started)}

    def profile(self) -> tuple[CostProfile, float]:
        """(the cost profile the loop plans with, a host call's fixed cost in seconds if measured here)."""
        return self.s.profile, self.host_call_s

    def reset_stats(self) -> None:
        """Start the figures over (a benchmark's measured part begins)."""
        with self._lock:
            self.stats.reset()

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        self._stop.set()
        self._now.set()
        self._thread.join(timeout=10)
        for threads in (self._swaps, self._publisher):
            threads.shutdown(wait=False, cancel_futures=True)
        self.follower.close()
        self.pool.close()

    # --- the loop ----------------------------------------------------------------------------

    def _refuse(self, generation: int, err: Exception) -> None:
        with self._lock:
            self.knob_error, self._refused = f"generation {generation} refused: {err}", generation
        log.warning("knobs of generation %d refused, the running ones stay: %s", generation, err)

    def _use(self, terms: LoopTerms) -> None:
        self.name, self.stateful, self.layer_cap, self.memory_price = \
            terms.planner, terms.stateful, terms.layer_cap, terms.memory_price

    def _run(self) -> None:
        while True:
            self._now.wait(self.widenings.period(self.s.period_s))
            self._now.clear()
            if self._stop.is_set():
                break
            started, ticket = time.perf_counter(), self.widenings.pass_started()
            try:
                pending, failed = self._pass(), False
            except Exception as err:  # a failed pass is retried next period; the heartbeat says if it persists
                with self._lock:
                    self.counts["errors"] += 1
                    self.last_error = f"{type(err).__name__}: {err}"
                log.exception("planning pass failed")
                pending, failed = False, True  # a widening waiting on it: answered with what is published
            self.widenings.pass_ended(ticket, pending, self._version, time.monotonic())
            if failed:
                continue
            with self._lock:
                self.counts["passes"] += 1
                self.plan_s["last"] = time.perf_counter() - started
                self.plan_s["sum"] += self.plan_s["last"]
                self.last_error = ""
                self.heartbeat.beat()

    def _pass(self) -> bool:  # rules.py decides: read the hosts, plan, prefetch, publish; True: loads pending
        s = self.s
        with self._lock:
            due = pass_due(self._fresh, self._pending_loads, time.monotonic() - self._refreshed, s.idle_s)
            self._fresh = False
        if not due:
            return False
        self._refreshed, answered_before = time.monotonic(), self.widenings.answered
        # 1. What the hosts hold (the truth of what is resident), their meters.
        statuses = host_statuses(self.pool)  # an empty slot: None, planned around
        self._fit_slots(len(statuses))
        for i in hosts_to_configure(statuses, s.knobs.keep_alive_s, s.host_model is not None):
            configure_host(self.pool, i, s.knobs.keep_alive_s)
        with self._lock:  # the step scaler's spares: ready, planned around (the slots past its width)
            active = self.widenings.width.active_slots([st is not None for st in statuses], time.monotonic())
        every, mask = HostView.from_status(statuses, s.num_layers, s.num_experts), np.asarray(active)  # spares' too
        view = HostView(every.resident & mask, every.loading & mask, every.live & mask, np.where(mask, every.memory, 0.0))
        with self._lock:
            # plan for a host that came or went, and again until a widening's loads are published
            joined = self._planned and (view.live.tolist() != self.hosts_live or self.widenings.open())
            self.hosts_live, self._seen = view.live.tolist(), ([st is not None for st in statuses], every.resident)
            self.resident_replicas = int(view.resident.sum())
            self.host_figures.update(statuses, view)
            now = time.time()
            iteration_s = self.window.iteration_s(now)
            first, self._planned = not self._planned, True
            groups = forecast_groups(first, joined, bool(self.window.reports(now)), self.stateful, self._actuals,
                                     lambda: self._phase_forecasts(now))
            if self.stateful:  # every iteration's loads, each planned once
                self._actuals = []
            learnt, self._learn = self._learn, []
        # what a replica's step scaler may switch to at once: held whole until the next pass, idle at the latest
        if (standby := self.widenings.standby_changed(self._seen[0], every.lasting(s.idle_s + s.period_s))) is not None:
            publish_standby(standby, self.s.board)
        if not view.live.any():
            return False
        # 2. The plan; 3. prefetch what it needs; 4. publish what is loaded.
        off = s.knobs.predictor == "off"
        made = self._planner is None
        planner = self._planner_for(iteration_s, get_planner)
        if made:  # a restarted loop keeps the homes its predecessor moved
            planner.adopt(view.resident & view.live[None, None, :])
        planner.learn(*learnt)  # what ran since the last pass
        decision = plan_groups(planner, groups, view, s.profile.expert_bytes, self.layer_cap, self.host_figures.memory, off)
        self._releasing = self._releasing if decision is None else decision.plan  # its release: evicted once unrouted
        routed = self._published.replicas() if self._published else None
        free = self._releasing.releasable(view.resident & view.live[None, None, :]) if self._releasing else []
        gone = [(*r, "evict") for r in free if routed is not None and r not in routed]
        send_actions(self.pool, [*gone, *((*r, "load") for r in (decision.loads if decision else []))], every.resident)
        if decision is None:  # a stateful planner without new iterations, or no traffic: nothing to change
            return False
        self._pending_loads = bool(decision.loads)
        with self._lock:
            self.counts["plans"] += len(groups)
            self.counts["loads_sent"] += len(decision.loads)
        publish = to_publish(self._published, decision, off, self.name)
        if publish is not None:
            self._publish(publish, view.live, answered_before)
        return self._pending_loads

    def _publish(self, placement, live, answered_before: int | None = None) -> int:
        with self._lock:  # one publisher at a time: a pass, or widen answering
            if placement is self._published or answered_before is not None and self.widenings.answered > answered_before:
                return self._version  # a widening published over other hosts since this pass read them
            self._version, self._published = publish_placement(placement, self.s.board), placement
            self.widenings.published(live, placement)
            self.counts["publishes"] += 1
            return self._version

    def _phase_forecasts(self, now: float) -> list[np.ndarray]:
        """Each phase's merged forecast over the window, or its held one (rules.held_forecasts). Call
        under the lock."""
        source = "forecast" if self.s.knobs.predictor == "gate" else "actual"
        gather = self.window.samples if self._planner is not None and self._planner.samples else self.window.merged
        merged = {phase: gather(now, source, phase) for phase in PHASES}
        out, self._held = held_forecasts(merged, self._held, now, self.s.knobs.keep_alive_s)
        return out

    def _fit_slots(self, slots: int) -> None:
        """Size the per-host figures to the pool's slots now (maxHosts changed while serving); a
        stateful planner, whose history is of the old hosts, is made again."""
        with self._lock:
            was = len(self.host_figures.memory)
            if not self.host_figures.resize(slots):
                return
            log.info("planning over %d expert-host slots, was %d", slots, was)
            if self.stateful:
                self._planner, self._actuals = None, []

    def _planner_for(self, iteration_s: float, get_planner):
        """The configured planner (made once: stateful ones keep their history), its config following
        the measured iteration time."""
        with self._lock:
            profile = self.fit.scaled(self.s.profile)
        extra = {"home_moves_submit": self._swaps.submit, **self.s.planner_extra}
        config = planner_config(self.s.knobs, profile, iteration_s, extra, num_layers=self.s.num_layers,
                                num_experts=self.s.num_experts, serving_replicas=self.s.replicas)
        if self._planner is None:
            self._planner = get_planner(self.name, config)
        elif not self.stateful:
            self._planner = replace(self._planner, config=config)
        return self._planner


def plan_loop(name: str, settings: LoopSettings | None = None):
    """The named loop actor: created with `settings` if it does not exist yet (the first serving
    replica creates it; the others and the ingress get the same one)."""
    if settings is None:
        return ray.get_actor(name, namespace=NAMESPACE)
    return PlanLoop.options(name=name, namespace=NAMESPACE, get_if_exists=True, lifetime="detached").remote(settings)
