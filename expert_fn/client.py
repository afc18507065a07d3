"""Client of one expert host: what the serving path calls.

    client = ExpertHostClient("127.0.0.1:50051", timeout_s=30)
    client.load(layer, expert, wait=False)        # pre-warm; returns the replica's state
    client.evict(layer, expert)                   # True if evicted now
    out = client.invoke(layer, {expert: x, ...})  # x: [n, H] float32 -> out[expert]: [n, H]
    client.invoke_detailed(layer, {...})          # InvokeResult: outputs, cold_starts, compute_s
    pending = client.submit(layer, experts, counts, x, rows)   # packed, asynchronous (the serving path)
    pending.result()                              # PackedResult: y [n, H], cold_starts, compute_s
    client.status()                               # dict: host facts, replicas, meters
    client.health()                               # {"state": "serving", "ready": True}
    client.close()

One invoke is one call for all the experts of a layer that this host serves; a replica not
resident is loaded on demand (a cold start, counted by the host). `submit` sends the tokens of
all experts as one packed tensor (expert_fn/packed.py) and returns at once; with transport
"auto" (the default) it goes through the host's shared-memory local channel when the host runs
on this machine (local_channel.py, about a tenth of gRPC's per-call cost) and through gRPC
otherwise; "grpc" and "local" force one. Control calls (load, evict, status, health) are gRPC.
Errors:
- ExpertHostUnavailable: the host is dead, unreachable, draining or too slow (gRPC
  UNAVAILABLE, DEADLINE_EXCEEDED, ...): the caller should route to another replica.
- ReplicaLoadError: the replica's weights failed to load; the message names the file.
- HostMemoryFull, BadRequest (also a ValueError), ExpertHostError for anything else.
After a host restarts on the same address the client reconnects by itself within about a
second (reconnect backoff 0.1-1 s); calls until then raise ExpertHostUnavailable.
"""

from __future__ import annotations

from typing import Sequence

import grpc
import torch

from moeless.expert_fn import expert_host_pb2 as pb
from moeless.expert_fn import expert_host_pb2_grpc as pb_grpc
from moeless.expert_fn.codec import (
    CLIENT_OPTIONS,
    InvokeResult,
    batches_from_proto,
    put_batches,
    put_tensor,
    tensor_from_proto,
)
from moeless.expert_fn.errors import (
    ERROR_KEY,
    ERRORS_BY_KIND,
    ExpertHostError,
    ExpertHostUnavailable,
    ReplicaLoadError,  # noqa: F401 (re-exported: callers catch it from here)
)
from moeless.expert_fn.local_channel import LocalChannel
from moeless.expert_fn.packed import PackedResult, Pending

TRANSPORTS = ("auto", "grpc", "local")

# Codes that mean "this host cannot answer", whatever the call was.
UNAVAILABLE_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
}


def _translate(err: grpc.RpcError, address: str) -> ExpertHostError:
    """The moeless error for a failed call (the host's kind when it sent one)."""
    kind = dict(err.trailing_metadata() or ()).get(ERROR_KEY)
    if kind in ERRORS_BY_KIND:
        return ERRORS_BY_KIND[kind](err.details())
    if err.code() in UNAVAILABLE_CODES:
        return ExpertHostUnavailable(f"expert host {address}: {err.code().name}: {err.details()}")
    return ExpertHostError(f"expert host {address}: {err.code().name}: {err.details()}")


def _fields(message) -> dict:
    """A flat message's fields as a dict of Python scalars."""
    return {field.name: getattr(message, field.name) for field in message.DESCRIPTOR.fields}


class ExpertHostClient:
    """A channel to the expert host at `address` ("host:port"); every call has timeout_s."""

    def __init__(self, address: str, timeout_s: float = 30.0, transport: str = "auto") -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.address = address
        self.timeout_s = timeout_s
        self.transport = transport
        self._channel = grpc.insecure_channel(address, options=CLIENT_OPTIONS)
        self._stub = pb_grpc.ExpertHostStub(self._channel)
        # The local channel: None = not tried since the last failure, False = this host has none
        # reachable from here (another machine), else the open channel.
        self._local: LocalChannel | bool | None = False if transport == "grpc" else None

    def _call(self, method, request):
        try:
            return method(request, timeout=self.timeout_s)
        except grpc.RpcError as err:
            raise _translate(err, self.address) from None

    def load(self, layer: int, expert: int, wait: bool = False) -> str:
        """Pre-warm (layer, expert); returns its state ("loading", or "idle"/"warm" when resident).

        wait=True returns once it is resident and raises ReplicaLoadError if it cannot load.
        """
        return self._call(self._stub.Load, pb.LoadRequest(layer=layer, expert=expert, wait=wait)).state

    def evict(self, layer: int, expert: int) -> bool:
        """Evict (layer, expert); False if it was loading, busy (evicted when done) or absent."""
        return self._call(self._stub.Evict, pb.ReplicaRef(layer=layer, expert=expert)).evicted

    def invoke(self, layer: int, batches: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Outputs of layer's experts on their tokens, in one RPC.

        batches: expert -> x: [n, H] float32; returns expert -> [n, H] float32.
        """
        return self.invoke_detailed(layer, batches).outputs

    def invoke_detailed(self, layer: int, batches: dict[int, torch.Tensor]) -> InvokeResult:
        """invoke, plus the call's cold starts and the host's compute time."""
        request = pb.InvokeRequest(layer=layer)
        put_batches(request.batches, batches)
        reply = self._call(self._stub.Invoke, request)
        return InvokeResult(batches_from_proto(reply.outputs), reply.cold_starts, reply.compute_s)

    def submit(self, layer: int, experts: Sequence[int], counts: Sequence[int], x: torch.Tensor,
               rows: torch.Tensor) -> Pending:
        """Start a packed call with the rows x[rows] (x: [T, H] float32, rows: [n] long, expert-major:
        counts[i] rows for experts[i]); pending.result() -> PackedResult (y: [n, H])."""
        local = self._local_channel()
        if local is not None:
            return local.submit(layer, experts, counts, x, rows)
        request = pb.PackedRequest(layer=layer, experts=experts, counts=counts)
        put_tensor(request.x, x.index_select(0, rows))
        return _GrpcPending(self._stub.InvokePacked.future(request, timeout=self.timeout_s), self.address)

    @property
    def uses_local_channel(self) -> bool:
        return isinstance(self._local, LocalChannel) and not self._local.broken

    def _local_channel(self) -> LocalChannel | None:
        """The open local channel, opening one if the host offers it and shares this machine."""
        if isinstance(self._local, LocalChannel) and self._local.broken:
            self._local = None  # the host died or restarted: ask it again
        if self._local is None:
            try:
                name = self._call(self._stub.LocalChannel, pb.LocalChannelRequest()).socket
            except ExpertHostUnavailable:
                raise
            except ExpertHostError:  # a host that predates the local channel (UNIMPLEMENTED)
                name = ""
            try:
                self._local = LocalChannel(name, timeout_s=self.timeout_s) if name else False
            except ExpertHostUnavailable:
                if self.transport == "local":
                    raise
                self._local = False  # the host answered but its socket is not here: another machine
        if self._local is False and self.transport == "local":
            raise ExpertHostError(f"expert host {self.address} offers no local channel reachable from here; "
                                  "use transport 'auto' or 'grpc'")
        return self._local or None

    def status(self) -> dict:
        """{"device", "memory_bytes", "keep_alive_s", "health", "inflight", "replicas": [...],
        "meters": {...}}; each replica: layer, expert, state, bytes, gb_s, invocations, tokens,
        last_load_s, error."""
        reply = self._call(self._stub.Status, pb.StatusRequest())
        status = {name: getattr(reply, name) for name in ("device", "memory_bytes", "keep_alive_s", "health", "inflight")}
        status["replicas"] = [_fields(r) for r in reply.replicas]
        status["meters"] = _fields(reply.meters)
        return status

    def health(self) -> dict:
        """{"state": "starting" | "serving" | "draining", "ready": bool}."""
        reply = self._call(self._stub.Health, pb.HealthRequest())
        return {"state": reply.state, "ready": reply.ready}

    def close(self) -> None:
        if isinstance(self._local, LocalChannel):
            self._local.close()
        self._channel.close()

    def __enter__(self) -> "ExpertHostClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _GrpcPending:
    """An InvokePacked call in flight."""

    def __init__(self, future, address: str):
        self._future, self._address = future, address

    def result(self) -> PackedResult:
        try:
            reply = self._future.result()
        except grpc.RpcError as err:
            raise _translate(err, self._address) from None
        return PackedResult(tensor_from_proto(reply.y), reply.cold_starts, reply.compute_s)
