"""The client side of the local channel (see local_channel_server.py): routed calls through shared memory.

    channel = LocalChannel(socket_name, timeout_s=30)   # from the host's LocalChannel RPC
    pending = channel.submit(call, x)   # the frame: head, lists, x[call.tokens], written into shared memory
    result = pending.result()           # RoutedResult; result.z is a view of shared memory

The shared buffer holds the whole routed call's frame (expert_fn/wire/routed.py) at offset 0, each
token's row once, copied from x straight into it (one index_select) in x's dtype; the host
writes z [n_out, H] in that dtype after it, at the frame's size rounded up to 64 bytes. Only a
tiny control message crosses the socket each way (CALL; routed's REPLY), whatever the call's
size. The buffer is a memfd handed to the host over the socket (SCM_RIGHTS), so nothing is
left in /dev/shm when either side dies, and it only works where the host truly shares this
machine; it grows by doubling (a new memfd) to the largest call.

Rows on a GPU (x on CUDA) stay there: the channel hands the host a device buffer once (cuda_ipc.py)
and each call copies the token rows into it (one index_select on the GPU); the host reads them in
place and writes z there, so result.z is then a view of that GPU buffer. Only the head and the
pair lists go through shared memory.

One call at a time per channel (a lock spans submit .. result); z stays valid until the next
submit. A dead host (EOF, reset, refused) or a timeout raises ExpertHostUnavailable, and the
channel is then broken for good: the caller opens a new one once the host is back. A host error
is raised with its class and the host's message, naming the call; the channel goes on.
"""

from __future__ import annotations

import functools
import mmap
import os
import socket
import threading

import torch

from moeless.expert_fn.wire.cuda_ipc import describe
from moeless.expert_fn.errors import ERRORS_BY_KIND, ExpertHostError, ExpertHostUnavailable
from moeless.expert_fn.wire.polling import DEFAULT_CLIENT_POLL_S, Poller
from moeless.expert_fn.host.local_channel_server import (
    BUFFER,
    BUFFER_MAGIC,
    CALL,
    CALL_DEVICE,
    CALL_DEVICE_MAGIC,
    CALL_MAGIC,
    z_offset,
)
from moeless.expert_fn.wire.routed import (
    REPLY,
    HeldCall,
    RoutedCall,
    RoutedResult,
    decode_reply_head,
    lists_bytes,
    split_error,
    write_call,
)

INITIAL_BYTES = 4 << 20  # grows by doubling when a call needs more (a long prefill)
MAX_REPLY_BYTES = 1 << 16  # REPLY and, for an error, its text


def _grown(nbytes: int) -> int:
    """The size of a new buffer that holds nbytes: a power of two, at least INITIAL_BYTES."""
    return max(INITIAL_BYTES, 1 << (nbytes - 1).bit_length())


class LocalChannel:
    """A shared-memory channel to the expert host listening on abstract socket `name`."""

    def __init__(self, name: str, timeout_s: float = 30.0, poll_s: float = DEFAULT_CLIENT_POLL_S):
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
        self._poller = Poller(self._sock, poll_s)  # spin for the answer before blocking (polling.py)
        self._buffer: mmap.mmap | None = None
        self._gpu_buffer: torch.Tensor | None = None  # rows and z of calls whose x is on a GPU
        self._calls = 0
        self.broken = False

    def submit(self, call: RoutedCall, x: torch.Tensor) -> HeldCall:
        """Send call with the rows x[call.tokens] (x: [T, H] contiguous, in the dtype they travel in)."""
        self._lock.acquire()
        try:
            if self.broken:
                raise ExpertHostUnavailable(f"local channel {self.name} is closed; open a new one")
            self._calls += 1
            on_gpu = x.device.type == "cuda"
            message, z_at = self._write_on_gpu(call, x) if on_gpu else self._write(call, x)
            self._send(message)
            return HeldCall(self._lock, functools.partial(self._wait, self._calls, call.layer, z_at, on_gpu))
        except BaseException:
            self._lock.release()
            raise

    def close(self) -> None:
        with self._lock:
            self._break()

    # --- internals ----------------------------------------------------------------------------

    def _write(self, call: RoutedCall, x: torch.Tensor) -> tuple[bytes, int]:
        """The whole frame into shared memory -> (CALL, z's offset there)."""
        frame = call.request_bytes(x.shape[1], x.dtype)
        z_at = z_offset(frame)
        self._reserve(z_at + call.n_out * x.shape[1] * x.element_size())
        write_call(self._buffer, self._calls, call, x)
        return CALL.pack(CALL_MAGIC, frame, z_at), z_at

    def _write_on_gpu(self, call: RoutedCall, x: torch.Tensor) -> tuple[bytes, int]:
        """HEAD and the lists into shared memory, the rows into the GPU buffer at 0 -> (CALL_DEVICE,
        z's offset in the GPU buffer)."""
        hidden, item = x.shape[1], x.element_size()
        lists = lists_bytes(self._calls, call, hidden, x.dtype)
        self._reserve(len(lists))
        self._buffer[:len(lists)] = lists
        rows = int(call.tokens.numel())
        z_at = z_offset(rows * hidden * item)
        gpu = self._reserve_gpu(z_at + call.n_out * hidden * item, x.device)
        if rows:
            torch.index_select(x, 0, call.tokens.to(x.device), out=gpu[:rows * hidden * item].view(x.dtype).view(rows, hidden))
        torch.cuda.current_stream(x.device).synchronize()  # the rows are in place before the host reads them
        return CALL_DEVICE.pack(CALL_DEVICE_MAGIC, len(lists), 0, z_at), z_at

    def _reserve_gpu(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A GPU buffer of at least nbytes on `device`, handed to the host when new (it grows by doubling)."""
        gpu = self._gpu_buffer
        if gpu is not None and gpu.numel() >= nbytes and gpu.device == device:
            return gpu
        size = _grown(nbytes)
        gpu = torch.empty(size, dtype=torch.uint8, device=device)
        self._send(describe(gpu))
        # The old buffer is freed with the last z the caller still holds of it (torch keeps it).
        self._gpu_buffer = gpu
        return gpu

    def _reserve(self, nbytes: int) -> None:
        """Make the shared buffer at least nbytes (a new memfd, handed to the host)."""
        if self._buffer is not None and len(self._buffer) >= nbytes:
            return
        size = _grown(nbytes)
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
        # The old mapping is not closed here: a z the caller still holds keeps it (torch.frombuffer
        # holds a reference), and it is unmapped with the last such view.
        self._buffer = buffer

    def _send(self, msg: bytes) -> None:
        try:
            self._sock.send(msg)
        except OSError as err:
            self._fail(f"send failed ({err})")

    def _receive(self) -> bytes:
        try:
            msg = self._sock.recv(MAX_REPLY_BYTES)
        except socket.timeout:
            self._fail(f"no answer within {self.timeout_s} s")
        except OSError as err:
            self._fail(f"receive failed ({err})")
        if not msg:
            self._fail("the host closed the connection (it died or is stopping)")
        return msg

    def _wait(self, call_id: int, layer: int, z_at: int, on_gpu: bool) -> RoutedResult:
        """Read the answer to call `call_id` (the lock is held)."""
        self._poller.wait()
        msg = self._receive()
        where = f"local channel {self.name}, call {call_id} (layer {layer})"
        try:
            head = decode_reply_head(msg)
        except ValueError as err:
            self._break()
            raise ExpertHostError(f"{where}: {err}; the channel is closed") from None
        if head.call_id not in (call_id, 0) or len(msg) != REPLY.size + (0 if head.ok else head.body_bytes):
            self._break()
            raise ExpertHostError(f"{where}: the reply (to call {head.call_id}, {len(msg)} bytes) is not this "
                                  "call's; the channel is closed")
        if not head.ok:
            kind, message = split_error(msg[REPLY.size:])
            raise ERRORS_BY_KIND.get(kind, ExpertHostError)(f"{where}: {message}")
        count = head.n_out * head.hidden
        if on_gpu:
            z = self._gpu_buffer[z_at:z_at + count * head.dtype.itemsize].view(head.dtype)
        else:
            z = torch.frombuffer(self._buffer, dtype=head.dtype, offset=z_at, count=count) \
                if count else torch.empty(0, dtype=head.dtype)
        return RoutedResult(z.view(head.n_out, head.hidden), head.cold_starts, head.compute_s)

    def _fail(self, why: str) -> None:
        self._break()
        raise ExpertHostUnavailable(f"local channel {self.name}: {why}")

    def _break(self) -> None:
        self.broken = True
        self._sock.close()
