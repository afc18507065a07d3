"""The replica table of one expert host: lifecycle states and memory, as pure logic on a clock.

States of a replica of (layer, expert):

    cold --begin_load--> loading --finish_load(ok)--> idle <--acquire/release--> warm
      ^                     |                           |
      +--finish_load(err)---+          evict / keep-alive expiry / room for a load
                                                        v
                                                     evicted --begin_load--> loading ...

- warm: resident with invocations in flight; idle: resident, none in flight.
- An idle replica stays resident for keep_alive_s after its last use (or a load that found it
  resident: touch), then expire() evicts it.
- A loading replica is never evicted; a warm one is evicted only once its calls end.
- Memory is reserved when a load begins; to make room, idle replicas go in the order of
  shares.pick_victims: the least saving per GB·s first (LRU where reloads cost the same per byte),
  never into another active model's guaranteed share (a replica several models share counts in
  each one's: shares.py).

Not thread-safe: the runtime calls it under its lock. Time comes from the injected clock.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Callable

from moeless.expert_fn.errors import HostMemoryFull
from moeless.expert_fn.host.meters import Meters
from moeless.expert_fn.host.shares import Candidate, Shares, pick_victims, warm_set

Key = tuple[int, int]  # (layer, expert)
Clock = Callable[[], float]  # seconds, monotonic


class ReplicaState(str, Enum):
    COLD = "cold"
    LOADING = "loading"
    WARM = "warm"
    IDLE = "idle"
    EVICTED = "evicted"


RESIDENT = (ReplicaState.WARM, ReplicaState.IDLE)


@dataclass
class Replica:
    state: ReplicaState = ReplicaState.COLD
    bytes: int = 0  # reserved while loading or resident
    busy: int = 0  # invocations in flight
    last_used: float = 0.0  # when it last became idle (load end or release)
    load_started: float = 0.0
    evict_when_idle: bool = False
    error: str = ""  # last load error


class ReplicaTable:
    """Replica states and reserved memory of one host (capacity_bytes in all)."""

    def __init__(self, capacity_bytes: int, keep_alive_s: float, clock: Clock, meters: Meters,
                 shares: Shares | None = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if keep_alive_s < 0:
            raise ValueError(f"keep_alive_s must be >= 0, got {keep_alive_s}")
        self.capacity_bytes = capacity_bytes
        self.keep_alive_s = keep_alive_s
        self._clock = clock
        self._meters = meters
        self.shares = shares  # models' guaranteed shares (None: plain least recently used)
        self._replicas: dict[Key, Replica] = {}
        self._loaded: dict[int, tuple[float, int]] = {}  # model -> (seconds, bytes) of its loads so far
        self._held = 0  # sum of the replicas' bytes, kept as they change (a load must not scan them all)

    def state(self, key: Key) -> ReplicaState:
        replica = self._replicas.get(key)
        return replica.state if replica else ReplicaState.COLD

    def needs_load(self, key: Key) -> bool:
        return self.state(key) in (ReplicaState.COLD, ReplicaState.EVICTED)

    @property
    def bytes_held(self) -> int:
        return self._held

    def replicas(self) -> dict[Key, Replica]:
        """A copy of every replica ever seen on this host, by key."""
        return {key: replace(r) for key, r in self._replicas.items()}

    def begin_load(self, key: Key, nbytes: int, model: int | None = None) -> list[Key]:
        """Mark key loading and reserve nbytes for `model` (default: the model of key's layer; a
        replica several models share is loaded for the one that asked); returns the idle replicas
        evicted to make room.

        Raises HostMemoryFull (nothing changed) when even evicting every idle replica leaves
        too little room.
        """
        if not self.needs_load(key):
            raise ValueError(f"replica {key} is {self.state(key).value}; only cold or evicted replicas load")
        # 1. Pick idle victims until nbytes fit: the least saving per GB·s first, within the models' shares
        #    (none where they fit already: then no replica is looked at).
        free = self.capacity_bytes - self._held
        shares = self._shares
        model = shares.model_of(key[0]) if model is None else model
        victims: list[Key] | None = []
        if free < nbytes:
            held = [Candidate(k, r.bytes, r.state is ReplicaState.IDLE, r.last_used, self._reload_s(k, r.bytes),
                              tuple(self._meters.replicas[k].used.items()) if k in shares.users else ())
                    for k, r in self._replicas.items() if r.bytes]
            victims = pick_victims(held, shares, key, free, nbytes, self._clock(), mine=model)
        if victims is None:
            why = "loading, busy or within another model's guaranteed share" if self.shares else "loading or busy"
            raise HostMemoryFull(
                f"replica {key} needs {nbytes} bytes of {self.capacity_bytes}; the rest is {why}: wait, evict "
                "replicas, or give the host more memory"
            )
        # 2. Evict them, then reserve.
        for victim in victims:
            self._evict_now(victim)
        self._replicas[key] = Replica(state=ReplicaState.LOADING, bytes=nbytes, load_started=self._clock())
        self._held += nbytes
        self._meters.hold(key, nbytes, model)
        return victims

    def finish_load(self, key: Key, error: str | None = None) -> None:
        """End key's load: idle (resident) on success, cold with the error on failure."""
        replica = self._expect(key, ReplicaState.LOADING)
        now = self._clock()
        self._meters.loaded(key, now - replica.load_started, ok=error is None)
        if error is None:
            replica.state, replica.last_used, replica.error = ReplicaState.IDLE, now, ""
            m = self._shares.model_of(key[0])
            seconds, nbytes = self._loaded.get(m, (0.0, 0))
            self._loaded[m] = (seconds + now - replica.load_started, nbytes + replica.bytes)
        else:
            self._held -= replica.bytes
            replica.state, replica.bytes, replica.error = ReplicaState.COLD, 0, error
            self._meters.free(key)

    def acquire(self, key: Key) -> None:
        """One more invocation in flight on a resident replica."""
        replica = self._replicas.get(key)
        if replica is None or replica.state not in RESIDENT:
            raise ValueError(f"replica {key} is {self.state(key).value}, not resident")
        replica.busy += 1
        replica.state = ReplicaState.WARM

    def release(self, key: Key) -> list[Key]:
        """One invocation ended; returns [key] if a deferred eviction happened now."""
        replica = self._expect(key, ReplicaState.WARM)
        replica.busy -= 1
        if replica.busy:
            return []
        replica.state, replica.last_used = ReplicaState.IDLE, self._clock()
        if replica.evict_when_idle:
            self._evict_now(key)
            return [key]
        return []

    def touch(self, key: Key) -> None:
        """A resident replica asked for again (a load of one already resident): its keep-alive starts
        over, as a use's does, so a placement just confirmed resident is not evicted under it."""
        replica = self._replicas.get(key)
        if replica is not None and replica.state is ReplicaState.IDLE:
            replica.last_used = self._clock()

    @staticmethod
    def idle_s(replica: Replica, now: float) -> float:
        """Seconds an idle replica has been unused at `now` (its keep-alive runs out at keep_alive_s); else 0."""
        return max(now - replica.last_used, 0.0) if replica.state is ReplicaState.IDLE else 0.0

    def evict(self, key: Key) -> bool:
        """Evict key now if idle (True); a warm one goes when its calls end, a loading one stays."""
        state = self.state(key)
        if state is ReplicaState.IDLE:
            self._evict_now(key)
            return True
        if state is ReplicaState.WARM:
            self._replicas[key].evict_when_idle = True
        return False

    def expire(self, keeps: Callable[[Key], bool] | None = None) -> list[Key]:
        """Evict the idle replicas unused for keep_alive_s, except those kept (`kept`); returns their keys."""
        now = self._clock()
        expired = [key for key, r in self._idle() if now - r.last_used >= self.keep_alive_s]
        if expired:
            kept = self.kept(keeps, expired)
            expired = [key for key in expired if key not in kept]
        for key in expired:
            self._evict_now(key)
        return expired

    def kept(self, keeps: Callable[[Key], bool] | None = None, among: list[Key] | None = None) -> set[Key]:
        """The idle replicas (of `among`, default all) the keep-alive leaves resident: the models'
        keep-warm sets (shares.warm_set) and those keeps(key) holds (model_calls.py's family warmth)."""
        idle = {key for key, _ in self._idle()} if among is None else set(among)
        kept = {key for key in idle if keeps(key)} if keeps else set()
        if self.shares is not None:
            kept |= idle & warm_set([(k, r.bytes, self._meters.replicas[k].tokens) for k, r in self._replicas.items()
                                     if r.bytes], self.shares)
        return kept

    @property
    def _shares(self) -> Shares:
        """The models' shares, or one model without a share (plain eviction order)."""
        return self.shares or Shares((0,), (0,), 0.0)

    def _reload_s(self, key: Key, nbytes: int) -> float:
        """What loading key again would take: its model's mean load seconds per byte so far, times its
        bytes (one load's own time is noisy: a file's first read is slower than the next ones)."""
        seconds, loaded = self._loaded.get(self._shares.model_of(key[0]), (0.0, 0))
        return seconds / loaded * nbytes if loaded else 0.0

    def _idle(self) -> list[tuple[Key, Replica]]:
        return [(key, r) for key, r in self._replicas.items() if r.state is ReplicaState.IDLE]

    def _evict_now(self, key: Key) -> None:
        replica = self._replicas[key]
        self._held -= replica.bytes
        replica.state, replica.bytes, replica.evict_when_idle = ReplicaState.EVICTED, 0, False
        self._meters.free(key)
        self._meters.evicted(key)

    def _expect(self, key: Key, state: ReplicaState) -> Replica:
        replica = self._replicas.get(key)
        if replica is None or replica.state is not state:
            raise ValueError(f"replica {key} is {self.state(key).value}, expected {state.value}")
        return replica
