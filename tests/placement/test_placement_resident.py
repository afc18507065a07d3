"""moeless's resident planner for one layer: golden example, priced additions, staying put."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeless.placement.latency_model import LatencyModel
from moeless.placement.resident_planner import ReplicaCost, place_resident
from moeless.placement.types import LayerPlacement, PlacementError

CALL_1 = LatencyModel(alpha=1e-6, beta=0.0, cold_start=1e-6, call_overhead=1e-6)  # a call costs one token


def serial_seconds(layer: LayerPlacement, load: np.ndarray, num_gpus: int, model: LatencyModel) -> float:
    """The serial model, written out here (not the planner's kernels): whole tokens by largest remainder."""
    tokens = np.floor(load[layer.expert] * layer.share + 1e-9).astype(int)
    remainder = load[layer.expert] * layer.share - tokens
    for e in range(load.shape[0]):
        mine = np.flatnonzero(layer.expert == e)
        for r in mine[np.argsort(-remainder[mine], kind="stable")][: int(load[e] - tokens[mine].sum())]:
            tokens[r] += 1
    per_gpu = np.bincount(layer.gpu, weights=tokens, minlength=num_gpus)
    calls = np.bincount(layer.gpu, weights=tokens > 0, minlength=num_gpus)
    return float((model.alpha * per_gpu + model.call_overhead * calls).max() + 2 * model.beta * per_gpu.max())


def test_golden_example():
    resident = Placement_static_layer(4, 2)
    cost = ReplicaCost(CALL_1, prefetch_layers=0, horizon=1)
    layer, left, decision = place_resident(np.array([10.0, 6.0, 0, 0]), np.array([4, 4]), resident, cost)
    assert [(a.expert, a.gpu) for a in decision.added] == [(0, 1)]
    assert decision.static_s == pytest.approx(18e-6) and decision.final_s == pytest.approx(10e-6)
    assert layer.expert.tolist() == [0, 1, 2, 3, 0] and layer.gpu.tolist() == [0, 0, 1, 1, 1]
    assert layer.share.tolist() == pytest.approx([0.1, 1.0, 1.0, 1.0, 0.9]) and left.tolist() == [2, 1]


def test_a_plan_counts_the_call_of_an_expert_unless_its_forecast_makes_it_idle_with_90_percent():
    # Expert 2's forecast of 0.3 token: P(no token) = exp(-0.3) = 74% < 90%, so the plan counts its
    # call (as for a whole token), not the 9 + 1 on GPU 1 of the golden example; 0.05 (95% idle) is idle.
    resident = Placement_static_layer(4, 2)
    cost = ReplicaCost(CALL_1, prefetch_layers=0, horizon=1)

    def plan(load):
        layer, _, decision = place_resident(np.array(load), np.array([4, 4]), resident, cost)
        return layer.expert.tolist(), layer.gpu.tolist(), layer.share.tolist(), decision.final_s

    assert plan([10.0, 6, 0.3, 0]) == plan([10.0, 6, 1, 0]) != plan([10.0, 6, 0, 0])
    assert plan([10.0, 6, 0.05, 0]) == plan([10.0, 6, 0, 0])


def Placement_static_layer(num_experts: int, num_gpus: int) -> LayerPlacement:
    expert = np.arange(num_experts)
    return LayerPlacement.even(expert, expert * num_gpus // num_experts, num_experts)


def test_home_replicas_stay_in_the_plan_and_small_predicted_gains_keep_static_eps_split():
    resident = LayerPlacement.even(np.array([0, 1, 2, 3, 0]), np.array([0, 0, 1, 1, 1]), 4)  # static + an extra
    cost = ReplicaCost(CALL_1, prefetch_layers=0, horizon=1)
    # 13 tokens per expert at most: noise ~ 1/sqrt(13) = 28% of static EP's time; the extra would save 1/28
    layer, _, decision = place_resident(np.array([13.0, 12, 13, 12]), np.full(2, 4), resident, cost)
    assert decision.final_s == decision.static_s and layer.num_replicas == 4
    assert layer.gpu.tolist() == [0, 0, 1, 1] and layer.share.tolist() == [1.0] * 4
    # Prefill-sized: the extra replica (warm, free) is used.
    layer, _, decision = place_resident(np.array([900.0, 100, 50, 50]), np.full(2, 4), resident, cost)
    assert decision.final_s < 0.9 * decision.static_s and layer.num_replicas == 5 and not decision.added


def test_nothing_resident_starts_from_static_blocks():
    cost = ReplicaCost(CALL_1, prefetch_layers=0, horizon=1)
    layer, _, decision = place_resident(np.array([0.0, 0, 0, 0]), np.full(2, 4), None, cost)
    assert decision.stayed and layer.gpu.tolist() == [0, 0, 1, 1] and layer.share.tolist() == [1.0] * 4
    assert decision.static_s == decision.final_s == 0.0


@st.composite
def layer_cases(draw):
    num_experts, num_gpus = draw(st.integers(1, 10)), draw(st.integers(1, 6))
    load = np.array(draw(st.lists(st.integers(0, 400), min_size=num_experts, max_size=num_experts)), dtype=np.float64)
    free = np.array(draw(st.lists(st.integers(0, 2 * num_experts), min_size=num_gpus, max_size=num_gpus)))
    free[0] += max(0, num_experts - int(free.sum()))
    resident = None
    if draw(st.booleans()):
        count = draw(st.integers(num_experts, 2 * num_experts))
        expert = np.concatenate([np.arange(num_experts), draw(st.lists(st.integers(0, num_experts - 1), min_size=count - num_experts,
                                                                      max_size=count - num_experts))]).astype(int)
        gpu = np.array(draw(st.lists(st.integers(0, num_gpus - 1), min_size=count, max_size=count)))
        pairs = sorted(set(zip(expert.tolist(), gpu.tolist())))
        resident = LayerPlacement.even(np.array([e for e, _ in pairs]), np.array([g for _, g in pairs]), num_experts)
    model = LatencyModel(alpha=draw(st.sampled_from([1e-6, 7.5e-6])), beta=draw(st.sampled_from([0.0, 3e-6])),
                         cold_start=draw(st.sampled_from([1e-5, 1e-4, 1.2e-3])), call_overhead=draw(st.sampled_from([0.0, 8.7e-5])))
    cost = ReplicaCost(model, prefetch_layers=draw(st.integers(0, 3)), expert_bytes=draw(st.sampled_from([1, 1_327_104, 10**9])),
                       keep_alive_s=draw(st.sampled_from([0.0, 1.0, 60.0])), gb_s_price=draw(st.sampled_from([0.0, 0.01, 1.0])),
                       horizon=draw(st.sampled_from([1.0, 30.0])), iteration_s=0.05)
    budget = draw(st.one_of(st.none(), st.integers(num_experts, 3 * num_experts)))
    return load, free, resident, cost, budget


def independent_cost(cost: ReplicaCost, loads_before: int, layer_s: float) -> float:
    """One more replica's price, from the cost model's definition (docs/design.md, "What a plan costs")."""
    def exposed(n):
        return max(n * cost.model.cold_start - cost.prefetch_layers * layer_s, 0.0)

    memory_gb_s = cost.expert_bytes / 1e9 * (cost.horizon * cost.iteration_s + cost.keep_alive_s)
    return exposed(loads_before + 1) - exposed(loads_before) + cost.gb_s_price * memory_gb_s


@settings(max_examples=150, deadline=None)
@given(layer_cases())
def test_a_plan_never_adds_a_replica_whose_priced_gain_is_below_its_cost(case):
    load, free, resident, cost, budget = case
    try:
        layer, left, decision = place_resident(load, free, resident, cost, budget)
    except PlacementError:
        return  # the resident replicas and the budget leave no room for every expert
    num_gpus = free.shape[0]
    # 1. Each addition's own gain and cost as the model defines them (cost computed here); each
    #    step's additions together gain more than they cost.
    times = [a.before_s for a in decision.added] + [decision.grown_s]
    for a, after in zip(decision.added, times[1:]):
        price = independent_cost(cost, a.loads_before, a.before_s)
        assert a.cost_s == pytest.approx(price, rel=1e-9, abs=1e-15)
        assert a.gain_s == pytest.approx((a.before_s - after) * cost.horizon, rel=1e-9, abs=1e-15)
    for step in {a.step for a in decision.added}:
        mine = [a for a in decision.added if a.step == step]
        assert sum(a.gain_s for a in mine) > sum(independent_cost(cost, a.loads_before, a.before_s) for a in mine)
    # 2. The whole plan: time evaluated here; never slower than static EP's split on the forecast,
    #    and what it gains over staying put pays for every addition.
    final = serial_seconds(layer, load, num_gpus, cost.model)
    assert final == pytest.approx(decision.final_s, rel=1e-9, abs=1e-15)
    assert decision.final_s <= decision.static_s + 1e-15 and decision.final_s <= decision.grown_s + 1e-15
    assert decision.added == () or times[0] == pytest.approx(decision.base_s)
    total_cost = sum(independent_cost(cost, a.loads_before, a.before_s) for a in decision.added)
    assert (decision.base_s - final) * cost.horizon >= total_cost - 1e-12
    # 3. A valid plan: every expert routable, shares sum to 1, within slots and budget.
    assert np.allclose(np.bincount(layer.expert, weights=layer.share, minlength=load.shape[0]), 1.0)
    assert (left >= 0).all() and (np.bincount(layer.gpu, minlength=num_gpus) <= free).all()
    assert budget is None or layer.num_replicas <= budget
    if resident is not None:
        new = set(zip(layer.expert.tolist(), layer.gpu.tolist())) - set(zip(resident.expert.tolist(), resident.gpu.tolist()))
        assert len(new) <= len(decision.added) + load.shape[0]  # cold: additions, or experts with no resident room


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), tokens=st.integers(0, 6))
def test_loads_too_small_to_pay_for_any_cold_start_keep_the_resident_placement(seed, tokens):
    rng = np.random.default_rng(seed)
    num_experts, num_gpus = 8, 4
    resident = LayerPlacement.even(np.arange(num_experts), rng.integers(0, num_gpus, num_experts), num_experts)
    load = rng.multinomial(tokens, np.full(num_experts, 1 / num_experts)).astype(np.float64)
    # A decode step on the measured CPU profile (1.2 ms cold starts from disk, none hidden), gains
    # counted over one iteration.
    model = LatencyModel(alpha=7.5e-6, beta=2.9e-6, cold_start=1.24e-3, call_overhead=8.7e-5)
    cost = ReplicaCost(model, prefetch_layers=0, horizon=1)
    layer, _, decision = place_resident(load, np.full(num_gpus, num_experts), resident, cost)
    assert decision.base_s * cost.horizon < model.cold_start  # even the whole layer's time cannot pay
    assert decision.stayed
    assert set(zip(layer.expert.tolist(), layer.gpu.tolist())) <= set(zip(resident.expert.tolist(), resident.gpu.tolist()))


def test_memory_price_and_prefetch_decide_what_pays():
    load = np.array([200.0, 10, 10, 10])
    resident = LayerPlacement.even(np.arange(4), np.arange(4), 4)
    model = LatencyModel(alpha=7.5e-6, beta=0.0, cold_start=1.24e-3, call_overhead=8.7e-5)
    free = np.full(4, 4)

    def added(**kw):
        return len(place_resident(load, free, resident, ReplicaCost(model, expert_bytes=1_327_104, **kw))[2].added)

    assert added(prefetch_layers=0, horizon=1) == 0  # a 1.24 ms cold start for one iteration's gain: no
    assert added(prefetch_layers=3, horizon=1) > 0  # hidden behind 3 layer times: yes
    assert added(prefetch_layers=3, horizon=30, gb_s_price=1e3, keep_alive_s=60) == 0  # memory priced dear: no


def test_bad_inputs_say_what_is_wrong():
    cost = ReplicaCost(CALL_1)
    with pytest.raises(ValueError, match=r"\[E\] vector"):
        place_resident(np.array([1.0, -1.0]), np.full(2, 2), None, cost)
    with pytest.raises(PlacementError, match="cannot hold 4 experts"):
        place_resident(np.ones(4), np.array([1, 1]), None, cost)
    with pytest.raises(PlacementError, match="budget of 3"):
        place_resident(np.ones(4), np.full(2, 4), None, cost, budget=3)
    with pytest.raises(ValueError, match="horizon"):
        ReplicaCost(CALL_1, horizon=0)
