"""The ExpertPool's reconcile and the reconcile of a policy on a pool (pure; pool_reconcile.py,
reconcile.on_pool): who the pool admits, what its hosts run, per-model billing that adds up, a
policy refused naming the field, scale to zero and wake for every model at once."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from moeless.controller.operator import objects as obj
from moeless.controller.operator.actions import Configure, Create, Delete, Observed, Scale, Update
from moeless.controller.operator.meters import HostMeters, ModelMeters, Replica
from moeless.controller.operator.pool_reconcile import reconcile_pool
from moeless.controller.operator.reconcile import reconcile
from moeless.controller.operator.spec import GIB, SpecError, parse_spec

from fake_api import apply_actions

T0 = 1_700_000_000.0
POOL = "shared"


def pool(**spec) -> dict:
    body = {"hosts": {"image": "moeless:test", "minHosts": 1, "maxHosts": 4, "memoryGiBPerHost": 2},
            "storage": {"persistentVolumeClaim": "models", "mountPath": "/models"}, "keepAliveSeconds": 90}
    body.update(spec)
    return {"apiVersion": obj.API_VERSION, "kind": obj.POOL_KIND,
            "metadata": {"name": POOL, "namespace": "ml", "uid": "pool-uid", "generation": 1}, "spec": body}


def member(name: str, created: str, guaranteed: float = 0.0, model: str | None = None, warm: float = 0.0,
           **spec) -> dict:
    m = {"store": f"/models/{name}", "guaranteedGiB": guaranteed, "keepWarmGiB": warm}
    if model:
        m["name"] = model
    body = {"pool": POOL, "model": m, "serving": {"planner": "moeless"}, **spec}
    return {"apiVersion": obj.API_VERSION, "kind": obj.KIND,
            "metadata": {"name": name, "namespace": "ml", "uid": f"uid-{name}", "generation": 1,
                         "creationTimestamp": created}, "spec": body}


def host(tokens: dict[str, int], held_gib: dict[str, float], gb_s: dict[str, float]) -> HostMeters:
    models = {m: ModelMeters(gb_seconds=gb_s[m], tokens=tokens[m], bytes_held=held_gib[m] * GIB) for m in tokens}
    replicas = tuple(Replica(0, i, tokens[m], held_gib[m] * GIB, m) for i, m in enumerate(tokens))
    return HostMeters(gb_seconds=sum(gb_s.values()), tokens=sum(tokens.values()),
                      bytes_held=sum(held_gib.values()) * GIB, ready=True, replicas=replicas, models=models)


class Cluster:
    """The pool, its policies and the objects; applies actions as an API server would."""

    def __init__(self, the_pool: dict | None, policies: list[dict]) -> None:
        self.pool, self.policies, self.objects, self.events = the_pool, {p["metadata"]["name"]: p for p in policies}, {}, []

    def pods(self) -> list[dict]:
        sts = self.objects.get(("StatefulSet", f"{POOL}-hosts"))
        return [{"metadata": {"name": f"{POOL}-hosts-{i}", "uid": f"pod-{i}"},
                 "status": {"podIP": f"10.0.0.{i + 1}", "conditions": [{"type": "Ready", "status": "True"}]}}
                for i in range(sts["spec"]["replicas"] if sts else 0)]

    def observe(self, meters=None) -> Observed:
        return Observed(objects=copy.deepcopy(self.objects), pods=self.pods(), meters=meters or {},
                        pool=copy.deepcopy(self.pool), policies=copy.deepcopy(list(self.policies.values())))

    def step_pool(self, now: float, meters=None) -> list:
        actions = reconcile_pool(POOL, copy.deepcopy(self.pool), self.observe(meters), now)
        self._apply(actions, self.pool)
        return actions

    def step_policy(self, name: str, now: float, meters=None) -> list:
        actions = reconcile(name, copy.deepcopy(self.policies[name]), self.observe(meters), now)
        self._apply(actions, self.policies[name])
        return actions

    def _apply(self, actions: list, owner: dict) -> None:
        apply_actions(self.objects, owner, actions, self.events)

    def command(self) -> str:
        return " ".join(self.objects[("StatefulSet", f"{POOL}-hosts")]["spec"]["template"]["spec"]["containers"][0]["command"])


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def test_the_pool_serves_every_admitted_model_from_its_own_store_with_its_share():
    cluster = Cluster(pool(), [member("mixtral", "2026-01-01T00:00:00Z", 0.5), member("phi", "2026-01-02T00:00:00Z")])
    actions = cluster.step_pool(T0)
    assert {(a.obj["kind"], a.obj["metadata"]["name"]) for a in of(actions, Create)} == {
        ("StatefulSet", "shared-hosts"), ("Service", "shared-hosts")}
    command = cluster.command()
    assert "--store mixtral=/models/mixtral --store phi=/models/phi --share mixtral=0.536871" in command
    assert "--keep-alive-s 90" in command
    sts = cluster.objects[("StatefulSet", "shared-hosts")]
    template = sts["spec"]["template"]
    assert template["metadata"]["labels"][obj.POOL_LABEL] == POOL and obj.POLICY_LABEL not in template["metadata"]["labels"]
    assert sts["metadata"]["ownerReferences"][0]["kind"] == "ExpertPool"
    assert template["spec"]["volumes"][1]["persistentVolumeClaim"]["claimName"] == "models"
    assert template["spec"]["containers"][0]["volumeMounts"][1]["mountPath"] == "/models"
    status = cluster.pool["status"]
    assert status["modelCount"] == 2 and [r["name"] for r in status["models"]] == ["mixtral", "phi"]
    # Each policy owns its knobs and its resident set, not hosts.
    actions = cluster.step_policy("phi", T0 + 1)
    assert {a.obj["metadata"]["name"] for a in of(actions, Create)} == {"phi-serving", "phi-placement"}
    assert cluster.policies["phi"]["status"]["hostsDesired"] == 1


def test_a_new_keep_alive_reaches_the_running_hosts_without_rolling_them():
    cluster = Cluster(pool(), [member("mixtral", "2026-01-01T00:00:00Z")])
    cluster.step_pool(T0)
    template = copy.deepcopy(cluster.objects[("StatefulSet", "shared-hosts")]["spec"]["template"])
    running = {"shared-hosts-0": replace(host({"mixtral": 0}, {"mixtral": 0.0}, {"mixtral": 0.0}), keep_alive_s=90.0)}
    assert not of(cluster.step_pool(T0 + 1, running), Configure)  # the hosts run the pool's keep-alive
    cluster.pool["spec"]["keepAliveSeconds"] = 20
    actions = cluster.step_pool(T0 + 2, running)
    assert of(actions, Configure) == [Configure("shared-hosts-0", "10.0.0.1:50051", 20.0)]
    assert not of(actions, Update)  # the pods keep running: their template is not changed
    assert cluster.objects[("StatefulSet", "shared-hosts")]["spec"]["template"] == template
    # A host that says it runs 20 s is left alone; one that does not say (an older host) too.
    assert not of(cluster.step_pool(T0 + 3, {"shared-hosts-0": replace(running["shared-hosts-0"], keep_alive_s=20.0)}),
                  Configure)
    assert not of(cluster.step_pool(T0 + 4, {"shared-hosts-0": replace(running["shared-hosts-0"], keep_alive_s=None)}),
                  Configure)


def test_a_share_that_does_not_fit_and_a_name_taken_are_refused_naming_the_field():
    policies = [member("a", "2026-01-01T00:00:00Z", 1.5), member("b", "2026-01-02T00:00:00Z", 1.0),
                member("c", "2026-01-03T00:00:00Z", model="a"), member("d", "2026-01-04T00:00:00Z", 0.5)]
    cluster = Cluster(pool(), policies)
    cluster.step_pool(T0)
    rows = {r["policy"]: r for r in cluster.pool["status"]["models"]}
    assert [p for p, r in rows.items() if r["admitted"]] == ["a", "d"]  # d's 0.5 still fits beside a's 1.5
    assert rows["b"]["message"].startswith("spec.model.guaranteedGiB: 1 GiB does not fit")
    assert "at most 0.5 is left" in rows["b"]["message"]
    assert rows["c"]["message"].startswith("spec.model.name: model 'a' is served on ExpertPool shared by policy a")
    assert "--store a=/models/a --store d=/models/d" in cluster.command() and "/models/b" not in cluster.command()
    degraded = next(c for c in cluster.pool["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "PolicyRefused"
    # The refused policy says why, in its status and an Event, and gets no objects.
    actions = cluster.step_policy("b", T0 + 1)
    assert not of(actions, Create)
    ready = next(c for c in cluster.policies["b"]["status"]["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "NotAdmitted" and ready["message"] == rows["b"]["message"]
    assert ("b", "NotAdmitted", rows["b"]["message"]) in cluster.events


def test_keep_warm_sets_reach_the_hosts_and_one_that_does_not_fit_is_refused():
    cluster = Cluster(pool(), [member("a", "2026-01-01T00:00:00Z", warm=1.5), member("b", "2026-01-02T00:00:00Z", warm=0.25),
                               member("c", "2026-01-03T00:00:00Z", warm=0.5)])
    cluster.step_pool(T0)
    command = cluster.command()
    assert "--keep-warm a=1.61061 --keep-warm b=0.268435" in command
    assert "--store c=" not in command and "--keep-warm c=" not in command
    rows = {r["policy"]: r for r in cluster.pool["status"]["models"]}
    assert rows["c"]["admitted"] is False and rows["c"]["message"].startswith("spec.model.keepWarmGiB: 0.5 GiB does not fit")
    assert rows["a"]["keepWarmGiB"] == 1.5


def test_each_model_is_billed_its_own_gb_seconds_and_they_add_up_to_the_pool():
    cluster = Cluster(pool(), [member("mixtral", "2026-01-01T00:00:00Z"), member("phi", "2026-01-02T00:00:00Z")])
    cluster.step_pool(T0)
    cluster.step_pool(T0 + 10, {"shared-hosts-0": host({"mixtral": 30, "phi": 5}, {"mixtral": 0.4, "phi": 0.1},
                                                       {"mixtral": 4.0, "phi": 1.0})})
    cluster.step_pool(T0 + 20, {"shared-hosts-0": host({"mixtral": 60, "phi": 5}, {"mixtral": 0.4, "phi": 0.1},
                                                       {"mixtral": 10.0, "phi": 2.5})})
    status = cluster.pool["status"]
    rows = {r["name"]: r for r in status["models"]}
    assert rows["mixtral"]["expertGBSeconds"] == 10.0 and rows["phi"]["expertGBSeconds"] == 2.5
    assert status["cost"]["expertGBSeconds"] == sum(r["expertGBSeconds"] for r in rows.values()) == 12.5
    assert rows["mixtral"]["replicas"] == 1 and rows["phi"]["bytesHeld"] == 0.1 * GIB
    # A restarted host (new pod uid) counts from zero again, for the pool and each model.
    restarted = {"shared-hosts-0": host({"mixtral": 1, "phi": 0}, {"mixtral": 0.1, "phi": 0.0},
                                        {"mixtral": 0.5, "phi": 0.0})}
    cluster.pods = lambda: [{"metadata": {"name": "shared-hosts-0", "uid": "pod-0-new"},
                             "status": {"conditions": [{"type": "Ready", "status": "True"}]}}]
    cluster.step_pool(T0 + 30, restarted)
    rows = {r["name"]: r for r in cluster.pool["status"]["models"]}
    assert rows["mixtral"]["expertGBSeconds"] == 10.5 and cluster.pool["status"]["cost"]["expertGBSeconds"] == 13.0
    # Each policy's status shows its own row: kubectl get eap adds up to kubectl get epool.
    for name in ("mixtral", "phi"):
        cluster.step_policy(name, T0 + 31, restarted)
    billed = {n: p["status"]["cost"]["expertGBSeconds"] for n, p in cluster.policies.items()}
    assert billed == {"mixtral": 10.5, "phi": 2.5}
    assert sum(billed.values()) == cluster.pool["status"]["cost"]["expertGBSeconds"]
    assert cluster.policies["mixtral"]["status"]["replicas"] == 1  # its own model's replica only
    assert cluster.policies["phi"]["status"]["replicas"] == 0


def test_a_model_that_leaves_keeps_its_row_so_the_rows_still_add_up():
    cluster = Cluster(pool(), [member("mixtral", "2026-01-01T00:00:00Z"), member("phi", "2026-01-02T00:00:00Z")])
    cluster.step_pool(T0)
    cluster.step_pool(T0 + 10, {"shared-hosts-0": host({"mixtral": 3, "phi": 5}, {"mixtral": 0.4, "phi": 0.1},
                                                       {"mixtral": 4.0, "phi": 1.0})})
    del cluster.policies["phi"]
    actions = cluster.step_pool(T0 + 20, {"shared-hosts-0": host({"mixtral": 3, "phi": 5}, {"mixtral": 0.4, "phi": 0.0},
                                                                 {"mixtral": 6.0, "phi": 1.5})})
    assert "phi" not in cluster.command() and of(actions, Update)  # the hosts roll without its store
    rows = {r["name"]: r for r in cluster.pool["status"]["models"]}
    assert rows["phi"]["admitted"] is False and rows["phi"]["message"].startswith("left the pool")
    assert cluster.pool["status"]["cost"]["expertGBSeconds"] == sum(r["expertGBSeconds"] for r in rows.values()) == 7.5
    assert cluster.pool["status"]["modelCount"] == 1


def test_the_pool_sleeps_when_every_model_is_idle_and_wakes_on_its_annotation():
    cluster = Cluster(pool(scaleToZero={"enabled": True, "delaySeconds": 60}, prewarm={"hosts": 2}),
                      [member("mixtral", "2026-01-01T00:00:00Z"), member("phi", "2026-01-02T00:00:00Z")])
    cluster.step_pool(T0)
    assert cluster.objects[("StatefulSet", "shared-hosts")]["spec"]["replicas"] == 2
    busy = {"shared-hosts-0": host({"mixtral": 0, "phi": 9}, {"mixtral": 0.0, "phi": 0.1}, {"mixtral": 0.0, "phi": 1.0})}
    cluster.step_pool(T0 + 50, busy)  # phi's tokens keep the whole pool awake
    assert not of(cluster.step_pool(T0 + 100, busy), Scale)
    assert of(cluster.step_pool(T0 + 111, busy), Scale) == [Scale("shared-hosts", 0)]
    ready = next(c for c in cluster.pool["status"]["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "ScaledToZero"
    cluster.step_policy("mixtral", T0 + 112)
    assert next(c for c in cluster.policies["mixtral"]["status"]["conditions"]
                if c["type"] == "Ready")["reason"] == "ScaledToZero"
    cluster.pool["metadata"]["annotations"] = {obj.WAKE_ANNOTATION: "1700000200.000"}
    assert of(cluster.step_pool(T0 + 200), Scale) == [Scale("shared-hosts", 2)]
    assert cluster.pool["status"]["wokenBy"] == "1700000200.000"
    assert not of(cluster.step_pool(T0 + 205), Scale)  # acted on once
    # Its hosts take longer than the delay to start: the pool waits for them rather than sleep again.
    starting = cluster.pods
    cluster.pods = lambda: [{**p, "status": {"conditions": [{"type": "Ready", "status": "False"}]}} for p in starting()]
    assert Scale("shared-hosts", 0) not in of(cluster.step_pool(T0 + 300), Scale)  # (sized by memory: 2 -> 1)
    cluster.pods = starting  # Ready, and idle for the delay from then on: asleep again
    assert Scale("shared-hosts", 0) not in of(cluster.step_pool(T0 + 301), Scale)
    assert of(cluster.step_pool(T0 + 362), Scale) == [Scale("shared-hosts", 0)]


def test_a_policy_on_a_pool_refuses_host_fields_and_names_a_missing_pool():
    cluster = Cluster(None, [member("a", "2026-01-01T00:00:00Z", hosts={"image": "x", "maxHosts": 2})])
    cluster.step_policy("a", T0)
    ready = next(c for c in cluster.policies["a"]["status"]["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "InvalidSpec" and ready["message"].startswith("spec.hosts: a policy on an ExpertPool")
    cluster = Cluster(None, [member("a", "2026-01-01T00:00:00Z")])
    cluster.step_policy("a", T0)
    ready = next(c for c in cluster.policies["a"]["status"]["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "PoolNotFound" and "no ExpertPool shared" in ready["message"]


def test_a_policy_that_joins_a_pool_gives_up_its_own_hosts():
    own = member("a", "2026-01-01T00:00:00Z")
    own["spec"] = {"model": {"store": "/models/a"}, "hosts": {"image": "x", "maxHosts": 2}}
    cluster = Cluster(pool(), [own])
    cluster.step_policy("a", T0)
    assert ("StatefulSet", "a-hosts") in cluster.objects
    cluster.policies["a"]["spec"] = {"pool": POOL, "model": {"store": "/models/a"}}
    cluster.step_pool(T0 + 1)
    actions = cluster.step_policy("a", T0 + 2)
    assert set(of(actions, Delete)) == {Delete("StatefulSet", "a-hosts"), Delete("Service", "a-hosts")}
    assert "--store a=/models/a" in cluster.command()


def test_pool_fields_on_a_policy_with_hosts_of_its_own_are_refused():
    for key in ("name", "guaranteedGiB", "keepWarmGiB"):
        with pytest.raises(SpecError, match=f"spec.model.{key}: only for a policy on an ExpertPool"):
            parse_spec({"model": {"store": "/m", key: 1 if key != "name" else "x"}, "hosts": {"image": "i", "maxHosts": 1}})
    with pytest.raises(SpecError, match="spec.model.keepWarmGiB: -1 is negative"):
        parse_spec({"pool": POOL, "model": {"store": "/m", "keepWarmGiB": -1}})


def test_a_deleted_pool_deletes_its_hosts():
    cluster = Cluster(pool(), [member("a", "2026-01-01T00:00:00Z")])
    cluster.step_pool(T0)
    cluster.pool = None
    actions = cluster.step_pool(T0 + 1)
    assert set(of(actions, Delete)) == {Delete("StatefulSet", "shared-hosts"), Delete("Service", "shared-hosts")}
