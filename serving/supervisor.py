"""Restarting expert hosts that die in the embedded mode (`moeless serve`), with back-off.

A supervisor thread checks the local host processes every `check_s`; a dead one is restarted
on its address after a delay that doubles with each failure in a row (0.5 s, 1 s, 2 s ... up
to `max_delay_s`), and the count resets once a host has stayed up for `stable_s`.

It publishes the pool's members (`publish`, e.g. controller/pool/sources.write_members to the file every
serving replica and the planning loop follow; controller/pool/members.py): a dead host leaves the pool
at once, so no new call goes to it and the planning loop plans without it, and it re-joins once
restarted, at its address then. (A call that reached it before that fails over as well:
RemoteExecutor marks it dead and moves its replicas to live hosts meanwhile.)
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from moeless.controller.pool.members import Member

log = logging.getLogger(__name__)


def backoff_delay(failures: int, base_s: float = 0.5, max_delay_s: float = 30.0) -> float:
    """Seconds to wait before restart number `failures` + 1 of a host (failures in a row)."""
    return min(max_delay_s, base_s * 2 ** failures)


class HostSupervisor:
    """Keeps the hosts of a LocalHostGroup running (restarts: `restarts` per host) and publishes
    which of them take calls (`publish(members)`, called when that changes)."""

    def __init__(self, group, check_s: float = 0.2, base_s: float = 0.5, max_delay_s: float = 30.0,
                 stable_s: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 publish: Callable[[list[Member]], None] | None = None):
        self.group = group
        self.publish = publish
        self._published: list[Member] | None = None
        self.check_s, self.base_s, self.max_delay_s, self.stable_s = check_s, base_s, max_delay_s, stable_s
        self.clock = clock
        self.restarts = [0] * len(group)
        self._failures = [0] * len(group)  # restarts in a row without a stable run
        self._up_since = [clock()] * len(group)
        self._due: dict[int, float] = {}  # host -> when to restart it
        self._publish()
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
            self._publish()

    def members(self) -> list[Member]:
        """Every local host, ready while its process runs."""
        return [Member(i, address, self.group.alive(i)) for i, address in enumerate(self.group.addresses)]

    def _publish(self) -> None:
        if self.publish is None:
            return
        members = self.members()
        if members != self._published:
            try:
                self.publish(members)
            except OSError as err:  # e.g. a full disk: retried on the next check
                log.error("publishing the expert-host pool failed: %s", err)
                return
            self._published = members

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
