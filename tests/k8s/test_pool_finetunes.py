"""A base and its fine-tunes on one ExpertPool (pure; pool_spec.admit rule 4, pool_reconcile.py): a
fine-tune names its base (spec.model.base) and is admitted only beside it, the hosts list each base
before its fine-tunes, the pool sizes itself from the bytes its hosts hold (a shared replica once),
and each model's GB·s and its shared share add up to the pool's."""

from __future__ import annotations

import pytest

from moeless.controller.operator.actions import Emit, Scale
from moeless.controller.operator.meters import HostMeters, ModelMeters, Replica
from moeless.controller.operator.spec import GIB, SpecError, parse_spec

from test_pool_reconcile import POOL, T0, Cluster, member, of, pool


def finetune(name: str, created: str, base: str, **model) -> dict:
    policy = member(name, created)
    policy["spec"]["model"].update(base=base, **model)
    return policy


def family_cluster(*extra: dict) -> Cluster:
    """A base and two fine-tunes, the fine-tunes created first (a base created later still admits them)."""
    return Cluster(pool(), [finetune("code", "2026-01-01T00:00:00Z", "base"),
                            finetune("math", "2026-01-02T00:00:00Z", "base"),
                            member("base", "2026-01-03T00:00:00Z"), *extra])


def rows(cluster: Cluster) -> dict[str, dict]:
    return {row["name"]: row for row in cluster.pool["status"]["models"]}


def test_a_base_and_two_fine_tunes_are_admitted_and_the_hosts_list_the_base_first():
    cluster = family_cluster()
    cluster.step_pool(T0)
    assert {name: (row["admitted"], row.get("base")) for name, row in rows(cluster).items()} == \
        {"base": (True, None), "code": (True, "base"), "math": (True, "base")}
    command = cluster.command()
    assert command.index("--store base=/models/base") < command.index("--store code=/models/code") \
        < command.index("--store math=/models/math")
    assert cluster.pool["status"]["modelCount"] == 3
    assert not [c for c in cluster.pool["status"]["conditions"] if c["type"] == "Degraded" and c["status"] == "True"]


def test_a_fine_tune_without_its_base_on_the_pool_is_refused_naming_both():
    cluster = Cluster(pool(), [member("base", "2026-01-01T00:00:00Z"),
                               finetune("chat", "2026-01-02T00:00:00Z", "missing")])
    cluster.step_pool(T0)
    row = rows(cluster)["chat"]
    assert not row["admitted"]
    assert "fine-tune 'chat'" in row["message"] and "base model 'missing'" in row["message"]
    assert "no policy serves a model named 'missing'" in row["message"]
    assert "--store chat=" not in cluster.command()
    degraded = next(c for c in cluster.pool["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "PolicyRefused" and "chat:" in degraded["message"]
    # The policy itself says why, with a Warning event.
    actions = cluster.step_policy("chat", T0)
    ready = next(c for c in cluster.policies["chat"]["status"]["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "NotAdmitted") and "'missing'" in ready["message"]
    assert [e.reason for e in of(actions, Emit) if e.type == "Warning"] == ["NotAdmitted"]


def test_a_fine_tune_whose_base_is_on_another_pool_or_its_own_hosts_is_refused_saying_where():
    elsewhere = member("base", "2026-01-01T00:00:00Z")
    elsewhere["spec"]["pool"] = "other"
    cluster = Cluster(pool(), [elsewhere, finetune("code", "2026-01-02T00:00:00Z", "base")])
    cluster.step_pool(T0)
    assert "served on ExpertPool other" in rows(cluster)["code"]["message"]
    own = member("base", "2026-01-01T00:00:00Z")
    del own["spec"]["pool"]
    own["spec"]["model"] = {"store": "/models/base"}
    own["spec"]["hosts"] = {"image": "moeless:test", "maxHosts": 1}
    cluster = Cluster(pool(), [own, finetune("code", "2026-01-02T00:00:00Z", "base")])
    cluster.step_pool(T0)
    assert "hosts of its own" in rows(cluster)["code"]["message"]


def test_a_fine_tune_whose_base_was_refused_waits_for_it():
    cluster = Cluster(pool(), [member("base", "2026-01-01T00:00:00Z", guaranteed=5.0),  # 5 GiB > the hosts' 2
                               finetune("code", "2026-01-02T00:00:00Z", "base")])
    cluster.step_pool(T0)
    assert not rows(cluster)["base"]["admitted"] and "which refused it" in rows(cluster)["code"]["message"]


@pytest.mark.parametrize("model, error", [({"base": "b=c"}, "spec.model.base: 'b=c'"),
                                          ({"name": "x", "base": "x"}, "cannot be its own base")])
def test_a_bad_base_is_a_spec_error(model, error):
    with pytest.raises(SpecError, match=error):
        parse_spec({"pool": POOL, "model": {"store": "/m", **model}})


def test_a_base_needs_a_pool():
    with pytest.raises(SpecError, match="spec.model.base: only for a policy on an ExpertPool"):
        parse_spec({"model": {"store": "/m", "base": "b"}, "hosts": {"image": "i", "maxHosts": 1}})


def family_host(shared_gib: float, own_gib: float) -> HostMeters:
    """One host of the family: the base's replicas (shared_gib, every model uses them, held once) and
    each fine-tune's own (own_gib each); GB·s as the host splits them (expert_fn/host/meters.py)."""
    replicas = (Replica(0, 0, 10, shared_gib * GIB, "base"), Replica(0, 1, 5, own_gib * GIB, "code"),
                Replica(0, 2, 5, own_gib * GIB, "math"))
    split = {"base": (4.0, 4.0), "code": (5.0, 3.0), "math": (3.0, 1.0)}  # (GB·s, of which from shared replicas)
    models = {m: ModelMeters(gb_seconds=gb, tokens=10, bytes_held=shared_gib * GIB / 3 + (own_gib * GIB if m != "base"
                                                                                             else 0.0),
                             shared_gb_seconds=shared, shared_bytes=shared_gib * GIB)
              for m, (gb, shared) in split.items()}
    return HostMeters(gb_seconds=12.0, tokens=30, bytes_held=(shared_gib + 2 * own_gib) * GIB, ready=True,
                      replicas=replicas, models=models, shared_replicas=1)


def test_the_pool_sizes_itself_from_each_content_key_once():
    """1.2 GiB of the base's experts all three use and 0.2 GiB of each fine-tune's own: 1.6 GiB held, one
    host of 2 GiB at 0.8. Counting the base's bytes for each model (3 x 1.2 + 0.4 = 4 GiB) would ask for 3."""
    cluster = family_cluster()
    cluster.step_pool(T0)
    meters = {f"{POOL}-hosts-0": family_host(1.2, 0.2)}
    actions = cluster.step_pool(T0 + 60, meters)
    assert not of(actions, Scale) and cluster.pool["status"]["hostsDesired"] == 1
    assert cluster.pool["status"]["sharedReplicas"] == 1
    meters = {f"{POOL}-hosts-0": family_host(1.2, 0.4)}  # 2.0 GiB: a second host, after the upscale delay
    cluster.step_pool(T0 + 120, meters)
    cluster.step_pool(T0 + 160, meters)
    assert cluster.pool["status"]["hostsDesired"] == 2


def test_each_model_s_gb_s_and_shared_share_add_up_and_reach_its_policy():
    cluster = family_cluster()
    cluster.step_pool(T0)
    cluster.step_pool(T0 + 10, {f"{POOL}-hosts-0": family_host(1.2, 0.2)})
    by_model = rows(cluster)
    assert sum(r["expertGBSeconds"] for r in by_model.values()) == \
        pytest.approx(cluster.pool["status"]["cost"]["expertGBSeconds"]) == pytest.approx(12.0)
    assert {m: r["sharedExpertGBSeconds"] for m, r in by_model.items()} == {"base": 4.0, "code": 3.0, "math": 1.0}
    assert by_model["code"]["sharedBytes"] == pytest.approx(1.2 * GIB)
    for name in ("base", "code", "math"):
        cluster.step_policy(name, T0 + 10)
    costs = {name: cluster.policies[name]["status"]["cost"] for name in ("base", "code", "math")}
    assert {n: (c["expertGBSeconds"], c["sharedExpertGBSeconds"]) for n, c in costs.items()} == \
        {"base": (4.0, 4.0), "code": (5.0, 3.0), "math": (3.0, 1.0)}
