"""The planning loop's side of the step scaler: a widening asked by a serving replica, answered once
the placement over the wider set of hosts is published with nothing left to load.

    serving/step_gate.py --PlanLoop.widen(hosts)--> Widenings.ask: wider than the width now?
        yes: a ticket; the loop's next pass starts at once (and the passes after it every
             FAST_PERIOD_S while the ticket is open: their loads on the spares finish between them)
        the caller waits (Widenings.wait) until a pass that began after the ask ends with no loads
        pending (Widenings.pass_ended): its publish is the placement that spans the new hosts
    --> (the hosts planned over, the board version to follow up to)

A re-widening (a burst's next step, or the next burst within the spares' keep-alive) waits for no
pass: where the last pass saw the spares holding every replica of the placement last published over
the wider hosts, widen publishes that one again at once and settles the ticket (answer_warm; a
replica evicted since is loaded by its first call, a cold start, never a wrong answer). A pass that
read the hosts before it does not publish over it; the next pass plans over the wider hosts as usual.

The rule of how many hosts and for how long is PlacementWidth's (step_scaler.py).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Sequence

import numpy as np

from moeless.controller.planning.step_scaler import PlacementWidth, first_ready
from moeless.placement.types import Placement

FAST_PERIOD_S = 0.01  # between the passes of an open widening: its loads' status read again


class Widenings:
    """Tickets of widenings asked and settled (thread-safe; `lock`: the loop's)."""

    def __init__(self, width: PlacementWidth, lock: threading.RLock):
        self.width = width
        self._cond = threading.Condition(lock)
        self.asked = 0  # the last ticket given
        self.settled = 0  # every ticket up to this one is settled
        self.version = 0  # the board version of the loop's last publish
        self._asked_at: dict[int, float] = {}  # open ticket -> when it was asked
        self.settle_s: deque = deque(maxlen=256)  # the last widenings' seconds from ask to settled
        self._published: dict[tuple[bool, ...], Placement] = {}  # hosts planned over -> the last placement there
        self.warm_publishes = 0  # widenings answered from _published, no planning pass

    def ask(self, hosts: int, now: float) -> int | None:
        """A batch needs `hosts` hosts: a ticket where that widens the placement, else None."""
        with self._cond:
            if not self.width.need(hosts, now):
                return None
            self.asked += 1
            self._asked_at[self.asked] = now
            return self.asked

    def wait(self, ticket: int | None, timeout_s: float) -> int:
        """Block until `ticket` is settled (None: at once) or timeout_s; the board version to follow up to."""
        with self._cond:
            if ticket is not None:
                self._cond.wait_for(lambda: self.settled >= ticket, timeout_s)
            return self.version

    def pass_started(self) -> int:
        """The ticket a pass starting now answers (every one asked before it)."""
        with self._cond:
            return self.asked

    def pass_ended(self, ticket: int, loads_pending: bool, version: int, now: float) -> None:
        """A pass that answers `ticket` ended at `now`, after publishing board version `version` (or
        the last one); settled where it left nothing to load."""
        with self._cond:
            self.version = max(self.version, version)
            if not loads_pending and ticket > self.settled:
                for t in [t for t in self._asked_at if t <= ticket]:
                    self.settle_s.append(now - self._asked_at.pop(t))
                self.settled = ticket
                self._cond.notify_all()

    def published(self, hosts: Sequence[bool], placement: Placement) -> None:
        """The loop published `placement` planned over `hosts` [slots] (ready and within the width)."""
        with self._cond:
            self._published[tuple(bool(h) for h in hosts)] = placement

    def warm(self, hosts: Sequence[bool], resident: np.ndarray) -> Placement | None:
        """While a widening is open: the placement last published over `hosts` [slots] where every
        replica of it is resident (resident [L, E, slots] bool), else None (a pass plans)."""
        with self._cond:
            placement = self._published.get(tuple(bool(h) for h in hosts)) if self.settled < self.asked else None
        if placement is None or placement.num_gpus != resident.shape[2]:
            return None
        if not all(resident[l, lp.expert, lp.gpu].all() for l, lp in enumerate(placement.layers)):
            return None
        with self._cond:
            self.warm_publishes += 1
        return placement

    def answer_warm(self, ticket: int, ready: Sequence[bool], resident: np.ndarray,
                    publish: Callable[[Placement, list[bool]], int], now: float) -> bool:
        """Settle `ticket` at once where the hosts it widens to (the width's first ready slots of
        `ready`), or the fewest more (the width then holds them: one widening for a burst that asks for
        2 hosts, then 3), held every replica of the placement last published over them (warm: resident
        [L, E, slots] as the last pass read them): publish(it, the hosts) -> its board version (the one
        it has where it is still the placement published). False: a pass must answer it."""
        width = self.width.hosts(now) or 0
        for hosts in range(width, sum(map(bool, ready)) + 1):
            active = first_ready(ready, hosts)
            placement = self.warm(active, resident)
            if placement is not None:
                self.width.need(hosts, now)
                self.pass_ended(ticket, False, publish(placement, active), now)
                return True
        return False

    def as_dict(self) -> dict:
        """For /metrics and the bench: tickets asked and settled, those answered warm, the recent
        ask-to-settled seconds."""
        with self._cond:
            return {"asked": self.asked, "settled": self.settled, "warm": self.warm_publishes,
                    "settle_s": list(self.settle_s)}

    def hosts(self, now: float) -> int | None:
        """The hosts planned over now (PlacementWidth.hosts; None: every ready one)."""
        with self._cond:
            return self.width.hosts(now)

    def open(self) -> bool:
        """Whether a widening waits for a pass to settle it."""
        with self._cond:
            return self.settled < self.asked

    def period(self, period_s: float) -> float:
        """Seconds until the next pass: FAST_PERIOD_S while a widening is open, else period_s."""
        return FAST_PERIOD_S if self.open() else period_s
