"""History-window baseline (as EPLB uses): the forecast is the moving average of recent loads.

It ignores the current iteration's tokens except for their number: the forecast of layer l is
the mean normalised load of layer l over the last `window` iterations, times T * k.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from moeless.predictor.base import Forecast


class HistoryPredictor:
    """Moving average of the last `window` iterations' per-layer load shares."""

    name = "history"

    def __init__(self, num_layers: int, num_experts: int, top_k: int, window: int = 16):
        if window < 1:
            raise ValueError(f"history window must be at least 1 iteration, got {window}")
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.window = window
        self._shares: deque[np.ndarray] = deque(maxlen=window)  # each [L, E], rows sum to 1

    def predict(self, source: int, distance: int, hidden: torch.Tensor, trajectory: np.ndarray) -> Forecast:
        target = source + distance
        if not 0 <= target < self.num_layers:
            raise ValueError(f"layer {source} + distance {distance} is outside 0..{self.num_layers - 1}")
        tokens = hidden.shape[0] * self.top_k
        if not self._shares:
            return Forecast(np.full(self.num_experts, tokens / self.num_experts))
        share = np.mean([s[target] for s in self._shares], axis=0)
        return Forecast(share * tokens)

    def observe(self, loads: np.ndarray, trajectory: np.ndarray) -> None:
        loads = np.asarray(loads, dtype=np.float64)
        if loads.shape != (self.num_layers, self.num_experts):
            raise ValueError(f"loads must be [L, E] = [{self.num_layers}, {self.num_experts}], got {loads.shape}")
        total = loads.sum(axis=1, keepdims=True)
        uniform = np.full_like(loads, 1.0 / self.num_experts)
        self._shares.append(np.where(total > 0, loads / np.maximum(total, 1), uniform))

    def nbytes(self) -> int:
        return self.window * self.num_layers * self.num_experts * 8
