"""Repeated calls timed: p50 and p90 of the wall time after a warm-up (the benches' and the GPU
checks' one way to time a call)."""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np


def timed_calls(call: Callable[[], Any], repeats: int) -> dict[str, float]:
    """p50 and p90 seconds of `repeats` calls after a warm-up, and p50 of what call() returns as
    the host's compute (a RoutedResult's compute_s; 0 for anything else)."""
    for _ in range(max(3, repeats // 10)):
        call()
    wall, compute = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        result = call()
        wall.append(time.perf_counter() - start)
        compute.append(getattr(result, "compute_s", 0.0))
    return {"p50": float(np.percentile(wall, 50)), "p90": float(np.percentile(wall, 90)),
            "compute_p50": float(np.percentile(compute, 50))}
