"""The expert host's weight tiers: disk (the weight store) -> host memory -> device.

`HostTier` keeps verified expert weights in host memory (pinned where the host computes on a
GPU, so the copy to the device can be asynchronous). A file's sha256 is checked once, when it
enters the tier; a cold start is then `to_device`, a copy from host memory: on a GPU on a copy
stream of its own, non_blocking, waited for by the loading thread only (the compute stream never
blocks on it), on a CPU a copy; either way in the host's compute dtype.

Settings (`TierConfig`): capacity in bytes (0 turns the tier off: every load reads and verifies
the file; None: no limit), eviction order ("lru": least recently used first, "fifo": first to
enter first), pre-warm ("none", or "all": every expert of the store, layer-major, as capacity
allows, read in the background when the host starts).

Thread-safe: concurrent gets of one expert share one read (single flight); a read that fails
(missing file, bad checksum) is not kept, so the next get tries the file again.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from moeless.expert_fn.options import COMPUTE_DTYPES, EVICTION_ORDERS, PREWARM
from moeless.model.weight_store import WeightStore, stored_dtype

Key = tuple[int, int]  # (layer, expert)
Weights = dict[str, torch.Tensor]


@dataclass(frozen=True)
class TierConfig:
    """Host-tier settings: capacity_bytes (None: unlimited, 0: off), eviction order, pre-warm."""

    capacity_bytes: int | None = None
    eviction: str = "lru"
    prewarm: str = "none"

    def __post_init__(self) -> None:
        if self.capacity_bytes is not None and self.capacity_bytes < 0:
            raise ValueError(f"host tier capacity must be >= 0 bytes (0 turns it off), got {self.capacity_bytes}")
        if self.eviction not in EVICTION_ORDERS:
            raise ValueError(f"host tier eviction must be one of {', '.join(EVICTION_ORDERS)}, got {self.eviction!r}")
        if self.prewarm not in PREWARM:
            raise ValueError(f"host tier pre-warm must be one of {', '.join(PREWARM)}, got {self.prewarm!r}")


@dataclass
class TierStats:
    """Counters of one host tier (seconds are wall time of the reads)."""

    hits: int = 0
    misses: int = 0  # gets that read the file (it entered the tier, or the tier is off)
    shared_reads: int = 0  # gets that waited for a read another get had started
    read_failures: int = 0  # missing file, bad checksum, unreadable tensors
    evictions: int = 0
    offered: int = 0  # entries copied from a peer host (not read from the file)
    read_s_sum: float = 0.0  # disk -> host: read, sha256, parse (and pin)
    entries: int = 0
    bytes: int = 0


def tier_config_from_args(args: argparse.Namespace) -> TierConfig:
    """TierConfig from the flags of add_tier_arguments; raises ValueError with the flag's meaning."""
    gb = args.host_tier_gb
    return TierConfig(None if gb is None else round(gb * 1e9), args.host_tier_eviction, args.host_tier_prewarm)


def weights_bytes(weights: Weights) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


class HostTier:
    """Verified expert weights in host memory, read from `store` once each."""

    def __init__(self, store: WeightStore, config: TierConfig = TierConfig(), pin: bool = False) -> None:
        self.store = store
        self.config = config
        self.pin = pin
        self._lock = threading.Lock()
        self._entries: OrderedDict[Key, Weights] = OrderedDict()  # eviction order: first = next victim
        self._reads: dict[Key, Future] = {}
        self._held = 0  # bytes of the entries
        self._stats = TierStats()

    @property
    def enabled(self) -> bool:
        return self.config.capacity_bytes != 0

    def get(self, key: Key) -> tuple[Weights, str]:
        """key's weights in host memory and where they came from: "host" (a hit) or "disk".

        Raises WeightStoreError (naming the file) when the file is missing or corrupt.
        """
        with self._lock:
            if key in self._entries:
                self._stats.hits += 1
                if self.config.eviction == "lru":
                    self._entries.move_to_end(key)
                return self._entries[key], "host"
            future = self._reads.get(key)
            mine = future is None
            if mine:
                future = self._reads[key] = Future()
                self._stats.misses += 1
            else:
                self._stats.shared_reads += 1
        if not mine:
            return future.result(), "disk"
        started = time.perf_counter()
        try:
            weights = self._read(key)
        except BaseException as err:
            with self._lock:
                self._stats.read_failures += 1
                del self._reads[key]
            future.set_exception(err)
            raise
        with self._lock:
            self._stats.read_s_sum += time.perf_counter() - started
            self._admit(key, weights)
            del self._reads[key]
        future.set_result(weights)
        return weights, "disk"

    def offer(self, key: Key, weights: Weights) -> bool:
        """Keep host-memory weights got elsewhere (a peer host's copy, checked against key's content key)
        as key's entry, in the store's dtype (exact: they are its bytes, maybe widened), where the tier
        is on, lacks key and they fit: the next load of key is a hit, not another copy. True: entered."""
        if not self.enabled:
            return False
        dtype = stored_dtype(self.store)
        kept = {name: t.to(dtype) for name, t in weights.items()}
        if self.pin:
            kept = {name: t.pin_memory() for name, t in kept.items()}
        with self._lock:
            if key in self._entries or key in self._reads:
                return False
            self._admit(key, kept)
            entered = key in self._entries
            self._stats.offered += entered
            return entered

    def contains(self, key: Key) -> bool:
        with self._lock:
            return key in self._entries

    def prewarm(self) -> int:
        """Read every expert the settings ask for (pre-warm "all": layer-major until full); returns
        how many entered. Bad files are skipped here (their loads report them)."""
        if self.config.prewarm == "none" or not self.enabled:
            return 0
        entered = 0
        for layer, expert in self.store.keys():
            if self._full_for(self.store.expert_bytes(layer, expert)):
                return entered
            try:
                _, source = self.get((layer, expert))
            except Exception:  # counted in read_failures; a load of it raises the error
                continue
            entered += source == "disk"
        return entered

    def stats(self) -> dict:
        with self._lock:
            s = self._stats
            s.entries, s.bytes = len(self._entries), self._held
            return {**vars(s), "capacity_bytes": self.config.capacity_bytes, "eviction": self.config.eviction,
                    "prewarm": self.config.prewarm}

    # --- internals --------------------------------------------------------------------------

    def _read(self, key: Key) -> Weights:
        weights = self.store.load(*key, verify=True)
        if self.pin:
            weights = {name: t.pin_memory() for name, t in weights.items()}
        return weights

    def _full_for(self, nbytes: int) -> bool:
        cap = self.config.capacity_bytes
        with self._lock:
            return cap is not None and self._held + nbytes > cap

    def _admit(self, key: Key, weights: Weights) -> None:
        """Under the lock: keep weights if the tier is on and they fit, evicting in order."""
        cap = self.config.capacity_bytes
        size = weights_bytes(weights)
        if cap == 0 or (cap is not None and size > cap):
            return
        while cap is not None and self._held + size > cap:
            _, victim = self._entries.popitem(last=False)
            self._held -= weights_bytes(victim)
            self._stats.evictions += 1
        self._entries[key] = weights
        self._held += size


def compute_dtype_of(store: WeightStore, compute_dtype: str) -> torch.dtype:
    """The dtype a host computes `store`'s experts in; ValueError for a name not in COMPUTE_DTYPES."""
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute dtype {compute_dtype!r}: use one of {', '.join(COMPUTE_DTYPES)}")
    return stored_dtype(store) if compute_dtype == "store" else torch.float32


class DeviceCopier:
    """Copies host-tier weights to the compute device in the compute dtype (the cold start proper)."""

    def __init__(self, device: str, dtype: torch.dtype = torch.float32) -> None:
        self.device, self.dtype = device, dtype
        self._stream = torch.cuda.Stream(device=device) if device.startswith("cuda") and torch.cuda.is_available() else None

    def to_device(self, weights: Weights) -> Weights:
        """Fresh device tensors of weights in self.dtype (the host tier keeps its own copy).

        On a GPU: enqueued on the copy stream with non_blocking (asynchronous from pinned memory),
        converted there, and waited for with an event on this (the loading) thread only.
        """
        if self._stream is None:
            return {name: t.to(self.device, self.dtype, copy=True).contiguous() for name, t in weights.items()}
        with torch.cuda.stream(self._stream):
            out = {name: t.to(self.device, non_blocking=True).to(self.dtype).contiguous() for name, t in weights.items()}
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()
        compute = torch.cuda.default_stream(self.device)
        for t in out.values():  # allocated on the copy stream, used and freed on the compute stream
            t.record_stream(compute)
        return out
