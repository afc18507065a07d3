"""Replica sets chosen for dispatch room per GB (placement/replica_sets.py)."""

from __future__ import annotations

import numpy as np
import pytest

from moeless.placement.latency_model import LatencyModel
from moeless.placement.replica_sets import choose_replicas, mean_paired_seconds
from moeless.placement.resident_planner import ReplicaCost
from moeless.placement.types import LayerPlacement, PlacementError

ONE = LatencyModel(alpha=1.0, beta=0.0, cold_start=1.0, call_overhead=1.0)


def test_golden_example():
    samples = np.array([[8, 1, 1, 1], [1, 1, 8, 1]])
    layer, left, decision = choose_replicas(samples, np.array([4, 4]), None, ReplicaCost(ONE, prefetch_layers=0, horizon=1))
    assert layer.expert.tolist() == [0, 1, 2, 3, 0, 2] and layer.gpu.tolist() == [0, 0, 1, 1, 1, 0]
    assert layer.share.tolist() == [1, 1, 1, 1, 0, 0] and left.tolist() == [1, 1]
    assert decision.base_s == 11.0 and decision.final_s == 8.0
    assert [(e, g) for e, g, _, _ in decision.added] == [(0, 1), (2, 0)]


def test_a_copy_that_does_not_pay_its_price_is_not_added():
    samples = np.array([[8, 1, 1, 1], [1, 1, 8, 1]])
    cost = ReplicaCost(ONE, prefetch_layers=0, expert_bytes=10**9, gb_s_price=10.0, horizon=1, iteration_s=1.0)
    layer, _, decision = choose_replicas(samples, np.array([4, 4]), None, cost)
    assert layer.num_replicas == 4 and not decision.added and decision.final_s == decision.base_s


def test_resident_copies_are_kept_free_and_the_budget_and_slots_hold():
    samples = np.array([[8, 1, 1, 1], [1, 1, 8, 1]])
    resident = LayerPlacement(np.array([0, 1, 2, 3, 0]), np.array([0, 0, 1, 1, 1]), np.array([1.0, 1, 1, 1, 0]))
    cost = ReplicaCost(ONE, prefetch_layers=0, horizon=1)
    layer, left, decision = choose_replicas(samples, np.array([4, 4]), resident, cost, budget=5)
    assert layer.num_replicas == 5 and (0, 1) in set(zip(layer.expert.tolist(), layer.gpu.tolist()))
    assert decision.base_s == 9.5 and not decision.added  # the warm copy is in the base; the budget is spent
    layer, left, _ = choose_replicas(samples, np.array([2, 3]), None, cost)  # GPU 0 full: a copy only on GPU 1
    assert left.min() >= 0 and np.bincount(layer.gpu, minlength=2).tolist()[0] == 2
    with pytest.raises(PlacementError, match="cannot hold 4 experts"):
        choose_replicas(samples, np.array([4, 4]), None, cost, budget=3)


def test_the_mean_paired_time_is_the_pairing_of_each_sample():
    samples = np.array([[8, 1, 1, 1], [1, 1, 8, 1]])
    homes = mean_paired_seconds(samples, np.arange(4), np.array([0, 0, 1, 1]), np.ones(4), 2, ONE)
    both = mean_paired_seconds(samples, np.array([0, 1, 2, 3, 0, 2]), np.array([0, 0, 1, 1, 1, 0]),
                               np.array([1.0, 1, 1, 1, 0, 0]), 2, ONE)
    assert homes == 11.0 and both == 8.0
