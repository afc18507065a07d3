"""Busy-polling a data-plane socket before blocking on it: how the data plane keeps its wake-ups short.

A thread that blocks in recv and is woken when a call (or its answer) arrives pays the kernel's
wake-up and then runs on a cold core: measured on this 2-core VM, a routed call's decode and
combine take 1.6-3x longer after a 0.3-5 ms sleep than in a hot loop, and a 36 KB round trip
with both sides blocking costs ~2x one where both spin (docs/serving.md). Data planes made for
this job poll (NCCL, DeepEP and RDMA completion queues busy-poll), so each side spins for up to
`poll_s` before it blocks: a call that comes within that window finds its thread awake.

The price is CPU: a spinning thread holds a core for up to poll_s after each call (the host,
waiting for the next one) or until the answer comes (the client). poll_s = 0 blocks at once.
Python's `sock.recv(..., MSG_DONTWAIT)` still waits on a socket that has a timeout, so the spin
asks poll(2) with a zero timeout instead (it drops the GIL while it asks).
"""

from __future__ import annotations

import os
import select
import socket
import time

DEFAULT_HOST_POLL_S = 0.0
DEFAULT_CLIENT_POLL_S = 0.0


class Poller:
    """Spins until `sock` is readable or poll_s have passed (then the caller's blocking read waits)."""

    def __init__(self, sock: socket.socket, poll_s: float):
        self.poll_s = poll_s
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)

    def wait(self) -> bool:
        """True once the socket is readable (data, EOF or an error to read), False after poll_s."""
        if self.poll_s <= 0:
            return False
        deadline = time.perf_counter() + self.poll_s
        while not self._poll.poll(0):
            if time.perf_counter() > deadline:
                return False
            os.sched_yield()  # a runnable thread that needs this core gets it: the spin only uses idle time
        return True
