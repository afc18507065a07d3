"""Real expert hosts in tests: a condition polled until it holds, what a host holds, emptying one."""

from __future__ import annotations

import time
from typing import Callable

from moeless.expert_fn.client.client import ExpertHostClient


def wait_until(check: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Poll check() every 50 ms until it holds; fail naming `what` after timeout seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def resident(address: str) -> int:
    """Replicas the host at `address` holds or is loading."""
    with ExpertHostClient(address, timeout_s=10) as client:
        return sum(r["state"] in ("warm", "idle", "loading") for r in client.status()["replicas"])


def empty(address: str) -> None:
    """Evict every replica the host at `address` holds (what earlier tests of a module left there)."""
    with ExpertHostClient(address, timeout_s=10) as client:
        for r in client.status()["replicas"]:
            client.evict(r["layer"], r["expert"])
