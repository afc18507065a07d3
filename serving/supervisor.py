"""Restarting expert hosts that die in the embedded mode (`moeless serve`), with back-off.

A supervisor thread checks the local host processes every `check_s`; a dead one is restarted
on its address after a delay that doubles with each failure in a row (0.5 s, 1 s, 2 s ... up
to `max_delay_s`), and the count resets once a host has stayed up for `stable_s`. The serving
path needs no notice: RemoteExecutor marks the host dead on its first failed call, moves its
replicas to live hosts meanwhile (/healthz says "degraded"), probes it again and lets it re-join.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)


def backoff_delay(failures: int, base_s: float = 0.5, max_delay_s: float = 30.0) -> float:
    """Seconds to wait before restart number `failures` + 1 of a host (failures in a row)."""
    return min(max_delay_s, base_s * 2 ** failures)


class HostSupervisor:
    """Keeps the hosts of a LocalHostGroup running (restarts: `restarts` per host)."""

    def __init__(self, group, check_s: float = 0.2, base_s: float = 0.5, max_delay_s: float = 30.0,
                 stable_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.group = group
        self.check_s, self.base_s, self.max_delay_s, self.stable_s = check_s, base_s, max_delay_s, stable_s
        self.clock = clock
        self.restarts = [0] * len(group)
        self._failures = [0] * len(group)  # restarts in a row without a stable run
        self._up_since = [clock()] * len(group)
        self._due: dict[int, float] = {}  # host -> when to restart it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop supervising (before the group is closed, so no restart races the shutdown)."""
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.check_s):
            for i in range(len(self.group)):
                self._check(i)

    def _check(self, i: int) -> None:
        now = self.clock()
        if self.group.alive(i):
            if now - self._up_since[i] >= self.stable_s:
                self._failures[i] = 0
            return
        if i not in self._due:
            delay = backoff_delay(self._failures[i], self.base_s, self.max_delay_s)
            self._due[i] = now + delay
            log.warning("expert host %d died; restarting it in %.1f s", i, delay)
            return
        if now < self._due[i]:
            return
        del self._due[i]
        self._failures[i] += 1
        try:
            self.group.restart(i)
        except Exception as err:  # e.g. its port was taken meanwhile: try again after a longer delay
            log.error("restarting expert host %d failed: %s", i, err)
            return
        self.restarts[i] += 1
        self._up_since[i] = self.clock()
        log.warning("expert host %d restarted (%d so far)", i, self.restarts[i])
