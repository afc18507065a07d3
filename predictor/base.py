"""The one interface every load predictor implements, the gate replicas and all baselines alike.

While layer `source` of an iteration computes, a predictor forecasts the load of layer
`source + distance` from what is known by then: the hidden states entering layer `source`
and the iteration's expert map so far (mean gate probabilities of layers 0..source). After
the iteration, `observe` hands it the actual loads (history-based methods learn from them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


@dataclass(frozen=True)
class Forecast:
    """A predicted load of one layer for one iteration.

    load: [E] float, predicted tokens per expert (sums to T * k);
    topk: [T, k] int, predicted experts per token, or None for load-only methods.
    """

    load: np.ndarray
    topk: np.ndarray | None = None


class Predictor(Protocol):
    """A load predictor. `name` identifies the method in reports."""

    name: str

    def predict(self, source: int, distance: int, hidden: torch.Tensor, trajectory: np.ndarray) -> Forecast:
        """Forecast layer source + distance.

        hidden: [T, H], the gate input of layer `source`; trajectory: [source + 1, E], mean gate
        probabilities of layers 0..source of this iteration.
        """
        ...

    def observe(self, loads: np.ndarray, trajectory: np.ndarray) -> None:
        """A finished iteration: loads [L, E] actual tokens per expert, trajectory [L, E]."""
        ...

    def nbytes(self) -> int:
        """Memory the predictor holds (parameters or stored history), in bytes."""
        ...


def load_from_topk(topk: np.ndarray, num_experts: int) -> np.ndarray:
    """Tokens per expert implied by per-token choices: topk [T, k] -> [E] float."""
    return np.bincount(np.asarray(topk).reshape(-1), minlength=num_experts).astype(np.float64)
