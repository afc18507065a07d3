"""An ExpertAutoscalingPolicy's spec, parsed and checked (the checks OpenAPI cannot express).

The API server already refuses wrong types and out-of-range values (manifests/crd.yaml); this
module adds what Kubernetes 1.20 cannot check: planner names, unknown serving keys, minHosts <=
maxHosts, cudaIpc only with hostNetwork. Defaults are the CRD's (tests/k8s/test_crd_schema.py
keeps them equal), so a spec that did not pass through an API server (unit tests) parses the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from moeless.controller.knobs import KnobError, Knobs
from moeless.expert_fn.options import COMPUTE_DTYPES, PEER_COPIES  # no torch: the operator loads none

GIB = 1024**3


class SpecError(ValueError):
    """A policy the operator cannot act on; the message names the field (spec.hosts.maxHosts: ...)."""


@dataclass(frozen=True)
class HostPool:
    image: str
    max_hosts: int
    min_hosts: int = 0
    image_pull_policy: str = "IfNotPresent"
    gpus_per_host: int = 1
    memory_gib_per_host: float = 16.0
    target_memory_utilization: float = 0.8
    cpu: str = "1"
    grpc_port: int = 50051
    metrics_port: int = 9400
    host_network: bool = False
    drain_seconds: int = 30
    poll_microseconds: float = 0.0  # the data plane's busy-poll (expert-host --poll-us)
    compute_dtype: str = "float32"  # expert-host --compute-dtype
    cuda_ipc: bool = False  # the node's PID and IPC namespaces, for CUDA IPC with serving pods on the node
    family_warm: bool = True  # a fine-tune's base stays whole while it calls (expert-host --no-family-warm when off)
    peer_copies: str = "measured"  # when a load copies its replica from a peer host (expert-host --peer-copies)


@dataclass(frozen=True)
class Scaling:
    """How a pool of hosts grows and shrinks (scaling.decide_hosts): a policy's own pool or an ExpertPool."""

    prewarm_hosts: int = 0
    scale_to_zero: bool = False
    scale_to_zero_delay_s: float = 300.0
    upscale_delay_s: float = 30.0
    downscale_delay_s: float | None = None  # None: the keep-alive


class Sizing:
    """What a spec with hosts, scaling and a keep-alive derives (a policy's own pool, or an ExpertPool)."""

    hosts: HostPool | None
    scaling: Scaling
    keep_alive_s: float

    @property
    def scale_in_delay_s(self) -> float:
        delay = self.scaling.downscale_delay_s
        return self.keep_alive_s if delay is None else delay

    @property
    def host_capacity_bytes(self) -> int:
        assert self.hosts is not None, "a policy on an ExpertPool has no hosts of its own"
        return int(self.hosts.memory_gib_per_host * GIB)


@dataclass(frozen=True)
class PolicySpec(Sizing):
    """Everything the reconcile needs from spec, with defaults filled in.

    A policy has its own pool (hosts set) or joins an ExpertPool (pool set, hosts None): then its
    model is served on the pool's hosts by model_name, with guaranteed_gib of each host's memory
    kept for it while it is active and its hottest replicas up to keep_warm_gib per host kept past
    the keep-alive (expert_fn/host/shares.py).
    """

    store: str
    hosts: HostPool | None
    knobs: Knobs
    pvc: str | None = None
    host_path: str | None = None
    scaling: Scaling = Scaling()
    non_expert_deployment: str | None = None
    non_expert_gib_per_replica: float = 0.0
    pool: str | None = None
    model_name: str | None = None
    guaranteed_gib: float = 0.0
    keep_warm_gib: float = 0.0
    base: str | None = None  # a fine-tune's base: another model of the same pool (its store is written over the base's)

    @property
    def keep_alive_s(self) -> float:  # type: ignore[override]
        return self.knobs.keep_alive_s

    def served_as(self, policy_name: str) -> str:
        """The name the pool's hosts serve this model by (spec.model.name, default the policy's name)."""
        return self.model_name or policy_name


_POOL_KEYS = {
    "image": ("image", str), "maxHosts": ("max_hosts", int), "minHosts": ("min_hosts", int),
    "imagePullPolicy": ("image_pull_policy", str), "gpusPerHost": ("gpus_per_host", int),
    "memoryGiBPerHost": ("memory_gib_per_host", float), "targetMemoryUtilization": ("target_memory_utilization", float),
    "cpu": ("cpu", str), "grpcPort": ("grpc_port", int), "metricsPort": ("metrics_port", int),
    "hostNetwork": ("host_network", bool), "drainSeconds": ("drain_seconds", int),
    "pollMicroseconds": ("poll_microseconds", float), "computeDtype": ("compute_dtype", str),
    "cudaIpc": ("cuda_ipc", bool), "familyWarm": ("family_warm", bool), "peerCopies": ("peer_copies", str),
}


def _typed(value: Any, kind: type, where: str) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise SpecError(f"{where}: expected {kind.__name__}, got {value!r}")
    return value


def _block(spec: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    block = spec.get(key) or {}
    if not isinstance(block, Mapping):
        raise SpecError(f"spec.{key}: expected an object, got {block!r}")
    return block


def parse_hosts(spec: Mapping[str, Any]) -> HostPool:
    """spec.hosts -> HostPool; SpecError names the first bad field."""
    raw_pool = _block(spec, "hosts")
    unknown = sorted(set(raw_pool) - set(_POOL_KEYS))
    if unknown:
        raise SpecError(f"spec.hosts.{unknown[0]}: unknown field; known: {', '.join(_POOL_KEYS)}")
    for required in ("image", "maxHosts"):
        if required not in raw_pool:
            raise SpecError(f"spec.hosts.{required}: required")
    pool = HostPool(**{attr: _typed(raw_pool[key], kind, f"spec.hosts.{key}")
                       for key, (attr, kind) in _POOL_KEYS.items() if key in raw_pool})
    if not 0 <= pool.poll_microseconds <= 100_000:
        raise SpecError(f"spec.hosts.pollMicroseconds: {pool.poll_microseconds:g} is outside 0..100000")
    if pool.compute_dtype not in COMPUTE_DTYPES:
        raise SpecError(f"spec.hosts.computeDtype: {pool.compute_dtype!r}; use one of {', '.join(COMPUTE_DTYPES)}")
    if pool.peer_copies not in PEER_COPIES:
        raise SpecError(f"spec.hosts.peerCopies: {pool.peer_copies!r}; use one of {', '.join(PEER_COPIES)}")
    if pool.cuda_ipc and not pool.host_network:  # the handles travel over the local channel, a node-network socket
        raise SpecError("spec.hosts.cudaIpc: needs spec.hosts.hostNetwork: CUDA IPC handles travel over the local "
                        "channel, an abstract Unix socket of the node's network; set hostNetwork: true too")
    if pool.min_hosts > pool.max_hosts:
        raise SpecError(f"spec.hosts.minHosts: {pool.min_hosts} exceeds maxHosts {pool.max_hosts}")
    return pool


SCALING_KEYS = ("prewarm", "scaleToZero", "upscaleDelaySeconds", "downscaleDelaySeconds")


def parse_scaling(spec: Mapping[str, Any], max_hosts: int) -> Scaling:
    """spec.prewarm, scaleToZero, upscaleDelaySeconds, downscaleDelaySeconds -> Scaling."""
    prewarm, to_zero = _block(spec, "prewarm"), _block(spec, "scaleToZero")
    prewarm_hosts = _typed(prewarm.get("hosts", 0), int, "spec.prewarm.hosts")
    if prewarm_hosts > max_hosts:
        raise SpecError(f"spec.prewarm.hosts: {prewarm_hosts} exceeds hosts.maxHosts {max_hosts}")
    downscale = spec.get("downscaleDelaySeconds")
    return Scaling(
        prewarm_hosts=prewarm_hosts,
        scale_to_zero=_typed(to_zero.get("enabled", False), bool, "spec.scaleToZero.enabled"),
        scale_to_zero_delay_s=_typed(to_zero.get("delaySeconds", 300.0), float, "spec.scaleToZero.delaySeconds"),
        upscale_delay_s=_typed(spec.get("upscaleDelaySeconds", 30.0), float, "spec.upscaleDelaySeconds"),
        downscale_delay_s=None if downscale is None else _typed(downscale, float, "spec.downscaleDelaySeconds"),
    )


def parse_spec(spec: Mapping[str, Any]) -> PolicySpec:
    """spec (the object's .spec) -> PolicySpec; raises SpecError naming the first bad field."""
    if not isinstance(spec, Mapping):
        raise SpecError("spec: missing; a policy needs spec.model and spec.hosts (or spec.pool)")
    # 1. Model: where the weight store is.
    model = _block(spec, "model")
    if not isinstance(model.get("store"), str) or not model["store"]:
        raise SpecError("spec.model.store: required, the weight store's path inside the host pods")
    if model.get("persistentVolumeClaim") and model.get("hostPath"):
        raise SpecError("spec.model: set persistentVolumeClaim or hostPath, not both")
    # 2. Hosts: its own pool, or a share of an ExpertPool's.
    pool_name = spec.get("pool") or None
    if pool_name is not None:
        if not isinstance(pool_name, str):
            raise SpecError(f"spec.pool: expected the name of an ExpertPool, got {pool_name!r}")
        for key in ("hosts", *SCALING_KEYS):
            if key in spec:
                raise SpecError(f"spec.{key}: a policy on an ExpertPool (spec.pool: {pool_name}) takes its hosts and "
                                f"their scaling from the pool; set it on ExpertPool {pool_name}")
        for key in ("persistentVolumeClaim", "hostPath"):
            if model.get(key):
                raise SpecError(f"spec.model.{key}: on an ExpertPool the pool's spec.storage holds every model's store")
        hosts, scaling = None, Scaling()
    else:
        for key in ("name", "guaranteedGiB", "keepWarmGiB", "base"):
            if key in model:
                raise SpecError(f"spec.model.{key}: only for a policy on an ExpertPool (spec.pool)")
        hosts = parse_hosts(spec)
        scaling = parse_scaling(spec, hosts.max_hosts)
    name = model.get("name") or None
    if name is not None and (not isinstance(name, str) or "=" in name or "," in name):
        raise SpecError(f"spec.model.name: {name!r} is not a model name (no '=' or ',')")
    base = model.get("base") or None
    if base is not None and (not isinstance(base, str) or "=" in base or "," in base):
        raise SpecError(f"spec.model.base: {base!r} is not a model name (no '=' or ',')")
    if base is not None and base == name:
        raise SpecError(f"spec.model.base: model {base!r} cannot be its own base")
    guaranteed = _typed(model.get("guaranteedGiB", 0.0), float, "spec.model.guaranteedGiB")
    warm = _typed(model.get("keepWarmGiB", 0.0), float, "spec.model.keepWarmGiB")
    for key, value in (("guaranteedGiB", guaranteed), ("keepWarmGiB", warm)):
        if value < 0:
            raise SpecError(f"spec.model.{key}: {value:g} is negative")
    # 3. Serving knobs: exactly a `moeless serve --config` file.
    try:
        knobs = Knobs.from_mapping(_block(spec, "serving"), where="spec.serving")
    except KnobError as err:
        raise SpecError(str(err)) from None
    # 4. Billing.
    non_expert = _block(spec, "nonExpert")
    return PolicySpec(
        store=model["store"], hosts=hosts, knobs=knobs,
        pvc=model.get("persistentVolumeClaim") or None, host_path=model.get("hostPath") or None,
        scaling=scaling,
        non_expert_deployment=non_expert.get("deployment") or None,
        non_expert_gib_per_replica=_typed(non_expert.get("memoryGiBPerReplica", 0.0), float,
                                          "spec.nonExpert.memoryGiBPerReplica"),
        pool=pool_name, model_name=name, guaranteed_gib=guaranteed, keep_warm_gib=warm, base=base,
    )
