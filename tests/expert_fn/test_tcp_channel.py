"""The TCP channel (the data plane between pods) on real host processes: routed calls equal gRPC's
bit for bit, a host killed mid-call is unavailable at once and reached again after its restart,
and bad frames either way get errors that name the host and the call while serving goes on; the
same with NIXL moving the rows and z (transport "nixl", a real NIXL/UCX), plus: a call too large
for the link goes as a frame, a host that takes no NIXL says so, and a frame that says its rows
travel apart on a connection without a link is refused by name. (Answers over nixl in float32
and bfloat16 equal every other transport's: test_transport.py.)"""

from __future__ import annotations

import importlib
import socket
import struct
import threading
import time

import pytest
import torch

from moeless.expert_fn.client.client import ExpertHostClient
from moeless.expert_fn.errors import BadRequest, ExpertHostError, ExpertHostUnavailable
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.expert_fn.wire.nixl_link import BACKENDS, NixlError, NixlLink, _backends, nixl_api
from moeless.expert_fn.wire.routed import HEAD, REPLY, RoutedCall, decode_reply_head, lists_bytes
from moeless.expert_fn.client.tcp_channel import TcpChannel
from moeless.expert_fn.host.tcp_server import HELLO, HELLO_MAGIC, receive_into
from moeless.model.experts import expert_forward

from expert_fn_support import HIDDEN, answer_after_restart


@pytest.fixture(scope="module")
def hosts(store):
    with launch_local_hosts(1, store.root, keep_alive_s=60.0, metrics=False) as group:
        yield group


def _shared_call(layer: int = 0) -> RoutedCall:
    """Tokens 0..3; token 0 to experts 0 and 2 (one output row), token 1 to 2, token 3 to 0 and 3."""
    return RoutedCall(layer, [0, 2, 3], [2, 2, 1], torch.tensor([0, 1, 3]),
                      torch.tensor([0, 2, 0, 1, 2], dtype=torch.int32), torch.tensor([0, 1, 0, 2, 3], dtype=torch.int32),
                      torch.tensor([0.25, 0.5, 0.75, 1.0, 0.125]), 4)


def _expected(store, call: RoutedCall, x: torch.Tensor) -> torch.Tensor:
    """z by the routed call's definition, with the store's own weights (experts ascending, from zeros)."""
    z = torch.zeros(call.n_out, x.shape[1])
    start = 0
    for e, n in zip(call.experts, call.counts):
        rows = call.tokens[call.src[start:start + n].long()]
        y = expert_forward(store.load(call.layer, e), x[rows])
        z.index_put_((call.out[start:start + n].long(),), y * call.weight[start:start + n, None], accumulate=True)
        start += n
    return z


def test_tcp_and_grpc_answer_a_routed_call_the_same_bit_for_bit(hosts, store):
    x = torch.randn(6, HIDDEN)
    call = _shared_call()
    with ExpertHostClient(hosts.addresses[0], transport="tcp") as tcp, \
            ExpertHostClient(hosts.addresses[0], transport="grpc") as grpc_client:
        a = tcp.submit(call, x).result().z.clone()
        assert tcp.path == "tcp"
        b = grpc_client.submit(call, x).result().z
        assert grpc_client.path == "grpc"
    assert torch.equal(a, b)
    torch.testing.assert_close(a, _expected(store, call, x), rtol=1e-5, atol=1e-6)


def test_a_prefill_sized_call_grows_the_buffers_and_a_small_one_still_fits(hosts, store):
    x = torch.randn(40_000, HIDDEN)
    with ExpertHostClient(hosts.addresses[0], transport="tcp") as client:
        big = client.submit(RoutedCall.packed(0, [0, 1], [20_000, 20_000], torch.arange(40_000)), x).result().z
        torch.testing.assert_close(big[:20_000], expert_forward(store.load(0, 0), x[:20_000]), rtol=1e-5, atol=1e-6)
        small = client.submit(RoutedCall.packed(0, [1], [2], torch.arange(2)), x).result().z
        torch.testing.assert_close(small, expert_forward(store.load(0, 1), x[:2]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_a_bad_call_names_the_host_and_the_call_and_the_channel_goes_on(hosts, transport):
    x = torch.randn(4, HIDDEN)
    with ExpertHostClient(hosts.addresses[0], transport=transport) as client:
        with pytest.raises(BadRequest, match=r"expert host .*, call \d+ \(layer 9\).*layer"):
            client.submit(RoutedCall.packed(9, [0], [4], torch.arange(4)), x).result()  # no layer 9
        wrong = RoutedCall(0, [0], [3], torch.arange(4), torch.arange(4, dtype=torch.int32),
                           torch.arange(4, dtype=torch.int32), torch.ones(4), 4)  # counts say 3 pairs, 4 are sent
        with pytest.raises(BadRequest, match=r"call \d+ \(layer 0\).*add up"):
            client.submit(wrong, x).result()
        assert client.submit(RoutedCall.packed(0, [0], [4], torch.arange(4)), x).result().z.shape == (4, HIDDEN)
        assert client.path == transport


def test_a_peer_that_does_not_speak_the_protocol_is_hung_up_on_and_others_are_served(hosts):
    x = torch.randn(4, HIDDEN)
    call = RoutedCall.packed(0, [0], [4], torch.arange(4))
    with ExpertHostClient(hosts.addresses[0], transport="tcp") as client:
        client.submit(call, x).result()
        host, _, port = client._channel_now.address.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=10) as peer:
            peer.sendall(b"GET / HTTP/1.1\r\n" + bytes(HEAD.size))
            reply = peer.recv(4096)
            assert b"malformed routed call" in reply
            try:  # then the host hangs up on it (a reset: the rest of what it sent was never read)
                assert peer.recv(4096) == b""
            except ConnectionResetError:
                pass
        assert client.submit(call, x).result().z.shape == (4, HIDDEN)  # the other connection is served


def test_a_reply_that_is_not_a_frame_is_an_error_naming_the_host_and_the_call():
    """A fake peer answers garbage: the client raises an ExpertHostError naming it, and breaks the channel."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def peer():
        conn, _ = listener.accept()
        with conn:
            conn.recv(1 << 16)
            conn.sendall(b"NOPE" + bytes(64))
            time.sleep(0.5)

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    channel = TcpChannel(f"127.0.0.1:{port}", timeout_s=5)
    with pytest.raises(ExpertHostError, match=rf"expert host 127.0.0.1:{port}, call 1 \(layer 0\): malformed reply"):
        channel.submit(RoutedCall.packed(0, [0], [1], torch.arange(1)), torch.randn(1, HIDDEN)).result()
    assert channel.broken
    with pytest.raises(ExpertHostUnavailable, match="closed"):
        channel.submit(RoutedCall.packed(0, [0], [1], torch.arange(1)), torch.randn(1, HIDDEN))
    thread.join(5)
    listener.close()


@pytest.mark.parametrize("transport", ["tcp", "nixl"])  # nixl: the 12.8 MB call goes through its link
def test_a_host_killed_mid_call_is_unavailable_and_reached_again_after_a_restart(store, transport):
    with launch_local_hosts(1, store.root, metrics=False) as group:
        client = ExpertHostClient(group.addresses[0], transport=transport, timeout_s=30)
        x = torch.randn(4, HIDDEN)
        call = RoutedCall.packed(0, [0], [4], torch.arange(4))
        client.submit(call, x).result()
        big = torch.randn(200_000, HIDDEN)  # long enough to be in flight when the host dies
        pending = client.submit(RoutedCall.packed(0, [0, 1], [100_000, 100_000], torch.arange(200_000)), big)
        group.kill(0)
        started = time.monotonic()
        with pytest.raises(ExpertHostUnavailable):
            pending.result()
        with pytest.raises(ExpertHostUnavailable):  # and the next call too, without a hang
            client.submit(call, x).result()
        assert time.monotonic() - started < 5.0
        group.restart(0)
        z = answer_after_restart(client, call, x)
        assert client.path == transport
        torch.testing.assert_close(z, expert_forward(store.load(0, 0), x), rtol=1e-5, atol=1e-6)
        client.close()


def test_the_head_is_the_documented_layout():
    """Golden bytes: a peer in another language can write the frame from the docstring alone."""
    call = RoutedCall(3, [1], [1], torch.tensor([0]), torch.tensor([0], dtype=torch.int32),
                      torch.tensor([0], dtype=torch.int32), torch.tensor([0.5]), 1)
    frame = lists_bytes(7, call, 2, torch.float32)
    assert frame[:HEAD.size] == struct.pack("<4sIiiiiiiB3x", b"MRC1", 7, 3, 1, 1, 1, 1, 2, 0)
    assert frame[HEAD.size:] == struct.pack("<iiiif", 1, 1, 0, 0, 0.5)


# --- with NIXL moving the rows and z (transport "nixl", nixl_link.py) -------------------------

def _tcp_port(client: ExpertHostClient) -> str:
    client.status()
    return client._offer().tcp_port


def test_a_call_larger_than_the_link_goes_as_a_frame_and_the_next_small_one_through_nixl(hosts, store):
    host = hosts.addresses[0].rpartition(":")[0]
    with ExpertHostClient(hosts.addresses[0], transport="tcp") as probe:
        port = _tcp_port(probe)
    channel = TcpChannel(f"{host}:{port}", timeout_s=30, nixl_bytes=40 * HIDDEN * 4)  # 40 rows fit
    try:
        x = torch.randn(100, HIDDEN)
        big = channel.submit(RoutedCall.packed(0, [0, 1], [50, 50], torch.arange(100)), x).result().z.clone()
        assert channel._link is None  # nothing went through NIXL yet
        small = channel.submit(RoutedCall.packed(0, [1], [8], torch.arange(8)), x).result().z.clone()
        link = channel._link
        assert link is not None
        again = channel.submit(RoutedCall.packed(0, [1], [8], torch.arange(8)), x).result().z
        assert channel._link is link and torch.equal(again, small)  # the link is reused call after call
        torch.testing.assert_close(big[:50], expert_forward(store.load(0, 0), x[:50]), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(small, expert_forward(store.load(0, 1), x[:8]), rtol=1e-5, atol=1e-6)
    finally:
        channel.close()


def test_a_frame_whose_rows_travel_apart_without_a_link_is_refused_by_name_and_the_connection_goes_on(hosts):
    with ExpertHostClient(hosts.addresses[0], transport="tcp") as probe:
        port = _tcp_port(probe)
    host = hosts.addresses[0].rpartition(":")[0]
    with socket.create_connection((host, port), timeout=10) as peer:
        peer.sendall(lists_bytes(5, RoutedCall.packed(0, [0], [2], torch.arange(2)), HIDDEN, torch.float32, apart=True))
        head = bytearray(REPLY.size)
        assert receive_into(peer, memoryview(head))
        reply = decode_reply_head(head)
        text = bytearray(reply.body_bytes)
        assert receive_into(peer, memoryview(text))
        assert not reply.ok and reply.call_id == 5 and b"travel apart" in text
        x = torch.randn(2, HIDDEN)  # a plain frame on the same connection is answered
        peer.sendall(lists_bytes(6, RoutedCall.packed(0, [0], [2], torch.arange(2)), HIDDEN, torch.float32)
                     + x.numpy().tobytes())
        assert receive_into(peer, memoryview(head)) and decode_reply_head(head).ok and decode_reply_head(head).call_id == 6


def test_a_host_without_nixl_says_so_and_plain_tcp_still_works(store):
    with launch_local_hosts(1, store.root, metrics=False, nixl=False) as group:
        x = torch.randn(4, HIDDEN)
        call = RoutedCall.packed(0, [0], [4], torch.arange(4))
        with ExpertHostClient(group.addresses[0], transport="nixl") as client:
            with pytest.raises(ExpertHostError, match=r"takes no NIXL offer: NIXL is turned off .*--no-nixl.*transport 'tcp'"):
                client.submit(call, x).result()
        with ExpertHostClient(group.addresses[0], transport="tcp") as client:
            torch.testing.assert_close(client.submit(call, x).result().z, expert_forward(store.load(0, 0), x),
                                       rtol=1e-5, atol=1e-6)


def test_a_link_larger_than_the_host_allows_is_refused_by_name_and_the_connection_goes_on(hosts):
    with ExpertHostClient(hosts.addresses[0], transport="tcp") as probe:
        port = _tcp_port(probe)
    with socket.create_connection((hosts.addresses[0].rpartition(":")[0], port), timeout=10) as peer:
        peer.sendall(HELLO.pack(HELLO_MAGIC, 5, (1 << 30) + 1) + b"offer")  # the host allocates nothing for it
        head = bytearray(REPLY.size)
        assert receive_into(peer, memoryview(head))
        reply = decode_reply_head(head)
        text = bytearray(reply.body_bytes)
        assert receive_into(peer, memoryview(text))
        assert not reply.ok and b"a NIXL link of 1073741825 bytes per region; ask for 1 to 1073741824" in text
        x = torch.randn(2, HIDDEN)  # a plain frame on the same connection is answered
        peer.sendall(lists_bytes(6, RoutedCall.packed(0, [0], [2], torch.arange(2)), HIDDEN, torch.float32)
                     + x.numpy().tobytes())
        assert receive_into(peer, memoryview(head)) and decode_reply_head(head).ok


def test_a_link_refuses_an_offer_that_is_not_one():
    link = NixlLink("test", 1024)
    try:
        with pytest.raises(NixlError, match="too short"):
            link.connect(b"MRH1")
        with pytest.raises(NixlError, match="malformed"):
            link.connect(struct.pack("<QQiB3xII", 0, 999, 0, 0, 0, 0))
    finally:
        link.close()


def test_a_buffer_nixl_cannot_register_is_a_nixl_error_that_says_what_to_install(monkeypatch):
    """On an H200 with CUDA 13, nixl-cu12's UCX refused GPU memory with its binding's own exception
    (no NixlError, no RuntimeError): the host's HELLO handler let it through and dropped the client."""
    api = nixl_api()
    bindings = importlib.import_module(api.__name__.rpartition(".")[0] + "._bindings")

    class Refusing(api.nixl_agent):
        def register_memory(self, *args, **kwargs):
            raise bindings.nixlBackendError("NIXL_ERR_BACKEND")

    monkeypatch.setattr(api, "nixl_agent", Refusing)
    with pytest.raises(NixlError, match=r"registering 2048 bytes of DRAM on cpu .*nixl-cu13 beside CUDA 13.*NIXL_ERR_BACKEND"):
        NixlLink("test", 1024)


def test_a_client_whose_link_cannot_register_gets_one_error_naming_the_host(hosts, monkeypatch):
    import moeless.expert_fn.client.tcp_channel as tcp_channel

    def refuse(role, capacity, device):
        raise NixlError("registering 64 bytes of VRAM on cuda:0 failed: nixlBackendError: NIXL_ERR_BACKEND")

    monkeypatch.setattr(tcp_channel, "NixlLink", refuse)
    with ExpertHostClient(hosts.addresses[0], transport="nixl") as client:
        with pytest.raises(ExpertHostError, match=r"TCP channel .*: no NIXL link on cpu: registering 64 bytes of VRAM"):
            client.submit(RoutedCall.packed(0, [0], [2], torch.arange(2)), torch.randn(2, HIDDEN)).result()


def test_nixl_is_taken_from_the_build_for_torchs_cuda(monkeypatch):
    monkeypatch.setattr("torch.version.cuda", "13.0")
    assert _backends()[0] == "nixl_cu13._api"
    monkeypatch.setattr("torch.version.cuda", "12.8")
    assert _backends()[0] == "nixl_cu12._api"
    monkeypatch.setattr("torch.version.cuda", None)  # a CPU build: the declared order
    assert _backends() == BACKENDS


def test_the_apart_heads_are_the_documented_layout():
    """Golden bytes: the NIXL frame's head is HEAD with its own magic, and nothing follows the lists."""
    call = RoutedCall(3, [1], [1], torch.tensor([0]), torch.tensor([0], dtype=torch.int32),
                      torch.tensor([0], dtype=torch.int32), torch.tensor([0.5]), 1)
    frame = lists_bytes(7, call, 2, torch.float32, apart=True)
    assert frame[:HEAD.size] == struct.pack("<4sIiiiiiiB3x", b"MRC2", 7, 3, 1, 1, 1, 1, 2, 0)
    assert frame[HEAD.size:] == struct.pack("<iiiif", 1, 1, 0, 0, 0.5)
