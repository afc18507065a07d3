"""The host side of the TCP channel: routed calls as frames over TCP, for clients on other machines.

gRPC costs 0.6-0.8 ms per decode-sized call on loopback and falls off a cliff past 0.5 MB
(protobuf, HTTP/2 framing, several thread hops). A client on another machine (another pod)
instead keeps one TCP connection per host and sends each routed call as one frame
(expert_fn/routed.py): a fixed head, the pair lists and the token rows, read here straight into
a buffer that grows once and is reused; the reply is a head and the output rows, sent from the
tensor's own memory. gRPC stays the control plane (load, evict, status, health, and the offer of
this port).

Each connection is served by its own thread with the host's torch thread count. A bad frame
gets an error reply that names the call and what is wrong; a frame whose head cannot be read
(another protocol, a broken peer) closes that connection, and nothing else. A draining host
answers calls with ExpertHostUnavailable.
"""

from __future__ import annotations

import logging
import socket

import torch

from moeless.expert_fn.errors import BadRequest, ExpertHostError, ExpertHostUnavailable
from moeless.expert_fn.listener import Listener
from moeless.expert_fn.polling import DEFAULT_HOST_POLL_S, Poller
from moeless.expert_fn.routed import HEAD, decode_body, decode_head, encode_error, encode_reply, run_routed

log = logging.getLogger(__name__)


class TcpServer:
    """Listens on TCP (host, port); port 0 takes a free one. `port` is what the host offers clients."""

    def __init__(self, runtime, host: str = "0.0.0.0", port: int = 0, threads: int = 1,
                 poll_s: float = DEFAULT_HOST_POLL_S):
        self.runtime = runtime
        self.threads = threads
        self.poll_s = poll_s  # spin this long for the next call before blocking (polling.py)
        listener = socket.create_server((host, port), backlog=64)
        self.port = listener.getsockname()[1]
        self._listener = Listener(listener, self._serve, "tcp-channel",
                                  lambda conn: conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1))

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop accepting; let each connection finish the call it is running, then close it."""
        self._listener.close(timeout_s)

    def _serve(self, conn: socket.socket) -> None:
        """One client's calls, in order, until it disconnects, sends what is not a frame, or the host closes."""
        torch.set_num_threads(self.threads)  # OpenMP's count is per thread
        head = bytearray(HEAD.size)
        body = bytearray(1 << 20)  # grows by doubling to the largest call seen
        poller = Poller(conn, self.poll_s)
        try:
            while True:
                poller.wait()
                if not receive_into(conn, memoryview(head)):
                    return
                try:
                    call_head = decode_head(head)
                except BadRequest as err:  # not a frame of ours: answer once, then hang up
                    conn.sendall(encode_error(0, BadRequest.kind, str(err)))
                    return
                if len(body) < call_head.body_bytes:
                    body = bytearray(1 << (call_head.body_bytes - 1).bit_length())
                view = memoryview(body)[:call_head.body_bytes]
                if not receive_into(conn, view):
                    return
                self._answer(conn, call_head, view)
        except OSError as err:
            log.info("TCP channel closed: %s", err)

    def _answer(self, conn: socket.socket, head, body: memoryview) -> None:
        """Run one call and send its reply (or an error reply naming the call)."""
        try:
            if self.runtime.health != "serving":
                raise ExpertHostUnavailable(f"expert host is {self.runtime.health}; route to another host")
            z, cold, compute = run_routed(self.runtime, decode_body(head, body))
        except ExpertHostError as err:
            conn.sendall(encode_error(head.call_id, err.kind, str(err)))
            return
        except Exception as err:  # the client gets the failure instead of a hang
            log.exception("TCP channel call %d failed", head.call_id)
            conn.sendall(encode_error(head.call_id, ExpertHostError.kind, f"{type(err).__name__}: {err}"))
            return
        send_parts(conn, [encode_reply(head.call_id, z, cold, compute), memoryview(z.view(torch.uint8).numpy())])


def receive_into(conn: socket.socket, view: memoryview) -> bool:
    """Fill `view` from conn; False if the peer closed before the first byte (a clean end).
    Raises ConnectionError if it closes midway."""
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            if got == 0:
                return False
            raise ConnectionError(f"the peer closed after {got} of {len(view)} bytes")
        got += n
    return True


def send_parts(conn: socket.socket, parts: list) -> None:
    """Send every byte of `parts` (bytes or memoryviews) in order, without joining them first."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        sent = conn.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]
