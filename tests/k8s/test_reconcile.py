"""The operator's reconcile on a fake clock: assert the actions (no API server).

A small in-memory cluster applies the actions, so each test walks a policy through time the way
the shell would: observe, reconcile, apply.
"""

from __future__ import annotations

import copy

import pytest

from moeless.controller.operator import objects as obj
from moeless.controller.operator.meters import HostMeters, Replica
from moeless.controller.operator.actions import Create, Delete, Emit, Observed, Scale, Update, UpdateStatus
from moeless.controller.operator.reconcile import reconcile

from fake_api import apply_actions
from moeless.controller.operator.spec import GIB

T0 = 1_700_000_000.0
NAME = "mix"


def policy(**spec_overrides) -> dict:
    spec = {"model": {"store": "/models/store"},
            "hosts": {"image": "moeless:test", "minHosts": 1, "maxHosts": 4, "memoryGiBPerHost": 1},
            "serving": {"keepAliveSeconds": 120}, "upscaleDelaySeconds": 30}
    spec.update(spec_overrides)
    return {"apiVersion": obj.API_VERSION, "kind": obj.KIND,
            "metadata": {"name": NAME, "namespace": "ml", "uid": "uid-1", "generation": 1}, "spec": spec}


class Cluster:
    """Objects by (kind, name) plus the policy; applies actions as an API server would."""

    def __init__(self, pol: dict | None) -> None:
        self.policy, self.objects, self.events = pol, {}, []

    def observe(self, meters: dict[str, HostMeters] | None = None, serving_ready: int | None = None) -> Observed:
        sts = self.objects.get(("StatefulSet", f"{NAME}-hosts"))
        n = sts["spec"]["replicas"] if sts else 0
        pods = [{"metadata": {"name": f"{NAME}-hosts-{i}", "uid": f"pod-{i}"},
                 "status": {"conditions": [{"type": "Ready", "status": "True"}]}} for i in range(n)]
        return Observed(objects=copy.deepcopy(self.objects), pods=pods, meters=meters or {}, serving_ready=serving_ready)

    def step(self, now: float, meters: dict[str, HostMeters] | None = None, serving_ready: int | None = None) -> list:
        actions = reconcile(NAME, copy.deepcopy(self.policy), self.observe(meters, serving_ready), now)
        emitted: list = []
        apply_actions(self.objects, self.policy, actions, emitted)
        self.events += [reason for _, reason, _ in emitted]
        return actions

    @property
    def hosts(self) -> int:
        return self.objects[("StatefulSet", f"{NAME}-hosts")]["spec"]["replicas"]


def busy(hosts: int, held_gib: float, tokens: int = 100) -> dict[str, HostMeters]:
    """Every host holding held_gib / hosts and having computed `tokens` more tokens."""
    return {f"{NAME}-hosts-{i}": HostMeters(gb_seconds=10.0, tokens=tokens, bytes_held=held_gib * GIB / hosts,
                                            memory_bytes=GIB, ready=True,
                                            replicas=(Replica(0, i, tokens, held_gib * GIB / hosts),))
            for i in range(hosts)}


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def test_create_makes_the_pool_and_its_configuration():
    cluster = Cluster(policy(prewarm={"hosts": 2}))
    actions = cluster.step(T0)
    created = {(a.obj["kind"], a.obj["metadata"]["name"]) for a in of(actions, Create)}
    assert created == {("StatefulSet", "mix-hosts"), ("Service", "mix-hosts"),
                       ("ConfigMap", "mix-serving"), ("ConfigMap", "mix-placement")}
    assert cluster.hosts == 2  # prewarm.hosts over minHosts 1
    for created_obj in cluster.objects.values():
        assert created_obj["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert "keepAliveSeconds: 120" in cluster.objects[("ConfigMap", "mix-serving")]["data"]["config.yaml"]
    assert [e.reason for e in of(actions, Emit)] == ["Created"]
    status = cluster.policy["status"]
    assert status["hostsDesired"] == 2 and status["observedGeneration"] == 1
    # The next pass finds everything in place: no create, no scale.
    again = cluster.step(T0 + 5)
    assert not of(again, Create) and not of(again, Scale) and not of(again, Update)


def test_scale_out_waits_for_the_upscale_delay():
    cluster = Cluster(policy())
    cluster.step(T0)
    assert cluster.hosts == 1
    # 2.4 GiB resident on 1 GiB hosts at 80%: 3 hosts needed.
    assert not of(cluster.step(T0 + 10, busy(1, 2.4)), Scale)
    assert cluster.policy["status"]["pendingScale"]["hosts"] == 3
    assert not of(cluster.step(T0 + 39, busy(1, 2.4, tokens=200)), Scale)
    actions = cluster.step(T0 + 41, busy(1, 2.4, tokens=300))
    assert of(actions, Scale) == [Scale("mix-hosts", 3)]
    assert "ScaledOut" in cluster.events and "pendingScale" not in cluster.policy["status"]


def test_scale_in_only_after_keep_alive():
    cluster = Cluster(policy(hosts={"image": "moeless:test", "minHosts": 1, "maxHosts": 4, "memoryGiBPerHost": 1},
                             upscaleDelaySeconds=0))
    cluster.step(T0)
    cluster.step(T0 + 1, busy(1, 2.4))
    assert cluster.hosts == 3
    # Replicas expired: 0.5 GiB left needs one host, but keep-alive (120 s) must pass first.
    light = busy(3, 0.5, tokens=400)
    assert not of(cluster.step(T0 + 10, light), Scale)
    assert not of(cluster.step(T0 + 129, light), Scale)
    assert of(cluster.step(T0 + 131, light), Scale) == [Scale("mix-hosts", 1)]
    assert cluster.events[-1] == "ScaledIn"


def test_a_change_of_direction_restarts_the_wait():
    cluster = Cluster(policy(hosts={"image": "moeless:test", "minHosts": 2, "maxHosts": 4, "memoryGiBPerHost": 1}))
    cluster.step(T0)
    cluster.step(T0 + 10, busy(2, 3.0))  # wants 4: waits from T0+10
    cluster.step(T0 + 20, busy(2, 0.1, tokens=200))  # wants 2 again: nothing pending
    assert "pendingScale" not in cluster.policy["status"]
    cluster.step(T0 + 30, busy(2, 3.0, tokens=300))  # wants 4 again: waits from T0+30
    assert not of(cluster.step(T0 + 45, busy(2, 3.0, tokens=400)), Scale)
    assert of(cluster.step(T0 + 61, busy(2, 3.0, tokens=500)), Scale) == [Scale("mix-hosts", 4)]


def test_scale_to_zero_and_back():
    cluster = Cluster(policy(scaleToZero={"enabled": True, "delaySeconds": 60}, prewarm={"hosts": 2}))
    cluster.step(T0)
    assert cluster.hosts == 2
    cluster.step(T0 + 30, busy(2, 0.2, tokens=5))  # a token at T0+30
    assert not of(cluster.step(T0 + 80, busy(2, 0.2, tokens=5)), Scale)  # idle 50 s
    actions = cluster.step(T0 + 91, busy(2, 0.2, tokens=5))  # idle 61 s
    assert of(actions, Scale) == [Scale("mix-hosts", 0)]
    status = cluster.policy["status"]
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "ScaledToZero" and status["hostsDesired"] == 0
    assert not of(cluster.step(T0 + 500), Scale)  # stays at zero
    # A request arrives: the serving side sets the wake annotation; hosts come back pre-warmed, at once.
    cluster.policy["metadata"]["annotations"] = {obj.WAKE_ANNOTATION: "2023-11-14T22:21:00Z"}
    actions = cluster.step(T0 + 600)
    assert of(actions, Scale) == [Scale("mix-hosts", 2)] and cluster.events[-1] == "Woke"
    # The same annotation does not wake it twice: once idle again it goes back to zero.
    assert of(cluster.step(T0 + 661), Scale) == [Scale("mix-hosts", 0)]


def test_policy_deleted_removes_only_what_it_owned():
    cluster = Cluster(policy())
    cluster.step(T0)
    foreign = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "mix-notes", "labels": {obj.POLICY_LABEL: NAME}}}
    cluster.objects[("ConfigMap", "mix-notes")] = foreign
    cluster.policy = None
    actions = cluster.step(T0 + 5)
    assert sorted(actions, key=repr) == sorted([Delete("StatefulSet", "mix-hosts"), Delete("Service", "mix-hosts"),
                                               Delete("ConfigMap", "mix-serving"), Delete("ConfigMap", "mix-placement")],
                                              key=repr)
    assert list(cluster.objects) == [("ConfigMap", "mix-notes")]


def test_an_object_that_is_not_ours_is_left_alone():
    cluster = Cluster(policy())
    theirs = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "mix-serving"}, "data": {"config.yaml": "x"}}
    cluster.objects[("ConfigMap", "mix-serving")] = copy.deepcopy(theirs)
    actions = cluster.step(T0)
    assert all(getattr(a, "name", None) != "mix-serving" for a in actions)
    assert all(a.obj["metadata"]["name"] != "mix-serving" for a in of(actions, Create))
    assert cluster.objects[("ConfigMap", "mix-serving")] == theirs
    degraded = next(c for c in cluster.policy["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "NameConflict" and "ConfigMap mix-serving" in degraded["message"]
    assert cluster.events.count("NameConflict") == 1
    cluster.step(T0 + 5)
    assert cluster.events.count("NameConflict") == 1  # said once, not every pass


@pytest.mark.parametrize("serving, hosts, field", [
    ({"planner": "nope"}, {}, "spec.serving: planner"),
    ({"keepAlive": 3}, {}, "spec.serving: unknown key 'keepAlive'"),
    ({}, {"minHosts": 5}, "spec.hosts.minHosts"),
])
def test_invalid_spec_is_reported_and_nothing_is_touched(serving, hosts, field):
    pol = policy(serving=serving, hosts={"image": "moeless:test", "maxHosts": 4, **hosts})
    cluster = Cluster(pol)
    actions = cluster.step(T0)
    assert {type(a) for a in actions} == {Emit, UpdateStatus} and not cluster.objects
    degraded = next(c for c in cluster.policy["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "InvalidSpec" and field in degraded["message"]
    assert of(actions, Emit)[0].type == "Warning" and field in of(actions, Emit)[0].message
    assert cluster.step(T0 + 5) == []  # no repeated Event, no status churn


def test_a_spec_change_updates_the_pod_template_and_the_serving_config():
    cluster = Cluster(policy())
    cluster.step(T0)
    cluster.policy["spec"]["hosts"]["image"] = "moeless:v2"
    cluster.policy["spec"]["serving"] = {"planner": "static", "keepAliveSeconds": 120}
    cluster.policy["metadata"]["generation"] = 2
    actions = cluster.step(T0 + 5)
    updated = {(a.kind, a.name) for a in of(actions, Update)}
    assert updated == {("StatefulSet", "mix-hosts"), ("ConfigMap", "mix-serving")}
    sts = cluster.objects[("StatefulSet", "mix-hosts")]
    assert sts["spec"]["template"]["spec"]["containers"][0]["image"] == "moeless:v2"
    assert "planner: static" in cluster.objects[("ConfigMap", "mix-serving")]["data"]["config.yaml"]
    assert cluster.policy["status"]["observedGeneration"] == 2


def test_a_keep_alive_change_alone_does_not_roll_the_hosts():
    """The serving pods' loop sets the hosts' keep-alive live (Configure); restarting the hosts would
    drop every resident replica for a knob. The serving config still changes."""
    cluster = Cluster(policy())
    cluster.step(T0)
    cluster.policy["spec"]["serving"] = {"keepAliveSeconds": 30}
    actions = cluster.step(T0 + 5)
    assert {(a.kind, a.name) for a in of(actions, Update)} == {("ConfigMap", "mix-serving")}
    cluster.policy["spec"]["hosts"]["cpu"] = "2"  # any other change rolls them, with the keep-alive of now
    actions = cluster.step(T0 + 10)
    assert ("StatefulSet", "mix-hosts") in {(a.kind, a.name) for a in of(actions, Update)}
    assert "--keep-alive-s 30" in " ".join(
        cluster.objects[("StatefulSet", "mix-hosts")]["spec"]["template"]["spec"]["containers"][0]["command"])


def test_turning_cuda_ipc_on_rolls_the_hosts_into_the_node_s_namespaces():
    cluster = Cluster(policy(hosts={"image": "moeless:test", "minHosts": 1, "maxHosts": 4, "memoryGiBPerHost": 1,
                                    "hostNetwork": True}))
    cluster.step(T0)
    before = cluster.objects[("StatefulSet", "mix-hosts")]["metadata"]["annotations"][obj.TEMPLATE_HASH]
    cluster.policy["spec"]["hosts"]["cudaIpc"] = True
    actions = cluster.step(T0 + 5)
    assert {(a.kind, a.name) for a in of(actions, Update)} == {("StatefulSet", "mix-hosts")}
    sts = cluster.objects[("StatefulSet", "mix-hosts")]
    assert sts["metadata"]["annotations"][obj.TEMPLATE_HASH] != before
    assert sts["spec"]["template"]["spec"]["hostPID"] is sts["spec"]["template"]["spec"]["hostIPC"] is True


def test_meters_add_what_is_new_and_survive_a_host_restart():
    cluster = Cluster(policy())
    cluster.step(T0)
    pod = f"{NAME}-hosts-0"
    cluster.step(T0 + 5, {pod: HostMeters(gb_seconds=4.0, cold_starts=2, tokens=10)})
    cluster.step(T0 + 10, {pod: HostMeters(gb_seconds=6.5, cold_starts=3, tokens=20)})
    status = cluster.policy["status"]
    assert status["cost"]["expertGBSeconds"] == 6.5 and status["coldStarts"] == 3
    # The host restarted (its counters start again from zero): what it counts now adds on top.
    cluster.step(T0 + 15, {pod: HostMeters(gb_seconds=1.0, cold_starts=1, tokens=5)})
    status = cluster.policy["status"]
    assert status["cost"]["expertGBSeconds"] == 7.5 and status["coldStarts"] == 4
    assert status["meters"][pod]["gbSeconds"] == 1.0


def test_layer_cv_and_replicas_in_status():
    cluster = Cluster(policy())
    cluster.step(T0)
    meters = {f"{NAME}-hosts-0": HostMeters(tokens=40, bytes_held=2.0, replicas=(
        Replica(0, 0, 30, 1.0), Replica(0, 1, 10, 1.0), Replica(1, 0, 20, 1.0), Replica(1, 1, 20, 1.0),
        Replica(1, 2, 5, 0.0)))}  # an evicted replica: not resident, not counted
    cluster.step(T0 + 5, meters)
    status = cluster.policy["status"]
    assert status["replicas"] == 4
    assert status["layerCV"] == {"p50": 0.25, "p95": 0.475}  # CVs 0.5 and 0.0
    placement = cluster.objects[("ConfigMap", "mix-placement")]["data"]["resident.json"]
    assert '"replicas": 4' in placement and status["lastPlanTime"]


def test_non_expert_cost_bills_ready_serving_replicas_over_time():
    cluster = Cluster(policy(nonExpert={"deployment": "serve", "memoryGiBPerReplica": 0.5}))
    cluster.step(T0, serving_ready=2)  # the first pass starts the clock
    cluster.step(T0 + 10, serving_ready=2)
    cluster.step(T0 + 15, serving_ready=0)
    # 2 replicas x 0.5 GiB (0.537 GB) x 10 s; nothing while none is ready.
    assert cluster.policy["status"]["cost"]["nonExpertGBSeconds"] == pytest.approx(2 * 0.5 * GIB / 1e9 * 10)


def test_the_generation_the_serving_pods_applied_is_shown_in_status():
    cluster = Cluster(policy())
    cluster.step(T0)
    assert "servingGeneration" not in cluster.policy["status"]
    cluster.policy["metadata"]["annotations"] = {obj.SERVING_GENERATION_ANNOTATION: "1"}  # the serving pods' loop
    cluster.step(T0 + 5)
    assert cluster.policy["status"]["servingGeneration"] == 1
    cluster.policy["metadata"]["annotations"] = {obj.SERVING_GENERATION_ANNOTATION: "not a number"}
    cluster.step(T0 + 10)
    assert cluster.policy["status"]["servingGeneration"] == 1  # a garbled annotation changes nothing
