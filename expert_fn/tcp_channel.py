"""The client side of the TCP channel (tcp_server.py): routed calls as frames over one TCP connection.

    channel = TcpChannel("10.0.0.7:41233", timeout_s=30)   # the port from the host's offer
    pending = channel.submit(call, x)   # the frame: head, lists, x[call.tokens], written into one buffer
    result = pending.result()           # RoutedResult; result.z is a view of the receive buffer

Both buffers are allocated once and grow by doubling to the largest call; the token rows are
copied from x straight into the send buffer (one index_select), and the answer is read straight
into the receive buffer. One call at a time per channel (a lock spans submit .. result); z stays
valid until the next submit. A dead host (EOF, reset, refused) or a timeout raises
ExpertHostUnavailable, and the channel is then broken for good: the caller opens a new one once
the host is back. A reply that is not a frame of ours, or answers another call, is an
ExpertHostError naming the host and the call, and breaks the channel too.
"""

from __future__ import annotations

import functools
import socket
import threading

import torch

from moeless.expert_fn.errors import ERRORS_BY_KIND, ExpertHostError, ExpertHostUnavailable
from moeless.expert_fn.polling import DEFAULT_CLIENT_POLL_S, Poller
from moeless.expert_fn.routed import (
    HeldCall,
    REPLY,
    RoutedCall,
    RoutedResult,
    decode_reply_head,
    split_error,
    write_call,
)
from moeless.expert_fn.tcp_server import receive_into, send_parts

INITIAL_BYTES = 1 << 20


class TcpChannel:
    """A TCP connection to the expert host's stream port at `address` ("host:port")."""

    def __init__(self, address: str, timeout_s: float = 30.0, poll_s: float = DEFAULT_CLIENT_POLL_S):
        self.address = address
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        host, _, port = address.rpartition(":")
        try:
            self._sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
        except OSError as err:
            raise ExpertHostUnavailable(f"TCP channel {address}: cannot connect ({err})") from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._poller = Poller(self._sock, poll_s)  # spin for the answer before blocking (polling.py)
        self._send = bytearray(INITIAL_BYTES)
        self._receive = bytearray(INITIAL_BYTES)
        self._reply_head = bytearray(REPLY.size)
        self._calls = 0
        self.broken = False

    def submit(self, call: RoutedCall, x: torch.Tensor) -> HeldCall:
        """Send call with the rows x[call.tokens] (x: [T, H] contiguous, in the dtype they travel in)."""
        self._lock.acquire()
        try:
            if self.broken:
                raise ExpertHostUnavailable(f"TCP channel {self.address} is closed; open a new one")
            self._calls += 1
            total = call.request_bytes(x.shape[1], x.dtype)
            if len(self._send) < total:
                self._send = bytearray(1 << (total - 1).bit_length())
            write_call(self._send, self._calls, call, x)
            try:
                send_parts(self._sock, [memoryview(self._send)[:total]])
            except OSError as err:
                self._fail(f"send failed ({err})")
            return HeldCall(self._lock, functools.partial(self._wait, self._calls, call.layer))
        except BaseException:
            self._lock.release()
            raise

    def close(self) -> None:
        with self._lock:
            self._break()

    def _read(self, view: memoryview) -> None:
        try:
            if not receive_into(self._sock, view):
                self._fail("the host closed the connection (it died or is stopping)")
        except socket.timeout:
            self._fail(f"no answer within {self.timeout_s} s")
        except OSError as err:
            self._fail(f"receive failed ({err})")

    def _wait(self, call_id: int, layer: int) -> RoutedResult:
        """Read the answer to call `call_id` (the lock is held)."""
        self._poller.wait()
        self._read(memoryview(self._reply_head))
        where = f"expert host {self.address}, call {call_id} (layer {layer})"
        try:
            head = decode_reply_head(self._reply_head)
        except ValueError as err:
            self._break()
            raise ExpertHostError(f"{where}: {err}; the connection is closed") from None
        if head.call_id != call_id and head.call_id != 0:
            self._break()
            raise ExpertHostError(f"{where}: the reply answers call {head.call_id}; the connection is closed")
        if len(self._receive) < head.body_bytes:
            self._receive = bytearray(1 << (head.body_bytes - 1).bit_length())
        body = memoryview(self._receive)[:head.body_bytes]
        self._read(body)
        if not head.ok:
            kind, message = split_error(bytes(body))
            if head.call_id == 0:  # the host could not read our head: it hung up
                self._break()
            raise ERRORS_BY_KIND.get(kind, ExpertHostError)(f"{where}: {message}")
        count = head.n_out * head.hidden
        z = torch.frombuffer(self._receive, dtype=head.dtype, count=count).view(head.n_out, head.hidden) \
            if count else torch.empty(head.n_out, head.hidden, dtype=head.dtype)
        return RoutedResult(z, head.cold_starts, head.compute_s)

    def _fail(self, why: str) -> None:
        self._break()
        raise ExpertHostUnavailable(f"TCP channel {self.address}: {why}")

    def _break(self) -> None:
        self.broken = True
        self._sock.close()
