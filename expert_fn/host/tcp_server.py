"""The host side of the TCP channel: routed calls as frames over TCP, for clients on other machines.

gRPC costs 0.6-0.8 ms per decode-sized call on loopback and falls off a cliff past 0.5 MB
(protobuf, HTTP/2 framing, several thread hops). A client on another machine (another pod)
instead keeps one TCP connection per host and sends each routed call as one frame
(expert_fn/wire/routed.py): a fixed head, the pair lists and the token rows, read here straight into
a buffer that grows once and is reused; the reply is a head and the output rows, sent from the
tensor's own memory. gRPC stays the control plane (load, evict, status, health, and the offer of
this port).

A client may first say HELLO with a NIXL offer (nixl_link.py): the host then makes a link of its
own on its device for that connection and answers with its offer; from then on a call whose head
says so (routed.CALL_APART_MAGIC) finds its rows written into that link's buffer, and the host
writes z into the client's. A host without NIXL answers the HELLO with an error and the client
sends plain frames.

Each connection is served by its own thread with the host's torch thread count. A bad frame
gets an error reply that names the call and what is wrong; a frame whose head cannot be read
(another protocol, a broken peer) closes that connection, and nothing else. A draining host
answers calls with ExpertHostUnavailable.
"""

from __future__ import annotations

import logging
import select
import socket
import struct

import torch

from moeless.expert_fn.errors import BadRequest, ExpertHostError, refuse_unless_serving
from moeless.expert_fn.host.listener import Listener
from moeless.expert_fn.wire.nixl_link import NixlError, NixlLink, unavailable
from moeless.expert_fn.wire.polling import DEFAULT_HOST_POLL_S, Poller
from moeless.expert_fn.wire.routed import HEAD, decode_body, decode_head, encode_error, encode_reply
from moeless.expert_fn.host.run_routed import run_routed

log = logging.getLogger(__name__)

HELLO = struct.Struct("<4sIQ20x")  # b"MRH1", the offer's bytes (they follow), the link's capacity: HEAD.size long
HELLO_MAGIC = b"MRH1"
MAX_OFFER_BYTES = 1 << 20
MAX_LINK_BYTES = 1 << 30  # a client may ask for a link of up to this many bytes per region (the host allocates it)


class TcpServer:
    """Listens on TCP (host, port); port 0 takes a free one. `port` is what the host offers clients."""

    def __init__(self, runtime, host: str = "0.0.0.0", port: int = 0, threads: int = 1,
                 poll_s: float = DEFAULT_HOST_POLL_S, nixl: bool = True):
        self.runtime = runtime
        self.threads = threads
        self.poll_s = poll_s  # spin this long for the next call before blocking (polling.py)
        self.nixl = nixl  # take clients' NIXL offers (where nixl is installed)
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
        link = None  # this connection's NIXL link, once the client offered one
        try:
            while True:
                poller.wait()
                if not receive_into(conn, memoryview(head)):
                    return
                if bytes(head[:4]) == HELLO_MAGIC:
                    link = self._hello(conn, head, link)
                    continue
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
                self._answer(conn, call_head, view, link)
        except (OSError, NixlError) as err:
            log.info("TCP channel closed: %s", err)
        finally:
            if link is not None:
                link.close()

    def _hello(self, conn: socket.socket, head: bytearray, link):
        """Take the client's NIXL offer: answer with this host's link's (a new link) or an error."""
        _, size, capacity = HELLO.unpack_from(head)
        if size > MAX_OFFER_BYTES:
            raise NixlError(f"a NIXL offer of {size} bytes is larger than {MAX_OFFER_BYTES}")
        offer = bytearray(size)
        if not receive_into(conn, memoryview(offer)):
            raise NixlError("the client left during its HELLO")
        if link is not None:
            link.close()
        why = "NIXL is turned off on this expert host (expert-host --no-nixl)" if not self.nixl else unavailable()
        if why is None and not 0 < capacity <= MAX_LINK_BYTES:
            why = f"a NIXL link of {capacity} bytes per region; ask for 1 to {MAX_LINK_BYTES}"
        if why is not None:
            conn.sendall(encode_error(0, BadRequest.kind, why))
            return None
        try:
            link = NixlLink("host", capacity, self.runtime.device)
            link.connect(bytes(offer))
        except (NixlError, RuntimeError) as err:  # RuntimeError: torch could not allocate the buffer
            conn.sendall(encode_error(0, ExpertHostError.kind, f"no NIXL link: {err}"))
            return None
        mine = link.offer()
        send_parts(conn, [HELLO.pack(HELLO_MAGIC, len(mine), capacity), mine])
        return link

    def _answer(self, conn: socket.socket, head, body: memoryview, link) -> None:
        """Run one call and send its reply (or an error reply naming the call). A call whose rows
        travel apart reads them from the link's buffer and writes z into the client's."""
        if head.apart and link is not None:
            link.wait_note(note(head.call_id), 30.0, lambda: peer_gone(conn))  # the rows have landed (waiting drives UCX)
        try:
            refuse_unless_serving(self.runtime.health)
            if not head.apart:
                z, cold, compute = run_routed(self.runtime, decode_body(head, body))
            else:
                z, cold, compute = self._run_apart(head, body, link)
        except ExpertHostError as err:
            conn.sendall(encode_error(head.call_id, err.kind, str(err)))
            return
        except NixlError:
            raise  # the link is in doubt: the connection closes, the client reconnects
        except Exception as err:  # the client gets the failure instead of a hang
            log.exception("TCP channel call %d failed", head.call_id)
            conn.sendall(encode_error(head.call_id, ExpertHostError.kind, f"{type(err).__name__}: {err}"))
            return
        if head.apart:
            link.post_write(1, z.numel() * z.element_size(), note(head.call_id))
            conn.sendall(encode_reply(head.call_id, z, cold, compute, apart=True))
            link.finish_write(30.0, lambda: peer_gone(conn))  # the client's wait for the note drives UCX meanwhile
            return
        send_parts(conn, [encode_reply(head.call_id, z, cold, compute), memoryview(z.view(torch.uint8).numpy())])

    def _run_apart(self, head, body: memoryview, link):
        """Run a call whose rows the client wrote into the link's region 0; z into its region 1."""
        if link is None:
            decode_body(head, body)  # refuses it: the rows are nowhere
        x_bytes, z_bytes = head.item * head.rows * head.hidden, head.item * head.n_out * head.hidden
        if max(x_bytes, z_bytes) > link.capacity:
            raise BadRequest(f"routed call {head.call_id}: {max(x_bytes, z_bytes)} bytes do not fit the NIXL "
                             f"buffer of {link.capacity}; send them in the frame")
        call = decode_body(head, body, x=link.region(0, x_bytes).view(head.dtype).view(head.rows, head.hidden))
        z = link.region(1, z_bytes).view(head.dtype).view(head.n_out, head.hidden)
        z, cold, compute = run_routed(self.runtime, call, z=z)
        if z.device.type == "cuda":
            torch.cuda.current_stream(z.device).synchronize()  # z is in place before NIXL reads it
        return z, cold, compute


def peer_gone(conn: socket.socket) -> bool:
    """Whether the peer closed its end of conn (checked without reading or blocking)."""
    events = select.poll()
    events.register(conn, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    return bool(events.poll(0))


def note(call_id: int) -> bytes:
    """The notification that comes with a call's rows (or its z)."""
    return b"%d" % call_id


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
