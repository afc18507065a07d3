"""Wiring of the live loop into the serving app.

`start_live` puts a serving replica (ModelServer) on the loop: its RemoteExecutor re-levels shares
per layer (moeless's planners), a LiveExecutor around it forecasts and reports every forward
(serving/live_executor.py), a ReportSender carries the reports to the planning loop actor, which
the first replica creates (controller/planning/actor.py).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from moeless.controller.planning.actor import plan_loop
from moeless.controller.planning.settings import LoopSettings
from moeless.controller.planning.knob_sources import knob_source_for
from moeless.controller.planning.report_sender import ReportSender
from moeless.controller.planning.rules import live_planner_name
from moeless.controller.pool.wake import wake_timeout_s
from moeless.placement.check_gate import CheckGate
from moeless.placement.planner import relevels
from moeless.serving.live_executor import LiveExecutor
from moeless.serving.relevel import relevel_for
from moeless.hardware.host_profile import split_exact


@dataclass
class LiveParts:
    """A serving replica's part of the loop: its executor, report sender and the loop actor."""

    executor: Any  # live_executor.LiveExecutor
    sender: Any  # controller/planning/report_sender.ReportSender
    loop: Any  # the PlanLoop actor handle
    profile: Any  # the CostProfile the loop plans with


def start_live(config, model, remote, runtime=None, profile=None) -> LiveParts:
    """Put a ModelServer on the loop. model: the served model (experts dropped); remote: its
    RemoteExecutor; runtime: the PredictionRuntime (predictor/build.build_predictor, None without
    one); profile: a CostProfile (default: the loop measures one on host 0 at its start)."""
    import ray

    spec, knobs = model.spec, config.knobs
    knobs.check_for_model(spec.num_layers)
    non_expert = sum(p.numel() * p.element_size() for p in model.hf.parameters())
    settings = LoopSettings(pool=config.pool_source, num_layers=spec.num_layers,
                            num_experts=spec.num_experts, knobs=knobs, profile=profile, board=config.placement_board,
                            hidden_size=spec.hidden_size, non_expert_bytes=non_expert, replicas=config.num_replicas,
                            knob_source=knob_source_for(config.pool_source, config.knob_file),
                            host_model=config.host_model,
                            width_floor=config.step_hosts if config.step_slo_s is not None else None,
                            width_hold_s=config.step_hold_s, **dict(config.loop))
    loop = plan_loop(config.plan_loop, settings)
    # Also surfaces a loop that failed to start; one measuring the profile may first wake a pool at zero.
    waited = max(settings.first_host_wait_s, wake_timeout_s()) if profile is None else 0.0
    profile, _ = ray.get(loop.profile.remote(), timeout=120 + waited)
    latency = profile.latency_model("host")
    first = next((c for c in remote.clients if c is not None), None)  # none: a pool waking from zero
    remote.split_experts = first is not None and split_exact(first, spec.hidden_size)  # bit-identical outputs
    if relevels(live_planner_name(knobs)):
        # the twin's rule: the pairing priced by the layer's replicas, the check behind a per-layer gate
        remote.relevel = relevel_for(latency, profile.relevel_for, remote.split_experts, CheckGate(profile.check_s),
                                     phase=lambda: executor.phase)
    sender = ReportSender(loop)
    executor = LiveExecutor(remote, spec.num_layers, spec.num_experts, replica=uuid.uuid4().hex[:12], sink=sender.offer,
                            runtime=runtime, distance=knobs.distance, model=latency)
    return LiveParts(executor, sender, loop, profile)
