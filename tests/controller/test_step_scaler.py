"""The step scaler's rules (controller/planning/step_scaler.py) and the loop's widening tickets
(controller/planning/widenings.py), on a fake clock."""

import threading

import numpy as np
import pytest

from moeless.controller.planning.step_scaler import PlacementWidth, hosts_for_step, step_expert_s
from moeless.controller.planning.widenings import FAST_PERIOD_S, Widenings
from moeless.placement.profile import CostProfile
from moeless.placement.types import LayerPlacement, Placement

PROFILE = CostProfile(alpha=1e-3, beta=1e-8, call_overhead=0.5e-3, load_s={"disk": 1e-3, "host": 1e-4},
                      expert_bytes=1000, non_expert_bytes=1000, relevel_s=1e-5, source="test")


def test_the_docstring_example_prices_a_step_and_the_hosts_it_needs():
    expert_s = step_expert_s(4, PROFILE, num_layers=3, top_k=2, num_experts=8)
    assert expert_s == pytest.approx(3 * (1e-3 * 8 + 0.5e-3 * 8))  # 36 ms of host time
    assert hosts_for_step(expert_s, 10e-3, ready=8) == 4
    assert hosts_for_step(expert_s, 10e-3, ready=3) == 3  # no more than are ready
    assert hosts_for_step(expert_s, 12e-3, ready=8) == 3  # exactly 3 x the SLO: 3 hosts, not 4
    assert hosts_for_step(0.0, 10e-3, ready=8) == 1


def test_call_overheads_stop_growing_once_every_expert_is_reached():
    few, many = (step_expert_s(t, PROFILE, 1, 2, 8) for t in (2, 100))
    assert few == pytest.approx(1e-3 * 4 + 0.5e-3 * 4)
    assert many == pytest.approx(1e-3 * 200 + 0.5e-3 * 8)


def test_a_bad_slo_is_refused():
    with pytest.raises(ValueError, match="SLO"):
        hosts_for_step(1.0, 0.0, 4)
    with pytest.raises(ValueError, match="at least 1 host"):
        PlacementWidth(floor=0)


def test_the_width_holds_the_largest_recent_need_then_falls_back_to_the_floor():
    width = PlacementWidth(floor=1, hold_s=2.0)
    assert width.hosts(0.0) == 1
    assert width.need(3, 0.0) is True  # wider: a pass is due
    assert width.need(2, 0.5) is False and width.hosts(0.5) == 3  # a smaller need keeps the larger one held
    assert width.need(3, 1.0) is False
    assert width.hosts(2.9) == 3  # 1.9 s after the last need of 3
    assert width.hosts(3.0) == 1  # the need of 2 (at 0.5) expired too
    assert width.need(2, 3.0) is True and width.hosts(4.9) == 2 and width.hosts(5.0) == 1


def test_without_a_floor_every_ready_host_is_planned_over():
    width = PlacementWidth(floor=None)
    assert width.need(5, 0.0) is False and width.hosts(0.0) is None
    assert width.active_slots([True, False, True], 0.0) == [True, False, True]


def test_active_slots_are_the_first_ready_ones_in_slot_order():
    width = PlacementWidth(floor=2, hold_s=1.0)
    assert width.active_slots([False, True, True, True], 0.0) == [False, True, True, False]
    width.need(3, 0.0)
    assert width.active_slots([True, True, False, True, True], 0.5) == [True, True, False, True, False]
    assert width.active_slots([True, True, False, True, True], 1.5) == [True, True, False, False, False]


def test_a_widening_is_answered_by_the_first_pass_after_it_that_leaves_nothing_to_load():
    w = Widenings(PlacementWidth(floor=1, hold_s=5.0), threading.RLock())
    before = w.pass_started()  # a pass already running when the widening is asked
    ticket = w.ask(3, 0.0)
    assert ticket == 1 and w.open() and w.period(0.25) == FAST_PERIOD_S
    assert w.ask(2, 0.1) is None  # not wider than what is held: answered at once
    w.pass_ended(before, loads_pending=False, version=4, now=0.05)
    assert w.open()  # that pass planned without knowing of the widening
    mine = w.pass_started()
    w.pass_ended(mine, loads_pending=True, version=5, now=0.06)  # loads sent to the spares
    assert w.open()
    w.pass_ended(w.pass_started(), loads_pending=False, version=6, now=0.08)  # loaded and published
    assert not w.open() and w.period(0.25) == 0.25
    assert w.wait(ticket, timeout_s=0.0) == 6
    assert w.as_dict() == {"asked": 1, "settled": 1, "warm": 0, "settle_s": [pytest.approx(0.08)]}


def test_a_caller_waits_for_the_settling_pass():
    w = Widenings(PlacementWidth(floor=1, hold_s=5.0), threading.RLock())
    ticket, got = w.ask(2, 0.0), []
    waiter = threading.Thread(target=lambda: got.append(w.wait(ticket, timeout_s=10.0)))
    waiter.start()
    w.pass_ended(w.pass_started(), loads_pending=False, version=7, now=0.01)
    waiter.join(5.0)
    assert got == [7]


def test_a_re_widening_publishes_the_placement_last_published_over_those_hosts_while_it_is_resident():
    w = Widenings(PlacementWidth(floor=1, hold_s=5.0), threading.RLock())
    narrow, wide = [True, False, False], [True, True, True]
    # 1 layer, 2 experts over 3 slots: expert 0 on host 0, expert 1 on hosts 1 and 2
    placement = Placement((LayerPlacement.even(np.array([0, 1, 1]), np.array([0, 1, 2]), 2),), 2, 3)
    resident = np.ones((1, 2, 3), bool)
    w.published(wide, placement)
    w.published(narrow, Placement.static(1, 2, 3))
    assert w.warm(wide, resident) is None  # no widening open: the pass plans
    w.ask(3, 0.0)
    assert w.warm([True, True, False], resident) is None  # never published over these
    gone = resident.copy()
    gone[0, 1, 2] = False  # a spare's keep-alive evicted its part
    assert w.warm(wide, gone) is None
    assert w.warm(wide, resident) is placement
    assert w.as_dict()["warm"] == 1


def test_a_warm_widening_is_settled_by_widen_itself_with_the_version_it_published():
    w = Widenings(PlacementWidth(floor=1, hold_s=5.0), threading.RLock())
    placement = Placement((LayerPlacement.even(np.array([0, 1]), np.array([0, 1]), 2),), 2, 2)
    w.published([True, True], placement)
    published = []
    publish = lambda p, hosts: published.append((p, hosts)) or 9  # noqa: E731 -- the loop's board version
    ticket = w.ask(2, 0.0)
    assert not w.answer_warm(ticket, [True, True], np.zeros((1, 2, 2), bool), publish, 0.01)
    assert w.open() and not published  # the spares were empty when last read: a pass answers it
    assert w.answer_warm(ticket, [True, True], np.ones((1, 2, 2), bool), publish, 0.02)
    assert published == [(placement, [True, True])] and not w.open() and w.wait(ticket, 0.0) == 9
    assert w.as_dict()["settle_s"] == [pytest.approx(0.02)]


def test_a_warm_wider_placement_answers_a_narrower_ask_and_the_width_holds_it():
    """A burst asks for 2 hosts, then 3: where only the 3-host placement is warm, the first ask takes it."""
    w = Widenings(PlacementWidth(floor=1, hold_s=5.0), threading.RLock())
    wide = Placement((LayerPlacement.even(np.array([0, 1, 1]), np.array([0, 1, 2]), 2),), 2, 3)
    w.published([True, True, True], wide)
    published = []
    ticket = w.ask(2, 0.0)
    assert w.answer_warm(ticket, [True, True, True], np.ones((1, 2, 3), bool),
                         lambda p, hosts: published.append(hosts) or 3, 0.0)
    assert published == [[True, True, True]] and w.hosts(0.1) == 3 and w.ask(3, 0.1) is None
