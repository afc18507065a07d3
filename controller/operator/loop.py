"""The operator's control loop: every resync (sooner when a policy changes), reconcile every policy.

Why the kubernetes client and not Kopf: the reconcile is one pure function of the whole observed
state (reconcile.py), not a set of per-event handlers; time-driven steps (keep-alive, scale to
zero) need a periodic pass anyway; leader election must be a real Lease (Kopf's peering only
pauses peers); and the client is already a dependency, so the shell stays ~300 lines we own.

A watch on policies only wakes the loop early; correctness never depends on seeing an event. Any
error (server restarting, conflict, a reply the client cannot parse, a bug) ends that owner's pass,
logged, and the others go on; the next pass starts from what is there. Metrics:
moeless_operator_heartbeat_timestamp_seconds (last finished pass),
moeless_operator_reconciles_total{result}, moeless_operator_leader.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable

from kubernetes import watch
from kubernetes.client.rest import ApiException
from prometheus_client import CollectorRegistry, Counter, Gauge

from moeless.controller.operator import objects as obj
from moeless.controller.operator.kube import UNREACHABLE, Kube
from moeless.controller.operator.leader import LeaderElector
from moeless.controller.operator.pool_reconcile import reconcile_pool
from moeless.controller.operator.reconcile import reconcile

log = logging.getLogger("moeless.operator")


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.heartbeat = Gauge("moeless_operator_heartbeat_timestamp_seconds",
                               "when the last reconcile pass over all policies finished", registry=self.registry)
        self.reconciles = Counter("moeless_operator_reconciles", "policy reconciles by result", ["result"],
                                  registry=self.registry)
        self.leader = Gauge("moeless_operator_leader", "1 while this replica holds the lease", registry=self.registry)
        self.policies = Gauge("moeless_operator_policies", "policies seen in the last pass", registry=self.registry)


class Operator:
    """Reconciles the policies of one namespace (None: all) until stopped."""

    def __init__(self, kube: Kube, namespace: str | None = None, resync_s: float = 10.0,
                 clock: Callable[[], float] = time.time, elector: LeaderElector | None = None) -> None:
        self.kube, self.namespace, self.resync_s, self.clock, self.elector = kube, namespace, resync_s, clock, elector
        self.metrics = OperatorMetrics()
        self._wake = threading.Event()
        self._watches: dict[str, watch.Watch] = {}

    # -- one pass -------------------------------------------------------------------------------
    def pass_once(self) -> int:
        """Reconcile every ExpertPool, then every policy (and the leftovers of deleted ones: a
        policy's copy of its pool's figures is then at most one pass old); returns how many failed."""
        failed = 0
        policies = self.kube.list_policies(self.namespace)
        pools = self.kube.list_pools(self.namespace)
        self.metrics.policies.set(len(policies))
        work = []
        for kind, items in ((obj.POOL_KIND, pools), (obj.KIND, policies)):
            live = {_key(p): p for p in items}
            work += [(kind, key, live[key]) for key in sorted(live)]
            work += [(kind, key, None) for key in sorted(self.kube.managed_pools(self.namespace, kind) - set(live))]
        pool_hosts: dict[tuple[str, str], tuple[list, dict]] = {}  # read once a pass: the pool's policies reuse them
        for kind, (namespace, name), owner in work:
            try:
                now = self.clock()
                if kind == obj.POOL_KIND:
                    observed = self.kube.observe_pool(namespace, name, owner, policies)
                    pool_hosts[(namespace, name)] = (list(observed.pods), dict(observed.meters))
                    actions = reconcile_pool(name, owner, observed, now)
                else:
                    observed = self.kube.observe(namespace, name, owner, policies, pool_hosts)
                    actions = reconcile(name, owner, observed, now)
                refused = self.kube.apply(namespace, owner, actions, now)
                for action in actions:
                    log.debug("%s/%s: %s", namespace, name, action)
                self.metrics.reconciles.labels("conflict" if refused else "ok").inc()
            except (ApiException, *UNREACHABLE) as err:
                failed += 1
                self.metrics.reconciles.labels("error").inc()
                log.warning("%s/%s: %s (next pass retries)", namespace, name, describe(err))
            except Exception:  # noqa: BLE001 (a bug or an odd reply for one owner must not stop the others)
                failed += 1
                self.metrics.reconciles.labels("error").inc()
                log.exception("%s/%s: unexpected error (next pass retries)", namespace, name)
        return failed

    # -- the loop -------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        for plural in (obj.PLURAL, obj.POOL_PLURAL):
            threading.Thread(target=self._watch, args=(stop, plural), name=f"watch-{plural}", daemon=True).start()
        if self.elector is not None:
            threading.Thread(target=self.elector.run, args=(stop,), name="leader-election", daemon=True).start()
        while not stop.is_set():
            leading = self.elector is None or self.elector.leading
            self.metrics.leader.set(1 if leading else 0)
            if leading:
                try:
                    self.pass_once()
                    self.metrics.heartbeat.set(self.clock())
                except (ApiException, *UNREACHABLE) as err:
                    log.warning("listing policies: %s (retrying)", describe(err))
            self._wake.wait(self.resync_s if leading else 1.0)
            self._wake.clear()
        for watcher in self._watches.values():
            watcher.stop()
        if self.elector is not None:
            self.elector.release()

    def _watch(self, stop: threading.Event, plural: str) -> None:
        """Wake the loop when a policy (or pool) is added, deleted or changed; restart the watch when it
        ends or fails (retried every second, e.g. while the ExpertPool CRD is not installed)."""
        custom, last = self.kube.custom, None
        while not stop.is_set():
            watcher = self._watches[plural] = watch.Watch()
            try:
                if self.namespace:
                    stream = watcher.stream(custom.list_namespaced_custom_object, obj.GROUP, obj.VERSION,
                                            self.namespace, plural, timeout_seconds=60)
                else:
                    stream = watcher.stream(custom.list_cluster_custom_object, obj.GROUP, obj.VERSION, plural,
                                            timeout_seconds=60)
                seen: dict[str, tuple] = {}
                for event in stream:
                    meta = event["object"].get("metadata", {})
                    # Our own status writes come back as events too: wake only for the user's changes.
                    mark = (meta.get("generation"), json.dumps(meta.get("annotations"), sort_keys=True))
                    if event["type"] != "MODIFIED" or seen.get(meta.get("uid")) != mark:
                        self._wake.set()
                    seen[meta.get("uid")] = mark
                last = None  # it ran: the next failure is news
            except (ApiException, ValueError, *UNREACHABLE) as err:
                reason = str(getattr(err, "reason", err))
                if reason != last:  # once per reason: a missing CRD would log every second
                    log.info("%s watch ended: %s (retried every second)", plural, reason)
                last = reason
                stop.wait(1.0)


def describe(err: Exception) -> str:
    """An API error's own message (the server names the field), else the exception."""
    if isinstance(err, ApiException):
        try:
            return f"{err.status} {json.loads(err.body)['message']}"
        except (TypeError, ValueError, KeyError):
            return f"{err.status} {err.reason}"
    return str(err)


def _key(policy: dict) -> tuple[str, str]:
    return policy["metadata"]["namespace"], policy["metadata"]["name"]
