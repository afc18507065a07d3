"""A replica copied from a peer host that holds it resident, instead of read from the weight store.

A scale-out or a widening loads a share of the experts on hosts that do not hold them. Where
another host of the pool holds one resident, the planning loop names that host as the load's
source (controller/planning/peer_sources.py), and the loading host copies the replica's tensors
from it (the ReadReplica RPC) instead of reading and verifying the store's file, where that pays:
never where its own host tier holds the expert (a copy out of its own memory beats any wire), and
otherwise by measurement. The host keeps both ways' recent seconds per byte (a moving average of
its copies from peers and of its store reads), measures each way once, then copies from the peer
while that is the faster, trying the slower way once in PROBE_EVERY loads so that a change (a
congested volume, a busy peer) shows. A peer that did not answer (gone, unreachable, too slow) is
not asked again for DOWN_S seconds: a dead holder costs one timeout, not one a load.

Three routes, the first that works per peer:
- WRITTEN over NIXL (peer_links.py): UCX moves the bytes (shared memory on one machine, RDMA
  between nodes, GPU memory where the hosts compute on GPUs: NVLink within a node), gRPC carries
  only the ask, and one ask carries the replicas of a LoadMany from that peer, up to
  `--peer-ask-mb` (1 GiB), streamed through the link's region (peer_batches.py, peer_links.py).
  The host opens its link to a peer in the background at the first copy it would make from it
  (about 3 s the first time in a process here), copying over CUDA IPC meanwhile where it can, else
  reading its store (measured) or copying as bytes (always). `expert-host --no-nixl`, NIXL not
  installed, or a link that fails: the routes below.
- GPU to GPU over CUDA IPC, where this host computes on a GPU and the holder's replica is on one of
  the same machine (wire/replica_weights.py; NVLink where the node has it), one ask a replica; a
  peer whose memory cannot be mapped here (another machine) is not asked for it again;
  `expert-host --no-peer-ipc`: never tried (pods of one node that share no IPC namespace). It comes
  second: the one GPU run measured it slower than NIXL GPU to GPU within one GPU (4.25 ms a 34.6 MB
  expert against 2.43 ms: it maps the holder's memory afresh each copy), and only NIXL streams a
  LoadMany's replicas in one ask.
- As bytes over gRPC.
Figures: docs/benchmarks.md (`moeless bench peer-copy`). Whatever goes wrong (the peer gone or slow,
the replica evicted there since the loop looked, a tensor of the wrong name, dtype or shape) is
logged and the load reads the store: a peer can make a load shorter, never wrong, never lose it.

The peer is asked by content key (model/content_keys.py), not by (layer, expert): two hosts may
number their layers differently, and a key names the bytes, so a copy is of the same expert or of
none. The peer verified those bytes when it loaded them from its store; the receiver checks each
tensor's name, dtype and shape against the key. The tensors travel in the holder's compute dtype
(float32, or the store's own), converted exactly to the receiver's.

    peers = PeerCopies()
    weights = peers.fetch(tier, key, "10.0.0.7:50051", content_key)   # the tier's, the peer's or the store's
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass

import grpc

from moeless.expert_fn.wire import expert_host_pb2 as pb
from moeless.expert_fn.wire import expert_host_pb2_grpc as pb_grpc
from moeless.expert_fn.host.executor import Weights
from moeless.expert_fn.host.peer_batches import ASK_BYTES, Batch, CopyBatches
from moeless.expert_fn.host.peer_holder import NO_LINK, HolderLinks
from moeless.expert_fn.host.peer_links import AskerLink, AskerLinks
from moeless.expert_fn.options import PEER_COPIES
from moeless.expert_fn.stores.tiers import HostTier, Key, weights_bytes
from moeless.expert_fn.wire.codec import CLIENT_OPTIONS
from moeless.expert_fn.wire.cuda_ipc import DeviceBufferError
from moeless.expert_fn.wire.replica_weights import (PeerCopyError, device_weights_from, put_weights, weights_from,
                                                    weights_in)

log = logging.getLogger(__name__)

PROBE_EVERY = 16  # loads given a peer: the slower way measured again once in this many
DOWN_S = 30.0  # seconds a peer that did not answer is not asked again
SMOOTHING = 0.25  # weight of the newest measurement in each way's moving average


@dataclass
class PeerCopyStats:
    copies: int = 0
    fallbacks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    served: int = 0
    writes: int = 0  # NIXL WRITEs of those served over links (a chunk each: an ask streams many, peer_links.py)
    linked: int = 0  # of the copies, those WRITTEN over NIXL (peer_links.py)
    links: int = 0  # NIXL links open to peers
    link_bytes: int = 0  # memory their regions hold here, as asker and as holder (the device's: a GPU's on one)
    batched: int = 0  # of the linked copies, those brought by another load's ask (peer_batches.py)
    passed: int = 0  # loads given a peer that read the store (faster, its turn, the peer down, its link opening)
    peer_gb_per_s: float = 0.0  # the moving averages the choice reads (0: not measured yet)
    store_gb_per_s: float = 0.0


class PeerCopies:
    """Loads from peer hosts where they pay, one channel per peer (module docstring). Thread-safe."""

    def __init__(self, mode: str = "measured", device: str = "cpu", timeout_s: float = 10.0, nixl: bool = True,
                 cuda_ipc: bool = True, ask_bytes: int = ASK_BYTES) -> None:
        if mode not in PEER_COPIES:
            raise ValueError(f"peer copies must be one of {', '.join(PEER_COPIES)}, got {mode!r}")
        self.mode, self.device, self.timeout_s = mode, device, timeout_s
        self.holder = HolderLinks(device, nixl, timeout_s)  # NIXL links to the hosts that copy from this one
        self._cuda_ipc = cuda_ipc  # False: never map a peer's GPU memory (expert-host --no-peer-ipc)
        self.ask_bytes = ask_bytes  # the most one ask over a link carries (0: one region's worth)
        self._no_ipc: set[str] = set()  # peers whose GPU memory this host could not map
        self._batches = CopyBatches()  # a LoadMany's replicas from one peer, copied together over its link
        self._down: dict[str, float] = {}  # peer -> when it last did not answer
        self.stats = PeerCopyStats()
        self._stubs: dict[str, tuple[grpc.Channel, pb_grpc.ExpertHostStub]] = {}
        self._offered = 0  # loads given a peer where the tier lacked the expert
        self._lock = threading.Lock()
        self.links = AskerLinks(device, nixl, timeout_s, self._stub, self._measure_afresh)  # to the holders

    def fetch(self, tier: HostTier, key: Key, source: str, content_key: str) -> Weights:
        """key's weights: from the host tier where it holds them, else from the peer at `source` ("":
        none) where copies measure faster (a copy in host memory entering the tier), else read and
        verified into the tier (WeightStoreError where that fails)."""
        if source and not tier.contains(key) and self._peer_first(source, content_key):
            weights = self.read(source, content_key)
            if weights is not None:
                if all(t.device.type == "cpu" for t in weights.values()):  # a GPU copy's stays on the GPU
                    tier.offer(key, weights)
                return weights
        elif source:
            self._batches.discard(source, content_key)
        started = time.perf_counter()
        weights, where = tier.get(key)
        if where == "disk":
            with self._lock:
                self.stats.store_gb_per_s = _averaged(self.stats.store_gb_per_s, weights_bytes(weights),
                                                      time.perf_counter() - started)
        return weights

    def read(self, address: str, content_key: str) -> Weights | None:
        """The replica of `content_key` copied from the host at `address`; None (logged) where it cannot be."""
        started = time.perf_counter()
        try:
            weights, moved = self._copy(address, content_key)
        except Exception as err:  # a copy is a shortcut: whatever stops it, the store still loads the replica
            down = isinstance(err, grpc.RpcError) and err.code() in (grpc.StatusCode.UNAVAILABLE,
                                                                      grpc.StatusCode.DEADLINE_EXCEEDED)
            detail = (f"{err.code().name}: {err.details()}" if isinstance(err, grpc.RpcError) else
                      str(err) if isinstance(err, PeerCopyError) else f"{type(err).__name__}: {err}")
            log.warning("copying expert %s from peer host %s failed, reading the weight store instead%s: %s",
                        content_key, address, f" (not asked again for {DOWN_S:g} s)" if down else "", detail)
            with self._lock:
                self.stats.fallbacks += 1
                if down:
                    self._down[address] = time.monotonic()
            return None
        seconds = time.perf_counter() - started
        with self._lock:
            self.stats.copies += 1
            self.stats.bytes += weights_bytes(weights)
            if moved:  # this call moved bytes (a batch's, where it took one), not only waited for another's
                self.stats.seconds += seconds
                self.stats.peer_gb_per_s = _averaged(self.stats.peer_gb_per_s, moved, seconds)
        return weights

    def expect(self, source: str, content_keys: list[str]) -> None:
        """A LoadMany's replicas to copy from `source`: copied together over its NIXL link (peer_batches.py)."""
        self._batches.expect(source, content_keys)

    def _copy(self, address: str, content_key: str) -> tuple[Weights, int]:
        """The replica's weights from `address` and the bytes this call moved for them and others (0: another
        call's batch brought them): WRITTEN over NIXL (peer_links.py; with the others of its LoadMany,
        peer_batches.py) where its link is open, else GPU to GPU over CUDA IPC where both sides can, else as
        bytes over gRPC (module docstring)."""
        link = self.links.link_for(address, content_key)
        if link is not None:
            taken = self._batches.take(address, content_key, max(link.capacity, self.ask_bytes))
            if not isinstance(taken, Batch):  # another worker's batch (an ask of up to timeout_s, just begun)
                weights = taken.result(timeout=2 * self.timeout_s)  # None: copy it alone
                if weights is not None:
                    with self._lock:
                        self.stats.batched += 1
                    return weights, 0
                taken = Batch([content_key])
            return self._batch_copy(link, address, taken)
        self._batches.discard(address, content_key)  # copied alone: no batch copies it again
        ipc = self._ipc_to(address)
        request = pb.ReadReplicaRequest(content_key=content_key, device=ipc)
        reply = self._stub(address).ReadReplica(request, timeout=self.timeout_s)
        _resident(reply)
        if not any(t.described for t in reply.tensors):
            return weights_from(reply, content_key), len(reply.data)
        try:
            weights = device_weights_from(reply, content_key, self.device)
            return weights, weights_bytes(weights)
        except (DeviceBufferError, RuntimeError) as err:  # not mappable here, or the GPU copy failed
            log.warning("cannot map peer host %s's GPU memory here (%s); not asking it for that again", address, err)
            with self._lock:
                self._no_ipc.add(address)
            return self._copy(address, content_key)

    def _batch_copy(self, link: AskerLink, address: str, batch: Batch) -> tuple[Weights, int]:
        """batch's replicas from `address` in one ask over `link`: the first's weights and the bytes moved;
        the others' handed to their workers (None for any it did not bring: they copy it alone)."""
        got: dict[str, Weights | None] = {}
        try:
            answers = self.links.copy(link, address, batch.keys)
            for key, (reply, data) in zip(batch.keys, answers):
                got[key] = weights_in(reply, data, key) if data is not None else None
            reply, data = answers[0]
        finally:
            batch.settle(got)
        _resident(reply)
        if data is not None:
            with self._lock:
                self.stats.linked += sum(w is not None for w in got.values())
            return got[batch.keys[0]], sum(r.written for r, _ in answers)
        return weights_from(reply, batch.keys[0]), len(reply.data)  # answered as bytes

    def linked(self) -> list[str]:
        """The peers this host has an open NIXL link to."""
        return self.links.linked()

    def _measure_afresh(self) -> None:
        """A link opened: a new way to copy, measured afresh, not judged by the bytes copied before it."""
        with self._lock:
            self.stats.peer_gb_per_s = 0.0

    def _peer_first(self, source: str, content_key: str = "") -> bool:
        """Whether this load copies from `source`: never while it is down; else always, never (off), or
        (measured) each way once while one is not measured yet (the peer first), then while copies measure
        faster than store reads, once in PROBE_EVERY loads whichever is slower, and not while this host's
        NIXL link to it opens (a copy meanwhile would go as bytes: 5x the store's time at 35 MB here)."""
        with self._lock:
            if time.monotonic() - self._down.get(source, -DOWN_S) < DOWN_S:
                peer = False
            elif self.mode != "measured":
                peer = self.mode == "always"
            else:
                self._offered += 1
                copies, reads = self.stats.peer_gb_per_s, self.stats.store_gb_per_s
                peer = not copies or reads and (copies >= reads) != (self._offered % PROBE_EVERY == 0)
        if peer and self.mode == "measured" and content_key and not self._ipc_to(source) \
                and self.links.usable(source) and self.links.link_for(source, content_key) is None:
            peer = False  # the link is opening (started now if need be)
        with self._lock:
            self.stats.passed += not peer
        return bool(peer)

    def _ipc_to(self, address: str) -> bool:
        """Whether copies from `address` may go over CUDA IPC (a GPU host whose peer's memory it has not failed to map)."""
        return self._cuda_ipc and self.device.startswith("cuda") and address not in self._no_ipc

    def figures(self) -> dict:
        links, link_bytes = len(self.linked()), self.links.region_bytes() + self.holder.region_bytes()
        with self._lock:
            self.stats.links, self.stats.link_bytes, self.stats.writes = links, link_bytes, self.holder.writes
            return asdict(self.stats)

    def open_link(self, offer: bytes, capacity: int) -> bytes:
        """A peer host's NIXL link to this one (OpenCopyLink: peer_holder.HolderLinks.open)."""
        return self.holder.open(offer, capacity)

    def serve(self, reply: pb.ReplicaWeights, weights: Weights | None, asked: pb.ReadReplicaRequest,
              more: list[Weights | None] = ()) -> None:
        """Answer a peer's ReadReplica with weights (None: not resident here) and more, its more_keys' (where
        it named a link): WRITTEN over its NIXL link where it named one that works, else weights alone as
        described GPU memory or bytes (replica_weights.put_weights; the asker copies the others alone)."""
        batch = [(weights, reply), *((w, reply.more.add()) for w in more)]
        unwritten = self.holder.write(asked.link, asked.note, batch) if asked.link else "no link named"
        if unwritten is None:
            served = sum(w is not None for w, _ in batch)
        else:
            del reply.more[:]
            reply.unlinked = unwritten == NO_LINK  # the asker opens a new one
            served = weights is not None
            if served:
                put_weights(reply, weights, device=asked.device)
        with self._lock:
            self.stats.served += served

    def close(self) -> None:
        self.links.close()
        self.holder.close()
        with self._lock:
            stubs, self._stubs = self._stubs, {}
        for channel, _ in stubs.values():
            channel.close()

    def _stub(self, address: str) -> pb_grpc.ExpertHostStub:
        with self._lock:
            if address not in self._stubs:
                channel = grpc.insecure_channel(address, options=CLIENT_OPTIONS)
                self._stubs[address] = channel, pb_grpc.ExpertHostStub(channel)
            return self._stubs[address][1]


def _resident(reply: pb.ReplicaWeights) -> None:
    if not reply.resident:
        raise PeerCopyError("it does not hold it resident (evicted since the planning loop looked?)")


def _averaged(gb_per_s: float, nbytes: int, seconds: float) -> float:
    """The moving average of GB/s with one more measurement (the first one taken as it is)."""
    now = nbytes / max(seconds, 1e-9) / 1e9
    return now if not gb_per_s else (1 - SMOOTHING) * gb_per_s + SMOOTHING * now
