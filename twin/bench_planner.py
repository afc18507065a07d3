"""`moeless bench planner`, part 1: the cost profile measured here, and planning time.

1. Cost profile (twin/profile.py) at the expert shape of the model whose loads are replayed:
   alpha and the call overhead from a least-squares fit of `expert_forward` time over 1..256
   tokens; beta from serialising and copying a [T, H] float32 batch; one replica's load from disk
   (read, sha256, parse, copy: the expert host's path with its host tier off) and from the host
   memory tier (the copy alone); expert and non-expert bytes; the serving replica's re-level of one
   layer's shares on its actual loads (moeless's data plane, `measure_relevel_s`) and the check
   whether it pays (`measure_relevel_check_s`). Each time is the fastest of its repeats.
2. Planning time per layer for several (E, G): moeless, moeless-fill and the paper beside EPLB.

Part 2, the replay of every planner through the digital twin, is twin/bench_quality.py.
"""

from __future__ import annotations

import gc
import tempfile
import time
from typing import Callable, Sequence

import numpy as np

from moeless.controller.planner import Planner, PlannerConfig, get_planner
from moeless.twin.profile import CostProfile
from moeless.placement.cluster import Cluster
from moeless.placement.latency_model import LatencyModel


def _fastest_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` timed calls after a warm-up: the cost on an unloaded machine (on this
    shared CPU, medians swung 2-3x with other processes' load and once fitted a zero call overhead)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.min(times))


def fit_line(sizes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares seconds = intercept + slope * size: (slope, intercept), both clipped at 0."""
    slope, intercept = np.polyfit(np.asarray(sizes, dtype=np.float64), np.asarray(seconds), 1)
    return max(float(slope), 0.0), max(float(intercept), 0.0)


def measure_relevel_s(num_experts: int, num_gpus: int, model: LatencyModel, repeats: int = 50) -> float:
    """Seconds of one `relevel_layer` (what a serving replica runs per MoE-layer call when moeless
    split an expert): static EP's E home replicas plus one more replica of each of the G busiest
    experts, on the next GPU, under a skewed load of 64 tokens per expert. The fastest of repeats."""
    from moeless.placement.resident_planner import relevel_layer

    load, layer = _split_layer(num_experts, num_gpus)
    return _fastest_seconds(lambda: relevel_layer(load, layer, model, num_gpus), repeats)


def measure_relevel_check_s(num_experts: int, num_gpus: int, model: LatencyModel, repeats: int = 50) -> float:
    """Seconds of one `actual_shares` that does not re-level (the check a serving replica runs on
    every layer with a split expert, and the choice of shares it makes) on the layer
    `measure_relevel_s` times. The fastest of repeats."""
    from moeless.placement.resident_planner import actual_shares

    load, layer = _split_layer(num_experts, num_gpus)
    return _fastest_seconds(lambda: actual_shares(load, layer, model, num_gpus, np.inf), repeats)


def _split_layer(num_experts: int, num_gpus: int):
    """(load [E], layer): static EP's E home replicas plus one more replica of each of the G
    busiest experts, on the next GPU, under a skewed load of 64 tokens per expert."""
    from moeless.placement.types import LayerPlacement

    rng = np.random.default_rng(0)
    load = rng.multinomial(64 * num_experts, rng.dirichlet(np.full(num_experts, 0.3)))
    home = np.arange(num_experts) * num_gpus // num_experts
    hot = np.argsort(-load, kind="stable")[:num_gpus] if num_gpus > 1 else np.zeros(0, dtype=np.int64)
    return load, LayerPlacement.even(np.concatenate([np.arange(num_experts), hot]),
                                     np.concatenate([home, (home[hot] + 1) % num_gpus]), num_experts)


def measure_profile(hidden: int, ffn: int, non_expert_bytes: int, repeats: int = 50, threads: int = 1,
                    source: str = "", *, num_experts: int, num_gpus: int) -> tuple[CostProfile, dict]:
    """Measure the cost profile on this machine for experts of shape H=hidden, F=ffn (float32),
    torch on `threads` threads, layers of num_experts experts over num_gpus GPUs (the re-level).
    Returns (profile, the raw timings)."""
    import torch

    from moeless.expert_fn.tiers import DeviceCopier, HostTier, TierConfig
    from moeless.model.experts import expert_forward
    from moeless.model.weight_store import export_experts

    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        weights = {
            "gate": torch.randn(ffn, hidden, generator=gen) * 0.02,
            "up": torch.randn(ffn, hidden, generator=gen) * 0.02,
            "down": torch.randn(hidden, ffn, generator=gen) * 0.02,
        }
        # 1. alpha and the call overhead: one expert FFN call on T tokens.
        token_counts = [1, 4, 16, 64, 256]
        with torch.no_grad():
            ffn_s = [_fastest_seconds(lambda x=torch.randn(t, hidden): expert_forward(weights, x), repeats) for t in token_counts]
        alpha, call = fit_line(token_counts, ffn_s)

        # 2. beta: serialise a [T, H] float32 batch and copy it back into a tensor (one direction).
        def move(x: torch.Tensor) -> torch.Tensor:
            return torch.frombuffer(bytearray(x.numpy().tobytes()), dtype=torch.float32).reshape(x.shape)

        moved = [16, 64, 256]  # a GPU's tokens per layer here; 1024 tokens (2.4 MB) measured page faults, not copies
        move_s = [_fastest_seconds(lambda x=torch.randn(t, hidden): move(x), repeats) for t in moved]
        beta, _ = fit_line(moved, move_s)
        # 3. One replica's load, as the expert host runs it: from disk (tier off) and from host memory.
        copier = DeviceCopier("cpu")
        loads = max(5, repeats // 5)
        with tempfile.TemporaryDirectory() as root:
            store = export_experts([(0, 0, weights)], root, model="bench", num_layers=1, num_experts=1, act="silu")
            off, tier = HostTier(store, TierConfig(capacity_bytes=0)), HostTier(store)
            disk = _fastest_seconds(lambda: copier.to_device(off.get((0, 0))[0]), loads)
            host = _fastest_seconds(lambda: copier.to_device(tier.get((0, 0))[0]), loads)
            expert_bytes = store.expert_bytes(0, 0)
        # 4. The data plane's re-level of one layer's shares.
        relevel_model = LatencyModel(alpha=alpha, beta=beta, cold_start=host, call_overhead=call)
        relevel = measure_relevel_s(num_experts, num_gpus, relevel_model, repeats)
        check = measure_relevel_check_s(num_experts, num_gpus, relevel_model, repeats)
    finally:
        torch.set_num_threads(saved_threads)
    profile = CostProfile(alpha=alpha, beta=beta, call_overhead=call, load_s={"disk": disk, "host": host},
                          expert_bytes=expert_bytes, non_expert_bytes=non_expert_bytes, relevel_s=relevel,
                          relevel_check_s=check, source=source or f"this machine's CPU, torch on {threads} thread(s), H={hidden} F={ffn} float32")
    facts = {"expert_shape": {"H": hidden, "F": ffn, "dtype": "float32"}, "torch_threads": threads,
             "ffn_tokens": token_counts, "ffn_seconds": ffn_s, "move_tokens": moved, "move_seconds": move_s}
    return profile, facts


TIMED = ("moeless", "moeless-fill", "paper")  # planners timed beside EPLB


def skewed_loads(rng: np.random.Generator, count: int, experts: int, tokens: int, concentration: float = 0.3) -> np.ndarray:
    """count skewed [E] token vectors (Dirichlet routing probabilities): [count, E]."""
    return np.stack([rng.multinomial(tokens, rng.dirichlet(np.full(experts, concentration))) for _ in range(count)]).astype(np.float64)


def _time_planner(planner: Planner, loads: np.ndarray, cluster: Cluster) -> dict:
    """Time one-layer plan calls (chained: each plan is the next one's previous).

    Wall time, and the thread's CPU time (what the call costs without waiting for a busy CPU).
    """
    planner(loads[:1], cluster, None)  # warm-up: the first call loads the compiled kernels (once per process)
    previous, wall, cpu, replicas = None, [], [], []
    enabled = gc.isenabled()
    gc.disable()  # as timeit does: a collection pause is not the planner's time
    try:
        for load in loads:
            start, start_cpu = time.perf_counter(), time.thread_time()
            previous = planner(load[None, :], cluster, previous)
            wall.append(time.perf_counter() - start)
            cpu.append(time.thread_time() - start_cpu)
            replicas.append(previous.layers[0].num_replicas)
    finally:
        if enabled:
            gc.enable()
    return {
        "median_ms": 1e3 * float(np.median(wall)),
        "p99_ms": 1e3 * float(np.percentile(wall, 99)),
        "cpu_median_ms": 1e3 * float(np.median(cpu)),
        "replicas": float(np.mean(replicas)),
    }


def planning_time(sizes: Sequence[tuple[int, int]], model: LatencyModel, count: int, seed: int = 0) -> list[dict]:
    """Per-layer planning time of moeless, moeless-fill and the paper beside EPLB (at moeless's replica budget)."""
    rng = np.random.default_rng(seed)
    rows = []
    for experts, gpus in sizes:
        loads = skewed_loads(rng, count, experts, tokens=32 * experts)
        cluster = Cluster.uniform(gpus, 2 * (-(-2 * experts // gpus)), expert_bytes=1, layer_cap_replicas=2 * experts)
        row: dict = {"E": experts, "G": gpus}
        for name in TIMED:
            row[name] = _time_planner(get_planner(name, PlannerConfig(model=model)), loads, cluster)
        budget = max(experts, -(-round(row["moeless"]["replicas"]) // gpus) * gpus)
        row["eplb"] = _time_planner(get_planner("eplb", PlannerConfig(eplb_replicas=budget)), loads, cluster)
        rows.append(row)
    return rows
