"""Where serving learns the expert-host pool's members, and the thread that follows them.

`pool_source(MOELESS_EXPERT_HOSTS)` gives a source; `source.slots` is the pool's size in slots (a
placement's GPU count) when serving starts, `source.slots_now()` its size now and
`source.members()` the members now (controller/pool/members.py applies them):

    host:port[,host:port...] | dns:///NAME:PORT     a fixed list (controller/pool/addresses.py)
    k8s://NAMESPACE/POLICY:PORT?slots=N[&hostNetwork=true][&pool=POOL[&model=NAME]]
                                                    the pods of the policy's StatefulSet (below), or
                                                    of ExpertPool POOL's, which serve the policy's
                                                    model by NAME (default: the policy's name)
    file://PATH                                     a JSON file a local supervisor rewrites

On Kubernetes the source of truth is the **pods of the operator's StatefulSet, read from the API
server** (label `moeless.io/policy=POLICY`, component expert-host), not the headless Service's DNS
or the operator's placement ConfigMap: a pod object says at once which slot it is (its ordinal),
where it is (podIP, new after a restart), whether it takes calls (its Ready condition, which
follows the host's /readyz, 503 while starting and while draining) and whether it is going away
(deletionTimestamp, set when scale-in or a delete begins, before the host drains). DNS says none
of the last two and is cached; the ConfigMap is written once per operator pass and only lists what
is resident. N = the policy's (or the pool's) `hosts.maxHosts` when serving starts; after that the
slots follow `maxHosts` as the policy (the ExpertPool) says it now, so `kubectl apply` of a larger
maxHosts reaches running serving pods: the operator starts the pods, serving adds their slots, the
planning loop plans over them, and the next placement uses them (no restart).

Both are read through a list and a watch each per process (list_watch.py): a change reaches
serving as the API server's event, and a quiet pool costs no request. The serving pod needs `list`
and `watch` on pods and on the policy (ExpertPool), and `get` and `patch` on it for the Waker; with
`list` alone it lists every second, as it did before the watch; where it cannot list the policy, it
gets it.
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
from moeless.controller.pool.list_watch import ListWatch, ListWatchError
from moeless.controller.pool.members import HostPool, Member

log = logging.getLogger(__name__)
K8S, FILE = "k8s://", "file://"


class PoolSource(Protocol):
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


@dataclass(frozen=True)
class KubePodSource:
    """The policy's expert-host pods via the API server (see the module docstring). kubeconfig: a
    file (default $KUBECONFIG, else the pod's service account)."""

    namespace: str
    policy: str
    port: int
    slots: int
    host_network: bool = False  # on the node's network host i listens on port + i
    kubeconfig: str | None = None
    pool: str | None = None  # the ExpertPool whose hosts serve the policy's model (None: the policy's own)
    model: str | None = None  # the name the pool's hosts serve the model by (None: their only one)

    def members(self) -> list[Member]:
        """The pods now, from this process's watch of them (ListWatchError until it has listed them)."""
        from kubernetes import client

        owner = f"moeless.io/pool={self.pool}" if self.pool else f"moeless.io/policy={self.policy}"
        selector = f"{owner},app.kubernetes.io/component=expert-host"
        pods = _watched(self.kubeconfig, client.CoreV1Api, "list_namespaced_pod", self.namespace,
                        label_selector=selector).objects()
        return [m for m in (pod_member(p, self.port, self.host_network) for p in pods) if m]

    def slots_now(self) -> int:
        """spec.hosts.maxHosts of the ExpertPool (or of the policy) now; the start-up N where it has none."""
        from kubernetes import client

        plural, name = ("expertpools", self.pool) if self.pool else ("expertautoscalingpolicies", self.policy)
        try:
            found = _watched(self.kubeconfig, client.CustomObjectsApi, "list_namespaced_custom_object", "moeless.io",
                             "v1alpha1", self.namespace, plural, field_selector=f"metadata.name={name}").objects()
            if not found:
                raise LookupError(f"{plural}/{name} is not in namespace {self.namespace}")
            doc = found[0]
        except ListWatchError:  # a Role without `list` on it: get it
            doc = client.CustomObjectsApi(_api_client(self.kubeconfig)).get_namespaced_custom_object(
                "moeless.io", "v1alpha1", self.namespace, plural, name, _request_timeout=5)
        value = ((doc.get("spec") or {}).get("hosts") or {}).get("maxHosts")
        return value if isinstance(value, int) and value > 0 else self.slots


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


_api_clients: dict[str | None, object] = {}
_watches: dict[tuple, ListWatch] = {}
_watches_lock = threading.Lock()


def _watched(kubeconfig: str | None, api: type, method: str, *args: str, **selector: str) -> ListWatch:
    """This process's ListWatch of api(...).method(*args, **selector), started at the first call
    (sources are pickled to Ray actors; threads and clients are not)."""
    key = (kubeconfig, method, args, tuple(sorted(selector.items())))
    with _watches_lock:
        if key not in _watches:
            call = getattr(api(_api_client(kubeconfig)), method)
            _watches[key] = ListWatch(call, *args, what=f"{method.removeprefix('list_namespaced_')} {selector}",
                                      **selector)
        return _watches[key]


def _api_client(kubeconfig: str | None):
    """One ApiClient per kubeconfig per process (sources are pickled to Ray actors; clients are not)."""
    from kubernetes import client, config

    path = kubeconfig or os.environ.get("KUBECONFIG")
    if path not in _api_clients:
        if path:
            _api_clients[path] = config.new_client_from_config(config_file=path)
        else:
            config.load_incluster_config()
            _api_clients[path] = client.ApiClient()
    return _api_clients[path]


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
                        "[&pool=POOL[&model=NAME]] (N: the pool's hosts.maxHosts)")
    if query.get("model") and not query.get("pool"):
        raise KnobError(f"{HOSTS_ENV}: {value!r} names a model without a pool (&pool=POOL&model=NAME)")
    pool = query.get("pool") or None
    return KubePodSource(namespace, policy, int(port), int(query["slots"]),
                         query.get("hostNetwork", "false").lower() in ("1", "true", "yes"),
                         pool=pool, model=(query.get("model") or policy) if pool else None)


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
