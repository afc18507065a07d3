"""The operator's reconcile of one ExpertPool: (pool, the namespace's policies, observed, clock) -> actions. Pure.

Level-triggered like reconcile.py, whose steps it shares (actions.py). Steps of reconcile_pool():
1. Pool gone: delete what it owned.
2. Spec invalid: report it; touch nothing else.
3. Members: the policies with spec.pool naming it, admitted in order of creation
   (pool_spec.admit: a model name taken or a guaranteed share that does not fit is refused).
4. Meters: each host's new GB·s, cold starts and tokens, for the pool and for each model (the
   hosts' moeless_expert_model_* families); any model's tokens or the pool's wake annotation mark
   the pool active.
5. Scale: one size for every model (scaling.decide_hosts on what all of them hold: the hosts' bytes, in
   which a replica several models share, one per content key, counts once; so a fine-tune written over
   its base (spec.model.base) adds only its own experts' bytes to the pool's size).
6. Owned objects: the StatefulSet (its hosts serve every admitted model: --store NAME=DIR, with
   --share NAME=GB for guaranteed shares; admitting a model changes the pod template, which rolls
   the hosts) and its headless Service. A new keep-alive does not roll them: each running host
   whose /metrics shows another one is told the pool's (a Configure action, its gRPC Configure).
7. Status: hosts, one row per model (admitted, refused and why, or left; its base; replicas, cold
   starts, GB·s and the part of them from replicas it shares with other models, sharedExpertGBSeconds),
   the pool's totals, which the rows' GB·s add up to, and the replicas several models share (held once).
"""

from __future__ import annotations

from typing import Sequence

from moeless.controller.operator import objects as obj
from moeless.controller.operator.actions import (Action, Configure, Observed, UpdateStatus, conflicts, degraded, delete_owned,
                                                 host_reading, hosts_readiness, invalid, meter_increases, pod_ready,
                                                 rfc3339, scale_hosts, scale_status, set_conditions, sync_objects,
                                                 take_wake)
from moeless.controller.operator.meters import HostMeters, resident
from moeless.controller.operator.pool_spec import Member, PoolSpec, admit, parse_pool_spec
from moeless.controller.pool.members import pod_member
from moeless.controller.operator.spec import SpecError


def model_readings(models: Sequence[str]):
    """A meter reading (actions.meter_increases) of each model's counters on a host, keyed MODEL/counter."""
    def read(m: HostMeters) -> dict[str, float]:
        out = host_reading(m)
        for name in models:
            mm = m.models.get(name)
            if mm is not None:
                out.update({f"{name}/gbSeconds": mm.gb_seconds, f"{name}/coldStarts": mm.cold_starts,
                            f"{name}/tokens": mm.tokens, f"{name}/sharedGBSeconds": mm.shared_gb_seconds})
        return out
    return read


def reconcile_pool(pool_name: str, pool: dict | None, observed: Observed, now: float) -> list[Action]:
    """Actions that bring the cluster to what the pool and its members want (the module docstring)."""
    # 1. Pool gone (or going).
    if pool is None or pool["metadata"].get("deletionTimestamp"):
        return delete_owned(pool_name, observed, obj.POOL_KIND)
    old, status = pool.get("status") or {}, dict(pool.get("status") or {})
    generation = pool["metadata"].get("generation")
    # 2. Invalid spec.
    try:
        spec = parse_pool_spec(pool.get("spec"))
    except SpecError as err:
        return invalid(status, generation, str(err), now)
    # 3. Members.
    members = admit(pool_name, spec, observed.policies)
    admitted = [m for m in members if m.admitted]
    # 4. Meters: the pool's and every model's (a model that left keeps its row: the rows add up to the pool's).
    known = sorted({m.model for m in members} | {row["name"] for row in status.get("models") or ()})
    added, readings = meter_increases(status.get("meters") or {}, observed.pods, observed.meters, model_readings(known))
    inflight = sum(m.inflight for m in observed.meters.values())
    active = take_wake(pool, status) or added.get("tokens", 0) + inflight > 0
    total = float((status.get("cost") or {}).get("expertGBSeconds") or 0.0) + added.get("gbSeconds", 0.0)
    status.update(meters=readings, cost={"expertGBSeconds": round(total, 9)}, meterTime=rfc3339(now),
                  coldStarts=int(status.get("coldStarts") or 0) + int(added.get("coldStarts", 0)))
    # 5. Scale.
    conflicted = conflicts(pool, observed)
    actions, decision, last_active = scale_hosts(spec, pool, status, observed, active, now, conflicted)
    # 6. Owned objects.
    roles = obj.names(pool_name, obj.POOL_KIND)
    desired = {roles["hosts"]: obj.stateful_set(pool, spec, decision.hosts, admitted),
               roles["service"]: obj.service(pool, spec)}
    synced, _ = sync_objects(desired, observed, conflicted)
    actions = synced + actions + keep_alive_changes(spec, observed)
    # 7. Status.
    ready = sum(pod_ready(p) for p in observed.pods)
    rows = _rows(members, status, added, observed)
    status.update(observedGeneration=generation, hostsReady=ready, models=rows, modelCount=len(admitted),
                  replicas=len(resident(observed.meters)),
                  sharedReplicas=sum(m.shared_replicas for m in observed.meters.values()))
    scale_status(status, decision, last_active)
    readiness = hosts_readiness(decision.hosts, ready, "any model's next request (the wake annotation) starts them")
    bad = degraded(conflicted, observed, "pool")
    refused = [m for m in members if not m.admitted]
    if bad[0] == "False" and refused:
        bad = ("True", "PolicyRefused", "; ".join(f"{m.policy}: {m.message}" for m in refused))
    actions += set_conditions(status, readiness, bad, now, old)
    if status != old:
        actions.append(UpdateStatus(status))
    return actions


def keep_alive_changes(spec: PoolSpec, observed: Observed) -> list[Configure]:
    """A Configure for each ready host whose reading shows a keep-alive other than the pool's."""
    out = []
    for pod in observed.pods:
        reading, member = observed.meters.get(pod["metadata"]["name"]), pod_member(pod, spec.hosts.grpc_port,
                                                                                  spec.hosts.host_network)
        if (reading is not None and reading.keep_alive_s is not None and member is not None and member.ready
                and abs(reading.keep_alive_s - spec.keep_alive_s) > 1e-9):
            out.append(Configure(pod["metadata"]["name"], member.address, spec.keep_alive_s))
    return out


def _rows(members: Sequence[Member], status: dict, added: dict[str, float], observed: Observed) -> list[dict]:
    """One status row per member: its totals so far plus what its hosts added this pass."""
    before = {row["name"]: row for row in status.get("models") or ()}
    left = [Member(row["policy"], name, "", 0.0, False, "left the pool: no policy names it any more")
            for name, row in before.items() if name not in {m.model for m in members}]
    rows = []
    for m in [*members, *left]:
        last = before.get(m.model) or {}
        row = {"name": m.model, "policy": m.policy, "admitted": m.admitted, "guaranteedGiB": m.guaranteed_gib,
               "keepWarmGiB": m.keep_warm_gib,
               "expertGBSeconds": round(float(last.get("expertGBSeconds") or 0.0) + added.get(f"{m.model}/gbSeconds", 0.0), 9),
               "sharedExpertGBSeconds": round(float(last.get("sharedExpertGBSeconds") or 0.0)
                                              + added.get(f"{m.model}/sharedGBSeconds", 0.0), 9),
               "coldStarts": int(last.get("coldStarts") or 0) + int(added.get(f"{m.model}/coldStarts", 0)),
               "replicas": len(resident(observed.meters, m.model)),
               "bytesHeld": sum(h.models[m.model].bytes_held for h in observed.meters.values() if m.model in h.models),
               "sharedBytes": sum(h.models[m.model].shared_bytes for h in observed.meters.values() if m.model in h.models)}
        if m.base:
            row["base"] = m.base
        if m.message:
            row["message"] = m.message
        rows.append(row)
    return rows
