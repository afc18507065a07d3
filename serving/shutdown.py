"""Draining every ModelServer replica of a running app before it is shut down.

A Serve handle reaches one replica per call, so the signal goes through a named Ray actor
instead (as placements do, controller/planning/board.py): `drain_replicas` raises it, each replica's
DrainWatcher sees it within `interval_s`, drains (no new requests, running ones finish until
the deadline, the rest fail with a 503 that says so) and reports; `drain_replicas` returns
once every replica has reported, or at the deadline plus a margin.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Callable

import ray

SIGNAL_NAME = "moeless-drain-signal"
log = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class DrainSignal:
    def __init__(self):
        self.timeout_s: float | None = None
        self.reports: dict[str, dict] = {}

    def start(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    def started(self) -> float | None:
        return self.timeout_s

    def report(self, replica: str, outcome: dict) -> None:
        self.reports[replica] = outcome

    def outcomes(self) -> dict[str, dict]:
        return dict(self.reports)


def signal_actor(name: str = SIGNAL_NAME):
    """The signal actor (created on first use; it lives as long as the Ray instance)."""
    return DrainSignal.options(name=name, namespace="moeless", get_if_exists=True, lifetime="detached").remote()


def drain_replicas(replicas: int, timeout_s: float, name: str = SIGNAL_NAME, margin_s: float = 10.0) -> dict[str, dict]:
    """Tell every ModelServer replica to drain within timeout_s; wait for `replicas` reports.
    Returns each replica's outcome ({"unfinished": requests failed at the deadline})."""
    actor = signal_actor(name)
    ray.get(actor.start.remote(timeout_s))
    deadline = time.monotonic() + timeout_s + margin_s
    while True:
        outcomes = ray.get(actor.outcomes.remote())
        if len(outcomes) >= replicas or time.monotonic() > deadline:
            return outcomes
        time.sleep(0.05)


class DrainWatcher:
    """Polls the signal every interval_s; when it is raised, runs drain(timeout_s) -> outcome
    once and reports it."""

    def __init__(self, drain: Callable[[float], dict], interval_s: float = 0.1, name: str = SIGNAL_NAME):
        self.drain, self.interval_s = drain, interval_s
        self.actor = signal_actor(name)
        self.replica = uuid.uuid4().hex[:12]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="drain-watcher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                timeout_s = ray.get(self.actor.started.remote())
            except ray.exceptions.RayError:  # Ray is going away: nothing left to drain for
                return
            if timeout_s is None:
                continue
            outcome = self.drain(timeout_s)
            log.info("drained: %s", outcome)
            self.actor.report.remote(self.replica, outcome)
            return

    def close(self) -> None:
        self._stop.set()
