"""The live loop's pure parts: planner naming, what the hosts hold, one planning pass's decisions,
the report window, the figures, the heartbeat (fake clock), the per-call re-levelling."""

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeless.controller.planning.host_view import HostView
from moeless.controller.planning.rules import (
    hosts_to_configure, layer_cap_replicas, live_planner_name, loads_to_send, memory_price, plan_phases, plan_step, planner_config,
    publishable,
    resident_placement, same_placement, union_placement,
)
from moeless.controller.planning.window import Heartbeat, IterationReport, LayerFigures, LiveStats, ReportWindow
from moeless.placement.planner import get_planner, relevels
from moeless.placement.profile import ProfileError
from moeless.controller.knobs import KnobError, Knobs
from moeless.placement.latency_model import LatencyModel
from moeless.placement.check_gate import CheckGate
from moeless.placement.dispatch import pair_tokens
from moeless.placement.shares import actual_shares
from moeless.placement.types import LayerPlacement, Placement

from controller_support import E, G, L, PROFILE, homes, status


def test_planner_names_from_knobs():
    assert live_planner_name(Knobs()) == "moeless"
    assert live_planner_name(Knobs(scaler=False)) == "moeless-no-scaler"
    assert live_planner_name(Knobs(planner="paper", scaler=False, placer=False)) == "paper-no-scaler-no-placer"
    with pytest.raises(KnobError, match="scaler/placer: only the moeless and paper planners"):
        live_planner_name(Knobs(planner="static", placer=False))
    assert relevels("moeless-no-placer") and not relevels("eplb-window") and not relevels("paper")


def test_hosts_whose_keep_alive_differs_are_configured_unless_the_hosts_are_shared():
    statuses = [{"keep_alive_s": 60.0}, None, {"keep_alive_s": 30.0}, {"keep_alive_s": 30.0 + 1e-12}]
    assert hosts_to_configure(statuses, 30.0, shared=False) == [0]  # slot 1 is empty
    assert hosts_to_configure(statuses, 60.0, shared=False) == [2, 3]
    assert hosts_to_configure(statuses, 30.0, shared=True) == []  # a shared pool's keep-alive is the pool's


def test_layer_cap_from_knobs():
    assert layer_cap_replicas(Knobs(), E, 1000) == 2 * E
    assert layer_cap_replicas(Knobs(layer_memory_cap_gib=6000 / 2**30), E, 1000) == 6
    with pytest.raises(KnobError, match="layerMemoryCapGiB: .* fewer than the 4 experts"):
        layer_cap_replicas(Knobs(layer_memory_cap_gib=3000 / 2**30), E, 1000)


def test_resident_placement_puts_an_expert_resident_nowhere_at_home():
    resident = np.zeros((L, E, G), dtype=bool)
    resident[0, :, 0] = True  # layer 0: every expert on host 0; layer 1: nothing
    placement = resident_placement(resident)
    assert placement.layers[0].gpu.tolist() == [0, 0, 0, 0]
    assert sorted(zip(placement.layers[1].expert.tolist(), placement.layers[1].gpu.tolist())) == [(0, 0), (1, 0), (2, 1), (3, 1)]


def test_resident_placement_gives_a_host_that_joins_its_static_ep_share():
    """Host 1 was away: its experts 2 and 3 stood in on host 0. Once it is live they count at home
    again (and are loaded there), beside the stand-ins; while it is away they do not."""
    resident = np.zeros((L, E, G), dtype=bool)
    resident[:, :, 0] = True
    joined = resident_placement(resident, live=np.array([True, True]))
    for lp in joined.layers:
        assert sorted(zip(lp.expert.tolist(), lp.gpu.tolist())) == [(0, 0), (1, 0), (2, 0), (2, 1), (3, 0), (3, 1)]
    away = resident_placement(resident, live=np.array([True, False]))
    assert all(lp.gpu.tolist() == [0, 0, 0, 0] for lp in away.layers)


def test_plan_step_loads_the_static_share_of_a_host_that_joins():
    view = HostView.from_status([status(homes(0) + homes(1)), status([])], L, E)  # host 1 joined empty
    planner = get_planner("moeless", planner_config(Knobs(), PROFILE, 0.05, num_layers=L, num_experts=E))
    decision = plan_step(planner, np.full((L, E), 4.0), view, PROFILE.expert_bytes, 2 * E)
    assert sorted(decision.loads) == [(l, e, 1) for l in range(L) for e in (2, 3)]
    assert all(lp.gpu.tolist() == [0, 0, 0, 0] for lp in decision.publish.layers)  # served on host 0 until loaded


def test_loads_publishing_and_stand_ins():
    plan = Placement((LayerPlacement(np.array([0, 0, 1, 2, 3]), np.array([0, 1, 0, 1, 1]), np.array([.5, .5, 1, 1, 1])),
                      LayerPlacement(np.array([0, 1, 2, 3]), np.array([1, 1, 0, 0]), np.ones(4))), E, G)
    view = HostView.from_status([status(homes(0) + [(1, 2, "loading")]), status(homes(1))], L, E)
    # Layer 0: (0, 1) is new -> loaded; layer 1: experts 0, 1 moved to host 1, 2 and 3 to host 0.
    assert sorted(loads_to_send(plan, view)) == [(0, 0, 1), (1, 0, 1), (1, 1, 1), (1, 3, 0)]
    dead = HostView(view.resident, view.loading, np.array([True, False]), view.memory)
    assert sorted(loads_to_send(plan, dead)) == [(1, 3, 0)]
    published = publishable(plan, view.resident)
    # Layer 0: the unloaded replica (0, host 1) is left out, expert 0 keeps its loaded one, share 1.
    lp = published.layers[0]
    assert sorted(zip(lp.expert.tolist(), lp.gpu.tolist(), lp.share.tolist())) == [(0, 0, 1.0), (1, 0, 1.0), (2, 1, 1.0), (3, 1, 1.0)]
    # Layer 1: nothing planned is loaded: every expert is served where it is resident (its home).
    lp = published.layers[1]
    assert sorted(zip(lp.expert.tolist(), lp.gpu.tolist())) == [(0, 0), (1, 0), (2, 1), (3, 1)]
    nowhere = view.resident.copy()
    nowhere[1, 3] = False  # expert 3 of layer 1 resident nowhere: its planned replica is kept (loads on demand)
    assert (3, 0) in set(zip(publishable(plan, nowhere).layers[1].expert.tolist(), publishable(plan, nowhere).layers[1].gpu.tolist()))
    assert same_placement(published, published) and not same_placement(None, published)


def test_plan_step_plans_around_a_dead_host():
    skewed = np.array([[400.0, 300, 10, 10], [300, 300, 20, 20]])
    view = HostView.from_status([status(homes(0)), status(homes(1)), None], L, E)  # host 2 is dead
    planner = get_planner("moeless", planner_config(Knobs(memory_price=0.0), PROFILE, 0.05, num_layers=L, num_experts=E))
    decision = plan_step(planner, skewed, view, PROFILE.expert_bytes, 2 * E)
    for lp in decision.plan.layers:
        assert 2 not in lp.gpu.tolist() and sorted(set(lp.expert.tolist())) == list(range(E))
    assert all(g != 2 for _, _, g in decision.loads)
    assert decision.plan.layers[0].num_replicas > E  # the skew pays for more replicas
    # Static EP places on every host whatever its memory: it plans on the last known memory, and
    # serving replicas evacuate the dead host's replicas per call.
    static = plan_step(get_planner("static", planner.config), skewed, view, PROFILE.expert_bytes, 2 * E,
                       known_memory=np.full(3, 1e6))
    assert 2 in static.plan.layers[0].gpu.tolist() and all(g != 2 for _, _, g in static.loads)


def test_plan_phases_keeps_the_union_of_each_phases_plan():
    """A prefill's skew pays for replicas a decode step's few tokens do not: planned alone, their
    time-weighted mean would drop them; the union keeps them resident (calls re-level on actual loads)."""
    prefill = np.array([[400.0, 300, 10, 10], [300, 300, 20, 20]])
    decode = np.array([[2.0, 1, 1, 0], [1, 1, 1, 1]])
    view = HostView.from_status([status(homes(0)), status(homes(1))], L, E)
    planner = get_planner("moeless", planner_config(Knobs(memory_price=0.0), PROFILE, 0.05, num_layers=L, num_experts=E))
    alone = plan_step(planner, prefill, view, PROFILE.expert_bytes, 2 * E)
    small = plan_step(planner, decode, view, PROFILE.expert_bytes, 2 * E)
    both = plan_phases(planner, [prefill, decode], view, PROFILE.expert_bytes, 2 * E)
    assert small.plan.layers[0].num_replicas == E < alone.plan.layers[0].num_replicas
    for l in range(L):
        pairs = set(zip(both.plan.layers[l].expert.tolist(), both.plan.layers[l].gpu.tolist()))
        assert pairs == set(zip(alone.plan.layers[l].expert.tolist(), alone.plan.layers[l].gpu.tolist())) | \
            set(zip(small.plan.layers[l].expert.tolist(), small.plan.layers[l].gpu.tolist()))
        assert np.allclose(np.bincount(both.plan.layers[l].expert, weights=both.plan.layers[l].share), 1.0)
    assert sorted(both.loads) == sorted(alone.loads)
    # A union over the layer cap keeps that layer of the first plan.
    capped = union_placement([alone.plan, Placement.static(L, E, G)], view.cluster(PROFILE.expert_bytes, E))
    assert capped.layers[0] is alone.plan.layers[0]


def test_the_memory_neutral_price_is_one_over_the_deployments_gb():
    # PROFILE's deployment: 10_000 non-expert bytes per serving replica + L x E replicas of 1000 bytes.
    assert PROFILE.memory_neutral_price(L, E) == pytest.approx(1e9 / 18_000)
    assert PROFILE.memory_neutral_price(L, E, serving_replicas=2) == pytest.approx(1e9 / 28_000)
    assert memory_price(Knobs(memory_price=0.5), PROFILE, L, E) == 0.5  # set: the knob's
    assert planner_config(Knobs(), PROFILE, 0.05, num_layers=L, num_experts=E).gb_s_price == pytest.approx(1e9 / 18_000)
    with pytest.raises(ProfileError, match="holds no memory"):
        replace(PROFILE, expert_bytes=0, non_expert_bytes=0).memory_neutral_price(L, E)


def test_at_the_memory_neutral_price_a_replica_is_added_only_where_it_saves_more_gb_s_than_it_holds():
    prefill = np.array([[400.0, 300, 10, 10], [300, 300, 20, 20]])
    view = HostView.from_status([status(homes(0)), status(homes(1))], L, E)

    def replicas(non_expert_bytes):
        profile = replace(PROFILE, non_expert_bytes=non_expert_bytes)
        planner = get_planner("moeless", planner_config(Knobs(), profile, 0.05, num_layers=L, num_experts=E))
        return plan_step(planner, prefill, view, profile.expert_bytes, 2 * E).plan.layers[0].num_replicas

    # The same ~0.3 ms a layer saved: 18 kB held meanwhile is far less than a replica's 1 kB for its
    # 61.5 s of life; 1 TB held is far more.
    assert replicas(10_000) == E
    assert replicas(10**12) > E


def report(t, phase="prefill", duration=0.1, load=None, forecast=None, wall=1e-3, replica="a"):
    actual = np.array(load if load is not None else [[3, 1, 0, 0], [1, 1, 1, 1]])
    figures = LayerFigures(wall_s=np.full(L, wall), compute_s=np.full(L, 5e-4), host_tokens=np.array([3.0, 2.0]),
                           host_calls=np.array([2.0, 0.0]), cold_starts=np.array([1.0, 0.0]), model_s=np.full(L, 4e-4),
                           imbalance=np.array([1.5, 1.0]), cv=np.array([0.5, 0.0]))
    return IterationReport(replica, t, duration, phase, 4, actual, forecast, float("nan"), 1e-5, figures)


def test_window_merges_with_time_weights_and_forgets():
    window = ReportWindow(window_s=2.0)
    window.add(report(0.0, duration=0.3, load=[[4, 0, 0, 0], [0, 0, 0, 4]]))
    window.add(report(1.0, duration=0.1, load=[[0, 4, 0, 0], [0, 0, 0, 4]]))
    merged = window.merged(1.5, "actual")
    assert np.allclose(merged[0], [3, 1, 0, 0]) and np.allclose(merged[1], [0, 0, 0, 4])
    assert window.merged(1.5, "forecast") is None  # no predictor
    assert window.merged(1.5, "actual", "decode") is None and np.allclose(window.merged(1.5, "actual", "prefill"), merged)
    assert math.isclose(window.iteration_s(1.5), 0.2)
    assert np.allclose(window.merged(2.5, "actual")[0], [0, 4, 0, 0])  # the first ended more than 2 s ago
    assert window.merged(10.0, "actual") is None and window.iteration_s(10.0, default=0.05) == 0.05


def test_window_gives_its_reports_as_samples_for_a_planner_on_samples():
    window = ReportWindow(window_s=2.0)
    window.add(report(0.0, duration=0.3, load=[[4, 0, 0, 0], [0, 0, 0, 4]]))
    window.add(report(1.0, duration=0.1, load=[[0, 4, 0, 0], [0, 0, 0, 4]]))
    samples = window.samples(1.5, "actual", "prefill")
    assert samples.shape == (2, 2, 4) and samples[:, 0].tolist() == [[4, 0, 0, 0], [0, 4, 0, 0]]
    assert window.samples(1.5, "actual", "decode") is None and window.samples(2.5, "actual").shape[0] == 1


def test_stats_sum_per_phase_and_keep_the_last_layer_figures():
    stats = LiveStats(L)
    stats.add(report(0.0, "prefill", wall=3e-4))
    stats.add(report(0.1, "decode", wall=2e-3))
    stats.add(report(0.2, "decode", wall=2e-3))
    prefill, decode = stats.phases["prefill"], stats.phases["decode"]
    assert prefill.calls.tolist() == [1, 0] and decode.calls.tolist() == [2, 0]  # layer 1 made no call
    assert math.isclose(decode.mean("compute_s"), 5e-4) and decode.per_layer["cold_starts"].tolist() == [2.0, 0.0]
    assert prefill.buckets.sum() == 1 and decode.buckets[np.searchsorted([2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3], 2e-3)] == 2
    assert stats.imbalance.tolist() == [1.5, 1.0] and stats.load_max_over_mean.tolist() == [3.0, 1.0]
    with pytest.raises(ValueError, match="unknown phase"):
        stats.add(report(0.3, "chunked"))
    stats.reset()
    assert stats.phases["decode"].iterations == 0


def test_heartbeat_reports_a_stall_on_a_fake_clock():
    now = [100.0]
    beat = Heartbeat(lambda: now[0], threshold_s=2.0)
    now[0] += 1.5
    assert beat.stalled() is None
    beat.beat()
    now[0] += 2.5
    assert beat.stalled() == "degraded: planning loop stalled for 2.5 s"


def test_pairing_golden_example():
    # Static EP on 2 GPUs (experts 0, 1 on GPU 0; 2, 3 on GPU 1) plus a replica of expert 0 on GPU 1;
    # a call costs one token's time. Loads [10, 6, 0, 0]: GPU 0 works 18; 8 of expert 0's tokens
    # move to GPU 1 (1 + 8 there, 1 + 2 + 1 + 6 on GPU 0: 10).
    layer = LayerPlacement(np.array([0, 1, 2, 3, 0]), np.array([0, 0, 1, 1, 1]), np.array([1.0, 1, 1, 1, 0]))
    out = pair_tokens(np.array([10, 6, 0, 0]), layer, LatencyModel(alpha=1.0, beta=0.0, cold_start=1.0, call_overhead=1.0), 2)
    assert out.expert.tolist() == layer.expert.tolist() and out.gpu.tolist() == layer.gpu.tolist()
    assert np.allclose(out.share, [0.2, 1, 1, 1, 0.8])  # experts without tokens route to their replica
    static = Placement.static(1, E, 2).layers[0]
    assert pair_tokens(np.array([10, 6, 0, 0]), static, LatencyModel(1.0, 0.0, 1.0, 1.0), 2) is static


def test_pairing_gives_an_experts_twin_on_the_same_gpu_no_tokens():
    # Expert 0 twice on GPU 1 (EPLB's packing can do that): one replica there, whole tokens.
    model = LatencyModel(alpha=1.0, beta=0.0, cold_start=1.0, call_overhead=1.0)
    layer = LayerPlacement(np.array([0, 1, 2, 3, 0, 0]), np.array([0, 0, 1, 1, 1, 1]), np.array([0.5, 1, 1, 1, 0.25, 0.25]))
    out = pair_tokens(np.array([10, 6, 0, 0]), layer, model, 2)
    assert np.allclose(out.share, [0.2, 1, 1, 1, 0.8, 0])


def test_actual_shares_relevel_where_the_best_saving_beats_the_cost_else_route_the_better_split():
    import torch

    from moeless.model.interface import Routing
    from moeless.serving.relevel import relevel_for

    model = LatencyModel(alpha=1.0, beta=0.0, cold_start=1.0, call_overhead=1.0)
    layer = LayerPlacement(np.array([0, 1, 2, 3, 0]), np.array([0, 0, 1, 1, 1]), np.array([1.0, 1, 1, 1, 0]))
    # Planned shares = static EP's split: GPU 0 works 10 + 1 + 6 + 1 = 18. No split beats expert 1
    # alone (7), the work spread evenly ((16 tokens + 2 calls) / 2 = 9), nor expert 0 spread over
    # its two GPUs on top of expert 1 ((7 + 10 + 2 calls) / 2 = 9.5): at most 8.5 to save.
    out, relevelled, checked, _ = actual_shares(np.array([10, 6, 0, 0]), layer, model, 2, 8.4)
    assert relevelled and checked and np.allclose(out.share, [0.2, 1, 1, 1, 0.8])
    assert actual_shares(np.array([10, 6, 0, 0]), layer, model, 2, 8.5) == (layer, False, True, 0.0)
    # The busiest GPU holds no split expert's tokens (expert 0's are on GPU 1; expert 1's 30 on
    # GPU 0): nothing to save at any cost, and the plan beats static EP's split (31 against 33).
    away = LayerPlacement(layer.expert, layer.gpu, np.array([0.0, 1, 1, 1, 1]))
    assert actual_shares(np.array([1, 30, 0, 0]), away, model, 2, 0.0)[:3] == (away, False, True)
    static = Placement.static(1, E, 2).layers[0]
    assert actual_shares(np.array([10, 6, 0, 0]), static, model, 2, 0.0) == (static, False, False, 0.0)
    # A forecast that moved expert 0 to GPU 1, where expert 2 got 30 tokens: planned 10 + 1 + 30 + 1
    # = 42, static EP's split 31 (expert 2 alone, which no split beats): static EP's split is routed.
    out, relevelled, _, _ = actual_shares(np.array([10, 0, 30, 0]), away, model, 2, 0.0)
    assert not relevelled and out.share.tolist() == [1, 1, 1, 1, 0]
    # The data plane follows the same rule: shares re-levelled where it pays, kept (the same object) where not.
    idx = torch.tensor([[0]] * 10 + [[1]] * 6)
    routing = Routing(idx, torch.ones(16, 1), torch.zeros(16, E))
    assert np.allclose(relevel_for(model, 5.0)(0, layer, routing, 2).share, [0.2, 1, 1, 1, 0.8])
    assert relevel_for(model, 11.0)(0, layer, routing, 2) is layer
    # With the twin's gate and a pairing priced by the layer's replicas: the same choice; a phase
    # whose checks found nothing skips the next call's check and routes static EP's split.
    gate, phase = CheckGate(check_s=0.5, window=1), ["prefill"]
    relevel = relevel_for(model, lambda r, e, g: 1.0 * r / e, gate=gate, phase=lambda: phase[0])  # 5 / 4
    assert np.allclose(relevel(0, layer, routing, 2).share, [0.2, 1, 1, 1, 0.8])
    phase[0] = "decode"
    even = Routing(torch.tensor([[0], [1], [2], [3]]), torch.ones(4, 1), torch.zeros(4, E))
    assert relevel(0, layer, even, 2) is layer and gate.checks == 2  # nothing to save: backs off
    assert relevel(0, layer, even, 2).share.tolist() == [1, 1, 1, 1, 0] and gate.skips == 1
    assert np.allclose(relevel(0, layer, routing, 2).share, [0.2, 1, 1, 1, 0.8])  # the skip spent, decode checks again and pairs


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=E, max_size=E), st.lists(st.integers(0, E - 1), min_size=1, max_size=4),
       st.booleans(), st.floats(0.0, 3.0), st.floats(0.0, 0.5))
def test_route_check_floor_is_below_every_split_and_the_choice_below_planned_and_static(load, extra, away, call, beta):
    # The floor is a bound (at most the planned, unsplit and re-levelled times), and without a
    # re-level the routed shares are never slower than the planned ones or static EP's split: the
    # guarantee that a forecast which split the wrong expert costs the check and no more.
    from moeless.placement.resident_kernels import route_check

    model = LatencyModel(alpha=1.0, beta=beta, cold_start=1.0, call_overhead=call)
    expert = np.array(list(range(E)) + extra)
    gpu = np.concatenate([np.arange(E) * 2 // E, [1 - e * 2 // E for e in extra]])
    share = np.ones(expert.shape[0])
    if away:  # a split expert's tokens all on its extra replicas (a forecast that moved it)
        share[:E][np.bincount(expert, minlength=E) > 1] = 0.0
    share /= np.bincount(expert, weights=share, minlength=E)[expert]
    layer, whole = LayerPlacement(expert, gpu, share), np.array(load)
    planned, unsplit, floor, _ = route_check(whole, expert, gpu, share, 2, 1.0, call, beta)
    relevelled = model.layer_time(whole, pair_tokens(whole, layer, model, 2), 2, "serial")
    assert floor <= min(planned, unsplit, relevelled) + 1e-9
    static = model.layer_time(whole, Placement.static(1, E, 2).layers[0], 2, "serial")
    chosen, did, _, _ = actual_shares(whole, layer, model, 2, np.inf)
    assert not did
    assert model.layer_time(whole, chosen, 2, "serial") <= min(model.layer_time(whole, layer, 2, "serial"), static) + 1e-9
