"""Score any predictor on routing traces with the shared metrics (predictor/metrics.py).

The traces are replayed as a stream of iterations (one prompt's prefill each): for every source
layer and distance the predictor forecasts, the forecast is compared with the actual routing,
and after the iteration the predictor observes the actual loads. History-based methods are
first warmed on other traces (the training prompts), as a running system would be.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from moeless.predictor.base import Predictor
from moeless.predictor.dataset import PromptTrace, RoutingTraces
from moeless.predictor.gate_replica import Pair
from moeless.predictor.metrics import summarise, topk_hit_rate
from moeless.core.threads import torch_threads


@dataclass
class _Cases:
    """What one (l, d) pair predicted and what happened, over the iterations."""

    pred: list[np.ndarray] = field(default_factory=list)  # [E] each
    true: list[np.ndarray] = field(default_factory=list)  # [E] each
    pred_idx: list[np.ndarray] = field(default_factory=list)  # [T, k] each
    true_idx: list[np.ndarray] = field(default_factory=list)  # [T, k] each

    def metrics(self) -> dict[str, float]:
        hit = topk_hit_rate(np.concatenate(self.pred_idx), np.concatenate(self.true_idx)) if self.pred_idx else None
        return summarise(np.stack(self.pred), np.stack(self.true), hit)


def warm(predictor: Predictor, traces: RoutingTraces) -> None:
    """Let the predictor observe every iteration of `traces`, in order."""
    for trace in traces.traces:
        predictor.observe(trace.load.numpy(), trace.trajectory.numpy())


def replay(predictor: Predictor, traces: RoutingTraces, pairs: list[Pair], progress: bool = False) -> dict[Pair, dict[str, float]]:
    """Metrics of every (l, d) pair over the iterations of `traces`."""
    if not traces.traces:
        raise ValueError("no traces to evaluate on; collect more prompts for this split")
    cases = {pair: _Cases() for pair in pairs}
    for trace in tqdm(traces.traces, desc=f"scoring {predictor.name}", unit="prompt", disable=not progress):
        hidden = trace.hidden.float()
        trajectory = trace.trajectory.numpy()
        for (source, distance), c in cases.items():
            forecast = predictor.predict(source, distance, hidden[source], trajectory[: source + 1])
            c.pred.append(forecast.load)
            c.true.append(trace.load[source + distance].numpy())
            if forecast.topk is not None:
                c.pred_idx.append(forecast.topk)
                c.true_idx.append(trace.idx[source + distance].numpy())
        predictor.observe(trace.load.numpy(), trajectory)
    return {pair: c.metrics() for pair, c in cases.items()}


def latency_ms(predictor: Predictor, trace: PromptTrace, pairs: list[Pair], repeats: int = 5) -> float:
    """Median wall time of one predict call (one layer's forecast) on one trace's tokens, in ms:
    the latency a forecast adds to a layer when it is not overlapped with the layer's compute.

    Measured on one CPU thread, as the runtime's worker runs it (see moeless.core.threads.torch_threads). The
    median resists other processes' noise.
    """
    hidden, trajectory = trace.hidden.float(), trace.trajectory.numpy()
    times = []
    with torch_threads(1):
        for _ in range(repeats):
            for source, distance in pairs:
                start = time.perf_counter()
                predictor.predict(source, distance, hidden[source], trajectory[: source + 1])
                times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def by_distance(per_pair: dict[Pair, dict[str, float]]) -> dict[int, dict[str, float]]:
    """Mean of each metric over the source layers of every distance (NaNs skipped)."""
    out: dict[int, dict[str, float]] = {}
    for d in sorted({d for _, d in per_pair}):
        rows = [m for (_, dist), m in per_pair.items() if dist == d]
        out[d] = {k: _mean([r[k] for r in rows]) for k in rows[0]}
    return out


def _mean(values: list[float]) -> float:
    defined = [v for v in values if not np.isnan(v)]
    return float(np.mean(defined)) if defined else float("nan")
