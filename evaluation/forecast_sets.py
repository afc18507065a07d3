"""The forecasts each planner of `moeless eval` sees, one [I, L, E] array per (kind, distance), and
how accurate they were during the run.

Kinds: "perfect" (the actual loads), "previous" (the previous iteration's loads), "predictor" (the
gate-replica predictor at distance d, controller/forecasts.iteration_forecasts) and "history" (the
predictor switched off: predictor/history.HistoryPredictor, the moving average of the last
HISTORY_WINDOW iterations' load shares times the iteration's tokens, as EPLB's window uses).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from moeless.twin.forecasts import RequestForecasts, iteration_forecasts
from moeless.twin.iterations import Iteration

KINDS = ("perfect", "previous", "predictor", "history")
HISTORY_WINDOW = 16  # iterations; predictor/history.py's default window
PHASES = ("prefill", "decode", "all")


def history_forecasts(iterations: Sequence[Iteration], top_k: int, window: int = HISTORY_WINDOW) -> np.ndarray:
    """[I, L, E]: what HistoryPredictor forecasts for every layer of every iteration, having observed
    the iterations before it (uniform shares before the first)."""
    import torch

    from moeless.predictor.history import HistoryPredictor

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
    from moeless.predictor.metrics import load_accuracy

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
