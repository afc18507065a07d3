"""Calls whose rows live in a buffer the caller shares (a GPU buffer, cuda_ipc.py): the frame's
lists decoded without x, the host's answer_device on such a buffer, and the errors of a host that
cannot map one. The buffer here is host memory: answer_device does the same with it, and the CUDA
mapping itself runs in scripts/gpu_checks.sh (bench transport's local_device row) on a GPU."""

from __future__ import annotations

import mmap
import os
import socket

import pytest
import torch

from moeless.expert_fn.wire.cuda_ipc import DESCRIPTION, DESCRIPTION_MAGIC, DeviceBufferError, describe, open_described
from moeless.expert_fn.errors import BadRequest
from moeless.expert_fn.host.local_channel_server import (
    BUFFER,
    BUFFER_MAGIC,
    CALL,
    CALL_DEVICE,
    CALL_DEVICE_MAGIC,
    CALL_MAGIC,
    LocalChannelServer,
    answer_device,
    z_offset,
)
from moeless.expert_fn.wire.routed import HEAD, RoutedCall, decode_body, decode_call, decode_head, decode_reply_head, encode_call, lists_bytes, split_error
from moeless.expert_fn.host.run_routed import lists_on, run_routed
from local_channel_fakes import H, FakeRuntime, _reference, _routed


class AcceleratorRuntime(FakeRuntime):
    """The fake runtime under a device name that is not "cpu", so run_routed takes its GPU branch
    (lists moved in one copy, one index_add_ per expert, z copied back) on a CPU."""

    device = "cpu:0"


def _lists_in_shared_memory(call, x) -> tuple[mmap.mmap, int]:
    lists = lists_bytes(5, call, H, x.dtype)
    buffer = mmap.mmap(-1, 1 << 16)
    buffer[:len(lists)] = lists
    return buffer, len(lists)


def _rows_buffer(call, x, size: int = 4096) -> tuple[torch.Tensor, int, int]:
    """(a uint8 buffer with x's call rows at 0, x's bytes, z's offset after them)."""
    rows = x.index_select(0, call.tokens)
    nbytes = rows.numel() * rows.element_size()
    buffer = torch.zeros(size, dtype=torch.uint8)
    buffer[:nbytes] = rows.reshape(-1).view(torch.uint8)
    return buffer, nbytes, z_offset(nbytes)


def _error(reply: bytes) -> tuple[int, str, str]:
    head = decode_reply_head(reply)
    assert not head.ok
    return (head.call_id, *split_error(reply[len(reply) - head.body_bytes:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lists_alone_with_rows_from_elsewhere_decode_to_the_same_call(dtype):
    x = torch.randn(10, H).to(dtype)
    call = _routed(dtype)
    whole = decode_call(encode_call(5, call, x))
    lists = bytearray(lists_bytes(5, call, H, dtype))
    head = decode_head(lists)
    rows = x.index_select(0, call.tokens)
    apart = decode_body(head, memoryview(lists)[HEAD.size:], x=rows)
    assert (apart.experts, apart.counts, apart.pair_order, apart.singles) == \
           (whole.experts, whole.counts, whole.pair_order, whole.singles)
    assert torch.equal(apart.src, whole.src) and (apart.out == whole.out).all() and torch.equal(apart.weight, whole.weight)
    assert apart.x is rows and torch.equal(apart.x, whole.x)
    assert torch.equal(run_routed(FakeRuntime(), apart)[0], run_routed(FakeRuntime(), whole)[0])
    with pytest.raises(BadRequest, match="expected"):  # the whole frame where only the lists belong
        decode_body(head, memoryview(encode_call(5, call, x))[HEAD.size:], x=rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lists_move_in_one_copy_as_the_same_values(dtype):
    x = torch.randn(10, H).to(dtype)
    decoded = decode_call(encode_call(5, _routed(dtype), x))
    src, out, weight = lists_on(decoded, "cpu:0")
    assert src.dtype == out.dtype == torch.int32 and weight.dtype == dtype
    assert torch.equal(src, decoded.src) and torch.equal(out, torch.from_numpy(decoded.out)) and torch.equal(weight, decoded.weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ["shared rows", "pair order", "permuted"])
def test_the_accelerator_branch_of_run_routed_equals_the_cpu_branch(dtype, shape):
    x = torch.randn(10, H).to(dtype)
    call = _routed(dtype)
    if shape != "shared rows":  # each pair its own output row: in order, or reversed
        rows = torch.arange(call.pairs, dtype=torch.int32)
        call = RoutedCall(0, call.experts, call.counts, call.tokens, call.src,
                          rows if shape == "pair order" else rows.flip(0), call.weight, call.pairs)
    decoded = decode_call(encode_call(5, call, x))
    assert (decoded.pair_order, decoded.singles) == {"shared rows": (False, False), "pair order": (True, True),
                                                     "permuted": (False, True)}[shape]
    want = run_routed(FakeRuntime(), decoded)[0]
    assert torch.equal(run_routed(AcceleratorRuntime(), decoded)[0], want)
    z = torch.full_like(want, float("nan"))  # a transport's buffer, stale
    assert torch.equal(run_routed(AcceleratorRuntime(), decoded, z=z)[0], want) and torch.equal(z, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_answer_device_reads_the_rows_and_writes_z_in_the_callers_buffer(dtype):
    x = torch.randn(10, H).to(dtype)
    call = _routed(dtype)
    shared, lists = _lists_in_shared_memory(call, x)
    gpu, x_bytes, z_at = _rows_buffer(call, x)
    rows_before = gpu[:x_bytes].clone()
    reply = answer_device(FakeRuntime(), CALL_DEVICE.pack(CALL_DEVICE_MAGIC, lists, 0, z_at), shared, gpu)
    head = decode_reply_head(reply)
    assert (head.call_id, head.ok, head.n_out, head.hidden, head.dtype) == (5, True, 4, H, dtype)
    z = gpu[z_at:z_at + 4 * H * x.element_size()].view(dtype).view(4, H)
    assert torch.equal(z, _reference(call, x))
    assert torch.equal(gpu[:x_bytes], rows_before)


def test_answer_device_refuses_what_does_not_fit_overlaps_or_was_never_mapped():
    x = torch.randn(10, H)
    call = _routed(torch.float32)
    shared, lists = _lists_in_shared_memory(call, x)
    gpu, x_bytes, z_at = _rows_buffer(call, x, size=512)
    z_bytes = 4 * H * 4

    def error(msg, buffer=gpu):
        return _error(answer_device(FakeRuntime(), msg, shared, buffer))

    call_id, kind, message = error(CALL_DEVICE.pack(CALL_DEVICE_MAGIC, lists, 0, 512 - z_bytes + 64))
    assert (call_id, kind) == (5, BadRequest.kind)
    assert f"routed call 5 (layer 0): x ({x_bytes} bytes at 0) and z ({z_bytes} bytes at {512 - z_bytes + 64})" in message
    assert "device buffer of 512 bytes" in message
    _, kind, message = error(CALL_DEVICE.pack(CALL_DEVICE_MAGIC, lists, 0, 64))  # z over the rows
    assert kind == BadRequest.kind and "do not fit apart" in message
    _, kind, message = error(CALL_DEVICE.pack(CALL_DEVICE_MAGIC, lists, 0, z_at), None)
    assert kind == BadRequest.kind and "routed call 5" in message and "no device buffer was handed over" in message
    _, kind, message = error(CALL_DEVICE.pack(CALL_DEVICE_MAGIC, lists, 0, z_at), DeviceBufferError("no CUDA here"))
    assert kind == BadRequest.kind and "GPU memory this host has not mapped: no CUDA here" in message
    _, kind, message = error(CALL_DEVICE.pack(CALL_DEVICE_MAGIC, lists, 0, z_at)[:-1])
    assert kind == BadRequest.kind and "malformed local-channel device call message" in message
    _, kind, message = error(CALL_DEVICE.pack(CALL_DEVICE_MAGIC, lists - 4, 0, z_at))
    assert kind == BadRequest.kind and "expected" in message
    call_id, kind, message = error(CALL_DEVICE.pack(CALL_DEVICE_MAGIC, (1 << 16) + 8, 0, z_at))
    assert (call_id, kind) == (5, BadRequest.kind) and "do not fit the shared buffer of 65536 bytes" in message


def _description(handle: bytes = b"h" * 64, counter: bytes = b"/torch_1_2", event: bytes = b"e" * 64) -> bytes:
    return DESCRIPTION.pack(DESCRIPTION_MAGIC, 4096, 0, 4096, 0, 0, True, len(handle), len(counter), len(event)) \
        + handle + counter + event


def test_a_device_buffer_that_cannot_be_described_or_opened_says_why():
    with pytest.raises(DeviceBufferError, match="only a contiguous uint8 CUDA buffer"):
        describe(torch.zeros(64, dtype=torch.uint8))
    with pytest.raises(DeviceBufferError, match="malformed device buffer message"):
        open_described(b"MLCX" + _description()[4:])
    with pytest.raises(DeviceBufferError, match="does not hold what its head says"):
        open_described(_description()[:-1])
    # Well formed but no real allocation behind it: no CUDA (CI), or a handle the driver refuses.
    expected = "cannot map the caller's GPU memory" if torch.cuda.is_available() else "this host has no CUDA"
    with pytest.raises(DeviceBufferError, match=expected):
        open_described(_description())


def test_a_host_that_cannot_map_the_rows_says_so_per_call_and_the_connection_goes_on():
    """A real server on its socket: the lists in a memfd, a description it cannot open, a device
    call (an error naming the call and why), then an ordinary call on the same connection."""
    runtime = FakeRuntime()
    server = LocalChannelServer(runtime)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.settimeout(10)
    try:
        conn.connect("\0" + server.name)
        fd = os.memfd_create("test-device-rows")
        os.ftruncate(fd, 1 << 16)
        shared = mmap.mmap(fd, 1 << 16)
        socket.send_fds(conn, [BUFFER.pack(BUFFER_MAGIC, 1 << 16)], [fd])
        os.close(fd)
        x = torch.randn(10, H)
        call = _routed(torch.float32)
        lists = lists_bytes(5, call, H, x.dtype)
        shared[:len(lists)] = lists
        conn.send(_description())
        conn.send(CALL_DEVICE.pack(CALL_DEVICE_MAGIC, len(lists), 0, 4096))
        call_id, kind, message = _error(conn.recv(1 << 16))
        assert (call_id, kind) == (5, BadRequest.kind) and "routed call 5 (layer 0)" in message
        assert ("this host has no CUDA" in message or "cannot map the caller's GPU memory" in message) \
            and "send the rows in host memory" in message or torch.cuda.is_available()
        frame = encode_call(6, call, x)
        shared[:len(frame)] = frame
        conn.send(CALL.pack(CALL_MAGIC, len(frame), z_offset(len(frame))))
        head = decode_reply_head(conn.recv(1 << 16))
        assert (head.call_id, head.ok) == (6, True) and runtime.calls == 1
        z = torch.frombuffer(shared, dtype=torch.float32, offset=z_offset(len(frame)), count=4 * H).view(4, H)
        assert torch.equal(z, _reference(call, x))
        del z
    finally:
        conn.close()
        server.close()
