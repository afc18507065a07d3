"""Leader election on a coordination.k8s.io/v1 Lease: one operator replica acts, the others wait.

lease_step is the pure rule; LeaderElector is the shell that reads and writes the Lease (with its
resourceVersion, so two candidates cannot both win one round) every duration / 3 seconds. A
leader that cannot renew stops acting once its lease would have expired (`leading` turns false).
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime, timezone
from typing import Callable

from kubernetes.client.rest import ApiException

from moeless.controller.operator.kube import UNREACHABLE, Kube, raw

log = logging.getLogger("moeless.operator.leader")


def micro_time(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_micro_time(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc).timestamp()


def lease_step(spec: dict | None, me: str, now: float, duration_s: int) -> dict | None:
    """The Lease spec to write to lead (None: someone else holds a live lease, follow).

    1. No lease, or an expired one: take it (count a transition when it changes hands).
    2. Ours: renew it.
    3. Another holder renewed within its duration: follow.
    """
    spec = spec or {}
    holder = spec.get("holderIdentity")
    renewed = parse_micro_time(spec["renewTime"]) if spec.get("renewTime") else None
    duration = spec.get("leaseDurationSeconds") or duration_s
    if holder == me:
        return {**spec, "renewTime": micro_time(now), "leaseDurationSeconds": duration_s}
    if holder and renewed is not None and now < renewed + duration:
        return None
    transitions = (spec.get("leaseTransitions") or 0) + (1 if holder else 0)
    return {"holderIdentity": me, "leaseDurationSeconds": duration_s, "acquireTime": micro_time(now),
            "renewTime": micro_time(now), "leaseTransitions": transitions}


class LeaderElector:
    """Keeps trying to hold Lease `name` in `namespace`; `leading` says whether this process may act."""

    def __init__(self, kube: Kube, namespace: str, name: str, identity: str, clock: Callable[[], float],
                 duration_s: int = 15) -> None:
        self.kube, self.namespace, self.name, self.identity = kube, namespace, name, identity
        self.clock, self.duration_s = clock, duration_s
        self._renewed_at: float | None = None
        self._last_round_failed = False

    @property
    def leading(self) -> bool:
        return self._renewed_at is not None and self.clock() < self._renewed_at + self.duration_s

    def try_once(self) -> bool:
        """One round: read the lease, write it if the rule says we lead. Returns `leading`."""
        now = self.clock()
        api = self.kube.coordination
        self._last_round_failed = True
        try:
            lease = raw(api.read_namespaced_lease, self.name, self.namespace)
            spec = lease_step(None if lease is None else lease.get("spec"), self.identity, now, self.duration_s)
            if spec is not None:
                body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                        "metadata": {"name": self.name, "namespace": self.namespace}, "spec": spec}
                if lease is None:
                    api.create_namespaced_lease(self.namespace, body)
                else:
                    body["metadata"]["resourceVersion"] = lease["metadata"]["resourceVersion"]
                    api.replace_namespaced_lease(self.name, self.namespace, body)
                if not self.leading:
                    log.info("%s leads (lease %s/%s)", self.identity, self.namespace, self.name)
                self._renewed_at = now
            self._last_round_failed = False
        except ApiException as err:
            if err.status != 409:  # 409: another candidate wrote first this round
                log.warning("lease %s/%s: %s", self.namespace, self.name, err.reason)
        except UNREACHABLE as err:  # API server unreachable: keep what we had until it expires
            log.warning("lease %s/%s: %s", self.namespace, self.name, err)
        return self.leading

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.try_once()
            # After a failed round (API server restarting, RBAC cache cold) retry every second, so a
            # short outage does not let the lease lapse, as client-go's retryPeriod does.
            stop.wait(1.0 if self._last_round_failed else self.duration_s / 3)

    def release(self) -> None:
        """On a clean exit, give the lease up so a standby takes over at once."""
        if not self.leading:
            return
        try:
            lease = raw(self.kube.coordination.read_namespaced_lease, self.name, self.namespace)
            if lease and lease["spec"].get("holderIdentity") == self.identity:
                lease["spec"]["holderIdentity"] = None
                lease["spec"].pop("renewTime", None)
                self.kube.coordination.replace_namespaced_lease(self.name, self.namespace, lease)
        except (ApiException, *UNREACHABLE) as err:
            log.info("releasing lease: %s", err)
        self._renewed_at = None
