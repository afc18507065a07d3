"""moeless's fill planner for one layer: golden example, invariants, warm pricing, errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeless.placement.diff import diff_layer
from moeless.placement.fill_placer import place_fill
from moeless.placement.kernels import fill, reshare
from moeless.placement.latency_model import LatencyModel
from moeless.placement.types import LayerPlacement, Placement, PlacementError

CALL_1 = LatencyModel(alpha=1e-6, beta=0.0, cold_start=1e-3, call_overhead=1e-6)  # a call costs one token


def gpu_work(layer, load, num_gpus, call):
    """Tokens + call tokens per GPU, whole tokens as the serial model counts them: [G]."""
    tokens = layer.replica_tokens(load.astype(np.int64))
    return np.bincount(layer.gpu, weights=tokens + call * (tokens > 0), minlength=num_gpus)


def test_golden_tiny_example():
    layer, left, decision = place_fill(np.array([10.0, 6, 2, 0]), np.array([4, 4]), None, CALL_1)
    assert decision.level == 11.0 and not decision.stayed
    assert layer.expert.tolist() == [0, 1, 2, 3]
    assert layer.gpu.tolist() == [1, 0, 0, 1]
    assert layer.share.tolist() == [1.0, 1.0, 1.0, 1.0]
    assert left.tolist() == [2, 2]


def test_a_heavy_expert_is_cut_into_replicas_that_level_the_gpus():
    load = np.array([100.0, 4, 0, 0])
    layer, _, decision = place_fill(load, np.full(4, 4), None, CALL_1)
    # (104 tokens + 4 calls) / 4 GPUs = 27 is the bound; one more call for the cut the 4s share
    assert layer.logcnt(4)[0] == 4 and decision.level <= 27 + 1 + 0.5
    assert gpu_work(layer, load, 4, 1.0).max() <= decision.level
    unsplit, _, _ = place_fill(load, np.full(4, 4), None, CALL_1, split=False)
    assert (unsplit.logcnt(4) == 1).all() and gpu_work(unsplit, load, 4, 1.0).max() == 101


def test_decode_sized_loads_split_only_while_it_shortens_the_busiest_gpu():
    # 3 tokens, a call costs 8: 3 one-token replicas on idle GPUs finish at 9 instead of 11
    model = LatencyModel(alpha=1e-6, beta=0.0, cold_start=1e-3, call_overhead=8e-6)
    layer, _, _ = place_fill(np.array([3.0, 0, 0, 0]), np.full(4, 2), None, model)
    assert layer.logcnt(4)[0] == 3 and gpu_work(layer, np.array([3, 0, 0, 0]), 4, 8.0).max() == 9


@st.composite
def layer_inputs(draw):
    num_experts = draw(st.integers(1, 12))
    num_gpus = draw(st.integers(1, 6))
    ints = st.lists(st.integers(0, 300), min_size=num_experts, max_size=num_experts)
    load = np.array(draw(ints), dtype=np.float64)
    free = np.array(draw(st.lists(st.integers(0, 2 * num_experts), min_size=num_gpus, max_size=num_gpus)))
    free[0] += max(0, num_experts - int(free.sum()))  # room for every expert's first replica
    previous = None
    if draw(st.booleans()):
        previous, _, _ = place_fill(np.array(draw(ints), dtype=np.float64), np.full(num_gpus, 2 * num_experts), None, CALL_1)
    budget = draw(st.one_of(st.none(), st.integers(num_experts, 3 * num_experts)))
    return load, free, previous, budget


@settings(max_examples=80, deadline=None)
@given(layer_inputs(), st.sampled_from([0.0, 1e-5, 1e-3, 1.0]), st.sampled_from([1.0, 1000.0]))
def test_invariants_and_a_warm_replica_moves_only_when_the_plan_pays_for_its_cold_starts(inputs, cold_start, horizon):
    load, free, previous, budget = inputs
    num_experts, num_gpus = load.size, free.size
    model = LatencyModel(alpha=1e-6, beta=1e-7, cold_start=cold_start, call_overhead=3e-6)
    try:
        layer, left, decision = place_fill(load, free, previous, model, horizon, budget)
    except PlacementError as err:  # only when slots or the budget cannot hold the pieces
        assert "slots" in str(err)
        return
    Placement((layer,), num_experts, num_gpus)  # validates: every expert placed, shares sum to 1
    held = np.bincount(layer.gpu, minlength=num_gpus)
    assert (held <= free).all() and np.array_equal(left, free - held)
    assert budget is None or layer.num_replicas <= max(budget, num_experts)
    assert len(set(zip(layer.expert.tolist(), layer.gpu.tolist()))) == layer.num_replicas, "two replicas of one expert share a GPU"
    assert np.isclose((load[layer.expert] * layer.share).sum(), load.sum())
    assert layer.gpu_tokens(load.astype(np.int64), num_gpus).sum() == load.sum()
    if previous is None:
        return
    cold = diff_layer(previous, layer).cold_loads_per_gpu(num_gpus).max(initial=0)
    if decision.stayed:  # the resident replicas, re-shared: no cold start at all
        assert cold == 0 and decision.saved_s * horizon <= decision.cold_s
        assert np.array_equal(layer.expert, previous.expert) and np.array_equal(layer.gpu, previous.gpu)
    elif cold > 0:  # moved: the model says it pays, unless the resident replicas no longer fit
        resident = np.bincount(previous.gpu, minlength=num_gpus)
        could_stay = (resident <= free).all() and previous.num_replicas <= min(budget or free.sum(), free.sum())
        if could_stay:
            kept = LayerPlacement(previous.expert, previous.gpu, reshare(load, previous.expert, previous.gpu, 3.0, num_gpus))
            saved = model.layer_time(load, kept, num_gpus, "serial") - model.layer_time(load, layer, num_gpus, "serial")
            assert decision.saved_s == pytest.approx(saved) and decision.cold_s == pytest.approx(cold_start * cold)
            assert saved * horizon > cold_start * cold


def test_the_same_load_again_changes_nothing():
    rng = np.random.default_rng(0)
    load = rng.multinomial(500, rng.dirichlet(np.full(16, 0.3))).astype(np.float64)
    first, _, _ = place_fill(load, np.full(4, 16), None, CALL_1)
    second, _, _ = place_fill(load, np.full(4, 16), first, CALL_1)
    assert diff_layer(first, second).churn == 0


def test_the_resident_replicas_stay_unless_the_gain_over_the_horizon_pays_the_cold_starts():
    free = np.full(2, 4)
    before, _, _ = place_fill(np.array([10.0, 10, 10, 10]), free, None, CALL_1)  # experts 0, 1 | 2, 3
    # Re-shared, the resident replicas take 36 us (30 + 4 + 2 calls). Cutting expert 0 reaches 23 us
    # for 2 cold starts on one GPU (2 ms).
    shifted = np.array([30.0, 4, 3, 3])
    stay, _, decision = place_fill(shifted, free, before, CALL_1, horizon=100.0)  # 13 us x 100 < 2 ms
    assert decision.stayed and decision.saved_s == pytest.approx(13e-6) and decision.cold_s == pytest.approx(2e-3)
    assert np.array_equal(stay.expert, before.expert) and np.array_equal(stay.gpu, before.gpu)
    moved, _, decision = place_fill(shifted, free, before, CALL_1, horizon=1000.0)  # 13 us x 1000 > 2 ms
    assert decision.kind == "fill" and moved.logcnt(4)[0] == 2 and decision.saved_s == pytest.approx(13e-6)
    same_groups, _, decision = place_fill(np.array([14.0, 6, 10, 10]), free, before, CALL_1, horizon=1.0)
    assert diff_layer(before, same_groups).churn == 0  # the same groups: the resident replicas, re-shared


def test_walk_follows_the_resident_order_so_groups_stay_together():
    load = np.array([30.0, 5, 25, 10, 20, 15, 8, 7])
    first, _, _ = place_fill(load, np.full(4, 8), None, CALL_1)
    nudged = load + np.array([1, 0, -1, 0, 1, 0, -1, 0])
    second, _, decision = place_fill(nudged, np.full(4, 8), first, CALL_1, horizon=1e9)
    assert diff_layer(first, second).churn <= 2 or decision.stayed


def run_fill(tokens, caps, level, budget):
    tokens, order, caps = np.array(tokens), np.arange(len(tokens)), np.array(caps)
    out = [np.zeros(budget, np.int64), np.zeros(budget, np.int64), np.zeros(budget)]
    count = fill(tokens, order, caps, 1.0, level, budget - len(tokens), *out)
    return None if count < 0 else list(zip(out[0][:count].tolist(), out[1][:count].tolist(), out[2][:count].tolist()))


def test_fill_cuts_an_overflowing_expert_and_respects_slots_and_budget():
    assert run_fill([5.0, 5.0, 5.0], [1, 1, 1], 6.0, budget=3) == [(0, 0, 5.0), (1, 1, 5.0), (2, 2, 5.0)]
    assert run_fill([5.0, 5.0, 5.0], [1, 1], 100.0, budget=3) is None  # 2 slots, 3 experts
    # 6 tokens + 1 call fill bin 0, the other 3 go on with expert 1 (3 + 1 + 1 + 1 = 6 <= 7)
    assert run_fill([9.0, 1.0], [3, 3], 7.0, budget=3) == [(0, 0, 6.0), (0, 1, 3.0), (1, 1, 1.0)]
    assert run_fill([9.0, 1.0], [3, 3], 6.0, budget=3) is None  # 5 | 4 + 1 call + 1 + 1 call > 6
    assert run_fill([9.0, 1.0], [3, 3], 7.0, budget=2) is None  # no cut left: 9 tokens never fit 7


def test_largest_remainder_is_whole_and_sums_to_each_experts_tokens():
    layer = LayerPlacement(np.array([0, 0, 0, 1]), np.array([0, 1, 2, 0]), np.array([0.5, 0.25, 0.25, 1.0]))
    assert layer.replica_tokens(np.array([7, 3])).tolist() == [3, 2, 2, 3]  # 3.5, 1.75, 1.75: the .75s get the 2 missing
    rng = np.random.default_rng(0)
    for _ in range(50):
        share = rng.dirichlet(np.ones(5))
        layer = LayerPlacement(np.zeros(5, dtype=np.int64), np.arange(5), share)
        tokens = int(rng.integers(0, 1000))
        counts = layer.replica_tokens(np.array([tokens]))
        assert counts.sum() == tokens and (np.abs(counts - tokens * share) < 1).all()


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: place_fill(np.array([1.0, -1.0]), np.full(2, 2), None, CALL_1), ValueError, "non-negative"),
        (lambda: place_fill(np.array([1.0, np.nan]), np.full(2, 2), None, CALL_1), ValueError, "finite"),
        (lambda: place_fill(np.ones(3), np.array([], dtype=np.int64), None, CALL_1), ValueError, "zero GPUs"),
        (lambda: place_fill(np.ones(5), np.full(2, 2), None, CALL_1), PlacementError, "4 free replica slots cannot hold 5 experts"),
        (lambda: place_fill(np.array([5.0, 5, 5, 5]), np.array([1, 3]), None, CALL_1, budget=4), None, None),
    ],
)
def test_invalid_inputs_raise_clear_errors(call, error, message):
    if error is None:  # a tight budget still fits one replica per expert
        layer, _, _ = call()
        assert layer.num_replicas == 4
        return
    with pytest.raises(error, match=message):
        call()


def test_reshare_levels_resident_replicas_most_loaded_first_and_keeps_idle_ones_warm():
    expert, gpu = np.array([0, 0, 1]), np.array([0, 1, 0])
    # expert 0 (10 tokens) first: two pieces reach level (10 + 2 calls) / 2 = 6 < 11; expert 1 joins GPU 0
    assert reshare(np.array([10.0, 4.0]), expert, gpu, 1.0, 2).tolist() == [0.5, 0.5, 1.0]
    # one token cannot be cut: the other replica keeps a zero share (still resident, no cold start later)
    assert reshare(np.array([1.0, 4.0]), expert, gpu, 1.0, 2).tolist() == [0.0, 1.0, 1.0]
    assert reshare(np.array([0.0, 0.0]), expert, gpu, 1.0, 2).tolist() == [1.0, 0.0, 1.0]
