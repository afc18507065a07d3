"""The operator against a real API server (etcd + kube-apiserver + controller-manager 1.20.2 on
loopback), running as `moeless operator` with the least-privilege service account of
manifests/rbac.yaml, reading the meters of a real expert-host process.

There is no node: the controller-manager creates the host pods, which stay Pending; a test marks a
pod Ready through the status subresource with podIP 127.0.0.1, where a real expert host (random
tiny weights) serves /metrics on the policy's metricsPort. The tests run in file order and share
one operator.
"""

from __future__ import annotations

import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml
from kubernetes import client, config

from moeless.controller.operator.kube import Kube
from moeless.controller.operator.actions import Create, Delete, Update, UpdateStatus
from moeless.controller.operator.reconcile import reconcile
from moeless.controller.operator.spec import GIB
from moeless.expert_fn.client.client import ExpertHostClient
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.controller.knobs import Knobs
from moeless.model.weight_store import export_experts

from k8s_support import ROOT, install_moeless, service_account_kubeconfig, start_operator, wait_for

pytestmark = pytest.mark.k8s
NS = "ml"
HIDDEN, FFN = 16, 8


@pytest.fixture(scope="module")
def api(cluster, kubectl):
    install_moeless(kubectl, NS)
    return config.new_client_from_config(config_file=str(cluster.kubeconfig))


@pytest.fixture(scope="module")
def operator_kubeconfig(cluster, api, tmp_path_factory) -> Path:
    """A kubeconfig with the operator service account's token (RBAC as deployed)."""
    return service_account_kubeconfig(cluster, "moeless-system", "moeless-operator",
                                      tmp_path_factory.mktemp("operator") / "kubeconfig")


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """One real expert host (2 layers x 4 experts of random weights) with some tokens computed."""
    gen = torch.Generator().manual_seed(0)
    weights = lambda: {"gate": torch.randn(FFN, HIDDEN, generator=gen), "up": torch.randn(FFN, HIDDEN, generator=gen),
                       "down": torch.randn(HIDDEN, FFN, generator=gen)}
    store = export_experts(((l, e, weights()) for l in range(2) for e in range(4)), tmp_path_factory.mktemp("store"),
                           model="random", num_layers=2, num_experts=4, act="silu")
    with launch_local_hosts(1, store.root, keep_alive_s=600.0) as group:
        with ExpertHostClient(group.addresses[0], timeout_s=20) as c:
            c.invoke(0, {0: torch.randn(30, HIDDEN), 1: torch.randn(10, HIDDEN), 2: torch.randn(5, HIDDEN)})
            c.invoke(1, {0: torch.randn(12, HIDDEN), 3: torch.randn(12, HIDDEN)})
            status = c.status()
        yield group, status


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


@pytest.fixture(scope="module")
def operators(operator_kubeconfig, tmp_path_factory):
    """The operator under test (`a`); a test may add a standby. All are stopped at the end."""
    tmp = tmp_path_factory.mktemp("operator-logs")
    procs = {"a": start_operator(operator_kubeconfig, "a", tmp)}
    procs["tmp"] = tmp
    yield procs
    for key, value in procs.items():
        if key != "tmp" and value[0].poll() is None:
            value[0].terminate()
            value[0].wait(20)


def policy_doc(metrics_port: int, memory_gib: float) -> dict:
    return {"apiVersion": "moeless.io/v1alpha1", "kind": "ExpertAutoscalingPolicy",
            "metadata": {"name": "mix", "namespace": NS},
            "spec": {"model": {"store": "/models/store"},
                     "hosts": {"image": "moeless:test", "minHosts": 1, "maxHosts": 3, "gpusPerHost": 0,
                               "memoryGiBPerHost": memory_gib, "metricsPort": metrics_port},
                     "serving": {"planner": "moeless", "keepAliveSeconds": 300}, "upscaleDelaySeconds": 0}}


def apply(kubectl, doc: dict, check: bool = True) -> subprocess.CompletedProcess:
    return kubectl("apply", "-f", "-", stdin=yaml.safe_dump(doc), check=check)


def eap(kubectl, name: str = "mix") -> dict:
    return kubectl.json("get", "eap", name, "-n", NS)


def mark_ready(api, pod: str) -> None:
    now = "2024-01-01T00:00:00Z"
    client.CoreV1Api(api).patch_namespaced_pod_status(pod, NS, {"status": {
        "phase": "Running", "podIP": "127.0.0.1", "hostIP": "127.0.0.1",
        "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}]}})


def test_policy_creates_the_pool_reads_the_meters_and_scales_out(api, kubectl, host, operators):
    group, host_status = host
    metrics_port = int(group.metrics_urls[0].rsplit(":", 1)[1].split("/")[0])
    held = sum(r["bytes"] for r in host_status["replicas"])
    resident = sum(1 for r in host_status["replicas"] if r["bytes"] > 0)
    # 1. Pool memory so small that what the host holds needs 3 hosts at 80%: the operator must grow it.
    memory_gib = held / GIB / 0.8 / 2.5
    doc = policy_doc(metrics_port, memory_gib)
    apply(kubectl, doc)
    sts = wait_for(lambda: kubectl.json("get", "statefulset", "mix-hosts", "-n", NS), what="the host StatefulSet")
    assert sts["spec"]["replicas"] == 1  # minHosts, before any meter is read
    serving = kubectl.json("get", "configmap", "mix-serving", "-n", NS)["data"]["config.yaml"]
    assert Knobs.from_mapping(yaml.safe_load(serving)).keep_alive_s == 300  # a valid `moeless serve --config`
    kubectl("get", "service", "mix-hosts", "-n", NS)
    # 2. The controller-manager creates the pod; it becomes Ready at the real host's address.
    wait_for(lambda: kubectl.json("get", "pod", "mix-hosts-0", "-n", NS), what="pod mix-hosts-0")
    mark_ready(api, "mix-hosts-0")
    # 3. Status carries the host's meters; the pool is scaled out through the scale subresource.
    status = wait_for(lambda: (s := eap(kubectl).get("status", {})).get("coldStarts") and s, what="meters in status")
    assert status["coldStarts"] == host_status["meters"]["cold_starts"] == 5
    assert status["cost"]["expertGBSeconds"] > 0 and status["replicas"] == resident
    assert 0 < status["layerCV"]["p95"] and status["observedGeneration"] == 1
    wait_for(lambda: kubectl.json("get", "statefulset", "mix-hosts", "-n", NS)["spec"]["replicas"] == 3,
             what="scale out to 3 hosts")
    wait_for(lambda: kubectl.json("get", "pod", "mix-hosts-2", "-n", NS), what="pod mix-hosts-2 from the controller-manager")
    events = kubectl.json("get", "events", "-n", NS, "--field-selector", "involvedObject.name=mix")["items"]
    assert {"Created", "ScaledOut"} <= {e["reason"] for e in events}
    placement = kubectl.json("get", "configmap", "mix-placement", "-n", NS)["data"]["resident.json"]
    assert f'"replicas": {resident}' in placement
    table = kubectl("get", "eap", "-n", NS).stdout
    assert table.split()[:8] == ["NAME", "READY", "HOSTS", "DESIRED", "REPLICAS", "CV-P95", "COLD-STARTS", "EXPERT-GBS"]
    assert table.splitlines()[1].split()[:5] == ["mix", "False", "1", "3", str(resident)]


@pytest.mark.parametrize("path, value, message", [
    (("hosts", "maxHosts"), 0, "spec.hosts.maxHosts"),
    (("serving", "predictor"), "sometimes", "spec.serving.predictor"),
    (("serving", "cvThreshold"), 0, "spec.serving.cvThreshold"),
    (("serving", "distance"), 1.5, "spec.serving.distance"),
])
def test_an_invalid_policy_is_refused_naming_the_field(kubectl, api, path, value, message):
    doc = policy_doc(9400, 1.0)
    doc["metadata"]["name"] = "bad"
    doc["spec"][path[0]][path[1]] = value
    result = apply(kubectl, doc, check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert kubectl("get", "eap", "bad", "-n", NS, check=False).returncode != 0


def test_a_policy_the_schema_cannot_judge_is_reported_by_the_operator(kubectl, api, operators):
    doc = policy_doc(9400, 1.0)
    doc["metadata"]["name"] = "unknown-planner"
    doc["spec"]["serving"]["planner"] = "nope"
    apply(kubectl, doc)
    cond = wait_for(lambda: next(c for c in eap(kubectl, "unknown-planner")["status"]["conditions"]
                                 if c["type"] == "Degraded"), what="Degraded condition")
    assert cond["status"] == "True" and cond["reason"] == "InvalidSpec" and "spec.serving: planner" in cond["message"]
    events = kubectl.json("get", "events", "-n", NS, "--field-selector", "involvedObject.name=unknown-planner")["items"]
    assert [e["type"] for e in events if e["reason"] == "InvalidSpec"] == ["Warning"]
    assert kubectl("get", "statefulset", "unknown-planner-hosts", "-n", NS, check=False).returncode != 0
    kubectl("delete", "eap", "unknown-planner", "-n", NS)


def test_api_server_restart_and_conflicting_writes_lose_no_policy_change(cluster, kubectl, api, operators):
    proc, port = operators["a"]
    cluster.restart_apiserver(down_s=2.0)
    # Several changes in a row, racing the operator's status writes (409s): the last one must win.
    for planner in ("static", "paper", "eplb-window"):
        kubectl("patch", "eap", "mix", "-n", NS, "--type=merge", "-p",
                f'{{"spec": {{"serving": {{"planner": "{planner}"}}, "hosts": {{"maxHosts": 2}}, "downscaleDelaySeconds": 0}}}}')
    want = eap(kubectl)["metadata"]["generation"]
    wait_for(lambda: "planner: eplb-window" in kubectl.json("get", "configmap", "mix-serving", "-n", NS)["data"]["config.yaml"],
             what="the serving config after the restart")
    wait_for(lambda: kubectl.json("get", "statefulset", "mix-hosts", "-n", NS)["spec"]["replicas"] == 2,
             what="scale in to the new maxHosts")
    wait_for(lambda: eap(kubectl)["status"]["observedGeneration"] == want, what="observedGeneration")
    assert proc.poll() is None
    beat = metric(port, "moeless_operator_heartbeat_timestamp_seconds")
    wait_for(lambda: metric(port, "moeless_operator_heartbeat_timestamp_seconds") > beat, what="a later heartbeat")


def test_a_stale_write_is_refused_and_the_change_still_lands(kubectl, api, operators):
    """A pass that read the policy before a user's change: its status write is refused (409), and the
    change is not lost: the next pass, from a fresh read, acts on it."""
    kube = Kube(api)
    stale = next(p for p in kube.list_policies(NS) if p["metadata"]["name"] == "mix")
    kubectl("patch", "eap", "mix", "-n", NS, "--type=merge", "-p", '{"spec": {"serving": {"keepAliveSeconds": 77}}}')
    actions = reconcile("mix", stale, kube.observe(NS, "mix", stale), time.time())
    refused = kube.apply(NS, stale, actions, time.time())
    assert [(type(a), code) for a, code in refused] == [(UpdateStatus, 409)]
    want = eap(kubectl)["metadata"]["generation"]
    wait_for(lambda: "keepAliveSeconds: 77" in kubectl.json("get", "configmap", "mix-serving", "-n", NS)["data"]["config.yaml"],
             what="the change acted on")
    wait_for(lambda: eap(kubectl)["status"]["observedGeneration"] == want, what="observedGeneration")


def test_every_write_lands_whatever_its_reply_and_gone_objects_are_refused_not_raised(api, kubectl):
    """Kube.apply's writes, on objects of their own: a deleted Service's reply is a Status that
    kubernetes 37's V1Service model refuses (it stopped the operator once, mid-CI); the write still
    counts, and a second delete of the same object is refused with 404 for the next pass."""
    kube = Kube(api)
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "w-svc"},
               "spec": {"ports": [{"port": 80}], "selector": {"app": "w"}}}
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "w-cm"}, "data": {"k": "1"}}
    assert kube.apply(NS, None, [Create(service), Create(config_map),
                                 Update("ConfigMap", "w-cm", {"data": {"k": "2"}})], time.time()) == []
    assert kubectl.json("get", "configmap", "w-cm", "-n", NS)["data"] == {"k": "2"}
    assert kube.apply(NS, None, [Delete("Service", "w-svc"), Delete("ConfigMap", "w-cm")], time.time()) == []
    wait_for(lambda: kubectl("get", "service", "w-svc", "-n", NS, check=False).returncode != 0, what="the Service gone")
    refused = kube.apply(NS, None, [Delete("Service", "w-svc")], time.time())
    assert [(type(a), code) for a, code in refused] == [(Delete, 404)]


def test_a_standby_operator_takes_over_when_the_leader_stops(kubectl, operators, operator_kubeconfig):
    _, port_a = operators["a"]
    # The API-server restart before this test may have let a's lease lapse; a takes it back alone.
    wait_for(lambda: metric(port_a, "moeless_operator_leader") == 1.0, timeout=30, what="a leading")
    operators["b"] = start_operator(operator_kubeconfig, "b", operators["tmp"])
    _, port_b = operators["b"]
    wait_for(lambda: metric(port_b, "moeless_operator_leader") == 0.0, what="b up as a standby")
    assert metric(port_a, "moeless_operator_leader") == 1.0
    assert kubectl.json("get", "lease", "moeless-operator", "-n", "moeless-system")["spec"]["holderIdentity"] == "a"
    operators["a"][0].terminate()
    assert operators["a"][0].wait(20) == 0
    wait_for(lambda: metric(port_b, "moeless_operator_leader") == 1.0, timeout=30, what="b leading")
    kubectl("patch", "eap", "mix", "-n", NS, "--type=merge", "-p", '{"spec": {"serving": {"keepAliveSeconds": 42}}}')
    wait_for(lambda: "keepAliveSeconds: 42" in kubectl.json("get", "configmap", "mix-serving", "-n", NS)["data"]["config.yaml"],
             what="b reconciling")


def test_deleting_the_policy_removes_what_it_made(kubectl, operators):
    kubectl("delete", "eap", "mix", "-n", NS)
    for kind, name in (("statefulset", "mix-hosts"), ("service", "mix-hosts"), ("configmap", "mix-serving"),
                       ("configmap", "mix-placement")):
        wait_for(lambda: kubectl("get", kind, name, "-n", NS, check=False).returncode != 0, what=f"{kind} {name} gone")


def test_manifests_and_examples_pass_a_server_side_dry_run(kubectl, api):
    manifests = ROOT / "manifests"
    operator = kubectl("apply", "--dry-run=server", "-f", str(manifests / "operator.yaml"))
    examples = kubectl("apply", "--dry-run=server", "-n", NS, "-f", str(manifests / "examples"))
    assert operator.stdout.count("(server dry run)") == 1
    documents = [d for f in sorted((manifests / "examples").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    assert examples.stdout.count("(server dry run)") == len(documents) == 11
