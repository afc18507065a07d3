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
- GPU to GPU over CUDA IPC, where this host computes on a GPU and the holder's replica is on one of
  the same machine (wire/replica_weights.py; NVLink where the node has it); a peer whose memory
  cannot be mapped here (another machine) is not asked for it again; `expert-host --no-peer-ipc`:
  never tried (pods of one node that share no IPC namespace).
- WRITTEN over NIXL (peer_links.py): UCX moves the bytes (shared memory on one machine, RDMA
  between nodes, GPU memory where the hosts compute on GPUs), gRPC carries only the ask. The host
  opens its link to a peer in the background at the first copy it would make from it (about 3 s
  the first time in a process here: NIXL's import and UCX's start; then 0.04 s a link), reading its
  store meanwhile (measured) or copying as bytes (always); a link measures afresh once open.
  `expert-host --no-nixl`, NIXL not installed, or a link that fails: bytes from that peer.
- As bytes over gRPC.
On this CPU machine (`moeless bench peer-copy`, docs/benchmarks.md) a 35 MB expert (DeepSeek-V2-
Lite's shape, float32) came over NIXL in 0.8x the store's time and as bytes over gRPC in 5x; on an
H200, GPU to GPU, over NIXL in 0.04x and over CUDA IPC in 0.07x. The default model's 0.33 MB experts
are faster from the store on either machine (an ask's round trip dominates), so hosts read it there.
Whatever goes wrong (the peer gone or slow, the replica evicted there since the loop looked, a
tensor of the wrong name, dtype or shape) is logged and the load reads the store: a peer can make
a load shorter, never wrong, and never lose it.

The peer is asked by content key (model/content_keys.py), not by (layer, expert): two hosts may
number their layers differently (models added in another order), and a key names the bytes, so a
copy is of the same expert or of none. The peer verified those bytes when it loaded them from its
store; the receiver checks each tensor's name, dtype and shape against the key. The tensors travel
in the holder's compute dtype (float32, or the store's own), and the receiver converts them to
its own: both are exact for the key's bytes (a store of bfloat16 widened to float32 and back).

    peers = PeerCopies()
    weights = peers.fetch(tier, key, "10.0.0.7:50051", content_key)   # the tier's, the peer's or the store's
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass

import grpc
import torch

from moeless.expert_fn.wire import expert_host_pb2 as pb
from moeless.expert_fn.wire import expert_host_pb2_grpc as pb_grpc
from moeless.expert_fn.host.executor import Weights
from moeless.expert_fn.host.peer_links import AskerLink, HolderLinks
from moeless.expert_fn.options import PEER_COPIES
from moeless.expert_fn.stores.tiers import HostTier, Key, weights_bytes
from moeless.expert_fn.wire.codec import CLIENT_OPTIONS
from moeless.expert_fn.wire.cuda_ipc import DeviceBufferError
from moeless.expert_fn.wire.nixl_link import NixlError, unavailable
from moeless.expert_fn.wire.replica_weights import (PeerCopyError, device_weights_from, put_weights, weights_from,
                                                    weights_in)
from moeless.model.content_keys import parse_key

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
    linked: int = 0  # of the copies, those WRITTEN over NIXL (peer_links.py)
    links: int = 0  # NIXL links open to peers
    passed: int = 0  # loads given a peer that read the store (measured faster, its turn to be measured, the peer
    # down, its NIXL link opening)
    peer_gb_per_s: float = 0.0  # the moving averages the choice reads (0: not measured yet)
    store_gb_per_s: float = 0.0


class PeerCopies:
    """Loads from peer hosts where they pay, one channel per peer (module docstring). Thread-safe."""

    def __init__(self, mode: str = "measured", device: str = "cpu", timeout_s: float = 10.0, nixl: bool = True,
                 cuda_ipc: bool = True) -> None:
        if mode not in PEER_COPIES:
            raise ValueError(f"peer copies must be one of {', '.join(PEER_COPIES)}, got {mode!r}")
        self.mode, self.device, self.timeout_s = mode, device, timeout_s
        self.holder = HolderLinks(device, nixl, timeout_s)  # NIXL links to the hosts that copy from this one
        self._nixl = nixl  # until a link finds NIXL missing (imported then: 2.4 s here, not at start)
        self._cuda_ipc = cuda_ipc  # False: never map a peer's GPU memory (expert-host --no-peer-ipc)
        self._no_ipc: set[str] = set()  # peers whose GPU memory this host could not map
        self._no_link: set[str] = set()  # peers this host copies from as bytes over gRPC, not over NIXL
        self._links: dict[str, AskerLink] = {}  # peer -> this host's NIXL link to it
        self._opening: set[str] = set()  # peers a link is being opened to (a thread each)
        self._link_lock = threading.Lock()
        self._down: dict[str, float] = {}  # peer -> when it last did not answer
        self.stats = PeerCopyStats()
        self._stubs: dict[str, tuple[grpc.Channel, pb_grpc.ExpertHostStub]] = {}
        self._offered = 0  # loads given a peer where the tier lacked the expert
        self._lock = threading.Lock()

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
            weights = self._copy(address, content_key)
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
        seconds, nbytes = time.perf_counter() - started, weights_bytes(weights)
        with self._lock:
            self.stats.copies += 1
            self.stats.bytes += nbytes
            self.stats.seconds += seconds
            self.stats.peer_gb_per_s = _averaged(self.stats.peer_gb_per_s, nbytes, seconds)
        return weights

    def _copy(self, address: str, content_key: str) -> Weights:
        """The replica's weights from `address`: GPU to GPU over CUDA IPC where both sides can, else WRITTEN
        over NIXL (peer_links.py), else as bytes over gRPC (module docstring)."""
        ipc = self._ipc_to(address)
        link = None if ipc else self._link_for(address, content_key)
        if link is not None:
            reply, data = self._linked_copy(link, address, content_key)
        else:
            request = pb.ReadReplicaRequest(content_key=content_key, device=ipc)
            reply, data = self._stub(address).ReadReplica(request, timeout=self.timeout_s), None
        if not reply.resident:
            raise PeerCopyError("it does not hold it resident (evicted since the planning loop looked?)")
        if data is not None:
            weights = weights_in(reply, data, content_key)
            with self._lock:
                self.stats.linked += 1
            return weights
        if not any(t.described for t in reply.tensors):
            return weights_from(reply, content_key)
        try:
            return device_weights_from(reply, content_key, self.device)
        except (DeviceBufferError, RuntimeError) as err:  # not mappable here, or the GPU copy failed
            log.warning("cannot map peer host %s's GPU memory here (%s); not asking it for that again", address, err)
            with self._lock:
                self._no_ipc.add(address)
            return self._copy(address, content_key)

    def _link_for(self, address: str, content_key: str) -> AskerLink | None:
        """This host's open NIXL link to `address` that fits content_key's replica; else None, and one
        opened in the background where NIXL may be used (opening takes about a second here: the copies
        meanwhile go as bytes over gRPC, so no load waits for it)."""
        if not self._nixl or address in self._no_link:
            return None
        dtype, ffn, hidden = parse_key(content_key)
        capacity = 3 * ffn * hidden * max(4, getattr(torch, dtype).itemsize)  # the holder's dtype at most
        with self._link_lock:
            link = self._links.get(address)
            if (link is not None and link.capacity >= capacity) or address in self._opening:
                return link if link is not None and link.capacity >= capacity else None
            self._opening.add(address)
        threading.Thread(target=self._open_link, args=(address, capacity), name="peer-link", daemon=True).start()
        return None

    def _open_link(self, address: str, capacity: int) -> None:
        """On a thread of its own: open a link to `address` (replacing a smaller one); where it cannot be
        opened, copies from there are bytes over gRPC from now on (a peer down: tried again later)."""
        try:
            why = unavailable()
            if why:  # the else clause does not run after this return, the finally clause does
                log.info("peer copies go as bytes over gRPC: %s", why)
                self._nixl = False
                return
            link = AskerLink(self._stub(address), capacity, self.device, self.timeout_s)
        except grpc.RpcError as err:
            if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self._unlink(address, f"{err.code().name}: {err.details()}")
        # RuntimeError: the region found no GPU memory (or another CUDA error): bytes from that peer
        except (NixlError, ImportError, ValueError, AttributeError, RuntimeError) as err:
            self._unlink(address, f"{type(err).__name__}: {err}")
        else:
            with self._link_lock:
                old, self._links[address] = self._links.get(address), link
            with self._lock:  # a new way to copy: measured afresh, not judged by the bytes copied before it
                self.stats.peer_gb_per_s = 0.0
            if old is not None:
                old.close()
        finally:
            with self._link_lock:
                self._opening.discard(address)

    def _linked_copy(self, link: AskerLink, address: str,
                     content_key: str) -> tuple[pb.ReplicaWeights, torch.Tensor | None]:
        """A ReadReplica over `link`; where it cannot be used, the same ask answered as bytes, and bytes
        from `address` from then on."""
        stub = self._stub(address)
        try:
            reply, data = link.copy(stub, content_key, self.timeout_s)
            if reply.resident and data is None:
                self._unlink(address, "it answered as bytes: it holds no link from this host (restarted?) or its "
                                      "WRITE failed")
            return reply, data
        except NixlError as err:
            self._unlink(address, str(err))
        return stub.ReadReplica(pb.ReadReplicaRequest(content_key=content_key), timeout=self.timeout_s), None

    def linked(self) -> list[str]:
        """The peers this host has an open NIXL link to."""
        with self._link_lock:
            return sorted(self._links)

    def _unlink(self, address: str, why: str) -> None:
        """Copy from `address` as bytes over gRPC from now on, its link closed."""
        log.warning("cannot copy from peer host %s over NIXL (%s); copying its replicas as bytes over gRPC from now on",
                    address, why)
        with self._link_lock:
            self._no_link.add(address)
            link = self._links.pop(address, None)
        if link is not None:
            link.close()

    def _peer_first(self, source: str, content_key: str = "") -> bool:
        """Whether this load copies from `source`: never while it is down (module docstring); else always,
        never (off), or (measured) each way once while one is not measured yet (the peer first), then
        while copies measure faster than store reads, and once in PROBE_EVERY loads whichever is slower;
        (measured) not while this host's NIXL link to it opens (content_key's replica: a copy meanwhile
        would go as bytes over gRPC, 5x the store's time at a 35 MB expert here)."""
        with self._lock:
            if time.monotonic() - self._down.get(source, -DOWN_S) < DOWN_S:
                peer = False
            elif self.mode != "measured":
                peer = self.mode == "always"
            else:
                self._offered += 1
                copies, reads = self.stats.peer_gb_per_s, self.stats.store_gb_per_s
                peer = not copies or reads and (copies >= reads) != (self._offered % PROBE_EVERY == 0)
        if peer and self.mode == "measured" and content_key and not self._ipc_to(source) and self._nixl \
                and source not in self._no_link and self._link_for(source, content_key) is None:
            peer = False  # the link is opening (started now if need be)
        with self._lock:
            self.stats.passed += not peer
        return bool(peer)

    def _ipc_to(self, address: str) -> bool:
        """Whether copies from `address` try CUDA IPC first (a GPU host whose peer's memory it has not failed to map)."""
        return self._cuda_ipc and self.device.startswith("cuda") and address not in self._no_ipc

    def figures(self) -> dict:
        links = len(self.linked())
        with self._lock:
            self.stats.links = links
            return asdict(self.stats)

    def open_link(self, offer: bytes, capacity: int) -> bytes:
        """A peer host's NIXL link to this one (OpenCopyLink: peer_links.HolderLinks.open)."""
        return self.holder.open(offer, capacity)

    def serve(self, reply: pb.ReplicaWeights, weights: Weights, asked: pb.ReadReplicaRequest) -> None:
        """Answer a peer's ReadReplica with weights: WRITTEN over its NIXL link where it named one that
        works, else described GPU memory or bytes (replica_weights.put_weights)."""
        if not (asked.link and self.holder.write(asked.link, asked.note, weights, reply)):
            put_weights(reply, weights, device=asked.device)
        with self._lock:
            self.stats.served += 1

    def close(self) -> None:
        with self._link_lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()
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


def _averaged(gb_per_s: float, nbytes: int, seconds: float) -> float:
    """The moving average of GB/s with one more measurement (the first one taken as it is)."""
    now = nbytes / max(seconds, 1e-9) / 1e9
    return now if not gb_per_s else (1 - SMOOTHING) * gb_per_s + SMOOTHING * now
