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
    meters.invoked([((0, 0), 3, 0), ((0, 1), 5, 0)])
    meters.invoked([((0, 1), 2, 0)])
    m = meters.replicas
    assert m[(0, 0)].last_load_s == pytest.approx(0.25) and m[(0, 0)].load_failures == 1
    assert (m[(0, 1)].invocations, m[(0, 1)].tokens) == (2, 7)
    totals = meters.totals()
    assert (totals.invocations, totals.tokens, totals.cold_starts, totals.load_failures) == (2, 10, 1, 1)
    assert totals.gb_s == pytest.approx(10 * 0.25 / 1e9)


def test_a_shared_replica_s_gb_s_is_split_evenly_among_the_models_keeping_it_resident(clock):
    """The golden example of meters.py's rule: 1 GB loaded by A at t=0, used by A at 1 and by B at 2,
    keep-alive 10, read at t=20: A pays alone [0, 2) (loader, then its claim), A and B share [2, 11),
    B alone [11, 12) (A's claim ran out) and [12, 20) (nobody's claim: the last user)."""
    meters = Meters(clock, keep_alive_s=10.0, users=lambda key: (0, 1))  # a content key both models hold
    start = clock()
    meters.hold((0, 0), 10**9, model=0)
    clock.advance(1.0)
    meters.invoked([((0, 0), 3, 0)])
    clock.advance(1.0)
    meters.invoked([((0, 0), 5, 1)])
    clock.advance(5.0)
    mid = meters.by_model(["a", "b"], lambda layer: 0)  # a read in between changes nothing
    assert mid["a"].gb_s == pytest.approx(1 + 1 + 2.5) and mid["b"].gb_s == pytest.approx(2.5)
    assert mid["a"].bytes_held + mid["b"].bytes_held == 10**9  # both claim it now: half each
    clock.advance(13.0)
    assert clock() - start == 20.0
    parts = meters.by_model(["a", "b"], lambda layer: 0)
    assert parts["a"].gb_s == pytest.approx(6.5) and parts["b"].gb_s == pytest.approx(13.5)
    assert parts["a"].gb_s + parts["b"].gb_s == pytest.approx(meters.totals().gb_s) == pytest.approx(20.0)
    assert (parts["a"].bytes_held, parts["b"].bytes_held) == (0, 10**9)  # the last user's now
    assert (parts["a"].tokens, parts["b"].tokens, parts["a"].loads, parts["b"].loads) == (3, 5, 0, 0)
    assert (parts["a"].shared_replicas, parts["b"].shared_replicas, parts["a"].shared_bytes) == (1, 1, 10**9)
    # A content key both models hold: all of each one's GB·s of it is its shared share (kubectl's Shared-GBs).
    assert (parts["a"].shared_gb_s, parts["b"].shared_gb_s) == (pytest.approx(6.5), pytest.approx(13.5))
    assert meters.totals().shared_replicas == 1
    assert meters.needed_by((0, 0)) == []  # both claims ran out
    meters.free((0, 0))  # evicted: nothing more for anyone
    clock.advance(100.0)
    assert meters.by_model(["a", "b"], lambda layer: 0)["b"].gb_s == pytest.approx(13.5)


def test_a_model_added_later_shares_a_replica_from_then_on(clock):
    """1 GB of model a's alone for 10 s; then model b, whose store holds the same content key, is added
    (users_changed) and both use it: only the GB·s from then on are shared, the first 10 stay a's own."""
    users = {(0, 0): (0,)}
    meters = Meters(clock, keep_alive_s=100.0, users=lambda key: users[key])
    meters.hold((0, 0), 10**9, model=0)
    meters.invoked([((0, 0), 1, 0)])
    clock.advance(10.0)
    users[(0, 0)] = (0, 1)
    meters.users_changed()
    meters.invoked([((0, 0), 1, 1)])
    clock.advance(10.0)
    parts = meters.by_model(["a", "b"], lambda layer: 0)
    assert (parts["a"].gb_s, parts["b"].gb_s) == (pytest.approx(15.0), pytest.approx(5.0))
    assert (parts["a"].shared_gb_s, parts["b"].shared_gb_s) == (pytest.approx(5.0), pytest.approx(5.0))


def _by_sampling(uses: list[tuple[float, int]], start: float, end: float, keep_alive: float, loader: int,
                 gb: float, dt: float = 1e-3) -> dict[int, float]:
    """The rule, integrated by brute force: at each instant, who claims (used within the keep-alive before
    it), else who used it last, else the loader; evenly."""
    out: dict[int, float] = {}
    t = start + dt / 2
    while t < end:
        last = {}
        for when, model in uses:
            if when <= t:
                last[model] = when
        payers = [m for m, when in last.items() if when + keep_alive > t]
        if not payers:
            latest = max(last.values(), default=None)
            payers = [m for m, when in last.items() if when == latest] or [loader]
        for m in payers:
            out[m] = out.get(m, 0.0) + gb * dt / len(payers)
        t += dt
    return out


@pytest.mark.parametrize("reads", [0, 1, 7])
def test_the_split_follows_the_rule_whenever_it_is_read(clock, reads):
    meters = Meters(clock, keep_alive_s=3.0)
    start = clock()
    meters.hold((0, 0), 4 * 10**9, model=2)
    uses = []
    for step, model in enumerate([0, 1, 1, 0, 2, 2, 1]):
        clock.advance(0.5 * (step + 1))
        meters.invoked([((0, 0), 1, model)])
        uses.append((clock(), model))
        for _ in range(reads if step % 2 else 0):
            meters.by_model(["a", "b", "c"], lambda layer: 0)
    clock.advance(9.0)
    parts = meters.by_model(["a", "b", "c"], lambda layer: 0)
    assert sum(p.gb_s for p in parts.values()) == pytest.approx(meters.totals().gb_s)
    expected = _by_sampling(uses, start, clock(), 3.0, loader=2, gb=4.0)
    for i, name in enumerate("abc"):
        assert parts[name].gb_s == pytest.approx(expected.get(i, 0.0), abs=0.01)
