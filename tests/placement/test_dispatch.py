"""Dispatch-time pairing (placement/dispatch.py): the golden example, the knee, stable ties, and
never worse than the plan's shares or static EP's split."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeless.placement import dispatch
from moeless.placement.dispatch import pair_counts, pair_tokens, pairing_index
from moeless.placement.latency_model import LatencyModel
from moeless.placement.shares import actual_shares
from moeless.placement.types import LayerPlacement

GOLDEN = LatencyModel(alpha=1.0, beta=0.0, cold_start=0.0, call_overhead=2.0)  # a call costs 2 tokens: the knee


def seconds(layer: LayerPlacement, load: np.ndarray, num_gpus: int, model: LatencyModel) -> float:
    return model.layer_time(load, layer, num_gpus, "serial")


def test_golden_example():
    layer = LayerPlacement(np.array([0, 1, 2, 3, 1]), np.array([0, 0, 1, 1, 1]), np.array([1.0, 1, 1, 1, 0]))
    load = np.array([6, 5, 1, 0])
    counts = pair_counts(load, layer.expert, layer.gpu, layer.share, 2, 1.0, 2.0, 0.0)
    assert counts.tolist() == [6, 0, 1, 0, 5]
    paired = pair_tokens(load, layer, GOLDEN, 2)
    assert seconds(paired, load, 2, GOLDEN) == 10.0 and seconds(layer, load, 2, GOLDEN) == 15.0
    assert paired.share.tolist() == [1.0, 0.0, 1.0, 1.0, 1.0]  # expert 3 (no token) routes to its only replica


def test_an_expert_is_split_only_past_the_knee():
    """Expert 0 (40 tokens) alone on GPU 0 and also on GPU 1, which has 10 tokens of expert 1:
    evening the pair splits it. With the knee above its 40 tokens, it stays whole."""
    layer = LayerPlacement(np.array([0, 1, 0]), np.array([0, 1, 1]), np.array([1.0, 1.0, 0.0]))
    load = np.array([40, 10])
    split = pair_counts(load, layer.expert, layer.gpu, layer.share, 2, 1.0, 2.0, 0.0)
    assert split.tolist() == [26, 10, 14]  # 26 + 2 on GPU 0, 10 + 2 + 14 + 2 on GPU 1
    whole = pair_counts(load, layer.expert, layer.gpu, layer.share, 2, 0.5, 20.5, 0.0)  # knee: 41 tokens
    assert whole.tolist() == [40, 10, 0]


def test_ties_are_stable_and_go_to_the_earlier_replica():
    """Four equal experts, each on both GPUs: the pairing is the same every time, homes first."""
    layer = LayerPlacement(np.array([0, 1, 2, 3, 0, 1, 2, 3]), np.array([0, 0, 1, 1, 1, 1, 0, 0]), np.array([1.0] * 4 + [0.0] * 4))
    load = np.array([5, 5, 5, 5])
    first = pair_counts(load, layer.expert, layer.gpu, layer.share, 2, 1.0, 1.0, 0.0)
    assert first.tolist() == [5, 5, 5, 5, 0, 0, 0, 0]
    for _ in range(3):
        assert pair_counts(load, layer.expert, layer.gpu, layer.share, 2, 1.0, 1.0, 0.0).tolist() == first.tolist()


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_never_worse_than_the_plan_or_static_ep_and_every_token_kept(data):
    num_experts = data.draw(st.integers(2, 12))
    num_gpus = data.draw(st.integers(1, 4))
    load = np.array(data.draw(st.lists(st.integers(0, 60), min_size=num_experts, max_size=num_experts)))
    home = np.arange(num_experts) * num_gpus // num_experts
    extra = data.draw(st.lists(st.tuples(st.integers(0, num_experts - 1), st.integers(0, num_gpus - 1)), max_size=10))
    expert = np.concatenate([np.arange(num_experts), [e for e, _ in extra]]).astype(np.int64)
    gpu = np.concatenate([home, [g for _, g in extra]]).astype(np.int64)
    share = np.array([1.0] * num_experts + [0.0] * len(extra))
    plan = LayerPlacement(expert, gpu, share)
    model = LatencyModel(alpha=1.0, beta=data.draw(st.sampled_from([0.0, 0.1])), cold_start=0.0,
                         call_overhead=data.draw(st.sampled_from([0.0, 1.0, 4.0])))
    paired = pair_tokens(load, plan, model, num_gpus)
    assert seconds(paired, load, num_gpus, model) <= seconds(plan, load, num_gpus, model) + 1e-9
    assert np.bincount(paired.expert, weights=paired.share, minlength=num_experts) == pytest.approx(1.0)
    counts = paired.replica_tokens(load)
    assert np.bincount(paired.expert, weights=counts, minlength=num_experts).tolist() == load.tolist()
    knee = model.call_overhead / model.alpha
    for e in range(num_experts):  # only an expert past the knee is split
        if ((paired.expert == e) & (counts > 0)).sum() > 1:
            assert load[e] > knee


def test_whole_experts_only_when_splits_are_not_exact():
    """split=False (hosts whose kernel is not split-exact): the knee example's 40 tokens move whole
    or not at all, and a plan whose shares split an expert is not a start, so even with its split
    listed the pairing keeps every expert whole."""
    layer = LayerPlacement(np.array([0, 1, 0]), np.array([0, 1, 1]), np.array([0.6, 1.0, 0.4]))
    load = np.array([40, 10])
    assert pair_tokens(load, layer, GOLDEN, 2).replica_tokens(load).tolist() == [26, 10, 14]
    whole = pair_tokens(load, layer, GOLDEN, 2, split=False)
    assert whole.replica_tokens(load).tolist() == [40, 10, 0]  # moving it all would make GPU 1 52 > 42
    for relevel_s in (0.0, np.inf):  # paired (whole) or not (static EP's split): the plan's split is never routed
        assert actual_shares(load, layer, GOLDEN, 2, relevel_s, split=False)[0].replica_tokens(load).tolist() == [40, 10, 0]


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_whole_pairing_never_splits_and_never_loses_to_static_ep(data):
    num_experts, num_gpus = data.draw(st.integers(2, 12)), data.draw(st.integers(1, 4))
    load = np.array(data.draw(st.lists(st.integers(0, 60), min_size=num_experts, max_size=num_experts)))
    home = np.arange(num_experts) * num_gpus // num_experts
    extra = data.draw(st.lists(st.tuples(st.integers(0, num_experts - 1), st.integers(0, num_gpus - 1)), max_size=10))
    expert = np.concatenate([np.arange(num_experts), [e for e, _ in extra]]).astype(np.int64)
    gpu = np.concatenate([home, [g for _, g in extra]]).astype(np.int64)
    plan = LayerPlacement(expert, gpu, np.array([1.0] * num_experts + [0.0] * len(extra)))
    model = LatencyModel(alpha=1.0, beta=0.0, cold_start=0.0, call_overhead=data.draw(st.sampled_from([0.0, 1.0])))
    paired = pair_tokens(load, plan, model, num_gpus, split=False)
    counts = paired.replica_tokens(load)
    assert np.bincount(paired.expert, weights=counts > 0, minlength=num_experts).max() <= 1
    assert np.bincount(paired.expert, weights=counts, minlength=num_experts).tolist() == load.tolist()
    assert seconds(paired, load, num_gpus, model) <= seconds(plan, load, num_gpus, model) + 1e-9


def test_the_index_is_made_once_per_layer_and_a_home_first_pairing_equals_the_uncached_one():
    rng = np.random.default_rng(3)
    expert = np.concatenate([np.arange(8), [0, 3, 5, 5]])
    gpu = np.concatenate([np.arange(8) // 2, [1, 2, 0, 3]])
    home_first = LayerPlacement(expert, gpu, np.array([1.0] * 8 + [0.0] * 4))
    assert pairing_index(home_first, 8, 4)[1] and pairing_index(home_first, 8, 4) is pairing_index(home_first, 8, 4)
    split = LayerPlacement(expert, gpu, np.array([0.5, 1, 1, 0.5, 1, 0.5, 1, 1, 0.5, 0.5, 0.25, 0.25]))
    assert not pairing_index(split, 8, 4)[1]
    before = len(dispatch._INDEX)
    for _ in range(20):  # layers published and dropped: their entries go with them
        pairing_index(LayerPlacement(expert, gpu, home_first.share.copy()), 8, 4)
    gc.collect()
    assert len(dispatch._INDEX) <= before + 1
    for _ in range(50):
        load = rng.integers(0, 80, 8)
        for layer in (home_first, split):
            cached = pair_tokens(load, layer, GOLDEN, 4).replica_tokens(load)
            uncached = pair_counts(load, layer.expert, layer.gpu, layer.share, 4, 1.0, 2.0, 0.0)
            assert cached.tolist() == uncached.tolist()
