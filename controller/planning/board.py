"""Publishing a placement to every ModelServer replica of a running app.

A named Ray actor holds the latest placement and its version; each ModelServer polls it from a
background thread and `set`s its PlacementSource, so the next layer it runs uses the new plan.
A planner (or a benchmark) calls `publish_placement`. Replicas may switch a few milliseconds
apart: that is harmless, since every placement gives the same outputs.
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

    def publish(self, placement: Placement) -> int:
        self.version += 1
        self.placement = placement
        return self.version

    def newer_than(self, version: int) -> tuple[int, Placement] | None:
        return (self.version, self.placement) if self.version > version else None


def board(name: str = BOARD_NAME):
    """The board actor (created on first use; it lives as long as the Ray instance)."""
    return PlacementBoard.options(name=name, namespace="moeless", get_if_exists=True, lifetime="detached").remote()


def publish_placement(placement: Placement, name: str = BOARD_NAME) -> int:
    """Send `placement` to every ModelServer replica; returns its version on the board."""
    return ray.get(board(name).publish.remote(placement))


class BoardFollower:
    """Polls the board every `interval_s` (every hurry_interval_s while hurried) and applies newer
    placements to `source`."""

    def __init__(self, source: PlacementSink, interval_s: float = 0.1, name: str = BOARD_NAME,
                 hurry_interval_s: float = 0.005):
        self.source, self.interval_s, self.hurry_interval_s = source, interval_s, hurry_interval_s
        self.board = board(name)
        self.seen = 0
        self._hurried_until = 0.0
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
            update = ray.get(self.board.newer_than.remote(self.seen))
            if update is None:
                continue
            self.seen, placement = update
            try:
                self.source.set(placement)
            except PlacementError as err:  # a plan for another model or host count: keep serving the current one
                log.error("ignoring placement version %d from the board: %s", self.seen, err)

    def close(self) -> None:
        self._stop.set()
        self._poll.set()
