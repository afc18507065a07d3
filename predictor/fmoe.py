"""fMoE-style expert-map matching: find the past iteration whose routing so far looks most like
the current one, and forecast with that iteration's later layers.

An expert map is an iteration's per-layer mean gate probabilities, [L, E]. While layer `source`
runs, the current map is known for layers 0..source; the stored map with the highest cosine
similarity over those layers is the match, and its load shares at layer source + d, times
T * k, are the forecast. (fMoE also matches prompts semantically for the first layers; this
keeps only the trajectory part.)
"""

from __future__ import annotations

import numpy as np
import torch

from moeless.predictor.base import Forecast


class ExpertMapPredictor:
    """Nearest stored expert map by cosine similarity of the trajectory so far."""

    name = "fmoe"

    def __init__(self, num_layers: int, num_experts: int, top_k: int, capacity: int = 1024):
        if capacity < 1:
            raise ValueError(f"expert-map capacity must be at least 1, got {capacity}")
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.capacity = capacity
        self._maps = np.zeros((0, num_layers, num_experts))  # [M, L, E] mean gate probabilities
        self._shares = np.zeros((0, num_layers, num_experts))  # [M, L, E] load shares

    def predict(self, source: int, distance: int, hidden: torch.Tensor, trajectory: np.ndarray) -> Forecast:
        target = source + distance
        if not 0 <= target < self.num_layers:
            raise ValueError(f"layer {source} + distance {distance} is outside 0..{self.num_layers - 1}")
        tokens = hidden.shape[0] * self.top_k
        if len(self._maps) == 0:
            return Forecast(np.full(self.num_experts, tokens / self.num_experts))
        # 1. Cosine similarity of the current trajectory (layers 0..source) with every stored map.
        current = np.asarray(trajectory, dtype=np.float64)[: source + 1].reshape(-1)
        stored = self._maps[:, : source + 1].reshape(len(self._maps), -1)
        norms = np.linalg.norm(stored, axis=1) * max(np.linalg.norm(current), 1e-12)
        similarity = stored @ current / np.maximum(norms, 1e-12)
        # 2. The best match's load shares at the target layer, scaled to this iteration's tokens.
        best = int(np.argmax(similarity))
        return Forecast(self._shares[best, target] * tokens)

    def observe(self, loads: np.ndarray, trajectory: np.ndarray) -> None:
        loads = np.asarray(loads, dtype=np.float64)
        shape = (self.num_layers, self.num_experts)
        if loads.shape != shape or np.shape(trajectory) != shape:
            raise ValueError(f"loads and trajectory must be [L, E] = {list(shape)}, got {loads.shape}, {np.shape(trajectory)}")
        total = loads.sum(axis=1, keepdims=True)
        shares = np.where(total > 0, loads / np.maximum(total, 1), 1.0 / self.num_experts)
        # Oldest maps go first when full.
        self._maps = np.concatenate([self._maps, np.asarray(trajectory, dtype=np.float64)[None]])[-self.capacity :]
        self._shares = np.concatenate([self._shares, shares[None]])[-self.capacity :]

    def nbytes(self) -> int:
        return int(self._maps.nbytes + self._shares.nbytes)
