"""GB·s and counters on a fake clock, through the replica table that drives them."""

from __future__ import annotations

import pytest

from moeless.expert_fn.host.lifecycle import ReplicaTable
from moeless.expert_fn.host.meters import Meters


def test_gb_seconds_integrate_bytes_held_from_load_start_to_eviction(clock):
    meters = Meters(clock)
    t = ReplicaTable(10**10, keep_alive_s=5.0, clock=clock, meters=meters)
    t.begin_load((0, 0), 2 * 10**9)  # 2 GB
    clock.advance(1.0)
    t.finish_load((0, 0))
    t.begin_load((0, 1), 10**9)  # 1 GB
    clock.advance(3.0)
    assert meters.gb_s((0, 0)) == pytest.approx(8.0)  # still held: the open interval counts
    assert t.evict((0, 0))
    clock.advance(10.0)  # (0, 0) holds nothing now; (0, 1) is loading, still billed
    assert meters.gb_s((0, 0)) == pytest.approx(8.0)
    assert meters.gb_s((0, 1)) == pytest.approx(13.0)
    totals = meters.totals()
    assert totals.gb_s == pytest.approx(21.0)
    assert totals.bytes_held == 10**9 and totals.evictions == 1 and totals.loads == 1


def test_reloading_adds_a_new_interval(clock):
    meters = Meters(clock)
    t = ReplicaTable(10**10, keep_alive_s=2.0, clock=clock, meters=meters)
    for _ in range(2):
        t.begin_load((0, 0), 10**9)
        t.finish_load((0, 0))
        clock.advance(2.0)
        assert t.expire() == [(0, 0)]
        clock.advance(50.0)  # evicted: not billed
    assert meters.gb_s((0, 0)) == pytest.approx(4.0)
    assert meters.replicas[(0, 0)].loads == 2 and meters.replicas[(0, 0)].evictions == 2


def test_load_time_failures_cold_starts_and_tokens(clock):
    meters = Meters(clock)
    t = ReplicaTable(10**10, keep_alive_s=2.0, clock=clock, meters=meters)
    t.begin_load((0, 0), 10)
    clock.advance(0.25)
    t.finish_load((0, 0), error="bad file")
    meters.cold_start((0, 1))
    meters.invoked(0, {0: 3, 1: 5})
    meters.invoked(0, {1: 2})
    m = meters.replicas
    assert m[(0, 0)].last_load_s == pytest.approx(0.25) and m[(0, 0)].load_failures == 1
    assert (m[(0, 1)].invocations, m[(0, 1)].tokens) == (2, 7)
    totals = meters.totals()
    assert (totals.invocations, totals.tokens, totals.cold_starts, totals.load_failures) == (2, 10, 1, 1)
    assert totals.gb_s == pytest.approx(10 * 0.25 / 1e9)
