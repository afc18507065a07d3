"""What changes between two placements: replicas to load (cold starts), replicas to evict, churn.

A replica is identified by (expert, GPU) within a layer: a new placement reuses a resident
replica when the same expert was on the same GPU before (token shares may change freely).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeless.placement.types import LayerPlacement, Placement


@dataclass(frozen=True)
class LayerDiff:
    """cold_loads: [N, 2] (expert, gpu) to load; evictions: [M, 2] (expert, gpu) to drop; kept: warm reused."""

    cold_loads: np.ndarray
    evictions: np.ndarray
    kept: int

    @property
    def churn(self) -> int:
        """Replicas loaded plus replicas evicted."""
        return int(self.cold_loads.shape[0] + self.evictions.shape[0])

    def cold_loads_per_gpu(self, num_gpus: int) -> np.ndarray:
        """Cold starts each GPU performs: [G] int."""
        return np.bincount(self.cold_loads[:, 1], minlength=num_gpus) if self.cold_loads.size else np.zeros(num_gpus, np.int64)


def _pairs(layer: LayerPlacement | None) -> set[tuple[int, int]]:
    if layer is None:
        return set()
    return set(zip(layer.expert.tolist(), layer.gpu.tolist()))


def _array(pairs: set[tuple[int, int]]) -> np.ndarray:
    return np.array(sorted(pairs), dtype=np.int64).reshape(-1, 2)


def diff_layer(previous: LayerPlacement | None, new: LayerPlacement) -> LayerDiff:
    """The change from `previous` (None: nothing resident) to `new` for one layer."""
    before, after = _pairs(previous), _pairs(new)
    return LayerDiff(_array(after - before), _array(before - after), len(after & before))


def diff(previous: Placement | None, new: Placement) -> list[LayerDiff]:
    """Per-layer diffs: [L]. previous must have the same layer count, or be None."""
    if previous is not None and previous.num_layers != new.num_layers:
        raise ValueError(f"cannot diff placements of {previous.num_layers} and {new.num_layers} layers")
    return [diff_layer(previous.layers[l] if previous else None, lp) for l, lp in enumerate(new.layers)]
