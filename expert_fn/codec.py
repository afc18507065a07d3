"""Tensors on the wire: float32 row-major bytes plus a shape (no per-element protobuf floats)."""

from __future__ import annotations

import torch

from moeless.expert_fn import expert_host_pb2 as pb
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


def tensor_to_proto(x: torch.Tensor) -> pb.Tensor:
    """Any-shape tensor -> pb.Tensor holding its float32 values."""
    x = x.detach().to("cpu", torch.float32).contiguous()
    return pb.Tensor(shape=list(x.shape), data=x.numpy().tobytes())


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
