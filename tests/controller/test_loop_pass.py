"""One pass of the planning loop, decided by rules.py's pure functions on plain data (no Ray, no
hosts): whether a pass is due, what it plans for, the plan of each group, what it publishes."""

import numpy as np

from moeless.controller.knobs import Knobs
from moeless.controller.planning.host_view import HostView
from moeless.controller.planning.rules import (
    StepDecision, forecast_groups, held_forecasts, pass_due, plan_groups, plan_phases, plan_step,
    planner_config, same_placement, to_publish,
)
from moeless.placement.planner import get_planner
from moeless.placement.types import LayerPlacement, Placement

from controller_support import E, G, L, PROFILE, homes, status

SKEWED = np.array([[400.0, 300, 10, 10], [300, 300, 20, 20]])


def planner(name="moeless"):
    return get_planner(name, planner_config(Knobs(memory_price=0.0), PROFILE, 0.05, num_layers=L, num_experts=E))


def test_a_pass_is_due_with_reports_pending_loads_or_after_idle_seconds():
    assert pass_due(True, False, 0.0, 1.0) and pass_due(False, True, 0.0, 1.0) and pass_due(False, False, 1.0, 1.0)
    assert not pass_due(False, False, 0.99, 1.0)


def test_a_phase_without_reports_keeps_its_last_forecast_for_the_hold():
    prefill, decode = np.ones((L, E)), np.full((L, E), 2.0)
    out, held = held_forecasts({"prefill": prefill, "decode": decode}, {}, 10.0, 60.0)
    assert [f is prefill for f in out] == [True, False] and held == {"prefill": (10.0, prefill), "decode": (10.0, decode)}
    out, again = held_forecasts({"prefill": None, "decode": decode}, held, 70.0, 60.0)  # prefill's for 60 s
    assert len(out) == 2 and out[0] is prefill and again["prefill"] == (10.0, prefill)
    out, _ = held_forecasts({"prefill": None, "decode": None}, held, 70.1, 60.0)  # past the hold
    assert out == [] and held["decode"] == (10.0, decode)  # the caller's dict is left as it was


def test_what_a_pass_plans_for():
    asked = []

    def phases():
        asked.append(1)
        return ["p", "d"]

    # No traffic, not the first pass, no host came or went, nothing pending: nothing (and no merge).
    assert forecast_groups(False, False, False, False, [], phases) == [] and not asked
    assert forecast_groups(True, False, False, False, [], phases) == [["p", "d"]]  # the first pass
    assert forecast_groups(False, True, False, False, [], phases) == [["p", "d"]]  # a host joined
    assert forecast_groups(False, False, True, False, [], phases) == [["p", "d"]]  # reports in the window
    # A stateful planner: every reported iteration in order, one group each; the first pass: the homes.
    a, b = np.ones((L, E)), np.zeros((L, E))
    groups = forecast_groups(False, False, True, True, [a, b], phases)
    assert len(groups) == 2 and groups[0][0] is a and groups[1][0] is b
    assert forecast_groups(True, False, False, True, [], phases) == [[]]
    assert forecast_groups(False, False, True, True, [], phases) == []
    assert len(asked) == 3


def test_plan_groups_homes_without_forecasts_or_with_the_predictor_off():
    view = HostView.from_status([status([]), status([])], L, E)  # two empty hosts, as at start
    assert plan_groups(planner(), [], view, PROFILE.expert_bytes, 2 * E, None, False) is None
    for groups, off in (([[]], False), ([[SKEWED]], True)):
        decision = plan_groups(planner(), groups, view, PROFILE.expert_bytes, 2 * E, None, off)
        assert same_placement(decision.plan, Placement.static(L, E, G), shares=False)
        assert sorted(decision.loads) == sorted((l, e, e * G // E) for l in range(L) for e in range(E))


def test_a_first_pass_without_traffic_keeps_the_homes_the_hosts_hold_where_they_moved():
    """A restarted loop's first pass before any report: layer 0's experts 0 and 2 swapped hosts (a move or
    a rebalance before the restart). Its homes are taken where the hosts hold them: nothing to load, not
    static EP's blocks back; with the predictor off, serving routes static EP's, so those load."""
    moved = [(l, e, s) for g in range(G) for l, e, s in homes(g)]
    swapped = [[r for r in homes(0) if r[:2] != (0, 0)] + [(0, 2, "idle")],
               [r for r in homes(1) if r[:2] != (0, 2)] + [(0, 0, "idle")]]
    assert len(moved) == sum(map(len, swapped))
    view = HostView.from_status([status(swapped[0]), status(swapped[1])], L, E)
    decision = plan_groups(planner(), [[]], view, PROFILE.expert_bytes, 2 * E, None, False)
    assert decision.loads == [] and {(0, 0, 1), (0, 2, 0)} <= decision.plan.replicas()
    off = plan_groups(planner(), [[SKEWED]], view, PROFILE.expert_bytes, 2 * E, None, True)
    assert sorted(off.loads) == [(0, 0, 0), (0, 2, 1)]


def test_plan_groups_plans_each_phase_and_keeps_the_last_groups_decision():
    view = HostView.from_status([status(homes(0)), status(homes(1))], L, E)
    decode = np.array([[2.0, 1, 1, 0], [1, 1, 1, 1]])
    phases = plan_groups(planner(), [[SKEWED, decode]], view, PROFILE.expert_bytes, 2 * E, None, False)
    assert same_placement(phases.plan, plan_phases(planner(), [SKEWED, decode], view, PROFILE.expert_bytes, 2 * E).plan)
    last = plan_groups(planner(), [[SKEWED], [decode]], view, PROFILE.expert_bytes, 2 * E, None, False)
    assert same_placement(last.plan, plan_step(planner(), decode, view, PROFILE.expert_bytes, 2 * E).plan)


def test_what_a_pass_publishes():
    view = HostView.from_status([status(homes(0)), status(homes(1))], L, E)
    decision = plan_groups(planner(), [[SKEWED]], view, PROFILE.expert_bytes, 2 * E, None, False)
    assert to_publish(None, decision, False, "moeless") is decision.publish
    assert to_publish(None, decision, True, "moeless") is None  # the predictor off: static EP stays
    assert to_publish(decision.publish, decision, False, "moeless") is None  # published already
    # Other shares on the same replicas: moeless's serving replicas re-level them anyway, EPLB's do not.
    def placed(shares):
        layer = LayerPlacement(np.array([0, 0, 1, 2, 3]), np.array([0, 1, 0, 1, 1]), np.array([*shares, 1, 1, 1]))
        return Placement((layer, layer), E, G)

    even = StepDecision(placed((.5, .5)), [], placed((.5, .5)))
    assert to_publish(placed((.3, .7)), even, False, "moeless") is None
    assert to_publish(placed((.3, .7)), even, False, "eplb-window") is even.publish
