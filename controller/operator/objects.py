"""The objects a policy or an ExpertPool owns, as the API wants them (pure builders, no client).

For a policy NAME in a namespace:
- StatefulSet NAME-hosts: the expert-host pool (stable names: host i is GPU i of the placement;
  scale-in removes the highest ordinals). Its size moves only through the scale subresource.
  Not for a policy on an ExpertPool (spec.pool): its model is served on the pool's hosts.
- Service NAME-hosts: headless, so the serving app reaches each host by name (same).
- ConfigMap NAME-serving: config.yaml, the serving knobs (a `moeless serve --config` file).
- ConfigMap NAME-placement: resident.json, the replicas resident on each host.
For an ExpertPool NAME: StatefulSet and Service NAME-hosts, as above, whose hosts serve every
admitted model (one --store NAME=DIR each). Every object carries its policy or pool as its
controller owner (deleting it deletes them) and the labels below; an object with one of these
names that is not owned by it is left alone.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from typing import Any, Sequence

import yaml

from moeless.controller.operator.pool_spec import Member, PoolSpec
from moeless.controller.operator.spec import GIB, PolicySpec

GROUP, VERSION, KIND, PLURAL = "moeless.io", "v1alpha1", "ExpertAutoscalingPolicy", "expertautoscalingpolicies"
POOL_KIND, POOL_PLURAL = "ExpertPool", "expertpools"
PLURALS = {KIND: PLURAL, POOL_KIND: POOL_PLURAL}
API_VERSION = f"{GROUP}/{VERSION}"
SERVING_GENERATION_ANNOTATION = "moeless.io/serving-generation"  # set by the serving pods' planning loop
MANAGED_BY = "moeless-operator"
POLICY_LABEL = "moeless.io/policy"
POOL_LABEL = "moeless.io/pool"
OWNER_LABELS = {KIND: POLICY_LABEL, POOL_KIND: POOL_LABEL}
TEMPLATE_HASH = "moeless.io/template-hash"
WAKE_ANNOTATION = "moeless.io/wake"  # set (any value, e.g. a timestamp) to wake a pool scaled to zero


def names(owner_name: str, kind: str = KIND) -> dict[str, tuple[str, str]]:
    """role -> (kind, name) of the objects a policy (or, kind POOL_KIND, an ExpertPool) owns."""
    hosts = {"hosts": ("StatefulSet", f"{owner_name}-hosts"), "service": ("Service", f"{owner_name}-hosts")}
    if kind == POOL_KIND:
        return hosts
    return {**hosts, "serving": ("ConfigMap", f"{owner_name}-serving"),
            "placement": ("ConfigMap", f"{owner_name}-placement")}


def labels(owner_name: str, component: str, kind: str = KIND) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "moeless",
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        OWNER_LABELS[kind]: owner_name,
    }


def owner_reference(owner: dict) -> dict[str, Any]:
    meta = owner["metadata"]
    return {"apiVersion": API_VERSION, "kind": owner.get("kind", KIND), "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def owned_by(obj: dict, owner_name: str, uid: str | None, kind: str = KIND) -> bool:
    """Whether obj's controller is this policy or pool (by uid; by name when it is gone, uid None)."""
    for ref in obj.get("metadata", {}).get("ownerReferences") or ():
        if ref.get("kind") == kind and ref.get("controller") and ref.get("name") == owner_name:
            if uid is None or ref.get("uid") == uid:
                return True
    return False


def _meta(owner: dict, name: str, component: str) -> dict[str, Any]:
    kind = owner.get("kind", KIND)
    return {"name": name, "namespace": owner["metadata"]["namespace"],
            "labels": labels(owner["metadata"]["name"], component, kind), "ownerReferences": [owner_reference(owner)]}


def host_command(spec: PolicySpec | PoolSpec, members: Sequence[Member] = ()) -> list[str]:
    """The expert host's command line: a policy's own store, or every admitted member's store on an
    ExpertPool (--store NAME=DIR) with their guaranteed shares (--share NAME=GB) and keep-warm sets
    (--keep-warm NAME=GB); on the node's
    network host i listens on port + i."""
    pool = spec.hosts
    assert pool is not None
    memory_gb = round(pool.memory_gib_per_host * GIB / 1e9, 3)
    if isinstance(spec, PoolSpec):
        admitted = [m for m in members if m.admitted]
        stores = " ".join(f"--store {m.model}={m.store}" for m in admitted)
        # Six digits: a share to the kilobyte (one small model's expert can be a few kilobytes)
        stores += "".join(f" --share {m.model}={m.guaranteed_gib * GIB / 1e9:.6g}" for m in admitted if m.guaranteed_gib)
        stores += "".join(f" --keep-warm {m.model}={m.keep_warm_gib * GIB / 1e9:.6g}"
                          for m in admitted if m.keep_warm_gib)
    else:
        stores = f"--store {spec.store}"
    tail = (f"{stores} --bind 0.0.0.0 --keep-alive-s {spec.keep_alive_s:g} "
            f"--memory-gb {memory_gb:g} --drain-s {pool.drain_seconds}")
    if pool.poll_microseconds:
        tail += f" --poll-us {pool.poll_microseconds:g}"
    if pool.compute_dtype != "float32":
        tail += f" --compute-dtype {pool.compute_dtype}"
    if not pool.family_warm:
        tail += " --no-family-warm"
    if pool.peer_copies != "measured":
        tail += f" --peer-copies {pool.peer_copies}"
    if pool.host_network:
        offset = "${POD_NAME##*-}"
        return ["sh", "-c", f"exec moeless expert-host {tail} --port $(({pool.grpc_port} + {offset})) "
                            f"--metrics-port $(({pool.metrics_port} + {offset}))"]
    return ["moeless", "expert-host", *tail.split(), "--port", str(pool.grpc_port), "--metrics-port", str(pool.metrics_port)]


def _probe(spec: PolicySpec, path: str) -> dict[str, Any]:
    pool = spec.hosts
    timing = {"periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 3}
    if not pool.host_network:
        return {"httpGet": {"path": path, "port": "metrics"}, **timing}
    # On the node's network each host has its own port: an exec probe computes it.
    check = (f"import os,urllib.request as u; u.urlopen('http://127.0.0.1:%d{path}' % "
             f"({pool.metrics_port} + int(os.environ['POD_NAME'].rsplit('-', 1)[1])), timeout=2)")
    return {"exec": {"command": ["python", "-c", check]}, **timing}


def pod_template(owner: dict, spec: PolicySpec | PoolSpec, members: Sequence[Member] = ()) -> dict[str, Any]:
    name, pool, kind = owner["metadata"]["name"], spec.hosts, owner.get("kind", KIND)
    assert pool is not None
    volumes = [{"name": "tmp", "emptyDir": {}}]
    mounts = [{"name": "tmp", "mountPath": "/tmp"}]
    if spec.pvc or spec.host_path:
        source = ({"persistentVolumeClaim": {"claimName": spec.pvc, "readOnly": True}} if spec.pvc
                  else {"hostPath": {"path": spec.host_path, "type": "Directory"}})
        volumes.append({"name": "store", **source})
        mount = spec.mount_path if isinstance(spec, PoolSpec) else spec.store
        mounts.append({"name": "store", "mountPath": mount, "readOnly": True})
    resources: dict[str, Any] = {"requests": {"cpu": pool.cpu}}
    if pool.gpus_per_host:
        resources["limits"] = {"nvidia.com/gpu": pool.gpus_per_host}
    container = {
        "name": "expert-host", "image": pool.image, "imagePullPolicy": pool.image_pull_policy,
        "command": host_command(spec, members),
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "HOME", "value": "/tmp"}, {"name": "MOELESS_CACHE", "value": "/tmp/moeless-cache"},
                {"name": "NUMBA_CACHE_DIR", "value": "/tmp/numba"}],
        "readinessProbe": _probe(spec, "/readyz"),
        # A host busy loading replicas on a shared CPU answered late, and 3 misses 5 s apart restarted
        # healthy hosts (the helm node tier): start-up gets 5 minutes, then a minute of misses.
        "startupProbe": {**_probe(spec, "/healthz"), "failureThreshold": 60},
        "livenessProbe": {**_probe(spec, "/healthz"), "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6},
        "resources": resources,
        "volumeMounts": mounts,
        "securityContext": {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]}},
    }
    if not pool.host_network:  # declared ports on the node's network would collide between hosts
        container["ports"] = [{"name": "grpc", "containerPort": pool.grpc_port},
                              {"name": "metrics", "containerPort": pool.metrics_port}]
    pod_spec: dict[str, Any] = {
        "containers": [container], "volumes": volumes, "enableServiceLinks": False,
        # Draining finishes the calls in flight before the kill.
        "terminationGracePeriodSeconds": pool.drain_seconds + 10,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001},
    }
    if pool.host_network:
        pod_spec.update(hostNetwork=True, dnsPolicy="ClusterFirstWithHostNet")
    if pool.cuda_ipc:  # CUDA IPC with serving pods on the node: the driver refuses a handle from another PID
        # namespace, and torch's reference counter lives in /dev/shm (docs/serving.md). A change rolls the hosts.
        pod_spec.update(hostPID=True, hostIPC=True)
    meta = {"labels": labels(name, "expert-host", kind),
            "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(pool.metrics_port)}}
    return {"metadata": meta, "spec": pod_spec}


def template_hash(template: dict) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:16]


def host_selector(owner_name: str, kind: str = KIND) -> dict[str, str]:
    """The labels of a policy's (or a pool's) expert-host pods."""
    return {OWNER_LABELS[kind]: owner_name, "app.kubernetes.io/component": "expert-host"}


def stateful_set(owner: dict, spec: PolicySpec | PoolSpec, replicas: int, members: Sequence[Member] = ()) -> dict[str, Any]:
    owner_kind = owner.get("kind", KIND)
    kind, name = names(owner["metadata"]["name"], owner_kind)["hosts"]
    template = pod_template(owner, spec, members)
    # A keep-alive reaches running hosts live (a policy's: its planning loop's Configure RPC; a pool's:
    # the operator's): a change of it alone must not roll them (every resident replica lost), so the
    # hash leaves it out.
    unkept = replace(spec, keep_alive_s=0.0) if isinstance(spec, PoolSpec) else \
        replace(spec, knobs=replace(spec.knobs, keep_alive_s=0.0))
    hashed = pod_template(owner, unkept, members)
    meta = _meta(owner, name, "expert-host")
    meta["annotations"] = {TEMPLATE_HASH: template_hash(hashed)}
    return {
        "apiVersion": "apps/v1", "kind": kind, "metadata": meta,
        "spec": {"replicas": replicas, "serviceName": name, "podManagementPolicy": "Parallel",
                 "selector": {"matchLabels": host_selector(owner["metadata"]["name"], owner_kind)},
                 "template": template},
    }


def service(owner: dict, spec: PolicySpec | PoolSpec) -> dict[str, Any]:
    owner_kind = owner.get("kind", KIND)
    kind, name = names(owner["metadata"]["name"], owner_kind)["service"]
    assert spec.hosts is not None
    return {
        "apiVersion": "v1", "kind": kind, "metadata": _meta(owner, name, "expert-host"),
        "spec": {"clusterIP": "None", "selector": host_selector(owner["metadata"]["name"], owner_kind),
                 "ports": [{"name": "grpc", "port": spec.hosts.grpc_port},
                           {"name": "metrics", "port": spec.hosts.metrics_port}]},
    }


def serving_config_map(policy: dict, spec: PolicySpec) -> dict[str, Any]:
    kind, name = names(policy["metadata"]["name"])["serving"]
    config = yaml.safe_dump(spec.knobs.to_mapping(), sort_keys=False)
    return {"apiVersion": "v1", "kind": kind, "metadata": _meta(policy, name, "serving-config"),
            "data": {"config.yaml": config}}


def placement_config_map(policy: dict, resident: dict[str, list[list[int]]]) -> dict[str, Any]:
    """resident: host pod -> [[layer, expert], ...] of the replicas it holds."""
    kind, name = names(policy["metadata"]["name"])["placement"]
    body = {"hosts": resident, "replicas": sum(len(v) for v in resident.values())}
    return {"apiVersion": "v1", "kind": kind, "metadata": _meta(policy, name, "placement"),
            "data": {"resident.json": json.dumps(body, sort_keys=True)}}
