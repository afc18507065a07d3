"""The host memory tier and prefetch accounting of the expert host runtime (no gRPC).

A file is verified once, when it enters the host tier; a cold start is then a copy from host
memory. A load already running is never started twice, a warm replica is reused at zero cold
starts, and per layer the meters split cold-start time into hidden (prefetched) and exposed.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from moeless.expert_fn.errors import ReplicaLoadError
from moeless.expert_fn.host.metrics import registry_for
from moeless.expert_fn.host.runtime import ExpertHostRuntime
from moeless.expert_fn.stores.tiers import HostTier, TierConfig
from moeless.model.experts import expert_forward

from expert_fn_support import CORRUPT, HIDDEN, corrupt, random_store


class GatedStore:
    """A weight store whose loads are counted and, while `gate` is clear, wait for it."""

    def __init__(self, store) -> None:
        self._store = store
        self.reads: list[tuple[int, int]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def __getattr__(self, name):
        return getattr(self._store, name)

    def load(self, layer: int, expert: int, verify: bool = True):
        self.reads.append((layer, expert))
        self.entered.set()
        assert self.gate.wait(10), "test never opened the gate"
        return self._store.load(layer, expert, verify)


def wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


@pytest.fixture
def gated(store) -> GatedStore:
    return GatedStore(store)


def runtime_for(store, clock=time.monotonic, **tier) -> ExpertHostRuntime:
    return ExpertHostRuntime(store, capacity_bytes=10**8, keep_alive_s=30.0, clock=clock, tier=TierConfig(**tier))


def test_a_bad_checksum_is_refused_on_entering_the_host_tier_while_the_host_serves_others(store):
    rt = runtime_for(store, prewarm="all")
    try:
        wait_until(lambda: rt.status()["host_tier"]["entries"] + rt.status()["host_tier"]["read_failures"] == 8)
        tier = rt.status()["host_tier"]
        assert (tier["entries"], tier["read_failures"]) == (7, 1)  # every file but the corrupt one entered
        assert not rt.tier.contains(CORRUPT)
        x = torch.randn(3, HIDDEN)
        with pytest.raises(ReplicaLoadError, match="checksum mismatch"):
            rt.invoke(CORRUPT[0], {0: x, CORRUPT[1]: x})
        out = rt.invoke(CORRUPT[0], {0: x, 1: x})  # the host keeps serving the others
        torch.testing.assert_close(out.outputs[1], expert_forward(store.load(CORRUPT[0], 1), x), rtol=1e-5, atol=1e-6)
        with pytest.raises(ReplicaLoadError, match="checksum mismatch"):  # refused again: failures are never kept
            rt.load(*CORRUPT, wait=True)
        assert rt.status()["host_tier"]["read_failures"] == 3
    finally:
        rt.close()


def test_a_running_load_is_never_started_twice(gated):
    rt = runtime_for(gated)
    try:
        gated.gate.clear()
        assert rt.load(0, 2) == (rt.table.state((0, 2)), True)  # a prefetch starts the load
        assert gated.entered.wait(5)
        assert rt.load(0, 2)[1] is False  # running: not started again
        result: dict = {}
        threads = [threading.Thread(target=lambda i=i: result.setdefault(i, rt.invoke(0, {2: torch.randn(2, HIDDEN)})))
                   for i in range(3)]
        for t in threads:
            t.start()
        wait_until(lambda: rt.status()["inflight"] == 3)
        gated.gate.set()
        for t in threads:
            t.join(10)
        assert gated.reads == [(0, 2)]  # one read of the file for four callers
        assert [result[i].cold_starts for i in range(3)] == [1, 1, 1]  # each waited for the one load
        assert rt.status()["meters"]["loads"] == 1
    finally:
        gated.gate.set()
        rt.close()


def test_the_host_tier_shares_one_read_between_concurrent_gets(gated):
    tier = HostTier(gated)
    gated.gate.clear()
    got = []
    threads = [threading.Thread(target=lambda: got.append(tier.get((1, 0)))) for _ in range(4)]
    for t in threads:
        t.start()
    assert gated.entered.wait(5)
    wait_until(lambda: tier.stats()["shared_reads"] == 3)
    gated.gate.set()
    for t in threads:
        t.join(10)
    assert gated.reads == [(1, 0)] and len(got) == 4
    assert all(w is got[0][0] for w, _ in got)


def test_a_warm_replica_is_reused_at_zero_cold_starts_and_a_reload_copies_from_host_memory(gated, tmp_path):
    rt = runtime_for(gated)
    try:
        x = {0: torch.randn(4, HIDDEN)}
        assert rt.invoke(1, x).cold_starts == 1
        for _ in range(3):
            assert rt.invoke(1, x).cold_starts == 0  # warm: no load, no wait
        status = rt.status()
        assert (status["meters"]["loads"], status["meters"]["cold_starts"], status["cold"]["copies"]) == (1, 1, 1)
        assert rt.evict(1, 0)[0]
        again = rt.invoke(1, x)  # a cold start again, served from host memory: no second read of the file
        assert again.cold_starts == 1 and gated.reads == [(1, 0)]
        tier = rt.status()["host_tier"]
        assert (tier["hits"], tier["misses"], rt.status()["cold"]["copies"]) == (1, 1, 2)
        torch.testing.assert_close(again.outputs[0], expert_forward(gated.load(1, 0), x[0]), rtol=1e-5, atol=1e-6)
    finally:
        rt.close()


def test_a_file_is_verified_once_when_it_enters_the_tier(tmp_path):
    store = random_store(tmp_path, 1, 2, HIDDEN, 8)
    rt = runtime_for(store)
    try:
        x = {0: torch.randn(2, HIDDEN)}
        before = rt.invoke(0, x).outputs[0]
        corrupt(store, 0, 0)  # damaged after it entered: host memory still holds the verified bytes
        rt.evict(0, 0)
        torch.testing.assert_close(rt.invoke(0, x).outputs[0], before)
        off = runtime_for(store, capacity_bytes=0)  # tier off: every load reads and verifies the file
        try:
            with pytest.raises(ReplicaLoadError, match="checksum mismatch"):
                off.invoke(0, x)
        finally:
            off.close()
    finally:
        rt.close()


def test_prefetch_hides_cold_start_time_and_the_rest_is_exposed_per_layer(gated, clock):
    rt = runtime_for(gated, clock=clock)
    try:
        # 1. Loaded ahead and resident before the call: all 2 s hidden.
        gated.gate.clear()
        rt.load(0, 0)
        assert gated.entered.wait(5)
        clock.advance(2.0)
        gated.gate.set()
        wait_until(lambda: rt.table.state((0, 0)).value == "idle")
        assert rt.invoke(0, {0: torch.randn(1, HIDDEN)}).cold_starts == 0
        # 2. Loaded ahead, still loading when the call comes: 3 s hidden, 1 s waited.
        gated.gate.clear()
        gated.entered.clear()
        rt.load(1, 1)
        assert gated.entered.wait(5)
        clock.advance(3.0)
        call = threading.Thread(target=rt.invoke, args=(1, {1: torch.randn(1, HIDDEN)}))
        call.start()
        wait_until(lambda: rt.status()["inflight"] == 1)
        time.sleep(0.2)  # the call is waiting for the load now
        clock.advance(1.0)
        gated.gate.set()
        call.join(10)
        # 3. Not loaded ahead: the call starts the load itself, all exposed (the clock stands still: 0 s).
        rt.invoke(1, {2: torch.randn(1, HIDDEN)})
        layers = rt.status()["cold"]["layers"]
        assert layers[0] == {"hidden_s": 2.0, "exposed_s": 0.0, "waits": 0, "prefetched": 1}
        assert layers[1] == {"hidden_s": 3.0, "exposed_s": 1.0, "waits": 2, "prefetched": 1}
        scrape = "\n".join(f"{s.name} {s.labels} {s.value}" for m in registry_for(rt).collect() for s in m.samples)
        assert "moeless_expert_layer_cold_hidden_seconds_total {'layer': '1'} 3.0" in scrape
        assert "moeless_expert_layer_cold_exposed_seconds_total {'layer': '1'} 1.0" in scrape
        assert "moeless_expert_host_tier_misses_total {} 3" in scrape
    finally:
        gated.gate.set()
        rt.close()


def test_a_prefetch_evicted_before_any_use_is_counted_wasted(store, clock):
    rt = runtime_for(store, clock=clock)
    try:
        rt.load(0, 3, wait=True)
        assert rt.evict(0, 3)[0]
        assert rt.status()["cold"]["prefetch_wasted"] == 1
    finally:
        rt.close()


@pytest.mark.parametrize("order, kept", [("lru", {(0, 0), (0, 2)}), ("fifo", {(0, 1), (0, 2)})])
def test_host_tier_eviction_order(store, order, kept):
    size = sum(t.numel() * t.element_size() for t in store.load(0, 0).values())
    tier = HostTier(store, TierConfig(capacity_bytes=2 * size, eviction=order))
    for key in [(0, 0), (0, 1), (0, 0), (0, 2)]:
        tier.get(key)
    assert {key for key in [(0, 0), (0, 1), (0, 2)] if tier.contains(key)} == kept
    assert tier.stats()["evictions"] == 1


def test_tier_settings_are_checked():
    with pytest.raises(ValueError, match="eviction must be one of lru, fifo"):
        TierConfig(eviction="random")
    with pytest.raises(ValueError, match="pre-warm"):
        TierConfig(prewarm="some")
    with pytest.raises(ValueError, match=">= 0 bytes"):
        TierConfig(capacity_bytes=-1)


def test_tier_flags_make_a_config():
    import argparse

    from moeless.expert_fn.options import add_tier_arguments
    from moeless.expert_fn.stores.tiers import tier_config_from_args

    parser = argparse.ArgumentParser()
    add_tier_arguments(parser)
    config = tier_config_from_args(parser.parse_args(["--host-tier-gb", "0.5", "--host-tier-eviction", "fifo",
                                                      "--host-tier-prewarm", "all"]))
    assert config == TierConfig(500_000_000, "fifo", "all")
    assert tier_config_from_args(parser.parse_args([])) == TierConfig()
