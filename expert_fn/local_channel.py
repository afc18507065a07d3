"""The client side of the local channel (see local_channel_server.py): packed calls through shared memory.

    channel = LocalChannel(socket_name, timeout_s=30)   # from the host's LocalChannel RPC
    pending = channel.submit(layer, experts, counts, x, rows)   # x[rows] written into shared memory
    result = pending.result()   # PackedResult; result.y is a view of shared memory

The buffer is a memfd handed to the host over the socket (SCM_RIGHTS), so nothing is left in
/dev/shm when either side dies, and it only works where the host truly shares this machine.
One call at a time per channel (a lock spans submit .. result); y stays valid until the next
submit. A dead host (EOF, reset, refused) or a timeout raises ExpertHostUnavailable, and the
channel is then broken for good: the caller opens a new one once the host is back.
"""

from __future__ import annotations

import mmap
import os
import socket
import threading
from typing import Sequence

import torch

from moeless.expert_fn.errors import ERRORS_BY_KIND, ExpertHostError, ExpertHostUnavailable
from moeless.expert_fn.packed import BUFFER, BUFFER_MAGIC, PackedResult, decode_reply, encode_call

INITIAL_BYTES = 4 << 20  # grows by doubling when a call needs more (a long prefill)


class LocalChannel:
    """A shared-memory channel to the expert host listening on abstract socket `name`."""

    def __init__(self, name: str, timeout_s: float = 30.0):
        self.name = name
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect("\0" + name)
        except OSError as err:
            self._sock.close()
            raise ExpertHostUnavailable(f"local channel {name}: cannot connect ({err})") from None
        self._buffer: mmap.mmap | None = None
        self._floats: torch.Tensor | None = None
        self.broken = False

    def submit(self, layer: int, experts: Sequence[int], counts: Sequence[int], x: torch.Tensor,
               rows: torch.Tensor) -> "_Pending":
        """Send x[rows] (x: [T, H] float32 contiguous, rows: [n] long, expert-major as `counts`)."""
        self._lock.acquire()
        try:
            if self.broken:
                raise ExpertHostUnavailable(f"local channel {self.name} is closed; open a new one")
            n, hidden = int(rows.numel()), int(x.shape[1])
            self._reserve(n * hidden * 4)
            view = self._floats[:n * hidden].view(n, hidden)
            torch.index_select(x, 0, rows, out=view)
            self._send(encode_call(layer, experts, counts, hidden))
            return _Pending(self, view)
        except BaseException:
            self._lock.release()
            raise

    def close(self) -> None:
        with self._lock:
            self._break()

    # --- internals ----------------------------------------------------------------------------

    def _reserve(self, nbytes: int) -> None:
        """Make the shared buffer at least nbytes (a new memfd, handed to the host)."""
        if self._buffer is not None and len(self._buffer) >= nbytes:
            return
        size = max(INITIAL_BYTES, 1 << (nbytes - 1).bit_length())
        fd = os.memfd_create("moeless-local-channel", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            buffer = mmap.mmap(fd, size)
            try:
                socket.send_fds(self._sock, [BUFFER.pack(BUFFER_MAGIC, size)], [fd])
            except OSError as err:
                buffer.close()
                self._fail(f"cannot hand over the shared buffer ({err})")
        finally:
            os.close(fd)
        self._floats = None  # drop the view of the old buffer before closing it
        if self._buffer is not None:
            self._buffer.close()
        self._buffer = buffer
        self._floats = torch.frombuffer(buffer, dtype=torch.float32)

    def _send(self, msg: bytes) -> None:
        try:
            self._sock.send(msg)
        except OSError as err:
            self._fail(f"send failed ({err})")

    def _receive(self) -> bytes:
        try:
            msg = self._sock.recv(1 << 16)
        except socket.timeout:
            self._fail(f"no answer within {self.timeout_s} s")
        except OSError as err:
            self._fail(f"receive failed ({err})")
        if not msg:
            self._fail("the host closed the connection (it died or is stopping)")
        return msg

    def _fail(self, why: str) -> None:
        self._break()
        raise ExpertHostUnavailable(f"local channel {self.name}: {why}")

    def _break(self) -> None:
        self.broken = True
        self._sock.close()


class _Pending:
    """The call in flight on a LocalChannel (its lock is held until result() first returns)."""

    def __init__(self, channel: LocalChannel, view: torch.Tensor):
        self._channel, self._view = channel, view
        self._outcome: PackedResult | BaseException | None = None

    def result(self) -> PackedResult:
        if self._outcome is None:
            try:
                self._outcome = self._wait()
            except BaseException as err:
                self._outcome = err
            finally:
                self._channel._lock.release()
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        return self._outcome

    def _wait(self) -> PackedResult:
        channel = self._channel
        try:
            ok, cold, compute, kind, message = decode_reply(channel._receive())
        except ValueError as err:
            channel._fail(str(err))
        if not ok:
            raise ERRORS_BY_KIND.get(kind, ExpertHostError)(message)
        return PackedResult(self._view, cold, compute)
