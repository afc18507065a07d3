"""The planning loop's side of the step scaler: a widening asked by a serving replica, answered once
the placement over the wider set of hosts is published with nothing left to load.

    serving/step_gate.py --PlanLoop.widen(hosts)--> Widenings.ask: wider than the width now?
        yes: a ticket; the loop's next pass starts at once (and the passes after it every
             FAST_PERIOD_S while the ticket is open: their loads on the spares finish between them)
        the caller waits (Widenings.wait) until a pass that began after the ask ends with no loads
        pending (Widenings.pass_ended): its publish is the placement that spans the new hosts
    --> (the hosts planned over, the board version to follow up to)

The rule of how many hosts and for how long is PlacementWidth's (step_scaler.py).
"""

from __future__ import annotations

import threading
from collections import deque

from moeless.controller.planning.step_scaler import PlacementWidth

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

    def as_dict(self) -> dict:
        """For /metrics and the bench: tickets asked and settled, the recent ask-to-settled seconds."""
        with self._cond:
            return {"asked": self.asked, "settled": self.settled, "settle_s": list(self.settle_s)}

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
