"""The TCP channel with NIXL moving its rows and z (transport "nixl", nixl_link.py) on real host
processes and a real NIXL/UCX: answers equal the plain TCP channel's bit for bit, a call too large
for the link goes as a frame, bad calls name the host and the call while the channel goes on, a
host that takes no NIXL says so, and a frame that says its rows travel apart on a connection
without a link is refused by name. A host killed mid-call over NIXL: test_tcp_channel.py, over both."""

from __future__ import annotations

import socket
import struct

import pytest
import torch

from moeless.expert_fn.client import ExpertHostClient
from moeless.expert_fn.errors import BadRequest, ExpertHostError
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.expert_fn.nixl_link import NixlError, NixlLink
from moeless.expert_fn.routed import HEAD, REPLY, RoutedCall, decode_reply_head, lists_bytes
from moeless.expert_fn.tcp_channel import TcpChannel
from moeless.expert_fn.tcp_server import receive_into
from moeless.model.experts import expert_forward

from expert_fn_support import HIDDEN


@pytest.fixture(scope="module")
def hosts(store):
    with launch_local_hosts(1, store.root, keep_alive_s=60.0, metrics=False) as group:
        yield group


def _call(layer: int = 0) -> RoutedCall:
    """Tokens 0, 1, 3 of 6; token 0 to experts 0 and 2 (one output row), token 1 to 2, token 3 to 0 and 3."""
    return RoutedCall(layer, [0, 2, 3], [2, 2, 1], torch.tensor([0, 1, 3]),
                      torch.tensor([0, 2, 0, 1, 2], dtype=torch.int32), torch.tensor([0, 1, 0, 2, 3], dtype=torch.int32),
                      torch.tensor([0.25, 0.5, 0.75, 1.0, 0.125]), 4)


def _tcp_port(client: ExpertHostClient) -> str:
    client.status()
    return client._offer().tcp_port


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nixl_answers_as_the_tcp_frame_does_bit_for_bit_in_the_tokens_dtype(hosts, dtype):
    x = torch.randn(6, HIDDEN).to(dtype)
    call = RoutedCall(**{**_call().__dict__, "weight": _call().weight.to(dtype)})
    with ExpertHostClient(hosts.addresses[0], transport="nixl") as nixl, \
            ExpertHostClient(hosts.addresses[0], transport="tcp") as tcp:
        got = [nixl.submit(call, x).result().z.clone() for _ in range(3)]  # the link is reused call after call
        assert nixl.path == "nixl"
        want = tcp.submit(call, x).result().z
    assert got[0].dtype == dtype and got[0].shape == (call.n_out, HIDDEN)
    assert all(torch.equal(z, want) for z in got)


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
        assert channel._link is not None
        torch.testing.assert_close(big[:50], expert_forward(store.load(0, 0), x[:50]), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(small, expert_forward(store.load(0, 1), x[:8]), rtol=1e-5, atol=1e-6)
    finally:
        channel.close()


def test_a_bad_call_names_the_host_and_the_call_and_the_nixl_channel_goes_on(hosts):
    x = torch.randn(4, HIDDEN)
    with ExpertHostClient(hosts.addresses[0], transport="nixl") as client:
        with pytest.raises(BadRequest, match=r"expert host .*, call \d+ \(layer 9\).*layer"):
            client.submit(RoutedCall.packed(9, [0], [4], torch.arange(4)), x).result()  # no layer 9
        wrong = RoutedCall(0, [0], [3], torch.arange(4), torch.arange(4, dtype=torch.int32),
                           torch.arange(4, dtype=torch.int32), torch.ones(4), 4)  # counts say 3 pairs, 4 are sent
        with pytest.raises(BadRequest, match=r"call \d+ \(layer 0\).*add up"):
            client.submit(wrong, x).result()
        assert client.submit(RoutedCall.packed(0, [0], [4], torch.arange(4)), x).result().z.shape == (4, HIDDEN)
        assert client.path == "nixl"


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


def test_a_link_refuses_an_offer_that_is_not_one():
    link = NixlLink("test", 1024)
    try:
        with pytest.raises(NixlError, match="too short"):
            link.connect(b"MRH1")
        with pytest.raises(NixlError, match="malformed"):
            link.connect(struct.pack("<QQiB3xII", 0, 999, 0, 0, 0, 0))
    finally:
        link.close()


def test_the_apart_heads_are_the_documented_layout():
    """Golden bytes: the NIXL frame's head is HEAD with its own magic, and nothing follows the lists."""
    call = RoutedCall(3, [1], [1], torch.tensor([0]), torch.tensor([0], dtype=torch.int32),
                      torch.tensor([0], dtype=torch.int32), torch.tensor([0.5]), 1)
    frame = lists_bytes(7, call, 2, torch.float32, apart=True)
    assert frame[:HEAD.size] == struct.pack("<4sIiiiiiiB3x", b"MRC2", 7, 3, 1, 1, 1, 1, 2, 0)
    assert frame[HEAD.size:] == struct.pack("<iiiif", 1, 1, 0, 0, 0.5)
