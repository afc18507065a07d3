"""The lossless bound: the least MoE-layer time any plan that keeps every token on its gate's
expert can reach under the serial execution model (docs/design.md, "What a plan costs").

Per layer with loads W [E] (tokens per expert) on G GPUs, costs alpha (s/token of expert
compute), c (s per replica call with tokens) and beta (s/token moved one way):
1. Work: every token is computed once and every expert with tokens is called at least once, so
   the busiest GPU does at least the average: (alpha * sum W + c * #{e: W_e > 0}) / G.
2. The busiest expert: split over at most G GPUs, some GPU holds at least W_max / G of its tokens
   and pays its call: c + alpha * W_max / G (0 when the layer has no token).
3. Transfer: some GPU receives at least sum W / G tokens, moved in and out: 2 beta sum W / G.
bound = max(1, 2) + 3. The serial model (placement/kernels.serial_time) charges the busiest GPU's
work plus 2 beta times the most tokens any GPU receives, each at least its term above, so no
plan beats the bound; re-levels and exposed cold starts only add. The Oracle re-routes tokens
(lossy), so its time may fall below the bound of the real loads.

`call_bound` is tighter and still lossless: a plan that splits expert e over r_e replicas pays r_e
calls (on a GPU, r_e weight reads), and calls are whole, so some GPU makes at least
ceil(sum r_e / G) of them. The busiest GPU takes at least
max((alpha sum W + c sum r_e) / G, c ceil(sum r_e / G), max_e c + alpha W_e / r_e), minimised over
r_e in 1..G (found by bisection on the time T: r_e(T) = ceil(alpha W_e / (T - c)) is the fewest
replicas that keep expert e under T, which also makes the fewest calls, and T is feasible when
those calls and the work they make fit under T), plus the transfer term. Where tokens per expert
are near the knee (c / alpha), splitting costs about what it saves, and in decode, where a layer
is mostly calls, whole calls matter: 13 experts with tokens on 8 GPUs make some GPU call 2 of
them, not 13 / 8. There call_bound sits well above lossless_bound.
"""

from __future__ import annotations

import numpy as np

from moeless.placement.profile import CostProfile


def lossless_bound(loads: np.ndarray, num_gpus: int, alpha: float, call_overhead: float, beta: float) -> np.ndarray:
    """Seconds per layer: loads [..., E] tokens per expert -> [...] (see the module docstring)."""
    if num_gpus <= 0:
        raise ValueError(f"num_gpus must be positive, got {num_gpus}")
    w = np.asarray(loads, dtype=np.float64)
    total = w.sum(axis=-1)
    calls = (w > 0).sum(axis=-1)
    busiest = w.max(axis=-1, initial=0.0)
    spread = (alpha * total + call_overhead * calls) / num_gpus  # 1.
    hottest = np.where(busiest > 0, call_overhead + alpha * busiest / num_gpus, 0.0)  # 2.
    return np.maximum(spread, hottest) + 2.0 * beta * total / num_gpus  # 3.


def profile_bound(loads: np.ndarray, num_gpus: int, profile: CostProfile) -> np.ndarray:
    """lossless_bound with the cost profile's alpha, call_overhead and beta: loads [..., E] -> [...]."""
    return lossless_bound(loads, num_gpus, profile.alpha, profile.call_overhead, profile.beta)


def call_bound(loads: np.ndarray, num_gpus: int, alpha: float, call_overhead: float, beta: float, steps: int = 48) -> np.ndarray:
    """Seconds per layer with every replica's call paid: loads [..., E] -> [...] (see the module
    docstring). Bisection keeps lo below the minimum (lo starts at lossless_bound's work terms), so
    the result is a lower bound within (hi - lo) / 2**steps of the minimum."""
    w = np.asarray(loads, dtype=np.float64)
    c, g = call_overhead, num_gpus
    total, calls, busiest = w.sum(-1), (w > 0).sum(-1), w.max(-1, initial=0.0)
    lo = np.maximum(alpha * total + c * calls, 0.0) / g
    lo = np.where(busiest > 0, np.maximum(lo, c + alpha * busiest / g), 0.0)
    # one replica each: feasible
    hi = np.maximum(c * (busiest > 0) + alpha * busiest, np.maximum(alpha * total + c * calls, c * g * np.ceil(calls / g)) / g)

    def feasible(t: np.ndarray) -> np.ndarray:
        room = np.maximum(t - c, 1e-300)[..., None]
        r = np.where(w > 0, np.clip(np.ceil(alpha * w / room - 1e-12), 1, g), 0)
        fits = np.where(w > 0, c + alpha * w / np.maximum(r, 1) <= t[..., None] * (1 + 1e-12), True).all(-1)
        whole = c * np.ceil(r.sum(-1) / g) <= t * (1 + 1e-12)
        return fits & whole & ((alpha * total + c * r.sum(-1)) / g <= t * (1 + 1e-12))

    for _ in range(steps):
        mid = (lo + hi) / 2
        ok = feasible(mid)
        hi, lo = np.where(ok, mid, hi), np.where(ok, lo, mid)
    return lo + 2.0 * beta * total / g


def profile_call_bound(loads: np.ndarray, num_gpus: int, profile: CostProfile) -> np.ndarray:
    """call_bound with the cost profile's alpha, call_overhead and beta: loads [..., E] -> [...]."""
    return call_bound(loads, num_gpus, profile.alpha, profile.call_overhead, profile.beta)
