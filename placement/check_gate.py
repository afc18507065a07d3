"""Whether a layer call runs the data plane's check at all: a per-layer gate on what recent checks
found. Pure Python state, no clock; the twin and the RemoteExecutor route through the same gate.

The check (`shares.actual_shares`, 2-3.5 us measured) runs on every call of a layer that holds
copies, and on a batch whose imbalance the copies cannot help it buys nothing: in decode on 8 H100s
moeless-sets' layers paid 1,572 checks that found no gain for 141 that paired (FLAME log, 150
iterations, price 0; docs/planner.md). So, per layer and phase (a prefill's batch and a decode's
differ, and they alternate), the doubling back-off of a retransmit timer applied to a check:

1. A call that runs the check records what the check reckons its choice saves over static EP's
   split (`Routed.saved_s`: a pairing at its bound, net of its own seconds; the planned shares'
   lead over the unsplit ones; else 0).
2. Where the mean of the last WINDOW such records beats check_s, the next call checks again.
3. Otherwise the next `backoff` calls skip it and route static EP's split (each expert on its first
   replica: a moeless plan lists its homes first), costing only the gate's own lookup (the
   profile's relevel_skip_s, ~0.25x a check); backoff doubles on each check
   that does not pay, up to MAX_BACKOFF, and returns to 0 on one that does.
4. A call whose layer holds a replica the layer never held before checks at once (its records say
   nothing of that copy); copies dropped, or held again, are nothing new.

So a layer whose copies stop paying costs at most check_s every MAX_BACKOFF calls and one per copy
it has never held, and one whose copies pay checks on every call.

Golden example (check_s 3 us, WINDOW 2, MAX_BACKOFF 4), records in us: 10 -> check next (mean 10);
0 -> mean 5, check next; 0 -> mean 0: skip 1; (skip); 0 -> skip 2; (skip, skip); 0 -> skip 4;
(4 skips); 8 -> mean 4 > 3: check next, backoff 0.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from moeless.placement.latency_model import LatencyModel
from moeless.placement.shares import Routed, actual_shares
from moeless.placement.types import LayerPlacement

WINDOW = 8  # recent checks a layer's decision averages (a pairing's gain varies batch to batch)
MAX_BACKOFF = 64  # calls skipped at most between two checks of a layer whose copies stopped paying


@dataclass
class _Layer:
    saved: deque  # the last `window` checks' records
    skip: int = 0
    backoff: int = 0
    replicas: LayerPlacement | None = None  # the layer object last routed
    seen: set = field(default_factory=set)  # every (expert, gpu) replica the layer has held, as e * G + g
    unsplit: tuple | None = None  # (the layer object, its unsplit LayerPlacement), made once per layer

    def adds_copies(self, layer: LayerPlacement, num_gpus: int) -> bool:
        """Whether layer holds a replica this layer never held before (its records say nothing of it)."""
        if layer is self.replicas:
            return False
        self.replicas = layer
        ids = set((layer.expert * num_gpus + layer.gpu).tolist())
        new = not ids <= self.seen
        self.seen |= ids
        return new


class CheckGate:
    """Per-layer gate in front of `actual_shares` (module docstring). check_s: what one check
    costs (the profile's check_s); window, max_backoff: the rule's two knobs (max_backoff 0: every
    call checks, the gate's bookkeeping only)."""

    def __init__(self, check_s: float, window: int = WINDOW, max_backoff: int = MAX_BACKOFF) -> None:
        if not check_s >= 0 or window < 1 or max_backoff < 0:
            raise ValueError(f"CheckGate needs check_s >= 0, window >= 1, max_backoff >= 0; got {check_s}, {window}, {max_backoff}")
        self.check_s, self.window, self.max_backoff = check_s, window, max_backoff
        self._layers: dict[tuple[int, str], _Layer] = {}
        self.checks = self.skips = 0

    def route(self, index: int, phase: str, load: np.ndarray, layer: LayerPlacement, model: LatencyModel,
              num_gpus: int, relevel_s: float, split: bool = True) -> Routed:
        """`actual_shares` for layer `index`'s call in `phase`, or static EP's split without the check (step 3)."""
        if layer.num_replicas == load.shape[0]:
            return Routed(layer, False, False)
        state = self._layers.get((index, phase))
        if state is None:
            state = self._layers[(index, phase)] = _Layer(deque(maxlen=self.window))
        if state.adds_copies(layer, num_gpus):  # copies never held before: this call checks them
            state.skip = 0
        if state.skip > 0:
            state.skip -= 1
            self.skips += 1
            return Routed(_unsplit(state, layer), False, False)
        self.checks += 1
        routed = actual_shares(load, layer, model, num_gpus, relevel_s, split)
        state.saved.append(routed.saved_s)
        state.backoff = state.skip = back_off(sum(state.saved) / len(state.saved), state.backoff, self.check_s,
                                              self.max_backoff)
        return routed


def back_off(mean_saved_s: float, backoff: int, check_s: float, max_backoff: int) -> int:
    """Calls to skip after a check (steps 2-3): 0 where the records' mean beats check_s, else the
    last back-off doubled (at least 1, at most max_backoff)."""
    return 0 if mean_saved_s > check_s or max_backoff == 0 else min(max(1, 2 * backoff), max_backoff)


def _unsplit(state: _Layer, layer: LayerPlacement) -> LayerPlacement:
    """Each expert's tokens on its first replica (static EP's split for a homes-first plan)."""
    if state.unsplit is None or state.unsplit[0] is not layer:
        _, first = np.unique(layer.expert, return_index=True)
        share = np.zeros(layer.num_replicas)
        share[first] = 1.0
        state.unsplit = (layer, LayerPlacement(layer.expert, layer.gpu, share))
    return state.unsplit[1]
