"""Who yields memory on a host shared by models (expert_fn/host/shares.py): the module's golden example,
and a property: one model's eviction storm never takes another active model's guaranteed share."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from hypothesis import given, settings, strategies as st

from moeless.expert_fn.errors import HostMemoryFull
from moeless.expert_fn.host.lifecycle import ReplicaTable
from moeless.expert_fn.host.meters import Meters
from moeless.expert_fn.host.shares import Candidate, Shares, pick_victims, saving_per_gb_s, warm_set

from expert_fn_support import random_store


def test_the_golden_example():
    shares = Shares((0, 2), (2, 2), 60.0)
    held = [Candidate((0, 0), 1, True, 1.0), Candidate((1, 0), 1, True, 2.0), Candidate((2, 0), 1, True, 3.0),
            Candidate((3, 0), 1, True, 4.0), Candidate((2, 1), 1, True, 5.0)]
    assert pick_victims(held, shares, (0, 1), free=0, need=1, now=6.0) == [(2, 0)]
    # B down to its share: A's own least recently used replica goes next, never B's
    assert pick_victims(held, shares, (0, 1), free=0, need=2, now=6.0) == [(2, 0), (0, 0)]
    assert pick_victims(held, shares, (0, 1), free=0, need=3, now=6.0) == [(2, 0), (0, 0), (1, 0)]  # its own share too
    assert pick_victims(held, shares, (0, 1), free=0, need=4, now=6.0) is None  # but never B's
    # a sleeping B (nothing used for active_s) keeps no guarantee
    assert pick_victims(held, shares, (0, 1), free=0, need=3, now=100.0) == [(2, 0), (3, 0), (2, 1)]
    # without shares: least recently used, whoever owns it
    assert pick_victims(held, Shares((0,), (0,), 0.0), (0, 1), free=0, need=2, now=6.0) == [(0, 0), (1, 0)]
    # with load times, the least saving per GB·s: (1,0) reloads in 1 s, (0,0) in 4 s (per byte alike)
    timed = [replace(c, reload_s={(0, 0): 4.0, (1, 0): 1.0}.get(c.key, 0.0)) for c in held]
    assert pick_victims(timed, shares, (0, 1), free=0, need=3, now=6.0) == [(2, 0), (1, 0), (0, 0)]
    assert saving_per_gb_s(timed[0], 6.0) == pytest.approx(0.8e9) and saving_per_gb_s(timed[1], 6.0) == pytest.approx(0.25e9)


def test_the_model_whose_replicas_reload_slower_keeps_them_longer():
    """Models A, B and C without shares, replicas of 1 byte on a host of 3: A's loads took 1 s each, B's
    5 s. At t=20 C loads: B's replica, idle 15 s, saves 5/15 s per byte-second, A's (0,0) idle 13 s
    1/13 and (0,1) idle 11 s 1/11: A's (0,0) yields, though used later than B's (LRU would take B's)."""
    now = [0.0]
    clock = lambda: now[0]
    table = ReplicaTable(3, keep_alive_s=1e9, clock=clock, meters=Meters(clock), shares=Shares((0, 2, 4), (0, 0, 0), 1e9))
    for key, start, took in (((2, 0), 0.0, 5.0), ((0, 0), 6.0, 1.0), ((0, 1), 8.0, 1.0)):
        now[0] = start
        table.begin_load(key, 1)
        now[0] = start + took
        table.finish_load(key)
    now[0] = 20.0
    assert table.begin_load((4, 0), 1) == [(0, 0)]  # B's (2,0), idle longest, stays: its reload costs 5x


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


@settings(max_examples=150, deadline=None)
@given(b_keys=st.integers(1, 6), share=st.integers(0, 6), storm=st.lists(st.tuples(st.integers(0, 1), st.integers(0, 7)),
                                                                        min_size=1, max_size=40))
def test_an_eviction_storm_never_takes_another_active_model_s_share(b_keys, share, storm):
    """Model A (layers 0-1) loads and uses replicas at will; model B (layers 2-3) loaded b_keys replicas
    and keeps using them: B never holds less than min(its share, what it loaded)."""
    clock = _Clock()
    table = ReplicaTable(8, keep_alive_s=1e9, clock=clock, meters=Meters(clock),
                         shares=Shares((0, 2), (0, share), active_s=1e9))
    b_loaded = [(2 + i % 2, i // 2) for i in range(b_keys)]
    for key in b_loaded:
        table.begin_load(key, 1)
        table.finish_load(key)
    for key in storm:
        if table.needs_load(key):
            try:
                table.begin_load(key, 1)
            except HostMemoryFull:
                continue
            table.finish_load(key)
        table.acquire(key)
        table.release(key)
        b_held = sum(r.bytes for k, r in table.replicas().items() if k[0] >= 2)
        assert b_held >= min(share, b_keys)
        assert table.bytes_held <= 8


def test_a_shared_replica_counts_in_every_user_s_share_and_no_other_load_takes_it():
    """(0, 0) is A's and B's (one content key), filed under A's layers; B also holds its own (2, 1) and
    is guaranteed 2 bytes. A's loads evict A's own (0, 1), never the replica B's share protects, though
    it is A's too; once B sleeps, it may go."""
    shares = Shares((0, 2), (0, 2), 60.0, users={(0, 0): (0, 1)})
    held = [Candidate((0, 0), 1, True, 1.0, used_by=((1, 1.0),)), Candidate((2, 1), 1, True, 2.0),
            Candidate((0, 1), 1, True, 3.0)]
    assert shares.models_of((0, 0)) == (0, 1) and shares.models_of((0, 1)) == (0,)
    assert pick_victims(held, shares, (1, 0), free=0, need=1, now=5.0) == [(0, 1)]
    assert pick_victims(held, shares, (1, 0), free=0, need=2, now=5.0) is None
    assert pick_victims(held, shares, (1, 0), free=0, need=2, now=100.0) == [(2, 1), (0, 0)]
    # B's own load may take the shared replica: it is B's own, and A has no share
    assert pick_victims(held, shares, (3, 0), free=0, need=1, now=5.0, mine=1) == [(0, 1)]
    assert pick_victims(held, shares, (3, 0), free=0, need=3, now=5.0, mine=1) == [(0, 1), (0, 0), (2, 1)]


@settings(max_examples=100, deadline=None)
@given(shared=st.integers(1, 4), share=st.integers(0, 5), storm=st.lists(st.integers(0, 7), min_size=1, max_size=40))
def test_an_eviction_storm_never_takes_a_replica_another_model_s_share_needs_shared_or_not(shared, share, storm):
    """B uses `shared` of A's replicas (one content key each, filed under A's layers 0-1) and two of its
    own; A loads and uses replicas at will: B never holds less than min(its share, what it uses)."""
    clock = _Clock()
    b_shared = [(0, e) for e in range(shared)]
    table = ReplicaTable(6, keep_alive_s=1e9, clock=clock, meters=Meters(clock),
                         shares=Shares((0, 2), (0, share), active_s=1e9, users={k: (0, 1) for k in b_shared}))
    b_uses = b_shared + [(2, 0), (3, 0)]
    for key in b_uses:
        table.begin_load(key, 1, model=1)
        table.finish_load(key)
    for i in storm:
        key = (i % 2, i // 2)
        if table.needs_load(key):
            try:
                table.begin_load(key, 1, model=0)
            except HostMemoryFull:
                continue
            table.finish_load(key)
        table.acquire(key)
        table.release(key)
        b_held = sum(r.bytes for k, r in table.replicas().items() if k in b_uses)
        assert b_held >= min(share, len(b_uses))
        assert table.bytes_held <= 6


def test_a_host_with_shares_keeps_a_quiet_model_s_replicas_and_refuses_shares_it_cannot_hold(tmp_path):
    a, b = random_store(tmp_path / "a", 2, 4, 16, 8), random_store(tmp_path / "b", 2, 4, 16, 8)
    run = subprocess.run([sys.executable, "-m", "moeless.cli", "expert-host", "--store", f"a={a.root}",
                          "--store", f"b={b.root}", "--memory-gb", "0.001", "--share", "a=0.0009", "--share", "b=0.0009"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--share: the shares add up to 0.002 GB, more than the host's 0.001 GB" in run.stderr
    run = subprocess.run([sys.executable, "-m", "moeless.cli", "expert-host", "--store", f"a={a.root}",
                          "--share", "c=1"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--share c: this host serves no such model" in run.stderr


def test_warm_set_keeps_each_model_s_hottest_replicas_up_to_its_bytes():
    shares = Shares((0, 2), (0, 0), 60.0, warm=(2, 0))
    held = [((0, 0), 1, 50), ((0, 1), 1, 10), ((1, 0), 1, 90), ((1, 1), 2, 99), ((2, 0), 1, 500)]
    # A's hottest is (1, 1) but 2 bytes fill its warm set alone; B keeps nothing warm.
    assert warm_set(held, shares) == {(1, 1)}
    assert warm_set(held, Shares((0, 2), (0, 0), 60.0, warm=(3, 0))) == {(1, 1), (1, 0)}
    assert warm_set(held, Shares((0, 2), (0, 0), 60.0)) == set()


def test_the_keep_alive_leaves_a_model_s_keep_warm_set_and_a_load_may_still_evict_it():
    clock = _Clock()
    meters = Meters(clock)
    table = ReplicaTable(4, keep_alive_s=10.0, clock=clock, meters=meters,
                         shares=Shares((0, 2), (0, 0), active_s=1e9, warm=(1, 0)))
    for key, tokens in (((0, 0), 5), ((0, 1), 50), ((2, 0), 80)):
        table.begin_load(key, 1)
        table.finish_load(key)
        table.acquire(key)
        meters.invoked([(key, tokens, key[0] // 2)])
        table.release(key)
    clock.t += 100.0
    assert table.kept() == {(0, 1)} and table.kept(lambda key: key == (2, 0)) == {(0, 1), (2, 0)}  # + family warmth
    assert table.kept(among=[(0, 0), (2, 0)]) == set()
    assert sorted(table.expire()) == [(0, 0), (2, 0)]  # A's hottest (0, 1) stays; B keeps nothing warm
    assert [k for k, r in table.replicas().items() if r.bytes] == [(0, 1)]
    for key in ((2, 1), (3, 0), (3, 1)):  # B fills the host: A's warm replica is not guaranteed
        table.begin_load(key, 1)
        table.finish_load(key)
    table.begin_load((2, 2), 1)
    assert table.state((0, 1)).value == "evicted"


def test_a_bad_keep_warm_flag_is_one_clear_line(tmp_path):
    a = random_store(tmp_path / "a", 2, 4, 16, 8)
    for flag, says in (("a=lots", "--keep-warm 'a=lots': expected NAME=GB"), ("c=1", "--keep-warm c: this host serves no such model"),
                       ("a=0.002", "--keep-warm: the keep-warm sets add up to 0.002 GB, more than the host's 0.001 GB")):
        run = subprocess.run([sys.executable, "-m", "moeless.cli", "expert-host", "--store", f"a={a.root}",
                              "--memory-gb", "0.001", "--keep-warm", flag], capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and says in run.stderr, run.stderr
