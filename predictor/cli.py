"""`moeless predictor train|eval` (registered by moeless.cli; `moeless bench predictor` is in moeless.bench.predictor)."""

from __future__ import annotations

import argparse
import json

from moeless.core.paths import cache_dir

DEFAULT_DISTANCES = [1, 2, 3, 4]


def register(commands: argparse._SubParsersAction) -> None:
    """Add `predictor train` and `predictor eval`."""
    group = commands.add_parser("predictor", help="expert load predictors: train gate replicas, evaluate them")
    sub = group.add_subparsers(dest="predictor_command", metavar="ACTION", required=True)

    train = sub.add_parser("train", help="collect routing traces and fine-tune gate replicas (layer-aware); save them in one file",
                           description="Profile every (layer, distance) gate copy on held-out prompts and fine-tune those under --threshold.")
    _model_flags(train)
    train.add_argument("--distances", type=int, nargs="+", default=DEFAULT_DISTANCES, metavar="D", help="prediction distances in layers (default: 1 2 3 4)")
    train.add_argument("--threshold", type=float, default=0.8, help="fine-tune pairs whose held-out top-k hit rate is under this (default 0.8)")
    train.add_argument("--max-epochs", type=int, default=20, help="epoch budget per (layer, distance) (default 20)")
    train.add_argument("--time-budget", type=float, default=None, metavar="S", help="wall-clock budget for all fine-tuning, seconds")
    train.add_argument("--out", metavar="FILE", help="predictor file (default: <cache>/predictor/gate-replicas-<model hash>.pt)")
    train.set_defaults(func=_train)

    evaluate = sub.add_parser("eval", help="score a predictor file on held-out prompts against gate reuse and history",
                              description="Top-k hit rate, load accuracy, Pearson, straggler precision per distance.")
    evaluate.add_argument("file", help="predictor file written by `moeless predictor train`")
    _model_flags(evaluate)
    evaluate.add_argument("--humaneval", type=int, default=0, metavar="N", help="also score on the first N HumanEval prompts (domain shift)")
    evaluate.set_defaults(func=_eval)


def _model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="DIR", help="a MoE model directory (default: the default model)")
    parser.add_argument("--prompts", type=int, default=240, help="ShareGPT prompts to trace, split 70:30 by prompt (default 240)")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens per prompt (default 96)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads for the model's forward passes (default 2); predictors use one")


def _train(args: argparse.Namespace) -> int:
    # heavy (the torch model code): kept off --help's start-up path
    from moeless.core.threads import torch_threads
    from moeless.predictor.finetune import FitConfig, layer_aware_finetune
    from moeless.predictor.fingerprint import model_hash
    from moeless.predictor.gate_replica import all_pairs
    from moeless.predictor.sources import dataset_traces, load_model
    from moeless.predictor.store import save_predictor

    with torch_threads(args.threads):
        model = load_model(args.model)
        traces = dataset_traces(model, "sharegpt", args.prompts, args.max_tokens)
    fit, val = traces.split("train").holdout()
    pairs = all_pairs(model.spec.num_layers, sorted(set(args.distances)))
    config = FitConfig(threshold=args.threshold, max_epochs=args.max_epochs, time_budget_s=args.time_budget)
    with torch_threads(1):
        replicas, reports = layer_aware_finetune(model, fit, val, pairs, config)
    out = args.out or cache_dir() / "predictor" / f"gate-replicas-{model_hash(model)}.pt"
    metadata = {
        "accuracy": {f"{l}/{d}": r.as_dict() for (l, d), r in reports.items()},
        "config": {**config.__dict__, "prompts": args.prompts, "max_tokens": args.max_tokens},
    }
    path = save_predictor(out, replicas, model, metadata)
    print(f"{'d':>2} {'pairs':>5} {'under h':>7} {'tuned':>5} {'val hit before':>14} {'after':>6}")
    for d in sorted(set(args.distances)):
        rows = [r for (_, dist), r in reports.items() if dist == d]
        if rows:
            before, after = (sum(getattr(r, a) for r in rows) / len(rows) for a in ("before", "after"))
            print(f"{d:>2} {len(rows):>5} {sum(r.before < args.threshold for r in rows):>7} {sum(r.tuned for r in rows):>5} {before:>14.3f} {after:>6.3f}")
    print(f"saved {len(pairs)} gate replicas ({replicas.nbytes() / 2**20:.2f} MiB) to {path}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    # heavy (the torch model code): kept off --help's start-up path
    from moeless.core.threads import torch_threads
    from moeless.predictor.evaluate import by_distance, replay, warm
    from moeless.predictor.gate_replica import gate_reuse
    from moeless.predictor.history import HistoryPredictor
    from moeless.predictor.report import scores_table
    from moeless.predictor.sources import dataset_traces, load_model
    from moeless.predictor.store import load_predictor

    with torch_threads(args.threads):
        model = load_model(args.model)
        predictor, meta = load_predictor(args.file, model)
        sharegpt = dataset_traces(model, "sharegpt", args.prompts, args.max_tokens)
        datasets = [("sharegpt", sharegpt.split("test"))]
        if args.humaneval:
            datasets.append(("humaneval", dataset_traces(model, "humaneval", args.humaneval, args.max_tokens)))
    pairs = sorted(predictor.modules)
    spec = model.spec
    for name, traces in datasets:
        history = HistoryPredictor(spec.num_layers, spec.num_experts, spec.top_k)
        warm(history, sharegpt.split("train"))
        with torch_threads(1):
            scores = {p.name: by_distance(replay(p, traces, pairs)) for p in (predictor, gate_reuse(model, pairs), history)}
        print(f"\n== {name}: {len(traces.traces)} held-out prompts, {traces.num_tokens} tokens ==")
        print(scores_table(scores))
    print(f"\nfile: distances {meta['distances']}, model {meta['model_hash']}, {json.dumps(meta.get('config', {}))}")
    return 0
