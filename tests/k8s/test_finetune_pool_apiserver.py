"""A base and two fine-tunes on one ExpertPool, from the chart (helm template of pool.models with
base), against a real API server with the operator as deployed (its process, its RBAC), reading the
/metrics of one real expert host serving the three stores (the fine-tunes' written over the base's,
`export_experts(..., base=)`).

As in test_expert_pool_apiserver.py there is no node: the controller-manager creates the pool's
pod and the test marks it Ready at 127.0.0.1, where the real host listens. Checked: the API server
accepts what the chart renders; the pool admits the fine-tunes with their base and its hosts list
the base first; the host answers each model exactly (a shared expert with the base's bytes, a
changed one with the fine-tune's) and holds a shared expert once; each model's GB·s and shared
share reach the pool's and its policy's status (and `kubectl get`) and add up; a fine-tune whose
base is not on the pool is refused, naming it, in status and an Event. The tests run in file order.
"""

from __future__ import annotations

import subprocess

import pytest
import torch
import torch.nn.functional as F
import yaml
from kubernetes import client, config

from moeless.expert_fn.client.client import ExpertHostClient
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.model.weight_store import export_experts

from k8s_support import ROOT, install_moeless, operator_in_namespace, wait_for

pytestmark = pytest.mark.k8s
NS, POOL = "finetunes", "t-pool"
HIDDEN, FFN, LAYERS, EXPERTS = 16, 8, 2, 4
CHANGED = {"code": [(0, 1)], "math": [(1, 2), (0, 3)]}  # the experts each fine-tune changed


def weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"gate": torch.randn(FFN, HIDDEN, generator=gen), "up": torch.randn(FFN, HIDDEN, generator=gen),
            "down": torch.randn(HIDDEN, FFN, generator=gen)}


def family() -> dict[str, dict[tuple[int, int], dict[str, torch.Tensor]]]:
    base = {(l, e): weights(l * EXPERTS + e) for l in range(LAYERS) for e in range(EXPERTS)}
    out = {"base": base}
    for i, (name, changed) in enumerate(CHANGED.items()):
        out[name] = {**base, **{key: weights(1000 + 10 * i + n) for n, key in enumerate(changed)}}
    return out


def expert(w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ w["gate"].T) * (x @ w["up"].T)) @ w["down"].T


@pytest.fixture(scope="module")
def api(cluster, kubectl):
    install_moeless(kubectl, NS)
    return config.new_client_from_config(config_file=str(cluster.kubeconfig))


@pytest.fixture(scope="module")
def models():
    return family()


@pytest.fixture(scope="module")
def host(tmp_path_factory, models):
    """One real expert host serving base, code and math (the fine-tunes' stores written over the base's)."""
    root = tmp_path_factory.mktemp("family")
    stores = {}
    for name, experts in models.items():
        stores[name] = export_experts(((l, e, w) for (l, e), w in sorted(experts.items())), root / name, model=name,
                                      num_layers=LAYERS, num_experts=EXPERTS, act="silu", base=stores.get("base"))
    assert not any(stores["base"].in_base(l, e) for l in range(LAYERS) for e in range(EXPERTS))
    assert sum(stores["math"].in_base(l, e) for l in range(LAYERS) for e in range(EXPERTS)) == LAYERS * EXPERTS - 2
    with launch_local_hosts(1, [(n, root / n) for n in models], keep_alive_s=600.0) as group:
        yield group


@pytest.fixture(scope="module")
def operator(cluster, api, tmp_path_factory):
    with operator_in_namespace(cluster, "finetunes", tmp_path_factory, NS) as running:
        yield running


def render(helm, models: list[dict], **hosts) -> list[dict]:
    values = {"serving": {"enabled": False}, "operator": {"enabled": False},
              "pool": {"enabled": True, "storage": {"hostPath": "/srv/models", "mountPath": "/models"},
                       "keepAliveSeconds": 300, "models": models,
                       "hosts": {"minHosts": 1, "maxHosts": 2, "gpusPerHost": 0, "memoryGiBPerHost": 1, **hosts}}}
    args = [str(helm), "template", "t", str(ROOT / "helm" / "moeless"), "--namespace", NS, "-f", "-"]
    result = subprocess.run(args, input=yaml.safe_dump(values), capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise AssertionError(result.stderr)
    return [d for d in yaml.safe_load_all(result.stdout) if d]


FAMILY = [{"name": "base", "store": "/models/base"}, {"name": "code", "store": "/models/code", "base": "base"},
          {"name": "math", "store": "/models/math", "base": "base"}]


def get(kubectl, kind: str, name: str) -> dict:
    return kubectl.json("get", kind, name, "-n", NS)


def condition(doc: dict, kind: str) -> dict:
    return next(c for c in doc["status"]["conditions"] if c["type"] == kind)


def test_the_chart_renders_a_base_and_two_fine_tunes_the_api_server_accepts(helm, api, kubectl):
    docs = render(helm, FAMILY)
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ExpertAutoscalingPolicy"}
    assert {n: p["spec"]["model"].get("base") for n, p in policies.items()} == {"base": None, "code": "base",
                                                                                 "math": "base"}
    assert {p["spec"]["pool"] for p in policies.values()} == {POOL}
    result = kubectl("apply", "--dry-run=server", "-n", NS, "-f", "-", stdin=yaml.safe_dump_all(docs))
    assert result.stdout.count("(server dry run)") == len(docs)
    # The chart refuses a base that is not one of its models; the API server refuses a base that is no name.
    bad = subprocess.run([str(helm), "template", "t", str(ROOT / "helm" / "moeless"), "--set", "pool.enabled=true",
                          "--set", "pool.models[0].name=code", "--set", "pool.models[0].store=/m",
                          "--set", "pool.models[0].base=nobody"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "pool.models[code].base: nobody is not a model of pool.models" in bad.stderr
    code = dict(policies["code"], spec={**policies["code"]["spec"], "model": {"store": "/m", "base": "a=b"}})
    refused = kubectl("apply", "--dry-run=server", "-n", NS, "-f", "-", stdin=yaml.safe_dump(code), check=False)
    assert refused.returncode != 0 and "spec.model.base" in refused.stderr


def test_the_pool_serves_the_family_holds_shared_experts_once_and_bills_each_model(helm, api, kubectl, host, models,
                                                                                   operator):
    metrics_port = int(host.metrics_urls[0].rsplit(":", 1)[1].split("/")[0])
    docs = render(helm, FAMILY, metricsPort=metrics_port, grpcPort=int(host.addresses[0].rsplit(":", 1)[1]))
    kubectl("apply", "-n", NS, "-f", "-", stdin=yaml.safe_dump_all(docs))
    # 1. The hosts serve the three stores, the base first (a shared expert's replica is the base's).
    sts = wait_for(lambda: get(kubectl, "statefulset", f"{POOL}-hosts"), what="the pool's StatefulSet")
    command = " ".join(sts["spec"]["template"]["spec"]["containers"][0]["command"])
    assert "--store base=/models/base --store code=/models/code --store math=/models/math" in command
    # 2. Every model computes on the real host: exact answers, the shared experts' replicas held once.
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(7))
    for name, experts in models.items():
        with ExpertHostClient(host.addresses[0], timeout_s=20, model=name) as c:
            for layer in range(LAYERS):
                out = c.invoke(layer, {e: x for e in range(EXPERTS)})
                for e in range(EXPERTS):
                    torch.testing.assert_close(out[e], expert(experts[(layer, e)], x))
    with ExpertHostClient(host.addresses[0], timeout_s=20) as c:
        status = c.status()
    resident = [r for r in status["replicas"] if r["bytes"] > 0]
    assert len(resident) == LAYERS * EXPERTS + 3  # the base's 8 and the 3 changed experts, not 3 x 8
    assert status["meters"]["shared_replicas"] == LAYERS * EXPERTS  # every base expert: one fine-tune at least kept it
    # 3. The pod is Ready at the real host: per-model GB·s and shared shares reach the pool and each policy.
    wait_for(lambda: get(kubectl, "pod", f"{POOL}-hosts-0"), what="the host pod")
    client.CoreV1Api(api).patch_namespaced_pod_status(f"{POOL}-hosts-0", NS, {"status": {
        "phase": "Running", "podIP": "127.0.0.1", "hostIP": "127.0.0.1",
        "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2024-01-01T00:00:00Z"}]}})
    pool = wait_for(lambda: (p := get(kubectl, "expertpool", POOL)).get("status", {}).get("sharedReplicas") and p,
                    what="the pool's meters")
    assert pool["status"]["sharedReplicas"] == LAYERS * EXPERTS and pool["status"]["modelCount"] == 3
    rows = {r["name"]: r for r in pool["status"]["models"]}
    assert {n: (r["admitted"], r.get("base")) for n, r in rows.items()} == \
        {"base": (True, None), "code": (True, "base"), "math": (True, "base")}
    assert all(0 < r["sharedExpertGBSeconds"] <= r["expertGBSeconds"] for r in rows.values())
    assert sum(r["expertGBSeconds"] for r in rows.values()) == pytest.approx(pool["status"]["cost"]["expertGBSeconds"],
                                                                           abs=len(rows) * 1e-9)
    for name in rows:
        policy = wait_for(lambda: (p := get(kubectl, "eap", name)).get("status", {}).get("cost", {})
                          .get("sharedExpertGBSeconds") and p, what=f"{name}'s shared GB·s")
        assert policy["status"]["cost"]["expertGBSeconds"] >= policy["status"]["cost"]["sharedExpertGBSeconds"] > 0
    header = kubectl("get", "eap", "-n", NS).stdout.splitlines()[0].split()
    assert header[header.index("EXPERT-GBS") + 1] == "SHARED-GBS"
    wide = kubectl("get", "eap", "-n", NS, "-o", "wide").stdout.splitlines()
    assert "BASE" in wide[0].split() and any(line.split()[0] == "code" and "base" in line.split()[1:] for line in wide)
    assert "SHARED" in kubectl("get", "epool", "-n", NS).stdout.splitlines()[0].split()


def test_a_fine_tune_whose_base_is_not_on_the_pool_is_refused_naming_it(helm, api, kubectl, operator):
    chat = next(d for d in render(helm, [*FAMILY, {"name": "chat", "store": "/models/chat", "base": "math"}])
                if d["kind"] == "ExpertAutoscalingPolicy" and d["metadata"]["name"] == "chat")
    chat["spec"]["model"]["base"] = "missing"
    kubectl("apply", "-n", NS, "-f", "-", stdin=yaml.safe_dump(chat))
    doc = wait_for(lambda: (p := get(kubectl, "eap", "chat")).get("status", {}).get("conditions") and p,
                   what="chat refused")
    ready = condition(doc, "Ready")
    assert ready["reason"] == "NotAdmitted" and "fine-tune 'chat' needs its base model 'missing'" in ready["message"]
    events = kubectl.json("get", "events", "-n", NS, "--field-selector", "involvedObject.name=chat")["items"]
    assert [e["type"] for e in events if e["reason"] == "NotAdmitted"] == ["Warning"]
    wait_for(lambda: condition(get(kubectl, "expertpool", POOL), "Degraded")["reason"] == "PolicyRefused",
             what="the pool naming the refused fine-tune")
    assert "chat=" not in " ".join(get(kubectl, "statefulset", f"{POOL}-hosts")["spec"]["template"]["spec"]
                                   ["containers"][0]["command"])
    kubectl("delete", "eap", "chat", "-n", NS)
