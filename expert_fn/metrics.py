"""Prometheus exposition of a host's meters: a collector read at scrape time.

Per replica (labels layer, expert): GB·s, bytes held, loads, cold starts, invocations, tokens.
Per host: the same totals, load seconds, evictions, Invoke calls and calls in flight.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from moeless.expert_fn.runtime import ExpertHostRuntime

PREFIX = "moeless_expert"


class RuntimeCollector(Collector):
    """Reads ExpertHostRuntime.status() on every scrape."""

    def __init__(self, runtime: ExpertHostRuntime) -> None:
        self._runtime = runtime

    def collect(self) -> Iterator[Metric]:
        status = self._runtime.status()
        per_replica = {
            "gb_seconds": (CounterMetricFamily, "GB·s of memory held by the replica (load start to eviction)", "gb_s"),
            "bytes_held": (GaugeMetricFamily, "bytes the replica holds now", "bytes"),
            "invocations": (CounterMetricFamily, "Invoke calls that carried tokens for the replica", "invocations"),
            "tokens": (CounterMetricFamily, "tokens the replica computed", "tokens"),
            "loads": (CounterMetricFamily, "loads of the replica from the weight store", "loads"),
            "cold_starts": (CounterMetricFamily, "invocations that waited for the replica to load", "cold_starts"),
        }
        for name, (family, doc, field) in per_replica.items():
            metric = family(f"{PREFIX}_replica_{name}", doc, labels=["layer", "expert"])
            for r in status["replicas"]:
                metric.add_metric([str(r["layer"]), str(r["expert"])], r[field])
            yield metric
        totals = status["meters"]
        host = {
            "gb_seconds": (CounterMetricFamily, "GB·s of replica memory held on this host", "gb_s"),
            "bytes_held": (GaugeMetricFamily, "replica bytes held (loading or resident)", "bytes_held"),
            "loads": (CounterMetricFamily, "replica loads from the weight store", "loads"),
            "load_failures": (CounterMetricFamily, "replica loads that failed", "load_failures"),
            "load_seconds": (CounterMetricFamily, "seconds spent loading replicas", "load_s_sum"),
            "cold_starts": (CounterMetricFamily, "invocations that waited for a replica to load", "cold_starts"),
            "evictions": (CounterMetricFamily, "replicas evicted", "evictions"),
            "invocations": (CounterMetricFamily, "Invoke calls (one per layer per call)", "invocations"),
            "tokens": (CounterMetricFamily, "tokens computed", "tokens"),
        }
        for name, (family, doc, field) in host.items():
            yield family(f"{PREFIX}_host_{name}", doc, value=totals[field])
        yield GaugeMetricFamily(f"{PREFIX}_host_inflight", "Invoke calls running now", value=status["inflight"])
        yield GaugeMetricFamily(f"{PREFIX}_host_memory_bytes", "replica memory capacity", value=status["memory_bytes"])
        ready = status["health"] == "serving"
        yield GaugeMetricFamily(f"{PREFIX}_host_ready", "1 while serving, 0 starting or draining", value=ready)


def registry_for(runtime: ExpertHostRuntime) -> CollectorRegistry:
    """A registry of its own per host, so several hosts in one process do not collide."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RuntimeCollector(runtime))
    return registry
