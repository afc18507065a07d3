"""The lossless bound: a golden example by hand, and no planner beats it in any iteration."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from moeless.placement.planner import PLANNERS, STATEFUL_PLANNERS, PlannerConfig, get_planner
from moeless.placement.cluster import Cluster
from moeless.twin.bound import call_bound, lossless_bound, profile_bound, profile_call_bound
from moeless.twin.iterations import Iteration
from moeless.placement.profile import CostProfile
from moeless.twin.twin import TwinSettings, replay


def test_golden_example():
    # E = 4 experts on G = 2 GPUs; alpha 1, call 10, beta 0.5.
    # Work spread: (1 * 40 + 10 * 3) / 2 = 35; hottest: 10 + 30 / 2 = 25; transfer 2 * 0.5 * 40 / 2 = 20.
    assert lossless_bound(np.array([30, 6, 4, 0]), 2, 1.0, 10.0, 0.5) == 35 + 20
    # Work (64 + 10 * 2) / 2 = 42 beats the hottest expert, 10 + 60 / 2 = 40.
    assert lossless_bound(np.array([60, 4, 0, 0]), 2, 1.0, 10.0, 0.0) == 42
    assert lossless_bound(np.array([60, 0, 0, 0]), 2, 1.0, 30.0, 0.0) == 60  # hottest: 30 + 60 / 2 > (60 + 30) / 2
    assert lossless_bound(np.zeros(4), 2, 1.0, 10.0, 0.5) == 0
    # Every replica pays its call: one replica each, GPU 0 holds expert 0 (10 + 30 = 40); splitting it
    # (two calls) makes the spread work (40 + 4 * 10) / 2 = 40 too: 40, where lossless_bound says 35.
    assert call_bound(np.array([30, 6, 4, 0]), 2, 1.0, 10.0, 0.0) == pytest.approx(40)
    assert call_bound(np.array([300, 6, 4, 0]), 2, 1.0, 10.0, 0.0) == pytest.approx((310 + 40) / 2)  # split: 10 + 150 < 175
    # Whole calls: 3 experts with a token each on 2 GPUs (call 10): some GPU makes 2 calls, at least
    # 20, where the spread work says (3 + 30) / 2 = 16.5.
    assert lossless_bound(np.array([1, 1, 1, 0]), 2, 1.0, 10.0, 0.0) == 16.5
    assert call_bound(np.array([1, 1, 1, 0]), 2, 1.0, 10.0, 0.0) == pytest.approx(20, abs=1e-9)
    # Shapes: [I, L, E] -> [I, L].
    assert lossless_bound(np.ones((3, 2, 4)), 2, 1.0, 0.0, 0.0).shape == (3, 2)


PROFILE = CostProfile(alpha=1e-5, beta=2e-6, call_overhead=3e-4, load_s={"disk": 1e-2, "host": 1e-3},
                      expert_bytes=10**8, non_expert_bytes=10**9, relevel_s=1e-5, source="a test")
L, E, G = 2, 6, 3
LOSSLESS = sorted(p for p in [*PLANNERS, *STATEFUL_PLANNERS] if p != "oracle")  # the Oracle re-routes tokens


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(st.integers(0, 400), min_size=L * E, max_size=L * E), min_size=2, max_size=4), st.integers(0, 2**16))
def test_no_planner_beats_the_bound(rows, seed):
    loads = np.array(rows, dtype=np.int64).reshape(-1, L, E)
    loads[:, :, seed % E] *= 3  # a hot expert, so that replication pays somewhere
    its = [Iteration("prefill", w, 1, (), 0.05 * i) for i, w in enumerate(loads)]
    cluster = Cluster.uniform(G, 2 * L * E // G + L, PROFILE.expert_bytes, 2 * E)
    bound = profile_bound(loads, G, PROFILE)
    tight = profile_call_bound(loads, G, PROFILE)
    assert (tight >= bound - 1e-15).all()
    config = PlannerConfig(model=PROFILE.latency_model(), gb_s_price=0.0)
    for name in LOSSLESS:
        rec = replay(get_planner(name, config), its, loads.astype(np.float64), cluster, PROFILE, TwinSettings(distance=0))
        assert (rec.serial_s >= tight - 1e-12).all(), (name, rec.serial_s, tight)
