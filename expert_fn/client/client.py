"""Client of one expert host: what the serving path calls.

    client = ExpertHostClient("127.0.0.1:50051", timeout_s=30)
    client.load(layer, expert, wait=False)        # pre-warm; returns the replica's state
    client.evict(layer, expert)                   # True if evicted now
    out = client.invoke(layer, {expert: x, ...})  # x: [n, H] float32 -> out[expert]: [n, H]
    client.invoke_detailed(layer, {...})          # InvokeResult: outputs, cold_starts, compute_s
    pending = client.submit(call, x)              # a routed call (routed.py), asynchronous: the serving path
    pending.result()                              # RoutedResult: z [n_out, H], cold_starts, compute_s
    client.status()                               # dict: host facts, replicas, meters
    client.health()                               # {"state": "serving", "ready": True}
    client.close()

A host may serve several models from one memory (model_stores.py): a client made with
model="NAME" addresses that model's layers (the host's offer says where they are) and its
status() lists that model's replicas only; without a model it addresses the host's layers as
they are (one model: its own).

One invoke is one call for all the experts of a layer that this host serves; a replica not
resident is loaded on demand (a cold start, counted by the host). `submit` sends one routed
call (routed.py: each token once, in its own dtype, with its experts and gate weights) and
returns at once. The transport, from the host's offer (its LocalChannel RPC): "auto" (the
default) takes the shared-memory local channel when the host runs on this machine
(local_channel.py), else its TCP channel (tcp_channel.py: one connection, preallocated buffers,
the path between pods), else gRPC's InvokeRouted; "local", "tcp" and "grpc" force one (a pod
path measured on one machine is "tcp"); "nixl" is the TCP channel with its rows and z moved by
NIXL (nixl_link.py: GPU memory without host staging on a GPU cluster; needs nixl on both sides). Control calls (load, evict, status, health) are gRPC.
Errors:
- ExpertHostUnavailable: the host is dead, unreachable, draining or too slow (gRPC
  UNAVAILABLE, DEADLINE_EXCEEDED, ...): the caller should route to another replica.
- ReplicaLoadError: the replica's weights failed to load; the message names the file.
- HostMemoryFull, BadRequest (also a ValueError), ExpertHostError for anything else.
After a host restarts on the same address the client reconnects by itself within about a
second (reconnect backoff 0.1-1 s); calls until then raise ExpertHostUnavailable.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Sequence

import grpc
import torch

from moeless.expert_fn.wire import expert_host_pb2 as pb
from moeless.expert_fn.wire import expert_host_pb2_grpc as pb_grpc
from moeless.expert_fn.wire.codec import (
    CLIENT_OPTIONS,
    InvokeResult,
    batches_from_proto,
    put_batches,
)
from moeless.expert_fn.errors import (
    ERROR_KEY,
    ERRORS_BY_KIND,
    ExpertHostError,
    ExpertHostUnavailable,
    ReplicaLoadError,  # noqa: F401 (re-exported: callers catch it from here)
)
from moeless.expert_fn.client.local_channel import LocalChannel
from moeless.expert_fn.host.meters import ModelTotals
from moeless.expert_fn.options import TRANSPORTS
from moeless.expert_fn.wire.polling import DEFAULT_CLIENT_POLL_S
from moeless.expert_fn.wire.nixl_link import DEFAULT_CAPACITY
from moeless.expert_fn.wire.routed import Pending, RoutedCall, RoutedResult, decode_reply_head, encode_call, split_error, staged
from moeless.expert_fn.client.tcp_channel import TcpChannel


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

    def __init__(self, address: str, timeout_s: float = 30.0, transport: str = "auto",
                 poll_s: float = DEFAULT_CLIENT_POLL_S, model: str | None = None) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.address = address
        self.timeout_s = timeout_s
        self.transport = transport
        self.poll_s = poll_s  # the data channel spins this long for an answer before blocking (polling.py)
        self.model = model
        self._range: pb.ModelLayers | None = None  # the model's layers on the host (from its offer)
        self._channel = grpc.insecure_channel(address, options=CLIENT_OPTIONS)
        self._stub = pb_grpc.ExpertHostStub(self._channel)
        # The data channel: None = not asked since the last failure, False = gRPC (the host offers
        # nothing this transport takes), else the open local or TCP channel.
        self._channel_now: LocalChannel | TcpChannel | bool | None = None
        self._calls = 0

    def _call(self, method, request, timeout_s: float | None = None):
        try:
            return method(request, timeout=self.timeout_s if timeout_s is None else timeout_s)
        except grpc.RpcError as err:
            raise _translate(err, self.address) from None

    def load(self, layer: int, expert: int, wait: bool = False, source: str = "") -> str:
        """Pre-warm (layer, expert); returns its state ("loading", or "idle"/"warm" when resident).

        wait=True returns once it is resident and raises ReplicaLoadError if it cannot load. source: the
        address of a peer host holding it resident, which the host copies it from (expert_fn/host/peer_copy.py).
        """
        request = pb.LoadRequest(layer=layer + self._first_layer(), expert=expert, wait=wait, source=source)
        return self._call(self._stub.Load, request).state

    def load_many(self, replicas: Sequence[tuple[int, int]], wait: bool = False, timeout_s: float | None = None,
                  sources: Sequence[str] = ()) -> int:
        """load for every (layer, expert) of `replicas` in one RPC -> the loads it started; wait=True
        returns once all are resident (raising as load does), within timeout_s (default: the client's);
        sources: none, or one per replica (load's source, "" for the store)."""
        first = self._first_layer()
        request = pb.LoadManyRequest(replicas=[pb.ReplicaRef(layer=l + first, expert=e) for l, e in replicas], wait=wait,
                                     sources=list(sources))
        return self._call(self._stub.LoadMany, request, timeout_s).started

    def evict(self, layer: int, expert: int) -> bool:
        """Evict (layer, expert); False if it was loading, busy (evicted when done) or absent."""
        return self._call(self._stub.Evict, pb.ReplicaRef(layer=layer + self._first_layer(), expert=expert)).evicted

    def invoke(self, layer: int, batches: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Outputs of layer's experts on their tokens, in one RPC.

        batches: expert -> x: [n, H] float32; returns expert -> [n, H] float32.
        """
        return self.invoke_detailed(layer, batches).outputs

    def invoke_detailed(self, layer: int, batches: dict[int, torch.Tensor]) -> InvokeResult:
        """invoke, plus the call's cold starts and the host's compute time."""
        request = pb.InvokeRequest(layer=layer + self._first_layer())
        put_batches(request.batches, batches)
        reply = self._call(self._stub.Invoke, request)
        return InvokeResult(batches_from_proto(reply.outputs), reply.cold_starts, reply.compute_s)

    def submit(self, call: RoutedCall, x: torch.Tensor) -> Pending:
        """Start a routed call on the rows x[call.tokens] (x: [T, H] contiguous, in the dtype the
        tokens travel in); pending.result() -> RoutedResult (z: [n_out, H]). x on a GPU: over the
        local channel (CUDA IPC) and NIXL the rows and z stay in GPU memory; TCP and gRPC stage the
        call's rows through host memory, and z comes back there."""
        channel = self._data_channel()
        if self.model is not None:
            call = replace(call, layer=call.layer + self._first_layer())
        if x.device.type != "cpu" and not isinstance(channel, LocalChannel) \
                and not (isinstance(channel, TcpChannel) and channel.takes_device_rows):
            call, x = staged(call, x)  # TCP and gRPC carry host memory: only the call's rows come over
        if channel is not None:
            return channel.submit(call, x)
        self._calls += 1
        request = pb.RoutedFrame(frame=bytes(encode_call(self._calls, call, x)))
        return _GrpcPending(self._stub.InvokeRouted.future(request, timeout=self.timeout_s), self.address)

    @property
    def path(self) -> str:
        """The data path calls take now: "local", "tcp", "nixl" or "grpc"; "unopened" before the first data
        call and after a channel broke (the next call asks the host's offer again)."""
        if self._channel_now is False:
            return "grpc"
        if isinstance(self._channel_now, LocalChannel) and not self._channel_now.broken:
            return "local"
        if isinstance(self._channel_now, TcpChannel) and not self._channel_now.broken:
            return "nixl" if self._channel_now.takes_device_rows else "tcp"
        return "unopened"

    @property
    def uses_local_channel(self) -> bool:
        return self.path == "local"

    def _data_channel(self) -> LocalChannel | TcpChannel | None:
        """The open local or TCP channel, opening one from the host's offer; None: gRPC."""
        if isinstance(self._channel_now, (LocalChannel, TcpChannel)) and self._channel_now.broken:
            self._channel_now = None  # the host died or restarted: ask it again
        if self._channel_now is None:
            self._channel_now = self._open_channel()
        return self._channel_now or None

    def _open_channel(self) -> LocalChannel | TcpChannel | bool:
        """What this client's transport takes of the host's offer; False: gRPC."""
        if self.transport == "grpc":
            return False
        try:
            offer = self._offer()
            socket_name, tcp_port = offer.socket, offer.tcp_port
            self._range = None if self.model is None else self._model_range(offer)  # a restarted host says anew
        except ExpertHostUnavailable:
            raise
        except ExpertHostError:  # a host that predates the offer (UNIMPLEMENTED)
            socket_name, tcp_port = "", 0
        if self.transport in ("auto", "local") and socket_name:
            try:
                return LocalChannel(socket_name, timeout_s=self.timeout_s, poll_s=self.poll_s)
            except ExpertHostUnavailable:
                if self.transport == "local":
                    raise  # the host answered but its socket is not here: another machine
        if self.transport == "local":
            raise ExpertHostError(f"expert host {self.address} offers no local channel reachable from here; "
                                  "use transport 'auto', 'tcp' or 'grpc'")
        if tcp_port:
            host = self.address.rpartition(":")[0]
            return TcpChannel(f"{host}:{tcp_port}", timeout_s=self.timeout_s, poll_s=self.poll_s,
                              nixl_bytes=DEFAULT_CAPACITY if self.transport == "nixl" else 0)
        if self.transport in ("tcp", "nixl"):
            raise ExpertHostError(f"expert host {self.address} offers no TCP channel (NIXL's doorbell); "
                                  "use transport 'auto' or 'grpc'")
        return False

    def status(self) -> dict:
        """{"device", "memory_bytes", "keep_alive_s", "health", "inflight", "replicas": [...],
        "meters": {...}}; each replica: layer, expert, state, bytes, gb_s, invocations, tokens,
        last_load_s, error, models (those it computes for), shared (more than one). With a model: the
        replicas its experts use, at its own layer numbers (a replica it shares with another model is
        listed under each one's numbers: the host holds it once), and its own part of the meters
        (GB·s split, bytes, loads, cold starts, tokens, cold-start seconds, own and shared replicas);
        the memory and the other meters are the host's, every model's. Without a model, "models" holds
        every model's part, read with the host's totals. "peer_copies": the host's copies from peer hosts
        (host/peer_copy.py: copies, fallbacks, bytes, seconds, served, passed, the two ways' GB/s)."""
        reply = self._call(self._stub.Status, pb.StatusRequest())
        status = {name: getattr(reply, name) for name in ("device", "memory_bytes", "keep_alive_s", "health", "inflight")}
        first, layers = (self._first_layer(), self._range.layers) if self.model is not None else (0, None)
        status["replicas"] = []
        for r in reply.replicas:
            fields_ = {k: v for k, v in _fields(r).items() if k not in ("alias_layers", "alias_experts")}
            fields_ |= {"models": list(r.models), "shared": len(r.models) > 1}
            for layer, expert in [(r.layer, r.expert), *zip(r.alias_layers, r.alias_experts)]:
                if layers is None and (layer, expert) != (r.layer, r.expert):
                    continue  # the host's own view: each replica once, at its canonical key
                if layers is None or first <= layer < first + layers:
                    status["replicas"].append({**fields_, "layer": layer - first, "expert": expert})
        status["meters"], status["peer_copies"] = _fields(reply.meters), _fields(reply.peer_copies)
        if self.model is None:  # every model's part, read with the totals at one time: they add up
            status["models"] = {name: _fields(part) for name, part in reply.models.items()}
        elif self.model in reply.models:  # its own part where the host has one
            part = _fields(reply.models[self.model])
            status["meters"].update({f.name: part[f.name] for f in fields(ModelTotals)})
        return status

    def configure(self, keep_alive_s: float) -> float:
        """Set the host's keep-alive while it serves (every model's on a shared host); returns it."""
        return self._call(self._stub.Configure, pb.ConfigureRequest(keep_alive_s=keep_alive_s)).keep_alive_s

    def add_model(self, name: str, store: str) -> list[dict]:
        """Have the host serve the weight store at `store` (a path on the host) as model `name` from now
        on, without a restart; returns the models it serves then. BadRequest says why it refused."""
        return [_fields(m) for m in self._call(self._stub.AddModel, pb.AddModelRequest(name=name, store=store)).models]

    def models(self) -> list[dict]:
        """The models the host serves: name, first_layer, layers, experts (its offer)."""
        return [_fields(m) for m in self._offer().models]

    def _first_layer(self) -> int:
        """Where this client's model begins in the host's layers (0 without a model)."""
        if self.model is None:
            return 0
        if self._range is None:
            self._range = self._model_range(self._offer())
        return self._range.first_layer

    def _offer(self) -> pb.LocalChannelReply:
        """The host's offer: its data channels and the models it serves (the LocalChannel RPC)."""
        return self._call(self._stub.LocalChannel, pb.LocalChannelRequest())

    def _model_range(self, offer) -> pb.ModelLayers:
        for m in offer.models:
            if m.name == self.model:
                return m
        raise ExpertHostError(f"expert host {self.address} does not serve model {self.model!r}; it serves "
                              f"{[m.name for m in offer.models] or 'no named model (an older host)'}")

    def health(self) -> dict:
        """{"state": "starting" | "serving" | "draining", "ready": bool}."""
        reply = self._call(self._stub.Health, pb.HealthRequest())
        return {"state": reply.state, "ready": reply.ready}

    def close(self) -> None:
        if isinstance(self._channel_now, (LocalChannel, TcpChannel)):
            self._channel_now.close()
        self._channel.close()

    def __enter__(self) -> "ExpertHostClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _GrpcPending:
    """An InvokeRouted call in flight."""

    def __init__(self, future, address: str):
        self._future, self._address = future, address

    def result(self) -> RoutedResult:
        try:
            reply = self._future.result()
        except grpc.RpcError as err:
            raise _translate(err, self._address) from None
        data = bytearray(reply.frame)
        head = decode_reply_head(data)
        body = memoryview(data)[len(data) - head.body_bytes:]
        if not head.ok:
            kind, message = split_error(bytes(body))
            raise ERRORS_BY_KIND.get(kind, ExpertHostError)(message)
        z = torch.frombuffer(body, dtype=head.dtype).view(head.n_out, head.hidden) if head.n_out * head.hidden \
            else torch.empty(head.n_out, head.hidden, dtype=head.dtype)
        return RoutedResult(z, head.cold_starts, head.compute_s)
