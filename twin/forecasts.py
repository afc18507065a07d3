"""Real loads and real forecasts of every request, for the twin: what the planner sees per iteration.

One greedy generation per batch of prompts, its routing captured (model.capture): per request the
actual loads (prefill [L, E], one [L, E] row per decode step, as moeless.model.traces records
them) and, for every distance d, the load predictor's forecast of layer t made from layer t - d's
gate input (per token top-k, counted per request). Layers t < d have no source layer in the same
forward pass: NaN there.

`iteration_forecasts` turns them into [I, L, E] per iteration (batched like the loads) for three
forecast kinds: "perfect" (the actual loads), "previous" (the previous iteration's loads) and
"predictor" (the predictor at distance d; layers t < d from layer 0, layer 0 from the last
iteration of the same phase, scaled to this one's tokens). A fourth, "history" (the predictor
switched off: predictor/history.HistoryPredictor, the moving average of the last HISTORY_WINDOW
iterations' load shares times the iteration's tokens, as EPLB's window uses), is replayed by
`history_forecasts`. `forecast_set` makes every kind at every distance, the one forecast set that
`moeless bench planner` and `moeless eval` replay, and `accuracy` scores it per phase.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from tqdm import tqdm

from moeless.model.batching import left_pad
from moeless.model.traces import RequestLoads, _prompt_ids, load_request_loads
from moeless.predictor.history import HistoryPredictor
from moeless.predictor.metrics import load_accuracy
from moeless.twin.iterations import Iteration, per_iteration

KINDS = ("perfect", "previous", "predictor", "history")
HISTORY_WINDOW = 16  # iterations; predictor/history.py's default window
PHASES = ("prefill", "decode", "all")


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
    """Greedy-generate every prompt (EOS ends a request, as in model.traces.request_loads) and record
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


def save(path: str | Path, loads: Sequence[RequestLoads], forecasts: Sequence[RequestForecasts]) -> Path:
    """One .npz: the loads in model.traces' layout plus the forecasts (predicted_prefill [N, D, L, E],
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


def load(path: str | Path) -> tuple[list[RequestLoads], list[RequestForecasts]]:
    """Read what `save` wrote."""
    loads = load_request_loads(path)
    with np.load(path) as f:
        prefill, decode, distances = f["predicted_prefill"], f["predicted_decode"], tuple(f["distances"].tolist())
    starts = np.cumsum([0, *(len(r.decode) for r in loads)])
    forecasts = [RequestForecasts(distances, prefill[i], decode[starts[i]:starts[i + 1]]) for i in range(len(loads))]
    return loads, forecasts


def iteration_forecasts(iterations: Sequence[Iteration], kind: str, forecasts: Sequence[RequestForecasts] | None = None,
                        distance: int | None = None) -> np.ndarray:
    """The forecast the planner sees in every iteration: [I, L, E] (see the module docstring).

    "previous": the previous iteration's loads (one token per expert before the first).
    "predictor" at distance d: layer t is forecast from layer max(t - d, 0), the iteration's first
    layer forecasting layers 1..d-1 at their own distance where it was traced; layer 0 has no
    source layer: the last iteration of the same phase, scaled to this iteration's tokens (the
    scheduler knows both before the forward pass; the other phase's last iteration is a poor guess).
    """
    actual = np.stack([it.load for it in iterations]).astype(np.float64)
    if kind == "perfect":
        return actual
    if kind == "previous":
        return np.concatenate([np.ones_like(actual[:1]), actual[:-1]])
    if kind != "predictor":
        raise ValueError(f"unknown forecast kind {kind!r}; use one of {KINDS[:3]}")
    if not forecasts or distance not in forecasts[0].distances:
        have = forecasts[0].distances if forecasts else ()
        raise ValueError(f"no predictor forecasts at distance {distance}; traced distances: {have}")
    # Layer t is forecast from layer max(t - d, 0): at distance min(d, t), when that distance was traced.
    predicted = np.full_like(actual, np.nan)
    for j, d in enumerate(forecasts[0].distances):
        if d <= distance:
            by_d = per_iteration(iterations, [f.prefill[j] for f in forecasts], [f.decode[:, j] for f in forecasts])
            layers = np.arange(actual.shape[1]) >= d if d == distance else np.arange(actual.shape[1]) == d
            predicted[:, layers] = by_d[:, layers]
    return np.where(np.isnan(predicted), same_phase_history(iterations), predicted)


def same_phase_history(iterations: Sequence[Iteration]) -> np.ndarray:
    """Per iteration, the last earlier iteration of its phase, scaled to its own token count per
    layer (tokens spread evenly when there is none): [I, L, E]."""
    out, last = [], {}
    for it in iterations:
        load = it.load.astype(np.float64)
        total = load.sum(axis=1, keepdims=True)
        before = last.get(it.phase)
        if before is None:
            guess = np.repeat(total / load.shape[1], load.shape[1], axis=1)
        else:
            guess = before * np.divide(total, before.sum(axis=1, keepdims=True), out=np.zeros_like(total),
                                       where=before.sum(axis=1, keepdims=True) > 0)
        out.append(guess)
        last[it.phase] = load
    return np.stack(out)


def history_forecasts(iterations: Sequence[Iteration], top_k: int, window: int = HISTORY_WINDOW) -> np.ndarray:
    """[I, L, E]: what HistoryPredictor forecasts for every layer of every iteration, having observed
    the iterations before it (uniform shares before the first)."""
    actual = np.stack([it.load for it in iterations]).astype(np.float64)
    num_iter, num_layers, num_experts = actual.shape
    predictor = HistoryPredictor(num_layers, num_experts, top_k, window)
    out = np.empty_like(actual)
    for i in range(num_iter):
        tokens = np.rint(actual[i].sum(axis=1) / top_k).astype(np.int64)  # the iteration's tokens, known when it runs
        for l in range(num_layers):
            out[i, l] = predictor.predict(l, 0, torch.empty((int(tokens[l]), 0)), None).load
        predictor.observe(actual[i], None)
    return out


def forecast_set(iterations: Sequence[Iteration], requests: Sequence[RequestForecasts] | None, distances: Sequence[int],
                 top_k: int) -> dict[tuple[str, int], np.ndarray]:
    """{(kind, d): [I, L, E]} for every kind at every distance d (only "predictor" depends on d;
    without predictor forecasts (`requests` None) there is no "predictor" kind)."""
    perfect = iteration_forecasts(iterations, "perfect")
    previous = iteration_forecasts(iterations, "previous")
    history = history_forecasts(iterations, top_k)
    out = {}
    for d in distances:
        out.update({("perfect", d): perfect, ("previous", d): previous, ("history", d): history})
        if requests is not None:
            out[("predictor", d)] = iteration_forecasts(iterations, "predictor", requests, d)
    return out


def accuracy(forecasts: dict[tuple[str, int], np.ndarray], iterations: Sequence[Iteration]) -> list[dict]:
    """Load accuracy (predictor/metrics.load_accuracy: 1 - half the L1 distance of load shares) of
    every forecast but the perfect one, averaged over layers and iterations of each phase."""
    actual = np.stack([it.load for it in iterations]).astype(np.float64)
    phase = np.array([it.phase for it in iterations])
    rows, seen = [], set()
    for (kind, d), forecast in sorted(forecasts.items()):
        if kind == "perfect" or (kind != "predictor" and kind in seen):
            continue
        seen.add(kind)
        scores = load_accuracy(forecast, actual)  # [I, L]
        row = {"forecast": kind, "distance": d if kind == "predictor" else None}
        for name in PHASES:
            mask = np.ones(len(phase), bool) if name == "all" else phase == name
            row[name] = float(np.nanmean(scores[mask])) if mask.any() and np.isfinite(scores[mask]).any() else None
        rows.append(row)
    return rows
