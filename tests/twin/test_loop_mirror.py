"""The twin as the system's mirror: expert_fn's replica tables hold its replicas (twin/hosts.py), and
at cadence "loop" it plans when and as the live planning loop does (twin/loop_mirror.py)."""

from __future__ import annotations

import numpy as np
import pytest

from moeless.placement.cluster import Cluster
from moeless.placement.planner import PlannerConfig, get_planner
from moeless.placement.profile import CostProfile
from moeless.placement.types import LayerPlacement, Placement
from moeless.twin.hosts import TwinClock, TwinHosts
from moeless.twin.iterations import Iteration
from moeless.twin.twin import TwinSettings, replay

PROFILE = CostProfile(alpha=1e-6, beta=0.0, call_overhead=0.0, load_s={"disk": 1e-3, "host": 0.25},
                      expert_bytes=10**9, non_expert_bytes=0, relevel_s=0.0, source="a test")
L, E, G = 2, 4, 2
CALLS: list[int] = []


def iterations(n: int, step: float = 0.1, load=(20, 4, 4, 4)) -> list[Iteration]:
    return [Iteration("prefill", np.array([load] * L, dtype=np.int64), 1, (), i * step) for i in range(n)]


def copy_of_expert_zero(forecast, cluster, previous, config):
    """A test planner (moeless-named: its shares are paired per call): static EP plus a copy of expert
    0 on GPU 1 in every layer; it counts its calls."""
    CALLS.append(1)
    layer = LayerPlacement(np.array([0, 1, 2, 3, 0]), np.array([0, 0, 1, 1, 1]), np.array([1.0, 1, 1, 1, 0]))
    return Placement(tuple(layer for _ in range(forecast.shape[0])), forecast.shape[1], cluster.num_gpus)


def test_the_loop_plans_every_period_publishes_only_landed_copies_and_never_waits_for_a_load():
    from moeless.placement.planner import Planner

    CALLS.clear()
    its = iterations(10)
    planner = Planner("moeless-copy", copy_of_expert_zero, PlannerConfig(model=PROFILE.latency_model()))
    settings = TwinSettings(keep_alive_s=5.0, distance=0, cadence="loop", period_s=0.3, window_s=1.0)
    record = replay(planner, its, np.stack([i.load for i in its]), Cluster.uniform(G, 6, PROFILE.expert_bytes), PROFILE,
                    settings)
    # Passes at 0.0 (no report yet: the homes, no planner call), 0.3, 0.6, 0.9: three calls.
    assert len(CALLS) == 3
    # The pass at 0.3 sends one load per layer to GPU 1, 250 ms each, one after another: layer 0's
    # lands at 0.55 and is published from the iteration at 0.6, layer 1's at 0.8; until then the
    # layer runs on static EP's split (24 tokens on GPU 0).
    assert record.loads[3].tolist() == [1] * L and record.loads.sum() == L
    assert (record.exposed_s == 0).all()
    assert record.serial_s[:6, 0] == pytest.approx([24e-6] * 6)
    assert record.serial_s[6:, 0] == pytest.approx([16e-6] * 4)  # paired: 8 of expert 0's tokens on GPU 1
    assert record.planned[:, 0].tolist() == [4] * 6 + [5] * 4 and record.planned[:, 1].tolist() == [4] * 8 + [5] * 2


def test_in_the_loop_a_copy_without_tokens_expires_after_keep_alive():
    from moeless.placement.planner import Planner

    CALLS.clear()
    its = iterations(12, load=(2, 4, 4, 4))  # expert 0 too small to pair: its copy never gets a token
    planner = Planner("moeless-copy", copy_of_expert_zero, PlannerConfig(model=PROFILE.latency_model()))
    settings = TwinSettings(keep_alive_s=0.2, distance=0, cadence="loop", period_s=10.0, window_s=1.0)
    profile = CostProfile(**{**vars(PROFILE), "load_s": {"disk": 1e-3, "host": 0.05}})
    record = replay(planner, its, np.stack([i.load for i in its]), Cluster.uniform(G, 4, PROFILE.expert_bytes), profile,
                    settings)
    assert len(CALLS) == 0  # one pass, at 0.0, before any report: the homes only
    assert record.loads.sum() == 0 and record.resident[:, 0].tolist() == [4] * 12


def test_hosts_bill_what_their_tables_hold_and_evict_idle_replicas_after_keep_alive():
    clock = TwinClock(0.0)
    hosts = TwinHosts(Cluster.uniform(G, 5, 10**9), L, E, keep_alive_s=1.0, load_s=0.5, clock=clock)
    assert hosts.held().tolist() == [E] * L and hosts.gb_s() == 0.0
    done, evicted = hosts.load(0, 0, 1, issued=0.0)
    assert done == 0.5 and evicted.sum() == 0 and hosts.loading[0, 0, 1] and not hosts.resident[0, 0, 1]
    hosts.land(0.4)
    assert hosts.loading[0, 0, 1]
    hosts.land(0.5)
    assert hosts.resident[0, 0, 1] and hosts.held().tolist() == [E + 1, E]
    clock.now = 1.0
    static = np.array([[l, e, e * G // E] for l in range(L) for e in range(E)])
    hosts.release(hosts.hold(static))  # a call on each of static EP's replicas at 1.0: their last use
    clock.now = 1.4  # the copy idle since it landed at 0.5: not yet
    assert hosts.expire().sum() == 0 and hosts.resident[0, 0, 1]
    clock.now = 1.6
    assert hosts.expire().tolist() == [1, 0] and not hosts.resident[0, 0, 1] and hosts.resident[:, :, :].sum() == 8
    clock.now = 2.0
    # GB·s: static EP's 8 replicas for 2 s and the copy from its load's start (0.0) to its eviction (1.6).
    assert hosts.gb_s() == pytest.approx(8 * 2.0 + 1.6, rel=1e-9)


def test_a_load_never_evicts_a_replica_in_use():
    clock = TwinClock(0.0)
    hosts = TwinHosts(Cluster.uniform(G, 2, 10**9), 1, E, keep_alive_s=100.0, load_s=0.1, clock=clock)
    pairs = np.array([[0, 0, 0], [0, 1, 0]])
    taken = hosts.hold(pairs)  # GPU 0 is full (2 slots) and both its replicas are in use
    with pytest.raises(RuntimeError, match="full of planned replicas"):
        hosts.load(0, 2, 0, issued=0.0)
    hosts.release(taken)
    done, evicted = hosts.load(0, 2, 0, issued=0.0)  # now idle: the least recently used goes
    assert evicted.tolist() == [1]


def test_loop_cadence_of_static_ep_is_static_ep():
    its = iterations(6)
    forecasts = np.stack([i.load for i in its])
    cluster = Cluster.uniform(G, 4, PROFILE.expert_bytes)
    static = get_planner("static", PlannerConfig(model=PROFILE.latency_model()))
    both = [replay(static, its, forecasts, cluster, PROFILE, TwinSettings(cadence=c)) for c in ("iteration", "loop")]
    assert both[0].serial_s.tolist() == both[1].serial_s.tolist() and both[1].loads.sum() == 0
    with pytest.raises(ValueError, match="cadence"):
        TwinSettings(cadence="weekly")


def test_production_eplb_moves_its_weights_behind_serving_and_frees_the_old_layout():
    """Production EPLB (eplb_production.py) rebalances after `first` iterations; the twin keeps
    serving the old layout until the new one's loads land (never waited for), then frees what the
    new layout dropped at once (no keep-alive)."""
    its = iterations(12, step=0.1, load=(1, 1, 1, 30))  # expert 3: one copy in the start (SGLang's trivial layout copies 0 and 1)
    config = PlannerConfig(model=PROFILE.latency_model(), eplb_redundant=2, eplb_first_rebalance=2)
    profile = CostProfile(**{**vars(PROFILE), "load_s": {"disk": 1e-3, "host": 0.15}})
    record = replay(get_planner("eplb-production", config), its, np.stack([i.load for i in its]),
                    Cluster.uniform(G, 8, PROFILE.expert_bytes), profile, TwinSettings(keep_alive_s=60.0))
    assert (record.exposed_s == 0).all() and record.loads[:2].sum() == 0  # the first layout was pre-warmed
    assert record.loads[2].sum() > 0  # the rebalance at the third iteration sends its loads
    switched = int(np.argmax(record.serial_s[:, 0] < record.serial_s[0, 0] - 1e-12))
    assert switched > 2  # served once they landed, not before
    assert record.evictions[switched].sum() > 0 and record.evictions.sum() == record.evictions[switched].sum()
    assert (record.resident[switched:] < record.resident[switched - 1]).all()  # the old layout's dropped replicas freed at once
