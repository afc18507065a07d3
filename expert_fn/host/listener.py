"""A listening socket whose connections each get a thread: what both data-plane servers share
(local_channel_server.py over a Unix socket, tcp_server.py over TCP).

Each connection is served by its own thread (a ModelServer replica has one connection per host)
until its client disconnects; `close` stops accepting and lets every connection finish the call
it is running.
"""

from __future__ import annotations

import socket
import threading
from typing import Callable


class Listener:
    """Accepts on `sock` (bound and listening) and runs serve(conn) for each connection in a thread
    named `name`; `prepare(conn)` runs first (socket options)."""

    def __init__(self, sock: socket.socket, serve: Callable[[socket.socket], None], name: str,
                 prepare: Callable[[socket.socket], None] | None = None):
        self._listener, self._serve, self._name, self._prepare = sock, serve, name, prepare
        self._connections: set[socket.socket] = set()
        self._workers: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closing = False
        self._acceptor = threading.Thread(target=self._accept, name=f"{name}-accept", daemon=True)
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
            if self._prepare:
                self._prepare(conn)
            worker = threading.Thread(target=self._run, args=(conn,), name=self._name, daemon=True)
            self._workers.append(worker)
            worker.start()

    def _run(self, conn: socket.socket) -> None:
        try:
            self._serve(conn)
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()
