"""Real expert hosts (processes, gRPC on loopback) through the client: the serving path's view."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import pytest
import torch

from moeless.expert_fn.client.client import ExpertHostClient, ReplicaLoadError
from moeless.expert_fn.errors import BadRequest
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.model.experts import expert_forward

from expert_fn_support import CORRUPT, HIDDEN


@pytest.fixture(scope="module")
def hosts(store):
    with launch_local_hosts(2, store.root, keep_alive_s=60.0) as group:
        yield group


@pytest.fixture
def clients(hosts):
    clients = [ExpertHostClient(a, timeout_s=20) for a in hosts.addresses]
    yield clients
    for c in clients:
        c.close()


def replicas(client: ExpertHostClient) -> dict[tuple[int, int], dict]:
    return {(r["layer"], r["expert"]): r for r in client.status()["replicas"]}


def test_one_invoke_carries_several_experts_and_matches_expert_forward(clients, store):
    client = clients[0]
    before = client.status()["meters"]
    xs = {0: torch.randn(5, HIDDEN), 1: torch.randn(1, HIDDEN), 2: torch.randn(7, HIDDEN)}
    out = client.invoke(1, xs)
    assert sorted(out) == [0, 1, 2]
    for e, x in xs.items():
        torch.testing.assert_close(out[e], expert_forward(store.load(1, e), x), rtol=1e-5, atol=1e-6)
    after = client.status()["meters"]
    assert after["invocations"] - before["invocations"] == 1  # one RPC for the whole layer
    assert after["tokens"] - before["tokens"] == 13
    assert after["cold_starts"] - before["cold_starts"] == 3  # loaded on demand


def test_load_evict_and_reload(clients, store):
    client = clients[1]
    assert client.load(0, 2, wait=True) == "idle"
    assert replicas(client)[(0, 2)]["bytes"] == store.expert_bytes(0, 2)
    assert client.evict(0, 2) is True
    assert replicas(client)[(0, 2)]["state"] == "evicted" and replicas(client)[(0, 2)]["bytes"] == 0
    assert client.evict(0, 2) is False  # nothing left to evict
    x = torch.randn(3, HIDDEN)
    again = client.invoke_detailed(0, {2: x})
    assert again.cold_starts == 1 and again.compute_s > 0
    torch.testing.assert_close(again.outputs[2], expert_forward(store.load(0, 2), x), rtol=1e-5, atol=1e-6)
    assert replicas(client)[(0, 2)]["state"] == "idle"
    assert client.invoke_detailed(0, {2: x}).cold_starts == 0


def test_prewarm_does_not_block(clients):
    state = clients[1].load(0, 3)
    assert state in ("loading", "idle")
    assert clients[1].load(0, 3, wait=True) == "idle"


def test_load_many_loads_several_in_one_call_and_waits_for_them(clients):
    client = clients[1]
    for expert in (0, 1):
        client.evict(1, expert)
    client.load(0, 3, wait=True)
    assert client.load_many([(1, 0), (1, 1), (0, 3)], wait=True) == 2  # (0, 3) resident already
    assert all(replicas(client)[key]["state"] == "idle" for key in ((1, 0), (1, 1), (0, 3)))
    assert client.load_many([(1, 0), (1, 1)], wait=True) == 0  # resident: nothing started, answered at once
    time.sleep(0.5)
    idle = replicas(client)[(0, 3)]["idle_s"]
    assert idle >= 0.5 and client.load_many([(0, 3)], wait=True) == 0
    assert replicas(client)[(0, 3)]["idle_s"] < idle - 0.4  # confirmed resident: its keep-alive starts over
    with pytest.raises(ReplicaLoadError, match="checksum mismatch"):
        client.load_many([(1, 2), CORRUPT], wait=True)  # the one that cannot load fails the call, named
    assert replicas(client)[(1, 2)]["state"] == "idle"
    with pytest.raises(BadRequest, match="2 layers x 4 experts"):
        client.load_many([(0, 9)], wait=True)


def test_corrupt_file_fails_that_replica_and_the_host_serves_the_others(clients, store):
    client = clients[0]
    path = store.root / store.index["experts"]["1/3"]["file"]
    with pytest.raises(ReplicaLoadError, match=str(path)):
        client.invoke(CORRUPT[0], {CORRUPT[1]: torch.randn(2, HIDDEN), 0: torch.randn(2, HIDDEN)})
    with pytest.raises(ReplicaLoadError, match="checksum mismatch"):
        client.load(*CORRUPT, wait=True)
    x = torch.randn(4, HIDDEN)
    torch.testing.assert_close(client.invoke(1, {0: x})[0], expert_forward(store.load(1, 0), x), rtol=1e-5, atol=1e-6)
    assert "checksum mismatch" in replicas(client)[CORRUPT]["error"]
    assert client.status()["meters"]["load_failures"] >= 2
    assert client.health() == {"state": "serving", "ready": True}


def test_bad_input_is_a_clear_error(clients):
    with pytest.raises(BadRequest, match="2 layers x 4 experts"):
        clients[0].invoke(0, {9: torch.randn(1, HIDDEN)})
    with pytest.raises(BadRequest, match="H=16"):
        clients[0].invoke(0, {0: torch.randn(1, 3)})


def test_metrics_health_and_readiness_over_http(clients, hosts):
    clients[1].invoke(1, {1: torch.randn(6, HIDDEN)})
    base = hosts.metrics_urls[1]
    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    assert 'moeless_expert_replica_tokens_total{expert="1",layer="1",model="random"} 6.0' in text
    for name in ("replica_gb_seconds_total", "host_cold_starts_total", "host_load_seconds_total",
                 "host_invocations_total", "host_bytes_held"):
        assert f"moeless_expert_{name}" in text
    gb_s = [float(line.split()[-1]) for line in text.splitlines() if line.startswith("moeless_expert_host_gb_seconds_total")]
    assert gb_s and gb_s[0] > 0
    assert urllib.request.urlopen(f"{base}/healthz", timeout=10).status == 200
    assert urllib.request.urlopen(f"{base}/readyz", timeout=10).read() == b"serving\n"
    with pytest.raises(urllib.error.HTTPError, match="404"):
        urllib.request.urlopen(f"{base}/nope", timeout=10)


def test_a_bad_host_tier_flag_is_one_clear_line_and_exit_2(store):
    import subprocess
    import sys

    bad = subprocess.run([sys.executable, "-m", "moeless.expert_fn.host", "--store", str(store.root),
                          "--host-tier-gb", "-1"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("expert-host: host tier capacity must be >= 0")


def test_the_keep_alive_is_set_while_serving_and_a_bad_one_refused(clients, hosts):
    """Configure: a live knob, the replicas resident stay; a negative keep-alive is one clear error."""
    client = clients[0]
    client.load(0, 1, wait=True)
    before = client.status()["keep_alive_s"]
    try:
        assert client.configure(5.0) == 5.0 and client.status()["keep_alive_s"] == 5.0
        text = urllib.request.urlopen(f"{hosts.metrics_urls[0]}/metrics", timeout=10).read().decode()
        assert "moeless_expert_host_keep_alive_seconds 5.0" in text
        assert any((r["layer"], r["expert"]) == (0, 1) and r["state"] in ("idle", "warm") for r in client.status()["replicas"])
        with pytest.raises(BadRequest, match="keep_alive_s must be >= 0, got -1"):
            client.configure(-1.0)
        assert client.status()["keep_alive_s"] == 5.0
    finally:
        client.configure(before)
