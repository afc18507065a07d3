"""One host's share of one MoE layer as a single packed tensor: what both transports carry.

A packed call is (layer, experts [m], counts [m], x [n, H]) with x's rows expert-major: the
first counts[0] rows go to experts[0], the next counts[1] to experts[1], ... The answer is
y [n, H], row for row. One tensor instead of one per expert keeps the per-call cost flat: the
gRPC path sends one bytes field, the shared-memory path writes x once and reads y in place.

Both transports (gRPC `InvokePacked`, the local channel of local_channel.py) run a packed call
on the host with `run_packed`, so they compute exactly the same thing.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from moeless.expert_fn.errors import BadRequest


@dataclass
class PackedResult:
    """A packed call's answer. y: [n, H] float32 (on a local channel: a view of shared memory,
    valid until that client's next call); cold_starts: experts that had to load first;
    compute_s: the host's time in the expert forward itself."""

    y: torch.Tensor
    cold_starts: int
    compute_s: float


class Pending(Protocol):
    """A packed call in flight; result() waits for it (raises ExpertHostUnavailable et al.)."""

    def result(self) -> PackedResult: ...


def check_packed(experts: Sequence[int], counts: Sequence[int], x: torch.Tensor) -> None:
    """BadRequest unless experts are distinct, counts >= 1 and sum(counts) rows of x: [n, H]."""
    if len(experts) != len(counts):
        raise BadRequest(f"{len(experts)} experts but {len(counts)} counts; send one count per expert")
    if len(set(experts)) != len(experts):
        raise BadRequest("an expert appears twice in one call; send each expert's tokens once")
    if any(c < 1 for c in counts):
        raise BadRequest(f"every count must be >= 1 (leave out experts without tokens), got {list(counts)}")
    if x.dim() != 2 or x.shape[0] != sum(counts):
        raise BadRequest(f"x must be [sum(counts)={sum(counts)}, H], got shape {list(x.shape)}")


def run_packed(runtime, layer: int, experts: Sequence[int], counts: Sequence[int], x: torch.Tensor,
               out: torch.Tensor | None = None) -> PackedResult:
    """Run a packed call on an ExpertHostRuntime: x: [n, H] -> y: [n, H] written into `out`
    (x itself is fine: every expert's output is computed before it is copied back)."""
    check_packed(experts, counts, x)
    # 1. Views of each expert's rows (no copy), one runtime call for all of them.
    batches, start = {}, 0
    for expert, count in zip(experts, counts):
        batches[int(expert)] = x[start:start + count]
        start += count
    result = runtime.invoke(layer, batches)
    # 2. The outputs back into one tensor, in the same row order.
    y = torch.empty_like(x) if out is None else out
    start = 0
    for expert, count in zip(experts, counts):
        y[start:start + count].copy_(result.outputs[int(expert)])
        start += count
    return PackedResult(y, result.cold_starts, result.compute_s)


# --- the local channel's messages (SOCK_SEQPACKET: one message per send) ---------------------

BUFFER = struct.Struct("<4sq")  # b"MLCB", bytes: sent with the memfd that holds x and y from now on
CALL = struct.Struct("<4siiii")  # b"MLCI", layer, m experts, n rows, H; then int32 experts[m], counts[m]
REPLY = struct.Struct("<4sBid")  # b"MLCR", ok (1/0), cold_starts, compute_s; on error: kind "\0" message
BUFFER_MAGIC, CALL_MAGIC, REPLY_MAGIC = b"MLCB", b"MLCI", b"MLCR"


def encode_call(layer: int, experts: Sequence[int], counts: Sequence[int], hidden: int) -> bytes:
    head = CALL.pack(CALL_MAGIC, layer, len(experts), int(sum(counts)), hidden)
    return head + struct.pack(f"<{2 * len(experts)}i", *experts, *counts)


def decode_call(msg: bytes) -> tuple[int, list[int], list[int], int, int]:
    """-> (layer, experts, counts, n, H); BadRequest for a malformed message."""
    if len(msg) < CALL.size or msg[:4] != CALL_MAGIC:
        raise BadRequest("malformed local-channel call (bad header); client and host versions differ?")
    _, layer, m, n, hidden = CALL.unpack_from(msg)
    if m < 0 or len(msg) != CALL.size + 8 * m:
        raise BadRequest(f"malformed local-channel call: {m} experts but {len(msg) - CALL.size} bytes of lists")
    values = struct.unpack_from(f"<{2 * m}i", msg, CALL.size)
    return layer, list(values[:m]), list(values[m:]), n, hidden


def encode_reply(cold_starts: int, compute_s: float) -> bytes:
    return REPLY.pack(REPLY_MAGIC, 1, cold_starts, compute_s)


def encode_error(kind: str, message: str) -> bytes:
    return REPLY.pack(REPLY_MAGIC, 0, 0, 0.0) + kind.encode() + b"\0" + message.encode(errors="replace")


def decode_reply(msg: bytes) -> tuple[bool, int, float, str, str]:
    """-> (ok, cold_starts, compute_s, error kind, error message)."""
    if len(msg) < REPLY.size or msg[:4] != REPLY_MAGIC:
        raise ValueError("malformed local-channel reply")
    _, ok, cold, compute = REPLY.unpack_from(msg)
    kind, _, message = msg[REPLY.size:].decode(errors="replace").partition("\0")
    return bool(ok), cold, compute, kind, message
