"""Where serving learns the expert-host pool's members, and the thread that follows them.

`pool_source(MOELESS_EXPERT_HOSTS)` gives a source; `source.slots` is the pool's size in slots (a
placement's GPU count) when serving starts, `source.slots_now()` its size now and
`source.members()` the members now (controller/pool/host_pool.py applies them):

    host:port[,host:port...] | dns:///NAME:PORT     a fixed list (controller/pool/addresses.py)
    k8s://NAMESPACE/POLICY:PORT?slots=N[&hostNetwork=true][&pool=POOL[&model=NAME[&family=F1,F2...]]]
                                                    the pods of the policy's StatefulSet, or
                                                    of ExpertPool POOL's, which serve the policy's
                                                    model by NAME (default: the policy's name) and
                                                    the fine-tunes its engine serves too by F1, F2 ...
                                                    (`moeless serve`'s --model after the first, in order)
    file://PATH                                     a JSON file a local supervisor rewrites

On Kubernetes the members are the policy's pods, read through the API server (controller/pool/kube.py).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Protocol
from urllib.parse import parse_qs, urlsplit

from moeless.controller.knobs import KnobError
from moeless.controller.pool.addresses import HOSTS_ENV, expert_hosts
from moeless.controller.pool.host_pool import HostPool
from moeless.controller.pool.kube import KubePodSource
from moeless.controller.pool.members import Member
from moeless.controller.pool.wake import waker_for

log = logging.getLogger(__name__)
K8S, FILE = "k8s://", "file://"


class PoolSource(Protocol):
    """Where the members come from. A source whose pool can be woken from zero also has
    `wake_target()` (controller/pool/wake.py's waker_for)."""

    slots: int

    def members(self) -> list[Member]:
        """The pool's members now (raises OSError or an API error when the source cannot be read)."""
        ...

    def slots_now(self) -> int:
        """The pool's size in slots now (raises as members() does)."""
        ...


@dataclass(frozen=True)
class StaticSource:
    """Fixed hosts, all ready: host i in slot i."""

    addresses: tuple[str, ...]

    @property
    def slots(self) -> int:
        return len(self.addresses)

    def members(self) -> list[Member]:
        return [Member(i, a) for i, a in enumerate(self.addresses)]

    def slots_now(self) -> int:
        return self.slots


@dataclass(frozen=True)
class FileSource:
    """A JSON file {"slots": N, "members": [{"slot", "address", "ready"}]}, rewritten whole by its
    writer (write_members: atomic); `moeless serve`'s supervisor keeps one for its local hosts."""

    path: str
    slots: int

    @staticmethod
    def open(path: str) -> "FileSource":
        return FileSource(path, int(json.loads(Path(path).read_text())["slots"]))

    def members(self) -> list[Member]:
        doc = json.loads(Path(self.path).read_text())
        return [Member(int(m["slot"]), str(m["address"]), bool(m.get("ready", True))) for m in doc["members"]]

    def slots_now(self) -> int:
        return int(json.loads(Path(self.path).read_text())["slots"])


def write_members(path: str | Path, slots: int, members: list[Member]) -> None:
    """Publish the pool's members to a FileSource's file (readers never see half a file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"slots": slots, "members": [asdict(m) for m in members]}))
    os.replace(tmp, path)


def pool_source(value: str) -> PoolSource:
    """The source MOELESS_EXPERT_HOSTS names (module docstring); KnobError names a bad value."""
    value = value.strip()
    if value.startswith(FILE):
        try:
            return FileSource.open(value.removeprefix(FILE))
        except (OSError, ValueError, KeyError) as err:
            raise KnobError(f"{HOSTS_ENV}: cannot read the pool file {value!r} ({err})") from None
    if not value.startswith(K8S):
        return StaticSource(expert_hosts(value))
    url = urlsplit(value)
    namespace, _, rest = (url.netloc + url.path).partition("/")
    policy, _, port = rest.rpartition(":")
    query = {k: v[-1] for k, v in parse_qs(url.query).items()}
    if not (namespace and policy and port.isdigit() and query.get("slots", "").isdigit() and int(query["slots"]) > 0):
        raise KnobError(f"{HOSTS_ENV}: {value!r} is not {K8S}NAMESPACE/POLICY:PORT?slots=N[&hostNetwork=true]"
                        "[&pool=POOL[&model=NAME[&family=F1,F2...]]] (N: the pool's hosts.maxHosts)")
    if (query.get("model") or query.get("family")) and not query.get("pool"):
        raise KnobError(f"{HOSTS_ENV}: {value!r} names a model without a pool (&pool=POOL&model=NAME)")
    family = tuple(query.get("family", "").split(",")) if query.get("family") else ()
    if not all(family):
        raise KnobError(f"{HOSTS_ENV}: {value!r}: family must list the fine-tunes' names, comma-separated, none empty")
    pool = query.get("pool") or None
    return KubePodSource(namespace, policy, int(port), int(query["slots"]),
                         query.get("hostNetwork", "false").lower() in ("1", "true", "yes"),
                         pool=pool, model=(query.get("model") or policy) if pool else None, family=family)


class PoolFollower:
    """Keeps `pool` at `source`'s members: reads them now, then every `period_s` on a thread. A
    source that cannot be read leaves the pool as it is (retried next period)."""

    def __init__(self, pool: HostPool, source: PoolSource, period_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self.pool, self.source, self.period_s, self.clock = pool, source, period_s, clock
        self.errors = 0
        self.sync()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pool-follower", daemon=True)
        self._thread.start()

    def sync(self) -> None:
        try:
            members = self.source.members()
        except Exception as err:  # API server restarting, file being replaced: keep what is in use
            self.errors += 1
            log.warning("cannot read the expert-host pool (%s); keeping the %d hosts in use", err,
                        len(self.pool.clients()))
            return
        try:
            slots = self.source.slots_now()
        except Exception as err:  # the policy unreadable (gone, no RBAC): the slots stay as they are
            slots = None
            log.debug("cannot read the pool's size (%s); keeping %d slots", err, self.pool.slots)
        self.pool.update(members, self.clock(), slots)

    def first_ready_address(self, wait_s: float) -> str:
        """The lowest ready slot's address, waiting up to wait_s for one; a pool at zero on Kubernetes
        is woken for it (controller/pool/wake.py: the planning loop measures its cost profile on it
        before any request can wake the pool)."""
        waker = waker_for(self.source)
        if waker is not None:
            waker.timeout_s = max(waker.timeout_s, wait_s)
            waker.wait_for_hosts(lambda: bool(self.pool.addresses()), lambda: bool(self.pool.not_ready()))
        deadline = time.monotonic() + wait_s
        while not (addresses := self.pool.addresses()):
            if time.monotonic() >= deadline:
                raise RuntimeError(f"no expert host became ready within {wait_s:g} s to measure the cost profile "
                                   "on; start one (or pass a profile)")
            time.sleep(self.period_s)
        return addresses[min(addresses)]

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sync()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def follow_pool(source: PoolSource, make_client: Callable[[str], object], period_s: float = 1.0,
                retire_s: float = 60.0) -> tuple[HostPool, PoolFollower]:
    """A HostPool over `source`'s slots, kept current by a PoolFollower (close both when done)."""
    pool = HostPool(source.slots, make_client, retire_s)
    return pool, PoolFollower(pool, source, period_s)
