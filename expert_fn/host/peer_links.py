"""Peer copies over NIXL: the holder WRITEs a replica's bytes straight into the asker's memory.

A copy as bytes over gRPC (wire/replica_weights.py) serialises the tensors into a message on the
holder and parses them out on the asker, through gRPC's buffers on both sides. Over NIXL (UCX
underneath: shared memory on one machine, RDMA between nodes, GPU memory over NVLink or GPUDirect
RDMA where the hosts compute on GPUs) only the ask and the tensors' names, dtypes and shapes cross
gRPC:

1. The asker opens one link per holder (AskerLinks; OpenCopyLink: the two NixlLinks' offers
   exchanged), one region each of COPY_BATCH_BYTES or the largest replica it asks for (its content
   key's shape, 4 bytes an element: the holder's compute dtype is float32 or the store's), its
   pages touched while the link opens.
2. A ReadReplica naming the link has the holder copy the replica's tensors into its own region
   (one copy in host or GPU memory), WRITE them into the asker's with a notification, and wait
   until the WRITE is done before it answers. A WRITE completes only while both sides drive their
   workers (nixl_link.py), so the asker drives its own until the answer comes.
3. The asker copies the bytes out of its region, which serves its next copy: one copy at a time
   per link (its lock). One ask may name many replicas, more than the region holds (peer_batches.py:
   up to ASK_BYTES): the holder streams them through it a chunk at a time, a chunk being as many
   whole replicas as fit, one WRITE each, whose notification lists their bytes; the asker copies a
   chunk out as it lands and acknowledges it (a notification alone), and only then does the next
   WRITE land there, while the holder has filled its own region with that chunk meanwhile. So an
   ask's fixed part (the gRPC round trip, the holder's lookups, the answer) is paid once for GBs,
   not once a region. The holder keeps at most MAX_LINKS links and closes idle ones (peer_holder.py);
   an ask over a link it no longer holds is answered as bytes, and the asker opens a new link.

Whatever fails here (NIXL not installed or turned off on either side, a link that cannot be
registered or written) makes the asker copy from that holder as bytes over gRPC from then on
(peer_copy.py); a holder that cannot WRITE answers with bytes.

    link = AskerLink(stub, capacity, "cpu", timeout_s=10)     # the asker, once per holder
    [(reply, data)] = link.copy(stub, [content_key], timeout_s=10)  # data: the bytes it WROTE (None: not written)
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Callable

import grpc
import torch

from moeless.expert_fn.wire import expert_host_pb2 as pb
from moeless.expert_fn.wire import expert_host_pb2_grpc as pb_grpc
from moeless.expert_fn.host.peer_batches import COPY_BATCH_BYTES, copy_bound
from moeless.expert_fn.wire.nixl_link import NixlError, NixlLink, unavailable

log = logging.getLogger(__name__)


class AskerLink:
    """The asking host's link to one holder (module docstring, steps 1 and 3)."""

    def __init__(self, stub: pb_grpc.ExpertHostStub, capacity: int, device: str, timeout_s: float) -> None:
        self.link = NixlLink("copy-asker", capacity, device, regions=1)
        self.link.buffer.zero_()  # its pages touched now, while the link opens, not by the first copy's WRITE
        try:
            reply = stub.OpenCopyLink(pb.CopyLinkOffer(offer=self.link.offer(), capacity=capacity), timeout=timeout_s)
            self.link.connect(reply.offer)
        except BaseException:
            self.link.close()
            raise
        self.capacity, self.closed = capacity, False
        self._lock = threading.Lock()
        self._calls = itertools.count()

    def copy(self, stub: pb_grpc.ExpertHostStub, content_keys: list[str],
             timeout_s: float) -> list[tuple[pb.ReplicaWeights, torch.Tensor | None]]:
        """The holder's answer for each of content_keys (one ask naming this link: peer_batches.py) and the
        bytes it WROTE here for it (fresh memory on the link's device); None where it answered otherwise
        (not resident, or as bytes; the keys past the first then have empty answers). The holder streams
        them through the region a chunk at a time (step 3): each copied out and acknowledged here while the
        ask runs."""
        with self._lock:
            if self.closed:  # dropped by another copy's answer (the holder lost it) while this one waited
                raise NixlError("the link was closed")
            note = f"copy-{next(self._calls)}"
            asked = pb.ReadReplicaRequest(content_key=content_keys[0], more_keys=content_keys[1:], link=self.link.name,
                                          note=note)
            future = stub.ReadReplica.future(asked, timeout=timeout_s)
            chunks: list[list[torch.Tensor]] = []  # the replicas of each chunk copied out so far
            while not future.done():  # the holder's WRITEs complete only while this side's worker runs
                self._take_chunk(note, chunks, 0.0)
                time.sleep(0)  # gives the GIL to gRPC's threads, which deliver the answer
            reply = future.result()
            replies = [reply, *reply.more][:len(content_keys)]
            replies += [pb.ReplicaWeights() for _ in range(len(content_keys) - len(replies))]
            sizes = [r.written for r in replies if r.written]
            deadline = time.monotonic() + timeout_s
            while sum(map(len, chunks)) < len(sizes):  # the last chunk's notification may come after the answer
                if not self._take_chunk(note, chunks, max(deadline - time.monotonic(), 0.0)):
                    raise NixlError(f"no NIXL data from the holder for chunk {len(chunks)} of {note} within {timeout_s} s")
            copied = [t for chunk in chunks for t in chunk]
            if [t.numel() for t in copied] != sizes:
                raise NixlError(f"the holder wrote {[t.numel() for t in copied]} bytes for {note}, answered {sizes}")
            copies = iter(copied)
            return [(r, next(copies) if r.written else None) for r in replies]

    def _take_chunk(self, note: str, chunks: list[list[torch.Tensor]], timeout_s: float) -> bool:
        """Copy the holder's next chunk of the ask `note` out of the region where its notification came
        within timeout_s (each replica its own memory: one evicted frees its bytes, not a chunk's), and
        tell the holder, unless it was the last, that the region is free for the next; False where none came."""
        k = len(chunks)
        found = self.link.next_note(f"{note}/{k}/".encode(), timeout_s)
        if found is None:
            return False
        try:  # "{note}/{chunk}/{chunks}/{bytes of each replica in it, comma-separated}"
            count, sizes = found.decode().split("/")[2:]
            count, sizes = int(count), [int(n) for n in sizes.split(",")]
        except ValueError:
            raise NixlError(f"a malformed chunk notification from the holder: {found[:80]!r}") from None
        if sum(sizes) > self.capacity or min(sizes) < 1:
            raise NixlError(f"the holder says it wrote {sizes} bytes into a region of {self.capacity}")
        out, at = [], 0
        for n in sizes:
            out.append(self.link.region(0, at + n)[at:].clone())
            at += n
        if self.link.buffer.is_cuda:  # copied out before the next WRITE, which no stream orders, lands there
            torch.cuda.current_stream(self.link.buffer.device).synchronize()
        chunks.append(out)
        if k + 1 < count:
            self.link.post_write(0, 0, f"{note}/ack{k}".encode())  # a notification alone
        return True

    def close(self) -> None:
        with self._lock:  # not while a copy runs over it
            self.closed = True
            self.link.close()


class AskerLinks:
    """This host's links to the holders it copies from (step 1): one a holder, opened in the background at
    the first copy it would make from it; a holder whose link cannot be opened or used is copied from as
    bytes over gRPC from then on (peer_copy.py). Thread-safe."""

    def __init__(self, device: str, nixl: bool, timeout_s: float, stub: Callable[[str], pb_grpc.ExpertHostStub],
                 on_open: Callable[[], None]) -> None:
        self.device, self.timeout_s = device, timeout_s
        self.nixl = nixl  # until a link finds NIXL missing (imported then: 2.4 s here, not at start)
        self._stub, self._on_open = stub, on_open  # a holder's gRPC stub; called when a link opens
        self._links: dict[str, AskerLink] = {}  # holder -> this host's link to it
        self._opening: set[str] = set()  # holders a link is being opened to (a thread each)
        self._no_link: set[str] = set()  # holders copied from as bytes over gRPC
        self._lock = threading.Lock()

    def usable(self, address: str) -> bool:
        """Whether copies from `address` may go over NIXL (a link open or to be opened)."""
        return self.nixl and address not in self._no_link

    def link_for(self, address: str, content_key: str) -> AskerLink | None:
        """This host's open NIXL link to `address` that fits content_key's replica; else None, and one
        opened in the background where NIXL may be used (opening takes about a second here: the copies
        meanwhile go as bytes over gRPC, so no load waits for it)."""
        if not self.usable(address):
            return None
        need = copy_bound(content_key)
        capacity = max(need, COPY_BATCH_BYTES)  # room for a batch of smaller replicas (peer_batches.py)
        with self._lock:
            link = self._links.get(address)
            if (link is not None and link.capacity >= need) or address in self._opening:
                return link if link is not None and link.capacity >= need else None
            self._opening.add(address)
        threading.Thread(target=self._open, args=(address, capacity), name="peer-link", daemon=True).start()
        return None

    def _open(self, address: str, capacity: int) -> None:
        """On a thread of its own: open a link to `address` (replacing a smaller one); where it cannot be
        opened, copies from there are bytes over gRPC from now on (a peer down: tried again later)."""
        try:
            why = unavailable()
            if why:  # the else clause does not run after this return, the finally clause does
                log.info("peer copies go as bytes over gRPC: %s", why)
                self.nixl = False
                return
            link = AskerLink(self._stub(address), capacity, self.device, self.timeout_s)
        except grpc.RpcError as err:
            if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self.unlink(address, f"{err.code().name}: {err.details()}")
        # RuntimeError: the region found no GPU memory (or another CUDA error): bytes from that peer
        except (NixlError, ImportError, ValueError, AttributeError, RuntimeError) as err:
            self.unlink(address, f"{type(err).__name__}: {err}")
        else:
            with self._lock:
                old, self._links[address] = self._links.get(address), link
            self._on_open()
            if old is not None:
                old.close()
        finally:
            with self._lock:
                self._opening.discard(address)

    def copy(self, link: AskerLink, address: str,
             content_keys: list[str]) -> list[tuple[pb.ReplicaWeights, torch.Tensor | None]]:
        """One ReadReplica over `link` for content_keys (AskerLink.copy); where the link cannot be used, the
        first one's ask answered as bytes (the others' answers empty), and bytes from `address` from then on;
        where the holder no longer holds it (restarted, or closed it idle), a new link at the next copy."""
        stub = self._stub(address)
        try:
            answers = link.copy(stub, content_keys, self.timeout_s)
            if answers[0][0].unlinked:
                self._forget(address, link)
            elif answers[0][0].resident and answers[0][1] is None:
                self.unlink(address, "it answered as bytes: its WRITE failed, or the replica did not fit the link")
            return answers
        except NixlError as err:
            if not link.closed:  # else: forgotten meanwhile; this ask goes as bytes, the next opens a link
                self.unlink(address, str(err))
        reply = stub.ReadReplica(pb.ReadReplicaRequest(content_key=content_keys[0]), timeout=self.timeout_s)
        return [(reply, None)] + [(pb.ReplicaWeights(), None) for _ in content_keys[1:]]

    def linked(self) -> list[str]:
        """The peers this host has an open NIXL link to."""
        with self._lock:
            return sorted(self._links)

    def region_bytes(self) -> int:
        """Memory the open links' regions hold on this host (its device's)."""
        with self._lock:
            return sum(link.capacity for link in self._links.values())

    def _forget(self, address: str, link: AskerLink) -> None:
        """The holder at `address` holds `link` no more: closed here, a new one opened at the next copy."""
        log.info("peer host %s holds no NIXL link from this host (it restarted, or closed the link idle): opening "
                 "a new one at the next copy", address)
        with self._lock:
            if self._links.get(address) is link:
                del self._links[address]
        link.close()

    def unlink(self, address: str, why: str) -> None:
        """Copy from `address` as bytes over gRPC from now on, its link closed."""
        log.warning("cannot copy from peer host %s over NIXL (%s); copying its replicas as bytes over gRPC from now on",
                    address, why)
        with self._lock:
            self._no_link.add(address)
            link = self._links.pop(address, None)
        if link is not None:
            link.close()

    def close(self) -> None:
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()
