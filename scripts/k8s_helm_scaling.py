"""The helm release's checks of the pool's size (scripts/k8s_helm_e2e.py runs them): more hosts applied and
followed without a serving restart, an expert-host pod deleted during a burst, `kubectl get eap`'s columns over
it all, scale to zero after the idle delay and the next request waking the pool.
"""

from __future__ import annotations

import concurrent.futures as futures
import time

from k8s_helm_release import NS, QUESTIONS, RELEASE, Release, calls_of, host_metrics, log, wait_for


class PoolSizeChecks(Release):
    """Checks that change how many expert hosts run (each records its result in self.checks)."""

    def check_more_hosts(self, reference: dict[str, str]) -> None:
        start = time.monotonic()
        before_eap = self.eap().get("status") or {}
        identity = self.serving_identity()
        print(self.get_eap_table(), flush=True)
        self.apply_policy(lambda spec: spec["hosts"].update(minHosts=2))
        log("kubectl apply: minHosts 1 -> 2")
        wait_for(lambda: self.kubectl.json("get", "statefulset", f"{RELEASE}-hosts", "-n", NS)["spec"]["replicas"] == 2,
                 timeout=120, every=1, what="the operator scaling the pool to 2")
        scaled = time.monotonic() - start
        self.wait_hosts(2)
        ready = time.monotonic() - start
        self.checks.record("kubectl apply (more hosts) followed by the operator", True,
                           f"StatefulSet at 2 after {scaled:.1f} s, pod {RELEASE}-hosts-1 Ready after {ready:.1f} s",
                           ready)
        # The new host must receive calls from the running serving pod (no restart).
        t = time.monotonic()
        calls0 = calls_of(host_metrics(1))
        answers, exact = [], True
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for q in QUESTIONS:
                answer, _ = self.chat(q)
                exact &= answer == reference[q]
                answers.append(answer)
            if calls_of(host_metrics(1)) > calls0:
                break
        calls1 = calls_of(host_metrics(1))
        same = self.serving_identity() == identity
        self.checks.record("the new host receives calls without restarting any serving pod",
                           calls1 > calls0 and same and exact,
                           f"host 1 calls/tokens {calls0:.0f} -> {calls1:.0f} over {len(answers)} requests (all exact: "
                           f"{exact}); serving pod uid and restarts unchanged: {same}", time.monotonic() - t)
        time.sleep(6)  # an operator pass or two (resync 2 s) reads the hosts' meters
        self.snapshots = [("installed", before_eap), ("scaled out", self.eap().get("status") or {})]
        print(self.get_eap_table(), flush=True)

    def check_eap_moved(self) -> None:
        """kubectl get eap's columns over the run: hosts and replicas grow with the pool, GB·s all along, cold
        starts shown at every step and never falling (a cumulative meter of loads on the critical path: with the
        static planner the replacement of a deleted pod loads on demand and it rises; the moeless planner
        prefetches a host's static share as it joins, so there it may stay flat)."""
        if len(self.snapshots) < 2:
            self.checks.record("kubectl get eap shows hosts, replicas, cold starts and GB·s moving", False,
                               "the scale-out did not finish", 0.0)
            return
        time.sleep(6)
        self.snapshots.append(("after the deletion", self.eap().get("status") or {}))
        print(self.get_eap_table(), flush=True)
        col = {"hostsReady": lambda st: st.get("hostsReady"), "replicas": lambda st: st.get("replicas"),
               "coldStarts": lambda st: st.get("coldStarts"),
               "expertGBSeconds": lambda st: round((st.get("cost") or {}).get("expertGBSeconds") or 0, 2)}
        series = {k: [f(st) or 0 for _, st in self.snapshots] for k, f in col.items()}
        ok = (series["hostsReady"][1] == 2 and series["replicas"][1] > series["replicas"][0]
              and all(st.get("coldStarts") is not None for _, st in self.snapshots)
              and series["coldStarts"] == sorted(series["coldStarts"])
              and series["expertGBSeconds"][0] < series["expertGBSeconds"][1] < series["expertGBSeconds"][2])
        stages = " -> ".join(name for name, _ in self.snapshots)
        self.checks.record("kubectl get eap shows hosts, replicas, cold starts and GB·s moving", ok,
                           f"({stages}) " + ", ".join(f"{k} {' -> '.join(map(str, v))}" for k, v in series.items()), 12.0)

    def check_delete_during_burst(self, reference: dict[str, str]) -> None:
        start = time.monotonic()
        identity = self.serving_identity()
        burst = [QUESTIONS[i % len(QUESTIONS)] for i in range(8)]
        before = [calls_of(host_metrics(i)) for i in (0, 1)]
        with futures.ThreadPoolExecutor(len(burst)) as pool:
            jobs = [pool.submit(self.chat, q) for q in burst]
            time.sleep(2.0)
            during = [calls_of(host_metrics(i)) - b for i, b in zip((0, 1), before)]
            # A host that is serving this burst; host 0 if both are: it has held replicas the longest, so the other
            # host must load some of them on demand (cold starts) when it takes over.
            i = 0 if during[0] > 0 else 1
            victim = f"{RELEASE}-hosts-{i}"
            self.kubectl("delete", "pod", victim, "-n", NS, "--wait=false")
            log(f"deleted pod {victim} (it had taken {during[i]:.0f} layer calls of this burst; host calls "
                f"{during}) with {sum(not j.done() for j in jobs)} of {len(burst)} requests in flight")
            results = []
            for q, job in zip(burst, jobs):
                try:
                    answer, seconds = job.result()
                    results.append((answer == reference[q], seconds, answer))
                except Exception as err:  # noqa: BLE001 - a failed request is what this check counts
                    results.append((False, 0.0, f"{type(err).__name__}: {err}"))
        exact = sum(ok for ok, _, _ in results)
        bad = [r[2] for r in results if not r[0]]
        self.last_request = time.monotonic()
        self.checks.record("expert-host pod deleted during a burst: every request completes, exactly",
                           exact == len(burst) and self.serving_identity() == identity and during[i] > 0,
                           f"{victim} deleted while serving the burst ({during[i]:.0f} layer calls); "
                           f"{exact}/{len(burst)} exact, slowest {max(s for _, s, _ in results):.1f} s"
                           + (f"; not exact: {bad[:3]}" if bad else ""), time.monotonic() - start)
        t = time.monotonic()
        self.wait_hosts(2)
        log(f"the StatefulSet restarted {victim}: Ready again after {time.monotonic() - t:.1f} s")
        for q in QUESTIONS:  # the pool at work again (the restarted host's replicas load on demand or by prefetch)
            self.chat(q)
        self.last_request = time.monotonic()

    def check_scale_to_zero(self, reference: dict[str, str]) -> None:
        delay = 30
        answer, _ = self.chat(QUESTIONS[1])  # the last request: the idle delay counts from here
        self.last_request = start = time.monotonic()
        self.apply_policy(lambda spec: spec.update(scaleToZero={"enabled": True, "delaySeconds": delay}))
        log(f"kubectl apply: scaleToZero enabled, delaySeconds {delay}; no requests from now on")
        try:
            wait_for(lambda: not self.pods("expert-host") and
                     self.kubectl.json("get", "statefulset", f"{RELEASE}-hosts", "-n", NS)["spec"]["replicas"] == 0,
                     timeout=delay + 180, every=1, what="the pool at zero")
            idle = time.monotonic() - self.last_request
            self.checks.record("scale to zero after the idle delay", idle >= delay,
                               f"no expert-host pod {idle:.1f} s after the last request, {time.monotonic() - start:.1f} s "
                               f"after the policy change (delay {delay} s, then the hosts drain)", time.monotonic() - start)
        except AssertionError as err:
            self.checks.record("scale to zero after the idle delay", False, str(err), time.monotonic() - start)
            return
        print(self.get_eap_table(), flush=True)
        q = QUESTIONS[0]
        try:
            answer, seconds = self.chat(q, timeout=420)
            self.checks.record("the next request wakes the pool", answer == reference[q],
                               f"answered in {seconds:.1f} s (latency from zero hosts), {answer!r}; "
                               f"expert-host pods now {len(self.pods('expert-host'))}", seconds)
        except Exception as err:  # noqa: BLE001
            self.checks.record("the next request wakes the pool", False, f"{type(err).__name__}: {err}; expert-host "
                               f"pods {len(self.pods('expert-host'))}", time.monotonic() - start)
