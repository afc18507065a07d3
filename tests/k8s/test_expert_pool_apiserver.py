"""One ExpertPool shared by two models, against a real API server with the operator's RBAC as
deployed (manifests/rbac.yaml), reading the meters of a real expert host that serves both models.

As in test_operator_apiserver.py there is no node: the controller-manager creates the pool's pod,
the test marks it Ready at 127.0.0.1, where one real expert-host process serves two tiny models'
stores (--store a=DIR --store b=DIR) and its /metrics. The tests run in file order.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from kubernetes import client, config

from moeless.controller.pool.sources import pool_source
from moeless.controller.pool.kube import KubePolicy
from moeless.controller.pool.wake import Waker, waker_for
from moeless.expert_fn.client.client import ExpertHostClient
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.model.weight_store import export_experts

from k8s_support import install_moeless, operator_in_namespace, wait_for

pytestmark = pytest.mark.k8s
NS = "pools"
HIDDEN, FFN = 16, 8


@pytest.fixture(scope="module")
def api(cluster, kubectl):
    install_moeless(kubectl, NS)
    return config.new_client_from_config(config_file=str(cluster.kubeconfig))


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """One real expert host serving models a (2 layers x 4 experts) and b (3 x 2), each with tokens computed."""
    gen = torch.Generator().manual_seed(0)
    weights = lambda: {"gate": torch.randn(FFN, HIDDEN, generator=gen), "up": torch.randn(FFN, HIDDEN, generator=gen),
                       "down": torch.randn(HIDDEN, FFN, generator=gen)}
    stores = []
    for name, layers, experts in (("a", 2, 4), ("b", 3, 2)):
        root = tmp_path_factory.mktemp(f"store-{name}")
        export_experts(((l, e, weights()) for l in range(layers) for e in range(experts)), root, model=name,
                       num_layers=layers, num_experts=experts, act="silu")
        stores.append((name, root))
    with launch_local_hosts(1, stores, keep_alive_s=600.0) as group:
        with ExpertHostClient(group.addresses[0], timeout_s=20, model="a") as a:
            a.invoke(0, {0: torch.randn(30, HIDDEN), 1: torch.randn(10, HIDDEN)})
        with ExpertHostClient(group.addresses[0], timeout_s=20, model="b") as b:
            b.invoke(2, {1: torch.randn(7, HIDDEN)})
        yield group


@pytest.fixture(scope="module")
def operator(cluster, api, tmp_path_factory):
    with operator_in_namespace(cluster, "pools", tmp_path_factory, NS) as running:
        yield running


def apply(kubectl, *docs: dict) -> None:
    kubectl("apply", "-n", NS, "-f", "-", stdin=yaml.safe_dump_all(docs))


def pool_doc(metrics_port: int, grpc_port: int, **spec) -> dict:
    return {"apiVersion": "moeless.io/v1alpha1", "kind": "ExpertPool", "metadata": {"name": "shared"},
            "spec": {"hosts": {"image": "moeless:test", "minHosts": 1, "maxHosts": 2, "gpusPerHost": 0,
                               "memoryGiBPerHost": 1, "metricsPort": metrics_port, "grpcPort": grpc_port},
                     "storage": {"hostPath": "/srv/models"}, "keepAliveSeconds": 300, **spec}}


def policy_doc(name: str, guaranteed: float = 0.0) -> dict:
    return {"apiVersion": "moeless.io/v1alpha1", "kind": "ExpertAutoscalingPolicy", "metadata": {"name": name},
            "spec": {"pool": "shared", "model": {"store": f"/models/{name}", "guaranteedGiB": guaranteed},
                     "serving": {"planner": "moeless"}}}


def get(kubectl, kind: str, name: str) -> dict:
    return kubectl.json("get", kind, name, "-n", NS)


def condition(doc: dict, kind: str) -> dict:
    return next(c for c in doc["status"]["conditions"] if c["type"] == kind)


def test_one_pool_serves_two_models_bills_each_and_refuses_what_cannot_fit(api, kubectl, host, operator):
    metrics_port = int(host.metrics_urls[0].rsplit(":", 1)[1].split("/")[0])
    apply(kubectl, pool_doc(metrics_port, int(host.addresses[0].rsplit(":", 1)[1])), policy_doc("a", 0.5),
          policy_doc("b"))
    # 1. The pool's hosts serve both stores; a's share is kept on each host.
    sts = wait_for(lambda: get(kubectl, "statefulset", "shared-hosts"), what="the pool's StatefulSet")
    command = " ".join(sts["spec"]["template"]["spec"]["containers"][0]["command"])
    assert "--store a=/models/a --store b=/models/b --share a=0.536871" in command
    for name in ("a", "b"):  # each policy owns its knobs, not hosts
        wait_for(lambda: get(kubectl, "configmap", f"{name}-serving"), what=f"{name}'s serving knobs")
        assert kubectl("get", "statefulset", f"{name}-hosts", "-n", NS, check=False).returncode != 0
    # 2. The host pod becomes Ready at the real host: per-model meters reach the pool and each policy.
    wait_for(lambda: get(kubectl, "pod", "shared-hosts-0"), what="pod shared-hosts-0")
    client.CoreV1Api(api).patch_namespaced_pod_status("shared-hosts-0", NS, {"status": {
        "phase": "Running", "podIP": "127.0.0.1", "hostIP": "127.0.0.1",
        "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2024-01-01T00:00:00Z"}]}})
    pool = wait_for(lambda: (p := get(kubectl, "expertpool", "shared")).get("status", {}).get("replicas") and p,
                    what="the pool's meters")
    rows = {r["name"]: r for r in pool["status"]["models"]}
    assert (rows["a"]["replicas"], rows["b"]["replicas"]) == (2, 1)
    assert rows["a"]["admitted"] and rows["b"]["admitted"] and pool["status"]["modelCount"] == 2
    assert rows["a"]["expertGBSeconds"] > 0 and rows["b"]["expertGBSeconds"] > 0
    # status rounds each figure to 1e-9 GB·s: the rows add up to the total within that
    assert sum(r["expertGBSeconds"] for r in rows.values()) == pytest.approx(pool["status"]["cost"]["expertGBSeconds"],
                                                                           abs=len(rows) * 1e-9)
    # Each policy shows its own model: replicas from the hosts, GB·s as the pool's row (one pass behind at most).
    a = wait_for(lambda: (p := get(kubectl, "eap", "a")).get("status", {}).get("replicas") == 2 and p,
                 what="a's status")
    assert condition(a, "Ready")["status"] == "True" and a["status"]["hostsReady"] == 1
    assert a["status"]["cost"]["expertGBSeconds"] > 0
    table = kubectl("get", "epool", "-n", NS).stdout
    assert table.split()[:8] == ["NAME", "READY", "HOSTS", "DESIRED", "MODELS", "REPLICAS", "SHARED", "EXPERT-GBS"]
    assert table.splitlines()[1].split()[6] == "0"  # two unrelated models: no replica shared
    assert table.splitlines()[1].split()[:6] == ["shared", "True", "1", "1", "2", "3"]
    wide = kubectl("get", "eap", "-n", NS, "-o", "wide").stdout
    assert "POOL" in wide.split() and "shared" in wide.splitlines()[1].split()
    # 3. A third model whose share does not fit beside a's is refused, naming the field, in status and an Event.
    apply(kubectl, policy_doc("c", 0.9))
    c = wait_for(lambda: (p := get(kubectl, "eap", "c")).get("status", {}).get("conditions") and p, what="c refused")
    ready = condition(c, "Ready")
    assert ready["reason"] == "NotAdmitted" and ready["message"].startswith("spec.model.guaranteedGiB: 0.9 GiB does not fit")
    events = kubectl.json("get", "events", "-n", NS, "--field-selector", "involvedObject.name=c")["items"]
    assert [e["type"] for e in events if e["reason"] == "NotAdmitted"] == ["Warning"]
    assert "c=/models/c" not in " ".join(get(kubectl, "statefulset", "shared-hosts")["spec"]["template"]["spec"]
                                         ["containers"][0]["command"])
    wait_for(lambda: condition(get(kubectl, "expertpool", "shared"), "Degraded")["reason"] == "PolicyRefused",
             what="the pool naming the refused policy")
    kubectl("delete", "eap", "c", "-n", NS)


def keep_alive(host) -> float:
    with ExpertHostClient(host.addresses[0], timeout_s=10) as c:
        return c.status()["keep_alive_s"]


def test_a_pool_s_new_keep_alive_reaches_its_running_host_without_a_roll(api, kubectl, host, operator):
    # The host started with 600 s; the pool says 300 and the operator told the running host so.
    wait_for(lambda: keep_alive(host) == 300.0, what="the host running the pool's keep-alive")
    before, pod = get(kubectl, "statefulset", "shared-hosts"), get(kubectl, "pod", "shared-hosts-0")
    kubectl("patch", "expertpool", "shared", "-n", NS, "--type=merge", "-p", '{"spec": {"keepAliveSeconds": 45}}')
    wait_for(lambda: keep_alive(host) == 45.0, what="the new keep-alive on the running host")
    after = get(kubectl, "statefulset", "shared-hosts")
    assert after["metadata"]["generation"] == before["metadata"]["generation"]  # the pods were not rolled
    assert after["metadata"]["annotations"] == before["metadata"]["annotations"]
    assert get(kubectl, "pod", "shared-hosts-0")["metadata"]["uid"] == pod["metadata"]["uid"]


def test_the_pool_sleeps_when_no_model_is_busy_and_any_model_s_request_wakes_it(api, kubectl, host, operator, cluster):
    kubectl("patch", "expertpool", "shared", "-n", NS, "--type=merge", "-p",
            '{"spec": {"scaleToZero": {"enabled": true, "delaySeconds": 2}, "prewarm": {"hosts": 2}}}')
    wait_for(lambda: get(kubectl, "statefulset", "shared-hosts")["spec"]["replicas"] == 0, timeout=60,
             what="scale to zero once no model computes a token")
    wait_for(lambda: condition(get(kubectl, "eap", "b"), "Ready")["reason"] == "ScaledToZero", what="b's status")
    # A request of model b finds no host: serving's Waker (as waker_for makes it for b's pool source) wakes the pool.
    source = pool_source(f"k8s://{NS}/b:50051?slots=2&pool=shared")
    waker = waker_for(source)
    waker = Waker(KubePolicy(NS, source.pool, str(cluster.kubeconfig), waker.target.plural), timeout_s=60.0,
                  min_interval_s=1.0, poll_s=0.05)
    waker.wait_for_hosts(lambda: get(kubectl, "statefulset", "shared-hosts")["spec"]["replicas"] == 2)
    assert waker.wakes == 1 and waker.writes >= 1
    pool = get(kubectl, "expertpool", "shared")
    assert pool["status"]["wokenBy"] == pool["metadata"]["annotations"]["moeless.io/wake"]


def test_deleting_the_pool_removes_its_hosts_and_its_policies_say_so(api, kubectl, operator):
    kubectl("delete", "expertpool", "shared", "-n", NS)
    wait_for(lambda: kubectl("get", "statefulset", "shared-hosts", "-n", NS, check=False).returncode != 0,
             what="the pool's hosts gone")
    wait_for(lambda: condition(get(kubectl, "eap", "a"), "Ready")["reason"] == "PoolNotFound", timeout=90,
             what="a's status")  # the next passes of a loaded operator: twice failed at 30 s after a node tier
