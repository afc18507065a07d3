"""A LoadMany's copies from one peer, batched: one ask and one NIXL WRITE for many replicas.

Each copy from a peer costs a fixed part beside its bytes: the gRPC ask, the holder's copy into its
region, the waits on the WRITE and on the asker's copy out, the checks. Measured on an H200 that part
is about 2.1 ms a copy (0.33 MB experts took 2.1 ms each; docs/benchmarks.md), and a scale-up copies
hundreds of experts onto each GPU it adds. So the replicas a LoadMany names from one peer go
together:

1. The servicer tells the host's PeerCopies which replicas a LoadMany expects from each source
   (`expect`) before their loads are queued.
2. Loads still run one per load worker. The first worker to copy one of them over the peer's NIXL
   link takes the other replicas still pending from that peer, up to ASK_BYTES (`take`: a Batch),
   and asks for them all at once; the holder streams them through the link's region a chunk at a
   time (peer_links.py, step 3).
3. The worker of each other replica finds its copy taken (`take` gives it the Batch's future for
   it) and waits for it. A replica the batch did not bring (the holder no longer held it, or the
   copy failed) is None there, and its worker copies it alone.

A pending replica that a worker reads from its tier or store instead is `discard`ed; what nobody
takes is dropped after MAX_AGE_S, so a LoadMany that never ran its loads holds no memory.

    batches = CopyBatches()
    batches.expect("10.0.0.7:50051", [key_a, key_b])
    batch = batches.take("10.0.0.7:50051", key_a, capacity)  # a Batch: keys [key_a, key_b]
    batches.take("10.0.0.7:50051", key_b, capacity)          # a Future: key_b's weights (or None)
    batch.settle({key_b: weights_b})                          # in a finally: every future set
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from moeless.expert_fn.options import PEER_ASK_MB
from moeless.expert_fn.stores.tiers import Weights
from moeless.model.content_keys import parse_key

# A link's region (at each end) holds at least this many bytes, so that one WRITE carries a batch of
# small replicas (190 of the default model's 0.33 MB experts; a 35 MB one alone): a holder's 64 links
# (peer_holder.MAX_LINKS) take at most 4 GiB of its memory, on the GPU where it computes there (the
# host's /metrics: moeless_expert_host_peer_link_bytes; not billed as replicas are).
COPY_BATCH_BYTES = 64 << 20
# One ask carries at most this many bytes (copy_bound's), streamed through the region: a scale-up
# copies GBs onto each GPU it adds, and the twin's DeepSeek-V2-Lite family meets its step SLO only
# where an ask's fixed part (2.1 ms measured a copy) is paid once a GB or so, not once a replica
# (`moeless eval --shared-pool --finetunes 16 --peer-batch-mb 1024`: docs/shared-pool/finetunes/notes.md).
ASK_BYTES = PEER_ASK_MB << 20  # (expert-host --peer-ask-mb)
MAX_AGE_S = 60.0  # a pending replica, or a copy nobody took, is dropped this long after it was expected or copied


def copy_bound(content_key: str) -> int:
    """The most bytes a copy of content_key's replica takes: its shape at the holder's dtype at most
    (float32, or the store's where that is wider)."""
    dtype, ffn, hidden = parse_key(content_key)
    return 3 * ffn * hidden * max(4, getattr(torch, dtype).itemsize)


@dataclass
class Batch:
    """Replicas copied together (keys[0] the taking worker's own); settle() hands the others theirs."""

    keys: list[str]
    futures: dict[str, Future] = field(default_factory=dict)

    def settle(self, weights: dict[str, Weights | None]) -> None:
        """Every other key's future set: its weights, or None (its worker copies it alone)."""
        for key, future in self.futures.items():
            if not future.done():
                future.set_result(weights.get(key))


class CopyBatches:
    """The replicas expected from each peer and the copies taken for them (module docstring). Thread-safe."""

    def __init__(self, max_age_s: float = MAX_AGE_S) -> None:
        self.max_age_s = max_age_s
        self._pending: dict[str, dict[str, float]] = {}  # source -> content key -> when expected
        self._taken: dict[tuple[str, str], tuple[Future, float]] = {}  # (source, key) -> its copy, when taken
        self._swept = float("-inf")  # when _expire last swept
        self._lock = threading.Lock()

    def expect(self, source: str, content_keys: list[str]) -> None:
        """Step 1: a LoadMany's replicas to copy from `source`."""
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            pending = self._pending.setdefault(source, {})
            for key in content_keys:
                if (source, key) not in self._taken:
                    pending[key] = now

    def take(self, source: str, content_key: str, capacity: int) -> Batch | Future:
        """Step 2 or 3: the future of content_key's copy where another worker's batch took it; else a Batch
        of it and the replicas pending from `source` that fit `capacity` bytes with it, in the order expected."""
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            taken = self._taken.pop((source, content_key), None)
            if taken is not None:
                return taken[0]
            pending = self._pending.get(source, {})
            pending.pop(content_key, None)
            batch, room = Batch([content_key]), capacity - copy_bound(content_key)
            for key in list(pending):
                if (size := copy_bound(key)) > room:
                    break
                del pending[key]
                room -= size
                batch.keys.append(key)
                batch.futures[key] = Future()
                self._taken[source, key] = batch.futures[key], now
            return batch

    def discard(self, source: str, content_key: str) -> None:
        """content_key's load reads its tier or store: no batch copies it."""
        with self._lock:
            self._pending.get(source, {}).pop(content_key, None)

    def pending(self, source: str) -> int:
        """Replicas expected from `source` and not taken yet."""
        with self._lock:
            return len(self._pending.get(source, {}))

    def _expire(self, now: float) -> None:
        """Under the lock: what waited past max_age_s dropped (a copy nobody took frees its weights); at most
        once a second (a quarter of max_age_s where less): a sweep at every take scanned every entry, a
        LoadMany of 1,023 replicas' takes 0.3 ms a replica on this CPU machine (its copies' largest part)."""
        if now - self._swept < min(1.0, self.max_age_s / 4):
            return
        self._swept = now
        for source, pending in list(self._pending.items()):
            for key, since in list(pending.items()):
                if now - since > self.max_age_s:
                    del pending[key]
            if not pending:
                del self._pending[source]
        for entry, (_, since) in list(self._taken.items()):
            if now - since > self.max_age_s:
                del self._taken[entry]
