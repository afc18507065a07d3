"""One host's share of one MoE layer, each token sent once: the call every data-plane transport carries.

A routed call is (layer, experts [m] ascending, counts [m], src [P], out [P], weight [P], x [n, H]):
x holds each token this host needs once (n rows, in the model's compute dtype); the P (token,
expert) pairs are listed expert-major, counts[i] of them for experts[i], pair j reading row
src[j] of x, weighted by weight[j] and added into output row out[j]. The answer is z [n_out, H]:

    z[o] = sum over the pairs j with out[j] = o, in ascending expert order, of weight[j] * expert(x[src[j]])

accumulated from zeros exactly as the in-process reference combines a token's experts
(model/moe_model.LocalExecutor), so serving can use z as it is. The serving side
(serving/scatter.py) gives several pairs one output row only where they are a prefix of the
token's experts in ascending order: then z is the reference's own partial sum, bit for bit, and
the token's remaining pairs (on other hosts) are added after it in the same order. A packed call
(one output per pair, weight 1) is a routed call too: `RoutedCall.packed`.

The frame (little-endian), the same bytes on every transport (TCP, gRPC, shared memory):
    call:  HEAD, int32 experts[m], int32 counts[m], int32 src[P], int32 out[P], weight[P], x[n*H]
    reply: REPLY, then z[n_out*H] (ok) or the error kind, NUL, the message (not ok)
weight, x and z in the dtype the head names. Over a TCP channel with NIXL (nixl_link.py) x and z
travel apart, written into the peer's registered buffer: the head says so with its own magic
(b"MRC2": no x after the lists; b"MRR2": no z after the reply). Nothing is converted: a bfloat16 model's tokens
travel as bfloat16.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from moeless.expert_fn.errors import BadRequest

HEAD = struct.Struct("<4sIiiiiiiB3x")  # b"MRC1", call id, layer, m, P, n, n_out, H, dtype
REPLY = struct.Struct("<4sIB3xidiiB3x")  # b"MRR1", call id, ok, cold_starts, compute_s, n_out, H, dtype
CALL_MAGIC, REPLY_MAGIC = b"MRC1", b"MRR1"
CALL_APART_MAGIC, REPLY_APART_MAGIC = b"MRC2", b"MRR2"  # x (z) is in the peer's NIXL buffer, not after the head
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the head's dtype code is the index
ITEM_BYTES = {dtype: torch.empty(0, dtype=dtype).element_size() for dtype in DTYPES}


def item_bytes(dtype: torch.dtype) -> int:
    """Bytes of one value of dtype (no tensor made for the dtypes that travel: sizing a frame is per call)."""
    return ITEM_BYTES.get(dtype) or torch.empty(0, dtype=dtype).element_size()
MAX_FRAME_BYTES = 1 << 31  # a call larger than this is refused: no prefill needs 2 GiB per host


@dataclass
class RoutedResult:
    """A routed call's answer. z: [n_out, H] (on a local or stream channel: a view of its buffer,
    valid until that client's next call); cold_starts: experts that had to load first;
    compute_s: the host's time in the expert forward itself."""

    z: torch.Tensor
    cold_starts: int
    compute_s: float


class Pending(Protocol):
    """A routed call in flight; result() waits for it (raises ExpertHostUnavailable et al.)."""

    def result(self) -> RoutedResult: ...


class HeldCall:
    """A call in flight on a channel that runs one call at a time: the channel's lock, taken by
    submit, is held until result() first returns; `wait` reads the answer (once)."""

    def __init__(self, lock, wait: Callable[[], RoutedResult]):
        self._lock, self._wait = lock, wait
        self._outcome: RoutedResult | BaseException | None = None

    def result(self) -> RoutedResult:
        if self._outcome is None:
            try:
                self._outcome = self._wait()
            except BaseException as err:
                self._outcome = err
            finally:
                self._lock.release()
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        return self._outcome


def dtype_code(dtype: torch.dtype) -> int:
    if dtype not in DTYPES:
        raise BadRequest(f"tokens in {dtype} cannot travel; use one of {', '.join(map(str, DTYPES))}")
    return DTYPES.index(dtype)


@dataclass(frozen=True)
class RoutedCall:
    """A routed call without its tensor: tokens [n] long are the rows of the caller's x it sends
    (ascending); src, out: [P] int32; weight: [P] in the tokens' dtype (see the module docstring)."""

    layer: int
    experts: list[int]
    counts: list[int]
    tokens: torch.Tensor
    src: torch.Tensor
    out: torch.Tensor
    weight: torch.Tensor
    n_out: int

    @staticmethod
    def packed(layer: int, experts: Sequence[int], counts: Sequence[int], rows: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> "RoutedCall":
        """The packed call: rows [P] of x, expert-major, each its own output row, weight 1 (z = y)."""
        pairs = int(sum(counts))
        index = torch.arange(pairs, dtype=torch.int32)
        return RoutedCall(layer, list(experts), list(counts), rows, index, index, torch.ones(pairs, dtype=dtype), pairs)

    @property
    def pairs(self) -> int:
        return int(self.src.numel())

    def request_bytes(self, hidden: int, dtype: torch.dtype) -> int:
        """Bytes of this call's frame on the wire."""
        item = item_bytes(dtype)
        return HEAD.size + 8 * len(self.experts) + 8 * self.pairs + item * (self.pairs + int(self.tokens.numel()) * hidden)

    def reply_bytes(self, hidden: int, dtype: torch.dtype) -> int:
        return REPLY.size + item_bytes(dtype) * self.n_out * hidden


def staged(call: RoutedCall, x: torch.Tensor) -> tuple[RoutedCall, torch.Tensor]:
    """(call, x) with the call's rows of x (on a GPU) copied to host memory, in order: for a
    transport that carries host memory only."""
    rows = x.index_select(0, call.tokens.to(x.device)).cpu()
    return replace(call, tokens=torch.arange(rows.shape[0])), rows


def lists_bytes(call_id: int, call: RoutedCall, hidden: int, dtype: torch.dtype, apart: bool = False) -> bytes:
    """The frame up to x: HEAD and the lists (x follows: call.tokens' rows, n * H values; apart:
    x travels apart, and the head says so)."""
    head = HEAD.pack(CALL_APART_MAGIC if apart else CALL_MAGIC, call_id, call.layer, len(call.experts), call.pairs, int(call.tokens.numel()),
                     call.n_out, hidden, dtype_code(dtype))
    ints = np.asarray([*call.experts, *call.counts], dtype="<i4").tobytes()
    return (head + ints + call.src.numpy().astype("<i4", copy=False).tobytes()
            + call.out.numpy().astype("<i4", copy=False).tobytes() + raw_bytes(call.weight.to(dtype)))


def write_call(buffer, call_id: int, call: RoutedCall, x: torch.Tensor) -> int:
    """Write the whole frame of `call` on the caller's x [T, H] (its rows call.tokens, copied straight
    from x) at the start of `buffer` (writable, at least call.request_bytes long); returns its bytes."""
    lists = lists_bytes(call_id, call, x.shape[1], x.dtype)
    buffer[:len(lists)] = lists
    rows = int(call.tokens.numel())
    if rows:
        out = torch.frombuffer(buffer, dtype=x.dtype, offset=len(lists), count=rows * x.shape[1])
        torch.index_select(x, 0, call.tokens, out=out.view(rows, x.shape[1]))
    return len(lists) + rows * x.shape[1] * x.element_size()


def encode_call(call_id: int, call: RoutedCall, x: torch.Tensor) -> bytearray:
    """The whole frame of `call` on the caller's x [T, H], as one new buffer."""
    frame = bytearray(call.request_bytes(x.shape[1], x.dtype))
    write_call(frame, call_id, call, x)
    return frame


def decode_call(data: bytes | memoryview) -> "Decoded":
    """A whole frame -> Decoded (views into data); BadRequest names what is wrong."""
    view = memoryview(data)
    head = decode_head(view)
    return decode_body(head, view[HEAD.size:])


def raw_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes as they travel (no conversion)."""
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@dataclass(frozen=True)
class Head:
    """A decoded HEAD: sizes of what follows it."""

    call_id: int
    layer: int
    m: int
    pairs: int
    rows: int
    n_out: int
    hidden: int
    dtype: torch.dtype
    apart: bool = False  # x is not in the frame (the transport wrote it into the host's buffer)

    @property
    def item(self) -> int:
        return item_bytes(self.dtype)

    @property
    def lists_bytes(self) -> int:
        """Bytes after HEAD up to x: the lists and the weights."""
        return 8 * self.m + 8 * self.pairs + self.item * self.pairs

    @property
    def body_bytes(self) -> int:
        """Bytes after HEAD: the lists and x (the lists alone when x travels apart)."""
        return self.lists_bytes + (0 if self.apart else self.item * self.rows * self.hidden)


def decode_head(data: bytes | memoryview) -> Head:
    """HEAD -> Head; BadRequest for a head that no client of this version sends."""
    if len(data) < HEAD.size or bytes(data[:4]) not in (CALL_MAGIC, CALL_APART_MAGIC):
        raise BadRequest("malformed routed call (bad head): client and host versions differ?")
    magic, call_id, layer, m, pairs, rows, n_out, hidden, code = HEAD.unpack_from(data)
    if min(m, pairs, rows, n_out) < 0 or hidden <= 0 or code >= len(DTYPES):
        raise BadRequest(f"malformed routed call {call_id}: m={m} P={pairs} n={rows} n_out={n_out} H={hidden} dtype={code}")
    head = Head(call_id, layer, m, pairs, rows, n_out, hidden, DTYPES[code], magic == CALL_APART_MAGIC)
    if HEAD.size + head.body_bytes > MAX_FRAME_BYTES or n_out * hidden * head.item > MAX_FRAME_BYTES:
        raise BadRequest(f"routed call {call_id} is larger than {MAX_FRAME_BYTES} bytes; split the batch")
    return head


@dataclass(frozen=True)
class Decoded:
    """A routed call as the host runs it: src, out, weight and x are views into the received bytes
    (no copy; valid while the transport keeps them, which is until the answer is sent).
    pair_order: out[j] = j for every pair (each pair its own row, in order); singles: each output
    row is exactly one pair's (out is a permutation), so no row needs adding up. body: the bytes
    after HEAD, where src, out and weight lie side by side (lists_on moves them in one copy)."""

    head: Head
    experts: list[int]
    counts: list[int]
    src: torch.Tensor
    out: np.ndarray
    weight: torch.Tensor
    x: torch.Tensor
    pair_order: bool
    singles: bool
    body: memoryview


def decode_body(head: Head, body: memoryview, x: torch.Tensor | None = None) -> Decoded:
    """The lists and x after HEAD (body: exactly head.body_bytes), checked; BadRequest names what is wrong.
    With x ([n, H], the rows already elsewhere: a GPU buffer the caller shares), body is the lists alone.
    (Few array ops: a decode step's call is tiny, and each op costs its most on a core just woken.)"""
    if head.apart and x is None:
        raise BadRequest(f"routed call {head.call_id}: its rows travel apart (NIXL), but this connection has no "
                         "buffer for them; send them in the frame")
    expected = head.body_bytes if x is None else head.lists_bytes
    if len(body) != expected:
        raise BadRequest(f"routed call {head.call_id}: {len(body)} bytes after the head, expected {expected}")
    m, pairs = head.m, head.pairs
    ints = np.frombuffer(body, dtype="<i4", count=2 * m + 2 * pairs)
    lists = ints[:2 * m].tolist()
    experts, counts = lists[:m], lists[m:]
    src_out = ints[2 * m:].reshape(2, pairs)  # [2, P]: src, out
    low, high = (src_out.min(axis=1).tolist(), src_out.max(axis=1).tolist()) if pairs else ([0, 0], [0, 0])
    check(head, experts, counts, low, high)
    out = src_out[1]
    sent = pairs + (head.rows * head.hidden if x is None else 0)  # weights, then x where it came in the frame
    floats = torch.frombuffer(body, dtype=head.dtype, offset=4 * (2 * m + 2 * pairs), count=sent) \
        if sent else torch.empty(0, dtype=head.dtype)
    # Each pair its own row (out a permutation): n_out == P rows, each hit once; in pair order if also ascending.
    singles = head.n_out == pairs and (pairs == 0 or bool(np.bincount(out, minlength=pairs).max() == 1))
    pair_order = singles and (pairs == 0 or bool((out[1:] > out[:-1]).all()))
    x = floats[pairs:].view(head.rows, head.hidden) if x is None else x
    return Decoded(head, experts, counts, torch.from_numpy(src_out[0]), out, floats[:pairs], x, pair_order, singles,
                   body)


def check(head: Head, experts: list[int], counts: list[int], low: list[int], high: list[int]) -> None:
    """BadRequest unless the lists describe pairs the host can run (see the module docstring);
    low, high: the least and greatest of src and of out."""
    where = f"routed call {head.call_id} (layer {head.layer})"
    if len(set(experts)) != len(experts) or experts != sorted(experts):
        raise BadRequest(f"{where}: experts must be distinct and ascending, got {experts}")
    if any(c < 1 for c in counts) or sum(counts) != head.pairs:
        raise BadRequest(f"{where}: counts {counts} must be >= 1 and add up to the {head.pairs} pairs")
    if low[0] < 0 or high[0] >= head.rows:
        raise BadRequest(f"{where}: a pair reads a row outside the {head.rows} rows sent")
    if low[1] < 0 or high[1] >= head.n_out:
        raise BadRequest(f"{where}: a pair writes outside the {head.n_out} output rows")


def encode_reply(call_id: int, z: torch.Tensor, cold_starts: int, compute_s: float, apart: bool = False) -> bytes:
    """REPLY for a call that ran (z follows it: `z`'s raw bytes; apart: z was written into the client's buffer)."""
    return REPLY.pack(REPLY_APART_MAGIC if apart else REPLY_MAGIC, call_id, 1, cold_starts, compute_s, z.shape[0], z.shape[1], dtype_code(z.dtype))


def encode_error(call_id: int, kind: str, message: str) -> bytes:
    """REPLY for a call that failed, with its error kind and message."""
    tail = kind.encode() + b"\0" + message.encode(errors="replace")
    return REPLY.pack(REPLY_MAGIC, call_id, 0, 0, 0.0, len(tail), 0, 0) + tail


@dataclass(frozen=True)
class ReplyHead:
    call_id: int
    ok: bool
    cold_starts: int
    compute_s: float
    n_out: int  # ok: z's rows; not ok: the bytes of the error text that follow
    hidden: int
    dtype: torch.dtype
    apart: bool = False  # z is not after the head (the host wrote it into the client's buffer)

    @property
    def body_bytes(self) -> int:
        if not self.ok:
            return self.n_out
        return 0 if self.apart else self.n_out * self.hidden * item_bytes(self.dtype)


def decode_reply_head(data: bytes | memoryview) -> ReplyHead:
    """REPLY -> ReplyHead; ValueError for bytes that are not one (a broken or foreign peer)."""
    if len(data) < REPLY.size or bytes(data[:4]) not in (REPLY_MAGIC, REPLY_APART_MAGIC):
        raise ValueError("malformed reply (bad head)")
    magic, call_id, ok, cold, compute, n_out, hidden, code = REPLY.unpack_from(data)
    if n_out < 0 or hidden < 0 or code >= len(DTYPES):
        raise ValueError(f"malformed reply to call {call_id}: n_out={n_out} H={hidden} dtype={code}")
    return ReplyHead(call_id, bool(ok), cold, compute, n_out, hidden, DTYPES[code], magic == REPLY_APART_MAGIC)


def split_error(tail: bytes) -> tuple[str, str]:
    """(kind, message) of a failed call's reply text."""
    kind, _, message = tail.decode(errors="replace").partition("\0")
    return kind, message
