"""An ExpertPool's spec, parsed and checked, and which policies its hosts serve (admission). Pure.

An ExpertPool is a pool of expert hosts that several models share at the grain of experts: every
ExpertAutoscalingPolicy with `spec.pool: NAME` adds its model (`spec.model.store`, a path inside
the pool's storage volume, served by `spec.model.name`). The hosts run one `--store NAME=DIR` per
admitted model, one `--share NAME=GB` per guaranteed share and one `--keep-warm NAME=GB` per
keep-warm set (expert_fn/host/shares.py).

Admission (`admit`), in order of creation (then name), so an older model never loses its place to
a newer one:
1. a policy whose spec is invalid is left to its own reconcile (it reports InvalidSpec);
2. a model name another admitted policy serves already is refused;
3. a guaranteed share that does not fit beside the admitted ones in one host's memory is refused,
   naming spec.model.guaranteedGiB and what is left; so is a keep-warm set (spec.model.keepWarmGiB)
   that does not fit beside the admitted ones' (kept warm, not guaranteed: they may overlap shares);
4. a fine-tune (spec.model.base: the name another policy of the pool serves its model by; its store
   was written over that model's, `moeless model export --finetune DIR --base STORE`) whose base is
   not admitted on this pool is refused, naming the base and where it is (another ExpertPool, hosts
   of its own, refused here, or nowhere). Fine-tunes come after every model without a base, so a base
   created after its fine-tunes still admits them; the hosts list each base before its fine-tunes
   (--store order), so a shared expert's replica is the base's (model_stores.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from moeless.controller.operator.spec import (SCALING_KEYS, HostPool, Scaling, SpecError, Sizing, _block, _typed,
                                              parse_hosts, parse_scaling, parse_spec)

_KEYS = {"hosts", "storage", "keepAliveSeconds", *SCALING_KEYS}


@dataclass(frozen=True)
class PoolSpec(Sizing):
    """Everything the pool's reconcile needs from spec, with defaults filled in."""

    hosts: HostPool
    scaling: Scaling = Scaling()
    keep_alive_s: float = 60.0
    pvc: str | None = None
    host_path: str | None = None
    mount_path: str = "/models"


def parse_pool_spec(spec: Mapping[str, Any]) -> PoolSpec:
    """An ExpertPool's .spec -> PoolSpec; SpecError names the first bad field."""
    if not isinstance(spec, Mapping):
        raise SpecError("spec: missing; a pool needs spec.hosts")
    unknown = sorted(set(spec) - _KEYS)
    if unknown:
        raise SpecError(f"spec.{unknown[0]}: unknown field; known: {', '.join(sorted(_KEYS))}")
    hosts = parse_hosts(spec)
    storage = _block(spec, "storage")
    if storage.get("persistentVolumeClaim") and storage.get("hostPath"):
        raise SpecError("spec.storage: set persistentVolumeClaim or hostPath, not both")
    mount = _typed(storage.get("mountPath", "/models"), str, "spec.storage.mountPath")
    if not mount.startswith("/"):
        raise SpecError(f"spec.storage.mountPath: {mount!r} is not an absolute path")
    keep_alive = _typed(spec.get("keepAliveSeconds", 60.0), float, "spec.keepAliveSeconds")
    if keep_alive < 0:
        raise SpecError(f"spec.keepAliveSeconds: {keep_alive:g} is negative")
    return PoolSpec(hosts=hosts, scaling=parse_scaling(spec, hosts.max_hosts), keep_alive_s=keep_alive,
                    pvc=storage.get("persistentVolumeClaim") or None, host_path=storage.get("hostPath") or None,
                    mount_path=mount)


@dataclass(frozen=True)
class Member:
    """A policy on the pool as the pool sees it."""

    policy: str
    model: str  # the name the hosts serve it by
    store: str
    guaranteed_gib: float
    admitted: bool
    message: str = ""  # why not admitted
    keep_warm_gib: float = 0.0
    base: str | None = None  # a fine-tune's base model (spec.model.base)


def admit(pool_name: str, pool: PoolSpec, policies: Sequence[dict]) -> list[Member]:
    """The members of pool_name among policies (any policies; those of other pools are skipped), in
    order of creation, fine-tunes last, each admitted or refused with a message naming the field
    (module docstring)."""
    ordered = sorted(policies, key=lambda p: (p["metadata"].get("creationTimestamp") or "", p["metadata"]["name"]))
    mine, elsewhere = [], {}  # this pool's (policy, spec); the models of other pools or own hosts: name -> pool
    for policy in ordered:
        raw = policy.get("spec") or {}
        if not isinstance(raw, Mapping):
            continue
        try:
            spec = parse_spec(raw)
        except SpecError:
            continue  # 1. its own reconcile reports it
        name = policy["metadata"]["name"]
        if raw.get("pool") == pool_name:
            mine.append((name, spec))
        else:
            elsewhere.setdefault(spec.served_as(name), spec.pool)
    mine.sort(key=lambda item: item[1].base is not None)  # stable: bases first, each group in order of creation
    members: list[Member] = []
    served: dict[str, str] = {}
    capacity = pool.hosts.memory_gib_per_host
    left = {"guaranteedGiB": capacity, "keepWarmGiB": capacity}  # each host's GiB not yet promised, per field
    for name, spec in mine:
        model = spec.served_as(name)
        asks = {"guaranteedGiB": spec.guaranteed_gib, "keepWarmGiB": spec.keep_warm_gib}
        misfit = next((key for key, gib in asks.items() if gib > left[key] + 1e-9), None)
        message = ""
        if model in served:  # 2.
            message = (f"spec.model.name: model {model!r} is served on ExpertPool {pool_name} by policy "
                       f"{served[model]} already; give this one another name")
        elif misfit is not None:  # 3.
            kept = " warm" if misfit == "keepWarmGiB" else ""
            message = (f"spec.model.{misfit}: {asks[misfit]:g} GiB does not fit: ExpertPool {pool_name}'s hosts have "
                       f"{capacity:g} GiB each and the models admitted before it keep {capacity - left[misfit]:g}{kept}; "
                       f"at most {max(left[misfit], 0):g} is left")
        elif spec.base is not None and spec.base not in served:  # 4.
            message = _base_missing(pool_name, model, spec.base, {s.served_as(n) for n, s in mine}, elsewhere)
        else:
            served[model] = name
            left = {key: left[key] - gib for key, gib in asks.items()}
        members.append(Member(name, model, spec.store, spec.guaranteed_gib, not message, message, spec.keep_warm_gib,
                              spec.base))
    return members


def _base_missing(pool_name: str, model: str, base: str, here: set[str], elsewhere: Mapping[str, str | None]) -> str:
    """Why a fine-tune's base is not on the pool (admit's rule 4), naming the model, the base and where it is."""
    head = f"spec.model.base: fine-tune {model!r} needs its base model {base!r} on ExpertPool {pool_name}"
    if base == model:
        return f"spec.model.base: model {model!r} cannot be its own base"
    if base in here:
        return f"{head}, which refused it (see policy of {base!r}); it is admitted once its base is"
    if base in elsewhere:
        where = f"ExpertPool {elsewhere[base]}" if elsewhere[base] else "hosts of its own (no spec.pool)"
        return (f"{head}, but {base!r} is served on {where}: a fine-tune shares its base's experts only on the "
                f"base's pool; set spec.pool: {pool_name} on both or neither")
    return f"{head}, but no policy serves a model named {base!r}; add it (spec.pool: {pool_name}) or fix the name"


def member_of(policy_name: str, members: Sequence[Member]) -> Member | None:
    return next((m for m in members if m.policy == policy_name), None)
