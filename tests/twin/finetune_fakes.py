"""Fine-tunes of a small base for the twin's fine-tune tests: pure data, no I/O."""

from __future__ import annotations

import numpy as np

from moeless.twin.finetunes import FineTune, make_finetune
from moeless.twin.shared_pool import PoolModel, PoolSettings, Requests

GB = 10**9


def base_model(layers: int = 4, experts: int = 8, gpus: int = 2, top_k: int = 2, seed: int = 0) -> PoolModel:
    popularity = np.random.default_rng(seed).dirichlet(np.ones(experts), size=layers)
    return PoolModel("base", top_k, GB // 4, GB, gpus, 0.01, 0.1, 1e-5, 1e-4, popularity)


def poisson_requests(rate_per_s: float, horizon: float, seed: int) -> Requests:
    rng = np.random.default_rng(seed)
    arrival = np.sort(rng.uniform(0, horizon, rng.poisson(rate_per_s * horizon)))
    return Requests(arrival, rng.integers(20, 400, len(arrival)).astype(float), rng.integers(5, 200, len(arrival)).astype(float))


def finetunes_of(base: PoolModel, count: int, share: float) -> list[FineTune]:
    return [make_finetune(base, f"ft{i}", base.popularity, share, np.random.default_rng([0, i])) for i in range(count)]


SETTINGS = PoolSettings(horizon_s=900, window_s=1, step_s=0.05, idle_delay_s=40, keep_alive_s=20, gpu_bytes=5 * GB, seed=2)
