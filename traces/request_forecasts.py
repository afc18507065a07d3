"""Real loads and real forecasts of every request: what the twin replays and scores.

One greedy generation per batch of prompts, its routing captured (model.capture): per request the
actual loads (prefill [L, E], one [L, E] row per decode step, as traces/request_loads.py records
them) and, for every distance d, the load predictor's forecast of layer t made from layer t - d's
gate input (per token top-k, counted per request). Layers t < d have no source layer in the same
forward pass: NaN there. `save_forecasts` / `load_forecasts`: both in one .npz.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from tqdm import tqdm

from moeless.model.batching import left_pad
from moeless.traces.request_loads import RequestLoads, _prompt_ids, load_request_loads


@dataclass(frozen=True)
class RequestForecasts:
    """Forecasts of one request's loads: prefill [D, L, E]; decode [S, D, L, E] (NaN for t < d)."""

    distances: tuple[int, ...]
    prefill: np.ndarray
    decode: np.ndarray


@torch.no_grad()
def trace_with_forecasts(model, predictor, prompts: Sequence[str | Sequence[int]], max_new_tokens: int,
                         distances: Sequence[int], max_prompt_tokens: int = 512, batch_size: int = 8,
                         progress: bool = True) -> tuple[list[RequestLoads], list[RequestForecasts]]:
    """Greedy-generate every prompt (EOS ends a request, as in traces/request_loads.request_loads) and record
    its loads and the predictor's forecasts at each distance; one entry per prompt, in order."""
    distances = tuple(sorted(set(distances)))
    num_layers, num_experts = model.spec.num_layers, model.spec.num_experts
    if not distances or min(distances) < 1 or max(distances) >= num_layers:
        raise ValueError(f"distances must be in 1..{num_layers - 1}, got {distances}")
    eos = getattr(model.tokenizer, "eos_token_id", None)
    seqs = [_prompt_ids(model, p, max_prompt_tokens) for p in prompts]
    order = sorted(range(len(seqs)), key=lambda i: (len(seqs[i]), i))
    loads: dict[int, RequestLoads] = {}
    forecasts: dict[int, RequestForecasts] = {}
    for start in tqdm(range(0, len(order), batch_size), desc="routing + forecasts", unit="batch", disable=not progress):
        chunk = order[start:start + batch_size]
        batch = [seqs[i] for i in chunk]
        ids, mask = left_pad(batch)
        with model.capture() as capture:
            out = model.generate(ids, max_new_tokens + 1, attention_mask=mask, eos_token_id=eos)

        def counts(call: int) -> tuple[np.ndarray, np.ndarray]:
            """Per unpadded token of one forward call: actual [T, L, E] and forecast [T, D, L, E]."""
            records = capture.iterations[call]
            actual = np.stack([np.eye(num_experts, dtype=np.int64)[r.idx.numpy()].sum(1) for r in records], axis=1)
            tokens = actual.shape[0]
            predicted = np.full((tokens, len(distances), num_layers, num_experts), np.nan)
            for j, d in enumerate(distances):
                for t in range(d, num_layers):
                    source = records[t - d].gate_input
                    topk = predictor.predict(t - d, d, source, np.zeros((t - d + 1, num_experts))).topk
                    predicted[:, j, t] = np.eye(num_experts)[topk].sum(1)
            return actual, predicted

        prefill, prefill_f = counts(0)
        lengths = np.cumsum([0, *map(len, batch)])
        steps = [counts(c) for c in range(1, len(capture.iterations))]
        for b, i in enumerate(chunk):
            generated = out[b, ids.shape[1]:].tolist()
            used = generated.index(eos) if eos in generated else max_new_tokens
            rows = slice(lengths[b], lengths[b + 1])
            decode = np.stack([a[b] for a, _ in steps[:used]]) if used else np.zeros((0, num_layers, num_experts), np.int64)
            decode_f = np.stack([f[b] for _, f in steps[:used]]) if used else np.zeros((0, len(distances), num_layers, num_experts))
            loads[i] = RequestLoads(prefill[rows].sum(0), decode, len(batch[b]))
            forecasts[i] = RequestForecasts(distances, prefill_f[rows].sum(0), decode_f)
    return [loads[i] for i in range(len(seqs))], [forecasts[i] for i in range(len(seqs))]


def save_forecasts(path: str | Path, loads: Sequence[RequestLoads], forecasts: Sequence[RequestForecasts]) -> Path:
    """One .npz: the loads in traces/request_loads.py's layout plus the forecasts (predicted_prefill [N, D, L, E],
    predicted_decode [sum S, D, L, E], distances)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    shape = loads[0].prefill.shape
    np.savez_compressed(
        path, prefill=np.stack([r.prefill for r in loads]),
        decode=np.concatenate([r.decode.reshape(-1, *shape) for r in loads]),
        decode_len=np.array([len(r.decode) for r in loads], dtype=np.int64),
        prompt_tokens=np.array([r.prompt_tokens for r in loads], dtype=np.int64),
        predicted_prefill=np.stack([f.prefill for f in forecasts]),
        predicted_decode=np.concatenate([f.decode.reshape(-1, len(f.distances), *shape) for f in forecasts]),
        distances=np.array(forecasts[0].distances, dtype=np.int64),
    )
    return path


def load_forecasts(path: str | Path) -> tuple[list[RequestLoads], list[RequestForecasts]]:
    """Read what `save_forecasts` wrote."""
    loads = load_request_loads(path)
    with np.load(path) as f:
        prefill, decode, distances = f["predicted_prefill"], f["predicted_decode"], tuple(f["distances"].tolist())
    starts = np.cumsum([0, *(len(r.decode) for r in loads)])
    forecasts = [RequestForecasts(distances, prefill[i], decode[starts[i]:starts[i + 1]]) for i in range(len(loads))]
    return loads, forecasts
