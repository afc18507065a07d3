"""Serving follows the expert-host pool through a real API server, calling real expert-host processes.

Pods labelled as the policy's StatefulSet pods are created in the API server (no node: a test
marks one Ready through the status subresource, at the address of a real expert host serving a
tiny model's experts); a RemoteExecutor over a HostPool that follows KubePodSource runs forwards
the whole time. A pod that joins is called without restarting anything; a pod recreated at a new
address (a restarted StatefulSet pod) is reached there; a pod that starts terminating gets no new
call, while forwards running across every change equal the unmodified model's outputs. A pool at
zero is woken by the forward that finds it empty (controller/pool/wake.py): the policy gets the wake
annotation, the forward is held until a pod is Ready, then completes exactly. Serving talks to the
API server as a service account with the chart's serving Role (list and watch pods; get, list, watch
and patch policies): the RBAC a serving pod needs.
"""

from __future__ import annotations

import threading

import pytest
import torch
from kubernetes import client, config

from moeless.expert_fn.client.client import ExpertHostClient
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.model.tiny import tiny_model
from moeless.model.weight_store import export_experts
from moeless.serving.executor import RemoteExecutor
from moeless.serving.placement_source import PlacementSource
from moeless.controller.pool.kube import KubePodSource, KubePolicy
from moeless.controller.pool.sources import follow_pool
from moeless.controller.pool.wake import WAKE_ANNOTATION, Waker

from k8s_support import ROOT, account_with_role, service_account_kubeconfig, wait_for

pytestmark = pytest.mark.k8s
NS, POLICY, SLOTS = "pool", "tiny", 3
FINALIZER = "moeless.io/test-drain"  # holds a deleted pod in Terminating, as a draining host's grace period does


@pytest.fixture(scope="module")
def core(cluster, kubectl):
    kubectl("create", "namespace", NS)
    return client.CoreV1Api(config.new_client_from_config(config_file=str(cluster.kubeconfig)))


@pytest.fixture(scope="module")
def model_and_hosts(tmp_path_factory):
    """The tiny model and three real expert hosts over its exported experts (A, B, C)."""
    model = tiny_model("mixtral", 0)
    spec = model.spec
    root = tmp_path_factory.mktemp("tiny-store")
    export_experts(model.iter_experts(), root, model="tiny-mixtral", num_layers=spec.num_layers,
                   num_experts=spec.num_experts, act=spec.act)
    with launch_local_hosts(3, root, keep_alive_s=600.0, metrics=False) as group:
        yield model, group.addresses


@pytest.fixture(scope="module")
def reader_kubeconfig(cluster, core, tmp_path_factory):
    """A kubeconfig of service account pool-reader with the chart's serving Role: list and watch pods,
    and get, list, watch and patch policies (to follow maxHosts and wake a pool at zero)."""
    account_with_role(core, NS, "pool-reader", [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["moeless.io"], "resources": ["expertautoscalingpolicies"],
         "verbs": ["get", "list", "watch", "patch"]}])
    return service_account_kubeconfig(cluster, NS, "pool-reader", tmp_path_factory.mktemp("pool-reader") / "kubeconfig")


def create_pod(core, ordinal: int, address: str) -> None:
    """Pod POLICY-hosts-ORDINAL declaring `address`'s port as its grpc port, Ready at 127.0.0.1."""
    name, port = f"{POLICY}-hosts-{ordinal}", int(address.rpartition(":")[2])
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "finalizers": [FINALIZER],
                        "labels": {"moeless.io/policy": POLICY, "app.kubernetes.io/component": "expert-host"}},
           "spec": {"containers": [{"name": "expert-host", "image": "moeless:test",
                                    "ports": [{"name": "grpc", "containerPort": port}]}]}}
    wait_for(lambda: _try(core.create_namespaced_pod, NS, pod), what="pod creation (default service account)")
    core.patch_namespaced_pod_status(name, NS, {"status": {
        "phase": "Running", "podIP": "127.0.0.1",
        "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2024-01-01T00:00:00Z"}]}})


def delete_pods(core, *names: str) -> None:
    """Delete pods and let them go (their finalizer removed); wait until they are gone."""
    for name in names:
        core.delete_namespaced_pod(name, NS)
        core.patch_namespaced_pod(name, NS, {"metadata": {"finalizers": None}})
    wait_for(lambda: not {p.metadata.name for p in core.list_namespaced_pod(NS).items} & set(names), what="pods gone")


def _try(call, *args) -> bool:
    try:
        call(*args)
        return True
    except client.ApiException as err:
        if err.status == 403:  # the namespace's default service account is not there yet
            return False
        raise


def invocations(address: str) -> int:
    with ExpertHostClient(address, timeout_s=10) as c:
        return c.status()["meters"]["invocations"]


def test_a_running_executor_follows_pods_joining_restarting_and_draining(reader_kubeconfig, core, model_and_hosts):
    model, (a, b, c) = model_and_hosts
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    reference = model.forward(ids).logits
    model.drop_experts()
    spec = model.spec
    create_pod(core, 0, a)
    source = KubePodSource(NS, POLICY, port=1, slots=SLOTS, kubeconfig=str(reader_kubeconfig))
    pool, follower = follow_pool(source, lambda address: ExpertHostClient(address, timeout_s=30), period_s=0.1,
                                 retire_s=5.0)
    executor = RemoteExecutor(pool, PlacementSource.static(spec.num_layers, spec.num_experts, SLOTS))
    outputs, stop = [], threading.Event()

    def serve() -> None:  # forwards the whole time, across every change of the pool
        while not stop.is_set():
            outputs.append(model.forward(ids, executor=executor).logits)

    runner = threading.Thread(target=serve)
    try:
        assert pool.addresses() == {0: a}
        runner.start()
        wait_for(lambda: len(outputs) >= 2, what="forwards on pod 0 alone")
        # 1. Scale-out: pod 1 (host B) becomes Ready and is called, nothing restarted.
        create_pod(core, 1, b)
        wait_for(lambda: invocations(b) > 0, what="host B called after its pod joined")
        # 2. Pod 1 restarted at a new address (host C): C is called, B no more.
        delete_pods(core, f"{POLICY}-hosts-1")
        create_pod(core, 1, c)
        wait_for(lambda: pool.addresses() == {0: a, 1: c}, what="pod 1 re-resolved")
        seen_b = invocations(b)
        wait_for(lambda: invocations(c) > 0, what="host C called at pod 1's new address")
        # 3. Scale-in: pod 1 starts terminating (draining): no new call reaches it.
        core.delete_namespaced_pod(f"{POLICY}-hosts-1", NS)
        wait_for(lambda: pool.addresses() == {0: a}, what="pod 1 out of the pool")
        done, seen_c = len(outputs), invocations(c)
        wait_for(lambda: len(outputs) >= done + 3, what="forwards after the scale-in")
        assert invocations(c) <= seen_c + 1  # at most the one layer call in flight when the pod left
        assert invocations(b) == seen_b
    finally:
        stop.set()
        runner.join(30)
        follower.close()
        pool.close()
        delete_pods(core, *(p.metadata.name for p in core.list_namespaced_pod(NS).items))
    assert len(outputs) >= 8 and executor.dead_hosts == set()
    for logits in outputs:  # every forward, whatever the pool did meanwhile, equals the unmodified model's
        torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def policies(cluster, core, kubectl):
    """The policy CRD and policy POLICY (no operator: the test plays it)."""
    kubectl("apply", "-f", str(ROOT / "manifests" / "crd.yaml"))
    kubectl("wait", "--for=condition=Established", "crd/expertautoscalingpolicies.moeless.io", "--timeout=30s")
    api = client.CustomObjectsApi(core.api_client)
    api.create_namespaced_custom_object("moeless.io", "v1alpha1", NS, "expertautoscalingpolicies", {
        "apiVersion": "moeless.io/v1alpha1", "kind": "ExpertAutoscalingPolicy", "metadata": {"name": POLICY},
        "spec": {"model": {"store": "/models/store"},
                 "hosts": {"image": "moeless:test", "minHosts": 0, "maxHosts": SLOTS, "gpusPerHost": 0,
                           "memoryGiBPerHost": 1}}})
    return api


def test_a_forward_on_a_pool_at_zero_wakes_it_and_completes_exactly(reader_kubeconfig, core, policies,
                                                                   model_and_hosts):
    _, (a, _, _) = model_and_hosts
    model = tiny_model("mixtral", 0)  # the hosts' model, its experts not yet dropped (the other test dropped them)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    reference = model.forward(ids).logits
    model.drop_experts()
    spec = model.spec
    assert not core.list_namespaced_pod(NS).items  # the pool is at zero
    source = KubePodSource(NS, POLICY, port=1, slots=SLOTS, kubeconfig=str(reader_kubeconfig))
    pool, follower = follow_pool(source, lambda address: ExpertHostClient(address, timeout_s=30), period_s=0.1)
    waker = Waker(KubePolicy(NS, POLICY, str(reader_kubeconfig)), timeout_s=60.0, min_interval_s=1.0, poll_s=0.05)
    executor = RemoteExecutor(pool, PlacementSource.static(spec.num_layers, spec.num_experts, SLOTS), waker=waker)
    outputs: list = []
    request = threading.Thread(target=lambda: outputs.append(model.forward(ids, executor=executor).logits))

    def annotation() -> str | None:
        doc = policies.get_namespaced_custom_object("moeless.io", "v1alpha1", NS, "expertautoscalingpolicies", POLICY)
        return (doc["metadata"].get("annotations") or {}).get(WAKE_ANNOTATION)

    try:
        request.start()
        woken = wait_for(annotation, what="the policy's wake annotation, set by the forward")
        assert waker.waking and request.is_alive() and not outputs  # held, not failed
        create_pod(core, 0, a)  # the operator's work: a pod that turns Ready
        request.join(60)
        assert not request.is_alive()
    finally:
        follower.close()
        pool.close()
        delete_pods(core, *(p.metadata.name for p in core.list_namespaced_pod(NS).items))
    assert annotation() == woken and waker.writes == 1  # one write, though the forward polled many times
    assert waker.stats()["wakes"] == 1 and waker.last_wake_s > 0 and not waker.waking
    torch.testing.assert_close(outputs[0], reference, rtol=0, atol=1e-5)


def test_a_planning_loop_started_on_a_pool_at_zero_wakes_it_to_measure_the_profile(reader_kubeconfig, core, policies,
                                                                                  model_and_hosts):
    from moeless.controller.knobs import Knobs
    from moeless.controller.planning.actor import PlanLoop
    from moeless.controller.planning.settings import LoopSettings

    _, (a, _, _) = model_and_hosts
    spec = tiny_model("mixtral", 0).spec
    doc = policies.get_namespaced_custom_object("moeless.io", "v1alpha1", NS, "expertautoscalingpolicies", POLICY)
    before = (doc["metadata"].get("annotations") or {}).get(WAKE_ANNOTATION)
    if before:  # the operator's part: the last wake taken (else it is pending, and another write would not help)
        policies.patch_namespaced_custom_object_status("moeless.io", "v1alpha1", NS, "expertautoscalingpolicies",
                                                       POLICY, {"status": {"wokenBy": before}})
    assert not core.list_namespaced_pod(NS).items  # the pool is at zero
    pool = KubePodSource(NS, POLICY, port=1, slots=SLOTS, kubeconfig=str(reader_kubeconfig))
    settings = LoopSettings(pool=pool,
                            num_layers=spec.num_layers, num_experts=spec.num_experts, hidden_size=spec.hidden_size,
                            knobs=Knobs(predictor="off", distance=1), profile=None, board="unused", period_s=0.05,
                            pool_period_s=0.1, first_host_wait_s=60.0)
    loops: list = []
    starting = threading.Thread(target=lambda: loops.append(PlanLoop.__ray_metadata__.modified_class(settings)))

    def woken_anew() -> bool:
        doc = policies.get_namespaced_custom_object("moeless.io", "v1alpha1", NS, "expertautoscalingpolicies", POLICY)
        return (doc["metadata"].get("annotations") or {}).get(WAKE_ANNOTATION) not in (None, before)

    try:
        starting.start()
        wait_for(woken_anew, what="the wake annotation, set by the loop that needs a host to measure on")
        assert starting.is_alive() and not loops  # waiting, not failed
        create_pod(core, 0, a)
        starting.join(60)
        assert loops, "the loop did not start"
        profile, host_call_s = loops[0].profile()
        assert profile.source.startswith(f"expert host {a}") and host_call_s > 0
        wait_for(lambda: loops[0].state()["hosts_live"][0] and loops[0].state()["passes"] > 0, what="a pass")
    finally:
        if loops:
            loops[0].stop()
        delete_pods(core, *(p.metadata.name for p in core.list_namespaced_pod(NS).items))


def test_the_policy_s_serving_knobs_are_read_with_their_generation_and_the_applied_one_reported(reader_kubeconfig,
                                                                                                 policies):
    """What a serving pod's loop does with the serving ServiceAccount's rights (get and patch the policy)."""
    from moeless.controller.knobs import Knobs
    from moeless.controller.planning.knob_sources import APPLIED_ANNOTATION, PolicyKnobs, as_mapping

    source = PolicyKnobs(NS, POLICY, str(reader_kubeconfig))
    generation, _ = source.read()
    policies.patch_namespaced_custom_object("moeless.io", "v1alpha1", NS, "expertautoscalingpolicies", POLICY,
                                            {"spec": {"serving": {"memoryPrice": 0.5, "scaler": False}}})
    changed, doc = source.read()
    assert changed == generation + 1
    knobs = Knobs.from_mapping(as_mapping(doc))
    assert knobs.memory_price == 0.5 and knobs.scaler is False
    source.applied(changed)
    got = policies.get_namespaced_custom_object("moeless.io", "v1alpha1", NS, "expertautoscalingpolicies", POLICY)
    assert got["metadata"]["annotations"][APPLIED_ANNOTATION] == str(changed)
    assert got["metadata"]["generation"] == changed  # an annotation is not a spec change


def test_a_policy_s_max_hosts_raised_while_serving_adds_a_slot_the_next_placement_uses(reader_kubeconfig, core,
                                                                                      policies, model_and_hosts):
    """kubectl apply of a larger maxHosts: a running pool follower takes the new slot (the pod there
    was outside the slots until then), a placement over it calls it; lowered again, the slot goes
    and the placement still over it runs on the others. Every forward equals the unmodified model's."""
    from moeless.placement.types import Placement

    _, (a, b, c) = model_and_hosts
    model = tiny_model("mixtral", 0)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    reference = model.forward(ids).logits
    model.drop_experts()
    spec = model.spec

    def max_hosts(n: int) -> None:
        policies.patch_namespaced_custom_object("moeless.io", "v1alpha1", NS, "expertautoscalingpolicies", POLICY,
                                                {"spec": {"hosts": {"maxHosts": n}}})

    max_hosts(2)
    for ordinal, address in enumerate((a, b, c)):
        create_pod(core, ordinal, address)
    source = KubePodSource(NS, POLICY, port=1, slots=2, kubeconfig=str(reader_kubeconfig))
    pool, follower = follow_pool(source, lambda address: ExpertHostClient(address, timeout_s=30), period_s=0.1)
    placements = PlacementSource.static(spec.num_layers, spec.num_experts, 2)
    executor = RemoteExecutor(pool, placements)
    try:
        assert pool.slots == 2 and pool.addresses() == {0: a, 1: b}  # pod 2 is beyond maxHosts
        torch.testing.assert_close(model.forward(ids, executor=executor).logits, reference, rtol=0, atol=1e-5)
        seen_c = invocations(c)
        max_hosts(3)
        wait_for(lambda: pool.slots == 3 and pool.addresses() == {0: a, 1: b, 2: c}, what="the third slot")
        placements.set(Placement.static(spec.num_layers, spec.num_experts, 3))  # what the planning loop publishes
        torch.testing.assert_close(model.forward(ids, executor=executor).logits, reference, rtol=0, atol=1e-5)
        assert invocations(c) > seen_c
        max_hosts(2)
        wait_for(lambda: pool.slots == 2 and pool.addresses() == {0: a, 1: b}, what="back to two slots")
        seen_c = invocations(c)
        torch.testing.assert_close(model.forward(ids, executor=executor).logits, reference, rtol=0, atol=1e-5)
        assert invocations(c) == seen_c and executor.dead_hosts == set()  # slot 2 evacuated, not a failure
    finally:
        max_hosts(SLOTS)
        follower.close()
        pool.close()
        delete_pods(core, *(p.metadata.name for p in core.list_namespaced_pod(NS).items))
