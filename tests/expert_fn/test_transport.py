"""The packed call over both transports (shared-memory local channel, gRPC) on real host processes:
the same outputs bit for bit, faults as ExpertHostUnavailable, reconnection after a restart."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from moeless.expert_fn.client import ExpertHostClient
from moeless.expert_fn.errors import BadRequest, ExpertHostError, ExpertHostUnavailable, ReplicaLoadError
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.model.experts import expert_forward

from expert_fn_support import CORRUPT, HIDDEN


@pytest.fixture(scope="module")
def hosts(store):
    with launch_local_hosts(2, store.root, keep_alive_s=60.0, metrics=False) as group:
        yield group


def _packed(store, layer, experts, counts, x):
    """What the host must answer: each expert's rows through expert_forward, in order."""
    parts, start = [], 0
    for e, n in zip(experts, counts):
        parts.append(expert_forward(store.load(layer, e), x[start:start + n]))
        start += n
    return torch.cat(parts)


def test_local_channel_and_grpc_give_the_same_outputs(hosts, store):
    x = torch.randn(20, HIDDEN)
    rows = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5])  # a token may go to several experts
    experts, counts = [0, 2, 3], [4, 6, 1]
    with ExpertHostClient(hosts.addresses[0]) as local, \
            ExpertHostClient(hosts.addresses[0], transport="grpc") as remote:
        a = local.submit(0, experts, counts, x, rows).result()
        assert local.uses_local_channel
        b = remote.submit(0, experts, counts, x, rows).result()
        assert not remote.uses_local_channel
    assert torch.equal(a.y, b.y)
    torch.testing.assert_close(a.y, _packed(store, 0, experts, counts, x[rows]), rtol=1e-5, atol=1e-6)
    assert a.compute_s > 0


def test_a_call_larger_than_the_shared_buffer_grows_it(hosts, store):
    x = torch.randn(70_000, HIDDEN)  # 4.5 MB, over the initial 4 MB buffer
    rows = torch.arange(x.shape[0])
    with ExpertHostClient(hosts.addresses[1], transport="local") as client:
        y = client.submit(0, [0, 1], [35_000, 35_000], x, rows).result().y
        torch.testing.assert_close(y, _packed(store, 0, [0, 1], [35_000, 35_000], x), rtol=1e-5, atol=1e-6)
        small = client.submit(0, [1], [2], x, rows[:2]).result().y  # still fine after the growth
        torch.testing.assert_close(small, expert_forward(store.load(0, 1), x[:2]), rtol=1e-5, atol=1e-6)


def test_host_errors_cross_the_local_channel_with_their_class(hosts):
    x = torch.randn(4, HIDDEN)
    with ExpertHostClient(hosts.addresses[0], transport="local") as client:
        with pytest.raises(ReplicaLoadError, match=f"l{CORRUPT[0]:03d}_e{CORRUPT[1]:03d}"):
            client.submit(CORRUPT[0], [CORRUPT[1]], [4], x, torch.arange(4)).result()
        with pytest.raises(BadRequest, match="appears twice"):
            client.submit(0, [1, 1], [2, 2], x, torch.arange(4)).result()
        with pytest.raises(BadRequest, match="no expert"):
            client.submit(9, [0], [4], x, torch.arange(4)).result()
        ok = client.submit(0, [0], [4], x, torch.arange(4)).result()  # the channel still works
        assert ok.y.shape == (4, HIDDEN)


def test_without_a_local_channel_auto_uses_grpc_and_local_says_so(store):
    with launch_local_hosts(1, store.root, metrics=False, local_channel=False) as group:
        x = torch.randn(4, HIDDEN)
        with ExpertHostClient(group.addresses[0]) as auto:
            y = auto.submit(0, [0], [4], x, torch.arange(4)).result().y
            assert not auto.uses_local_channel
            torch.testing.assert_close(y, expert_forward(store.load(0, 0), x), rtol=1e-5, atol=1e-6)
        with ExpertHostClient(group.addresses[0], transport="local") as forced:
            with pytest.raises(ExpertHostError, match="no local channel"):
                forced.submit(0, [0], [4], x, torch.arange(4))


def test_killed_host_is_unavailable_at_once_and_a_restart_is_reached_again(store):
    with launch_local_hosts(1, store.root, metrics=False) as group:
        client = ExpertHostClient(group.addresses[0], timeout_s=30)
        x = torch.randn(4, HIDDEN)
        client.submit(0, [0], [4], x, torch.arange(4)).result()
        assert client.uses_local_channel
        group.kill(0)
        started = time.monotonic()
        with pytest.raises(ExpertHostUnavailable):
            client.submit(0, [0], [4], x, torch.arange(4)).result()
        with pytest.raises(ExpertHostUnavailable):  # and the next call too, without a hang
            client.submit(0, [0], [4], x, torch.arange(4)).result()
        assert time.monotonic() - started < 5.0
        group.restart(0)
        deadline = time.monotonic() + 10.0
        while True:
            try:
                y = client.submit(0, [0], [4], x, torch.arange(4)).result().y
                break
            except ExpertHostUnavailable:
                assert time.monotonic() < deadline, "restarted host not reachable"
                time.sleep(0.05)
        assert client.uses_local_channel
        torch.testing.assert_close(y, expert_forward(store.load(0, 0), x), rtol=1e-5, atol=1e-6)
        client.close()


def test_a_draining_host_refuses_local_calls_as_unavailable(store):
    with launch_local_hosts(1, store.root, metrics=False, drain_s=5.0) as group:
        client = ExpertHostClient(group.addresses[0], transport="local")
        x = torch.randn(4, HIDDEN)
        client.submit(0, [0], [4], x, torch.arange(4)).result()
        os.kill(group.pid(0), signal.SIGTERM)
        with pytest.raises(ExpertHostUnavailable):
            for _ in range(200):  # unavailable once the host drains (within its 0.5 s stop check)
                client.submit(0, [0], [4], x, torch.arange(4)).result()
                time.sleep(0.01)
        assert group.terminate(0) == 0
        client.close()


def test_a_host_exits_when_its_parent_dies(store, tmp_path):
    """A launcher killed with SIGKILL leaves no host process behind (--exit-with-parent)."""
    import subprocess
    import sys

    script = (f"import time; from moeless.expert_fn.launcher import launch_local_hosts; "
              f"g = launch_local_hosts(1, {str(store.root)!r}, metrics=False); "
              f"print(g.pid(0), flush=True); time.sleep(60)")
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    host_pid = int(launcher.stdout.readline())
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 30.0  # it checks every 0.5 s, then drains (slow on a loaded machine)
    try:
        while _running(host_pid):
            assert time.monotonic() < deadline, "the host outlived its launcher"
            time.sleep(0.1)
    finally:
        if _running(host_pid):  # the test failed: leave nothing behind either
            os.kill(host_pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped by init) counts as gone
        return f.read().split(") ")[1][0] != "Z"
