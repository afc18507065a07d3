"""The operator's only contact with the API server and the hosts: read what exists, apply actions.

Objects travel as plain API dicts (camelCase, as `kubectl get -o json` shows them): reads ask the
client for the raw JSON, writes send dicts. Every write that replaces an object sends the
resourceVersion it read, so a concurrent change makes it fail with 409 instead of being lost; the
next reconcile starts again from what is there (level-triggered).
"""

from __future__ import annotations

import json
import logging
import urllib.request
from typing import Any, Callable, Mapping

import grpc
import urllib3
from kubernetes import client
from kubernetes.client.rest import ApiException

from moeless.controller.operator import objects as obj
from moeless.controller.operator.actions import (Action, Configure, Create, Delete, Emit, Observed, Scale, Update,
                                                 UpdateStatus, pod_ready, rfc3339)
from moeless.controller.operator.meters import HostMeters, parse_host_metrics
from moeless.controller.operator.pool_spec import parse_pool_spec
from moeless.controller.operator.spec import HostPool, SpecError, parse_spec
from moeless.expert_fn.client.control import configure_keep_alive

log = logging.getLogger("moeless.operator")

Scraper = Callable[[str], str]  # url -> /metrics text
UNREACHABLE = (OSError, urllib3.exceptions.HTTPError)  # API server down or restarting


def http_scrape(url: str, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as reply:  # noqa: S310 (pod addresses only)
        return reply.read().decode()


def raw(call: Callable[..., Any], *args: Any, **kwargs: Any) -> dict | None:
    """The JSON of a read, or None for 404."""
    try:
        return json.loads(call(*args, _preload_content=False, **kwargs).data)
    except ApiException as err:
        if err.status == 404:
            return None
        raise


def send(call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """A write whose reply is read but not parsed: the operator never uses it, and the client's models can
    reject a valid one (a Service deleted while the garbage collector deletes it answers a Status, which
    kubernetes 37's V1Service refused with a ValidationError that stopped the operator). Errors raise."""
    call(*args, _preload_content=False, **kwargs).data  # .data reads it: the connection goes back to the pool


class Kube:
    """Typed clients of one ApiClient plus the host scraper."""

    def __init__(self, api: client.ApiClient, scrape: Scraper = http_scrape, component: str = obj.MANAGED_BY) -> None:
        self.core, self.apps = client.CoreV1Api(api), client.AppsV1Api(api)
        self.custom, self.coordination = client.CustomObjectsApi(api), client.CoordinationV1Api(api)
        self.scrape, self.component = scrape, component

    # -- reads --------------------------------------------------------------------------------
    def list_policies(self, namespace: str | None, plural: str = obj.PLURAL) -> list[dict]:
        """The policies (or, plural expertpools, the pools) of a namespace (None: all)."""
        if namespace:
            doc = raw(self.custom.list_namespaced_custom_object, obj.GROUP, obj.VERSION, namespace, plural)
        else:
            doc = raw(self.custom.list_cluster_custom_object, obj.GROUP, obj.VERSION, plural)
        return (doc or {}).get("items", [])

    def list_pools(self, namespace: str | None) -> list[dict]:
        """The ExpertPools; none (not an error) where their CRD is not installed yet."""
        try:
            return self.list_policies(namespace, obj.POOL_PLURAL)
        except ApiException as err:
            if err.status == 404:
                return []
            raise

    def managed_pools(self, namespace: str | None, kind: str = obj.KIND) -> set[tuple[str, str]]:
        """(namespace, owner) of every StatefulSet the operator made for a policy (or, kind ExpertPool,
        a pool): to find those of deleted owners."""
        selector = f"app.kubernetes.io/managed-by={obj.MANAGED_BY}"
        if namespace:
            doc = raw(self.apps.list_namespaced_stateful_set, namespace, label_selector=selector)
        else:
            doc = raw(self.apps.list_stateful_set_for_all_namespaces, label_selector=selector)
        label = obj.OWNER_LABELS[kind]
        return {(s["metadata"]["namespace"], s["metadata"]["labels"][label])
                for s in (doc or {}).get("items", []) if label in s["metadata"].get("labels", {})}

    def _get(self, kind: str, namespace: str, name: str) -> dict | None:
        read = {"StatefulSet": self.apps.read_namespaced_stateful_set, "Service": self.core.read_namespaced_service,
                "ConfigMap": self.core.read_namespaced_config_map, "Deployment": self.apps.read_namespaced_deployment}[kind]
        return raw(read, name, namespace)

    def _objects(self, namespace: str, owner_name: str, kind: str) -> dict[tuple[str, str], dict]:
        objects = {}
        for k, name in obj.names(owner_name, kind).values():
            found = self._get(k, namespace, name)
            if found is not None:
                objects[(k, name)] = found
        return objects

    def _hosts(self, namespace: str, owner_name: str, kind: str, hosts: HostPool | None) -> tuple[list, dict]:
        """The owner's host pods and the meters of those that answered (none without a valid hosts block)."""
        selector = ",".join(f"{k}={v}" for k, v in obj.host_selector(owner_name, kind).items())
        pods = (raw(self.core.list_namespaced_pod, namespace, label_selector=selector) or {}).get("items", [])
        meters: dict[str, HostMeters] = {}
        for pod in pods if hosts is not None else ():
            url = metrics_url(pod, hosts.metrics_port, hosts.host_network)
            if url is None:
                continue
            try:
                meters[pod["metadata"]["name"]] = parse_host_metrics(self.scrape(url))
            except (OSError, ValueError) as err:  # an unreachable host shows as Degraded/MetersUnavailable
                log.info("cannot read %s: %s", url, err)
        return pods, meters

    def observe(self, namespace: str, policy_name: str, policy: dict | None, policies: list[dict] = (),
                pool_hosts: Mapping[tuple[str, str], tuple[list, dict]] | None = None) -> Observed:
        """What one policy's reconcile needs (policies: the namespace's, for a policy on a pool;
        pool_hosts: (namespace, pool) -> (pods, meters) read this pass, which its policies reuse)."""
        objects = self._objects(namespace, policy_name, obj.KIND)
        if policy is None:
            return Observed(objects=objects)
        try:
            spec = parse_spec(policy.get("spec"))
        except SpecError:
            return Observed(objects=objects, pods=self._hosts(namespace, policy_name, obj.KIND, None)[0])
        pool = None
        if spec.pool is not None:  # its hosts are the pool's
            pool = raw(self.custom.get_namespaced_custom_object, obj.GROUP, obj.VERSION, namespace, obj.POOL_PLURAL,
                       spec.pool)
            seen = (pool_hosts or {}).get((namespace, spec.pool))
            pods, meters = seen or self._hosts(namespace, spec.pool, obj.POOL_KIND, _pool_hosts(pool))
        else:
            pods, meters = self._hosts(namespace, policy_name, obj.KIND, spec.hosts)
        serving = None
        if spec.non_expert_deployment:
            deployment = self._get("Deployment", namespace, spec.non_expert_deployment)
            serving = None if deployment is None else int((deployment.get("status") or {}).get("readyReplicas") or 0)
        return Observed(objects=objects, pods=pods, meters=meters, serving_ready=serving, pool=pool,
                        policies=[p for p in policies if p["metadata"]["namespace"] == namespace])

    def observe_pool(self, namespace: str, pool_name: str, pool: dict | None, policies: list[dict]) -> Observed:
        """What one ExpertPool's reconcile needs: its objects, hosts, meters and the namespace's policies."""
        objects = self._objects(namespace, pool_name, obj.POOL_KIND)
        if pool is None:
            return Observed(objects=objects)
        pods, meters = self._hosts(namespace, pool_name, obj.POOL_KIND, _pool_hosts(pool))
        return Observed(objects=objects, pods=pods, meters=meters,
                        policies=[p for p in policies if p["metadata"]["namespace"] == namespace])

    # -- writes -------------------------------------------------------------------------------
    def apply(self, namespace: str, policy: dict | None, actions: list[Action], now: float) -> list[tuple[Action, int]]:
        """Apply actions in order; returns those refused with 404 (gone) or 409 (exists, or changed since
        read: a resourceVersion conflict), which the next pass redoes from what is there."""
        refused = []
        for action in actions:
            try:
                self._apply(namespace, policy, action, now)
            except ApiException as err:
                if err.status not in (404, 409):
                    raise
                log.info("%s in %s: %s %s (next pass retries)", type(action).__name__, namespace, err.status, err.reason)
                refused.append((action, err.status))
        return refused

    def _apply(self, namespace: str, policy: dict | None, action: Action, now: float) -> None:
        if isinstance(action, Create):
            kind = action.obj["kind"]
            create = {"StatefulSet": self.apps.create_namespaced_stateful_set, "Service": self.core.create_namespaced_service,
                      "ConfigMap": self.core.create_namespaced_config_map}[kind]
            send(create, namespace, action.obj)
        elif isinstance(action, Update):
            current = self._get(action.kind, namespace, action.name)
            if current is None:
                return
            for key, value in action.fields.items():  # resourceVersion stays: a concurrent write makes this a 409
                current[key] = value if key == "data" else {**current.get(key, {}), **value}
            replace = {"StatefulSet": self.apps.replace_namespaced_stateful_set,
                       "ConfigMap": self.core.replace_namespaced_config_map}[action.kind]
            send(replace, action.name, namespace, current)
        elif isinstance(action, Scale):
            send(self.apps.patch_namespaced_stateful_set_scale, action.name, namespace,
                 {"spec": {"replicas": action.replicas}})
        elif isinstance(action, Delete):
            delete = {"StatefulSet": self.apps.delete_namespaced_stateful_set, "Service": self.core.delete_namespaced_service,
                      "ConfigMap": self.core.delete_namespaced_config_map}[action.kind]
            send(delete, action.name, namespace, propagation_policy="Background")
        elif isinstance(action, UpdateStatus):
            body = {"apiVersion": policy["apiVersion"], "kind": policy["kind"], "metadata": policy["metadata"],
                    "status": action.status}
            send(self.custom.replace_namespaced_custom_object_status, obj.GROUP, obj.VERSION, namespace,
                 obj.PLURALS[policy["kind"]], policy["metadata"]["name"], body)
        elif isinstance(action, Emit):
            send(self.core.create_namespaced_event, namespace, event(policy, action, now, self.component))
        elif isinstance(action, Configure):
            try:
                configure_keep_alive(action.address, action.keep_alive_s)
            except grpc.RpcError as err:  # gone or restarting meanwhile: the next pass sees its reading again
                log.info("cannot set %s's keep-alive to %g s: %s", action.pod, action.keep_alive_s, err.code())


def _pool_hosts(pool: dict | None) -> HostPool | None:
    """An ExpertPool's hosts block (None: no pool, or an invalid spec, which its own reconcile reports)."""
    try:
        return parse_pool_spec(pool.get("spec")).hosts if pool else None
    except SpecError:
        return None


def metrics_url(pod: dict, port: int, host_network: bool) -> str | None:
    """Where a ready host pod serves /metrics (None while it is not ready or has no address)."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip or not pod_ready(pod):
        return None
    if host_network:
        port += int(pod["metadata"]["name"].rsplit("-", 1)[1])
    return f"http://{ip}:{port}/metrics"


def event(policy: dict, action: Emit, now: float, component: str) -> dict[str, Any]:
    meta = policy["metadata"]
    stamp = rfc3339(now)
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {"apiVersion": obj.API_VERSION, "kind": policy.get("kind", obj.KIND), "name": meta["name"],
                           "namespace": meta["namespace"], "uid": meta["uid"]},
        "type": action.type, "reason": action.reason, "message": action.message,
        "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1, "source": {"component": component},
    }
