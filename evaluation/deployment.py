"""`moeless eval --geometry`: the paper's models on GPU clusters, one cell per (model, GPUs, workload).

A cell, in numbered steps:
1. Geometry (twin/geometry.py), GPUs (hardware/gpus.py) and the cost profile: a real profile file
   when given, else the roofline's (twin/roofline.py), said in the report.
2. Routing per token: a routing file (`moeless trace import|record`) or "moefied" (the default
   model rebuilt at the geometry's (E, k): "moefied SmolLM2 routing at E, k"); its layers are
   tiled to the geometry's MoE layers (layer l replays routed layer l mod L_r).
3. Batches of GPU size: the workload's arrivals (Azure trace, or the generated fallback), scaled to
   `load` x the scheduler's capacity; prompt and output lengths of the real dataset (ShareGPT,
   HumanEval); the chunked-prefill scheduler (twin/chunked.py).
4. The planners through the twin (serial execution; both billing models): static EP, EPLB-window,
   the paper's planner, moeless with the forecasts a trace allows (previous iteration, history
   window), moeless with a perfect forecast; the lossless bound (twin/bound.py) per layer and the
   offline reference and the hindsight homes (twin/reference.py: EPLB on each iteration's own loads,
   moves free; fixed homes fitted on the run's other batches); moeless
   at a few knob values (memory price, keep-alive) for the recommendation; the frontier
   (evaluation/frontier.py): time against GB·s for static EP, production EPLB, moeless at four
   memory prices and full replication.
Pure given its inputs; the run document (`cell_doc`) holds what the report needs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from moeless.controller.planning.rules import memory_price
from moeless.placement.cluster import Cluster
from moeless.placement.fill_placer import HORIZON
from moeless.placement.planner import PlannerConfig
from moeless.evaluation.frontier import frontier_cell
from moeless.twin.bound import profile_bound, profile_call_bound
from moeless.twin.chunked import scale_to_load, schedule, split_counts, step_loads
from moeless.twin.compare import Run, run_all
from moeless.twin.forecasts import forecast_set
from moeless.twin.iterations import Iteration
from moeless.twin.reference import hindsight_homes, offline_reference
from moeless.twin.twin import TwinSettings

CASES = (  # (key, label, planner, forecast)
    ("static", "static EP (Megatron-LM)", "static", "perfect"),
    ("eplb-window", "EPLB-window (every 10 iterations, past loads)", "eplb-window", "previous"),
    ("paper", "paper's planner (CV <= V, JSQ; previous iteration)", "paper", "previous"),
    ("moeless-previous", "moeless, previous iteration's loads", "moeless", "previous"),
    ("moeless-history", "moeless, history window", "moeless", "history"),
    ("moeless-perfect", "moeless, perfect forecast", "moeless", "perfect"),
)
OWN_FORECAST = "moeless-history"  # moeless with its own forecast where no gate replica runs: the history window
KNOB_GRID = ((1.0, 1.0), (0.1, 1.0), (1.0, 60.0), (0.1, 60.0))  # (memory price x the neutral price, keep-alive s)
MEM_FRACTION = 0.8  # of a GPU's memory for weights; the rest for the KV cache and activations
PHASES = ("prefill", "decode")
GAIN_BINS = 12  # batch-token bins of the gain figure (log-spaced)


class DeploymentError(ValueError):
    """A deployment that cannot be evaluated (the message says what to change)."""


@dataclass(frozen=True)
class DeploymentSizes:
    """requests (arrivals replayed), max_batched_tokens, max_seqs (the scheduler's), load (offered
    tokens / capacity), step_s (seconds per iteration), max_iterations, routing_prompts and
    routing_tokens (moefied routing: prompts traced, tokens generated each)."""

    requests: int = 600
    max_batched_tokens: int = 8192
    max_seqs: int = 256
    load: float = 0.8
    step_s: float = 0.05
    max_iterations: int = 400
    routing_prompts: int = 24
    routing_tokens: int = 32


def tile_layers(iterations: Sequence[Iteration], num_layers: int) -> list[Iteration]:
    """Iterations whose loads [L_r, E] become [num_layers, E]: layer l replays layer l mod L_r."""
    return [replace(it, load=it.load[np.arange(num_layers) % it.load.shape[0]]) for it in iterations]


def gpu_slots(profile, gpu, count: int, num_layers: int, num_experts: int) -> int:
    """Replica slots per GPU: the weights' share of its memory (MEM_FRACTION) less its 1/G of the
    non-expert weights (sharded), in experts, at most one replica of every expert; an error when
    static EP does not fit."""
    free = MEM_FRACTION * gpu.memory - profile.non_expert_bytes / count
    slots = min(int(free // profile.expert_bytes), num_layers * num_experts)
    need = -(-num_layers * num_experts // count)
    if slots < need:
        raise DeploymentError(f"{count} x {gpu.name} cannot hold static EP ({need} experts of {profile.expert_bytes / 1e9:.2f} GB "
                              f"per GPU, room for {slots}); use more GPUs")
    return slots


def iterations_for(routing, prompts: np.ndarray, outputs: np.ndarray, arrivals: np.ndarray, sizes: DeploymentSizes,
                   num_layers: int) -> list[Iteration]:
    """Steps 2-3: the scheduler's iterations with their loads [num_layers, E]."""
    n = len(arrivals)
    p, o = prompts[np.arange(n) % len(prompts)], outputs[np.arange(n) % len(outputs)]
    times = scale_to_load(arrivals, p, o, sizes.load, sizes.max_batched_tokens, sizes.step_s)
    steps = schedule(times, p, o, sizes.max_batched_tokens, sizes.max_seqs, sizes.step_s, max_iterations=sizes.max_iterations)
    return tile_layers(step_loads(steps, p, split_counts(routing)), num_layers)


def run_cell(iterations: list[Iteration], profile, gpu, count: int, top_k: int, knobs, progress=None) -> dict:
    """Step 4: every case and the bound on one cell's iterations; the cell's figures (see cell_doc)."""
    num_layers, num_experts = iterations[0].load.shape
    # The forecasts a trace allows (previous iteration, history window) exist before the iteration
    # starts, so a layer's cold loads start with its first layer: d = L - 1 for every planner
    # (measured: at d = 2 Llama-4-Scout's 4.9 ms loads were exposed and moeless was +2% on 8 x H100).
    d = num_layers - 1
    slots = gpu_slots(profile, gpu, count, num_layers, num_experts)
    # Replicas per layer: what the slots hold (measured: rounded down to a multiple of G, the cap
    # left moeless no replica beyond static EP's on Llama-4-Scout, 8 x A6000: 16 of 23).
    cap = max(num_experts, min(num_experts * count, slots * count // num_layers))
    cluster = Cluster.uniform(count, slots, profile.expert_bytes, cap)
    forecasts = forecast_set(iterations, None, [d], top_k)
    neutral = memory_price(replace(knobs, memory_price=None), profile, num_layers, num_experts)
    price = memory_price(knobs, profile, num_layers, num_experts)
    step = float(np.median(np.diff([it.time_s for it in iterations])))
    tier = "peer" if "peer" in profile.load_s else "host"  # a copy comes from a GPU that holds the expert
    base = PlannerConfig(model=profile.latency_model(tier), cv_threshold=knobs.cv_threshold, horizon=life(HORIZON, knobs.keep_alive_s, step),
                         keep_alive_s=knobs.keep_alive_s, gb_s_price=price, iteration_s=step,
                         dispatch_s=profile.relevel_s + profile.check_s, home_moves_every=knobs.home_moves_every)
    settings = TwinSettings(keep_alive_s=knobs.keep_alive_s, distance=d, tier=tier)
    records = run_all([Run(p, f, d) for _, _, p, f in CASES if p.startswith("moeless")] +
                      [Run(p, f, d) for _, _, p, f in CASES if not p.startswith("moeless")],
                      iterations, forecasts, cluster, profile, base, settings, progress)
    by_key = {key: records[Run(p, f, d)] for key, _, p, f in CASES}
    knob_rows = []
    for factor, keep in KNOB_GRID:
        config = replace(base, gb_s_price=neutral * factor, keep_alive_s=keep, horizon=life(HORIZON, keep, step))
        rec = run_all([Run("moeless", "history", d)], iterations, forecasts, cluster, profile, config,
                      replace(settings, keep_alive_s=keep), progress)[Run("moeless", "history", d)]
        knob_rows.append({"price_factor": factor, "memory_price": neutral * factor, "keep_alive_s": keep,
                          **_phase_figures(rec, None)})
    loads = np.stack([it.load for it in iterations])
    budgets = sorted({-(-num_experts // count) * count, max(num_experts, cap // count * count)})
    bound = {"bound": profile_bound(loads, count, profile), "call_bound": profile_call_bound(loads, count, profile),
             "offline": offline_reference(loads, count, profile.latency_model("host"), budgets),
             "hindsight": hindsight_homes(loads, count, profile.latency_model("host"))}
    frontier = frontier_cell(iterations, forecasts, cluster, profile, base, settings, neutral,
                             {k: bound[k] for k in ("offline", "hindsight", "bound")}, progress)
    return cell_doc(iterations, by_key, bound, knob_rows, profile, top_k, {"slots_per_gpu": slots, "distance": d,
                    "memory_price": price, "neutral_price": neutral, "keep_alive_s": knobs.keep_alive_s,
                    "frontier": frontier})


def life(horizon: float, keep_alive_s: float, iteration_s: float) -> float:
    """Iterations over which moeless counts a new replica's gain: its keep-alive at least. The
    planner bills a replica's memory over horizon + keep-alive; on a GPU a replica's weight read is
    paid per call and its cold start (a PCIe copy) is tens of layer times, so a gain counted over
    only HORIZON iterations never paid for memory held keep_alive_s (measured: moeless stayed on
    static EP in every GPU cell with the bound 30-40% below it)."""
    return max(horizon, keep_alive_s / iteration_s)


def _phase_figures(rec, mask) -> dict:
    """mean and p99 MoE-layer seconds (serial, exposed cold starts included), paper-model mean,
    GB·s under both billing models, exposed cold-start seconds per layer, loads per layer."""
    m = np.ones(len(rec.phase), bool) if mask is None else mask
    t = rec.layer_time("serial")[m]
    return {"iterations": int(m.sum()), "mean_s": float(t.mean()), "p99_s": float(np.percentile(t, 99)),
            "paper_mean_s": float(rec.layer_time("paper")[m].mean()), "total_s": float(t.sum()),
            "gb_s_resident": float(rec.gb_s_resident[m].sum()), "gb_s_per_layer": float(rec.gb_s_per_layer[m].sum()),
            "exposed_s": float(rec.exposed_s[m].mean()), "loads": float(rec.loads[m].mean()),
            "resident": float(rec.resident[m].mean())} if m.any() else {"iterations": 0}


def recommend(knob_rows: list[dict]) -> dict:
    """The knob row with the least total MoE-layer time (its GB·s is reported beside it: on GPUs
    rented whole, memory inside their HBM is already paid for)."""
    return min(knob_rows, key=lambda r: r["total_s"])


def cell_doc(iterations, records: dict, bounds: dict[str, np.ndarray], knob_rows: list, profile, top_k: int, facts: dict) -> dict:
    """The cell's figures: per case and phase (_phase_figures), each bound's ([I, L]) mean and p99 per phase,
    the knob rows and the recommended knobs, and moeless's gain against batch tokens (binned)."""
    phase = np.array([it.phase for it in iterations])
    tokens = np.array([it.load[0].sum() / top_k for it in iterations])  # tokens of the batch
    cases = {}
    for key, label, planner, forecast in CASES:
        rec = records[key]
        cases[key] = {"label": label, "planner": planner, "forecast": forecast,
                      "phases": {p: _phase_figures(rec, phase == p) for p in PHASES}, "all": _phase_figures(rec, None)}
    bound_figures = {name: {p: ({"mean_s": float(b[phase == p].mean()), "p99_s": float(np.percentile(b[phase == p], 99))}
                                if (phase == p).any() else None) for p in PHASES} for name, b in bounds.items()}
    static, own = records["static"].layer_time("serial").mean(1), records[OWN_FORECAST].layer_time("serial").mean(1)
    edges = np.geomspace(max(tokens.min(), 1), max(tokens.max(), 2), GAIN_BINS + 1)
    which = np.clip(np.digitize(tokens, edges) - 1, 0, GAIN_BINS - 1)
    gain = [{"tokens": float(np.sqrt(edges[b] * edges[b + 1])), "iterations": int((which == b).sum()),
             "gain": float(1 - own[which == b].sum() / static[which == b].sum())} for b in range(GAIN_BINS) if (which == b).any()]
    best = recommend(knob_rows)
    return {"cases": cases, **bound_figures, "knobs": knob_rows,
            "recommended": {"price_factor": best["price_factor"], "memory_price": best["memory_price"], "keep_alive_s": best["keep_alive_s"]},
            "gain_by_tokens": gain, "knee_tokens_per_call": profile.call_overhead / profile.alpha if profile.alpha else None,
            "mean_batch_tokens": {p: float(tokens[phase == p].mean()) if (phase == p).any() else None for p in PHASES},
            **facts}
