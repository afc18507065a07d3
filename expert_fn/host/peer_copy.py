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
not asked again for DOWN_S seconds: a dead holder costs one timeout, not one a load. Where a GPU link or a slow store makes the peer faster it copies; on a CPU machine whose
store sits in the page cache it reads the store (docs/benchmarks.md, `moeless bench peer-copy`).
A host computing on a GPU asks for device memory (wire/replica_weights.py): a GPU holder on the
same machine answers with its replica's GPU memory described for CUDA IPC and the asker copies it
GPU to GPU (NVLink where the node has it); where that memory cannot be mapped (another machine) the
asker takes bytes from that peer from then on.
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

from moeless.expert_fn.wire import expert_host_pb2 as pb
from moeless.expert_fn.wire import expert_host_pb2_grpc as pb_grpc
from moeless.expert_fn.host.executor import Weights
from moeless.expert_fn.options import PEER_COPIES
from moeless.expert_fn.stores.tiers import HostTier, Key, weights_bytes
from moeless.expert_fn.wire.codec import CLIENT_OPTIONS
from moeless.expert_fn.wire.cuda_ipc import DeviceBufferError
from moeless.expert_fn.wire.replica_weights import PeerCopyError, device_weights_from, weights_from

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
    passed: int = 0  # loads given a peer that read the store (measured faster, its turn to be measured, the peer down)
    peer_gb_per_s: float = 0.0  # the moving averages the choice reads (0: not measured yet)
    store_gb_per_s: float = 0.0


class PeerCopies:
    """Loads from peer hosts where they pay, one channel per peer (module docstring). Thread-safe."""

    def __init__(self, mode: str = "measured", device: str = "cpu", timeout_s: float = 10.0) -> None:
        if mode not in PEER_COPIES:
            raise ValueError(f"peer copies must be one of {', '.join(PEER_COPIES)}, got {mode!r}")
        self.mode, self.device, self.timeout_s = mode, device, timeout_s
        self._bytes_only: set[str] = set()  # peers whose GPU memory this host could not map
        self._down: dict[str, float] = {}  # peer -> when it last did not answer
        self.stats = PeerCopyStats()
        self._stubs: dict[str, tuple[grpc.Channel, pb_grpc.ExpertHostStub]] = {}
        self._offered = 0  # loads given a peer where the tier lacked the expert
        self._lock = threading.Lock()

    def fetch(self, tier: HostTier, key: Key, source: str, content_key: str) -> Weights:
        """key's weights: from the host tier where it holds them, else from the peer at `source` ("":
        none) where copies measure faster (a copy in host memory entering the tier), else read and
        verified into the tier (WeightStoreError where that fails)."""
        if source and not tier.contains(key) and self._peer_first(source):
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
        """The replica's weights from `address`: GPU to GPU where both sides can (module docstring), else bytes."""
        device = self.device.startswith("cuda") and address not in self._bytes_only
        request = pb.ReadReplicaRequest(content_key=content_key, device=device)
        reply = self._stub(address).ReadReplica(request, timeout=self.timeout_s)
        if not reply.resident:
            raise PeerCopyError("it does not hold it resident (evicted since the planning loop looked?)")
        if not any(t.described for t in reply.tensors):
            return weights_from(reply, content_key)
        try:
            return device_weights_from(reply, content_key, self.device)
        except (DeviceBufferError, RuntimeError) as err:  # not mappable here, or the GPU copy failed
            log.warning("cannot map peer host %s's GPU memory here (%s); copying its replicas as bytes from now on",
                        address, err)
            with self._lock:
                self._bytes_only.add(address)
            return self._copy(address, content_key)

    def _peer_first(self, source: str) -> bool:
        """Whether this load copies from `source`: never while it is down (module docstring); else always,
        never (off), or (measured) each way once while one is not measured yet (the peer first), then
        while copies measure faster than store reads, and once in PROBE_EVERY loads whichever is slower."""
        with self._lock:
            if time.monotonic() - self._down.get(source, -DOWN_S) < DOWN_S:
                peer = False
            elif self.mode != "measured":
                peer = self.mode == "always"
            else:
                self._offered += 1
                copies, reads = self.stats.peer_gb_per_s, self.stats.store_gb_per_s
                peer = not copies or reads and (copies >= reads) != (self._offered % PROBE_EVERY == 0)
            self.stats.passed += not peer
            return bool(peer)

    def served(self) -> None:
        """Count a replica sent to a peer."""
        with self._lock:
            self.stats.served += 1

    def figures(self) -> dict:
        with self._lock:
            return asdict(self.stats)

    def close(self) -> None:
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
