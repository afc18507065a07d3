"""How many expert hosts the pool should have now: a pure function of the policy, what the hosts
hold, whether they are busy, and the clock.

Rules (numbered as in decide_hosts):
1. Idle past scaleToZero.delaySeconds (when enabled): zero hosts, at once (the idle time was the delay).
2. In use: enough hosts that resident replicas fill at most targetMemoryUtilization of the pool,
   never fewer than max(minHosts, 1), never more than maxHosts.
3. From zero (created, or woken by a token or the wake annotation): at once, at least prewarm.hosts,
   since a request may be waiting for the first host.
4. Otherwise a change waits: more hosts after upscaleDelaySeconds of needing them, fewer after
   downscaleDelaySeconds (default keepAliveSeconds: hosts empty out as idle replicas expire).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moeless.controller.operator.spec import GIB, HostPool, Sizing


@dataclass(frozen=True)
class Pending:
    """A scale step waiting for its delay: the size wanted and since when (clock seconds)."""

    hosts: int
    since: float


@dataclass(frozen=True)
class ScaleDecision:
    hosts: int  # the pool's size after this reconcile
    wanted: int  # what the pool needs (differs from hosts while a step waits)
    pending: Pending | None
    reason: str  # Steady, Waiting, Created, Woke, ScaledOut, ScaledIn, ScaledToZero


def needed_hosts(hosts: HostPool, held_bytes: float) -> int:
    """Hosts for held_bytes of resident replicas at the target utilisation, within the pool's bounds."""
    per_host = hosts.memory_gib_per_host * GIB * hosts.target_memory_utilization
    need = math.ceil(held_bytes / per_host) if held_bytes > 0 else 0
    return min(hosts.max_hosts, max(need, hosts.min_hosts, 1))


def decide_hosts(spec: Sizing, current: int | None, held_bytes: float, idle_s: float,
                 pending: Pending | None, now: float) -> ScaleDecision:
    """spec: a policy with its own hosts (spec.PolicySpec) or an ExpertPool (pool_spec.PoolSpec);
    current: the pool's size (None: not created yet); idle_s: seconds since the last token."""
    hosts, scaling = spec.hosts, spec.scaling
    assert hosts is not None, "a policy on an ExpertPool is sized by its pool"
    # 1. Idle long enough: scale to zero.
    if scaling.scale_to_zero and idle_s >= scaling.scale_to_zero_delay_s:
        if current == 0:
            return ScaleDecision(0, 0, None, "Steady")
        return ScaleDecision(0, 0, None, "ScaledToZero" if current is not None else "Created")
    # 2. In use: what the resident replicas need.
    wanted = needed_hosts(hosts, held_bytes)
    # 3. From nothing: now, pre-warmed.
    if not current:
        wanted = min(hosts.max_hosts, max(wanted, scaling.prewarm_hosts))
        return ScaleDecision(wanted, wanted, None, "Created" if current is None else "Woke")
    if wanted == current:
        return ScaleDecision(current, wanted, None, "Steady")
    # 4. A step waits for its delay; a change of direction restarts the wait.
    up = wanted > current
    if pending is None or (pending.hosts > current) != up:
        pending = Pending(wanted, now)
    else:
        pending = Pending(wanted, pending.since)
    delay = scaling.upscale_delay_s if up else spec.scale_in_delay_s
    if now - pending.since >= delay:
        return ScaleDecision(wanted, wanted, None, "ScaledOut" if up else "ScaledIn")
    return ScaleDecision(current, wanted, pending, "Waiting")
