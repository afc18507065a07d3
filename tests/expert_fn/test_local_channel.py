"""The local channel (local_channel.py, local_channel_server.py) on a fake runtime, in one process:
the frame in shared memory, z written back in place in the tokens' dtype, growth, errors, draining."""

from __future__ import annotations

import mmap
import pytest
import torch

from moeless.expert_fn.errors import BadRequest, ExpertHostError, ExpertHostUnavailable
from moeless.expert_fn.client.local_channel import INITIAL_BYTES, LocalChannel
from moeless.expert_fn.host.local_channel_server import CALL, CALL_MAGIC, LocalChannelServer, answer, z_offset
from moeless.expert_fn.wire.routed import RoutedCall, decode_reply_head, encode_call, split_error

from local_channel_fakes import H, FakeRuntime, _reference, _routed

@pytest.fixture
def served():
    runtime = FakeRuntime()
    server = LocalChannelServer(runtime)
    channel = LocalChannel(server.name, timeout_s=10)
    yield runtime, server, channel
    channel.close()
    server.close()


def test_a_packed_call_answers_y_in_place(served):
    _, _, channel = served
    x = torch.randn(10, H)
    rows = torch.tensor([3, 1, 4, 1, 5])
    result = channel.submit(RoutedCall.packed(0, [0, 2], [2, 3], rows), x).result()
    expected = torch.cat([x[rows[:2]] * 1 + 0.25, x[rows[2:]] * 3 + 0.25])
    assert torch.equal(result.z, expected)
    assert (result.cold_starts, result.compute_s) == (2, 0.001)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_routed_call_with_shared_outputs_is_run_in_the_tokens_dtype(served, dtype):
    _, _, channel = served
    x = torch.randn(10, H).to(dtype)
    call = _routed(dtype)
    z = channel.submit(call, x).result().z
    assert z.dtype == dtype and z.shape == (4, H)
    assert torch.equal(z, _reference(call, x))


def test_a_call_larger_than_the_buffer_grows_it_and_small_calls_go_on(served):
    runtime, _, channel = served
    x = torch.randn(70_000, H)  # 2.2 MB of rows, 4.5 MB with z: over the initial 4 MiB
    assert 2 * x.numel() * 4 > INITIAL_BYTES
    rows = torch.arange(x.shape[0])
    z = channel.submit(RoutedCall.packed(0, [0, 1], [35_000, 35_000], rows), x).result().z
    assert torch.equal(z, torch.cat([x[:35_000] + 0.25, x[35_000:] * 2 + 0.25]))
    assert len(channel._buffer) == 8 << 20
    small = channel.submit(RoutedCall.packed(0, [1], [2], rows[:2]), x).result().z
    assert torch.equal(small, x[:2] * 2 + 0.25)
    assert runtime.calls == 2


def test_errors_keep_their_class_name_the_call_and_the_channel_goes_on(served):
    _, _, channel = served
    x = torch.randn(4, H)
    with pytest.raises(BadRequest, match=r"call 1 \(layer 9\).*no expert"):
        channel.submit(RoutedCall.packed(9, [0], [4], torch.arange(4)), x).result()
    with pytest.raises(BadRequest, match="routed call 2 .*distinct and ascending"):
        channel.submit(RoutedCall.packed(0, [1, 1], [2, 2], torch.arange(4)), x).result()
    with pytest.raises(BadRequest, match="cannot travel"):  # refused before it is sent
        channel.submit(RoutedCall.packed(0, [0], [4], torch.arange(4)), x.double())
    z = channel.submit(RoutedCall.packed(0, [0], [4], torch.arange(4)), x).result().z
    assert torch.equal(z, x + 0.25)


def test_a_draining_host_answers_unavailable(served):
    runtime, _, channel = served
    runtime.health = "draining"
    with pytest.raises(ExpertHostUnavailable, match="draining"):
        channel.submit(RoutedCall.packed(0, [0], [1], torch.arange(1)), torch.randn(1, H)).result()
    assert not channel.broken


def test_a_closed_host_is_unavailable_and_breaks_the_channel(served):
    _, server, channel = served
    x = torch.randn(2, H)
    channel.submit(RoutedCall.packed(0, [0], [2], torch.arange(2)), x).result()
    server.close()
    with pytest.raises(ExpertHostUnavailable):
        channel.submit(RoutedCall.packed(0, [0], [2], torch.arange(2)), x).result()
    assert channel.broken
    with pytest.raises(ExpertHostUnavailable, match="closed"):
        channel.submit(RoutedCall.packed(0, [0], [2], torch.arange(2)), x)


# --- the host side on its own: a frame written into a mapping, answer() on it ---------------------


def _shared(call: RoutedCall, x: torch.Tensor, size: int = 1 << 16) -> tuple[mmap.mmap, int, int]:
    """(the mapping with call's frame at 0, the frame's bytes, z's offset)."""
    frame = encode_call(5, call, x)
    buffer = mmap.mmap(-1, size)
    buffer[:len(frame)] = frame
    return buffer, len(frame), z_offset(len(frame))


def _error(reply: bytes) -> tuple[int, str, str]:
    head = decode_reply_head(reply)
    assert not head.ok
    return (head.call_id, *split_error(reply[len(reply) - head.body_bytes:]))


def test_answer_writes_z_after_the_frame_and_leaves_the_frame_alone():
    x = torch.randn(10, H, dtype=torch.bfloat16)
    call = _routed(torch.bfloat16)
    buffer, frame, z_at = _shared(call, x)
    before = bytes(buffer[:frame])
    reply = answer(FakeRuntime(), CALL.pack(CALL_MAGIC, frame, z_at), buffer)
    head = decode_reply_head(reply)
    assert (head.call_id, head.ok, head.n_out, head.hidden, head.dtype) == (5, True, 4, H, torch.bfloat16)
    assert z_at % 64 == 0 and z_at >= frame
    z = torch.frombuffer(buffer, dtype=torch.bfloat16, offset=z_at, count=4 * H).view(4, H)
    assert torch.equal(z, _reference(call, x))
    assert bytes(buffer[:frame]) == before


def test_answer_refuses_frames_that_do_not_fit_naming_the_call_and_the_sizes():
    x = torch.randn(10, H)
    call = _routed(torch.float32)
    buffer, frame, z_at = _shared(call, x, size=1024)
    z_bytes = 4 * H * 4
    call_id, kind, message = _error(answer(FakeRuntime(), CALL.pack(CALL_MAGIC, frame + 4096, z_at), buffer))
    assert (call_id, kind) == (5, BadRequest.kind)
    assert f"routed call 5 (layer 0): its {frame + 4096}-byte frame" in message and "1024 bytes" in message
    call_id, kind, message = _error(answer(FakeRuntime(), CALL.pack(CALL_MAGIC, frame, 1024 - z_bytes + 64), buffer))
    assert (call_id, kind) == (5, BadRequest.kind) and f"z ({z_bytes} bytes at {1024 - z_bytes + 64})" in message
    _, kind, message = _error(answer(FakeRuntime(), CALL.pack(CALL_MAGIC, frame - 4, z_at), buffer))
    assert kind == BadRequest.kind and "routed call 5: " in message and "expected" in message


def test_answer_names_what_is_wrong_with_a_malformed_message_or_frame():
    x = torch.randn(10, H)
    buffer, frame, z_at = _shared(_routed(torch.float32), x)
    assert _error(answer(FakeRuntime(), b"MLCX" + bytes(16), buffer))[1:] == (
        BadRequest.kind, "malformed local-channel call message: client and host versions differ?")
    _, kind, message = _error(answer(FakeRuntime(), CALL.pack(CALL_MAGIC, frame, z_at), None))
    assert kind == BadRequest.kind and "before a shared buffer" in message
    buffer[:4] = b"XXXX"
    _, kind, message = _error(answer(FakeRuntime(), CALL.pack(CALL_MAGIC, frame, z_at), buffer))
    assert kind == BadRequest.kind and "bad head" in message


def test_an_unexpected_failure_crosses_as_a_host_error():
    runtime = FakeRuntime()
    runtime.invoke = lambda layer, batches, on_device=False, out=None: 1 / 0
    buffer, frame, z_at = _shared(_routed(torch.float32), torch.randn(10, H))
    call_id, kind, message = _error(answer(runtime, CALL.pack(CALL_MAGIC, frame, z_at), buffer))
    assert (call_id, kind) == (5, ExpertHostError.kind) and message.startswith("ZeroDivisionError")
