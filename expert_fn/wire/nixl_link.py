"""One NIXL agent and one registered buffer per TCP-channel connection: the bulk rows' path.

The TCP channel (tcp_channel.py, tcp_server.py) can hand its bulk tensors to NIXL, NVIDIA's
transfer library (UCX underneath): the token rows and the answer z are WRITTEN straight into the
peer's registered buffer (host memory here; GPU memory on a GPU cluster, over NVLink or GPUDirect
RDMA, without staging through host memory), and only the head and the pair lists cross the
socket, which stays the doorbell: it wakes the other side, carries errors, and its EOF says a
peer died, as before. Each WRITE carries a notification (the call id); the receiver waits for it
before it reads the rows, since a NIXL notification arrives only after its WRITE's data.

Each side posts its WRITE, rings the doorbell, then waits for the WRITE to finish: a WRITE is done
only once the receiver's worker has made progress too, which it does while it waits for the
notification (measured: the host driving z's WRITE for 2 ms before its doorbell made a 36 KB round
trip 4.1 ms instead of 1.1). The agents run without NIXL's progress thread, which costs 12-16 ms a
round trip here (../shared/ENVIRONMENT.md).

A buffer is two regions of `capacity` bytes: the client's send rows | z, the host's rows | z.
A call whose rows or z do not fit goes inline as a plain TCP frame. `nixl` is optional (the
`nixl` extra: `nixl-cu12`, ~130 MB with its UCX); `unavailable()` says why it cannot be used.
"""

from __future__ import annotations

import importlib
import os
import struct
import time
import uuid
from contextlib import contextmanager
from typing import Callable

import torch

# address, bytes, device index, 1 for GPU memory; then the lengths of the agent name and metadata
OFFER = struct.Struct("<QQiB3xII")
DEFAULT_CAPACITY = 32 << 20  # bytes per region: 8k rows of H=4096 in bfloat16; a larger call goes as a plain frame
BACKENDS = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")  # the meta package picks by CUDA version


def _backends() -> tuple[str, ...]:
    """BACKENDS, the build for torch's CUDA major first: nixl-cu12's UCX cannot reach GPU memory
    beside a CUDA 13 torch (its CUDA transports load CUDA 12's runtime; measured on an H200)."""
    if not torch.version.cuda:
        return BACKENDS
    major = torch.version.cuda.split(".")[0]
    return tuple(sorted(BACKENDS, key=lambda name: not name.startswith(f"nixl_cu{major}.")))


class NixlError(Exception):
    """A NIXL transfer failed, timed out, or a peer's offer could not be read (the message says which)."""


def nixl_api():
    """NIXL's Python API module, or ImportError naming what to install."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # its INFO lines go to stdout
    for name in _backends():
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("NIXL is not installed here: pip install 'moeless[nixl]' (nixl-cu12)")


def unavailable() -> str | None:
    """Why NIXL cannot be used in this process (None: it can)."""
    try:
        nixl_api()
    except ImportError as err:
        return str(err)
    return None


_WARM: list = []  # the agent warm() made, kept: UCX stays started for the process's links


def warm() -> str | None:
    """Import NIXL and start UCX now, with an agent kept for the process's life and no memory, so that the
    process's first link opens as fast as its later ones (measured on this CPU machine: a link's two ends in
    0.09-0.12 s after it, 0.54-0.59 s in a process without it; the import alone took 2.4 s on a loaded
    one). Why NIXL cannot be used (None: warmed). Expert hosts on a GPU call it at start on a thread."""
    why = unavailable()
    if why is None and not _WARM:
        api = nixl_api()
        _WARM.append(api.nixl_agent(f"moeless-warm-{os.getpid()}",
                                    api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])))
    return why


@contextmanager
def _as_nixl_error(what: str):
    """NIXL's own exceptions (a peer that disconnected, a bad descriptor) as NixlError naming `what`."""
    try:
        yield
    except NixlError:
        raise
    except Exception as err:  # nixl's binding errors share no base class of their own
        raise NixlError(f"{what} failed: {type(err).__name__}: {err}") from None


class NixlLink:
    """An agent (no progress thread) with one registered buffer of `regions` x capacity bytes on
    `device` (2: the TCP channel's, each side's sends; 1: a peer copy's, expert_fn/host/peer_links.py),
    and at most one peer, whose buffer has as many regions."""

    def __init__(self, role: str, capacity: int, device: torch.device | str = "cpu", regions: int = 2):
        api = nixl_api()
        self.capacity, self.regions = capacity, regions
        self.name = f"moeless-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._agent = api.nixl_agent(self.name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.buffer = torch.empty(regions * capacity, dtype=torch.uint8, device=device)
        self._device = self.buffer.device.index or 0
        self._mem = "VRAM" if self.buffer.device.type == "cuda" else "DRAM"
        with _as_nixl_error(f"registering {regions * capacity} bytes of {self._mem} on {self.buffer.device} (GPU memory "
                            "needs a NIXL whose UCX has CUDA support: nixl-cu12 beside CUDA 12, nixl-cu13 beside CUDA 13)"):
            self._registered = self._agent.register_memory([(self.buffer.data_ptr(), regions * capacity, self._device,
                                                             "")], self._mem)
        self._peer: str | None = None
        self._peer_buffer = (0, 0, 0, "DRAM")  # address, bytes, device, memory type
        self._notes: list[bytes] = []
        self._writing = None  # the transfer handle posted last, until it is done

    def region(self, which: int, nbytes: int) -> torch.Tensor:
        """The first nbytes of region `which` (0: what this side sends, 1: what it receives), uint8."""
        start = which * self.capacity
        return self.buffer[start:start + nbytes]

    def offer(self) -> bytes:
        """What a peer needs to write here: this agent's metadata and the buffer's place."""
        meta = self._agent.get_agent_metadata()
        name = self.name.encode()
        return OFFER.pack(self.buffer.data_ptr(), self.regions * self.capacity, self._device, self._mem == "VRAM",
                          len(name), len(meta)) + name + meta

    def connect(self, offer: bytes) -> None:
        """Take the peer's offer (its agent and buffer); NixlError if it is not one."""
        if len(offer) < OFFER.size:
            raise NixlError(f"a NIXL offer of {len(offer)} bytes is too short")
        addr, nbytes, device, vram, name_len, meta_len = OFFER.unpack_from(offer)
        if len(offer) != OFFER.size + name_len + meta_len or nbytes != self.regions * self.capacity:
            raise NixlError(f"a malformed NIXL offer ({len(offer)} bytes, buffer {nbytes}, expected "
                            f"{self.regions * self.capacity})")
        meta = offer[OFFER.size + name_len:]
        try:
            self._peer = self._agent.add_remote_agent(meta)
        except Exception as err:  # nixl raises its own binding errors
            raise NixlError(f"NIXL could not add the peer's agent: {err}") from None
        self._peer_buffer = (addr, nbytes, device, "VRAM" if vram else "DRAM")

    @property
    def peer(self) -> str | None:
        """The peer's agent name (None: not connected; NIXL returns it as bytes)."""
        return self._peer.decode() if isinstance(self._peer, bytes) else self._peer

    def progress(self) -> None:
        """Drive this side's worker once (a WRITE to here needs it), keeping the notifications that arrived."""
        with _as_nixl_error(f"NIXL notifications from {self._peer}"):
            self._notes += [m for messages in self._agent.get_new_notifs().values() for m in messages]

    def post_write(self, which: int, nbytes: int, note: bytes) -> None:
        """Start writing the first nbytes of this side's region `which` into the peer's region `which`
        (0: the client's rows into the host's, 1: the host's z into the client's), with `note`."""
        with _as_nixl_error(f"a NIXL WRITE to {self._peer}"):
            self._post_write(which, nbytes, note)

    def _post_write(self, which: int, nbytes: int, note: bytes) -> None:
        self._finish_write(30.0, lambda: False)  # one transfer at a time: the last one is done (normally already)
        if self.buffer.is_cuda:  # UCX reads the region outside torch's streams: this thread's copies into it land first
            torch.cuda.current_stream(self.buffer.device).synchronize()
        if nbytes == 0:  # nothing to write: the note alone
            self._agent.send_notif(self._peer, note)
            return
        addr, _, device, mem = self._peer_buffer
        start = which * self.capacity
        local = self._agent.get_xfer_descs([(self.buffer.data_ptr() + start, nbytes, self._device)], self._mem)
        remote = self._agent.get_xfer_descs([(addr + start, nbytes, device)], mem)
        handle = self._agent.initialize_xfer("WRITE", local, remote, self._peer, note)
        state = self._agent.transfer(handle)
        self._writing = handle
        if state not in ("PROC", "DONE"):
            self._release()
            raise NixlError(f"NIXL WRITE of {nbytes} bytes to {self._peer} failed at once ({state})")

    def finish_write(self, timeout_s: float, peer_gone: Callable[[], bool] = lambda: False) -> None:
        """Wait until the posted WRITE is done (it drives UCX); NixlError on failure, after timeout_s,
        or once peer_gone() says the peer left (its doorbell socket closed)."""
        with _as_nixl_error(f"a NIXL WRITE to {self._peer}"):
            self._finish_write(timeout_s, peer_gone)

    def _finish_write(self, timeout_s: float, peer_gone: Callable[[], bool]) -> None:
        if self._writing is None:
            return
        deadline = time.monotonic() + timeout_s
        state = self._agent.check_xfer_state(self._writing)
        while state == "PROC":
            if time.monotonic() > deadline or peer_gone():
                self._release()
                raise NixlError(f"a NIXL WRITE to {self._peer} did not finish "
                                + ("(the peer left)" if peer_gone() else f"within {timeout_s} s"))
            os.sched_yield()
            state = self._agent.check_xfer_state(self._writing)
        self._release()
        if state != "DONE":
            raise NixlError(f"a NIXL WRITE to {self._peer} ended in state {state}")

    def wait_note(self, note: bytes, timeout_s: float, peer_gone: Callable[[], bool] = lambda: False) -> None:
        """Wait for the peer's WRITE that carries `note` to have landed here (its notification);
        NixlError after timeout_s or once peer_gone() says the peer left."""
        with _as_nixl_error(f"NIXL notifications from {self._peer}"):
            if self._take_note(note.__eq__, timeout_s, peer_gone) is None:
                raise NixlError(f"no NIXL data from the peer for call {note.decode()} "
                                + ("(the peer left)" if peer_gone() else f"within {timeout_s} s"))

    def next_note(self, prefix: bytes, timeout_s: float = 0.0) -> bytes | None:
        """The first notification from the peer that starts with `prefix`, taken; None where none came
        within timeout_s (0: look once, driving this side's worker)."""
        with _as_nixl_error(f"NIXL notifications from {self._peer}"):
            return self._take_note(lambda m: m.startswith(prefix), timeout_s)

    def _take_note(self, match: Callable[[bytes], bool], timeout_s: float,
                   peer_gone: Callable[[], bool] = lambda: False) -> bytes | None:
        """The first notification `match` accepts, taken from the ones come so far; None after timeout_s
        or once peer_gone() says the peer left."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._notes += [m for messages in self._agent.get_new_notifs().values() for m in messages]
            found = next((m for m in self._notes if match(m)), None)
            if found is not None:
                self._notes.remove(found)
                return found
            if time.monotonic() >= deadline or peer_gone():
                return None
            os.sched_yield()

    def close(self) -> None:
        """Release the transfer, the peer and the registration (the agent goes with the object)."""
        self._release()
        try:
            if self._peer is not None:
                self._agent.remove_remote_agent(self._peer)
            self._agent.deregister_memory(self._registered)
        except Exception:  # a dead peer or a half-built link: nothing more to give back
            pass
        self._peer = None

    def _release(self) -> None:
        if self._writing is not None:
            try:
                self._agent.release_xfer_handle(self._writing)
            finally:
                self._writing = None
