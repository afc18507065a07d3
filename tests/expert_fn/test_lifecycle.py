"""Replica lifecycle on a fake clock: states, keep-alive, memory room, loading never evicted."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeless.expert_fn.errors import HostMemoryFull
from moeless.expert_fn.host.lifecycle import ReplicaState as S
from moeless.expert_fn.host.lifecycle import ReplicaTable
from moeless.expert_fn.host.meters import Meters

from expert_fn_support import FakeClock


def table(clock, capacity: int = 1000, keep_alive_s: float = 10.0) -> ReplicaTable:
    return ReplicaTable(capacity, keep_alive_s, clock, Meters(clock))


def loaded(t: ReplicaTable, key, nbytes: int = 100) -> None:
    t.begin_load(key, nbytes)
    t.finish_load(key)


def test_states_through_a_life(clock):
    t = table(clock)
    key = (0, 1)
    assert t.state(key) is S.COLD and t.needs_load(key)
    t.begin_load(key, 100)
    assert t.state(key) is S.LOADING and t.bytes_held == 100 and not t.needs_load(key)
    t.finish_load(key)
    assert t.state(key) is S.IDLE
    t.acquire(key)
    t.acquire(key)
    assert t.state(key) is S.WARM
    t.release(key)
    assert t.state(key) is S.WARM  # one call still in flight
    t.release(key)
    assert t.state(key) is S.IDLE
    assert t.evict(key) and t.state(key) is S.EVICTED and t.bytes_held == 0
    assert t.needs_load(key)


def test_idle_replica_is_evicted_after_keep_alive_since_last_use(clock):
    t = table(clock, keep_alive_s=10.0)
    loaded(t, (0, 0))
    clock.advance(6)
    t.acquire((0, 0))
    t.release((0, 0))  # last use at +6
    clock.advance(9.9)
    assert t.expire() == [] and t.state((0, 0)) is S.IDLE
    clock.advance(0.1)
    assert t.expire() == [(0, 0)] and t.state((0, 0)) is S.EVICTED


def test_a_touch_starts_an_idle_replicas_keep_alive_over_and_idle_s_counts_from_it(clock):
    t = table(clock, keep_alive_s=10.0)
    loaded(t, (0, 0))
    clock.advance(8)
    assert t.idle_s(t.replicas()[(0, 0)], clock()) == pytest.approx(8)
    t.touch((0, 0))  # a load that found it resident
    assert t.idle_s(t.replicas()[(0, 0)], clock()) == 0
    clock.advance(9.9)
    assert t.expire() == [] and t.state((0, 0)) is S.IDLE  # 17.9 s after its load
    clock.advance(0.1)
    assert t.expire() == [(0, 0)]
    t.touch((0, 0))  # evicted, cold, loading or warm: nothing to start over
    t.touch((5, 5))
    assert t.state((0, 0)) is S.EVICTED and t.state((5, 5)) is S.COLD
    loaded(t, (0, 1))
    t.acquire((0, 1))
    assert t.idle_s(t.replicas()[(0, 1)], clock() + 50) == 0  # a replica computing is not idle


def test_warm_replica_does_not_expire_while_busy(clock):
    t = table(clock, keep_alive_s=1.0)
    loaded(t, (0, 0))
    t.acquire((0, 0))
    clock.advance(100)
    assert t.expire() == [] and t.state((0, 0)) is S.WARM


def test_loading_replica_is_never_evicted(clock):
    t = table(clock, capacity=200, keep_alive_s=0.0)
    t.begin_load((0, 0), 100)
    clock.advance(1000)
    assert t.expire() == []
    assert t.evict((0, 0)) is False
    t.begin_load((0, 1), 100)  # fills memory; (0, 0) still loading
    with pytest.raises(HostMemoryFull, match="loading or busy"):
        t.begin_load((0, 2), 100)
    assert t.state((0, 0)) is S.LOADING and t.state((0, 2)) is S.COLD and t.bytes_held == 200


def test_room_is_made_from_least_recently_used_idle_replicas(clock):
    t = table(clock, capacity=300)
    for e in range(3):
        loaded(t, (0, e))
        clock.advance(1)
    t.acquire((0, 0))
    t.release((0, 0))  # (0, 0) now the most recent; (0, 1) the least
    assert t.begin_load((1, 0), 150) == [(0, 1), (0, 2)]
    assert t.state((0, 0)) is S.IDLE and t.bytes_held == 250


def test_evicting_a_warm_replica_waits_for_its_calls(clock):
    t = table(clock)
    loaded(t, (0, 0))
    t.acquire((0, 0))
    assert t.evict((0, 0)) is False and t.state((0, 0)) is S.WARM
    assert t.release((0, 0)) == [(0, 0)] and t.state((0, 0)) is S.EVICTED


def test_failed_load_returns_to_cold_with_the_error_and_frees_memory(clock):
    t = table(clock)
    t.begin_load((0, 0), 100)
    t.finish_load((0, 0), error="/x/l000_e000.safetensors: checksum mismatch")
    assert t.state((0, 0)) is S.COLD and t.bytes_held == 0
    assert "checksum" in t.replicas()[(0, 0)].error
    assert t.needs_load((0, 0))


def test_misuse_is_refused_with_the_state(clock):
    t = table(clock)
    with pytest.raises(ValueError, match="cold, not resident"):
        t.acquire((0, 0))
    t.begin_load((0, 0), 100)
    with pytest.raises(ValueError, match="loading"):
        t.begin_load((0, 0), 100)
    with pytest.raises(ValueError, match="capacity_bytes"):
        table(clock, capacity=0)


OPS = st.lists(
    st.tuples(st.sampled_from(["load", "finish", "fail", "acquire", "release", "evict", "expire", "tick"]),
              st.integers(0, 3), st.integers(50, 400)),
    max_size=60,
)


def apply(t: ReplicaTable, clock: FakeClock, op: str, key, nbytes: int) -> None:
    if op == "load":
        t.begin_load(key, nbytes)
    elif op in ("finish", "fail"):
        t.finish_load(key, error=None if op == "finish" else "bad file")
    elif op == "acquire":
        t.acquire(key)
    elif op == "release":
        t.release(key)
    elif op == "evict":
        t.evict(key)
    elif op == "expire":
        t.expire()
    else:
        clock.advance(nbytes / 100)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_invariants_hold_under_any_sequence_of_operations(ops):
    """Memory never exceeds capacity and always equals what loading/resident replicas hold;
    a loading replica is never evicted; GB·s never decreases."""
    clock = FakeClock()
    meters = Meters(clock)
    t = ReplicaTable(1000, keep_alive_s=3.0, clock=clock, meters=meters)
    last_gb_s = 0.0
    for op, e, nbytes in ops:
        key = (0, e)
        before = t.state(key)
        loading_before = {k for k, r in t.replicas().items() if r.state is S.LOADING}
        try:
            apply(t, clock, op, key, nbytes)
        except (ValueError, HostMemoryFull):
            assert t.state(key) is before  # a refused operation changes nothing
        replicas = t.replicas()
        held = sum(r.bytes for r in replicas.values() if r.state in (S.LOADING, S.WARM, S.IDLE))
        assert t.bytes_held == held <= t.capacity_bytes
        assert all(r.bytes == 0 for r in replicas.values() if r.state in (S.COLD, S.EVICTED))
        assert all(r.busy > 0 for r in replicas.values() if r.state is S.WARM)
        if op not in ("finish", "fail"):
            assert all(replicas[k].state is S.LOADING for k in loading_before)
        assert meters.totals().bytes_held == held
        gb_s = meters.totals().gb_s
        assert gb_s >= last_gb_s - 1e-18
        last_gb_s = gb_s
