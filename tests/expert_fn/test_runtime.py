"""The host engine in-process (no gRPC): invoke correctness, cold starts, failures, keep-alive."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from moeless.expert_fn.errors import BadRequest, HostMemoryFull, ReplicaLoadError
from moeless.expert_fn.host.lifecycle import ReplicaState
from moeless.expert_fn.host.runtime import ExpertHostRuntime
from moeless.model.experts import expert_forward

from expert_fn_support import CORRUPT, HIDDEN


@pytest.fixture
def runtime(store, clock):
    rt = ExpertHostRuntime(store, capacity_bytes=10**8, keep_alive_s=30.0, clock=clock)
    yield rt
    rt.close()


def test_invoke_matches_expert_forward_and_counts_cold_starts(runtime, store):
    xs = {0: torch.randn(4, HIDDEN), 2: torch.randn(1, HIDDEN), 3: torch.randn(6, HIDDEN)}
    first = runtime.invoke(0, xs)
    assert first.cold_starts == 3
    for e, x in xs.items():
        torch.testing.assert_close(first.outputs[e], expert_forward(store.load(0, e), x), rtol=1e-5, atol=1e-6)
    assert runtime.invoke(0, xs).cold_starts == 0
    meters = runtime.status()["meters"]
    assert (meters["invocations"], meters["tokens"], meters["cold_starts"], meters["loads"]) == (2, 22, 3, 3)


def test_prewarm_returns_before_the_load_and_wait_returns_resident(runtime):
    state, started = runtime.load(0, 0, wait=True)
    assert (state.value, started) == ("idle", True)
    state, started = runtime.load(0, 0)
    assert (state.value, started) == ("idle", False)
    assert runtime.invoke(0, {0: torch.randn(2, HIDDEN)}).cold_starts == 0


def test_corrupt_file_fails_its_replica_only(runtime, store):
    path = store.root / store.index["experts"]["1/3"]["file"]
    with pytest.raises(ReplicaLoadError, match=str(path)):
        runtime.invoke(CORRUPT[0], {1: torch.randn(2, HIDDEN), CORRUPT[1]: torch.randn(2, HIDDEN)})
    out = runtime.invoke(CORRUPT[0], {1: torch.randn(2, HIDDEN)})
    assert out.outputs[1].shape == (2, HIDDEN)
    replicas = {(r["layer"], r["expert"]): r for r in runtime.status()["replicas"]}
    assert replicas[CORRUPT]["state"] == "cold" and "checksum mismatch" in replicas[CORRUPT]["error"]
    assert replicas[(1, 1)]["state"] == "idle"  # released after the failed call
    with pytest.raises(ReplicaLoadError, match="checksum"):
        runtime.load(*CORRUPT, wait=True)


def test_bad_requests_say_what_is_wrong(runtime):
    with pytest.raises(BadRequest, match="2 layers x 4 experts"):
        runtime.invoke(5, {0: torch.randn(1, HIDDEN)})
    with pytest.raises(BadRequest, match=r"\[n, H=16\]"):
        runtime.invoke(0, {0: torch.randn(3, HIDDEN + 1)})
    assert runtime.status()["replicas"][0]["state"] == "idle"  # not left pinned


def test_memory_full_when_everything_resident_is_loading_or_busy(store, clock):
    one_expert = store.expert_bytes(0, 0)
    rt = ExpertHostRuntime(store, capacity_bytes=one_expert, keep_alive_s=30.0, clock=clock)
    try:
        with pytest.raises(HostMemoryFull, match="needs"):
            rt.invoke(0, {0: torch.randn(1, HIDDEN), 1: torch.randn(1, HIDDEN)})
        assert rt.status()["inflight"] == 0
        rt.load(0, 0, wait=True)  # the first call's load of (0, 0) went ahead
        rt.invoke(0, {1: torch.randn(1, HIDDEN)})  # alone it fits, evicting idle (0, 0)
        states = {(r["layer"], r["expert"]): r["state"] for r in rt.status()["replicas"]}
        assert states == {(0, 0): "evicted", (0, 1): "idle"}
    finally:
        rt.close()


def test_keep_alive_sweeper_evicts_idle_replicas(runtime, clock):
    runtime.load(0, 1, wait=True)
    clock.advance(29.0)
    time.sleep(1.2)  # the sweeper runs every second at most
    assert runtime.status()["replicas"][0]["state"] == "idle"
    clock.advance(1.0)
    deadline = time.monotonic() + 3.0
    while runtime.status()["replicas"][0]["state"] != "evicted":
        assert time.monotonic() < deadline, "not evicted after keep_alive_s"
        time.sleep(0.05)
    assert runtime.status()["meters"]["bytes_held"] == 0


def test_a_load_of_a_resident_replica_starts_its_keep_alive_over(runtime, clock):
    runtime.load(0, 1, wait=True)
    clock.advance(20.0)
    assert runtime.status()["replicas"][0]["idle_s"] == pytest.approx(20.0)
    assert runtime.load(0, 1) == (ReplicaState.IDLE, False)  # a placement confirmed resident (LoadMany, Load)
    assert runtime.status()["replicas"][0]["idle_s"] == 0.0
    clock.advance(20.0)  # 40 s after its load, 20 s after the confirmation
    time.sleep(1.2)  # the sweeper runs every second at most
    assert runtime.status()["replicas"][0]["state"] == "idle"


def test_concurrent_invokes_are_correct(runtime, store):
    xs = [{e: torch.randn(3, HIDDEN) for e in (0, 1, 2)} for _ in range(16)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda b: runtime.invoke(0, b), xs))
    for batch, result in zip(xs, results):
        for e, x in batch.items():
            torch.testing.assert_close(result.outputs[e], expert_forward(store.load(0, e), x), rtol=1e-5, atol=1e-6)
    status = runtime.status()
    assert status["meters"]["loads"] == 3 and status["inflight"] == 0
    assert {r["state"] for r in status["replicas"]} == {"idle"}


def test_an_expert_without_tokens_is_neither_loaded_nor_counted(runtime):
    result = runtime.invoke(0, {0: torch.randn(2, HIDDEN), 1: torch.empty(0, HIDDEN)})
    assert result.outputs[1].shape == (0, HIDDEN) and result.cold_starts == 1
    replicas = {(r["layer"], r["expert"]): r for r in runtime.status()["replicas"]}
    assert set(replicas) == {(0, 0)} and replicas[(0, 0)]["loads"] == 1 and replicas[(0, 0)]["cold_starts"] == 1


def test_compute_dtype_store_keeps_a_bfloat16_model_in_bfloat16_at_half_the_memory(tmp_path):
    from expert_fn_support import random_store

    store = random_store(tmp_path, 1, 2, HIDDEN, 8, dtype=torch.bfloat16)
    x = torch.randn(5, HIDDEN).to(torch.bfloat16)
    wide = ExpertHostRuntime(store, capacity_bytes=10**6, keep_alive_s=60)
    narrow = ExpertHostRuntime(store, capacity_bytes=10**6, keep_alive_s=60, compute_dtype="store")
    try:
        a, b = wide.invoke(0, {1: x}).outputs[1], narrow.invoke(0, {1: x}).outputs[1]
        weights = store.load(0, 1)
        assert a.dtype == torch.float32 and torch.equal(a, expert_forward({k: w.float() for k, w in weights.items()},
                                                                          x.float()))
        assert b.dtype == torch.bfloat16 and torch.equal(b, expert_forward(weights, x))
        assert torch.allclose(b.float(), a, rtol=0.05, atol=0.02) and not torch.equal(b.float(), a)
        held = {r.status()["replicas"][0]["bytes"] for r in (wide, narrow)}
        assert held == {store.expert_bytes(0, 1) * 2, store.expert_bytes(0, 1)}  # float32 doubles a bfloat16 expert
    finally:
        wide.close()
        narrow.close()
    with pytest.raises(ValueError, match="compute dtype 'float16': use one of float32, store"):
        ExpertHostRuntime(store, capacity_bytes=10**6, keep_alive_s=60, compute_dtype="float16")
