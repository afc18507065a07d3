"""The host side of the local channel: routed calls through shared memory, for clients on this machine.

gRPC costs about 1 ms per call on loopback (protobuf, HTTP/2 framing, several thread hops),
several times a decode step's expert compute. A client on the same machine instead connects to
this Unix socket (abstract namespace: no file, gone with the process) and hands over a memfd
(BUFFER, with the fd). Each call is then one tiny message each way: the client writes the whole
routed call's frame (expert_fn/wire/routed.py: HEAD, the pair lists, each token's row once, in its
own dtype) at the start of that shared memory and sends CALL (the frame's size and where z
goes); the host reads the frame in place, writes z [n_out, H] (the tokens' dtype) at that
offset and answers with routed's REPLY (an error: REPLY, kind, message). gRPC stays the control
plane (load, evict, status, health, and the offer of this socket).

Each connection is served by its own thread (a ModelServer replica has one connection per host),
with the host's torch thread count. A draining host answers calls with ExpertHostUnavailable; a
bad frame, or one that does not fit the shared buffer, gets an error reply naming the call and
the sizes, and the connection goes on.

A caller whose rows are on a GPU also hands over a device buffer (cuda_ipc.py: DESCRIPTION) and
sends CALL_DEVICE: the frame's head and lists in shared memory as above, the rows and z in the
device buffer, at the offsets the message names. The host synchronises its GPU before it answers,
so z is there when the caller reads the reply. A host that cannot map the buffer (no CUDA) says
why in the answer to each such call.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import struct
import uuid

import torch

from moeless.expert_fn.wire.cuda_ipc import DESCRIPTION_MAGIC, MAX_DESCRIPTION_BYTES, DeviceBufferError, open_described
from moeless.expert_fn.errors import BadRequest, ExpertHostError, refuse_unless_serving
from moeless.expert_fn.host.listener import Listener
from moeless.expert_fn.wire.polling import DEFAULT_HOST_POLL_S, Poller
from moeless.expert_fn.wire.routed import HEAD, Head, decode_body, decode_head, encode_error, encode_reply
from moeless.expert_fn.host.run_routed import run_routed

log = logging.getLogger(__name__)

# The control messages (SOCK_SEQPACKET: one message per send); the data is in the shared buffer.
BUFFER = struct.Struct("<4sq")  # b"MLCB", bytes: sent with the memfd that holds frames and z from now on
CALL = struct.Struct("<4sqq")  # b"MLCI", the frame's bytes (at offset 0), z's offset; the reply: routed.REPLY
# b"MLCD", the bytes of HEAD and the lists (at offset 0 of shared memory), x's and z's offsets in the device buffer
CALL_DEVICE = struct.Struct("<4sqqq")
BUFFER_MAGIC, CALL_MAGIC, CALL_DEVICE_MAGIC = b"MLCB", b"MLCI", b"MLCD"
MAX_CONTROL_BYTES = MAX_DESCRIPTION_BYTES  # the largest message towards the host: a device buffer's description


def z_offset(frame_bytes: int) -> int:
    """Where the host writes z: right after the frame, 64-byte aligned."""
    return (frame_bytes + 63) // 64 * 64


class LocalChannelServer:
    """Listens on an abstract Unix socket; `name` is what the LocalChannel RPC hands to clients."""

    def __init__(self, runtime, threads: int = 1, poll_s: float = DEFAULT_HOST_POLL_S):
        self.runtime = runtime
        self.threads = threads
        self.poll_s = poll_s  # spin this long for the next call before blocking (polling.py)
        self.name = f"moeless-expert-host-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind("\0" + self.name)
        listener.listen(64)
        self._listener = Listener(listener, self._serve, "local-channel")

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop accepting; let each connection finish the call it is running, then close it."""
        self._listener.close(timeout_s)

    def _serve(self, conn: socket.socket) -> None:
        """One client's calls, in order, until it disconnects or the host closes."""
        torch.set_num_threads(self.threads)  # OpenMP's count is per thread
        buffer: mmap.mmap | None = None
        gpu_buffer: torch.Tensor | DeviceBufferError | None = None  # the caller's GPU buffer, or why it is not mapped
        poller = Poller(conn, self.poll_s)
        try:
            while True:
                poller.wait()
                msg, fds, _, _ = socket.recv_fds(conn, MAX_CONTROL_BYTES, 1)
                if not msg:
                    return
                if msg[:4] == BUFFER_MAGIC:
                    buffer = self._map(msg, fds, buffer)
                elif msg[:4] == DESCRIPTION_MAGIC:
                    gpu_buffer = None  # the old mapping goes first
                    try:
                        gpu_buffer = open_described(msg)
                    except DeviceBufferError as err:
                        gpu_buffer = err
                elif msg[:4] == CALL_DEVICE_MAGIC:
                    conn.send(answer_device(self.runtime, msg, buffer, gpu_buffer))
                else:
                    conn.send(answer(self.runtime, msg, buffer))
        except OSError as err:
            log.info("local channel closed: %s", err)
        finally:
            _release(buffer)

    @staticmethod
    def _map(msg: bytes, fds: list[int], old: mmap.mmap | None) -> mmap.mmap:
        """The client's new shared buffer (it grows by sending a bigger one)."""
        try:
            if len(fds) != 1 or len(msg) != BUFFER.size:
                raise OSError("a malformed buffer message (or one without its memfd)")
            _, size = BUFFER.unpack(msg)
            return mmap.mmap(fds[0], size)
        finally:
            for fd in fds:
                os.close(fd)
            _release(old)


def answer(runtime, msg: bytes, buffer: mmap.mmap | None) -> bytes:
    """Run the call that CALL `msg` points at in `buffer`: z is written there; returns the reply
    (routed.encode_reply) or an error reply naming the call."""
    call_id = 0
    try:
        if len(msg) != CALL.size or msg[:4] != CALL_MAGIC:
            raise BadRequest("malformed local-channel call message: client and host versions differ?")
        _, frame_bytes, z_at = CALL.unpack(msg)
        shared, head = _head_in(buffer, frame_bytes, "call")
        call_id, size = head.call_id, len(shared)
        z_bytes = head.n_out * head.hidden * head.item
        if frame_bytes > size or z_at < frame_bytes or z_at % head.item or z_at + z_bytes > size:
            raise BadRequest(f"routed call {call_id} (layer {head.layer}): its {frame_bytes}-byte frame and z "
                             f"({z_bytes} bytes at {z_at}) do not fit the shared buffer of {size} bytes")
        refuse_unless_serving(runtime.health)
        call = decode_body(head, shared[HEAD.size:frame_bytes])
        z = torch.frombuffer(shared, dtype=head.dtype, offset=z_at, count=z_bytes // head.item) \
            if z_bytes else torch.empty(0, dtype=head.dtype)
        z, cold, compute = run_routed(runtime, call, z=z.view(head.n_out, head.hidden))
        return encode_reply(call_id, z, cold, compute)
    except Exception as err:  # the client gets the failure instead of a hang
        return _error_reply(err, call_id)


def answer_device(runtime, msg: bytes, buffer: mmap.mmap | None, gpu_buffer) -> bytes:
    """Run the call that CALL_DEVICE `msg` describes: HEAD and the lists in `buffer`, x and z in the
    caller's GPU buffer `gpu_buffer` (a uint8 tensor, or the DeviceBufferError that kept it unmapped);
    z is written there and the GPU synchronised; returns the reply or an error reply naming the call."""
    call_id = 0
    try:
        if len(msg) != CALL_DEVICE.size:
            raise BadRequest("malformed local-channel device call message: client and host versions differ?")
        _, lists_bytes, x_at, z_at = CALL_DEVICE.unpack(msg)
        shared, head = _head_in(buffer, lists_bytes, "device call")
        call_id = head.call_id
        where = f"routed call {call_id} (layer {head.layer})"
        if lists_bytes > len(shared):
            raise BadRequest(f"{where}: its {lists_bytes} bytes of lists do not fit the shared buffer of {len(shared)} bytes")
        if isinstance(gpu_buffer, DeviceBufferError) or gpu_buffer is None:
            raise BadRequest(f"{where}: its rows are in GPU memory this host has not mapped: "
                             f"{gpu_buffer or 'no device buffer was handed over'}")
        x_bytes, z_bytes = head.rows * head.hidden * head.item, head.n_out * head.hidden * head.item
        inside = min(x_at, z_at) >= 0 and max(x_at + x_bytes, z_at + z_bytes) <= gpu_buffer.numel()
        overlap = x_at < z_at + z_bytes and z_at < x_at + x_bytes and x_bytes and z_bytes
        if not inside or overlap or x_at % head.item or z_at % head.item:
            raise BadRequest(f"{where}: x ({x_bytes} bytes at {x_at}) and z ({z_bytes} bytes at {z_at}) do not fit "
                             f"apart in the device buffer of {gpu_buffer.numel()} bytes")
        refuse_unless_serving(runtime.health)
        x = gpu_buffer[x_at:x_at + x_bytes].view(head.dtype).view(head.rows, head.hidden)
        call = decode_body(head, shared[HEAD.size:lists_bytes], x=x)
        z = gpu_buffer[z_at:z_at + z_bytes].view(head.dtype).view(head.n_out, head.hidden)
        z, cold, compute = run_routed(runtime, call, z=z)
        if gpu_buffer.is_cuda:
            torch.cuda.synchronize(gpu_buffer.device)  # z is complete before the caller hears of it
        return encode_reply(call_id, z, cold, compute)
    except Exception as err:  # the client gets the failure instead of a hang
        return _error_reply(err, call_id)


def _head_in(buffer: mmap.mmap | None, nbytes: int, what: str) -> tuple[memoryview, Head]:
    """(the shared buffer, the HEAD at its start) of a call of nbytes; BadRequest where no shared
    buffer that holds one came first."""
    if buffer is None or len(buffer) < HEAD.size:
        raise BadRequest(f"a local-channel {what} of {nbytes} bytes came before a shared buffer that holds it")
    shared = memoryview(buffer)
    return shared, decode_head(shared[:HEAD.size])


def _error_reply(err: Exception, call_id: int) -> bytes:
    """The error reply for a call that failed: a host error's kind and message, else the
    exception's class and message as a host error (logged with its traceback: call from an except)."""
    if isinstance(err, ExpertHostError):
        return encode_error(call_id, err.kind, _short(str(err)))
    log.exception("local channel call %d failed", call_id)
    return encode_error(call_id, ExpertHostError.kind, _short(f"{type(err).__name__}: {err}"))


def _short(message: str, limit: int = 4000) -> str:
    """An error text that fits one reply message (the client reads up to 64 KiB)."""
    return message if len(message) <= limit else message[:limit] + " [...]"


def _release(buffer: mmap.mmap | None) -> None:
    """Unmap `buffer` now if no view of it is left (else it goes with its last view)."""
    if buffer is not None:
        try:
            buffer.close()
        except BufferError:
            pass
