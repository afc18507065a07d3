"""Prometheus exposition of a host's meters: a collector read at scrape time.

Per replica (labels model, layer, expert; the layer is the model's own; a replica several models
share, one per content key, is labelled with the first model's numbers): GB·s, bytes held, loads,
cold starts, invocations, tokens, and how many models it computes for (`replica_models`). Per model
(label model; a host may serve several, model_stores.py): GB·s (a shared replica's split among the
models using it, meters.py), bytes held (the same split, now), loads, cold starts, tokens, which add
up to the host's; and the resident replicas it uses alone (`model_replicas{kind="own"}`) or with
other models (`kind="shared"`, each model counting it) with their bytes (`model_shared_bytes`), the
part of its GB·s from replicas it shares (`model_shared_gb_seconds`), and a LoRA fine-tune's own
factors (`model_lora_bytes`, in its bytes held and GB·s too).
Per layer (label layer): cold-start seconds hidden by prefetch and exposed (waited for).
Per host: the same totals, load seconds, evictions, Invoke calls and calls in flight, prefetches
never used, device copies, and the host memory tier's hits, misses, reads and bytes.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from moeless.expert_fn.host.runtime import ExpertHostRuntime

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
        models = self._runtime.models
        per_replica["models"] = (GaugeMetricFamily, "models the replica computes for (several: a shared content key)",
                                 "models")
        for name, (family, doc, field) in per_replica.items():
            metric = family(f"{PREFIX}_replica_{name}", doc, labels=["model", "layer", "expert"])
            for r in status["replicas"]:
                model = models.model_of(r["layer"])
                value = len(r[field]) if field == "models" else r[field]
                metric.add_metric([model.name, str(r["layer"] - model.first_layer), str(r["expert"])], value)
            yield metric
        per_model = {
            "gb_seconds": (CounterMetricFamily, "GB·s of the model's replica memory on this host", "gb_s"),
            "bytes_held": (GaugeMetricFamily, "bytes the model's replicas hold now", "bytes_held"),
            "loads": (CounterMetricFamily, "loads of the model's replicas", "loads"),
            "cold_starts": (CounterMetricFamily, "invocations that waited for one of the model's replicas", "cold_starts"),
            "tokens": (CounterMetricFamily, "tokens the model's replicas computed", "tokens"),
        }
        per_model["shared_gb_seconds"] = (CounterMetricFamily, "the part of the model's GB·s from replicas it shares "
                                          "with other models (its split of them)", "shared_gb_s")
        per_model["shared_bytes"] = (GaugeMetricFamily, "bytes of the resident replicas the model shares with others",
                                     "shared_bytes")
        per_model["lora_bytes"] = (GaugeMetricFamily, "bytes of the model's own LoRA factors (a LoRA fine-tune: "
                                   "applied over shared replicas at call time)", "lora_bytes")
        for name, (family, doc, field) in per_model.items():
            metric = family(f"{PREFIX}_model_{name}", doc, labels=["model"])
            for model, totals in sorted(status["models"].items()):
                metric.add_metric([model], totals[field])
            yield metric
        metric = GaugeMetricFamily(f"{PREFIX}_model_replicas", "resident replicas the model uses: alone (own) or with "
                                   "other models (shared, counted for each)", labels=["model", "kind"])
        for model, totals in sorted(status["models"].items()):
            metric.add_metric([model, "own"], totals["own_replicas"])
            metric.add_metric([model, "shared"], totals["shared_replicas"])
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
            "shared_replicas": (GaugeMetricFamily, "resident replicas several models use (held once)", "shared_replicas"),
        }
        for name, (family, doc, field) in host.items():
            yield family(f"{PREFIX}_host_{name}", doc, value=totals[field])
        per_layer = {
            "cold_hidden_seconds": ("cold-start seconds hidden by loads started ahead (prefetch)", "hidden_s"),
            "cold_exposed_seconds": ("cold-start seconds invocations waited for (the latency they cost)", "exposed_s"),
            "cold_waits": ("replica loads an invocation waited for", "waits"),
            "prefetched": ("replica loads started ahead that an invocation then used", "prefetched"),
        }
        cold = status["cold"]
        for name, (doc, field) in per_layer.items():
            metric = CounterMetricFamily(f"{PREFIX}_layer_{name}", doc, labels=["layer"])
            for layer, m in cold["layers"].items():
                metric.add_metric([str(layer)], m[field])
            yield metric
        yield CounterMetricFamily(f"{PREFIX}_host_prefetch_wasted", "replicas loaded ahead and evicted before any use",
                                  value=cold["prefetch_wasted"])
        yield CounterMetricFamily(f"{PREFIX}_host_device_copies", "host tier -> device copies", value=cold["copies"])
        yield CounterMetricFamily(f"{PREFIX}_host_device_copy_seconds", "seconds spent copying host tier -> device",
                                  value=cold["copy_s_sum"])
        tier = status["host_tier"]
        for name, doc in (("hits", "loads served from host memory"), ("misses", "loads that read the file (disk -> host)"),
                          ("read_failures", "file reads refused: missing, checksum mismatch, unreadable"),
                          ("evictions", "entries evicted from host memory"),
                          ("offered", "entries copied from a peer host instead of read"), ("read_s_sum", "seconds reading and verifying files")):
            family = f"{PREFIX}_host_tier_{'read_seconds' if name == 'read_s_sum' else name}"
            yield CounterMetricFamily(family, f"host memory tier: {doc}", value=tier[name])
        yield GaugeMetricFamily(f"{PREFIX}_host_tier_bytes", "bytes of verified weights in host memory", value=tier["bytes"])
        peer = status["peer_copies"]
        for name, doc in (("copies", "loads that copied their replica from a peer host"),
                          ("fallbacks", "loads given a peer that read the weight store instead"),
                          ("bytes", "bytes copied from peer hosts"), ("seconds", "seconds copying from peer hosts"),
                          ("linked", "copies WRITTEN over NIXL, not sent as bytes over gRPC"),
                          ("batched", "of those, copies brought by another load's ask (a LoadMany's replicas batched)"),
                          ("served", "replicas sent to peer hosts"),
                          ("writes", "NIXL WRITEs of the replicas sent over links (a chunk of an ask's each)"),
                          ("passed", "loads given a peer that read the weight store (measured faster, measured again, "
                                     "the peer down, or its NIXL link opening)")):
            yield CounterMetricFamily(f"{PREFIX}_host_peer_copy_{name}", f"peer copies: {doc}", value=peer[name])
        yield GaugeMetricFamily(f"{PREFIX}_host_peer_links", "NIXL links open to peer hosts (peer_links.py)",
                                value=peer["links"])
        yield GaugeMetricFamily(f"{PREFIX}_host_peer_link_bytes", "bytes the peer links' regions hold on this host's "
                                "device, as asker and as holder (beside its replicas)", value=peer["link_bytes"])
        for way in ("peer", "store"):
            yield GaugeMetricFamily(f"{PREFIX}_host_{way}_load_gb_per_second", f"moving average of {way} loads' GB/s "
                                    "(peer_copy.py's choice; 0: not measured yet)", value=peer[f"{way}_gb_per_s"])
        yield GaugeMetricFamily(f"{PREFIX}_host_inflight", "Invoke calls running now", value=status["inflight"])
        yield GaugeMetricFamily(f"{PREFIX}_host_memory_bytes", "replica memory capacity", value=status["memory_bytes"])
        yield GaugeMetricFamily(f"{PREFIX}_host_keep_alive_seconds", "seconds an idle replica stays resident",
                                value=status["keep_alive_s"])
        ready = status["health"] == "serving"
        yield GaugeMetricFamily(f"{PREFIX}_host_ready", "1 while serving, 0 starting or draining", value=ready)


def registry_for(runtime: ExpertHostRuntime) -> CollectorRegistry:
    """A registry of its own per host, so several hosts in one process do not collide."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RuntimeCollector(runtime))
    return registry
