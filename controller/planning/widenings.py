"""The planning loop's side of the step scaler: a widening asked by a serving replica, answered once
the placement over the wider set of hosts is published with nothing left to load.

    serving/step_gate.py --PlanLoop.widen(hosts)--> Widenings.ask: wider than the width now?
        yes: a ticket, which widen answers itself (below); where it cannot (a load failed, no host
             read yet), the loop's next pass starts at once (and the passes after it every
             FAST_PERIOD_S while the ticket is open: their loads on the spares finish between them),
             and the caller waits (Widenings.wait) until a pass that began after the ask ends with no
             loads pending (Widenings.pass_ended): its publish is the placement that spans the new hosts
    --> (the hosts planned over, the board version to follow up to)

widen answers a widening without a planning pass (choose): it takes the placement last published over
the wider hosts (where the last pass saw a wider one still held whole and this one not, that one), or
the first time over them static EP's blocks, has every replica of it resident, one LoadMany RPC a host
side by side (answer_loaded: those resident answer at once, so a warm widening costs one round trip; a
cold one, whose spares' keep-alive evicted their part, its loads' time, not planning passes'),
hands it back to the asking replica (which runs it at once) and publishes it on a thread of the
loop's, which settles the ticket. A pass that read the hosts before does not publish over it; the
next pass plans over the wider hosts as usual.

Ahead of any ask, each pass gives the board the standby placements (standby): those remembered over
wider sets of hosts that the hosts hold whole until the next pass at least (no replica's keep-alive
runs out before), which a replica's gate switches to without asking
first (board.BoardFollower.switch), so a warm widening costs the batch nothing it waits for.

The rule of how many hosts and for how long is PlacementWidth's (step_scaler.py).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from moeless.controller.planning.step_scaler import PlacementWidth, first_ready
from moeless.placement.home_fits import static_homes
from moeless.placement.types import LayerPlacement, Placement

FAST_PERIOD_S = 0.01  # between the passes of an open widening: its loads' status read again


@dataclass(frozen=True)
class Remembered:
    """A widening widen answers itself: the placement last published over `hosts` [slots] and its
    replicas the last pass did not see resident, missing [(layer, expert, host)]."""

    ticket: int
    placement: Placement
    hosts: list[bool]
    missing: list[tuple[int, int, int]]


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
        self.cold_publishes = 0  # ... after loading what the spares lacked of it
        self.cold_load_s: deque = deque(maxlen=256)  # those loads' seconds
        self.answer_parts: deque = deque(maxlen=256)  # widen's answers: where their seconds went (answer_loaded)
        self._loading: set[int] = set()  # tickets widen answers itself (no fast passes for them)
        self._standby: dict[int, Placement] = {}  # the last standby_changed returned

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

    def remembered(self, hosts: Sequence[bool], resident: np.ndarray) -> tuple[Placement, list] | None:
        """While a widening is open: the placement last published over `hosts` [slots] and its replicas
        not resident (resident [L, E, slots] bool), [(layer, expert, host)]; None where none was (a pass plans)."""
        with self._cond:
            placement = self._published.get(tuple(bool(h) for h in hosts)) if self.settled < self.asked else None
        if placement is None or placement.num_gpus != resident.shape[2]:
            return None
        return placement, _lacking(placement, resident)

    def standby(self, ready: Sequence[bool], resident: np.ndarray) -> dict[int, Placement]:
        """What a replica's step scaler may switch to at once (board.BoardFollower.switch): {hosts: the
        placement last published over the first `hosts` ready [slots] ones}, those whose every replica
        is resident [L, E, slots] bool (the loop passes those whose keep-alive lasts until its next pass
        may publish again: HostView.lasting); none without a step scaler (every ready host planned over)."""
        with self._cond:
            published = dict(self._published) if self.width.floor is not None else {}
        standby = {}
        for hosts in range(2, sum(map(bool, ready)) + 1):
            placement = published.get(tuple(bool(h) for h in first_ready(ready, hosts)))
            if placement is not None and placement.num_gpus == resident.shape[2] and not _lacking(placement, resident):
                standby[hosts] = placement
        return standby

    def standby_changed(self, ready: Sequence[bool], resident: np.ndarray) -> dict[int, Placement] | None:
        """standby, where it differs from the one this last returned; else None (nothing to publish)."""
        standby = self.standby(ready, resident)
        if standby.keys() == self._standby.keys() and all(standby[h] is self._standby[h] for h in standby):
            return None
        self._standby = standby
        return standby

    @property
    def answered(self) -> int:
        """Widenings published by widen itself (warm or cold): a pass that read the hosts before one
        does not publish over it."""
        with self._cond:
            return self.warm_publishes + self.cold_publishes

    def choose(self, ticket: int, ready: Sequence[bool], resident: np.ndarray, now: float) -> Remembered | None:
        """widen's own answer to `ticket`, by the hosts as the last pass read them (ready [slots],
        resident [L, E, slots]): the placement last published over the width's first ready hosts, or
        over the fewest more where that one held every replica then and the width's did not (the width
        then holds them: one widening for a burst that asks for 2 hosts, then 3); where the width was
        never published over, static EP's blocks over its hosts (the next pass plans them). None: no
        widening open or no host read yet (a pass answers). The ticket is then answer_loaded's."""
        if self.settled >= self.asked or resident.ndim != 3 or resident.shape[2] != len(ready):
            return None
        width = self.width.hosts(now) or 0
        found = [(hosts, active, self.remembered(active, resident))
                 for hosts, active in ((h, first_ready(ready, h)) for h in range(width, sum(map(bool, ready)) + 1))]
        found = [(hosts, active, *it) for hosts, active, it in found if it is not None]
        chosen = next((c for c in found if not c[3]), None) or next(iter(found), None)  # warm, else the narrowest
        if chosen is None:
            active = first_ready(ready, width)
            slots = np.flatnonzero(active)
            if not len(slots):
                return None
            num_layers, num_experts = resident.shape[:2]
            layer = LayerPlacement.even(np.arange(num_experts), slots[static_homes(num_experts, len(slots))], num_experts)
            static = Placement((layer,) * num_layers, num_experts, len(ready))
            chosen = (width, active, static, _lacking(static, resident))
        with self._cond:
            self.width.need(chosen[0], now)
            self._loading.add(ticket)
        return Remembered(ticket, chosen[2], chosen[1], chosen[3])

    def answer_loaded(self, chosen: Remembered, load: Callable[[list], int | None],
                      publish: Callable[[Placement, list[bool]], int], clock: Callable[[], float],
                      parts: dict | None = None, submit: Callable | None = None) -> bool:
        """load(every replica of chosen's placement) -> the loads it started, None where some did not
        load (outside the lock: passes and reports go on), then publish it and settle its ticket (warm
        where nothing had to load, else cold), unless a pass settled it meanwhile. False: a pass must.
        parts: seconds spent before (answer's), completed by load_s and publish_s into answer_parts.
        submit(fn, *args): where the publish runs (a thread of the loop's: the caller has the placement
        to run at once); None: here, before this returns."""
        began = clock()
        started = load(_replicas(chosen.placement))
        loaded = clock()
        if started is None:
            with self._cond:
                self._loading.discard(chosen.ticket)
            return False
        parts = {**(parts or {}), "cold": bool(started), "load_s": loaded - began}
        (submit or (lambda fn, *args: fn(*args)))(self._publish_loaded, chosen, parts, publish, clock)
        return True

    def _publish_loaded(self, chosen: Remembered, parts: dict, publish: Callable[[Placement, list[bool]], int],
                        clock: Callable[[], float]) -> None:
        with self._cond:
            self._loading.discard(chosen.ticket)
            if self.settled >= chosen.ticket:
                return  # a pass settled it meanwhile: it published
            began = clock()
            if parts["cold"]:
                self.cold_publishes += 1
                self.cold_load_s.append(parts["load_s"])
            else:
                self.warm_publishes += 1
            version = publish(chosen.placement, chosen.hosts)
            done = clock()
            self.answer_parts.append({**parts, "publish_s": done - began})
            self.pass_ended(chosen.ticket, False, version, done)

    def answer(self, ticket: int, ready: Sequence[bool], resident: np.ndarray, load: Callable[[list], int | None],
               publish: Callable[[Placement, list[bool]], int], clock: Callable[[], float],
               submit: Callable | None = None) -> Placement | None:
        """choose, then answer_loaded: the placement loaded (published, or its publish submitted).
        None: a pass must answer it."""
        began = clock()
        with self._cond:
            queued = began - self._asked_at.get(ticket, began)  # from the ask: the lock, the GIL, Ray's threads
        chosen = self.choose(ticket, ready, resident, began)
        parts = {"queued_s": queued, "choose_s": clock() - began}
        if chosen is None or not self.answer_loaded(chosen, load, publish, clock, parts, submit):
            return None
        return chosen.placement

    def as_dict(self) -> dict:
        """For /metrics and the bench: tickets asked and settled, those answered warm, the recent
        ask-to-settled seconds."""
        with self._cond:
            return {"asked": self.asked, "settled": self.settled, "warm": self.warm_publishes,
                    "cold": self.cold_publishes, "settle_s": list(self.settle_s), "cold_load_s": list(self.cold_load_s),
                    "answer_parts": list(self.answer_parts)}

    def hosts(self, now: float) -> int | None:
        """The hosts planned over now (PlacementWidth.hosts; None: every ready one)."""
        with self._cond:
            return self.width.hosts(now)

    def open(self) -> bool:
        """Whether a widening waits for a pass to settle it."""
        with self._cond:
            return self.settled < self.asked

    def period(self, period_s: float) -> float:
        """Seconds until the next pass: FAST_PERIOD_S while a widening waits for a pass, else period_s."""
        with self._cond:
            return FAST_PERIOD_S if any(t not in self._loading for t in self._asked_at) else period_s


def _replicas(placement: Placement) -> list[tuple[int, int, int]]:
    """placement's replicas: [(layer, expert, host)]."""
    return [(l, int(e), int(g)) for l, lp in enumerate(placement.layers) for e, g in zip(lp.expert, lp.gpu)]


def _lacking(placement: Placement, resident: np.ndarray) -> list[tuple[int, int, int]]:
    """placement's replicas not resident (resident [L, E, slots] bool)."""
    return [r for r in _replicas(placement) if not resident[r]]
