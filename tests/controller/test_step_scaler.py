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
    assert w.as_dict() == {"asked": 1, "settled": 1, "warm": 0, "cold": 0, "settle_s": [pytest.approx(0.08)],
                           "cold_load_s": [], "answer_parts": []}


def test_a_caller_waits_for_the_settling_pass():
    w = Widenings(PlacementWidth(floor=1, hold_s=5.0), threading.RLock())
    ticket, got = w.ask(2, 0.0), []
    waiter = threading.Thread(target=lambda: got.append(w.wait(ticket, timeout_s=10.0)))
    waiter.start()
    w.pass_ended(w.pass_started(), loads_pending=False, version=7, now=0.01)
    waiter.join(5.0)
    assert got == [7]


def test_the_placement_last_published_over_the_wider_hosts_is_remembered_with_what_the_spares_lack():
    w = Widenings(PlacementWidth(floor=1, hold_s=5.0), threading.RLock())
    narrow, wide = [True, False, False], [True, True, True]
    # 1 layer, 2 experts over 3 slots: expert 0 on host 0, expert 1 on hosts 1 and 2
    placement = Placement((LayerPlacement.even(np.array([0, 1, 1]), np.array([0, 1, 2]), 2),), 2, 3)
    resident = np.ones((1, 2, 3), bool)
    w.published(wide, placement)
    w.published(narrow, Placement.static(1, 2, 3))
    assert w.remembered(wide, resident) is None  # no widening open: the pass plans
    w.ask(3, 0.0)
    assert w.remembered([True, True, False], resident) is None  # never published over these
    gone = resident.copy()
    gone[0, 1, 2] = False  # a spare's keep-alive evicted its part
    assert w.remembered(wide, resident) == (placement, [])
    assert w.remembered(wide, gone) == (placement, [(0, 1, 2)])


class Calls:
    """The loop's side of an answer: what was loaded (every replica of the placement) and published."""

    def __init__(self, started=0, version=9):
        self.loads, self.published, self.started, self.version = [], [], started, version

    def load(self, replicas):
        self.loads.append(replicas)
        return self.started  # the loads the hosts started (None: one failed)

    def publish(self, placement, hosts):
        self.published.append((placement, hosts))
        return self.version


def test_a_warm_widening_is_settled_by_widen_itself_with_the_version_it_published():
    w = Widenings(PlacementWidth(floor=1, hold_s=5.0), threading.RLock())
    placement = Placement((LayerPlacement.even(np.array([0, 1]), np.array([0, 1]), 2),), 2, 2)
    w.published([True, True], placement)
    calls, ticket = Calls(), w.ask(2, 0.0)
    assert w.answer(ticket, [True, True], np.ones((1, 2, 2), bool), calls.load, calls.publish, lambda: 0.02)
    assert calls.loads == [[(0, 0, 0), (0, 1, 1)]]  # every replica made sure of: resident ones answer at once
    assert calls.published == [(placement, [True, True])] and not w.open() and w.wait(ticket, 0.0) == 9
    assert w.as_dict()["settle_s"] == [pytest.approx(0.02)] and w.as_dict()["warm"] == 1 and w.answered == 1


def test_a_warm_wider_placement_answers_a_narrower_ask_and_the_width_holds_it():
    """A burst asks for 2 hosts, then 3: where the 2-host placement lost a replica and the 3-host one is
    whole, the first ask takes the 3-host one; where neither is whole, the 2-host one, loaded."""
    w = Widenings(PlacementWidth(floor=1, hold_s=5.0), threading.RLock())
    wide = Placement((LayerPlacement.even(np.array([0, 1, 1]), np.array([0, 1, 2]), 2),), 2, 3)
    w.published([True, True, True], wide)
    w.published([True, True, False], Placement((LayerPlacement.even(np.array([0, 1]), np.array([0, 1]), 2),), 2, 3))
    resident = np.ones((1, 2, 3), bool)
    resident[0, 1, 1] = False  # expert 1 on host 1, in both placements: neither is whole
    calls, ticket = Calls(started=1), w.ask(2, 0.0)
    assert w.answer(ticket, [True, True, True], resident, calls.load, calls.publish, lambda: 0.0)
    assert calls.published[0][1] == [True, True, False] and w.as_dict()["cold"] == 1  # neither warm: the width's own
    w2 = Widenings(PlacementWidth(floor=1, hold_s=5.0), threading.RLock())
    w2.published([True, True, True], wide)
    w2.published([True, True, False], Placement((LayerPlacement.even(np.array([0, 1]), np.array([0, 0]), 2),), 2, 3))
    resident = np.ones((1, 2, 3), bool)
    resident[0, 1, 0] = False  # the 2-host placement's expert 1 (on host 0) evicted; the 3-host one is whole
    calls, ticket = Calls(), w2.ask(2, 0.0)
    assert w2.answer(ticket, [True, True, True], resident, calls.load, calls.publish, lambda: 0.0)
    assert calls.published == [(wide, [True, True, True])] and w2.hosts(0.1) == 3 and w2.ask(3, 0.1) is None
    assert w2.as_dict()["warm"] == 1


def _cold_setup():
    """2 slots, 1 layer, 2 experts: the placement last published over both hosts, host 1's part evicted."""
    w = Widenings(PlacementWidth(floor=1, hold_s=5.0), threading.RLock())
    placement = Placement((LayerPlacement.even(np.array([0, 1, 1]), np.array([0, 0, 1]), 2),), 2, 2)
    w.published([True, True], placement)
    resident = np.zeros((1, 2, 2), bool)
    resident[:, :, 0] = True
    return w, placement, resident


def test_a_cold_widening_loads_what_the_spares_lack_then_publishes_without_a_pass():
    w, placement, resident = _cold_setup()
    clock, calls = iter([1.0, 1.25, 1.25, 1.3]), Calls(started=1, version=11)
    ticket = w.ask(2, 0.0)
    chosen = w.choose(ticket, [True, True], resident, 0.0)
    assert chosen.placement is placement and chosen.hosts == [True, True] and chosen.missing == [(0, 1, 1)]
    assert w.period(0.25) == 0.25  # no fast passes while widen loads

    def load(replicas):
        assert w.open()  # not settled before its loads are done
        return calls.load(replicas)

    assert w.answer_loaded(chosen, load, calls.publish, lambda: next(clock))
    assert calls.loads == [[(0, 0, 0), (0, 1, 0), (0, 1, 1)]] and calls.published == [(placement, [True, True])]
    assert not w.open() and w.wait(ticket, 0.0) == 11
    assert w.as_dict()["cold"] == 1 and w.as_dict()["cold_load_s"] == [pytest.approx(0.25)]
    assert w.as_dict()["settle_s"] == [pytest.approx(1.3)] and w.answered == 1


def test_a_cold_widening_whose_loads_fail_is_left_to_a_pass_and_one_a_pass_settled_publishes_nothing():
    w, placement, resident = _cold_setup()
    ticket = w.ask(2, 0.0)
    failing = Calls(started=None)
    assert not w.answer(ticket, [True, True], resident, failing.load, failing.publish, lambda: 0.5)
    assert w.open() and w.period(0.25) == FAST_PERIOD_S and not failing.published  # the passes take over, fast
    calls = Calls()

    def a_pass_settles_it_meanwhile(replicas):
        w.pass_ended(w.pass_started(), loads_pending=False, version=5, now=0.7)
        return 1

    assert w.answer(ticket, [True, True], resident, a_pass_settles_it_meanwhile, calls.publish, lambda: 0.8)
    assert not calls.published and w.wait(ticket, 0.0) == 5 and w.as_dict()["cold"] == 0


def test_a_width_never_published_over_gets_static_eps_blocks_over_its_hosts():
    w = Widenings(PlacementWidth(floor=1, hold_s=5.0), threading.RLock())
    w.published([True, False, False], Placement.static(2, 4, 1))  # ... over the floor's one host only
    resident = np.zeros((2, 4, 3), bool)
    resident[:, :, 0] = True  # slot 0 holds every expert
    calls, ticket = Calls(started=4), w.ask(3, 0.0)
    assert w.answer(ticket, [True, True, True], resident, calls.load, calls.publish, lambda: 0.0)
    placement, hosts = calls.published[0]
    assert hosts == [True, True, True] and [lp.gpu.tolist() for lp in placement.layers] == [[0, 0, 1, 2]] * 2
    assert calls.loads == [[(0, 0, 0), (0, 1, 0), (0, 2, 1), (0, 3, 2), (1, 0, 0), (1, 1, 0), (1, 2, 1), (1, 3, 2)]]
    assert w.as_dict()["cold"] == 1
    w.width.needs.clear()
    ticket = w.ask(2, 10.0)  # 2 of 3 ready: blocks over the first two ready slots
    assert w.answer(ticket, [True, False, True], resident, calls.load, calls.publish, lambda: 10.0)
    assert calls.published[1][1] == [True, False, True]
    assert [lp.gpu.tolist() for lp in calls.published[1][0].layers] == [[0, 0, 2, 2]] * 2


def test_a_widening_before_any_host_was_read_is_left_to_a_pass():
    w = Widenings(PlacementWidth(floor=1, hold_s=5.0), threading.RLock())
    calls, ticket = Calls(), w.ask(2, 0.0)
    assert not w.answer(ticket, [], np.zeros((0, 0, 0), bool), calls.load, calls.publish, lambda: 0.0)
    assert not calls.loads and w.open() and w.period(0.25) == FAST_PERIOD_S


def test_standby_placements_are_those_last_published_over_wider_hosts_that_the_hosts_hold_whole():
    w = Widenings(PlacementWidth(floor=1, hold_s=5.0), threading.RLock())
    two = Placement((LayerPlacement.even(np.array([0, 1]), np.array([0, 1]), 2),), 2, 3)
    three = Placement((LayerPlacement.even(np.array([0, 1, 1]), np.array([0, 1, 2]), 2),), 2, 3)
    w.published([True, False, False], Placement.static(1, 2, 3))
    w.published([True, True, False], two)
    w.published([True, True, True], three)
    resident = np.ones((1, 2, 3), bool)
    assert w.standby([True] * 3, resident) == {2: two, 3: three}  # one host is no widening
    resident[0, 1, 2] = False  # host 2's keep-alive evicted its part: 3 hosts would start cold
    assert w.standby([True] * 3, resident) == {2: two}
    assert w.standby([True, False, True], np.ones((1, 2, 3), bool)) == {}  # host 1 gone: other hosts, never published
    assert w.standby_changed([True] * 3, resident) == {2: two}
    assert w.standby_changed([True] * 3, resident) is None  # nothing new to publish
    w.published([True, True, False], Placement((LayerPlacement.even(np.array([0, 1]), np.array([1, 0]), 2),), 2, 3))
    assert w.standby_changed([True] * 3, resident)[2] is not two  # a pass published over 2 hosts since
    every = Widenings(PlacementWidth(floor=None), threading.RLock())  # no step scaler: every host planned over
    every.published([True] * 3, three)
    assert every.standby([True] * 3, np.ones((1, 2, 3), bool)) == {}


def test_widens_own_answers_say_where_their_seconds_went():
    w = Widenings(PlacementWidth(floor=1, hold_s=5.0), threading.RLock())
    w.published([True, True], Placement((LayerPlacement.even(np.array([0, 1]), np.array([0, 1]), 2),), 2, 2))
    clock, calls = iter([0.01, 0.02, 0.02, 0.05, 0.05, 0.06]), Calls()
    ticket = w.ask(2, 0.0)
    assert w.answer(ticket, [True, True], np.ones((1, 2, 2), bool), calls.load, calls.publish, lambda: next(clock))
    parts = w.as_dict()["answer_parts"]
    assert parts == [{"queued_s": pytest.approx(0.01), "choose_s": pytest.approx(0.01), "cold": False,
                      "load_s": pytest.approx(0.03), "publish_s": pytest.approx(0.01)}]


def test_an_answers_publish_may_run_after_it_returns_the_placement_to_run():
    """widen hands the loaded placement to the replica that asked and publishes it on a thread of its
    own: the ticket settles (and the fast passes stay off) only once that publish has run."""
    w = Widenings(PlacementWidth(floor=1, hold_s=5.0), threading.RLock())
    placement = Placement((LayerPlacement.even(np.array([0, 1]), np.array([0, 1]), 2),), 2, 2)
    w.published([True, True], placement)
    calls, submitted, ticket = Calls(version=4), [], w.ask(2, 0.0)
    got = w.answer(ticket, [True, True], np.ones((1, 2, 2), bool), calls.load, calls.publish, lambda: 0.0,
                   submit=lambda fn, *args: submitted.append((fn, args)))
    assert got is placement and calls.published == [] and w.open() and w.period(0.25) == 0.25
    fn, args = submitted.pop()
    fn(*args)
    assert calls.published == [(placement, [True, True])] and not w.open() and w.wait(ticket, 0.0) == 4
