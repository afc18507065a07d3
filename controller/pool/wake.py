"""Waking an expert-host pool scaled to zero from the request that finds it empty.

The operator scales a policy's pool (or an ExpertPool, for every model on it) to zero after its
idle delay and starts it again when the policy's (the pool's) annotation `moeless.io/wake` takes a
value other than its status.wokenBy
(controller/operator/reconcile.py). A layer call that finds no ready host in a pool followed on
Kubernetes (controller/pool/kube.py KubePodSource) does not fail: the `Waker` sets that
annotation to the wall-clock time and holds the call until the pool follower sees a ready host,
for at most `timeout_s` (MOELESS_WAKE_TIMEOUT_S, default 180 s), then fails it with a 503 that
says what to check. The call then completes on the woken hosts, its outputs unchanged.

Many replicas (and many layer calls) find the pool empty at once; `wake_value` (pure) lets one
write through: no write while a wake is pending (annotation != wokenBy: the operator has not acted
yet), one was written less than `min_interval_s` ago by any replica (the annotation is that time)
or the pool has pods not Ready yet (it is starting); each replica reads the policy at most once
per min_interval_s.

This module is the part a layer call holds, and imports no Kubernetes client: the Waker writes
through the `WakeTarget` its pool's source gives (controller/pool/kube.py: the policy on the API
server).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Protocol

from moeless.controller.knobs import KnobError
from moeless.controller.pool.members import NoLiveHostError

log = logging.getLogger(__name__)
WAKE_ANNOTATION = "moeless.io/wake"  # controller/operator/objects.py: serving does not import the operator
TIMEOUT_ENV = "MOELESS_WAKE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 180.0


class PoolDidNotWake(NoLiveHostError):
    """The pool stayed empty for the whole wake timeout (the ingress answers 503)."""


def wake_value(now_s: float, annotation: str | None, woken_by: str | None, min_interval_s: float,
               starting: bool = False) -> str | None:
    """The annotation value to write at wall-clock `now_s`, or None to leave the policy as it is;
    starting: the pool has pods that are not Ready yet (it is waking already). Pure."""
    if starting:
        return None  # the operator scaled it out already; the pods are starting (a slow start is no reason)
    if annotation and annotation != woken_by:
        return None  # a wake is pending: the operator acts on it; another write would not help
    try:
        if now_s - float(annotation or "") < min_interval_s:
            return None  # a replica woke the pool just now (the operator already took it)
    except ValueError:  # no annotation, or one a person set by hand (any value wakes)
        pass
    return f"{now_s:.3f}"


class WakeTarget(Protocol):
    name: str

    def read(self) -> tuple[str | None, str | None]:
        """(the wake annotation, status.wokenBy) of the policy now."""
        ...

    def write(self, value: str) -> None:
        """Set the wake annotation to `value`."""
        ...


class Waker:
    """Holds layer calls while the pool is empty and wakes it (module docstring). Thread-safe."""

    def __init__(self, target: WakeTarget, timeout_s: float = DEFAULT_TIMEOUT_S, min_interval_s: float = 5.0,
                 poll_s: float = 0.1, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep):
        self.target, self.timeout_s, self.min_interval_s, self.poll_s = target, timeout_s, min_interval_s, poll_s
        self.clock, self.wall, self.sleep = clock, wall, sleep
        self.wakes, self.writes, self.last_wake_s = 0, 0, 0.0
        self.waking_since: float | None = None  # clock() when the pool was first found empty; None: not waking
        self._last_try = -float("inf")
        self._error = ""
        self._lock = threading.Lock()

    @property
    def waking(self) -> bool:
        return self.waking_since is not None

    def stats(self) -> dict:
        return {"waking": self.waking, "wakes": self.wakes, "writes": self.writes, "last_wake_s": self.last_wake_s}

    def wait_for_hosts(self, has_hosts: Callable[[], bool], starting: Callable[[], bool] = lambda: False) -> None:
        """Return once has_hosts(), waking the pool meanwhile unless starting() (pods there, not Ready
        yet); PoolDidNotWake after timeout_s."""
        if has_hosts():
            return
        with self._lock:
            if self.waking_since is None:
                self.waking_since = self.clock()
                log.warning("no expert host of %s is ready: waking the pool (holding requests up to %g s)",
                            self.target.name, self.timeout_s)
            since = self.waking_since
        while not has_hosts():
            if self.clock() - since >= self.timeout_s:
                with self._lock:  # the next request starts a new wake
                    self.waking_since = None if self.waking_since == since else self.waking_since
                raise PoolDidNotWake(
                    f"the expert-host pool {self.target.name} did not wake within {self.timeout_s:g} s "
                    f"({TIMEOUT_ENV}); check that the operator runs (acting on the {WAKE_ANNOTATION} annotation, "
                    f"it copies it into the policy's status.wokenBy) and why the pods are not Ready (kubectl "
                    f"describe pods -l {getattr(self.target, 'selector', 'moeless.io/policy=' + self.target.name.partition('/')[2])})"
                    + (f"; last error: {self._error}" if self._error else ""))
            self._poke(starting())
            self.sleep(self.poll_s)
        with self._lock:
            if self.waking_since is not None:  # the first call to see the hosts reports the wake
                self.last_wake_s, self.waking_since = self.clock() - self.waking_since, None
                self.wakes += 1
                log.warning("the expert-host pool %s woke in %.1f s", self.target.name, self.last_wake_s)

    def _poke(self, starting: bool) -> None:
        """Read the policy and write the annotation if wake_value says so, at most once per min_interval_s."""
        with self._lock:
            if self.clock() - self._last_try < self.min_interval_s:
                return
            self._last_try = self.clock()
            try:
                value = wake_value(self.wall(), *self.target.read(), self.min_interval_s, starting)
                if value is not None:
                    self.target.write(value)
                    self.writes += 1
                    log.info("set %s=%s on %s", WAKE_ANNOTATION, value, self.target.name)
                self._error = ""
            except Exception as err:  # API server away, or no RBAC: retried next interval, named in the 503
                self._error = f"{type(err).__name__}: {getattr(err, 'reason', None) or err}"
                if getattr(err, "status", None) == 403:
                    self._error += f" (serving's service account needs get and patch on {getattr(self.target, 'plural', 'expertautoscalingpolicies')})"
                log.warning("cannot wake the expert-host pool %s (%s)", self.target.name, self._error)


def waker_for(source: object) -> Waker | None:
    """A Waker for a pool that can be woken, a source with a `wake_target()` (a pool followed on
    Kubernetes: controller/pool/kube.py), its timeout from MOELESS_WAKE_TIMEOUT_S; None for other
    sources (nothing to wake: an empty pool is a 503 at once)."""
    wake_target = getattr(source, "wake_target", None)
    return Waker(wake_target(), wake_timeout_s()) if wake_target else None


def wake_timeout_s() -> float:
    """MOELESS_WAKE_TIMEOUT_S (default 180); KnobError names a bad value."""
    raw = os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_S))
    try:
        timeout_s = float(raw)
    except ValueError:
        timeout_s = -1.0
    if not timeout_s > 0:
        raise KnobError(f"{TIMEOUT_ENV}: {raw!r} is not a positive number of seconds")
    return timeout_s


def health_word(health: dict) -> tuple[int, str]:
    """/healthz's (HTTP status, word) from ModelServer.health(). Pure."""
    if health["draining"]:
        return 503, "draining"
    if not health["live_hosts"]:
        return 503, "waking" if health.get("waking") else "no expert host is serving"
    # degraded: some host is down (restarting); the others carry its experts meanwhile
    return 200, "ok" if len(health["live_hosts"]) == health["hosts"] else "degraded"
