"""Host failures as the serving side sees them: SIGKILL -> ExpertHostUnavailable fast (no hang),
restart -> a cold host on the same address, SIGTERM -> the call in flight completes, exit 0."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from moeless.expert_fn.client.client import ExpertHostClient, ExpertHostUnavailable
from moeless.expert_fn.launcher import HostStartError, launch_local_hosts
from moeless.model.experts import expert_forward

from expert_fn_support import random_store

SLOW_HIDDEN, SLOW_FFN, SLOW_TOKENS = 32, 16384, 2048  # one expert's call takes about a second


@pytest.fixture(scope="module")
def slow_store(tmp_path_factory):
    return random_store(tmp_path_factory.mktemp("slow"), 1, 2, SLOW_HIDDEN, SLOW_FFN, seed=1)


@pytest.fixture(scope="module")
def hosts(slow_store):
    with launch_local_hosts(2, slow_store.root, keep_alive_s=60.0, drain_s=30.0) as group:
        yield group


def invoke_in_thread(client: ExpertHostClient, batches: dict) -> tuple[threading.Thread, dict]:
    """Start client.invoke(0, batches) in a thread; the dict gets "out" or "error" and "elapsed"."""
    result: dict = {}

    def run() -> None:
        started = time.monotonic()
        try:
            result["out"] = client.invoke(0, batches)
        except Exception as err:  # recorded for the test to check
            result["error"] = err
        result["elapsed"] = time.monotonic() - started

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def readiness(base_url: str) -> int:
    """/readyz's status; 0 where the probe's connection failed (as kubelet, a failed probe: poll again).
    A CI run once had a probe reset by the host at the start of its drain, while it still served."""
    try:
        return urllib.request.urlopen(f"{base_url}/readyz", timeout=5).status
    except urllib.error.HTTPError as err:
        return err.code
    except (ConnectionError, urllib.error.URLError):
        return 0


def wait_inflight(client: ExpertHostClient, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while client.status()["inflight"] < 1:
        assert time.monotonic() < deadline, "the invoke never reached the host"
        time.sleep(0.01)


def test_sigkill_during_an_invoke_is_unavailable_at_once_and_restart_serves_cold(hosts):
    client = ExpertHostClient(hosts.addresses[0], timeout_s=60)
    thread, result = invoke_in_thread(client, {0: torch.randn(SLOW_TOKENS, SLOW_HIDDEN)})
    wait_inflight(client)
    hosts.kill(0)
    thread.join(10)
    assert not thread.is_alive(), "the client hung on a dead host"
    assert isinstance(result.get("error"), ExpertHostUnavailable), result
    # A dead host refuses new calls at once too, far below the 60 s timeout.
    started = time.monotonic()
    with pytest.raises(ExpertHostUnavailable, match="UNAVAILABLE"):
        client.invoke(0, {0: torch.randn(1, SLOW_HIDDEN)})
    assert time.monotonic() - started < 2.0
    hosts.restart(0)
    deadline = time.monotonic() + 5.0
    while True:  # the channel reconnects within its backoff (about a second)
        try:
            status = client.status()
            break
        except ExpertHostUnavailable:
            assert time.monotonic() < deadline, "restarted host not reachable"
            time.sleep(0.05)
    assert status["replicas"] == [] and status["health"] == "serving"  # a fresh, cold host
    client.close()


def test_sigterm_drains_the_invoke_in_flight_then_exits_zero(hosts, slow_store):
    client = ExpertHostClient(hosts.addresses[1], timeout_s=60)
    # About 4 s of compute: the drain must begin while it runs, also on a machine the rest of the suite loads.
    x = torch.randn(4 * SLOW_TOKENS, SLOW_HIDDEN)
    thread, result = invoke_in_thread(client, {1: x})
    wait_inflight(client)
    os.kill(hosts.pid(1), signal.SIGTERM)
    deadline = time.monotonic() + 10.0
    while readiness(hosts.metrics_urls[1]) != 503:  # not ready while draining, still alive
        assert time.monotonic() < deadline, "readiness never turned false on SIGTERM"
        time.sleep(0.02)
    assert thread.is_alive()  # the call in flight is still running
    exit_status = hosts.terminate(1, timeout_s=40)
    thread.join(10)
    assert "error" not in result, result
    torch.testing.assert_close(result["out"][1], expert_forward(slow_store.load(0, 1), x), rtol=1e-4, atol=1e-5)
    assert exit_status == 0
    with pytest.raises(ExpertHostUnavailable):
        client.health()
    client.close()


def test_a_host_that_cannot_start_is_reported_with_its_log(tmp_path):
    (tmp_path / "index.json").write_text("{not json")
    with pytest.raises(HostStartError, match="not valid JSON"):
        launch_local_hosts(1, tmp_path, startup_timeout_s=60)


def test_a_host_too_slow_for_the_deadline_is_unavailable(hosts):
    with ExpertHostClient(hosts.addresses[0], timeout_s=0.1) as client:
        started = time.monotonic()
        with pytest.raises(ExpertHostUnavailable, match="DEADLINE_EXCEEDED"):
            client.invoke(0, {0: torch.randn(SLOW_TOKENS, SLOW_HIDDEN)})
        assert time.monotonic() - started < 2.0
