"""The operator's reconcile: (policy, observed objects, meters, clock) -> actions. Pure.

Level-triggered: every call compares what the policy wants with what exists, whatever happened
before, so a missed watch event, an operator restart or an API-server restart loses nothing. What
must survive between calls (pending scale steps, last activity, meter readings) lives in the
policy's status, not in the operator's memory.

Steps of reconcile():
1. Policy gone: delete what it owned (the garbage collector would too; this also covers a
   cluster without one).
2. Spec invalid: report it (status Degraded/InvalidSpec and an Event); touch nothing else.
3. Meters: add each host's new GB·s, cold starts and tokens to the totals; tokens or the wake
   annotation mark the pool active.
4. Scale: decide the pool's size (scaling.decide_hosts); create or scale the StatefulSet.
5. Owned objects: create what is missing, update what differs; an object with our name that the
   policy does not own is never touched (Degraded/NameConflict).
6. Status.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Mapping, Sequence

from moeless.controller.operator import objects as obj
from moeless.controller.operator.meters import HostMeters, increase, layer_cv_percentiles, resident
from moeless.controller.operator.scaling import Pending, decide_hosts
from moeless.controller.operator.spec import GIB, PolicySpec, SpecError, parse_spec


# -- actions ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Create:
    obj: dict


@dataclass(frozen=True)
class Update:
    """Set top-level fields (e.g. spec.template and annotations, or data) of an existing object."""

    kind: str
    name: str
    fields: dict


@dataclass(frozen=True)
class Scale:
    """Resize the StatefulSet through its scale subresource."""

    name: str
    replicas: int


@dataclass(frozen=True)
class Delete:
    kind: str
    name: str


@dataclass(frozen=True)
class UpdateStatus:
    status: dict


@dataclass(frozen=True)
class Emit:
    """An Event on the policy."""

    type: str  # Normal or Warning
    reason: str
    message: str


Action = Create | Update | Scale | Delete | UpdateStatus | Emit


@dataclass(frozen=True)
class Observed:
    """What the shell read for one policy.

    objects: (kind, name) -> object, for the names in objects.names() and any object labelled with
    the policy; pods: the host pods; meters: pod name -> reading, for pods whose /metrics answered;
    serving_ready: ready replicas of spec.nonExpert.deployment (None: not set or not found).
    """

    objects: Mapping[tuple[str, str], dict] = field(default_factory=dict)
    pods: Sequence[dict] = ()
    meters: Mapping[str, HostMeters] = field(default_factory=dict)
    serving_ready: int | None = None


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def seconds(text: str | None) -> float | None:
    if not text:
        return None
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()


def pod_ready(pod: dict) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def reconcile(policy_name: str, policy: dict | None, observed: Observed, now: float) -> list[Action]:
    """Actions that bring the cluster to what the policy wants (see the module docstring)."""
    # 1. Policy gone (or going): delete what it owned by name.
    if policy is None or policy["metadata"].get("deletionTimestamp"):
        return [Delete(kind, name) for (kind, name), o in sorted(observed.objects.items())
                if obj.owned_by(o, policy_name, None)]
    uid, status = policy["metadata"]["uid"], dict(policy.get("status") or {})
    generation = policy["metadata"].get("generation")
    # 2. Invalid spec: say so, change nothing.
    try:
        spec = parse_spec(policy.get("spec"))
    except SpecError as err:
        return _invalid(status, generation, str(err), now)
    actions: list[Action] = []
    # 3. Meters.
    status, active = _meter(spec, policy, status, observed, now)
    # 4. Scale.
    roles = obj.names(policy_name)
    sts = observed.objects.get(roles["hosts"])
    conflicts = [f"{kind} {name}" for kind, name in roles.values()
                 if (kind, name) in observed.objects and not obj.owned_by(observed.objects[(kind, name)], policy_name, uid)]
    current = None if sts is None else int(sts["spec"].get("replicas") or 0)
    last_active = seconds(status.get("lastActiveTime")) or now
    if active:
        last_active = now
    pending = status.get("pendingScale")
    pending = Pending(pending["hosts"], seconds(pending["since"])) if pending else None
    held = sum(m.bytes_held for m in observed.meters.values())
    decision = decide_hosts(spec, current, held, now - last_active, pending, now)
    # 5. Owned objects (the StatefulSet is created at its decided size, then only scaled).
    resident_set: dict[str, list[list[int]]] = {}
    for pod, r in resident(observed.meters):
        resident_set.setdefault(pod, []).append([r.layer, r.expert])
    desired = {
        roles["hosts"]: obj.stateful_set(policy, spec, decision.hosts),
        roles["service"]: obj.service(policy, spec),
        roles["serving"]: obj.serving_config_map(policy, spec),
        roles["placement"]: obj.placement_config_map(policy, resident_set),
    }
    plan_changed = False
    for key, want in desired.items():
        have = observed.objects.get(key)
        if f"{key[0]} {key[1]}" in conflicts:
            continue
        if have is None:
            actions.append(Create(want))
            plan_changed |= key == roles["placement"]
        elif key[0] == "StatefulSet":
            want_hash = want["metadata"]["annotations"][obj.TEMPLATE_HASH]
            if (have["metadata"].get("annotations") or {}).get(obj.TEMPLATE_HASH) != want_hash:
                annotations = {**(have["metadata"].get("annotations") or {}), obj.TEMPLATE_HASH: want_hash}
                actions.append(Update(*key, {"metadata": {"annotations": annotations},
                                             "spec": {"template": want["spec"]["template"]}}))
        elif key[0] == "ConfigMap" and have.get("data") != want["data"]:
            actions.append(Update(*key, {"data": want["data"]}))
            plan_changed |= key == roles["placement"]
    if sts is not None and "StatefulSet " + roles["hosts"][1] not in conflicts and decision.hosts != current:
        actions.append(Scale(roles["hosts"][1], decision.hosts))
    if decision.reason not in ("Steady", "Waiting"):
        actions.append(Emit("Normal", decision.reason, f"expert hosts {current or 0} -> {decision.hosts}"))
    # 6. Status.
    ready = sum(pod_ready(p) for p in observed.pods)
    cv = layer_cv_percentiles(observed.meters)
    status.update(
        observedGeneration=generation, hostsReady=ready, hostsDesired=decision.hosts,
        replicas=sum(len(v) for v in resident_set.values()), lastActiveTime=rfc3339(last_active),
    )
    applied = (policy["metadata"].get("annotations") or {}).get(obj.SERVING_GENERATION_ANNOTATION, "")
    if applied.isdigit():  # what the serving pods' loop runs (controller/planning/knob_sources.py)
        status["servingGeneration"] = int(applied)
    status.pop("pendingScale", None)
    if decision.pending:
        status["pendingScale"] = {"hosts": decision.pending.hosts, "since": rfc3339(decision.pending.since)}
    if cv is not None:
        status["layerCV"] = {"p50": round(cv[0], 4), "p95": round(cv[1], 4)}
    if plan_changed:
        status["lastPlanTime"] = rfc3339(now)
    unread = [p["metadata"]["name"] for p in observed.pods if pod_ready(p) and p["metadata"]["name"] not in observed.meters]
    if conflicts:
        degraded = ("True", "NameConflict", f"not owned by this policy, left alone: {', '.join(conflicts)}")
    elif unread:
        degraded = ("True", "MetersUnavailable", f"cannot read /metrics of {', '.join(sorted(unread))}")
    else:
        degraded = ("False", "AsExpected", "")
    if decision.hosts == 0:
        readiness = ("True", "ScaledToZero", "no expert host: the next token or the wake annotation starts them")
    elif ready >= decision.hosts:
        readiness = ("True", "HostsReady", f"{ready} of {decision.hosts} expert hosts ready")
    else:
        readiness = ("False", "HostsStarting", f"{ready} of {decision.hosts} expert hosts ready")
    old_degraded = _condition(status, "Degraded")
    status["conditions"] = [_transition(status, "Ready", *readiness, now), _transition(status, "Degraded", *degraded, now)]
    if conflicts and (old_degraded or {}).get("reason") != "NameConflict":
        actions.append(Emit("Warning", "NameConflict", degraded[2]))
    if status != (policy.get("status") or {}):
        actions.append(UpdateStatus(status))
    return actions


def _meter(spec: PolicySpec, policy: dict, status: dict, observed: Observed, now: float) -> tuple[dict, bool]:
    """Add the hosts' new readings to the totals; active: a host computed a token, or the policy was woken."""
    last = status.get("meters") or {}
    uids = {p["metadata"]["name"]: p["metadata"].get("uid", "") for p in observed.pods}
    cost = dict(status.get("cost") or {"expertGBSeconds": 0.0, "nonExpertGBSeconds": 0.0})
    cold, new_tokens, readings = int(status.get("coldStarts") or 0), 0, {}
    for pod, m in sorted(observed.meters.items()):
        uid, before = uids.get(pod, ""), last.get(pod)
        cost["expertGBSeconds"] += increase(m.gb_seconds, before, "gbSeconds", uid)
        cold += int(increase(m.cold_starts, before, "coldStarts", uid))
        new_tokens += int(increase(m.tokens, before, "tokens", uid)) + m.inflight
        readings[pod] = {"uid": uid, "gbSeconds": m.gb_seconds, "coldStarts": m.cold_starts, "tokens": m.tokens}
    # Non-expert weights: the serving app's ready replicas since the last pass.
    metered_at = seconds(status.get("meterTime"))
    if metered_at is not None and observed.serving_ready and spec.non_expert_gib_per_replica:
        cost["nonExpertGBSeconds"] += observed.serving_ready * spec.non_expert_gib_per_replica * GIB / 1e9 * (now - metered_at)
    cost = {k: round(v, 9) for k, v in cost.items()}
    wake = (policy["metadata"].get("annotations") or {}).get(obj.WAKE_ANNOTATION)
    woken = bool(wake) and wake != status.get("wokenBy")
    # Pods gone since the last reading are forgotten (their last interval is not billed); pods not read
    # this pass keep their last reading, so nothing is counted twice when they answer again.
    status.update(meters={**{p: v for p, v in last.items() if p in uids and p not in readings}, **readings},
                  cost=cost, coldStarts=cold, meterTime=rfc3339(now))
    if woken:
        status["wokenBy"] = wake
    return status, new_tokens > 0 or woken


def _condition(status: dict, kind: str) -> dict | None:
    return next((c for c in status.get("conditions") or () if c.get("type") == kind), None)


def _transition(status: dict, kind: str, value: str, reason: str, message: str, now: float) -> dict[str, Any]:
    old = _condition(status, kind)
    since = old["lastTransitionTime"] if old and old.get("status") == value else rfc3339(now)
    condition = {"type": kind, "status": value, "reason": reason, "lastTransitionTime": since}
    if message:  # the client sends an empty string as null, which the schema refuses
        condition["message"] = message
    return condition


def _invalid(status: dict, generation: Any, message: str, now: float) -> list[Action]:
    old = _condition(status, "Degraded")
    new = dict(status, observedGeneration=generation, conditions=[
        _transition(status, "Ready", "False", "InvalidSpec", message, now),
        _transition(status, "Degraded", "True", "InvalidSpec", message, now),
    ])
    actions: list[Action] = []
    if not old or old.get("message") != message:
        actions.append(Emit("Warning", "InvalidSpec", message))
    if new != status:
        actions.append(UpdateStatus(new))
    return actions
