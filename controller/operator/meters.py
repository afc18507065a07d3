"""The expert hosts' meters as the operator reads them: parse a host's /metrics, sum them up.

A host exposes moeless_expert_* families (expert_fn/host/metrics.py); counters are cumulative since
the host started, so the policy's totals since creation add each host's increase since the
last reading (status.meters keeps the last reading per pod; a new pod uid or a counter that went
down starts from zero). What a host held between its last reading and its exit is not billed:
at most one resync period per stopped host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

PREFIX = "moeless_expert_"


@dataclass(frozen=True)
class Replica:
    layer: int  # the model's own layer
    expert: int
    tokens: float
    bytes_held: float
    model: str = ""


@dataclass(frozen=True)
class ModelMeters:
    """One model's part of a host's counters (moeless_expert_model_*{model})."""

    gb_seconds: float = 0.0
    cold_starts: int = 0
    tokens: int = 0
    bytes_held: float = 0.0
    shared_gb_seconds: float = 0.0  # the part of gb_seconds from replicas it shares with other models
    shared_bytes: float = 0.0  # bytes of the resident replicas it shares (each sharing model counts them)


@dataclass(frozen=True)
class HostMeters:
    """One host's reading: cumulative counters and its resident replicas."""

    gb_seconds: float = 0.0
    cold_starts: int = 0
    tokens: int = 0
    inflight: int = 0
    bytes_held: float = 0.0
    memory_bytes: float = 0.0
    ready: bool = False
    replicas: tuple[Replica, ...] = field(default_factory=tuple)
    models: Mapping[str, ModelMeters] = field(default_factory=dict)
    keep_alive_s: float | None = None  # what the host runs now (None: it does not say)
    shared_replicas: int = 0  # resident replicas several models use, each held once


def parse_host_metrics(text: str) -> HostMeters:
    """Prometheus text exposition of one host -> HostMeters."""
    host: dict[str, float] = {}
    per_replica: dict[tuple[str, int, int], dict[str, float]] = {}
    per_model: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if not name.startswith(PREFIX):
                continue
            name = name[len(PREFIX):]
            if name.startswith("replica_"):
                key = (sample.labels.get("model", ""), int(sample.labels["layer"]), int(sample.labels["expert"]))
                per_replica.setdefault(key, {})[name[len("replica_"):]] = sample.value
            elif name.startswith("model_"):
                per_model.setdefault(sample.labels["model"], {})[name[len("model_"):]] = sample.value
            elif name.startswith("host_"):
                host[name[len("host_"):]] = sample.value
    replicas = tuple(Replica(layer, expert, values.get("tokens", 0.0), values.get("bytes_held", 0.0), model)
                     for (model, layer, expert), values in sorted(per_replica.items()))
    models = {model: ModelMeters(values.get("gb_seconds", 0.0), int(values.get("cold_starts", 0)),
                                 int(values.get("tokens", 0)), values.get("bytes_held", 0.0),
                                 values.get("shared_gb_seconds", 0.0), values.get("shared_bytes", 0.0))
              for model, values in sorted(per_model.items())}
    return HostMeters(
        gb_seconds=host.get("gb_seconds", 0.0), cold_starts=int(host.get("cold_starts", 0)),
        tokens=int(host.get("tokens", 0)), inflight=int(host.get("inflight", 0)),
        bytes_held=host.get("bytes_held", 0.0), memory_bytes=host.get("memory_bytes", 0.0),
        ready=host.get("ready", 0.0) == 1.0, replicas=replicas, models=models,
        keep_alive_s=host.get("keep_alive_seconds"), shared_replicas=int(host.get("shared_replicas", 0)),
    )


def resident(meters: Mapping[str, HostMeters], model: str | None = None) -> list[tuple[str, Replica]]:
    """(pod, replica) for every replica holding memory now, over all hosts (of `model` only, unless None)."""
    return [(pod, r) for pod, m in sorted(meters.items()) for r in m.replicas
            if r.bytes_held > 0 and (model is None or r.model == model)]


def layer_cv_percentiles(meters: Mapping[str, HostMeters], model: str | None = None) -> tuple[float, float] | None:
    """p50 and p95 over layers of the CV (std / mean) of resident replicas' token counts.

    Layers whose replicas computed no token are left out; None when no layer has tokens.
    """
    loads: dict[tuple[str, int], list[float]] = {}
    for _, r in resident(meters, model):
        loads.setdefault((r.model, r.layer), []).append(r.tokens)
    cvs = [float(np.std(v) / np.mean(v)) for v in loads.values() if np.mean(v) > 0]
    if not cvs:
        return None
    return float(np.percentile(cvs, 50)), float(np.percentile(cvs, 95))


def increase(current: float, last: Mapping[str, float] | None, key: str, uid: str) -> float:
    """What a cumulative counter added since the last reading of the same pod (uid)."""
    if last is None or last.get("uid") != uid or current < last.get(key, 0):
        return current
    return current - last.get(key, 0)
