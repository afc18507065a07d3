"""What the reconciles (reconcile.py for policies, pool_reconcile.py for ExpertPools) see and do,
and the steps both take: own objects, meter hosts, scale a StatefulSet, write conditions. Pure.

Actions are what the shell (kube.py) applies, in order; Observed is what it read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Mapping, Sequence

from moeless.controller.operator import objects as obj
from moeless.controller.operator.meters import HostMeters, increase
from moeless.controller.operator.scaling import Pending, ScaleDecision, decide_hosts
from moeless.controller.operator.spec import Sizing


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
    """An Event on the policy (or pool)."""

    type: str  # Normal or Warning
    reason: str
    message: str


@dataclass(frozen=True)
class Configure:
    """Set a running host's keep-alive (its Configure RPC): a change that must not roll the pods."""

    pod: str
    address: str  # host:port of its gRPC server
    keep_alive_s: float


Action = Create | Update | Scale | Delete | UpdateStatus | Emit | Configure


@dataclass(frozen=True)
class Observed:
    """What the shell read for one policy or pool.

    objects: (kind, name) -> object, for the names in objects.names() and any object labelled with
    the owner; pods: the host pods (a policy on an ExpertPool: the pool's); meters: pod name ->
    reading, for pods whose /metrics answered; serving_ready: ready replicas of
    spec.nonExpert.deployment (None: not set or not found); pool: the ExpertPool a policy names
    (None: none, or not found); policies: every policy of the namespace (a pool admits its members
    from them, and a policy on a pool learns whether it was admitted).
    """

    objects: Mapping[tuple[str, str], dict] = field(default_factory=dict)
    pods: Sequence[dict] = ()
    meters: Mapping[str, HostMeters] = field(default_factory=dict)
    serving_ready: int | None = None
    pool: dict | None = None
    policies: Sequence[dict] = ()


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def seconds(text: str | None) -> float | None:
    if not text:
        return None
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()


def pod_ready(pod: dict) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


# -- owned objects ---------------------------------------------------------------------------
def conflicts(owner: dict, observed: Observed) -> list[str]:
    """'Kind name' of each object with one of the owner's names that another controller owns."""
    kind, name, uid = owner.get("kind", obj.KIND), owner["metadata"]["name"], owner["metadata"]["uid"]
    return [f"{k} {n}" for k, n in obj.names(name, kind).values()
            if (k, n) in observed.objects and not obj.owned_by(observed.objects[(k, n)], name, uid, kind)]


def sync_objects(desired: Mapping[tuple[str, str], dict], observed: Observed,
                 conflicted: Sequence[str]) -> tuple[list[Action], set[tuple[str, str]]]:
    """Create what is missing, update what differs (a StatefulSet: its pod template, by hash; a
    ConfigMap: its data); never touch a conflicted name. Returns the actions and the keys changed."""
    actions: list[Action] = []
    changed: set[tuple[str, str]] = set()
    for key, want in desired.items():
        have = observed.objects.get(key)
        if f"{key[0]} {key[1]}" in conflicted:
            continue
        if have is None:
            actions.append(Create(want))
            changed.add(key)
        elif key[0] == "StatefulSet":
            want_hash = want["metadata"]["annotations"][obj.TEMPLATE_HASH]
            if (have["metadata"].get("annotations") or {}).get(obj.TEMPLATE_HASH) != want_hash:
                annotations = {**(have["metadata"].get("annotations") or {}), obj.TEMPLATE_HASH: want_hash}
                actions.append(Update(*key, {"metadata": {"annotations": annotations},
                                             "spec": {"template": want["spec"]["template"]}}))
                changed.add(key)
        elif key[0] == "ConfigMap" and have.get("data") != want["data"]:
            actions.append(Update(*key, {"data": want["data"]}))
            changed.add(key)
    return actions, changed


def delete_owned(owner_name: str, observed: Observed, kind: str = obj.KIND) -> list[Action]:
    """The owner is gone (or going): delete what it owned by name."""
    return [Delete(k, name) for (k, name), o in sorted(observed.objects.items()) if obj.owned_by(o, owner_name, None, kind)]


# -- meters ----------------------------------------------------------------------------------
Reading = Callable[[HostMeters], Mapping[str, float]]  # a host's reading -> {gbSeconds, coldStarts, tokens}


def host_reading(m: HostMeters) -> dict[str, float]:
    return {"gbSeconds": m.gb_seconds, "coldStarts": m.cold_starts, "tokens": m.tokens}


def meter_increases(last: Mapping[str, Mapping], pods: Sequence[dict], meters: Mapping[str, HostMeters],
                    read: Reading = host_reading) -> tuple[dict[str, float], dict[str, dict]]:
    """What every host added to read()'s counters since its last reading (last: pod -> reading with
    its uid), and the readings to keep (pods gone since are forgotten: their last interval is not
    billed; pods not read this pass keep their last reading, so nothing is counted twice)."""
    uids = {p["metadata"]["name"]: p["metadata"].get("uid", "") for p in pods}
    added: dict[str, float] = {}
    readings: dict[str, dict] = {}
    for pod, m in sorted(meters.items()):
        uid, before, now = uids.get(pod, ""), last.get(pod), read(m)
        for key, value in now.items():
            added[key] = added.get(key, 0.0) + increase(value, before, key, uid)
        readings[pod] = {"uid": uid, **now}
    kept = {p: v for p, v in last.items() if p in uids and p not in readings}
    return added, {**kept, **readings}


def take_wake(owner: dict, status: dict) -> bool:
    """Whether the wake annotation holds a value not acted on yet; if so, status.wokenBy records it."""
    wake = (owner["metadata"].get("annotations") or {}).get(obj.WAKE_ANNOTATION)
    if not wake or wake == status.get("wokenBy"):
        return False
    status["wokenBy"] = wake
    return True


# -- scaling ---------------------------------------------------------------------------------
def scale_hosts(spec: Sizing, owner: dict, status: dict, observed: Observed, active: bool, now: float,
                conflicted: Sequence[str]) -> tuple[list[Action], ScaleDecision, float]:
    """Decide the host StatefulSet's size (scaling.decide_hosts) and the Scale and Event actions;
    returns them with the decision and the last active time. The StatefulSet is created at its
    decided size by sync_objects, then only scaled. Hosts starting (a pod there, not Ready) count as
    activity: a pool just woken is not put back to sleep before its hosts can serve the request that
    woke it (on a busy node the pods took longer than the scale-to-zero delay, and it flapped)."""
    kind, name = obj.names(owner["metadata"]["name"], owner.get("kind", obj.KIND))["hosts"]
    sts = observed.objects.get((kind, name))
    current = None if sts is None else int(sts["spec"].get("replicas") or 0)
    starting = bool(current) and any(not pod_ready(p) and not p["metadata"].get("deletionTimestamp")
                                     for p in observed.pods)
    last_active = now if active or starting else seconds(status.get("lastActiveTime")) or now
    pending = status.get("pendingScale")
    pending = Pending(pending["hosts"], seconds(pending["since"])) if pending else None
    held = sum(m.bytes_held for m in observed.meters.values())
    decision = decide_hosts(spec, current, held, now - last_active, pending, now)
    actions: list[Action] = []
    if sts is not None and f"{kind} {name}" not in conflicted and decision.hosts != current:
        actions.append(Scale(name, decision.hosts))
    if decision.reason not in ("Steady", "Waiting"):
        actions.append(Emit("Normal", decision.reason, f"expert hosts {current or 0} -> {decision.hosts}"))
    return actions, decision, last_active


def scale_status(status: dict, decision: ScaleDecision, last_active: float) -> None:
    status.update(hostsDesired=decision.hosts, lastActiveTime=rfc3339(last_active))
    status.pop("pendingScale", None)
    if decision.pending:
        status["pendingScale"] = {"hosts": decision.pending.hosts, "since": rfc3339(decision.pending.since)}


def hosts_readiness(hosts: int, ready: int, wake_hint: str) -> tuple[str, str, str]:
    """The Ready condition of a pool of `hosts` wanted, `ready` ready."""
    if hosts == 0:
        return "True", "ScaledToZero", f"no expert host: {wake_hint}"
    if ready >= hosts:
        return "True", "HostsReady", f"{ready} of {hosts} expert hosts ready"
    return "False", "HostsStarting", f"{ready} of {hosts} expert hosts ready"


def degraded(conflicted: Sequence[str], observed: Observed, what: str = "policy") -> tuple[str, str, str]:
    """The Degraded condition: a name conflict, hosts whose /metrics did not answer, or none."""
    unread = [p["metadata"]["name"] for p in observed.pods if pod_ready(p) and p["metadata"]["name"] not in observed.meters]
    if conflicted:
        return "True", "NameConflict", f"not owned by this {what}, left alone: {', '.join(conflicted)}"
    if unread:
        return "True", "MetersUnavailable", f"cannot read /metrics of {', '.join(sorted(unread))}"
    return "False", "AsExpected", ""


# -- conditions ------------------------------------------------------------------------------
def condition(status: dict, kind: str) -> dict | None:
    return next((c for c in status.get("conditions") or () if c.get("type") == kind), None)


def transition(status: dict, kind: str, value: str, reason: str, message: str, now: float) -> dict[str, Any]:
    old = condition(status, kind)
    since = old["lastTransitionTime"] if old and old.get("status") == value else rfc3339(now)
    new = {"type": kind, "status": value, "reason": reason, "lastTransitionTime": since}
    if message:  # the client sends an empty string as null, which the schema refuses
        new["message"] = message
    return new


def set_conditions(status: dict, ready: tuple[str, str, str], bad: tuple[str, str, str], now: float,
                   old: dict) -> list[Action]:
    """Write Ready and Degraded into status; a Warning Event when Degraded newly says NameConflict."""
    previous = condition(old, "Degraded")
    status["conditions"] = [transition(status, "Ready", *ready, now), transition(status, "Degraded", *bad, now)]
    if bad[1] == "NameConflict" and (previous or {}).get("reason") != "NameConflict":
        return [Emit("Warning", "NameConflict", bad[2])]
    return []


def invalid(status: dict, generation: Any, message: str, now: float, reason: str = "InvalidSpec") -> list[Action]:
    """Report a spec the operator cannot act on (Ready False, Degraded True, one Warning Event); change nothing."""
    old = condition(status, "Degraded")
    new = dict(status, observedGeneration=generation, conditions=[
        transition(status, "Ready", "False", reason, message, now),
        transition(status, "Degraded", "True", reason, message, now),
    ])
    actions: list[Action] = []
    if not old or old.get("message") != message:
        actions.append(Emit("Warning", reason, message))
    if new != status:
        actions.append(UpdateStatus(new))
    return actions
