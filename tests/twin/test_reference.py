"""The offline reference and the hindsight homes: their golden examples, and where they sit between the
bounds and static EP."""

from __future__ import annotations

import numpy as np
import pytest

from moeless.placement.home_fits import home_time, packed_homes, swapped_homes
from moeless.placement.latency_model import LatencyModel
from moeless.placement.types import Placement
from moeless.twin.bound import call_bound, lossless_bound
from moeless.twin import reference
from moeless.twin.reference import hindsight_homes, offline_reference

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


def test_hindsight_homes_golden_example(monkeypatch):
    # Static EP's blocks hold both busy experts on one GPU in each iteration (10 + 1 + 10 + 1 = 22);
    # homes fitted on the other fold put them apart (0 with 2 or 3): 11 in every iteration.
    monkeypatch.setattr(reference, "HINDSIGHT_BLOCK", 1)
    loads = np.array([[[10, 10, 0, 0]], [[0, 0, 10, 10]]] * 2)
    assert hindsight_homes(loads, 2, MODEL).tolist() == [[11.0]] * 4
    static = Placement.static(1, 4, 2)
    assert [MODEL.layer_time(w[0], static.layers[0], 2, "serial") for w in loads] == [22.0] * 4


def test_hindsight_homes_score_batches_they_were_not_fitted_on(monkeypatch):
    """Each fold is timed on homes fitted on the other fold alone: changing a fold's own loads never
    changes the homes it is timed on (no peeking at the scored batches)."""
    monkeypatch.setattr(reference, "HINDSIGHT_BLOCK", 2)
    rng = np.random.default_rng(7)
    loads = rng.multinomial(200, rng.dirichlet(np.full(8, 0.3)), size=(8, 2))  # [I, L, E]: folds 0 0 1 1 0 0 1 1
    model = LatencyModel(alpha=1e-6, beta=1e-8, cold_start=1e-3, call_overhead=3e-5)
    fold0 = np.array([0, 1, 4, 5])
    other = loads[[2, 3, 6, 7]].astype(float)
    homes = [swapped_homes(other[:, l], packed_homes(other.sum(axis=0), 4)[l], 4, model) for l in range(2)]
    expected = [[home_time(loads[i, l][None], homes[l], 4, model) for l in range(2)] for i in fold0]
    assert np.allclose(hindsight_homes(loads, 4, model)[fold0], expected)
    skewed = loads.copy()
    skewed[fold0] = rng.multinomial(200, rng.dirichlet(np.full(8, 0.1)), size=(4, 2))
    again = [[home_time(skewed[i, l][None], homes[l], 4, model) for l in range(2)] for i in fold0]
    assert np.allclose(hindsight_homes(skewed, 4, model)[fold0], again)


def test_hindsight_homes_sit_between_the_bound_and_static_ep():
    """One fixed layout per layer, every token at home: never under the lossless bound in any
    iteration, and on skewed loads faster than static EP's blocks over the run."""
    rng = np.random.default_rng(5)
    loads = rng.multinomial(400, rng.dirichlet(np.full(8, 0.3)), size=(40, 3))  # [I, L, E]
    model = LatencyModel(alpha=1e-6, beta=1e-8, cold_start=1e-3, call_overhead=3e-5)
    homes_s = hindsight_homes(loads, 4, model)
    static = Placement.static(3, 8, 4)
    static_s = np.array([[model.layer_time(w[l], static.layers[l], 4, "serial") for l in range(3)] for w in loads])
    assert homes_s.shape == (40, 3)
    assert (homes_s >= lossless_bound(loads, 4, model.alpha, model.call_overhead, model.beta) - 1e-12).all()
    assert homes_s.mean() < static_s.mean()
