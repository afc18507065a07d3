"""Production EPLB (N redundant experts, rebalanced on past loads every period) and full replication."""

from __future__ import annotations

import numpy as np
import pytest

from moeless.placement.cluster import Cluster
from moeless.placement.eplb_production import held_layout, production_eplb, production_replicas, trivial_layout
from moeless.placement.full_replication import plan_full_replication
from moeless.placement.planner import get_planner
from moeless.placement.planner_config import PlannerConfig
from moeless.placement.types import LayerPlacement, Placement, PlacementError


def test_replicas_are_rounded_up_to_a_multiple_of_the_gpus():
    assert production_replicas(64, 8, 8) == 72 and production_replicas(64, 8, 16) == 80
    assert production_replicas(256, 32, 64) == 320 and production_replicas(4, 0, 2) == 4
    with pytest.raises(ValueError, match="redundant"):
        production_replicas(4, -1, 2)


def test_it_rebalances_on_the_loads_since_the_last_rebalance_only_at_its_times():
    """E = 4 on 2 GPUs with 2 copies: expert 0 hot from the start. The first plan (SGLang's trivial
    layout) copies experts 0 and 1 by their index, not their loads; after `first` = 2 calls, EPLB on the summed loads
    gives expert 0 the most replicas; the plan then holds until the next period."""
    plan = production_eplb()
    config = PlannerConfig(eplb_redundant=2, eplb_rebalance_every=3, eplb_first_rebalance=2)
    cluster = Cluster.uniform(2, 8, 1)
    hot = np.array([[30.0, 1, 1, 1]])
    plans = [plan(hot, cluster, None, config) for _ in range(6)]
    counts = [p.layers[0].logcnt(4).tolist() for p in plans]
    assert plans[0] is plans[1]  # no rebalance before `first`
    assert counts[2][0] == 3 and sum(counts[2]) == 6  # both copies to the hot expert
    assert plans[2] is plans[3] is plans[4] and plans[5] is not plans[4]  # then every `period`
    assert all(abs(np.bincount(p.layers[0].expert, weights=p.layers[0].share) - 1).max() < 1e-9 for p in plans)


def test_a_rebalance_releases_the_old_replicas_it_dropped_until_they_are_evicted():
    """N = 0, E = 4 on 2 GPUs, hot experts 0 and 1 both in GPU 0's block: the first rebalance pairs
    them apart, and its plan releases the old replicas it dropped while they are resident (who runs
    the plan evicts them once the new ones serve: Placement.release); once evicted, forgotten."""
    plan = production_eplb()
    config = PlannerConfig(eplb_redundant=0, eplb_rebalance_every=100, eplb_first_rebalance=1)
    cluster, static = Cluster.uniform(2, 8, 1), Placement.static(1, 4, 2)
    hot = np.array([[30.0, 30, 1, 1]])
    assert plan(hot, cluster, static, config).release.shape == (0, 3)
    moved = plan(hot, cluster, static, config)
    dropped = static.replicas() - moved.replicas()
    assert len(dropped) == 2 and {tuple(r) for r in moved.release.tolist()} == dropped
    union = sorted(static.replicas() | moved.replicas())
    both = Placement((LayerPlacement.even(np.array([e for _, e, _ in union]), np.array([g for _, _, g in union]), 4),), 4, 2)
    held = plan(hot, cluster, both, config)
    assert held is plan(hot, cluster, both, config) and {tuple(r) for r in held.release.tolist()} == dropped
    after = plan(hot, cluster, moved, config)  # evicted
    assert after.release.shape == (0, 3) and after.replicas() == moved.replicas()


def test_it_starts_from_sglang_s_trivial_layout_static_ep_s_blocks_with_the_copies_after_them():
    """The docstring's example, and the first plan: with no redundant expert it is static EP."""
    layer = trivial_layout(1, 4, 6, 2).layers[0]
    assert sorted(zip(layer.gpu.tolist(), layer.expert.tolist())) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 3)]
    assert layer.logcnt(4).tolist() == [2, 2, 1, 1]
    first = production_eplb()(np.ones((3, 8)), Cluster.uniform(4, 6, 1), None, PlannerConfig(eplb_redundant=0))
    static = Placement.static(3, 8, 4)
    assert all(a.expert.tolist() == b.expert.tolist() and a.gpu.tolist() == b.gpu.tolist()
               for a, b in zip(first.layers, static.layers))


def test_a_restarted_loop_takes_up_the_rebalanced_layout_resident_on_the_hosts():
    """A loop restarted after a rebalance (E = 4 on 2 GPUs, N = 0: experts 0 and 2 on GPU 0, 1 and 3
    on GPU 1) starts from what the hosts hold, not the trivial layout, and says so. A GPU holding a
    copy more than its slots (3 of the layer's 4: expert 1, left by a rebalance and not yet released)
    drops it; a resident set missing an expert, or whose surplus is an expert's only copy, is not
    taken up. With N = 2 (6 slots, 3 a GPU) a GPU that had two slots of expert 0 holds it once: taken
    up as held."""
    config = PlannerConfig(eplb_redundant=0, eplb_first_rebalance=5)
    cluster, hot = Cluster.uniform(2, 8, 1), np.ones((1, 4))
    held = np.zeros((1, 4, 2), bool)
    held[0, [0, 2], 0] = held[0, [1, 3], 1] = True
    planner = get_planner("eplb-production", config)
    planner.adopt(held)
    layer = planner(hot, cluster).layers[0]
    assert sorted(zip(layer.gpu.tolist(), layer.expert.tolist())) == [(0, 0), (0, 2), (1, 1), (1, 3)]
    assert planner.describe() == ["production EPLB took up the layout resident at its start"]
    lopsided = held.copy()
    lopsided[0, 1, 0] = True  # GPU 0 holds 3: expert 1's copy there goes
    trimmed = get_planner("eplb-production", config)
    trimmed.adopt(lopsided)
    layer = trimmed(hot, cluster).layers[0]
    assert sorted(zip(layer.gpu.tolist(), layer.expert.tolist())) == [(0, 0), (0, 2), (1, 1), (1, 3)]
    assert trimmed.describe() != []
    missing = held.copy()
    missing[0, 3, 1] = False
    crowded = np.zeros((1, 4, 2), bool)
    crowded[0, [0, 1, 2], 0] = crowded[0, 3, 1] = True  # GPU 0 holds 3, each its only copy
    for bad in (missing, crowded):
        other = get_planner("eplb-production", config)
        other.adopt(bad)
        first = other(hot, cluster).layers[0]
        assert sorted(zip(first.gpu.tolist(), first.expert.tolist())) == [(0, 0), (0, 1), (1, 2), (1, 3)]
        assert other.describe() == []
    doubled = held.copy()
    doubled[0, 1, 0] = True  # GPU 0: experts 0 (two slots, one replica), 1 and 2; GPU 1: 1 and 3
    redundant = get_planner("eplb-production", PlannerConfig(eplb_redundant=2, eplb_first_rebalance=5))
    redundant.adopt(doubled)
    layer = redundant(hot, cluster).layers[0]
    assert sorted(zip(layer.gpu.tolist(), layer.expert.tolist())) == [(0, 0), (0, 1), (0, 2), (1, 1), (1, 3)]
    assert layer.logcnt(4).tolist() == [1, 2, 1, 1] and redundant.describe() != []


def test_a_layout_that_does_not_fit_is_refused_by_name():
    plan = production_eplb()
    with pytest.raises(PlacementError, match="lower the redundant experts"):
        plan(np.ones((2, 4)), Cluster.uniform(2, 5, 1), None, PlannerConfig(eplb_redundant=4, eplb_first_rebalance=1))


def test_full_replication_puts_every_expert_on_every_gpu_of_the_layers_that_fit():
    cluster = Cluster.uniform(2, 6, 1)  # 12 slots: layer 0 whole (8), layer 1 static (4)
    placement = plan_full_replication(np.ones((2, 4)), cluster, None, None)
    first, second = placement.layers
    assert sorted(zip(first.expert.tolist(), first.gpu.tolist())) == [(e, g) for e in range(4) for g in range(2)]
    assert first.share[:4].tolist() == [1.0] * 4 and first.share[4:].tolist() == [0.0] * 4  # homes first
    assert second.gpu.tolist() == [0, 0, 1, 1]


def test_a_layer_held_in_two_layouts_is_taken_up_where_one_copy_of_each_expert_fits():
    """Golden (a restart in the middle of a rebalance, E = 5 on 3 GPUs of 2 slots): GPU 1 holds experts
    2, 3 and 4, GPU 2 holds 0, 1 and 2, GPU 0 holds 4. Dropping from GPU 1 the copy held most elsewhere
    (expert 2's) leaves GPU 2 three experts held nowhere else; one copy each fits: 2 on GPU 1, 4 on GPU 0."""
    held = np.zeros((1, 5, 3), bool)
    held[0, [2, 3, 4], 1] = held[0, [0, 1, 2], 2] = held[0, 4, 0] = True
    layer = held_layout(held, 6, 3).layers[0]
    assert sorted(zip(layer.gpu.tolist(), layer.expert.tolist())) == [(0, 4), (1, 2), (1, 3), (2, 0), (2, 1)]
    held[0, 4, 0] = False  # now GPUs 1 and 2 hold five experts in four slots
    assert held_layout(held, 6, 3) is None
