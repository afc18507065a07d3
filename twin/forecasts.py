"""What the planner sees per iteration: real forecasts of every request (traces/request_forecasts.py:
per request the actual loads and, for every distance d, the load predictor's forecast of layer t
made from layer t - d's gate input; NaN for t < d) batched as the twin's iterations are.

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

from typing import Sequence

import numpy as np
import torch

from moeless.predictor.history import HistoryPredictor
from moeless.predictor.metrics import load_accuracy
from moeless.traces.request_forecasts import RequestForecasts
from moeless.twin.iterations import Iteration, per_iteration

KINDS = ("perfect", "previous", "predictor", "history")
HISTORY_WINDOW = 16  # iterations; predictor/history.py's default window
PHASES = ("prefill", "decode", "all")


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
