"""Routed calls over every transport (shared-memory local channel, TCP, gRPC) on real host processes:
the same outputs bit for bit, faults as ExpertHostUnavailable, reconnection after a restart."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from moeless.expert_fn.client.client import ExpertHostClient
from moeless.expert_fn.errors import BadRequest, ExpertHostError, ExpertHostUnavailable, ReplicaLoadError
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.expert_fn.wire.routed import RoutedCall
from moeless.model.experts import expert_forward

from expert_fn_support import CORRUPT, EXPERTS, HIDDEN, answer_after_restart


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


def _call(layer, experts, counts, rows):
    return RoutedCall.packed(layer, experts, counts, rows)


def test_local_channel_and_grpc_give_the_same_outputs(hosts, store):
    x = torch.randn(20, HIDDEN)
    rows = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5])  # a token may go to several experts
    experts, counts = [0, 2, 3], [4, 6, 1]
    with ExpertHostClient(hosts.addresses[0]) as local, \
            ExpertHostClient(hosts.addresses[0], transport="grpc") as remote:
        a = local.submit(_call(0, experts, counts, rows), x).result()
        assert local.uses_local_channel
        b = remote.submit(_call(0, experts, counts, rows), x).result()
        assert not remote.uses_local_channel
    assert torch.equal(a.z, b.z)
    torch.testing.assert_close(a.z, _packed(store, 0, experts, counts, x[rows]), rtol=1e-5, atol=1e-6)
    assert a.compute_s > 0


def _top2(x: torch.Tensor, tokens: torch.Tensor, dtype: torch.dtype) -> RoutedCall:
    """Each of `tokens` sent once to its top-2 of the EXPERTS experts (a random gate), both pairs
    summed into the token's own output row: outputs shared by several pairs."""
    gate = torch.randn(int(tokens.numel()), EXPERTS, generator=torch.Generator().manual_seed(3))
    weight, chosen = gate.softmax(-1).topk(2)
    experts, counts, src, w = [], [], [], []
    for e in range(EXPERTS):
        where = (chosen == e).nonzero()  # (token position, k): ascending positions
        if len(where):
            experts.append(e)
            counts.append(len(where))
            src += where[:, 0].tolist()
            w += weight[where[:, 0], where[:, 1]].tolist()
    src = torch.tensor(src, dtype=torch.int32)
    return RoutedCall(0, experts, counts, tokens, src, src.clone(), torch.tensor(w).to(dtype), int(tokens.numel()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_routed_call_with_shared_outputs_is_the_same_over_every_transport(hosts, store, dtype):
    x = torch.randn(30, HIDDEN).to(dtype)
    tokens = torch.tensor([0, 2, 3, 7, 11, 12, 19, 20, 21, 29])
    call = _top2(x, tokens, dtype)
    assert call.n_out < call.pairs
    z = {}
    for transport in ("local", "tcp", "nixl", "grpc"):
        with ExpertHostClient(hosts.addresses[0], transport=transport) as client:
            z[transport] = client.submit(call, x).result().z.clone()
            assert client.path == transport
    assert z["local"].dtype == dtype and z["local"].shape == (call.n_out, HIDDEN)
    assert all(torch.equal(z["local"], z[t]) for t in ("tcp", "nixl", "grpc"))
    # The reference's sums: each expert in float32 on the token's row, weighted in the tokens' dtype.
    expected = torch.zeros(call.n_out, HIDDEN, dtype=dtype)
    start = 0
    for e, n in zip(call.experts, call.counts):
        src = call.src[start:start + n].long()
        y = expert_forward(store.load(0, e), x[tokens[src]].float()).to(dtype)
        out = call.out[start:start + n].long()
        expected.index_put_((out,), y * call.weight[start:start + n, None], accumulate=True)
        start += n
    tolerance = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(z["local"], expected, **tolerance)


def test_a_call_larger_than_the_shared_buffer_grows_it(hosts, store):
    x = torch.randn(70_000, HIDDEN)  # 4.5 MB, over the initial 4 MB buffer
    rows = torch.arange(x.shape[0])
    with ExpertHostClient(hosts.addresses[1], transport="local") as client:
        z = client.submit(_call(0, [0, 1], [35_000, 35_000], rows), x).result().z
        torch.testing.assert_close(z, _packed(store, 0, [0, 1], [35_000, 35_000], x), rtol=1e-5, atol=1e-6)
        small = client.submit(_call(0, [1], [2], rows[:2]), x).result().z  # still fine after the growth
        torch.testing.assert_close(small, expert_forward(store.load(0, 1), x[:2]), rtol=1e-5, atol=1e-6)


def test_host_errors_cross_the_local_channel_with_their_class(hosts):
    x = torch.randn(4, HIDDEN)
    with ExpertHostClient(hosts.addresses[0], transport="local") as client:
        with pytest.raises(ReplicaLoadError, match=f"l{CORRUPT[0]:03d}_e{CORRUPT[1]:03d}"):
            client.submit(_call(CORRUPT[0], [CORRUPT[1]], [4], torch.arange(4)), x).result()
        with pytest.raises(BadRequest, match="distinct and ascending"):
            client.submit(_call(0, [1, 1], [2, 2], torch.arange(4)), x).result()
        with pytest.raises(BadRequest, match="no expert"):
            client.submit(_call(9, [0], [4], torch.arange(4)), x).result()
        ok = client.submit(_call(0, [0], [4], torch.arange(4)), x).result()  # the channel still works
        assert ok.z.shape == (4, HIDDEN)
        assert client.uses_local_channel


def test_without_a_local_channel_auto_uses_another_transport_and_local_says_so(store):
    with launch_local_hosts(1, store.root, metrics=False, local_channel=False) as group:
        x = torch.randn(4, HIDDEN)
        with ExpertHostClient(group.addresses[0]) as auto:
            z = auto.submit(_call(0, [0], [4], torch.arange(4)), x).result().z
            assert not auto.uses_local_channel
            torch.testing.assert_close(z, expert_forward(store.load(0, 0), x), rtol=1e-5, atol=1e-6)
        with ExpertHostClient(group.addresses[0], transport="local") as forced:
            with pytest.raises(ExpertHostError, match="no local channel"):
                forced.submit(_call(0, [0], [4], torch.arange(4)), x)


def test_killed_host_is_unavailable_at_once_and_a_restart_is_reached_again(store):
    with launch_local_hosts(1, store.root, metrics=False) as group:
        client = ExpertHostClient(group.addresses[0], timeout_s=30)
        x = torch.randn(4, HIDDEN)
        call = _call(0, [0], [4], torch.arange(4))
        client.submit(call, x).result()
        assert client.uses_local_channel
        group.kill(0)
        started = time.monotonic()
        with pytest.raises(ExpertHostUnavailable):
            client.submit(call, x).result()
        with pytest.raises(ExpertHostUnavailable):  # and the next call too, without a hang
            client.submit(call, x).result()
        assert time.monotonic() - started < 5.0
        group.restart(0)
        z = answer_after_restart(client, call, x)
        assert client.uses_local_channel
        torch.testing.assert_close(z, expert_forward(store.load(0, 0), x), rtol=1e-5, atol=1e-6)
        client.close()


def test_a_draining_host_refuses_local_calls_as_unavailable(store):
    with launch_local_hosts(1, store.root, metrics=False, drain_s=5.0) as group:
        client = ExpertHostClient(group.addresses[0], transport="local")
        x = torch.randn(4, HIDDEN)
        call = _call(0, [0], [4], torch.arange(4))
        client.submit(call, x).result()
        os.kill(group.pid(0), signal.SIGTERM)
        with pytest.raises(ExpertHostUnavailable):
            for _ in range(200):  # unavailable once the host drains (within its 0.5 s stop check)
                client.submit(call, x).result()
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
