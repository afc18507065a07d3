"""The Expert Scaler: how many replicas each expert of one layer gets (the paper's Algorithm 1).

One greedy loop serves every policy: start from the minimum counts, repeatedly give one more
replica to the expert whose per-replica load is largest (a max-heap), split its load evenly,
and stop when the replica budget (the layer's memory cap) is spent or a stopping rule holds.
The rules differ in what they measure:

- `cv_below(V)`: the paper's rule, CV of all per-replica loads <= V. In decode about half the
  experts get no token; their zero loads keep that CV high, so the budget, not balance, stops it.
- `active_cv_below(V)`: the same CV over replicas of experts that receive tokens.
- `straggler_within(G, slack, c)`: what sets a layer's time on G GPUs: the largest replica's work
  is at most (1 + slack) x the least work the busiest GPU could have (total / G, counting a
  per-call cost of c tokens when replicas on one GPU run one after another). moeless-greedy's rule.

Wrappers compose on top (as in Ray Serve's autoscaling policy): `with_dead_band` keeps the
previous counts while a looser rule still holds, so plans do not flap between iterations.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class ReplicaStats:
    """Summary of per-replica loads of one layer, enough for every stopping rule.

    replicas: all replicas; idle: replicas of experts with zero load; total: sum of loads;
    sumsq: sum over replicas of (per-replica load)^2; top: the largest per-replica load.
    """

    replicas: int
    idle: int
    total: float
    sumsq: float
    top: float

    @staticmethod
    def of(load: np.ndarray, logcnt: np.ndarray) -> "ReplicaStats":
        """load: [E], logcnt: [E] (all >= 1)."""
        per = load / logcnt
        return ReplicaStats(
            replicas=int(logcnt.sum()),
            idle=int(logcnt[load == 0].sum()),
            total=float(load.sum()),
            sumsq=float((load * per).sum()),
            top=float(per.max(initial=0.0)),
        )


StopRule = Callable[[ReplicaStats], bool]


def _cv(count: int, total: float, sumsq: float) -> float:
    if count <= 0 or total <= 0:
        return 0.0
    mean = total / count
    # The greedy loop keeps sumsq incrementally: a variance within rounding of 0 is 0 (its square
    # root would read as a CV of ~1e-8, above a threshold of 0).
    var = sumsq / count - mean * mean
    return 0.0 if var <= 1e-12 * mean * mean else float(np.sqrt(var) / mean)


def replica_cv(load: np.ndarray, logcnt: np.ndarray, active_only: bool = False) -> float:
    """CV (std / mean) of per-replica loads, each expert's load split evenly. load, logcnt: [E]."""
    s = ReplicaStats.of(np.asarray(load, dtype=np.float64), np.asarray(logcnt))
    return _cv(s.replicas - (s.idle if active_only else 0), s.total, s.sumsq)


def cv_below(threshold: float) -> StopRule:
    """The paper's rule: CV of all per-replica loads <= threshold."""
    return lambda s: _cv(s.replicas, s.total, s.sumsq) <= threshold


def active_cv_below(threshold: float) -> StopRule:
    """CV over replicas of experts that receive tokens <= threshold."""
    return lambda s: _cv(s.replicas - s.idle, s.total, s.sumsq) <= threshold


def straggler_within(num_gpus: int, slack: float = 0.0, call_tokens: float = 0.0) -> StopRule:
    """The largest replica's work is within (1 + slack) of what any GPU must do with one more replica.

    Work is in tokens; a call with tokens costs `call_tokens` more (the latency model's call
    overhead / alpha). With n active replicas, one more raises the busiest GPU's least possible
    work to max((total + c (n + 1)) / G, c ceil((n + 1) / G)); splitting further cannot beat that.
    """
    if num_gpus <= 0:
        raise ValueError(f"straggler_within needs at least one GPU, got {num_gpus}")

    def holds(s: ReplicaStats) -> bool:
        active = s.replicas - s.idle + 1
        bound = max((s.total + call_tokens * active) / num_gpus, call_tokens * -(-active // num_gpus))
        return s.top + call_tokens <= (1.0 + slack) * bound

    return holds


def greedy_scale(
    load: np.ndarray,
    budget: int | None,
    stop: StopRule,
    min_replicas: int = 1,
    max_replicas: int | None = None,
) -> np.ndarray:
    """Replica counts for one layer. load: [E] tokens (>= 0) -> logcnt: [E] int.

    budget: most replicas the layer may hold (M_cap / M_e), None for no cap; max_replicas: most
    per expert (None for no limit; a planner passes the GPU count, as two replicas of one expert
    on one GPU gain nothing).
    """
    load = _check_load(load)
    num_experts = load.shape[0]
    if min_replicas < 1 or (max_replicas is not None and max_replicas < min_replicas):
        raise ValueError(f"need 1 <= min_replicas <= max_replicas, got {min_replicas}, {max_replicas}")
    if budget is not None and budget < num_experts * min_replicas:
        raise ValueError(
            f"a budget of {budget} replicas cannot give {num_experts} experts {min_replicas} replica(s) each; "
            f"raise the layer memory cap"
        )
    # 1. Every expert starts at the minimum; the stats of per-replica loads are kept incrementally
    #    (in plain Python: for one layer's few experts that beats numpy's per-call cost).
    loads = load.tolist()
    counts = [min_replicas] * num_experts
    replicas = num_experts * min_replicas
    idle = loads.count(0.0) * min_replicas
    total = sum(loads)
    sumsq = sum(w * w for w in loads) / min_replicas
    limit = max_replicas if max_replicas is not None else float("inf")
    # 2. Max-heap of per-replica loads (negated for heapq); experts at their limit leave it.
    heap = [(-w / min_replicas, e) for e, w in enumerate(loads) if w > 0 and min_replicas < limit]
    heapq.heapify(heap)
    while heap and (budget is None or replicas < budget):
        top = -heap[0][0]
        if stop(ReplicaStats(replicas, idle, total, sumsq, top)):
            break
        # 3. Add one replica to the straggler expert and split its load evenly.
        _, e = heapq.heappop(heap)
        w, r = loads[e], counts[e]
        sumsq += w * w / (r + 1) - w * w / r
        counts[e] = r + 1
        replicas += 1
        if r + 1 < limit:
            heapq.heappush(heap, (-w / (r + 1), e))
    return np.array(counts, dtype=np.int64)


def with_dead_band(
    scale: Callable[[np.ndarray], np.ndarray], relaxed: StopRule, budget: int | None = None
) -> Callable[[np.ndarray, np.ndarray | None], np.ndarray]:
    """Keep the previous counts while they still satisfy `relaxed` (a looser rule) within the
    budget; otherwise re-scale. scale: load [E] -> logcnt [E]; returns (load, previous) -> logcnt."""

    def scaled(load: np.ndarray, previous: np.ndarray | None) -> np.ndarray:
        load = _check_load(load)
        if previous is not None:
            previous = np.asarray(previous, dtype=np.int64)
            fits = budget is None or int(previous.sum()) <= budget
            if previous.shape == load.shape and (previous >= 1).all() and fits:
                if relaxed(ReplicaStats.of(load, previous)):
                    return previous.copy()
        return scale(load)

    return scaled


def _check_load(load: np.ndarray) -> np.ndarray:
    load = np.asarray(load, dtype=np.float64)
    if load.ndim != 1 or load.size == 0:
        raise ValueError(f"a layer's load must be a non-empty [E] vector, got shape {load.shape}")
    if not np.isfinite(load).all() or (load < 0).any():
        raise ValueError("loads must be finite, non-negative token counts; check the forecast")
    return load
