"""Where `moeless bench planner` and `moeless eval` get real per-request loads, forecasts and the
model's expert facts.

'default': the default model on ShareGPT test prompts (held out from the predictor's training
prompts), with the gate-replica predictor's forecasts at every distance; the predictor is the
one `moeless predictor train` caches for this model (predictor/train.trained_gate_replicas: trained on the ShareGPT
train split first if missing). Traced once and cached under the moeless cache, keyed by the
model's build and the predictor file. 'tiny': a tiny random moeless-sliced model on random token
ids with untrained gate copies as the predictor (wiring only). Anything else: a .npz written by
traces/request_forecasts.save_forecasts (loads and forecasts) or by
traces/request_loads.save_request_loads (loads only: no predictor forecasts).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Sequence

import numpy as np

from moeless.core.paths import cache_dir
from moeless.model.datasets import humaneval_prompts, sharegpt_prompts
from moeless.model.default import BuildConfig, default_model, model_path
from moeless.model.shape import ModelFacts, model_facts
from moeless.model.tiny import tiny_model
from moeless.predictor.gate_replica import all_pairs, gate_reuse
from moeless.predictor.train import trained_gate_replicas
from moeless.traces.request_forecasts import load_forecasts, save_forecasts, trace_with_forecasts
from moeless.traces.request_loads import load_request_loads

DATASETS = {"sharegpt": "ShareGPT test", "humaneval": "HumanEval"}  # the default model's prompt sources


def requests_from(source: str, requests: int, new_tokens: int, distances: Sequence[int],
                  dataset: str = "sharegpt") -> tuple[list, list | None, ModelFacts, str]:
    """(per-request loads, their forecasts or None, the model's facts, a line saying where they came from).

    dataset: the default model's prompts, "sharegpt" (its test split) or "humaneval" (code)."""
    if requests <= 0 or new_tokens < 0:
        raise ValueError(f"need requests > 0 and new_tokens >= 0, got {requests}, {new_tokens}")
    if dataset not in DATASETS:
        raise ValueError(f"unknown prompt dataset {dataset!r}; use one of {', '.join(DATASETS)}")
    if source == "tiny":
        rng = np.random.default_rng(0)
        model = tiny_model("moeless-sliced")
        distances = [d for d in distances if d < model.spec.num_layers] or [1]
        prompts = [rng.integers(0, model.spec.vocab_size, size=int(rng.integers(8, 64))).tolist() for _ in range(requests)]
        loads, forecasts = trace_with_forecasts(model, gate_reuse(model, all_pairs(model.spec.num_layers, distances)),
                                                prompts, new_tokens, distances)
        note = f"tiny random moeless-sliced model, {requests} random-token prompts, untrained gate copies (wiring check, not real loads)"
        return loads, forecasts, model_facts(model), note
    if source == "default":
        model = default_model()
        predictor, path = trained_gate_replicas(model, distances)
        tag = hashlib.sha256(path.read_bytes()).hexdigest()[:8]
        ds = "".join(map(str, sorted(set(distances))))
        named = "" if dataset == "sharegpt" else f"-{dataset}"
        cached = cache_dir() / f"planner-forecasts-{model_path(BuildConfig()).name}-p{tag}{named}-n{requests}-t{new_tokens}-d{ds}.npz"
        if not cached.is_file():
            prompts = sharegpt_prompts(requests, split="test") if dataset == "sharegpt" else humaneval_prompts(requests)
            loads, forecasts = trace_with_forecasts(model, predictor, prompts, new_tokens, distances)
            save_forecasts(cached, loads, forecasts)
        loads, forecasts = load_forecasts(cached)
        note = (f"default model on {len(loads)} {DATASETS[dataset]} prompts, {new_tokens} decode tokens; gate-replica predictor "
                f"{path.name} (trained on the train split) ({cached})")
        return loads, forecasts, model_facts(model), note
    path = Path(source)
    with np.load(path) as f:
        has_forecasts = "predicted_prefill" in f.files
    if has_forecasts:
        loads, forecasts = load_forecasts(path)
    else:
        loads, forecasts = load_request_loads(path), None
    return loads, forecasts, model_facts(default_model()), f"routing trace {path} (expert shape of the default model)"
