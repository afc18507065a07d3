"""The expert-host pool on Kubernetes: its members are the pods of the operator's StatefulSet, its
size and its wake annotation are on the policy (or the ExpertPool), all through the API server.
The pool's sources (controller/pool/sources.py) and the planning loop's knob source import this; a
layer call does not: its Waker holds the source's `wake_target()`, a WakeTarget (controller/pool/wake.py).

The source of truth is the **pods of the operator's StatefulSet, read from the API server** (label
`moeless.io/policy=POLICY`, component expert-host), not the headless Service's DNS or the
operator's placement ConfigMap: a pod object says at once which slot it is (its ordinal), where it
is (podIP, new after a restart), whether it takes calls (its Ready condition, which follows the
host's /readyz, 503 while starting and while draining) and whether it is going away
(deletionTimestamp, set when scale-in or a delete begins, before the host drains). DNS says none
of the last two and is cached; the ConfigMap is written once per operator pass and only lists what
is resident. The slots (N of k8s://...?slots=N, controller/pool/sources.py) = the policy's (or the
pool's) `hosts.maxHosts` when serving starts; after that the slots follow `maxHosts` as the policy
(the ExpertPool) says it now, so `kubectl apply` of a larger maxHosts reaches running serving pods:
the operator starts the pods, serving adds their slots, the planning loop plans over them, and the
next placement uses them (no restart).

Both are read through a list and a watch each per process (list_watch.py): a change reaches
serving as the API server's event, and a quiet pool costs no request. The serving pod needs `list`
and `watch` on pods and on the policy (ExpertPool), and `get` and `patch` on it for the Waker; with
`list` alone it lists every second, as it did before the watch; where it cannot list the policy, it
gets it.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moeless.controller.pool.list_watch import ListWatch, ListWatchError
from moeless.controller.pool.members import Member, pod_member
from moeless.controller.pool.wake import WAKE_ANNOTATION

if TYPE_CHECKING:
    from kubernetes.client import ApiClient


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
    family: tuple[str, ...] = ()  # the names they serve the fine-tunes in this model's engine by (serving/family.py)

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
            doc = client.CustomObjectsApi(api_client(self.kubeconfig)).get_namespaced_custom_object(
                "moeless.io", "v1alpha1", self.namespace, plural, name, _request_timeout=5)
        value = ((doc.get("spec") or {}).get("hosts") or {}).get("maxHosts")
        return value if isinstance(value, int) and value > 0 else self.slots

    def wake_target(self) -> "KubePolicy":
        """What a Waker writes to wake this pool at zero: the ExpertPool's annotation for a shared
        pool (it wakes for every model at once), else the policy's."""
        if self.pool:
            return KubePolicy(self.namespace, self.pool, self.kubeconfig, "expertpools")
        return KubePolicy(self.namespace, self.policy, self.kubeconfig)


@dataclass(frozen=True)
class KubePolicy:
    """The ExpertAutoscalingPolicy (or, plural expertpools, the ExpertPool) via the API server (needs
    get and patch on it; kubeconfig as KubePodSource's)."""

    namespace: str
    policy: str
    kubeconfig: str | None = None
    plural: str = "expertautoscalingpolicies"

    @property
    def name(self) -> str:
        return f"{self.namespace}/{self.policy}"

    @property
    def selector(self) -> str:
        """The label of its expert-host pods."""
        return f"moeless.io/{'pool' if self.plural == 'expertpools' else 'policy'}={self.policy}"

    def _api(self):
        from kubernetes import client

        return client.CustomObjectsApi(api_client(self.kubeconfig))

    def read(self) -> tuple[str | None, str | None]:
        doc = self._api().get_namespaced_custom_object("moeless.io", "v1alpha1", self.namespace,
                                                       self.plural, self.policy, _request_timeout=5)
        return ((doc["metadata"].get("annotations") or {}).get(WAKE_ANNOTATION),
                (doc.get("status") or {}).get("wokenBy"))

    def write(self, value: str) -> None:
        self._api().patch_namespaced_custom_object(  # a dict body: a merge patch, only this annotation
            "moeless.io", "v1alpha1", self.namespace, self.plural, self.policy,
            {"metadata": {"annotations": {WAKE_ANNOTATION: value}}}, _request_timeout=5)


_api_clients: dict[str | None, object] = {}
_watches: dict[tuple, ListWatch] = {}
_watches_lock = threading.Lock()


def _watched(kubeconfig: str | None, api: type, method: str, *args: str, **selector: str) -> ListWatch:
    """This process's ListWatch of api(...).method(*args, **selector), started at the first call
    (sources are pickled to Ray actors; threads and clients are not)."""
    key = (kubeconfig, method, args, tuple(sorted(selector.items())))
    with _watches_lock:
        if key not in _watches:
            call = getattr(api(api_client(kubeconfig)), method)
            _watches[key] = ListWatch(call, *args, what=f"{method.removeprefix('list_namespaced_')} {selector}",
                                      **selector)
        return _watches[key]


def api_client(kubeconfig: str | None) -> ApiClient:
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
