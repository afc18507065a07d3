"""The step scaler's rules: how many hosts a step needs, and how long the loop keeps them.

A family engine (serving/family.py) batches every fine-tune of a base together, so a burst of one
fine-tune lengthens every other's steps. The twin (twin/finetunes.py: step_floor, the gated p99)
meets each step SLO only where a scaler widens the placement before such a batch runs, and holds
the batch's newcomers out until it has:

    admission (serving/step_gate.py): price the batch it would form -> hosts_for_step
        need > the hosts the placement spans -> the loop's widen(need): PlacementWidth.need,
        an immediate planning pass over the first `need` ready hosts (the others are spares:
        warm, planned around) -> newcomers held until the published placement spans them
    every pass: PlacementWidth.hosts(now) -> active_slots; back to the floor `hold_s` after the
        last batch that needed more (a scale-down delay: every widening loads the added hosts)

Pure functions and a small state on an injected clock, as Ray Serve's autoscaling policy is.

Example (a step of 3 layers, top-2, alpha 1 ms a token, call_overhead 0.5 ms, 8 experts; 4 tokens):
step_expert_s = 3 x (1e-3 x 4 x 2 + 0.5e-3 x min(8, 8)) = 36 ms of host time; against a 10 ms SLO
hosts_for_step = ceil(3.6) = 4 hosts (at most the ready ones).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from moeless.placement.profile import CostProfile


def step_expert_s(tokens: int, profile: CostProfile, num_layers: int, top_k: int, num_experts: int) -> float:
    """Host-seconds of expert work in one step of `tokens` tokens (prefill and decode alike): per MoE
    layer alpha x tokens x top_k through the experts, plus a call overhead per expert the tokens reach
    (at most all of them) -- the latency model's serial pricing summed over the hosts."""
    routed = max(int(tokens), 0) * top_k
    per_layer = profile.alpha * routed + profile.call_overhead * min(num_experts, routed)
    return num_layers * per_layer


def hosts_for_step(expert_s: float, slo_s: float, ready: int) -> int:
    """The fewest hosts over which `expert_s` host-seconds, spread evenly, take no longer than slo_s:
    ceil(expert_s / slo_s), at least 1 and at most the `ready` hosts (more cannot be had now)."""
    if not slo_s > 0:
        raise ValueError(f"the step SLO must be > 0 seconds, got {slo_s}")
    need = math.ceil(expert_s / slo_s * (1 - 1e-9))  # exactly k x the SLO: k hosts, not k + 1
    return max(1, min(need, max(ready, 1)))


@dataclass
class PlacementWidth:
    """How many of the pool's ready hosts the loop plans over: `floor` always, and the most any batch
    needed within the last `hold_s` (`need`). floor None: every ready host (no step scaler)."""

    floor: int | None = None
    hold_s: float = 2.0
    needs: dict[int, float] = field(default_factory=dict)  # hosts -> when a batch last needed them

    def __post_init__(self):
        if self.floor is not None and self.floor < 1:
            raise ValueError(f"the step scaler's floor must be at least 1 host, got {self.floor}")
        if not self.hold_s >= 0:
            raise ValueError(f"the step scaler's hold must be >= 0 seconds, got {self.hold_s}")

    def need(self, hosts: int, now: float) -> bool:
        """A batch needs `hosts` hosts now; True where that widens the placement (a pass is due)."""
        wider = self.floor is not None and hosts > self.hosts(now)
        self.needs = {h: t for h, t in self.needs.items() if now - t < self.hold_s and h != hosts}
        self.needs[hosts] = now
        return wider

    def hosts(self, now: float) -> int | None:
        """The hosts to plan over now (None: every ready one)."""
        if self.floor is None:
            return None
        return max([self.floor, *(h for h, t in self.needs.items() if now - t < self.hold_s)])

    def active_slots(self, ready: Sequence[bool], now: float) -> list[bool]:
        """[slots] which to plan over: the first hosts(now) ready slots, in slot order (the same
        hosts each time, so a widening reuses the spares' warm replicas); every ready one without a floor."""
        return first_ready(ready, self.hosts(now))


def first_ready(ready: Sequence[bool], hosts: int | None) -> list[bool]:
    """[slots] the first `hosts` ready slots (None: every ready one), in slot order."""
    out, taken = [], 0
    for up in ready:
        out.append(bool(up) and (hosts is None or taken < hosts))
        taken += bool(up)
    return out
