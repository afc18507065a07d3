"""The planning loop's calls to one host of its pool, each failure planned around (the host went
away, is draining or too slow: the next pass tries again)."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def host_status(pool: Any, slot: int) -> dict | None:
    """What the host in `slot` holds and its meters; None for an empty slot or a host that did not answer."""
    client = pool.client(slot)
    if client is None:  # no ready host in this slot
        return None
    try:
        return client.status()
    except Exception:  # unreachable, draining, too slow: planned around for this pass
        return None


def configure_host(pool: Any, slot: int, keep_alive_s: float) -> None:
    """The knobs' keep-alive on a host that runs another (a live change, or a host that restarted)."""
    try:
        pool.client(slot).configure(keep_alive_s)
    except Exception as err:  # gone meanwhile: the next pass tries again
        log.warning("cannot set host %d's keep-alive to %g s: %s", slot, keep_alive_s, err)
