"""The serving replicas' side of the planning loop: each replica's IterationReports carried to the
loop actor (controller/planning/actor.py) from a thread of its own."""

from __future__ import annotations

import queue
import threading

import ray

from moeless.controller.planning.window import IterationReport


class ReportSender:
    """Sends a serving replica's IterationReports to the loop from a thread of its own: `offer`
    never blocks the forward; reports are dropped (counted) while the loop is not keeping up."""

    def __init__(self, loop, max_queued: int = 64, max_inflight: int = 32):
        self.loop, self.max_inflight = loop, max_inflight
        self.sent = self.dropped = 0
        self._queue: queue.Queue = queue.Queue(max_queued)
        self._inflight: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="report-sender", daemon=True)
        self._thread.start()

    def offer(self, report: IterationReport) -> None:
        try:
            self._queue.put_nowait(report)
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                report = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            if len(self._inflight) >= self.max_inflight:
                _, self._inflight = ray.wait(self._inflight, num_returns=len(self._inflight), timeout=0)
            if len(self._inflight) >= self.max_inflight:  # the loop is stalled or slow: drop, never block
                self.dropped += 1
                continue
            try:
                self._inflight.append(self.loop.report.remote(report))
                self.sent += 1
            except Exception:  # the actor is gone (Ray shutting down)
                self.dropped += 1

    def close(self) -> None:
        self._stop.set()
