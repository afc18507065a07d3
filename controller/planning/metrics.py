"""The live loop's Prometheus metrics, exposed by the ingress at /metrics (a collector read at scrape).

From the planning loop's figures (every serving replica's reports, the hosts' meters): MoE-layer
time per phase (histogram), per-layer load max/mean, host imbalance and CV, replicas resident,
cold starts (hidden and exposed seconds, from the hosts), the predictor's online accuracy, the
latency model's refit and error, plan time, GB·s (experts: the hosts' meters, the model's split of
replicas it shares with other models; non-expert: its bytes x serving replicas x seconds), its own and
shared replicas, the time forecasting added to forwards, and the loop's heartbeat age as the ingress sees it (so a
loop that stopped answering still shows, its age growing).
"""

from __future__ import annotations

import math
from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "moeless"


class LoopCollector(Collector):
    """Yields the metrics of the last snapshot the ingress fetched (`update`); with a model, every
    sample is labelled model="NAME" (an app serving several models has one loop, one collector each)."""

    def __init__(self, model: str | None = None) -> None:
        self.model = model
        self.snapshot: dict | None = None
        self.heartbeat_age_s = 0.0
        self.stalled = False

    def update(self, snapshot: dict | None, heartbeat_age_s: float, stalled: bool) -> None:
        if snapshot is not None:
            self.snapshot = snapshot
        self.heartbeat_age_s, self.stalled = heartbeat_age_s, stalled

    def collect(self) -> Iterator[Metric]:
        for family in self._families():
            if self.model is not None:
                samples = [s._replace(labels={**s.labels, "model": self.model}) for s in family.samples]
                family.samples = samples
            yield family

    def _families(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(f"{PREFIX}_plan_loop_heartbeat_age_seconds",
                                "seconds since the planning loop last finished a pass", value=self.heartbeat_age_s)
        yield GaugeMetricFamily(f"{PREFIX}_plan_loop_stalled", "1 while the planning loop's heartbeat is older than "
                                "its threshold", value=float(self.stalled))
        s = self.snapshot
        if s is None:
            return
        yield CounterMetricFamily(f"{PREFIX}_plan_loop_passes", "planning passes finished", value=s["passes"])
        yield CounterMetricFamily(f"{PREFIX}_plan_loop_errors", "planning passes that failed", value=s["errors"])
        yield CounterMetricFamily(f"{PREFIX}_placements_published", "placements published to the serving replicas",
                                  value=s["publishes"])
        yield CounterMetricFamily(f"{PREFIX}_prefetch_loads_sent", "replica loads the loop sent ahead (prefetch)",
                                  value=s["loads_sent"])
        yield GaugeMetricFamily(f"{PREFIX}_plan_last_seconds", "wall time of the last planning pass (status, plan, loads, "
                                "publish)", value=s["plan_s"]["last"])
        yield CounterMetricFamily(f"{PREFIX}_plan_seconds", "wall time of all planning passes", value=s["plan_s"]["sum"])
        stats = s["stats"]
        histogram = HistogramMetricFamily(f"{PREFIX}_moe_layer_seconds", "MoE-layer expert call as a serving replica "
                                          "waited for it (scatter, hosts, gather)", labels=["phase"])
        for phase, p in stats["phases"].items():
            cumulative, buckets = 0, []
            for bound, count in zip([*p["time_buckets"], math.inf], p["bucket_counts"]):
                cumulative += count
                buckets.append(("+Inf" if bound == math.inf else repr(bound), cumulative))
            histogram.add_metric([phase], buckets, sum(p["sum_wall_s"]))
        yield histogram
        forecast = CounterMetricFamily(f"{PREFIX}_forecast_seconds", "time forecasting added to forward passes",
                                       labels=["phase"])
        for phase, p in stats["phases"].items():
            forecast.add_metric([phase], p["forecast_s"])
        yield forecast
        for name, key, doc in (("layer_load_max_over_mean", "load_max_over_mean", "the busiest expert's tokens over the "
                                "mean expert's (last call)"),
                               ("layer_host_imbalance", "imbalance", "the busiest host's tokens over the mean host's "
                                "(last call)"),
                               ("layer_load_cv", "cv", "coefficient of variation of the replicas' tokens (last call)")):
            gauge = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["layer"])
            for layer, value in enumerate(stats[key]):
                gauge.add_metric([str(layer)], value)
            yield gauge
        yield GaugeMetricFamily(f"{PREFIX}_expert_replicas_resident", "expert replicas loaded on the live hosts",
                                value=s["resident_replicas"])
        kinds = GaugeMetricFamily(f"{PREFIX}_expert_replicas_by_kind", "resident replicas the model uses alone (own) "
                                  "or with other models of the same hosts (shared: one per content key, its GB·s split)",
                                  labels=["kind"])
        kinds.add_metric(["own"], s.get("own_replicas", 0))
        kinds.add_metric(["shared"], s.get("shared_replicas", 0))
        yield kinds
        yield CounterMetricFamily(f"{PREFIX}_cold_starts", "invocations that waited for a replica to load (hosts)",
                                  value=s["cold_starts"])
        yield CounterMetricFamily(f"{PREFIX}_cold_start_hidden_seconds", "cold-start seconds prefetching hid (hosts)",
                                  value=s["cold_hidden_s"])
        yield CounterMetricFamily(f"{PREFIX}_cold_start_exposed_seconds", "cold-start seconds invocations waited "
                                  "(hosts)", value=s["cold_exposed_s"])
        accuracy = stats["accuracy"]
        yield GaugeMetricFamily(f"{PREFIX}_predictor_online_accuracy", "the predictor's load accuracy over its recent "
                                "forecasts (NaN: none)", value=accuracy if accuracy is not None else math.nan)
        yield GaugeMetricFamily(f"{PREFIX}_knobs_generation", "the knobs' generation the planning loop runs (its policy's "
                                "metadata.generation on Kubernetes, the --config file's changes locally; 0: as started)",
                                value=s.get("generation", 0))
        yield GaugeMetricFamily(f"{PREFIX}_knobs_refused", "1 while the latest knobs were refused (the running ones stay; "
                                "/healthz says why)", value=float(bool(s.get("knob_error"))))
        yield GaugeMetricFamily(f"{PREFIX}_memory_price", "seconds of MoE-layer time one GB·s of replica memory is "
                                "worth to the planner (knob memoryPrice; unset: memory-neutral)", value=s["memory_price"])
        fit = s["latency_fit"]
        yield GaugeMetricFamily(f"{PREFIX}_latency_model_scale", "the latency model refitted on the running machine: "
                                "measured compute / the calibrated model's (a)", value=fit["a"])
        yield GaugeMetricFamily(f"{PREFIX}_latency_model_call_seconds", "the refitted model's fixed compute per host "
                                "call (b)", value=fit["b_s"])
        error = GaugeMetricFamily(f"{PREFIX}_latency_model_error_ratio", "the latency model's predicted expert compute "
                                  "over the measured, minus 1 (calibrated: as calibrated at start; online: refitted, "
                                  "each call predicted before it was seen)", labels=["phase", "model"])
        for phase, p in stats["phases"].items():
            measured = sum(p["sum_compute_s"])
            for model, key in (("calibrated", "sum_model_s"), ("online", "sum_model_online_s")):
                error.add_metric([phase, model], sum(p[key]) / measured - 1.0 if measured > 0 else math.nan)
        yield error
        yield CounterMetricFamily(f"{PREFIX}_expert_gb_seconds", "GB·s of expert replica memory (hosts' meters; a "
                                  "replica shared with other models: this model's split)",
                                  value=s["expert_gb_s"])
        yield CounterMetricFamily(f"{PREFIX}_non_expert_gb_seconds", "GB·s of non-expert weights (bytes x serving "
                                  "replicas x seconds)", value=s["non_expert_gb_s"])
        if s.get("width") is not None:  # the step scaler (controller/planning/step_scaler.py)
            yield GaugeMetricFamily(f"{PREFIX}_step_width_hosts", "the ready hosts the loop plans over (the step "
                                    "scaler's width; the others are spares)", value=s["width"])
            yield CounterMetricFamily(f"{PREFIX}_step_widenings", "widenings the step scaler asked of the loop",
                                      value=s["widenings"]["asked"])
            yield CounterMetricFamily(f"{PREFIX}_step_widenings_warm", "widenings answered at once from a placement "
                                      "the spares still held (republished if another was since; no planning pass)",
                                      value=s["widenings"].get("warm", 0))
            yield CounterMetricFamily(f"{PREFIX}_step_widenings_cold", "widenings answered by loading what the "
                                      "spares lacked of the placement last published over them, or of static EP's "
                                      "blocks the first time (no planning pass)",
                                      value=s["widenings"].get("cold", 0))


class LoopsCollector(Collector):
    """Several loops' collectors as one (each labelled by its model): a family per metric, with
    every loop's samples in it (Prometheus' text format wants each family once)."""

    def __init__(self, collectors: list[LoopCollector]) -> None:
        self.collectors = collectors

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for collector in self.collectors:
            for family in collector.collect():
                if family.name in merged:
                    merged[family.name].samples.extend(family.samples)
                else:
                    merged[family.name] = family
        yield from merged.values()


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
    detail["knobs_generation"] = state.get("generation", 0)
    for key in ("knob_error", "restart_pending"):
        if state.get(key):
            detail[key] = state[key]
    if age > state["stall_threshold_s"]:
        detail["state"] = f"degraded: planning loop stalled for {age:.1f} s" + ("" if answered else " (not answering)")
        return True, detail
    return False, detail
