"""The chart with the real helm 3.17.2: lint, template, server-side dry-run of every rendered object,
install and uninstall against the loopback API server.

KubeRay's RayService and the Prometheus Operator's ServiceMonitor are rendered and checked here,
but the API server cannot judge them (their CRDs are not installed offline): no dry-run for those.
"""

from __future__ import annotations

import importlib
import subprocess
from pathlib import Path

import pytest
import yaml

from moeless.controller.operator import objects
from moeless.controller.operator.actions import Create, Observed
from moeless.controller.operator.pool_reconcile import reconcile_pool
from moeless.controller.operator.pool_spec import parse_pool_spec
from moeless.controller.operator.spec import parse_spec

from k8s_support import ROOT, wait_for

CHART = ROOT / "helm" / "moeless"
NS = "helm-test"
pytestmark = pytest.mark.k8s


def helm_run(helm, *args: str, kubeconfig=None, check: bool = True) -> subprocess.CompletedProcess:
    env_args = ["--kubeconfig", str(kubeconfig)] if kubeconfig else []
    result = subprocess.run([str(helm), *args, *env_args], capture_output=True, text=True, timeout=120)
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)}: {result.stderr}")
    return result


def render(helm, *sets: str, values: Path | None = None) -> list[dict]:
    args = [a for s in sets for a in ("--set", s)] + (["-f", str(values)] if values else [])
    out = helm_run(helm, "template", "t", str(CHART), "--namespace", NS, *args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


POOL_VALUES = {"pool": {"enabled": True, "storage": {"hostPath": "/srv/models", "mountPath": "/models"},
                        "models": [{"name": "smollm", "store": "/models/smollm", "guaranteedGiB": 1},
                                   {"name": "mixtral-tiny", "store": "/models/mixtral-tiny", "model": "tiny:mixtral",
                                    "serving": {"planner": "static"}}]}}


@pytest.fixture
def pool_values(tmp_path) -> Path:
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump(POOL_VALUES))
    return path


def kinds(docs: list[dict]) -> list[str]:
    return sorted(d["kind"] for d in docs)


def pod_specs(docs: list[dict]) -> list[dict]:
    specs = [d["spec"]["template"]["spec"] for d in docs if d["kind"] == "Deployment"]
    for d in docs:
        if d["kind"] == "RayService":
            cluster = d["spec"]["rayClusterConfig"]
            specs += [cluster["headGroupSpec"]["template"]["spec"]]
            specs += [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]
    return specs


@pytest.mark.parametrize("sets", [(), ("serving.kuberay=true", "serviceMonitor.enabled=true"),
                                  ("policy.model.hostPath=/srv/store", "policy.scaleToZero.enabled=true"),
                                  ("pool.enabled=true", "serviceMonitor.enabled=true")])
def test_lint(helm, sets):
    args = [a for s in sets for a in ("--set", s)]
    result = helm_run(helm, "lint", "--strict", str(CHART), *args)
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout


def test_template_default_is_a_deployment_and_a_gpu_pool_policy(helm):
    docs = render(helm)
    assert kinds(docs) == ["ClusterRole", "ClusterRoleBinding", "Deployment", "Deployment", "ExpertAutoscalingPolicy",
                           "Role", "Role", "RoleBinding", "RoleBinding", "Service", "Service", "ServiceAccount",
                           "ServiceAccount"]
    # Serving follows the pool through the API server: it may read and watch pods and the policy in its namespace
    # and patch the policy (the wake annotation), nothing more.
    serving = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "t-moeless-serving")
    env = {e["name"]: e.get("value") for e in serving["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["MOELESS_EXPERT_HOSTS"] == f"k8s://{NS}/t:50051?slots=8"
    assert serving["spec"]["template"]["spec"]["serviceAccountName"] == "t-moeless-serving"
    role = next(d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "t-moeless-serving")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                             {"apiGroups": ["moeless.io"], "resources": ["expertautoscalingpolicies", "expertpools"],
                              "verbs": ["get", "list", "watch", "patch"]}]
    for spec in pod_specs(docs):  # non-root, read-only root filesystem everywhere
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert all(c["securityContext"]["readOnlyRootFilesystem"] for c in spec["containers"])
    policy = next(d for d in docs if d["kind"] == "ExpertAutoscalingPolicy")
    spec = parse_spec(policy["spec"])  # what the operator will accept
    assert spec.non_expert_deployment == "t-moeless-serving"
    # The pool the operator makes from it: GPUs requested, ready on /readyz, time to drain on SIGTERM.
    policy["metadata"].update(namespace=NS, uid="u")
    pod = objects.stateful_set(policy, spec, 1)["spec"]["template"]["spec"]
    host = pod["containers"][0]
    assert host["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert host["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # Liveness restarts a host only after a start-up window and a minute of misses (3 misses 5 s apart
    # restarted healthy hosts busy loading replicas on the node tier).
    assert host["startupProbe"]["httpGet"]["path"] == host["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert host["startupProbe"]["periodSeconds"] * host["startupProbe"]["failureThreshold"] >= 300
    assert host["livenessProbe"]["periodSeconds"] * host["livenessProbe"]["failureThreshold"] >= 60
    assert pod["terminationGracePeriodSeconds"] > spec.hosts.drain_seconds
    # The operator too: a busy node timed out its 1 s probes and restarted it over and over (the pool node tier).
    operator = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "t-moeless-operator")
    probes = operator["spec"]["template"]["spec"]["containers"][0]
    assert probes["startupProbe"]["periodSeconds"] * probes["startupProbe"]["failureThreshold"] >= 180
    assert probes["livenessProbe"]["timeoutSeconds"] >= 5
    assert probes["livenessProbe"]["periodSeconds"] * probes["livenessProbe"]["failureThreshold"] >= 60
    assert pod["securityContext"]["runAsNonRoot"] and host["securityContext"]["readOnlyRootFilesystem"]


def test_template_with_kuberay_and_service_monitors(helm):
    docs = render(helm, "serving.kuberay=true", "serviceMonitor.enabled=true")
    assert "RayService" in kinds(docs) and kinds(docs).count("Deployment") == 1  # the operator's only
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert sorted(m["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] for m in monitors) == \
        ["expert-host", "operator"]
    policy = next(d for d in docs if d["kind"] == "ExpertAutoscalingPolicy")
    assert "nonExpert" not in policy["spec"]
    ray = next(d for d in docs if d["kind"] == "RayService")
    app = yaml.safe_load(ray["spec"]["serveConfigV2"])["applications"][0]
    assert app["args"]["config"].endswith("config.yaml") and app["args"]["hosts"].startswith("k8s://")
    module, _, builder = app["import_path"].partition(":")  # Ray Serve calls it with the args dict
    assert builder == "app_from_args" and callable(getattr(importlib.import_module(module), builder))
    for spec in pod_specs(docs):
        assert spec["securityContext"]["runAsNonRoot"] is True


def test_serving_transport_reaches_the_command_and_the_ray_args_and_a_bad_one_is_refused(helm):
    def command(docs):
        serving = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "t-moeless-serving")
        return serving["spec"]["template"]["spec"]["containers"][0]["command"]

    assert command(render(helm))[-2:] == ["--transport", "auto"]
    assert command(render(helm, "serving.transport=tcp"))[-2:] == ["--transport", "tcp"]
    ray = next(d for d in render(helm, "serving.kuberay=true", "serving.transport=grpc") if d["kind"] == "RayService")
    assert yaml.safe_load(ray["spec"]["serveConfigV2"])["applications"][0]["args"]["transport"] == "grpc"
    bad = helm_run(helm, "template", "t", str(CHART), "--set", "serving.transport=rdma", check=False)
    assert bad.returncode != 0 and 'serving.transport: "rdma" is not one of auto, local, tcp, nixl, grpc' in bad.stderr


def serving_pod(docs: list[dict], name: str = "t-moeless-serving") -> dict:
    return next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == name)["spec"]["template"]["spec"]


def test_serving_gpus_are_requested_and_run_the_replicas_on_cuda_and_a_bad_count_is_refused(helm):
    from moeless.cli import build_parser
    from moeless.serving.config import config_from_args

    container = serving_pod(render(helm, "serving.gpus=1"))["containers"][0]
    assert container["resources"] == {"requests": {"cpu": "2", "memory": "4Gi", "nvidia.com/gpu": 1},
                                      "limits": {"memory": "8Gi", "nvidia.com/gpu": 1}}  # merged into serving.resources
    assert container["command"][-2:] == ["--device", "cuda"]
    assert build_parser().parse_args(container["command"][1:]).device == "cuda"  # the real CLI accepts it
    plain = serving_pod(render(helm))["containers"][0]  # gpus 0: on CPU, no GPU asked for
    assert "nvidia.com/gpu" not in str(plain["resources"]) and "--device" not in plain["command"]
    assert build_parser().parse_args(plain["command"][1:]).device == "cpu"
    # KubeRay: the workers run the replicas (the head has num-cpus 0), so they get the GPUs; the app its device.
    for gpus, device in ((2, "cuda"), (0, None)):
        ray = next(d for d in render(helm, "serving.kuberay=true", f"serving.gpus={gpus}") if d["kind"] == "RayService")
        args = yaml.safe_load(ray["spec"]["serveConfigV2"])["applications"][0]["args"]
        assert args.get("device") == device
        assert config_from_args({k: v for k, v in args.items() if k != "config"}).device == (device or "cpu")
        cluster = ray["spec"]["rayClusterConfig"]
        worker = cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]
        assert (worker["requests"].get("nvidia.com/gpu"), worker["limits"].get("nvidia.com/gpu")) == \
            ((gpus, gpus) if gpus else (None, None))
        assert "nvidia.com/gpu" not in str(cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"])
    for flag, value, shown in (("--set", "serving.gpus=-1", "-1"), ("--set-json", "serving.gpus=1.5", "1.5"),
                               ("--set", "serving.gpus=two", '"two"')):
        bad = helm_run(helm, "template", "t", str(CHART), flag, value, check=False)
        assert bad.returncode != 0 and f"serving.gpus: {shown} is not a whole number >= 0" in bad.stderr


def test_cuda_ipc_puts_serving_and_hosts_in_the_node_s_namespaces_and_needs_the_node_s_network(helm, pool_values):
    docs = render(helm, "serving.cudaIpc=true", "serving.hostNetwork=true", "policy.hosts.cudaIpc=true",
                  "policy.hosts.hostNetwork=true")
    pod = serving_pod(docs)
    assert (pod["hostNetwork"], pod["hostPID"], pod["hostIPC"]) == (True, True, True)
    # The node's /dev/shm (torch's CUDA IPC reference counters): no emptyDir over it.
    assert all(m["mountPath"] != "/dev/shm" for m in pod["containers"][0]["volumeMounts"])
    policy = next(d for d in docs if d["kind"] == "ExpertAutoscalingPolicy")
    policy["metadata"].update(namespace=NS, uid="u")
    host = objects.stateful_set(policy, parse_spec(policy["spec"]), 1)["spec"]["template"]["spec"]
    assert (host["hostNetwork"], host["hostPID"], host["hostIPC"]) == (True, True, True)
    plain = render(helm, "serving.hostNetwork=true", "policy.hosts.hostNetwork=true")
    assert not {"hostPID", "hostIPC"} & set(serving_pod(plain))
    assert {"name": "dshm", "mountPath": "/dev/shm"} in serving_pod(plain)["containers"][0]["volumeMounts"]
    pooled = render(helm, "pool.hosts.cudaIpc=true", "pool.hosts.hostNetwork=true", values=pool_values)
    assert parse_pool_spec(next(d for d in pooled if d["kind"] == "ExpertPool")["spec"]).hosts.cuda_ipc
    for sets, message in (
            (("serving.cudaIpc=true",), "serving.cudaIpc needs serving.hostNetwork"),
            (("policy.hosts.cudaIpc=true",), "policy.hosts.cudaIpc needs policy.hosts.hostNetwork"),
            (("pool.enabled=true", "pool.hosts.cudaIpc=true"), "pool.hosts.cudaIpc needs pool.hosts.hostNetwork"),
            (("serving.cudaIpc=true", "serving.hostNetwork=true", "serving.kuberay=true"),
             "serving.cudaIpc: the RayService does not run on the node's network")):
        bad = helm_run(helm, "template", "t", str(CHART), *[a for s in sets for a in ("--set", s)], check=False)
        assert bad.returncode != 0 and message in bad.stderr, (sets, bad.stderr)
        if "needs" in message:
            assert "hostNetwork=true too" in bad.stderr


def test_template_of_one_pool_for_several_models(helm, pool_values):
    """pool.enabled: an ExpertPool, a policy per model on it, a serving Deployment and Service per model that
    follows the pool's pods and addresses its model on the shared hosts; the operator admits both."""
    docs = render(helm, values=pool_values)
    assert kinds(docs).count("ExpertAutoscalingPolicy") == 2 and kinds(docs).count("ExpertPool") == 1
    pool = next(d for d in docs if d["kind"] == "ExpertPool")
    assert pool["metadata"]["name"] == "t-pool" and parse_pool_spec(pool["spec"]).host_path == "/srv/models"
    policies = [d for d in docs if d["kind"] == "ExpertAutoscalingPolicy"]
    for policy in policies:
        spec = parse_spec(policy["spec"])  # what the operator will accept
        assert spec.pool == "t-pool" and spec.non_expert_deployment == f"t-moeless-serving-{policy['metadata']['name']}"
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    for name, model_flag in (("smollm", []), ("mixtral-tiny", ["--model", "tiny:mixtral"])):
        container = deployments[f"t-moeless-serving-{name}"]["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["MOELESS_EXPERT_HOSTS"] == f"k8s://{NS}/{name}:50051?slots=8&pool=t-pool&model={name}"
        assert container["command"][container["command"].index("--transport") + 2:] == model_flag
        volumes = deployments[f"t-moeless-serving-{name}"]["spec"]["template"]["spec"]["volumes"]
        assert {"name": "knobs", "configMap": {"name": f"{name}-serving"}} in volumes
        service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == f"t-moeless-serving-{name}")
        assert service["spec"]["selector"]["moeless.io/serves"] == name
    assert "t-moeless-serving" not in deployments  # no single-model app beside them
    # What the operator makes of the rendered pool: hosts that serve both stores, the first one's share kept.
    for i, d in enumerate([pool, *policies]):
        d["metadata"].update(namespace=NS, uid=f"u{i}", creationTimestamp=f"2026-01-0{i + 1}T00:00:00Z")
    actions = reconcile_pool("t-pool", pool, Observed(policies=policies), 1_700_000_000.0)
    sts = next(a.obj for a in actions if isinstance(a, Create) and a.obj["kind"] == "StatefulSet")
    command = " ".join(sts["spec"]["template"]["spec"]["containers"][0]["command"])
    assert "--store smollm=/models/smollm --store mixtral-tiny=/models/mixtral-tiny --share smollm=1.07374" in command


FAMILY_VALUES = {"pool": {"enabled": True, "storage": {"hostPath": "/srv/models", "mountPath": "/models"},
                          "models": [{"name": "smollm", "store": "/models/smollm"},
                                     {"name": "code", "store": "/models/code", "base": "smollm", "model": "default+code"},
                                     {"name": "chat", "store": "/models/chat", "base": "smollm", "model": "default+chat"},
                                     {"name": "lora", "store": "/models/lora", "base": "smollm", "model": "default+lora",
                                      "ownEngine": True}]}}


def test_template_serves_a_base_and_its_fine_tunes_in_one_app(helm, tmp_path):
    """A fine-tune (base set) is served by its base's app, one engine for the family (serving/family.py):
    one Deployment running every member's --model, its pool address naming the hosts' names for the
    fine-tunes (&family=), a Service per model pointing there, the non-expert weights billed once (the
    base's policy); ownEngine keeps an app of its own. A fine-tune that cannot join is refused naming it."""
    path = tmp_path / "family.yaml"
    path.write_text(yaml.safe_dump(FAMILY_VALUES))
    docs = render(helm, values=path)
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    assert sorted(deployments) == ["t-moeless-operator", "t-moeless-serving-lora", "t-moeless-serving-smollm"]
    container = deployments["t-moeless-serving-smollm"]["spec"]["template"]["spec"]["containers"][0]
    command = container["command"][container["command"].index("--transport") + 2:]
    assert command == ["--model", "default", "--model", "default+code", "--model", "default+chat"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MOELESS_EXPERT_HOSTS"] == f"k8s://{NS}/smollm:50051?slots=8&pool=t-pool&model=smollm&family=code,chat"
    lora = deployments["t-moeless-serving-lora"]["spec"]["template"]["spec"]["containers"][0]
    assert lora["command"][-2:] == ["--model", "default+lora"]
    services = {d["metadata"]["name"]: d["spec"]["selector"]["moeless.io/serves"] for d in docs if d["kind"] == "Service"
                and d["metadata"]["name"].startswith("t-moeless-serving-")}
    assert services == {"t-moeless-serving-smollm": "smollm", "t-moeless-serving-code": "smollm",
                        "t-moeless-serving-chat": "smollm", "t-moeless-serving-lora": "lora"}
    billed = {d["metadata"]["name"]: parse_spec(d["spec"]).non_expert_deployment for d in docs
              if d["kind"] == "ExpertAutoscalingPolicy"}
    assert billed == {"smollm": "t-moeless-serving-smollm", "code": None, "chat": None, "lora": "t-moeless-serving-lora"}
    for models, words in (([{"name": "b", "store": "/b"}, {"name": "c", "store": "/c", "base": "b"}],
                           "pool.models[c].model: a fine-tune served in its base's app needs BASE+FINETUNE"),
                          ([{"name": "c", "store": "/c", "base": "x", "model": "default+c"}],
                           "pool.models[c].base: x is not a model of pool.models"),
                          ([{"name": "b", "store": "/b"}, {"name": "c", "store": "/c", "base": "b", "model": "default+c"},
                            {"name": "d", "store": "/d", "base": "c", "model": "default+d"}],
                           "pool.models[d]: its base c is itself a fine-tune; one engine serves a base and its own "
                           "fine-tunes only: set ownEngine: true")):
        path.write_text(yaml.safe_dump({"pool": {**FAMILY_VALUES["pool"], "models": models}}))
        bad = helm_run(helm, "template", "t", str(CHART), "-f", str(path), check=False)
        assert bad.returncode != 0 and words in bad.stderr


def test_every_rendered_object_passes_a_server_side_dry_run(helm, kubectl, pool_values):
    kubectl("apply", "-f", str(CHART / "crds"))
    for crd in ("expertautoscalingpolicies", "expertpools"):
        kubectl("wait", "--for=condition=Established", f"crd/{crd}.moeless.io", "--timeout=30s")
    kubectl("create", "namespace", NS, check=False)
    for sets, values in [((), None), (("policy.model.hostPath=/srv/store", "policy.scaleToZero.enabled=true",
                                       "operator.replicas=2", "policy.serving.planner=static",
                                       "policy.serving.predictor=history"), None),
                         (("serving.gpus=1", "serving.cudaIpc=true", "serving.hostNetwork=true",
                           "policy.hosts.cudaIpc=true", "policy.hosts.hostNetwork=true"), None),
                         (("pool.scaleToZero.enabled=true",), pool_values)]:
        docs = render(helm, *sets, values=values)
        result = kubectl("apply", "--dry-run=server", "-n", NS, "-f", "-", stdin=yaml.safe_dump_all(docs))
        assert result.stdout.count("(server dry run)") == len(docs)


def test_install_and_uninstall(helm, kubectl, cluster):
    helm_run(helm, "install", "demo", str(CHART), "--namespace", NS, "--create-namespace", kubeconfig=cluster.kubeconfig)
    assert "deployed" in helm_run(helm, "status", "demo", "-n", NS, kubeconfig=cluster.kubeconfig).stdout
    policy = kubectl.json("get", "eap", "demo", "-n", NS)
    assert policy["spec"]["hosts"]["gpusPerHost"] == 1 and policy["spec"]["hosts"]["image"] == "moeless:0.1.0"
    for kind, name in (("deployment", "demo-moeless-operator"), ("deployment", "demo-moeless-serving"),
                       ("service", "demo-moeless-serving"), ("serviceaccount", "demo-moeless-operator")):
        kubectl("get", kind, name, "-n", NS)
    helm_run(helm, "uninstall", "demo", "-n", NS, "--wait", kubeconfig=cluster.kubeconfig)
    wait_for(lambda: kubectl("get", "eap", "demo", "-n", NS, check=False).returncode != 0, what="policy removed")
    assert kubectl("get", "deployment", "-n", NS, "-o", "name").stdout.strip() == ""
    assert kubectl("get", "clusterrole", "demo-moeless-operator", check=False).returncode != 0
    kubectl("get", "crd", "expertautoscalingpolicies.moeless.io")  # helm keeps CRDs on uninstall
