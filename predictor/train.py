"""A model's gate-replica predictor, trained end to end and saved in one file.

1. Trace ShareGPT prompts through the model (its real routing; cached per model).
2. Fine-tune every (layer, distance) gate copy whose held-out top-k hit rate is under the threshold.
3. Save the replicas with the model's fingerprint (predictor/store.py).
`moeless predictor train` runs it, and so does `trained_gate_replicas` (the twin's workload,
traces/sources.py) when the file it needs is missing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from moeless.core.threads import torch_threads
from moeless.predictor.finetune import FitConfig, layer_aware_finetune
from moeless.predictor.gate_replica import ModulePredictor, all_pairs
from moeless.predictor.sources import dataset_traces, load_model
from moeless.predictor.store import PredictorFileError, default_path, load_predictor, save_predictor

DEFAULT_DISTANCES = (1, 2, 3, 4)
DEFAULT_PROMPTS = 240
DEFAULT_MAX_TOKENS = 96


def train_gate_replicas(model_dir: str | None = None, distances: Sequence[int] = DEFAULT_DISTANCES,
                        prompts: int = DEFAULT_PROMPTS, max_tokens: int = DEFAULT_MAX_TOKENS, threads: int = 2,
                        config: FitConfig = FitConfig(), out: str | Path | None = None) -> str:
    """Train and save the gate replicas of the model in model_dir (None: the default model) for
    every layer at `distances`; returns what `moeless predictor train` prints (the last line names
    the file)."""
    with torch_threads(threads):
        model = load_model(model_dir)
        traces = dataset_traces(model, "sharegpt", prompts, max_tokens)
    fit, val = traces.split("train").holdout()
    pairs = all_pairs(model.spec.num_layers, sorted(set(distances)))
    with torch_threads(1):
        replicas, reports = layer_aware_finetune(model, fit, val, pairs, config)
    metadata = {
        "accuracy": {f"{l}/{d}": r.as_dict() for (l, d), r in reports.items()},
        "config": {**config.__dict__, "prompts": prompts, "max_tokens": max_tokens},
    }
    path = save_predictor(out or default_path(model), replicas, model, metadata)
    lines = [f"{'d':>2} {'pairs':>5} {'under h':>7} {'tuned':>5} {'val hit before':>14} {'after':>6}"]
    for d in sorted(set(distances)):
        rows = [r for (_, dist), r in reports.items() if dist == d]
        if rows:
            before, after = (sum(getattr(r, a) for r in rows) / len(rows) for a in ("before", "after"))
            lines.append(f"{d:>2} {len(rows):>5} {sum(r.before < config.threshold for r in rows):>7} "
                         f"{sum(r.tuned for r in rows):>5} {before:>14.3f} {after:>6.3f}")
    lines.append(f"saved {len(pairs)} gate replicas ({replicas.nbytes() / 2**20:.2f} MiB) to {path}")
    return "\n".join(lines)


def trained_gate_replicas(model, distances: Sequence[int]) -> tuple[ModulePredictor, Path]:
    """(the gate-replica predictor of `model` covering `distances`, its file): the file `moeless
    predictor train` writes for this model, trained now (ShareGPT train split) if missing or short."""
    path = default_path(model)
    try:
        predictor, meta = load_predictor(path, model)
        if set(distances) <= set(meta["distances"]):
            return predictor, path
    except PredictorFileError:
        pass
    print(train_gate_replicas(distances=sorted({*distances, 1, 2, 3, 4}), out=path))
    return load_predictor(path, model)[0], path
