"""Wiring of the live loop into the serving app, and the app's configuration from outside.

`start_live` puts a serving replica (ModelServer) on the loop: its RemoteExecutor re-levels shares
per layer (moeless's planners), a LiveExecutor around it forecasts and reports every forward
(serving/forecasting.py), a ReportSender carries the reports to the planning loop actor, which
the first replica creates (serving/plan_loop.py). `loop_health` turns what the ingress last
heard from the loop into /healthz's words. `config_from_args` builds a ServeConfig from Ray
Serve's `args` (a RayService's import path, `app.app_from_args`), its hosts read by
serving/pool_sources.py (a fixed list, or a pool followed while serving).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

from moeless.knobs import KnobError, Knobs

@dataclass
class LiveParts:
    """A serving replica's part of the loop: its executor, report sender and the loop actor."""

    executor: Any  # forecasting.LiveExecutor
    sender: Any  # plan_loop.ReportSender
    loop: Any  # the PlanLoop actor handle


def start_live(config, model, remote, runtime=None, profile=None) -> LiveParts:
    """Put a ModelServer on the loop. model: the served model (experts dropped); remote: its
    RemoteExecutor; runtime: the PredictionRuntime (forecasting.build_predictor, None without
    one); profile: a CostProfile (default: the loop measures one on host 0 at its start)."""
    import ray

    from moeless.controller.live import live_planner_name
    from moeless.controller.planner import relevels
    from moeless.serving.forecasting import LiveExecutor, relevel_for
    from moeless.serving.plan_loop import LoopSettings, ReportSender, plan_loop
    from moeless.serving.wake import wake_timeout_s

    spec, knobs = model.spec, config.knobs
    knobs.check_for_model(spec.num_layers)
    non_expert = sum(p.numel() * p.element_size() for p in model.hf.parameters())
    settings = LoopSettings(pool=config.pool_source, num_layers=spec.num_layers,
                            num_experts=spec.num_experts, knobs=knobs, profile=profile, board=config.placement_board,
                            hidden_size=spec.hidden_size, non_expert_bytes=non_expert, replicas=config.num_replicas,
                            **dict(config.loop))
    loop = plan_loop(config.plan_loop, settings)
    # Also surfaces a loop that failed to start; one measuring the profile may first wake a pool at zero.
    waited = max(settings.first_host_wait_s, wake_timeout_s()) if profile is None else 0.0
    profile, _ = ray.get(loop.profile.remote(), timeout=120 + waited)
    latency = profile.latency_model("host")
    if relevels(live_planner_name(knobs)):
        remote.relevel = relevel_for(latency, len(remote.clients), profile.relevel_s)
    sender = ReportSender(loop)
    executor = LiveExecutor(remote, spec.num_layers, spec.num_experts, replica=uuid.uuid4().hex[:12], sink=sender.offer,
                            runtime=runtime, distance=knobs.distance, model=latency)
    return LiveParts(executor, sender, loop)


def loop_health(state: dict | None, seen_s: float | None, now_s: float, answered: bool) -> tuple[bool, dict]:
    """(degraded, the loop's part of /healthz) from the loop's last state the ingress got (None:
    never), when it got it (seen_s, wall clock) and whether the loop answered just now. A loop
    whose heartbeat is older than its threshold, or that does not answer for that long, is a stall."""
    if state is None:
        return False, {"state": "starting"}
    age = now_s - state["heartbeat_s"]
    detail = {"state": "running", "planner": state["planner"], "predictor": state["predictor"],
              "heartbeat_age_s": round(age, 3), "passes": state["passes"], "publishes": state["publishes"]}
    if state.get("last_error"):
        detail["last_error"] = state["last_error"]
    if age > state["stall_threshold_s"]:
        detail["state"] = f"degraded: planning loop stalled for {age:.1f} s" + ("" if answered else " (not answering)")
        return True, detail
    return False, detail


def config_from_args(args: Mapping[str, Any]):
    """A ServeConfig from Ray Serve's application args: {"config": knobs YAML file (optional),
    "model": "default" | "tiny:ARCH" | DIR (default "default"), "hosts": "host:port,..." or a pool
    such as "k8s://NS/POLICY:PORT?slots=N" (default: $MOELESS_EXPERT_HOSTS; serving/pool_sources.py),
    "replicas": serving replicas (default 1)}; the loop runs as in
    `moeless serve`. Raises KnobError for a bad value (the message names it)."""
    from moeless.serving.app import ServeConfig
    from moeless.serving.embedded import choose_model
    from moeless.serving.expert_hosts import HOSTS_ENV
    from moeless.serving.placement_board import BOARD_NAME
    from moeless.serving.pool_sources import StaticSource, pool_source
    from moeless.serving.plan_loop import LOOP_NAME

    unknown = sorted(set(args) - {"config", "model", "hosts", "replicas"})
    if unknown:
        raise KnobError(f"application args: unknown key {unknown[0]!r}; known: config, model, hosts, replicas")
    knobs = Knobs.from_yaml(args["config"]) if args.get("config") else Knobs()
    hosts = args.get("hosts") or os.environ.get(HOSTS_ENV)
    if not hosts:
        raise KnobError(f"no expert hosts: pass args.hosts or set {HOSTS_ENV} (host:port[,host:port...])")
    choice = choose_model(str(args.get("model", "default")))
    source = pool_source(str(hosts))
    fixed = isinstance(source, StaticSource)
    return ServeConfig(choice.name, choice.loader, source.addresses if fixed else (), pool=None if fixed else source,
                       num_replicas=int(args.get("replicas", 1)), placement_board=BOARD_NAME, knobs=knobs,
                       plan_loop=LOOP_NAME)
