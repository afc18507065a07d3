"""The holder's side of peer copies over NIXL (peer_links.py, step 2): one link per asking host, each
with one region on this host's device, which the holder fills with a chunk of replicas and WRITEs
into the asker's.

A link costs its region (64 MiB or more) of the holder's device memory, a GPU's where it computes
on one, for as long as it is kept. So a holder keeps at most MAX_LINKS, the least recently used
closed first, and closes a link unused for LINK_IDLE_S (an asker that left, or restarted and opened
another). An ask that names a link the holder no longer holds is answered as bytes, marked
`unlinked`: the asker opens a new link at its next copy (peer_links.AskerLinks.copy).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import torch

from moeless.expert_fn.wire import expert_host_pb2 as pb
from moeless.expert_fn.wire.nixl_link import NixlError, NixlLink, unavailable
from moeless.expert_fn.wire.replica_weights import Weights, add_tensor

log = logging.getLogger(__name__)

MAX_LINKS = 64  # links a holder keeps (an asker each); the least recently used is closed first
MAX_CAPACITY = 4 << 30  # bytes a link's region may take: a replica larger than any model's expert is not asked for
LINK_IDLE_S = 600.0  # a link unused this long is closed (its asker gone, or it opened another)
# Why HolderLinks.write wrote nothing. Only NO_LINK tells the asker to open another link: after FAILED it
# copies from this host as bytes (a link that failed once would fail again), as after UNFIT.
NO_LINK, UNFIT, FAILED = "no such link", "nothing fits the region", "the WRITE failed"


class HolderLinks:
    """The holder's links, one per asker (module docstring, step 2). Thread-safe."""

    def __init__(self, device: str, nixl: bool = True, timeout_s: float = 10.0, idle_s: float = LINK_IDLE_S) -> None:
        self.device, self.nixl, self.timeout_s, self.idle_s = device, nixl, timeout_s, idle_s
        self._links: OrderedDict[str, tuple[NixlLink, threading.Lock]] = OrderedDict()  # asker's name -> link
        self._used: dict[str, float] = {}  # asker's name -> when its link was last opened or written
        self.writes = 0  # NIXL WRITEs made to askers (a chunk each)
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
        link.buffer.zero_()  # its pages touched now, not by the first copy into it
        try:
            link.connect(offer)
        except BaseException:
            link.close()
            raise
        with self._lock:
            self._links[link.peer], self._used[link.peer] = (link, threading.Lock()), time.monotonic()
            closed = self._idle()
            while len(self._links) > MAX_LINKS:
                asker, (old, _) = self._links.popitem(last=False)
                del self._used[asker]
                closed.append(old)
        for old in closed:
            old.close()
        return link.offer()

    def region_bytes(self) -> int:
        """Memory the askers' links' regions hold on this host (its device's), idle ones closed first."""
        with self._lock:
            closed = self._idle()
            held = sum(link.capacity * link.regions for link, _ in self._links.values())
        for link in closed:
            link.close()
        return held

    def _idle(self) -> list[NixlLink]:
        """The links unused for idle_s and not writing now, taken out (to close outside the lock)."""
        now = time.monotonic()
        idle = [a for a, used in self._used.items() if now - used > self.idle_s and not self._links[a][1].locked()]
        for asker in idle:
            log.info("closing the idle NIXL copy link of peer host agent %s (unused for %.0f s)", asker, now - self._used[asker])
            del self._used[asker]
        return [self._links.pop(asker)[0] for asker in idle]

    def write(self, asker: str, note: str, batch: list[tuple[Weights | None, pb.ReplicaWeights]]) -> str | None:
        """WRITE each replica's bytes of `batch` (weights None: not held here) one after another into
        `asker`'s link with `note`, as many at a time as its region holds (a chunk: the asker acknowledges
        each before the next WRITE lands there), each one's names, dtypes, shapes and bytes (`written`) into
        its reply; None where written, else why not (the replies untouched: the caller answers with bytes):
        NO_LINK, UNFIT (nothing to write, or a replica larger than the region) or FAILED (logged, the link
        closed)."""
        with self._lock:
            closed = self._idle()
            entry = self._links.get(asker)
            if entry is not None:
                self._links.move_to_end(asker)
                self._used[asker] = time.monotonic()
        for link in closed:
            link.close()
        flats = [[t.detach().contiguous().reshape(-1).view(torch.uint8) for t in w.values()] if w is not None else []
                 for w, _ in batch]
        sizes = [sum(f.numel() for f in flat) for flat in flats]
        if entry is None:
            return NO_LINK
        chunks = chunked(sizes, entry[0].capacity)
        if not chunks:
            return UNFIT
        link, lock = entry
        with lock:
            try:
                for k, chunk in enumerate(chunks):
                    link.finish_write(self.timeout_s)  # the last WRITE has read this side's region: fill it again
                    region, at = link.region(0, sum(sizes[i] for i in chunk)), 0
                    for f in (f for i in chunk for f in flats[i]):
                        region[at:at + f.numel()].copy_(f)
                        at += f.numel()
                    if k:  # the asker copied the last chunk out of its region
                        link.wait_note(f"{note}/ack{k - 1}".encode(), self.timeout_s)
                    link.post_write(0, at, f"{note}/{k}/{len(chunks)}/{','.join(str(sizes[i]) for i in chunk)}".encode())
                    with self._lock:
                        self.writes += 1
                link.finish_write(self.timeout_s)
            except NixlError as err:
                log.warning("a NIXL WRITE of a replica to peer host %s failed, answering with bytes: %s", asker, err)
                self._drop(asker, link)
                return FAILED
        for (weights, reply), size in zip(batch, sizes):
            if weights is not None:
                reply.resident, reply.written = True, size
                for name, t in weights.items():
                    add_tensor(reply, name, t)
        return None

    def close(self) -> None:
        with self._lock:
            links, self._links, self._used = list(self._links.values()), OrderedDict(), {}
        for link, _ in links:
            link.close()

    def _drop(self, asker: str, link: NixlLink) -> None:
        with self._lock:
            if self._links.get(asker, (None,))[0] is link:
                del self._links[asker], self._used[asker]
        link.close()


def chunked(sizes: list[int], capacity: int) -> list[list[int]]:
    """The indices of `sizes` (bytes; 0: nothing to write) in chunks of at most `capacity` bytes, in
    order; [] where there is nothing to write or one size alone exceeds capacity.

    >>> chunked([3, 0, 4, 2, 5], 6)
    [[0], [2, 3], [4]]
    """
    chunks: list[list[int]] = []
    room = 0
    for i, size in enumerate(sizes):
        if size > capacity:
            return []
        if size and size > room:
            chunks.append([])
            room = capacity
        if size:
            chunks[-1].append(i)
            room -= size
    return chunks
