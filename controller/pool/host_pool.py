"""The expert-host pool as serving uses it while it runs: the clients of the ready hosts, by slot.

The pool's slots follow the source's (a policy's `maxHosts` raised or lowered while serving: a slot
beyond the placement's GPUs is used once a placement spans it). `HostPool.update` applies what
controller/pool/members.py's `diff` says:

- a ready member in an empty slot: a client is made, and the next layer call may use it (scale-out
  without a restart);
- a member that is gone (scaled in, terminating) or not ready (starting, dead, draining: its
  /readyz turned 503): its slot is emptied, so no new call goes there; the replicas the placement put there are served by
  the ready hosts meanwhile (scatter.evacuate), the outputs unchanged;
- a member whose address changed (a restarted pod): a new client for the new address.

A client taken out of use is closed only `retire_s` later: a layer call that started before the
change holds it and completes on it (a draining host finishes the calls in flight). Members that
are there but not ready are `not_ready()`: /healthz counts them as hosts down (degraded), while a
member that is gone was taken away on purpose.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterable

from moeless.controller.pool.members import Member, PoolChange, diff

log = logging.getLogger(__name__)


class HostPool:
    """The clients of the ready hosts, by slot; thread-safe. `make_client(address)` builds a client
    (anything with close()); `version` counts changes applied."""

    def __init__(self, slots: int, make_client: Callable[[str], Any], retire_s: float = 60.0):
        if slots <= 0:
            raise ValueError(f"an expert-host pool needs at least one slot, got {slots}")
        self.slots, self.make_client, self.retire_s = slots, make_client, retire_s
        self.version = 0
        self._clients: dict[int, Any] = {}
        self._addresses: dict[int, str] = {}
        self._not_ready: frozenset[int] = frozenset()
        self._retired: list[tuple[float, Any]] = []  # (when taken out of use, client)
        self._lock = threading.Lock()

    @staticmethod
    def fixed(clients: list, addresses: list[str] | None = None) -> "HostPool":
        """A pool that never changes: client i in slot i (tests, benchmarks, a static host list)."""
        pool = HostPool(len(clients), lambda address: None)
        pool._clients = dict(enumerate(clients))
        pool._addresses = dict(enumerate(addresses or [getattr(c, "address", f"client-{i}") for i, c in enumerate(clients)]))
        return pool

    def clients(self) -> dict[int, Any]:
        """slot -> client of every ready host now (a snapshot: a layer call keeps using it)."""
        with self._lock:
            return dict(self._clients)

    def client(self, slot: int) -> Any | None:
        with self._lock:
            return self._clients.get(slot)

    def addresses(self) -> dict[int, str]:
        with self._lock:
            return dict(self._addresses)

    def not_ready(self) -> frozenset[int]:
        """Slots whose member is there but not ready (starting, dead, draining)."""
        with self._lock:
            return self._not_ready

    def update(self, observed: Iterable[Member], now: float, slots: int | None = None) -> PoolChange:
        """Bring the pool to the ready members of `observed` in `slots` slots (None: as many as now);
        close clients retired retire_s ago."""
        observed = list(observed)
        with self._lock:
            if slots is not None and slots > 0 and slots != self.slots:
                log.info("expert-host pool: %d slots, was %d", slots, self.slots)
                self.slots = slots
                self.version += 1
            change = diff(self._addresses, observed, self.slots)
            for member in change.ignored:
                log.warning("expert host %s in slot %d is outside the pool's %d slots; not used", member.address,
                            member.slot, self.slots)
            for slot in sorted(change.removed | set(change.readdressed)):
                self._retired.append((now, self._clients.pop(slot)))
                del self._addresses[slot]
            for slot, address in sorted({**change.added, **change.readdressed}.items()):
                self._clients[slot], self._addresses[slot] = self.make_client(address), address
            self._not_ready = frozenset(m.slot for m in observed if not m.ready and 0 <= m.slot < self.slots
                                        and m.slot not in self._addresses)
            if change:
                self.version += 1
                log.info("expert-host pool: added %s, re-addressed %s, removed %s", change.added,
                         change.readdressed, sorted(change.removed))
            due = [c for when, c in self._retired if now - when >= self.retire_s]
            self._retired = [(when, c) for when, c in self._retired if now - when < self.retire_s]
        for client in due:
            _close(client)
        return change

    def close(self) -> None:
        """Close every client, in use or retired."""
        with self._lock:
            clients = list(self._clients.values()) + [c for _, c in self._retired]
            self._clients, self._addresses, self._retired = {}, {}, []
        for client in clients:
            _close(client)


def _close(client: Any) -> None:
    try:
        client.close()
    except Exception as err:  # a client of a host that is gone may fail to close; nothing is lost
        log.debug("closing an expert-host client failed: %s", err)
