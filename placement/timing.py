"""How long the data plane's own planning steps take on this machine: the pairing of one layer's
tokens with its replicas on its actual loads (placement/dispatch.py), the check whether it pays and
a call whose check the gate skips (placement/check_gate.py). The live loop charges them (its
calibration on a host) and so does the twin (the cost profile's relevel_s, relevel_check_s and
relevel_skip_s)."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from moeless.placement.check_gate import MAX_BACKOFF, CheckGate
from moeless.placement.cluster import Cluster
from moeless.placement.dispatch import pair_tokens
from moeless.placement.full_replication import plan_full_replication
from moeless.placement.latency_model import LatencyModel
from moeless.placement.types import LayerPlacement


def fastest_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` timed calls after a warm-up: the cost on an unloaded machine (on this
    shared CPU, medians swung 2-3x with other processes' load and once fitted a zero call overhead)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.min(times))


def measure_relevel_s(num_experts: int, num_gpus: int, model: LatencyModel, repeats: int = 50) -> float:
    """Seconds of one `pair_tokens` (what a serving replica runs per MoE-layer call where the check
    says a layer's pairing pays), on a home-first plan as moeless-sets and full replication publish
    (on the layer's index, made once per published layer): static EP's E home replicas plus one
    copy (share 0) of each of the G busiest experts, on the next GPU, under a skewed load of 64
    tokens per expert. The fastest of repeats."""
    load, layer = _split_layer(num_experts, num_gpus)
    home_first = _homes_first(layer, num_experts)
    return fastest_seconds(lambda: pair_tokens(load, home_first, model, num_gpus), repeats)


def measure_relevel_check_s(num_experts: int, num_gpus: int, model: LatencyModel, repeats: int = 50) -> float:
    """Seconds of one check that does not re-level (`actual_shares` through the gate that runs it,
    check_gate.py: the check a serving replica runs on a layer that holds copies, the choice of
    shares it makes and the gate's records) on the layer `measure_relevel_s` times with even
    shares. The fastest of repeats."""
    load, layer = _split_layer(num_experts, num_gpus)
    gate = CheckGate(0.0, max_backoff=0)  # every call checks
    return fastest_seconds(lambda: gate.route(0, "prefill", load, layer, model, num_gpus, np.inf), repeats)


def measure_relevel_skip_s(num_experts: int, num_gpus: int, model: LatencyModel, repeats: int = 50) -> float:
    """Seconds of one call whose check the gate skips (check_gate.py, step 3: static EP's split
    routed), on the same layer. The fastest of repeats (a gate backed off skips all but one in
    MAX_BACKOFF of them)."""
    load, layer = _split_layer(num_experts, num_gpus)
    gate = CheckGate(np.inf)  # no check pays: it backs off
    return fastest_seconds(lambda: gate.route(0, "prefill", load, layer, model, num_gpus, np.inf), max(repeats, 2 * MAX_BACKOFF))


def measure_relevel_per_replica_s(num_experts: int, num_gpus: int, model: LatencyModel, repeats: int = 50) -> float:
    """Seconds each replica past the E homes and G copies adds to one `pair_tokens`: the slope from
    `measure_relevel_s`'s layer to full replication's (the layer plan_full_replication publishes)
    under the same loads. The fastest of repeats each; 0 with one GPU (nothing to replicate)."""
    if num_gpus < 2:
        return 0.0
    load, layer = _split_layer(num_experts, num_gpus)
    home_first = _homes_first(layer, num_experts)
    full = plan_full_replication(np.zeros((1, num_experts)), Cluster.uniform(num_gpus, num_experts, 1), None, None).layers[0]
    few = fastest_seconds(lambda: pair_tokens(load, home_first, model, num_gpus), repeats)
    many = fastest_seconds(lambda: pair_tokens(load, full, model, num_gpus), repeats)
    return max(many - few, 0.0) / (full.num_replicas - home_first.num_replicas)


def _homes_first(layer: LayerPlacement, num_experts: int) -> LayerPlacement:
    """The layer with its first E replicas (the homes) at share 1 and its copies at 0, as home-first plans publish."""
    return LayerPlacement(layer.expert, layer.gpu, (np.arange(layer.num_replicas) < num_experts).astype(np.float64))


def _split_layer(num_experts: int, num_gpus: int):
    """(load [E], layer): static EP's E home replicas plus one more replica of each of the G
    busiest experts, on the next GPU, under a skewed load of 64 tokens per expert."""
    rng = np.random.default_rng(0)
    load = rng.multinomial(64 * num_experts, rng.dirichlet(np.full(num_experts, 0.3)))
    home = np.arange(num_experts) * num_gpus // num_experts
    hot = np.argsort(-load, kind="stable")[:num_gpus] if num_gpus > 1 else np.zeros(0, dtype=np.int64)
    return load, LayerPlacement.even(np.concatenate([np.arange(num_experts), hot]),
                                     np.concatenate([home, (home[hot] + 1) % num_gpus]), num_experts)
