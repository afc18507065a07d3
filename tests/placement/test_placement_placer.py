"""The Expert Placer: the paper's JSQ with warm reuse, moeless's priced placer, round-robin."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeless.placement.diff import diff_layer
from moeless.placement.latency_model import LatencyModel
from moeless.placement.placer import place_jsq_warm, place_round_robin
from moeless.placement.priced_placer import _level_shares, place_priced
from moeless.placement.types import LayerPlacement, Placement, PlacementError

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def layer_inputs(draw):
    """(load [E], logcnt [E], free slots [G], previous LayerPlacement or None)."""
    num_experts = draw(st.integers(1, 12))
    num_gpus = draw(st.integers(1, 6))
    load = np.array(draw(st.lists(st.integers(0, 300), min_size=num_experts, max_size=num_experts)), dtype=np.float64)
    logcnt = np.array(draw(st.lists(st.integers(1, num_gpus), min_size=num_experts, max_size=num_experts)))
    free = np.array(draw(st.lists(st.integers(0, 2 * num_experts), min_size=num_gpus, max_size=num_gpus)))
    free[0] += max(0, num_experts - int(free.sum()))  # room for every expert's first replica
    previous = None
    if draw(st.booleans()):
        prev_load = np.array(draw(st.lists(st.integers(0, 300), min_size=num_experts, max_size=num_experts)), dtype=np.float64)
        previous, _ = place_jsq_warm(prev_load, logcnt, np.full(num_gpus, 2 * num_experts))
    return load, logcnt, free, previous


def check_common(layer: LayerPlacement, load, logcnt, free, free_after, budget=None):
    num_experts, num_gpus = load.size, free.size
    Placement((layer,), num_experts, num_gpus)  # validates: every expert placed, shares sum to 1
    held = np.bincount(layer.gpu, minlength=num_gpus)
    assert (held <= free).all(), "a GPU got more replicas than it has room for"
    assert np.array_equal(free_after, free - held)
    assert len(set(zip(layer.expert.tolist(), layer.gpu.tolist()))) == layer.num_replicas, "two replicas of one expert share a GPU"
    if budget is None:
        assert (layer.logcnt(num_experts) <= logcnt).all()
    else:  # extra replicas within the layer's budget
        assert layer.num_replicas <= max(budget, logcnt.sum())
    # Tokens are conserved, fractional and whole.
    assert np.isclose((load[layer.expert] * layer.share).sum(), load.sum())
    assert layer.gpu_tokens(load.astype(np.int64), num_gpus).sum() == load.sum()


def warm_gpus_left_with_room(previous, layer, free_after, e):
    used = set(layer.gpu[layer.expert == e].tolist())
    return [g for g in previous.gpu[previous.expert == e].tolist() if g not in used and free_after[g] > 0]


@SETTINGS
@given(layer_inputs())
def test_paper_placer_invariants_and_warm_replicas_never_move_while_their_gpu_has_room(inputs):
    load, logcnt, free, previous = inputs
    layer, free_after = place_jsq_warm(load, logcnt, free, previous)
    check_common(layer, load, logcnt, free, free_after)
    assert np.allclose(layer.share, 1.0 / layer.logcnt(load.size)[layer.expert])
    if previous is not None:
        for e, _ in diff_layer(previous, layer).cold_loads.tolist():
            assert not warm_gpus_left_with_room(previous, layer, free_after, e), f"expert {e} left a warm GPU with room"


@SETTINGS
@given(layer_inputs(), st.sampled_from([0.0, 1e-5, 1e-3]), st.integers(0, 8))
def test_priced_placer_invariants_and_warm_replicas_move_only_when_it_pays(inputs, cold_start, extra):
    load, logcnt, free, previous = inputs
    model = LatencyModel(alpha=1e-7, beta=1e-9, cold_start=cold_start, call_overhead=1e-6)
    budget = int(logcnt.sum()) + extra
    layer, free_after, moves = place_priced(load, logcnt, free, previous, model, horizon=2.0, budget=budget)
    check_common(layer, load, logcnt, free, free_after, budget)
    for move in moves:
        assert move.penalty_s * 2.0 > cold_start, "moved a warm replica although staying was cheaper"
    if previous is not None:
        for e, g in diff_layer(previous, layer).cold_loads.tolist():
            if warm_gpus_left_with_room(previous, layer, free_after, e):
                assert any(m.expert == e and m.cold_gpu == g for m in moves), f"expert {e} left a warm GPU unpriced"


def test_paper_placer_reuses_a_warm_gpu_however_loaded():
    previous = LayerPlacement.even(np.array([0, 1]), np.array([0, 0]), 2)  # both experts warm on GPU 0
    layer, _ = place_jsq_warm(np.array([100.0, 100.0]), np.array([1, 1]), np.array([4, 4]), previous)
    assert layer.gpu.tolist() == [0, 0]


def test_priced_placer_moves_when_the_imbalance_outweighs_the_cold_start_and_stays_otherwise():
    previous = LayerPlacement.even(np.array([0, 1]), np.array([0, 0]), 2)
    load, cnt, free = np.array([1000.0, 1000.0]), np.array([1, 1]), np.array([4, 4])
    cheap = LatencyModel(alpha=1e-6, beta=0.0, cold_start=1e-4)  # staying adds 1000 tokens = 1 ms > 0.1 ms
    layer, _, moves = place_priced(load, cnt, free, previous, cheap)
    assert sorted(layer.gpu.tolist()) == [0, 1] and len(moves) == 1 and moves[0].penalty_s == pytest.approx(1e-3)
    dear = LatencyModel(alpha=1e-6, beta=0.0, cold_start=1e-2)  # 1 ms < 10 ms cold start: stay warm
    layer, _, moves = place_priced(load, cnt, free, previous, dear)
    assert layer.gpu.tolist() == [0, 0] and moves == []
    assert place_priced(load, cnt, free, previous, dear, horizon=100.0)[2], "a long horizon makes the move pay"


def test_priced_placer_levels_gpus_with_uneven_splits():
    model = LatencyModel(alpha=1e-6, beta=0.0, cold_start=0.0)
    load = np.array([600.0, 300.0, 100.0])
    layer, _, _ = place_priced(load, np.array([2, 1, 1]), np.array([3, 3, 3]), None, model)
    assert sorted(layer.gpu_tokens(load.astype(np.int64), 3).tolist()) == [300, 350, 350]
    even, _ = place_jsq_warm(load, np.array([2, 1, 1]), np.array([3, 3, 3]))  # the paper's even split
    assert even.gpu_tokens(load.astype(np.int64), 3).max() == 400


def test_spare_budget_relieves_the_busiest_gpu_only_when_it_pays():
    load = np.array([900.0, 100.0, 100.0])  # 1100 tokens on 3 GPUs: 367 each at best
    cheap = LatencyModel(alpha=1e-6, beta=0.0, cold_start=1e-5)
    alone, _, _ = place_priced(load, np.ones(3, int), np.array([3, 3, 3]), None, cheap, budget=3)
    assert alone.gpu_tokens(load.astype(np.int64), 3).max() == 900
    relieved, _, _ = place_priced(load, np.ones(3, int), np.array([3, 3, 3]), None, cheap, budget=5)
    assert relieved.num_replicas == 5 and relieved.gpu_tokens(load.astype(np.int64), 3).max() <= 367
    dear = LatencyModel(alpha=1e-6, beta=0.0, cold_start=1.0)  # a cold start dwarfs the 0.5 ms saved
    kept, _, _ = place_priced(load, np.ones(3, int), np.array([3, 3, 3]), None, dear, budget=5)
    assert kept.num_replicas == 3


def test_gpus_already_loaded_get_less():
    model = LatencyModel(alpha=1e-6, beta=0.0, cold_start=0.0)
    busy = np.array([0.0, 500.0])
    paper, _ = place_jsq_warm(np.array([100.0, 50.0]), np.array([1, 1]), np.array([2, 2]), gpu_load=busy)
    assert paper.gpu.tolist() == [0, 0]
    ours, _, _ = place_priced(np.array([100.0, 50.0]), np.array([1, 1]), np.array([2, 2]), None, model, gpu_load=busy)
    assert ours.gpu.tolist() == [0, 0]
    with pytest.raises(ValueError, match="gpu_load"):
        place_jsq_warm(np.ones(2), np.ones(2, int), np.array([2, 2]), gpu_load=np.zeros(3))


def test_level_shares_fill_the_lowest_first():
    assert _level_shares(10.0, [0.0, 4.0]) == pytest.approx([0.7, 0.3])
    assert _level_shares(2.0, [0.0, 5.0]) == pytest.approx([1.0, 0.0])
    assert _level_shares(6.0, [1.0, 1.0, 1.0]) == pytest.approx([1 / 3] * 3)


def test_round_robin_is_static_blocks_plus_following_gpus():
    layer, _ = place_round_robin(np.ones(4), np.array([2, 1, 1, 1]), np.array([4, 4]))
    assert list(zip(layer.expert.tolist(), layer.gpu.tolist())) == [(0, 0), (0, 1), (1, 0), (2, 1), (3, 1)]


def test_extra_replicas_never_take_the_last_slots_first_replicas_need():
    load = np.array([1000.0, 0.0, 0.0])
    layer, free = place_jsq_warm(load, np.array([3, 1, 1]), np.array([1, 1, 1]))
    assert layer.logcnt(3).tolist() == [1, 1, 1] and free.sum() == 0


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: place_jsq_warm(np.array([-1.0]), np.array([1]), np.array([1])), ValueError, "non-negative"),
        (lambda: place_jsq_warm(np.array([1.0]), np.array([0]), np.array([1])), ValueError, "at least one replica"),
        (lambda: place_jsq_warm(np.array([1.0]), np.array([1]), np.array([], dtype=int)), ValueError, "zero GPUs"),
        (lambda: place_jsq_warm(np.ones(3), np.ones(3, int), np.array([1, 1])), PlacementError, "free replica slots"),
    ],
)
def test_invalid_inputs_raise_clear_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()
