"""`moeless bench planner`: the latency model measured here, planning time, and plan quality.

1. Latency model: alpha and the per-call overhead from timing moeless.model.experts.expert_forward
   at the default model's expert shape; beta from serialising + copying hidden vectors; the cold
   start from loading one expert's safetensors file from a weight store.
2. Planning time per layer for several (E, G), moeless and paper beside EPLB on the same inputs.
3. Quality on real per-layer loads: every planner replays the same iterations (each plans with
   a perfect forecast against its own previous placement); predicted layer time under the paper's
   and the serial execution model, as ratios to static EP and to the Oracle; replicas; churn.
"""

from __future__ import annotations

import gc
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from moeless.controller.iterations import Iteration
from moeless.controller.planner import Planner, PlannerConfig, get_planner
from moeless.placement.cluster import Cluster
from moeless.placement.diff import diff
from moeless.placement.latency_model import LatencyModel

EXPERT_SHAPE = (576, 192)  # the default model's expert: hidden H, FFN width F
TIMES = ("paper_s", "serial_s", "serial_cold_s", "prefetch_s")  # the Replay fields that are layer times


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _fit(sizes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares seconds = intercept + slope * size: (slope, intercept), both clipped at 0."""
    slope, intercept = np.polyfit(np.asarray(sizes, dtype=np.float64), np.asarray(seconds), 1)
    return max(float(slope), 0.0), max(float(intercept), 0.0)


def measure_latency_model(repeats: int = 50, threads: int = 1) -> tuple[LatencyModel, dict]:
    """Measure alpha, call overhead, beta and cold start on this machine (torch on `threads` threads)."""
    import torch

    from moeless.model.experts import expert_forward
    from moeless.model.weight_store import export_experts

    hidden, ffn = EXPERT_SHAPE
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
            ffn_s = [_median_seconds(lambda x=torch.randn(t, hidden): expert_forward(weights, x), repeats) for t in token_counts]
        alpha, call = _fit(token_counts, ffn_s)
        # 2. beta: serialise a [T, H] float32 batch and copy it back into a tensor (one direction).
        def move(x: torch.Tensor) -> torch.Tensor:
            return torch.frombuffer(bytearray(x.numpy().tobytes()), dtype=torch.float32).reshape(x.shape)

        moved = [16, 128, 1024]
        move_s = [_median_seconds(lambda x=torch.randn(t, hidden): move(x), repeats) for t in moved]
        beta, _ = _fit(moved, move_s)
        # 3. Cold start: load (and checksum) one expert's file, as an expert host does.
        with tempfile.TemporaryDirectory() as root:
            store = export_experts([(0, 0, weights)], root, model="bench", num_layers=1, num_experts=1, act="silu")
            cold = _median_seconds(lambda: store.load(0, 0), max(5, repeats // 5))
            expert_bytes = store.expert_bytes(0, 0)
    finally:
        torch.set_num_threads(saved_threads)
    model = LatencyModel(alpha=alpha, beta=beta, cold_start=cold, call_overhead=call)
    facts = {
        "expert_shape": {"H": hidden, "F": ffn, "dtype": "float32"},
        "torch_threads": threads,
        "expert_bytes": expert_bytes,
        "ffn_tokens": token_counts,
        "ffn_seconds": ffn_s,
        "move_tokens": moved,
        "move_seconds": move_s,
    }
    return model, facts


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
    """Per-layer planning time of moeless and paper beside EPLB (at moeless's replica budget)."""
    rng = np.random.default_rng(seed)
    rows = []
    for experts, gpus in sizes:
        loads = skewed_loads(rng, count, experts, tokens=32 * experts)
        cluster = Cluster.uniform(gpus, 2 * (-(-2 * experts // gpus)), expert_bytes=1, layer_cap_replicas=2 * experts)
        row: dict = {"E": experts, "G": gpus}
        for name in ("moeless", "paper"):
            row[name] = _time_planner(get_planner(name, PlannerConfig(model=model)), loads, cluster)
        budget = max(experts, -(-round(row["moeless"]["replicas"]) // gpus) * gpus)
        row["eplb"] = _time_planner(get_planner("eplb", PlannerConfig(eplb_replicas=budget)), loads, cluster)
        rows.append(row)
    return rows


@dataclass
class Replay:
    """Per-iteration figures of one planner, each averaged over layers: [I]."""

    paper_s: list[float] = field(default_factory=list)
    serial_s: list[float] = field(default_factory=list)
    serial_cold_s: list[float] = field(default_factory=list)  # serial plus each layer's slowest GPU's cold loads
    prefetch_s: list[float] = field(default_factory=list)  # the same, less what loading d layers ahead hides
    replicas: list[float] = field(default_factory=list)
    churn: list[float] = field(default_factory=list)


def replay(planner: Planner, iterations: Sequence[Iteration], cluster: Cluster, model: LatencyModel, progress=None,
           prefetch_layers: int = 3) -> Replay:
    """Plan every iteration (perfect forecast, chained previous placement) and price it.

    Cold loads of a layer cost cold_start each on the GPU that loads the most ("serial + cold");
    with a forecast d = prefetch_layers layers ahead they can start d layers early, so only what
    exceeds d times the iteration's mean serial layer time stays on the critical path ("prefetch").
    """
    out, previous = Replay(), None
    num_gpus = cluster.num_gpus
    for it in iterations:
        placement = planner(it.load, cluster, previous)
        loads = planner.lossy_load(it.load) if planner.lossy_load else it.load
        diffs = diff(previous, placement)
        paper, serial, loading = [], [], []
        for l, layer in enumerate(placement.layers):
            paper.append(model.layer_time(loads[l], layer, num_gpus, "paper"))
            serial.append(model.layer_time(loads[l], layer, num_gpus, "serial"))
            loading.append(model.cold_start * float(diffs[l].cold_loads_per_gpu(num_gpus).max()))
        layer_s = float(np.mean(serial))
        out.paper_s.append(float(np.mean(paper)))
        out.serial_s.append(layer_s)
        out.serial_cold_s.append(layer_s + float(np.mean(loading)))
        out.prefetch_s.append(layer_s + float(np.mean(np.maximum(np.asarray(loading) - prefetch_layers * layer_s, 0.0))))
        out.replicas.append(float(placement.logcnt().sum(axis=1).mean()))
        out.churn.append(float(np.mean([d.churn for d in diffs])))
        previous = placement
        if progress is not None:
            progress.update(1)
    return out


def summarise(replays: dict[str, Replay], phases: Sequence[str]) -> dict:
    """Per phase, per planner: mean layer times, ratios to static and oracle, replicas, churn."""
    phases = np.asarray(phases)
    summary: dict = {}
    for phase in ("prefill", "decode"):
        mask = phases == phase
        if not mask.any():
            continue
        table = {}
        for name, r in replays.items():
            row = {key: float(np.mean(np.asarray(getattr(r, key))[mask])) for key in (*TIMES, "replicas", "churn")}
            table[name] = row
        for row in table.values():
            for key in TIMES:
                if "static" in table:
                    row[f"{key}_vs_static"] = row[key] / table["static"][key]
                if "oracle" in table:
                    row[f"{key}_vs_oracle"] = row[key] / table["oracle"][key]
        summary[phase] = {"iterations": int(mask.sum()), "planners": table}
    return summary
