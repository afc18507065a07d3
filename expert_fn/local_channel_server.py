"""The host side of the local channel: packed calls through shared memory, for clients on this machine.

gRPC costs about 1 ms per call on loopback (protobuf, HTTP/2 framing, several thread hops),
several times a decode step's expert compute. A client on the same machine instead connects to
this Unix socket (abstract namespace: no file, gone with the process) and hands over a memfd;
each call is then one small message each way, with the tokens read from and the outputs written
back into that shared memory in place. gRPC stays the control plane (load, evict, status,
health) and the data plane for hosts on other machines.

Each connection is served by its own thread (a ModelServer replica has one connection per host),
with the host's torch thread count. A draining host answers calls with ExpertHostUnavailable.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import threading
import uuid

import torch

from moeless.expert_fn.errors import ExpertHostError, ExpertHostUnavailable
from moeless.expert_fn.packed import (
    BUFFER,
    BUFFER_MAGIC,
    decode_call,
    encode_error,
    encode_reply,
    run_packed,
)

log = logging.getLogger(__name__)

MAX_CONTROL_BYTES = 1 << 16  # a call's header: 20 bytes + 8 per expert


class LocalChannelServer:
    """Listens on an abstract Unix socket; `name` is what the LocalChannel RPC hands to clients."""

    def __init__(self, runtime, threads: int = 1):
        self.runtime = runtime
        self.threads = threads
        self.name = f"moeless-expert-host-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind("\0" + self.name)
        self._listener.listen(64)
        self._connections: set[socket.socket] = set()
        self._workers: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closing = False
        self._acceptor = threading.Thread(target=self._accept, name="local-channel-accept", daemon=True)
        self._acceptor.start()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop accepting; let each connection finish the call it is running, then close it."""
        with self._lock:
            self._closing = True
            connections = list(self._connections)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for conn in connections:  # wakes a thread blocked in recv; a running call still sends its reply
            try:
                conn.shutdown(socket.SHUT_RD)
            except OSError:
                pass
        for worker in list(self._workers):
            worker.join(timeout_s)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            with self._lock:
                if self._closing:
                    conn.close()
                    return
                self._connections.add(conn)
            worker = threading.Thread(target=self._serve, args=(conn,), name="local-channel", daemon=True)
            self._workers.append(worker)
            worker.start()

    def _serve(self, conn: socket.socket) -> None:
        """One client's calls, in order, until it disconnects or the host closes."""
        torch.set_num_threads(self.threads)  # OpenMP's count is per thread
        buffer: mmap.mmap | None = None
        try:
            while True:
                msg, fds, _, _ = socket.recv_fds(conn, MAX_CONTROL_BYTES, 1)
                if not msg:
                    return
                if msg[:4] == BUFFER_MAGIC:
                    buffer = self._map(msg, fds, buffer)
                    continue
                conn.send(self._call(msg, buffer))
        except OSError as err:
            log.info("local channel closed: %s", err)
        finally:
            if buffer is not None:
                buffer.close()
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    @staticmethod
    def _map(msg: bytes, fds: list[int], old: mmap.mmap | None) -> mmap.mmap:
        """The client's new shared buffer (it grows by sending a bigger one)."""
        _, size = BUFFER.unpack(msg)
        if len(fds) != 1:
            raise OSError("a buffer message came without its memfd")
        try:
            return mmap.mmap(fds[0], size)
        finally:
            os.close(fds[0])
            if old is not None:
                old.close()

    def _call(self, msg: bytes, buffer: mmap.mmap | None) -> bytes:
        """One packed call; the reply (outputs are in the buffer) or an error reply."""
        try:
            if self.runtime.health != "serving":
                raise ExpertHostUnavailable(f"expert host is {self.runtime.health}; route to another host")
            layer, experts, counts, n, hidden = decode_call(msg)
            if buffer is None or n * hidden * 4 > len(buffer):
                raise ExpertHostError(f"a call of {n} x {hidden} float32 does not fit the shared buffer")
            x = torch.frombuffer(buffer, dtype=torch.float32, count=n * hidden).view(n, hidden)
            result = run_packed(self.runtime, layer, experts, counts, x, out=x)
            return encode_reply(result.cold_starts, result.compute_s)
        except ExpertHostError as err:
            return encode_error(err.kind, str(err))
        except Exception as err:  # the client gets the failure instead of a hang
            log.exception("local channel call failed")
            return encode_error(ExpertHostError.kind, f"{type(err).__name__}: {err}")
