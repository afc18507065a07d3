"""Scatter/gather planning and fault evacuation (pure; fake experts are simple functions of x)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from moeless.placement.types import LayerPlacement
from moeless.serving.scatter import (
    MIN_CHUNK, NoLiveHostError, evacuate, gather, host_inputs, merge_small_chunks, plan_scatter,
)


def _fake_expert(e: int, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x * (e + 1)) + e


def _reference(x, idx, weight):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            out[t] += weight[t, j] * _fake_expert(int(idx[t, j]), x[t])
    return out


@st.composite
def layer_cases(draw):
    """A routing idx [T, k] and a random placement (1-3 replicas per expert, uneven shares)."""
    num_experts, k, hosts = draw(st.integers(2, 6)), draw(st.integers(1, 2)), draw(st.integers(1, 4))
    k = min(k, num_experts)
    tokens = draw(st.integers(0, 12))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    idx = torch.tensor(np.stack([rng.choice(num_experts, k, replace=False) for _ in range(tokens)])
                       if tokens else np.zeros((0, k)), dtype=torch.long)
    expert = np.concatenate([np.full(draw(st.integers(1, 3)), e) for e in range(num_experts)])
    gpu = rng.integers(0, hosts, expert.size)
    raw = rng.uniform(0.1, 1.0, expert.size)
    share = raw / np.bincount(expert, weights=raw)[expert]
    return idx, LayerPlacement(expert, gpu, share), hosts


@settings(max_examples=60, deadline=None)
@given(layer_cases())
def test_scatter_then_gather_equals_reference(case):
    idx, placement, _ = case
    x = torch.randn(idx.shape[0], 5, dtype=torch.float64)
    weight = torch.rand(idx.shape, dtype=torch.float64)
    plan = plan_scatter(idx, placement)
    inputs = host_inputs(plan, x)
    outputs = {h: {e: _fake_expert(e, xs) for e, xs in batch.items()} for h, batch in inputs.items()}
    out = gather(plan, outputs, weight, idx.shape[0])
    if idx.shape[0]:
        torch.testing.assert_close(out, _reference(x, idx, weight), rtol=0, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(layer_cases())
def test_every_token_goes_once_to_a_host_holding_its_expert(case):
    idx, placement, _ = case
    plan = plan_scatter(idx, placement)
    for e, tokens in plan.experts.items():
        positions = torch.cat([batch[e] for batch in plan.hosts.values() if e in batch])
        assert sorted(positions.tolist()) == list(range(tokens.rows.numel()))
    for h, batch in plan.hosts.items():
        held = set(placement.expert[placement.gpu == h].tolist())
        assert set(batch) <= held
    assert sum(plan.tokens_per_host().values()) == idx.numel()


def test_tokens_of_one_expert_split_by_share_over_hosts():
    idx = torch.zeros((20, 1), dtype=torch.long)  # all 20 tokens to expert 0
    placement = LayerPlacement(np.array([0, 0, 1]), np.array([0, 1, 1]), np.array([0.3, 0.7, 1.0]))
    plan = plan_scatter(idx, placement)
    assert plan.hosts[0][0].tolist() == list(range(6)) and plan.hosts[1][0].tolist() == list(range(6, 20))


def test_chunks_under_min_rows_join_the_largest_chunk():
    idx = torch.zeros((10, 1), dtype=torch.long)  # 0.3 / 0.7 of 10 tokens would be 3 + 7
    placement = LayerPlacement(np.array([0, 0, 1]), np.array([0, 1, 1]), np.array([0.3, 0.7, 1.0]))
    plan = plan_scatter(idx, placement)
    assert 0 not in plan.hosts and plan.hosts[1][0].tolist() == list(range(10))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 12)), min_size=1, max_size=10))
def test_merge_small_chunks_keeps_sums_and_leaves_no_small_split(pairs):
    expert = np.array([e for e, _ in pairs])
    counts = np.array([c for _, c in pairs])
    merged = merge_small_chunks(expert, counts, MIN_CHUNK)
    for e in np.unique(expert):
        mine = merged[expert == e]
        assert mine.sum() == counts[expert == e].sum()
        live = mine[mine > 0]
        assert live.size <= 1 or (live >= MIN_CHUNK).all()


def test_gate_choice_outside_placement_is_an_error():
    placement = LayerPlacement.even(np.array([0, 1]), np.array([0, 0]), 2)
    with pytest.raises(ValueError, match="only 2 experts"):
        plan_scatter(torch.tensor([[3]]), placement)


def test_evacuate_moves_dead_hosts_replicas_to_least_loaded_live_hosts():
    placement = LayerPlacement.even(np.array([0, 1, 2, 3, 0]), np.array([0, 0, 1, 2, 2]), 4)
    moved = evacuate(placement, {0}, 3)
    assert 0 not in moved.gpu.tolist()
    assert moved.gpu.tolist() == [1, 1, 1, 2, 2]  # host 1 held 1, host 2 held 2; ties to the lower
    np.testing.assert_array_equal(moved.share, placement.share)
    with pytest.raises(NoLiveHostError, match="all 3 expert hosts are down"):
        evacuate(placement, {0, 1, 2}, 3)
