"""Tensors on the wire: float32 row-major bytes plus a shape (no per-element protobuf floats)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeless.expert_fn.wire import expert_host_pb2 as pb
from moeless.expert_fn.errors import BadRequest

# Both ends raise gRPC's 4 MB default: a prefill batch of a few thousand tokens is larger.
MAX_MESSAGE_BYTES = 1 << 30
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# Clients retry a lost host within about a second (gRPC's default backoff grows to 120 s), so a
# restarted host is reachable again soon after it is ready.
CLIENT_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def put_tensor(target: pb.Tensor, x: torch.Tensor) -> None:
    """Write x's float32 values and shape into target (a field of the message being built).

    Filling a message in place matters: passing a built Tensor to a parent's constructor copies
    it again (tens of ms for a few MB in upb).
    """
    x = x.detach().to("cpu", torch.float32).contiguous()
    target.shape.extend(x.shape)
    target.data = x.numpy().tobytes()


def put_batches(target, batches: dict[int, torch.Tensor]) -> None:
    """Append one pb.ExpertBatch per expert to a repeated field: batches: expert -> [n, H]."""
    for expert, x in batches.items():
        put_tensor(target.add(expert=expert).x, x)


def batches_from_proto(source) -> dict[int, torch.Tensor]:
    """A repeated pb.ExpertBatch field -> expert -> [n, H] float32; an expert twice is refused."""
    batches = {b.expert: tensor_from_proto(b.x) for b in source}
    if len(batches) != len(source):
        raise BadRequest("an expert appears twice in one Invoke; send each expert's tokens once")
    return batches


def tensor_from_proto(msg: pb.Tensor) -> torch.Tensor:
    """pb.Tensor -> float32 tensor of its shape (a copy the caller owns)."""
    shape = tuple(msg.shape)
    numel = 1
    for dim in shape:
        numel *= dim
    if len(msg.data) != 4 * numel:
        raise BadRequest(f"tensor of shape {list(shape)} needs {4 * numel} bytes of float32, got {len(msg.data)}")
    if numel == 0:
        return torch.empty(shape, dtype=torch.float32)
    return torch.frombuffer(bytearray(msg.data), dtype=torch.float32).reshape(shape)


@dataclass
class InvokeResult:
    """What one Invoke returns, decoded."""

    outputs: dict[int, torch.Tensor]  # expert -> [n, H] float32 on the CPU
    cold_starts: int  # experts of this call that were not resident when it arrived
    compute_s: float  # the host's time in the forward itself (no load waits, no transfer)
