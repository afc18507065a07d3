"""The planning loop's calls to the hosts of its pool, each failure planned around (the host went
away, is draining or too slow: the next pass tries again)."""

from __future__ import annotations

import logging
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np

from moeless.controller.planning.peer_sources import peer_sources

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


def host_statuses(pool: Any) -> list[dict | None]:
    """Every slot's host_status, the hosts asked side by side (a pass's reads cost the slowest host's,
    not their sum)."""
    slots = pool.slots
    if slots <= 1:
        return [host_status(pool, i) for i in range(slots)]
    with ThreadPoolExecutor(slots, thread_name_prefix="host-status") as threads:
        return list(threads.map(lambda slot: host_status(pool, slot), range(slots)))


def configure_host(pool: Any, slot: int, keep_alive_s: float) -> None:
    """The knobs' keep-alive on a host that runs another (a live change, or a host that restarted)."""
    try:
        pool.client(slot).configure(keep_alive_s)
    except Exception as err:  # gone meanwhile: the next pass tries again
        log.warning("cannot set host %d's keep-alive to %g s: %s", slot, keep_alive_s, err)


def load_sources(pool: Any, loads: Sequence[tuple[int, int, int]], resident: np.ndarray | None) -> list[str]:
    """Each load's source: the address of a peer host holding its replica (peer_sources.py), "" for its
    store (none holds it, no view of the hosts yet, or the holder's address unknown)."""
    if resident is None:
        return [""] * len(loads)
    addresses = pool.addresses()
    return [addresses.get(g, "") if g is not None else "" for g in peer_sources(loads, resident)]


def send_actions(pool: Any, actions: Sequence[tuple[int, int, int, str]], resident: np.ndarray | None = None) -> None:
    """(layer, expert, host, "evict" | "load") each, loads not waited for: every host's in its own
    thread (a widening loads a spare's whole share: its Load RPCs one after another, the hosts side by
    side), each host's in the order given (its evictions before its loads). resident: bool [L, E, G], the
    hosts' replicas as last read; a load copies its replica from a peer holding it (load_sources)."""
    loads = [(layer, expert, host) for layer, expert, host, act in actions if act == "load"]
    sources = iter(load_sources(pool, loads, resident))
    by_host: dict[int, list[tuple[int, int, str, str]]] = defaultdict(list)
    for layer, expert, host, act in actions:
        by_host[host].append((layer, expert, act, next(sources) if act == "load" else ""))
    if len(by_host) <= 1:
        for host, calls in by_host.items():
            _send(pool, host, calls)
        return
    with ThreadPoolExecutor(len(by_host), thread_name_prefix="host-actions") as threads:
        for host, calls in by_host.items():
            threads.submit(_send, pool, host, calls)


def load_all(pool: Any, replicas: Sequence[tuple[int, int, int]], timeout_s: float,
             resident: np.ndarray | None = None) -> int | None:
    """Every (layer, expert, host) of `replicas` resident, waited for: one LoadMany RPC per host (its
    load workers take them in turn; a resident one answers at once), the hosts side by side, each load
    copied from a peer holding it where `resident` (as in send_actions) shows one. The loads started
    (0: all were resident); None where one is not resident within timeout_s (a host gone or too
    slow, a replica that cannot load: the caller falls back to a planning pass)."""
    by_host: dict[int, list[tuple[int, int]]] = defaultdict(list)
    from_peers: dict[int, list[str]] = defaultdict(list)
    for (layer, expert, host), source in zip(replicas, load_sources(pool, replicas, resident)):
        by_host[host].append((layer, expert))
        from_peers[host].append(source)

    def load(host: int) -> int | None:
        client = pool.client(host)
        if client is None:  # the host left the pool
            return None
        try:
            sources = from_peers[host] if any(from_peers[host]) else ()
            return client.load_many(by_host[host], wait=True, timeout_s=timeout_s, sources=sources)
        except Exception as err:
            log.warning("loading %d replicas on host %d failed: %s", len(by_host[host]), host, err)
            return None

    if len(by_host) <= 1:
        started = [load(host) for host in by_host]
    else:
        with ThreadPoolExecutor(len(by_host), thread_name_prefix="host-loads") as threads:
            started = list(threads.map(load, list(by_host)))
    return None if None in started else sum(started)


def _send(pool: Any, host: int, calls: list[tuple[int, int, str, str]]) -> None:
    for layer, expert, act, source in calls:
        try:
            client = pool.client(host)
            client.evict(layer, expert) if act == "evict" else client.load(layer, expert, wait=False, source=source)
        except Exception as err:  # the host went away meanwhile (None: it left the pool): planned around next pass
            log.warning("%s of (layer %d, expert %d) on host %d failed: %s", act, layer, expert, host, err)
