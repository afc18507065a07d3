"""`moeless bench predictor`: every method's metrics against distance on held-out prompts.

Methods: gate_replica (moeless: gate copies, layer-aware fine-tuned), replica_init (the same
copies before fine-tuning: an ablation), gate_reuse (the original
gate l+d on layer l's input, Mixtral-offloading), mlp (from scratch, ProMoE-style), history
(moving average, EPLB), fmoe (expert-map matching). All are trained or warmed on the ShareGPT
train prompts and scored on held-out ShareGPT prompts and on HumanEval prompts (domain shift).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from moeless.bench import BENCHES
from moeless.bench.common import add_bench_flags, write_result
from moeless.predictor.dataset import RoutingTraces
from moeless.predictor.evaluate import by_distance, latency_ms, replay, warm
from moeless.predictor.finetune import FitConfig, layer_aware_finetune
from moeless.predictor.fmoe import ExpertMapPredictor
from moeless.predictor.gate_replica import ModulePredictor, Pair, gate_reuse, gate_route, rescaled_gate_copies
from moeless.predictor.history import HistoryPredictor
from moeless.predictor.scratch import train_scratch

METHODS = ("gate_replica", "replica_init", "gate_reuse", "mlp", "history", "fmoe")


@dataclass(frozen=True)
class BenchConfig:
    """Sizes of one benchmark run. source_stride: score source layers 0, s, 2s, ... (1: all)."""

    sharegpt: int = 240
    humaneval: int = 48
    max_tokens: int = 96
    distances: tuple[int, ...] = (1, 2, 3, 4, 5)
    source_stride: int = 1
    threshold: float = 0.8
    epochs: int = 20
    mlp_epochs: int = 6
    mlp_width: int = 512
    history_window: int = 16
    fit: dict = field(default_factory=lambda: {"lr": 1e-3, "batch_size": 256})


QUICK = BenchConfig(sharegpt=40, humaneval=8, max_tokens=48, source_stride=6, epochs=10, mlp_epochs=4)



def register(benches: argparse._SubParsersAction) -> None:
    """Add `moeless bench predictor`."""
    bench = benches.add_parser("predictor", help=BENCHES["predictor"].help,
                               description="Gate replicas vs gate reuse, from-scratch MLP, history window and fMoE maps, "
                                           "on held-out ShareGPT and HumanEval prompts. Writes predictor.json and predictor.png with --out.")
    add_bench_flags(bench)
    bench.add_argument("--model", metavar="DIR", help="a MoE model directory (default: the default model)")
    bench.add_argument("--threshold", type=float, default=None, help="layer-aware fine-tuning threshold h (default 0.8)")
    bench.add_argument("--threads", type=int, default=2, help="torch CPU threads for the model's forward passes (default 2); predictors use one")
    bench.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    from moeless.predictor.report import bench_summary, plot_scores  # heavy: kept off --help's start-up path
    from moeless.predictor.sources import dataset_traces, load_model
    from moeless.core.threads import torch_threads

    cfg = QUICK if args.quick else BenchConfig()
    if args.threshold is not None:
        cfg = replace(cfg, threshold=args.threshold)
    with torch_threads(args.threads):
        model = load_model(args.model)
        sharegpt = dataset_traces(model, "sharegpt", cfg.sharegpt, cfg.max_tokens)
        humaneval = dataset_traces(model, "humaneval", cfg.humaneval, cfg.max_tokens)
    with torch_threads(1):
        result = run_bench(model, sharegpt, humaneval, cfg)
    print(bench_summary(result))
    path = write_result(args.out, "predictor", result)
    if path is not None:
        print(f"\nwrote {path} and {plot_scores(result, Path(args.out) / 'predictor.png')}")
    return 0


def bench_pairs(num_layers: int, cfg: BenchConfig) -> list[Pair]:
    """(l, d) for the scored source layers and every distance that stays inside the model."""
    if any(d < 1 for d in cfg.distances):
        raise ValueError(f"benchmark distances must be at least 1, got {cfg.distances}")
    return [(l, d) for d in cfg.distances for l in range(0, num_layers, cfg.source_stride) if l + d < num_layers]


def run_bench(model, sharegpt: RoutingTraces, humaneval: RoutingTraces, cfg: BenchConfig, progress: bool = True) -> dict:
    """Train, warm and score every method; the result is JSON-ready.

    1. Pairs (l, d) and the fit/validation split of the ShareGPT train prompts.
    2. Train the gate replicas (layer-aware) and the MLPs; time both.
    3. Score every method on the ShareGPT test prompts and on HumanEval.
    4. Memory per method, gate size, and the ratios against the baselines.
    """
    spec = model.spec
    pairs = bench_pairs(spec.num_layers, cfg)
    train = sharegpt.split("train")
    fit, val = train.holdout()
    fit_cfg = FitConfig(threshold=cfg.threshold, max_epochs=cfg.epochs, **cfg.fit)
    start = time.perf_counter()
    replicas, replica_reports = layer_aware_finetune(model, fit, val, pairs, fit_cfg, progress=progress)
    replica_s = time.perf_counter() - start
    start = time.perf_counter()
    mlp, _ = train_scratch(model, fit, val, pairs, FitConfig(max_epochs=cfg.mlp_epochs, **cfg.fit), cfg.mlp_width, progress)
    mlp_s = time.perf_counter() - start
    replica_init = ModulePredictor("replica_init", rescaled_gate_copies(model, fit, pairs), gate_route(model), spec.num_experts)

    def fresh(method: str):
        """A predictor of `method`, history-based ones warmed on the train prompts."""
        if method == "history":
            p = HistoryPredictor(spec.num_layers, spec.num_experts, spec.top_k, cfg.history_window)
        elif method == "fmoe":
            p = ExpertMapPredictor(spec.num_layers, spec.num_experts, spec.top_k)
        else:
            return {"gate_replica": replicas, "replica_init": replica_init, "gate_reuse": gate_reuse(model, pairs), "mlp": mlp}[method]
        warm(p, train)
        return p

    scores: dict = {}
    test = sharegpt.split("test")
    for name, traces in (("sharegpt", test), ("humaneval", humaneval)):
        scores[name] = {}
        for method in METHODS:
            per_pair = replay(fresh(method), traces, pairs, progress=progress)
            scores[name][method] = {str(d): m for d, m in by_distance(per_pair).items()}
    longest = max(test.traces, key=lambda t: t.num_tokens)  # latency at the largest prefill
    memory = {method: fresh(method).nbytes() for method in METHODS}
    latency = {method: latency_ms(fresh(method), longest, pairs) for method in METHODS}
    tuned = [r for r in replica_reports.values() if r.tuned]
    return {
        "config": asdict(cfg),
        "model": {"arch": spec.arch, "L": spec.num_layers, "E": spec.num_experts, "k": spec.top_k, "H": spec.hidden_size},
        "prompts": {"train": len(train.traces), "fit": len(fit.traces), "val": len(val.traces),
                    "sharegpt_test": len(sharegpt.split("test").traces), "humaneval": len(humaneval.traces)},
        "pairs": len(pairs),
        "scores": scores,
        "memory_bytes": memory,
        "latency_ms_per_layer": latency,
        "latency_tokens": longest.num_tokens,
        "gate_bytes": spec.hidden_size * spec.num_experts * 4,  # one float32 gate [E, H]
        "memory_per_layer_bytes": {m: b / len(pairs) if m in ("gate_replica", "replica_init", "gate_reuse", "mlp") else b / spec.num_layers for m, b in memory.items()},
        "training_s": {"gate_replica": replica_s, "mlp": mlp_s},
        "finetune": {"pairs_under_threshold": sum(r.before < cfg.threshold for r in replica_reports.values()),
                     "pairs_tuned": len(tuned), "pairs_at_threshold_after": sum(r.after >= cfg.threshold for r in replica_reports.values()),
                     "mean_val_gain": sum(r.after - r.before for r in tuned) / max(1, len(tuned))},
        "ratios": ratios(scores),
    }


def ratios(scores: dict) -> dict:
    """gate_replica over each baseline, per dataset and distance, for top-k hit and load accuracy
    (e.g. 1.18 = 18% more accurate); history and fMoE have no top-k, only load accuracy."""
    out: dict = {}
    for dataset, methods in scores.items():
        ours = methods["gate_replica"]
        out[dataset] = {
            base: {d: {metric: ours[d][metric] / methods[base][d][metric] for metric in ("topk_hit", "load_acc") if methods[base][d][metric] > 0}
                   for d in ours}
            for base in METHODS if base != "gate_replica"
        }
    return out
