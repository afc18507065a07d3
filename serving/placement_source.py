"""Where the serving path gets its placement: an input that may change between iterations.

The serving path never decides a placement (docs/design.md); a planner, a benchmark or a test calls
`set` and the next layer that runs reads the new one. Until the planner exists the default is
static expert parallelism: one replica per expert, contiguous blocks of experts per host.
"""

from __future__ import annotations

import threading

from moeless.placement.types import LayerPlacement, Placement, PlacementError


class PlacementSource:
    """A thread-safe holder of the current Placement; `version` counts the changes."""

    def __init__(self, placement: Placement):
        self._lock = threading.Lock()
        self._placement = placement
        self.version = 0

    @staticmethod
    def static(num_layers: int, num_experts: int, num_hosts: int) -> "PlacementSource":
        """Static one-replica-per-expert placement over `num_hosts` expert hosts."""
        return PlacementSource(Placement.static(num_layers, num_experts, num_hosts))

    @property
    def placement(self) -> Placement:
        with self._lock:
            return self._placement

    def layer(self, layer: int) -> tuple[LayerPlacement, int]:
        """One layer's replicas and the hosts the placement spans, from one placement (a set() between
        two reads cannot mix two placements)."""
        placement = self.placement
        return placement.layers[layer], placement.num_gpus

    def set(self, placement: Placement) -> None:
        """Replace the placement; it must keep the layer and expert counts (the host count may change:
        a pool that grew or shrank while serving)."""
        current = self.placement
        if (placement.num_layers, placement.num_experts) != (current.num_layers, current.num_experts):
            raise PlacementError(
                f"a new placement must keep {current.num_layers} layers x {current.num_experts} experts, got "
                f"{placement.num_layers} x {placement.num_experts}"
            )
        with self._lock:
            self._placement = placement
            self.version += 1
