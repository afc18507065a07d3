"""Who is in the expert-host pool: its members, the change that makes the pool in use those members,
and a StatefulSet pod as a member. Pure: no client, no thread, no Kubernetes, so that serving's
data path and the operator's reconcile (controller/operator/pool_reconcile.py) share it without
either importing the other's world.

A pool has a number of slots (a placement's GPU ids: slot i is StatefulSet pod i, or local host i
in `moeless serve`). A membership source (controller/pool/sources.py) says which members exist
now; `diff` compares that with what is in use, like a level-triggered reconcile, and
controller/pool/host_pool.py applies the difference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping


class NoLiveHostError(RuntimeError):
    """Every expert host is down: the layer cannot run anywhere."""


@dataclass(frozen=True)
class Member:
    """One expert host as the source sees it: its slot, its host:port, and whether it takes calls."""

    slot: int
    address: str
    ready: bool = True


@dataclass(frozen=True)
class PoolChange:
    """What to do to the pool in use: slots to fill (slot -> address), slots whose host moved to a
    new address, slots to empty; `ignored`: ready members outside the slots (a warning)."""

    added: dict[int, str] = field(default_factory=dict)
    readdressed: dict[int, str] = field(default_factory=dict)
    removed: frozenset[int] = frozenset()
    ignored: tuple[Member, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.added or self.readdressed or self.removed)


def diff(in_use: Mapping[int, str], observed: Iterable[Member], slots: int) -> PoolChange:
    """The change that makes `in_use` (slot -> address) the ready members of `observed`. Pure.
    Two members in one slot: the ready one wins, then the lower address (deterministic)."""
    want: dict[int, str] = {}
    ignored = []
    for m in sorted(observed, key=lambda m: (m.slot, m.address)):
        if not m.ready or m.slot in want:
            continue
        if not 0 <= m.slot < slots:
            ignored.append(m)
            continue
        want[m.slot] = m.address
    return PoolChange(
        added={s: a for s, a in want.items() if s not in in_use},
        readdressed={s: a for s, a in want.items() if s in in_use and in_use[s] != a},
        removed=frozenset(s for s in in_use if s not in want),
        ignored=tuple(ignored),
    )


def pod_member(pod: dict, port: int, host_network: bool = False) -> Member | None:
    """A StatefulSet pod as a member (None without an ordinal or an address, and once it is
    terminating: scaled in or deleted, it takes no new call and is not a host down). Its port: the
    container port named "grpc" where the pod declares one, else `port` (+ the ordinal on the
    node's network, where the operator declares none). Pure."""
    name, status = pod["metadata"]["name"], pod.get("status") or {}
    ordinal = name.rpartition("-")[2]
    ip = status.get("podIP")
    if not ordinal.isdigit() or not ip or pod["metadata"].get("deletionTimestamp"):
        return None
    declared = [p["containerPort"] for c in (pod.get("spec") or {}).get("containers") or ()
                for p in c.get("ports") or () if p.get("name") == "grpc"]
    port = declared[0] if declared else port + int(ordinal) if host_network else port
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())
    return Member(int(ordinal), f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}", ready)
