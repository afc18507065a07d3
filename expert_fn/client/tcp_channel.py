"""The client side of the TCP channel (tcp_server.py): routed calls as frames over one TCP connection.

    channel = TcpChannel("10.0.0.7:41233", timeout_s=30)   # the port from the host's offer
    pending = channel.submit(call, x)   # the frame: head, lists, x[call.tokens], written into one buffer
    result = pending.result()           # RoutedResult; result.z is a view of the receive buffer

Both buffers are allocated once and grow by doubling to the largest call; the token rows are
copied from x straight into the send buffer (one index_select), and the answer is read straight
into the receive buffer.

With nixl_bytes > 0 (transport "nixl") the rows and z travel through NIXL instead (nixl_link.py):
at the first call the channel makes a link on x's device (GPU memory on a GPU replica: no staging
through host memory) and offers it to the host with a HELLO; each call then gathers its rows
into the link's buffer, WRITEs them into the host's and sends only the head and the pair lists
on the socket; the host WRITEs z back, and result.z is a view of the link's buffer. A call whose
rows or z exceed nixl_bytes goes as a plain frame. A host that cannot take the offer (no nixl
there, or turned off) is an ExpertHostError that says so; a transfer that fails breaks the
channel (ExpertHostUnavailable), as a dead socket does.

One call at a time per channel (a lock spans submit .. result); z stays valid until the next
submit. A dead host (EOF, reset, refused) or a timeout raises ExpertHostUnavailable, and the
channel is then broken for good: the caller opens a new one once the host is back. A reply that is not a frame of ours, or answers another call, is an
ExpertHostError naming the host and the call, and breaks the channel too.
"""

from __future__ import annotations

import functools
import socket
import threading

import torch

from moeless.expert_fn.errors import ERRORS_BY_KIND, ExpertHostError, ExpertHostUnavailable
from moeless.expert_fn.wire.nixl_link import NixlError, NixlLink
from moeless.expert_fn.wire.polling import DEFAULT_CLIENT_POLL_S, Poller
from moeless.expert_fn.wire.routed import (
    HeldCall,
    REPLY,
    RoutedCall,
    RoutedResult,
    decode_reply_head,
    item_bytes,
    lists_bytes,
    split_error,
    staged,
    write_call,
)
from moeless.expert_fn.host.tcp_server import HELLO, HELLO_MAGIC, MAX_OFFER_BYTES, note, peer_gone, receive_into, send_parts

INITIAL_BYTES = 1 << 20


class TcpChannel:
    """A TCP connection to the expert host's stream port at `address` ("host:port")."""

    def __init__(self, address: str, timeout_s: float = 30.0, poll_s: float = DEFAULT_CLIENT_POLL_S,
                 nixl_bytes: int = 0):
        self.address = address
        self.timeout_s = timeout_s
        self.nixl_bytes = nixl_bytes  # > 0: rows and z through NIXL, each call's up to this many bytes
        self._link: NixlLink | None = None
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
            item, hidden = item_bytes(x.dtype), x.shape[1]
            apart = bool(self.nixl_bytes) and max(int(call.tokens.numel()), call.n_out) * hidden * item <= self.nixl_bytes
            if apart:
                self._submit_apart(call, x)
            else:
                self._submit_frame(*staged(call, x) if x.device.type != "cpu" else (call, x))
            return HeldCall(self._lock, functools.partial(self._wait, self._calls, call.layer, apart))
        except BaseException:
            self._lock.release()
            raise

    @property
    def takes_device_rows(self) -> bool:
        """Whether rows on a GPU go as they are (through NIXL) rather than staged by the caller."""
        return self.nixl_bytes > 0

    def _submit_frame(self, call: RoutedCall, x: torch.Tensor) -> None:
        """The whole frame (head, lists, rows) on the socket."""
        total = call.request_bytes(x.shape[1], x.dtype)
        if len(self._send) < total:
            self._send = bytearray(1 << (total - 1).bit_length())
        write_call(self._send, self._calls, call, x)
        try:
            send_parts(self._sock, [memoryview(self._send)[:total]])
        except OSError as err:
            self._fail(f"send failed ({err})")

    def _submit_apart(self, call: RoutedCall, x: torch.Tensor) -> None:
        """The rows into the host's NIXL buffer, the head and lists on the socket."""
        link = self._link_on(x.device)
        rows, hidden = int(call.tokens.numel()), x.shape[1]
        nbytes = rows * hidden * x.element_size()
        if rows:
            torch.index_select(x, 0, call.tokens.to(x.device), out=link.region(0, nbytes).view(x.dtype).view(rows, hidden))
        if x.device.type == "cuda":
            torch.cuda.current_stream(x.device).synchronize()  # the rows are in place before NIXL reads them
        try:  # posted, not waited for: the caller's other hosts' calls go out meanwhile (_wait finishes it)
            link.post_write(0, nbytes, note(self._calls))
            send_parts(self._sock, [lists_bytes(self._calls, call, hidden, x.dtype, apart=True)])
        except OSError as err:
            self._fail(f"send failed ({err})")
        except NixlError as err:
            self._fail(str(err))

    def _link_on(self, device: torch.device) -> NixlLink:
        """This channel's NIXL link on `device`, offered to the host when new (HELLO)."""
        if self._link is not None and self._link.buffer.device == device:
            return self._link
        if self._link is not None:
            self._link.close()
            self._link = None
        try:
            link = NixlLink("client", self.nixl_bytes, device)
        except ImportError as err:
            raise ExpertHostError(f"TCP channel {self.address}: transport 'nixl' needs NIXL here: {err}") from None
        except NixlError as err:
            raise ExpertHostError(f"TCP channel {self.address}: no NIXL link on {device}: {err}") from None
        try:
            mine = link.offer()
            send_parts(self._sock, [HELLO.pack(HELLO_MAGIC, len(mine), self.nixl_bytes), mine])
            answer = bytearray(HELLO.size)
            self._read(memoryview(answer))
            if bytes(answer[:4]) != HELLO_MAGIC:  # an error reply: the host cannot take NIXL
                text = bytes(self._read_body(decode_reply_head(answer)))
                raise ExpertHostError(f"expert host {self.address} takes no NIXL offer: {split_error(text)[1]}; "
                                      "use transport 'tcp' or install nixl there")
            _, size, _ = HELLO.unpack_from(answer)
            if size > MAX_OFFER_BYTES:
                self._fail(f"the host's NIXL offer of {size} bytes is too large")
            offer = bytearray(size)
            self._read(memoryview(offer))
            link.connect(bytes(offer))
        except OSError as err:
            link.close()
            self._fail(f"NIXL handshake failed ({err})")
        except (ValueError, NixlError) as err:
            link.close()
            self._fail(f"NIXL handshake failed: {err}")
        except BaseException:
            link.close()
            raise
        self._link = link
        return link

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

    def _wait(self, call_id: int, layer: int, apart: bool = False) -> RoutedResult:
        """Read the answer to call `call_id` (the lock is held); apart: its rows went through NIXL."""
        if apart:
            try:  # the rows' WRITE, driven to its end (the host's wait for its note drives it too)
                self._link.finish_write(self.timeout_s, lambda: peer_gone(self._sock))
            except NixlError as err:
                self._fail(str(err))
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
        body = self._read_body(head)
        if not head.ok:
            kind, message = split_error(bytes(body))
            if head.call_id == 0:  # the host could not read our head: it hung up
                self._break()
            raise ERRORS_BY_KIND.get(kind, ExpertHostError)(f"{where}: {message}")
        count = head.n_out * head.hidden
        if head.apart:
            if self._link is None:
                self._break()
                raise ExpertHostError(f"{where}: the host wrote z through NIXL, but no link was offered; "
                                      "the connection is closed")
            try:
                self._link.wait_note(note(call_id), self.timeout_s, lambda: peer_gone(self._sock))
            except NixlError as err:
                self._fail(str(err))
            return RoutedResult(self._link.region(1, count * item_bytes(head.dtype)).view(head.dtype)
                                .view(head.n_out, head.hidden), head.cold_starts, head.compute_s)
        z = torch.frombuffer(self._receive, dtype=head.dtype, count=count).view(head.n_out, head.hidden) \
            if count else torch.empty(head.n_out, head.hidden, dtype=head.dtype)
        return RoutedResult(z, head.cold_starts, head.compute_s)

    def _read_body(self, head) -> memoryview:
        """The body that follows a reply head (z, or a failure's text), read into the receive buffer."""
        if len(self._receive) < head.body_bytes:
            self._receive = bytearray(1 << (head.body_bytes - 1).bit_length())
        body = memoryview(self._receive)[:head.body_bytes]
        self._read(body)
        return body

    def _fail(self, why: str) -> None:
        self._break()
        raise ExpertHostUnavailable(f"TCP channel {self.address}: {why}")

    def _break(self) -> None:
        self.broken = True
        self._sock.close()
        if self._link is not None:
            self._link.close()
            self._link = None
