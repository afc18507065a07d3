"""What the planning loop reads of its hosts (controller/planning/host_view.py): their states and
memory, how long each idle replica's keep-alive lasts, the figures it keeps per slot across passes."""

import math

import pytest

from moeless.controller.planning.host_view import HostFigures, HostView

from controller_support import E, L, homes, status


def test_host_view_reads_states_and_dead_hosts():
    view = HostView.from_status([status(homes(0) + [(1, 3, "loading"), (0, 2, "evicted")]), None], L, E)
    assert view.live.tolist() == [True, False] and view.memory.tolist() == [1_000_000, 0]
    assert view.resident[:, :, 0].sum() == 4 and view.resident[1, 0, 0] and not view.resident[0, 2, 0]
    assert view.loading[1, 3, 0] and not view.resident[:, :, 1].any()
    draining = HostView.from_status([status(homes(0)), status(homes(1), health="draining")], L, E)
    assert draining.live.tolist() == [True, False]


def test_host_view_says_how_long_each_resident_replica_lasts():
    idle = status([(0, 0, "idle"), (0, 1, "warm"), (1, 2, "loading")]) | {"keep_alive_s": 5.0}
    idle["replicas"][0]["idle_s"] = 4.0
    view = HostView.from_status([idle, None], L, E)
    assert view.keep_left[0, 0, 0] == pytest.approx(1.0) and view.keep_left[0, 1, 0] == math.inf
    assert view.lasting(0.5)[0, :2, 0].tolist() == [True, True]
    assert view.lasting(1.5)[0, :2, 0].tolist() == [False, True]  # its keep-alive runs out sooner
    assert view.lasting(1.5).sum() == 1 and not view.lasting(0.0)[1, 2, 0]  # loading: not resident
    assert HostView(view.resident, view.loading, view.live, view.memory).lasting(99.0).sum() == 2  # not read: resident
    idle["replicas"][0]["kept"] = True  # its host keeps it past its keep-alive (a keep-warm set, family warmth)
    assert HostView.from_status([idle, None], L, E).lasting(99.0)[0, :2, 0].tolist() == [True, True]


def test_host_figures_keep_each_slots_memory_and_add_up_gb_s_across_host_restarts():
    figures = HostFigures(2)
    first = [status(homes(0)) | {"meters": {"gb_s": 3.0, "cold_starts": 2}}, None]
    figures.update(first, HostView.from_status(first, L, E))
    assert figures.memory.tolist() == [1_000_000, 0] and figures.meters == [{"gb_s": 3.0, "cold_starts": 2}, {}]
    later = [None, status(homes(1), memory=500) | {"meters": {"gb_s": 1.0, "cold_starts": 1}}]
    figures.update(later, HostView.from_status(later, L, E))  # host 0 silent: its memory as last seen
    assert figures.memory.tolist() == [1_000_000, 500]
    restarted = [status([]) | {"meters": {"gb_s": 0.5}}, later[1] | {"meters": {"gb_s": 4.0}}]
    figures.update(restarted, HostView.from_status(restarted, L, E))
    assert figures.totals()["expert_gb_s"] == pytest.approx(3.0 + 0.5 + 4.0)  # a restart counts from 0 again
    assert figures.totals()["cold_starts"] == 0 and not figures.resize(2)
    assert figures.resize(3) and figures.memory.tolist() == [1_000_000, 500, 0] and figures.meters[2] == {}
    assert figures.resize(1) and figures.totals()["expert_gb_s"] == pytest.approx(7.5)  # a slot gone keeps its part
