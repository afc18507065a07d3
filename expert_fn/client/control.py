"""One-shot control calls to an expert host that need neither torch nor a data channel: what the
operator sends (it runs without the serving stack; client.py's ExpertHostClient is the data plane's
client and also offers `configure`)."""

from __future__ import annotations

import grpc

from moeless.expert_fn.wire import expert_host_pb2 as pb
from moeless.expert_fn.wire import expert_host_pb2_grpc as pb_grpc


def configure_keep_alive(address: str, keep_alive_s: float, timeout_s: float = 2.0) -> float:
    """Set the host at `address` (host:port of its gRPC server) to keep idle replicas keep_alive_s
    seconds; returns the value it runs now. grpc.RpcError when the host cannot be reached."""
    with grpc.insecure_channel(address) as channel:
        reply = pb_grpc.ExpertHostStub(channel).Configure(pb.ConfigureRequest(keep_alive_s=keep_alive_s),
                                                          timeout=timeout_s)
    return reply.keep_alive_s
