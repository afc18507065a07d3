"""The offline reference: its golden example, and it sits between the call bound and static EP."""

from __future__ import annotations

import numpy as np
import pytest

from moeless.placement.latency_model import LatencyModel
from moeless.placement.types import Placement
from moeless.twin.bound import call_bound
from moeless.twin.reference import offline_reference

MODEL = LatencyModel(alpha=1.0, beta=0.0, cold_start=1.0, call_overhead=1.0)


def test_golden_example():
    # Static EP: experts 0, 1 on GPU 0 (18), 2, 3 on GPU 1. EPLB pairs 0 with 3 (13) and 1 with 2 (9).
    assert offline_reference(np.array([[[10, 6, 1, 1]]]), 2, MODEL, [4]).tolist() == [[13.0]]
    # Loads static EP already balances: the reference is static EP's time, never more.
    assert offline_reference(np.array([[[5, 1, 5, 1]]]), 2, MODEL, [4]).tolist() == [[8.0]]
    with pytest.raises(ValueError, match="multiple of the 2 GPUs"):
        offline_reference(np.ones((1, 1, 4), dtype=np.int64), 2, MODEL, [5])


def test_between_the_call_bound_and_static_ep():
    rng = np.random.default_rng(3)
    loads = rng.multinomial(400, rng.dirichlet(np.full(8, 0.3)), size=(5, 3))  # [I, L, E]
    model = LatencyModel(alpha=1e-6, beta=1e-8, cold_start=1e-3, call_overhead=3e-5)
    ref = offline_reference(loads, 4, model, [8, 12])
    static = Placement.static(3, 8, 4)
    static_s = np.array([[model.layer_time(w[l], static.layers[l], 4, "serial") for l in range(3)] for w in loads])
    assert (ref <= static_s + 1e-15).all() and (ref < static_s).any()
    assert (ref >= call_bound(loads, 4, model.alpha, model.call_overhead, model.beta) - 1e-12).all()
