"""`moeless bench serve`'s paired path: the node-local path with dispatch-time pairing on.

Every host holds every expert (full replication, placement/full_replication.py: static EP's homes
listed first, copies after them with share 0), and every MoE-layer call's tokens are paired with
the replicas on this batch's own loads by the serving path's rule (serving/relevel.py ->
placement/shares.actual_shares -> placement/dispatch.py): the check behind serving's per-layer,
per-phase gate (placement/check_gate.py: a layer whose recent checks did not pay skips the check
and keeps static EP's split), the pairing where the most it can save beats its own measured cost.
Its seconds are inside the layer call the bench times (the path pays them), and counted apart
here: microseconds per layer call, how many calls checked, skipped and paired. Replicas are loaded
before the warm-up, so no call meets a cold start.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from moeless.hardware.host_profile import CALL_EXPERTS, fit_host_calls, split_exact
from moeless.model.interface import Routing
from moeless.placement.cluster import Cluster
from moeless.placement.full_replication import plan_full_replication
from moeless.placement.latency_model import LatencyModel
from moeless.placement.check_gate import CheckGate
from moeless.placement.timing import measure_relevel_check_s, measure_relevel_s
from moeless.placement.types import LayerPlacement, Placement
from moeless.serving.path_timing import phase_of
from moeless.serving.relevel import routed_shares


class TimedRelevel:
    """serving/relevel.relevel_for's rule (`routed_shares` behind a CheckGate), each call timed:
    samples of (seconds, checked, paired). A call is a prefill's where it has more tokens than the
    batch has rows (serving/path_timing.phase_of), for the gate's per-phase records."""

    def __init__(self, model: LatencyModel, relevel_s: float, check_s: float, batch: int, split: bool = True):
        self.model, self.relevel_s, self.check_s, self.batch, self.split = model, relevel_s, check_s, batch, split
        self.gate, self.samples = CheckGate(check_s), []

    def __call__(self, layer: int, placement: LayerPlacement, routing: Routing, num_hosts: int) -> LayerPlacement:
        start = time.perf_counter()
        phase = phase_of(routing.idx.shape[0], self.batch)
        routed = routed_shares(placement, routing, num_hosts, self.model, self.relevel_s, self.split, self.gate, layer, phase)
        self.samples.append((time.perf_counter() - start, routed.checked, routed.paired))
        return routed.layer

    def summary(self) -> dict[str, float]:
        """us per layer call (mean, median, p90; gate, check and pairing together), calls, calls
        checked (the rest skipped the check) and paired."""
        seconds = np.array([s for s, _, _ in self.samples]) if self.samples else np.zeros(1)
        return {"us_per_layer_mean": 1e6 * float(seconds.mean()), "us_per_layer_median": 1e6 * float(np.median(seconds)),
                "us_per_layer_p90": 1e6 * float(np.percentile(seconds, 90)), "calls": len(self.samples),
                "checked_calls": sum(checked for _, checked, _ in self.samples),
                "paired_calls": sum(paired for _, _, paired in self.samples), "relevel_s": self.relevel_s,
                "check_s": self.check_s, "splits": self.split}


def replicated_placement(num_layers: int, num_experts: int, hosts: int) -> Placement:
    """Every expert of every layer on every host, homes first (static EP's)."""
    cluster = Cluster.uniform(hosts, num_layers * num_experts, expert_bytes=1)
    return plan_full_replication(np.zeros((num_layers, num_experts)), cluster, None, None)


def preload(clients, placement: Placement) -> int:
    """Load every replica of the placement on its host and wait; returns how many."""
    count = 0
    for layer, lp in enumerate(placement.layers):
        for expert, gpu in zip(lp.expert.tolist(), lp.gpu.tolist()):
            clients[gpu].load(layer, expert, wait=True)
            count += 1
    return count


def pairing_figures(dispatch: dict[str, float], model: LatencyModel, paired_ms: dict[str, Any],
                    static_ms: dict[str, Any]) -> dict[str, Any]:
    """The paired path against the same transport's static EP in the same run: the ratio of MoE-layer
    ms (p50 and p90) per phase, and the pairing's own cost (dispatch: TimedRelevel.summary())."""
    phases = [p for p in ("prefill", "decode", "all") if p in paired_ms and p in static_ms]
    return {"latency_model": {"alpha": model.alpha, "beta": model.beta, "call_overhead": model.call_overhead},
            "dispatch": dispatch,
            "ratio_to_static_local": {p: paired_ms[p]["median"] / static_ms[p]["median"] for p in phases},
            "ratio_to_static_local_p90": {p: paired_ms[p]["p90"] / static_ms[p]["p90"] for p in phases}}


def timed_relevel(client, hidden: int, num_experts: int, hosts: int, batch: int) -> TimedRelevel:
    """The pairing rule on the host's costs as the planning loop fits them (hardware/host_profile.py:
    alpha and the per-expert call overhead inside a host call, not the call's round trip), its own
    cost (relevel_s) and the check's (the gate's price of a check) measured here on this layer's
    shape; experts split only where the host is split-exact (host_profile.split_exact), as
    serving/live.py decides; batch: rows of the bench's batches (a prefill's calls have more tokens)."""
    fit = fit_host_calls(client, hidden, experts=tuple(m for m in CALL_EXPERTS if m <= num_experts), repeats=5)
    model = LatencyModel(alpha=fit["alpha"], beta=fit["beta"], cold_start=0.0, call_overhead=fit["call_overhead"])
    return TimedRelevel(model, measure_relevel_s(num_experts, hosts, model), measure_relevel_check_s(num_experts, hosts, model),
                        batch, split_exact(client, hidden))
