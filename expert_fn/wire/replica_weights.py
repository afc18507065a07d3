"""A resident replica's weights on the wire (the ReadReplica RPC: expert_fn/host/peer_copy.py).

Two forms, and a third beside them (the bytes WRITTEN over NIXL, their names, dtypes and shapes
here: host/peer_links.py). Bytes: each tensor's name, dtype and shape, and their row-major bytes
one after another in one field (upb serialised a few MB in one field about 9x faster than in three
nested ones, in a one-off script of 2026-11-30, not a bench). Device: where the asker computes on
a CUDA GPU and the holder's replica is on one, each tensor's GPU memory described as
cuda_ipc.describe gives it; the asker maps it and copies it into its own GPU memory, over NVLink
or PCIe peer to peer between two GPUs of a node (on one GPU, within its memory), never staged
through host memory. That needs what CUDA IPC needs (cuda_ipc.py:
one machine, the same GPU numbering on both sides, pods in the node's IPC namespace); where it
fails the asker asks again for bytes.

Either way the receiver checks each tensor against the content key it asked for: the three expert
tensors, each of the key's shape, in the key's dtype or float32 (the holder's compute dtype).

    reply = pb.ReplicaWeights(); put_weights(reply, weights, device=False)
    weights = weights_from(reply, key)                          # fresh CPU memory
    weights = weights_in(reply, written, key)                   # views of the bytes WRITTEN over NIXL
    weights = device_weights_from(reply, key, "cuda:0")         # a device reply, copied onto cuda:0
"""

from __future__ import annotations

import torch

from moeless.expert_fn.wire import expert_host_pb2 as pb
from moeless.expert_fn.wire.cuda_ipc import DeviceBufferError, describe, open_described
from moeless.model.content_keys import parse_key
from moeless.model.experts import EXPERT_TENSORS

Weights = dict[str, torch.Tensor]


class PeerCopyError(Exception):
    """A peer's reply that cannot be this expert's weights (the message says why)."""


def put_weights(reply: pb.ReplicaWeights, weights: Weights, device: bool = False) -> None:
    """Fill `reply` with weights: described device memory where `device` and they are on a GPU, else their
    row-major bytes one after another in reply.data (from a GPU: one copy to host memory)."""
    reply.resident = True
    if device and all(t.is_cuda for t in weights.values()):
        try:  # a replica's tensors are its own allocations, contiguous from offset 0
            described = [describe(t.detach().reshape(-1).view(torch.uint8)) for t in weights.values()]
        except DeviceBufferError:  # not shareable after all: bytes, as to another machine
            described = []
        for (name, t), shared in zip(weights.items(), described):
            add_tensor(reply, name, t).described = shared
        if described:
            return
    flat = []
    for name, t in weights.items():
        t = t.detach().to("cpu").contiguous()
        add_tensor(reply, name, t)
        flat.append(t.reshape(-1).view(torch.uint8))
    reply.data = torch.cat(flat).numpy().tobytes()


def add_tensor(reply: pb.ReplicaWeights, name: str, t: torch.Tensor) -> pb.WeightTensor:
    """Name t in reply.tensors (its dtype and shape; its bytes travel apart)."""
    return reply.tensors.add(name=name, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape))


def weights_from(reply: pb.ReplicaWeights, content_key: str) -> Weights:
    """The tensors of a bytes reply (views of one fresh CPU buffer): weights_in its data field."""
    data = torch.frombuffer(bytearray(reply.data), dtype=torch.uint8) if reply.data else torch.empty(0, dtype=torch.uint8)
    return weights_in(reply, data, content_key)


def weights_in(reply: pb.ReplicaWeights, data: torch.Tensor, content_key: str) -> Weights:
    """The tensors `reply` names as views of data (uint8, their bytes one after another: a bytes reply's
    field, or what the holder WROTE into a NIXL link, on any device); PeerCopyError unless they are exactly
    the expert tensors of `content_key`'s shape, in its dtype or float32."""
    shapes, kinds, sizes = _checked(reply, content_key)
    if data.numel() != sum(sizes):
        raise PeerCopyError(f"{data.numel()} bytes of tensors, where {[t.name for t in reply.tensors]} take "
                            f"{sum(sizes)}")
    weights, at = {}, 0
    for t, shape, kind, size in zip(reply.tensors, shapes, kinds, sizes):
        weights[t.name] = data[at:at + size].view(kind).reshape(shape)
        at += size
    return weights


def device_weights_from(reply: pb.ReplicaWeights, content_key: str, device: str) -> Weights:
    """The tensors of a device reply copied into fresh memory on `device` (waited for); PeerCopyError as
    weights_from, cuda_ipc.DeviceBufferError where the holder's memory cannot be mapped here."""
    shapes, kinds, sizes = _checked(reply, content_key)
    weights = {}
    for t, shape, kind, size in zip(reply.tensors, shapes, kinds, sizes):
        source = open_described(t.described)  # the holder's memory, mapped until `source` is dropped
        if source.numel() != size:
            raise PeerCopyError(f"tensor {t.name}: {source.numel()} bytes of device memory, where it takes {size}")
        copy = torch.empty(size, dtype=torch.uint8, device=device)
        copy.copy_(source)
        weights[t.name] = copy.view(kind).reshape(shape)
        del source
    torch.cuda.synchronize(device)
    return weights


def _checked(reply: pb.ReplicaWeights, content_key: str) -> tuple[list[list[int]], list[torch.dtype], list[int]]:
    """Each tensor's shape, dtype and bytes where `reply` holds exactly content_key's expert tensors."""
    dtype, ffn, hidden = parse_key(content_key)
    expected = {"gate": [ffn, hidden], "up": [ffn, hidden], "down": [hidden, ffn]}
    names = [t.name for t in reply.tensors]
    if sorted(names) != sorted(EXPERT_TENSORS):
        raise PeerCopyError(f"tensors {names}, where an expert has {list(EXPERT_TENSORS)}")
    kinds = []
    for t in reply.tensors:
        if t.dtype not in (dtype, "float32") or list(t.shape) != expected[t.name]:
            raise PeerCopyError(f"tensor {t.name} is {t.dtype} {list(t.shape)}, where the key says {dtype} "
                                f"{expected[t.name]}")
        kinds.append(getattr(torch, t.dtype))
    return [expected[n] for n in names], kinds, [ffn * hidden * kind.itemsize for kind in kinds]
