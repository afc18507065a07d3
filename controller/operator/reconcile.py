"""The operator's reconcile of one policy: (policy, observed objects, meters, clock) -> actions. Pure.

Level-triggered: every call compares what the policy wants with what exists, whatever happened
before, so a missed watch event, an operator restart or an API-server restart loses nothing. What
must survive between calls (pending scale steps, last activity, meter readings) lives in the
policy's status, not in the operator's memory.

Steps of reconcile():
1. Policy gone: delete what it owned (the garbage collector would too; this also covers a
   cluster without one).
2. Spec invalid: report it (status Degraded/InvalidSpec and an Event); touch nothing else.
   A policy on an ExpertPool (spec.pool) goes on in on_pool() below.
3. Meters: add each host's new GB·s, cold starts and tokens to the totals; tokens or the wake
   annotation mark the pool active.
4. Scale: decide the pool's size (scaling.decide_hosts); create or scale the StatefulSet.
5. Owned objects: create what is missing, update what differs; an object with our name that the
   policy does not own is never touched (Degraded/NameConflict).
6. Status.

on_pool(): the pool's reconcile (pool_reconcile.py) sizes the hosts and meters every model; the
policy owns its serving and placement ConfigMaps, and its status shows the pool's hosts and its
own model's replicas, cold starts, GB·s and the part of them from replicas it shares with other
models, e.g. a fine-tune's with its base (copied from the pool's status, so that the models' add up
to the pool's), or why the pool did not admit it (a fine-tune whose base is not on the pool, too).
"""

from __future__ import annotations

from moeless.controller.operator import objects as obj
from moeless.controller.operator.actions import (Action, Delete, Observed, UpdateStatus, conflicts, degraded,
                                                 delete_owned, hosts_readiness, invalid, meter_increases, pod_ready,
                                                 rfc3339, scale_hosts, scale_status, seconds, set_conditions,
                                                 sync_objects, take_wake)
from moeless.controller.operator.meters import layer_cv_percentiles, resident
from moeless.controller.operator.pool_spec import admit, member_of, parse_pool_spec
from moeless.controller.operator.spec import GIB, PolicySpec, SpecError, parse_spec


def reconcile(policy_name: str, policy: dict | None, observed: Observed, now: float) -> list[Action]:
    """Actions that bring the cluster to what the policy wants (see the module docstring)."""
    # 1. Policy gone (or going): delete what it owned by name.
    if policy is None or policy["metadata"].get("deletionTimestamp"):
        return delete_owned(policy_name, observed)
    old, status = policy.get("status") or {}, dict(policy.get("status") or {})
    generation = policy["metadata"].get("generation")
    # 2. Invalid spec: say so, change nothing.
    try:
        spec = parse_spec(policy.get("spec"))
    except SpecError as err:
        return invalid(status, generation, str(err), now)
    if spec.pool is not None:
        return on_pool(policy_name, policy, spec, observed, now)
    # 3. Meters.
    added, readings = meter_increases(status.get("meters") or {}, observed.pods, observed.meters)
    cost = _cost(status)
    cost["expertGBSeconds"] += added.get("gbSeconds", 0.0)
    _bill_non_expert(spec, status, cost, observed, now)
    inflight = sum(m.inflight for m in observed.meters.values())
    active = take_wake(policy, status) or added.get("tokens", 0) + inflight > 0
    status.update(meters=readings, cost=_rounded(cost), coldStarts=int(status.get("coldStarts") or 0) +
                  int(added.get("coldStarts", 0)), meterTime=rfc3339(now))
    # 4. Scale.
    conflicted = conflicts(policy, observed)
    actions, decision, last_active = scale_hosts(spec, policy, status, observed, active, now, conflicted)
    # 5. Owned objects (the StatefulSet is created at its decided size, then only scaled).
    resident_set = _resident_set(observed)
    roles = obj.names(policy_name)
    desired = {
        roles["hosts"]: obj.stateful_set(policy, spec, decision.hosts),
        roles["service"]: obj.service(policy, spec),
        roles["serving"]: obj.serving_config_map(policy, spec),
        roles["placement"]: obj.placement_config_map(policy, resident_set),
    }
    synced, changed = sync_objects(desired, observed, conflicted)
    actions = synced + actions
    # 6. Status.
    ready = sum(pod_ready(p) for p in observed.pods)
    status.update(observedGeneration=generation, hostsReady=ready,
                  replicas=sum(len(v) for v in resident_set.values()))
    scale_status(status, decision, last_active)
    _serving_status(policy, status, observed, changed, roles, None, now)
    readiness = hosts_readiness(decision.hosts, ready, "the next token or the wake annotation starts them")
    actions += set_conditions(status, readiness, degraded(conflicted, observed), now, old)
    if status != old:
        actions.append(UpdateStatus(status))
    return actions


def on_pool(policy_name: str, policy: dict, spec: PolicySpec, observed: Observed, now: float) -> list[Action]:
    """A policy whose model is served on ExpertPool spec.pool (the module docstring)."""
    old, status = policy.get("status") or {}, dict(policy.get("status") or {})
    generation = policy["metadata"].get("generation")
    pool = observed.pool
    if pool is None or pool["metadata"].get("deletionTimestamp"):
        return invalid(status, generation, f"spec.pool: no ExpertPool {spec.pool} in this namespace; create it "
                       f"(kubectl get expertpools) or name another", now, reason="PoolNotFound")
    try:
        members = admit(spec.pool, parse_pool_spec(pool.get("spec")), observed.policies)
    except SpecError as err:
        return invalid(status, generation, f"spec.pool: ExpertPool {spec.pool} is invalid ({err})", now,
                       reason="PoolInvalid")
    me = member_of(policy_name, members)
    if me is None or not me.admitted:
        message = me.message if me else f"spec.pool: ExpertPool {spec.pool} has not listed this policy yet"
        return invalid(status, generation, message, now, reason="NotAdmitted")
    # Owned objects: its knobs and its resident set; hosts of its own (from before it joined the pool) go.
    conflicted = conflicts(policy, observed)
    roles = obj.names(policy_name)
    resident_set = _resident_set(observed, me.model)
    desired = {roles["serving"]: obj.serving_config_map(policy, spec),
               roles["placement"]: obj.placement_config_map(policy, resident_set)}
    actions, changed = sync_objects(desired, observed, conflicted)
    for role in ("hosts", "service"):
        if roles[role] in observed.objects and f"{roles[role][0]} {roles[role][1]}" not in conflicted:
            actions.append(Delete(*roles[role]))
    # Status: the pool's hosts, this model's share of its meters.
    pool_status = pool.get("status") or {}
    row = next((m for m in pool_status.get("models") or () if m.get("policy") == policy_name), {})
    cost = _cost(status)
    cost["expertGBSeconds"] = float(row.get("expertGBSeconds") or 0.0)
    cost["sharedExpertGBSeconds"] = float(row.get("sharedExpertGBSeconds") or 0.0)  # its part of the shared replicas'
    _bill_non_expert(spec, status, cost, observed, now)
    status.pop("meters", None)
    status.update(observedGeneration=generation, cost=_rounded(cost), meterTime=rfc3339(now),
                  coldStarts=int(row.get("coldStarts") or 0), hostsReady=int(pool_status.get("hostsReady") or 0),
                  hostsDesired=int(pool_status.get("hostsDesired") or 0),
                  replicas=sum(len(v) for v in resident_set.values()))
    _serving_status(policy, status, observed, changed, roles, me.model, now)
    readiness = hosts_readiness(status["hostsDesired"], status["hostsReady"],
                                f"ExpertPool {spec.pool} is scaled to zero; the next request wakes it")
    actions += set_conditions(status, readiness, degraded(conflicted, observed), now, old)
    if status != old:
        actions.append(UpdateStatus(status))
    return actions


def _resident_set(observed: Observed, model: str | None = None) -> dict[str, list[list[int]]]:
    out: dict[str, list[list[int]]] = {}
    for pod, r in resident(observed.meters, model):
        out.setdefault(pod, []).append([r.layer, r.expert])
    return out


def _cost(status: dict) -> dict[str, float]:
    return dict(status.get("cost") or {"expertGBSeconds": 0.0, "nonExpertGBSeconds": 0.0})


def _rounded(cost: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 9) for k, v in cost.items()}


def _bill_non_expert(spec: PolicySpec, status: dict, cost: dict[str, float], observed: Observed, now: float) -> None:
    """Non-expert weights: the serving app's ready replicas since the last pass."""
    metered_at = seconds(status.get("meterTime"))
    if metered_at is not None and observed.serving_ready and spec.non_expert_gib_per_replica:
        cost["nonExpertGBSeconds"] = cost.get("nonExpertGBSeconds", 0.0) + \
            observed.serving_ready * spec.non_expert_gib_per_replica * GIB / 1e9 * (now - metered_at)


def _serving_status(policy: dict, status: dict, observed: Observed, changed: set, roles: dict, model: str | None,
                    now: float) -> None:
    """What the serving pods run (their annotation), the layers' balance, when the resident set changed."""
    applied = (policy["metadata"].get("annotations") or {}).get(obj.SERVING_GENERATION_ANNOTATION, "")
    if applied.isdigit():  # what the serving pods' loop runs (controller/planning/knob_sources.py)
        status["servingGeneration"] = int(applied)
    cv = layer_cv_percentiles(observed.meters, model)
    if cv is not None:
        status["layerCV"] = {"p50": round(cv[0], 4), "p95": round(cv[1], 4)}
    if roles["placement"] in changed:
        status["lastPlanTime"] = rfc3339(now)
