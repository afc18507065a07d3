"""The gRPC face of an ExpertHostRuntime: decodes requests, encodes replies, maps errors.

A runtime error travels as a gRPC status plus trailing metadata `moeless-error: <kind>` (see
errors.py) so the client re-raises the same class.
"""

from __future__ import annotations

from typing import Sequence

import grpc

from moeless.expert_fn.wire import expert_host_pb2 as pb
from moeless.expert_fn.wire import expert_host_pb2_grpc as pb_grpc
from moeless.expert_fn.wire.codec import batches_from_proto, put_batches
from moeless.expert_fn.stores.model_stores import ModelRange
from moeless.expert_fn.errors import (
    ERROR_KEY,
    BadRequest,
    ExpertHostError,
    HostMemoryFull,
    ReplicaLoadError,
    refuse_unless_serving,
)
from moeless.expert_fn.wire.nixl_link import NixlError
from moeless.expert_fn.wire.routed import decode_call, encode_reply, raw_bytes
from moeless.expert_fn.host.run_routed import run_routed
from moeless.expert_fn.host.lifecycle import RESIDENT
from moeless.expert_fn.host.runtime import ExpertHostRuntime
from moeless.model.weight_store import WeightStoreError

STATUS_CODES = {
    ReplicaLoadError: grpc.StatusCode.FAILED_PRECONDITION,
    HostMemoryFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    BadRequest: grpc.StatusCode.INVALID_ARGUMENT,
}


def _abort(context: grpc.ServicerContext, err: ExpertHostError) -> None:
    context.set_trailing_metadata(((ERROR_KEY, err.kind),))
    context.abort(STATUS_CODES.get(type(err), grpc.StatusCode.INTERNAL), str(err))


class ExpertHostServicer(pb_grpc.ExpertHostServicer):
    def __init__(self, runtime: ExpertHostRuntime, local_channel: str = "", tcp_port: int = 0,
                 models: Sequence[ModelRange] = ()) -> None:
        self.runtime = runtime
        self.local_channel = local_channel  # the abstract socket of local_channel_server, "" if none
        self.tcp_port = tcp_port  # the TCP channel's port (tcp_server.py), 0 if none
        self.models = [pb.ModelLayers(name=m.name, first_layer=m.first_layer, layers=m.layers, experts=m.experts)
                       for m in models]  # offered with the channels

    def Load(self, request: pb.LoadRequest, context: grpc.ServicerContext) -> pb.LoadReply:
        try:
            state, started = self.runtime.load(request.layer, request.expert, wait=request.wait, source=request.source)
        except ExpertHostError as err:
            _abort(context, err)
        return pb.LoadReply(state=state.value, started=started)

    def LoadMany(self, request: pb.LoadManyRequest, context: grpc.ServicerContext) -> pb.LoadManyReply:
        sources = list(request.sources) or [""] * len(request.replicas)
        try:  # every load queued first (the host's load workers take them in turn), then each waited for
            if len(sources) != len(request.replicas):
                raise BadRequest(f"LoadMany has {len(sources)} sources for {len(request.replicas)} replicas; give "
                                 "one per replica (\"\" for the weight store) or none")
            self._expect_copies(request.replicas, sources)
            states = [self.runtime.load(r.layer, r.expert, source=src) for r, src in zip(request.replicas, sources)]
            for r, (state, _) in zip(request.replicas, states):
                if request.wait and state not in RESIDENT:
                    self.runtime.load(r.layer, r.expert, wait=True)
        except ExpertHostError as err:
            _abort(context, err)
        return pb.LoadManyReply(started=sum(started for _, started in states))

    def _expect_copies(self, replicas, sources: list[str]) -> None:
        """The replicas of a LoadMany that will copy from a peer, by peer: batched (peer_batches.py)."""
        rt, by_source = self.runtime, {}
        for r, source in zip(replicas, sources):
            key = rt.models.check(r.layer, r.expert)[0] if source else None
            if key is not None and rt.table.needs_load(key) and not rt.tier.contains(key):  # a hint: races are harmless
                by_source.setdefault(source, []).append(rt.models.content_key(key))
        for source, keys in by_source.items():
            rt.peers.expect(source, keys)

    def ReadReplica(self, request: pb.ReadReplicaRequest, context: grpc.ServicerContext) -> pb.ReplicaWeights:
        reply, resident = pb.ReplicaWeights(), self.runtime.resident_weights
        weights, more = resident(request.content_key), [resident(k) for k in request.more_keys] if request.link else []
        if weights is not None or any(w is not None for w in more):
            self.runtime.peers.serve(reply, weights, request, more)
        return reply

    def OpenCopyLink(self, request: pb.CopyLinkOffer, context: grpc.ServicerContext) -> pb.CopyLinkOffer:
        try:
            return pb.CopyLinkOffer(offer=self.runtime.peers.open_link(request.offer, request.capacity))
        except (ValueError, NixlError) as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))

    def Evict(self, request: pb.ReplicaRef, context: grpc.ServicerContext) -> pb.EvictReply:
        try:
            evicted, state = self.runtime.evict(request.layer, request.expert)
        except ExpertHostError as err:
            _abort(context, err)
        return pb.EvictReply(state=state.value, evicted=evicted)

    def Invoke(self, request: pb.InvokeRequest, context: grpc.ServicerContext) -> pb.InvokeReply:
        try:
            refuse_unless_serving(self.runtime.health)
            result = self.runtime.invoke(request.layer, batches_from_proto(request.batches))
        except ExpertHostError as err:
            _abort(context, err)
        reply = pb.InvokeReply(cold_starts=result.cold_starts, compute_s=result.compute_s)
        put_batches(reply.outputs, result.outputs)
        return reply

    def InvokeRouted(self, request: pb.RoutedFrame, context: grpc.ServicerContext) -> pb.RoutedFrame:
        try:
            refuse_unless_serving(self.runtime.health)
            call = decode_call(bytearray(request.frame))
            z, cold, compute = run_routed(self.runtime, call)
        except ExpertHostError as err:
            _abort(context, err)
        return pb.RoutedFrame(frame=encode_reply(call.head.call_id, z, cold, compute) + raw_bytes(z))

    def LocalChannel(self, request: pb.LocalChannelRequest, context: grpc.ServicerContext) -> pb.LocalChannelReply:
        return pb.LocalChannelReply(socket=self.local_channel, tcp_port=self.tcp_port, models=self.models)

    def AddModel(self, request: pb.AddModelRequest, context: grpc.ServicerContext) -> pb.LocalChannelReply:
        try:
            self.runtime.add_model(request.name, request.store)
        except WeightStoreError as err:
            _abort(context, BadRequest(str(err)))
        self.models = [pb.ModelLayers(name=m.name, first_layer=m.first_layer, layers=m.layers, experts=m.experts)
                       for m in self.runtime.models.ranges()]
        return self.LocalChannel(pb.LocalChannelRequest(), context)

    def Configure(self, request: pb.ConfigureRequest, context: grpc.ServicerContext) -> pb.ConfigureReply:
        try:
            return pb.ConfigureReply(keep_alive_s=self.runtime.set_keep_alive(request.keep_alive_s))
        except ExpertHostError as err:
            _abort(context, err)

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        s = self.runtime.status()
        return pb.StatusReply(
            device=s["device"], memory_bytes=s["memory_bytes"], keep_alive_s=s["keep_alive_s"],
            health=s["health"], inflight=s["inflight"],
            replicas=[pb.ReplicaStatus(**{k: v for k, v in r.items() if k != "aliases"},
                                       alias_layers=[a[0] for a in r["aliases"]], alias_experts=[a[1] for a in r["aliases"]])
                      for r in s["replicas"]],
            meters=pb.HostMeters(**s["meters"]),
            models={name: pb.HostMeters(**part) for name, part in s["models"].items()},
            peer_copies=pb.PeerCopyStats(**s["peer_copies"]),
        )

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthReply:
        health = self.runtime.health
        return pb.HealthReply(state=health, ready=health == "serving")
