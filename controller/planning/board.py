"""Publishing a placement to every ModelServer replica of a running app.

A named Ray actor holds the latest placement and its version; each ModelServer polls it from a
background thread and `set`s its PlacementSource, so the next layer it runs uses the new plan.
A planner (or a benchmark) calls `publish_placement`. Replicas may switch a few milliseconds
apart: that is harmless, since every placement gives the same outputs.

Beside it the board holds the loop's standby placements (`publish_standby`): for a width of more
hosts than the loop plans over, the placement it last published over them, while the hosts held
every replica of it. A replica's step scaler whose batch needs that width switches to one at once
(`BoardFollower.switch`) and the loop publishes it in its turn (serving/step_gate.py).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

import ray

from moeless.controller.planning.names import BOARD_NAME
from moeless.placement.types import Placement, PlacementError

log = logging.getLogger(__name__)


class PlacementSink(Protocol):
    """What a follower applies placements to (serving's PlacementSource)."""

    def set(self, placement: Placement) -> None: ...


@ray.remote(num_cpus=0)
class PlacementBoard:
    def __init__(self):
        self.version, self.placement = 0, None
        self.standby_version, self.standby = 0, {}

    def publish(self, placement: Placement) -> int:
        self.version += 1
        self.placement = placement
        return self.version

    def publish_standby(self, standby: dict[int, Placement]) -> int:
        self.standby_version += 1
        self.standby = standby
        return self.standby_version

    def newer_than(self, version: int, standby_version: int = -1) -> tuple | None:
        """(version, placement or None where not newer, standby version, standby or None where not
        newer); None where neither is."""
        if self.version <= version and self.standby_version <= standby_version:
            return None
        return (self.version, self.placement if self.version > version else None, self.standby_version,
                self.standby if self.standby_version > standby_version else None)


_HANDLES: dict[tuple[str, str], object] = {}  # (board, Ray node): a lookup costs milliseconds a publish


def board(name: str = BOARD_NAME):
    """The board actor (created on first use; it lives as long as the Ray instance)."""
    key = (name, ray.get_runtime_context().get_node_id())  # a new Ray instance: a new node, looked up again
    if key not in _HANDLES:
        _HANDLES[key] = PlacementBoard.options(name=name, namespace="moeless", get_if_exists=True,
                                               lifetime="detached").remote()
    return _HANDLES[key]


def publish_placement(placement: Placement, name: str = BOARD_NAME) -> int:
    """Send `placement` to every ModelServer replica; returns its version on the board."""
    return ray.get(board(name).publish.remote(placement))


def publish_standby(standby: dict[int, Placement], name: str = BOARD_NAME) -> int:
    """Send the standby placements {hosts: placement over that many} to every ModelServer replica."""
    return ray.get(board(name).publish_standby.remote(standby))


def spanned(placement: Placement) -> int:
    """The hosts a placement puts replicas on."""
    return len({int(g) for layer in placement.layers for g in layer.gpu})


class BoardFollower:
    """Polls the board every `interval_s` (every hurry_interval_s while hurried) and applies newer
    placements to `source`; keeps the standby ones for `switch`."""

    def __init__(self, source: PlacementSink, interval_s: float = 0.1, name: str = BOARD_NAME,
                 hurry_interval_s: float = 0.005):
        self.source, self.interval_s, self.hurry_interval_s = source, interval_s, hurry_interval_s
        self.board = board(name)
        self.seen, self.standby_seen, self.standby = 0, 0, {}
        self._hurried_until = 0.0
        self._floor, self._pinned_until = 0, 0.0  # a switch's hosts: no narrower board placement until then
        self._passed = 0  # the newest narrower board version the pin passed over (not read again until it ends)
        self._apply = threading.Lock()  # a board placement and a switch: one after the other
        self._stop, self._poll = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="placement-follower", daemon=True)
        self._thread.start()

    def hurry(self, for_s: float = 1.0) -> None:
        """Poll now and every hurry_interval_s for `for_s` seconds: a placement is about to be
        published that a caller waits for (the step scaler's widening, serving/step_gate.py)."""
        self._hurried_until = time.monotonic() + for_s
        self._poll.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            hurried = time.monotonic() < self._hurried_until
            self._poll.wait(self.hurry_interval_s if hurried else self.interval_s)
            self._poll.clear()
            if self._stop.is_set():
                break
            since = max(self.seen, self._passed) if time.monotonic() < self._pinned_until else self.seen
            update = ray.get(self.board.newer_than.remote(since, self.standby_seen))
            if update is None:
                continue
            version, placement, self.standby_seen, standby = update
            if standby is not None:
                self.standby = standby
            if placement is not None:
                self._follow(version, placement)

    def _follow(self, version: int, placement: Placement) -> None:
        with self._apply:
            if time.monotonic() < self._pinned_until and spanned(placement) < self._floor:
                self._passed = version  # narrower than this replica switched to: read again once the pin ends
                return
            self.seen = version
            try:
                self.source.set(placement)
            except PlacementError as err:  # a plan for another model or host count: keep serving the current one
                log.error("ignoring placement version %d from the board: %s", version, err)

    def switch(self, hosts: int, for_s: float) -> bool:
        """Run the standby placement over the fewest hosts >= `hosts` now, and no board placement over
        fewer hosts for `for_s` seconds (the loop publishes the wider one meanwhile); False where none."""
        wide = [h for h in self.standby if h >= hosts]
        if not wide:
            return False
        return self.adopt(self.standby[min(wide)], for_s)

    def adopt(self, placement: Placement, for_s: float) -> bool:
        """Run `placement` now (a widening's, loaded: PlanLoop.widen's answer), and no board placement
        over fewer hosts for `for_s` seconds; False where it does not fit this model."""
        with self._apply:
            try:
                self.source.set(placement)
            except PlacementError as err:
                log.error("ignoring a widening's placement over %d hosts: %s", spanned(placement), err)
                return False
            self._floor, self._pinned_until = spanned(placement), time.monotonic() + for_s
        return True  # polled as usual: this replica waits for nothing the board has

    def close(self) -> None:
        self._stop.set()
        self._poll.set()
