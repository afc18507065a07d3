"""Peer copies over NIXL: the holder WRITEs a replica's bytes straight into the asker's memory.

A copy as bytes over gRPC (wire/replica_weights.py) serialises the tensors into a message on the
holder and parses them out on the asker, through gRPC's buffers on both sides. Over NIXL (UCX
underneath: shared memory on one machine, RDMA between nodes, GPU memory over NVLink or GPUDirect
RDMA where the hosts compute on GPUs) only the ask and the tensors' names, dtypes and shapes cross
gRPC:

1. The asker opens one link per holder (OpenCopyLink: the two NixlLinks' offers exchanged), one
   region each of the largest replica it asks for (its content key's shape, 4 bytes an element:
   the holder's compute dtype is float32 or the store's).
2. A ReadReplica naming the link has the holder copy the replica's tensors into its own region
   (one copy in host or GPU memory), WRITE them into the asker's with a notification, and wait
   until the WRITE is done before it answers. A WRITE completes only while both sides drive their
   workers (nixl_link.py), so the asker drives its own until the answer comes.
3. The asker copies the bytes out of its region, which serves its next copy: one copy at a time
   per link (its lock). The holder keeps at most MAX_LINKS links, the least recently used closed
   first (an asker that restarted opens a new one).

Whatever fails here (NIXL not installed or turned off on either side, a link that cannot be
registered or written) makes the asker copy from that holder as bytes over gRPC from then on
(peer_copy.py); a holder that cannot WRITE answers with bytes.

    link = AskerLink(stub, capacity, "cpu", timeout_s=10)     # the asker, once per holder
    reply, data = link.copy(stub, content_key, timeout_s=10)  # data: the bytes it WROTE (None: not written)
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict

import torch

from moeless.expert_fn.wire import expert_host_pb2 as pb
from moeless.expert_fn.wire import expert_host_pb2_grpc as pb_grpc
from moeless.expert_fn.wire.nixl_link import NixlError, NixlLink, unavailable
from moeless.expert_fn.wire.replica_weights import Weights, add_tensor

log = logging.getLogger(__name__)

MAX_LINKS = 64  # links a holder keeps (an asker each); the least recently used is closed first
MAX_CAPACITY = 4 << 30  # bytes a link's region may take: a replica larger than any model's expert is not asked for


class AskerLink:
    """The asking host's link to one holder (module docstring, steps 1 and 3)."""

    def __init__(self, stub: pb_grpc.ExpertHostStub, capacity: int, device: str, timeout_s: float) -> None:
        self.link = NixlLink("copy-asker", capacity, device, regions=1)
        try:
            reply = stub.OpenCopyLink(pb.CopyLinkOffer(offer=self.link.offer(), capacity=capacity), timeout=timeout_s)
            self.link.connect(reply.offer)
        except BaseException:
            self.link.close()
            raise
        self.capacity = capacity
        self._lock = threading.Lock()
        self._calls = itertools.count()

    def copy(self, stub: pb_grpc.ExpertHostStub, content_key: str,
             timeout_s: float) -> tuple[pb.ReplicaWeights, torch.Tensor | None]:
        """The holder's answer to a ReadReplica naming this link, and the bytes it WROTE here (fresh
        memory on the link's device); None where it answered otherwise (not resident, or as bytes)."""
        with self._lock:
            note = f"copy-{next(self._calls)}"
            asked = pb.ReadReplicaRequest(content_key=content_key, link=self.link.name, note=note)
            future = stub.ReadReplica.future(asked, timeout=timeout_s)
            while not future.done():  # the holder's WRITE completes only while this side's worker runs
                self.link.progress()
                time.sleep(0)  # gives the GIL to gRPC's threads, which deliver the answer
            reply = future.result()
            if not reply.written:
                return reply, None
            if reply.written > self.capacity:
                raise NixlError(f"the holder says it wrote {reply.written} bytes into a region of {self.capacity}")
            self.link.wait_note(note.encode(), timeout_s)  # arrives after its data; normally here already
            data = self.link.region(0, reply.written).clone()
            if data.is_cuda:  # copied out before the next copy's WRITE, which no stream orders, lands in the region
                torch.cuda.current_stream(data.device).synchronize()
            return reply, data

    def close(self) -> None:
        self.link.close()


class HolderLinks:
    """The holder's links, one per asker (module docstring, step 2). Thread-safe."""

    def __init__(self, device: str, nixl: bool = True, timeout_s: float = 10.0) -> None:
        self.device, self.nixl, self.timeout_s = device, nixl, timeout_s
        self._links: OrderedDict[str, tuple[NixlLink, threading.Lock]] = OrderedDict()  # asker's name -> link
        self._lock = threading.Lock()

    def open(self, offer: bytes, capacity: int) -> bytes:
        """A link to the asker whose NIXL offer this is; this side's offer. ValueError where this host
        takes no link (NIXL off or missing) or the capacity is out of bounds, NixlError where NIXL fails."""
        why = "NIXL is turned off on this expert host (expert-host --no-nixl)" if not self.nixl else unavailable()
        if why:
            raise ValueError(f"this expert host copies replicas to peers as bytes only: {why}")
        if not 0 < capacity <= MAX_CAPACITY:
            raise ValueError(f"a copy link's region must be 1 byte to {MAX_CAPACITY} bytes, asked {capacity}")
        link = NixlLink("copy-holder", capacity, self.device, regions=1)
        try:
            link.connect(offer)
        except BaseException:
            link.close()
            raise
        with self._lock:
            self._links[link.peer] = link, threading.Lock()
            closed = [self._links.popitem(last=False)[1][0] for _ in range(len(self._links) - MAX_LINKS)]
        for old in closed:
            old.close()
        return link.offer()

    def write(self, asker: str, note: str, weights: Weights, reply: pb.ReplicaWeights) -> bool:
        """WRITE weights' bytes into `asker`'s link with `note`, their names, dtypes and shapes into
        `reply` (reply.written: the bytes); False, reply untouched, where there is no such link or they
        do not fit, or (logged, the link closed) where the WRITE failed: the caller answers with bytes."""
        with self._lock:
            entry = self._links.get(asker)
            if entry is not None:
                self._links.move_to_end(asker)
        flat = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in weights.values()]
        total = sum(f.numel() for f in flat)
        if entry is None or total > entry[0].capacity:
            return False
        link, lock = entry
        with lock:
            try:
                region, at = link.region(0, total), 0
                for f in flat:
                    region[at:at + f.numel()].copy_(f)
                    at += f.numel()
                link.post_write(0, total, note.encode())
                link.finish_write(self.timeout_s)
            except NixlError as err:
                log.warning("a NIXL WRITE of a replica to peer host %s failed, answering with bytes: %s", asker, err)
                self._drop(asker, link)
                return False
        reply.resident, reply.written = True, total
        for name, t in weights.items():
            add_tensor(reply, name, t)
        return True

    def close(self) -> None:
        with self._lock:
            links, self._links = list(self._links.values()), OrderedDict()
        for link, _ in links:
            link.close()

    def _drop(self, asker: str, link: NixlLink) -> None:
        with self._lock:
            if self._links.get(asker, (None,))[0] is link:
                del self._links[asker]
        link.close()
