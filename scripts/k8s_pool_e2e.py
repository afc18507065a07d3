"""`helm install` of one ExpertPool shared by two models, end to end on a real node (docs/kubernetes.md; slow,
not in CI). The node, images and cleanup are scripts/k8s_helm_release.py's; the chart runs with pool.enabled and two
models: the default model and tiny:mixtral, each with its own policy, serving Deployment and port, on one pool of
expert hosts. Every check is made from outside the pods.

    dockerd --bridge=none --iptables=false --ip-masq=false --ip6tables=false &
    .venv/bin/python scripts/k8s_pool_e2e.py [--ref HEAD]

Checks: both models installed on one pool (one host pod serving both stores); a request to each answered exactly
(the unmodified model's greedy completion, computed here); per-model GB·s in `kubectl get eap` add up to the pool's
in `kubectl get epool`; one model idle past the pool's keep-alive gives its memory back, all but its keep-warm set
(KEEP_WARM replicas), while the other keeps serving, and its next request wakes it (cold starts, its latency, its
serving pod's moeless_model_wake_seconds); `kubectl apply` of a knob reaches that model's serving pod without a
restart (generation reported); a new pool keep-alive reaches the running host without a roll; maxHosts raised
while serving adds a host pod that the model's serving pod calls without a restart; the pool scales to zero when
both are idle and a request of either wakes it; `helm uninstall` leaves nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from k8s_helm_release import METRICS_PORT, NS, RELEASE, run_checks, strip_for_apply, wait_for  # noqa: E402
from k8s_pool_release import KEEP_ALIVE_S, KEEP_WARM, POOL, PROMPTS, PoolRelease, model_meters  # noqa: E402


class PoolRun(PoolRelease):
    """The whole run: install (k8s_pool_release.py), then every check of `checks_in_order`, then the uninstall's.
    A run with other models or checks (k8s_family_e2e.py) overrides it."""

    def checks_in_order(self) -> list:
        return [self.check_each_model_exact, self.check_billing_adds_up, self.check_idle_model_gives_memory_back,
                self.check_live_knob, self.check_pool_keep_alive_live, self.check_max_hosts_live,
                self.check_pool_sleeps_and_wakes]

    def run(self) -> int:
        failed = self.install()
        if failed is not None:
            return failed
        self.tables()
        for check in self.checks_in_order():
            check()
        if not self.checks.ok:
            self.dump()  # the pods' logs, before the uninstall takes them
        self.check_uninstall_pool()
        return 0

    def check_each_model_exact(self) -> None:
        start, results = time.monotonic(), []
        for policy in self.models:
            for prompt in PROMPTS:
                answer, seconds = self.complete(policy, prompt)
                results.append((policy, answer == self.reference[policy][prompt], answer, seconds))
        self.checks.record("a request to each model is answered exactly", all(ok for _, ok, _, _ in results),
                           "; ".join(f"{p}: {a!r} ({s:.1f} s, exact {ok})" for p, ok, a, s in results),
                           time.monotonic() - start)

    def check_billing_adds_up(self) -> None:
        """The pool's rows add up to its total (one status), and each policy's GB·s is its row as of a pool pass
        between two reads of the pool: `kubectl get eap` adds up to `kubectl get epool`."""
        start = time.monotonic()
        time.sleep(6)  # a few operator passes (resync 2 s)
        before = self.epool()["status"]
        billed = {p: self.eap_of(p)["status"]["cost"]["expertGBSeconds"] for p in self.models}
        after = self.epool()["status"]
        rows = {r["policy"]: r["expertGBSeconds"] for r in after["models"]}
        low = {r["policy"]: r["expertGBSeconds"] for r in before["models"]}
        ok = (abs(sum(rows.values()) - after["cost"]["expertGBSeconds"]) < 1e-6
              and all(low[p] - 1e-6 <= billed[p] <= rows[p] + 1e-6 for p in self.models) and all(v > 0 for v in billed.values()))
        self.checks.record("per-model GB·s in kubectl get eap add up to the pool's", ok,
                           f"eap {billed}; pool rows {rows} sum {sum(rows.values()):.4f} = pool "
                           f"{after['cost']['expertGBSeconds']:.4f}", time.monotonic() - start)
        self.tables()

    def check_idle_model_gives_memory_back(self) -> None:
        busy, quiet = self.models
        start = time.monotonic()
        held_before = model_meters(quiet).get("bytes_held", 0.0)
        cold_before = model_meters(quiet).get("cold_starts_total", 0.0)
        warm = self.complete(quiet, PROMPTS[0])[1]  # its replicas resident: a warm request's latency
        exact = True
        while time.monotonic() - start < KEEP_ALIVE_S + 25:  # the busy model keeps serving past the keep-alive
            for prompt in PROMPTS:
                answer, _ = self.complete(busy, prompt)
                exact &= answer == self.reference[busy][prompt]
        quiet_held, busy_held = model_meters(quiet).get("bytes_held", 0.0), model_meters(busy).get("bytes_held", 0.0)
        kept = KEEP_WARM * self.expert_bytes
        self.checks.record("one model idle past the keep-alive gives its memory back but its keep-warm set, while "
                           "the other serves", held_before > kept and quiet_held == kept and busy_held > 0 and exact,
                           f"{quiet} held {held_before / 1e6:.3f} MB -> {quiet_held / 1e6:.3f} MB (its keep-warm set: "
                           f"{KEEP_WARM} replicas, {kept / 1e6:.3f} MB); {busy} holds {busy_held / 1e6:.2f} MB, all its "
                           f"answers exact: {exact}", time.monotonic() - start)
        answer, seconds = self.complete(quiet, PROMPTS[1])
        cold_after = model_meters(quiet).get("cold_starts_total", 0.0)
        port = self.models[quiet].port
        wakes = [line for line in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
                 .splitlines() if line.startswith(("moeless_model_wake_seconds_count", "moeless_model_wake_seconds_sum"))]
        counted = any(line.startswith("moeless_model_wake_seconds_count") and float(line.rsplit(" ", 1)[1]) >= 1
                      for line in wakes)
        self.checks.record("its next request wakes it (experts loaded again), exactly, and the wake is metered",
                           answer == self.reference[quiet][PROMPTS[1]] and cold_after > cold_before and counted,
                           f"{seconds:.2f} s (a warm request: {warm:.2f} s), cold starts {cold_before:.0f} -> "
                           f"{cold_after:.0f}, {answer!r}; its serving pod: {wakes}", seconds)

    def check_live_knob(self) -> None:
        policy = list(self.models)[1]
        start, identity = time.monotonic(), self.identity_of(policy)
        doc = strip_for_apply(self.eap_of(policy))
        generation = self.eap_of(policy)["metadata"]["generation"]
        doc["spec"].setdefault("serving", {})["scaler"] = False
        path = self.work / "knob.yaml"
        path.write_text(yaml.safe_dump(doc))
        self.kubectl("apply", "-f", str(path))
        try:
            applied = wait_for(lambda: (s := self.eap_of(policy).get("status") or {}).get("servingGeneration", 0)
                               > generation and s["servingGeneration"], timeout=90, every=1,
                               what="the serving pod reporting the new generation")
            port = self.models[policy].port
            gauge = next((line for line in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
                          .read().decode().splitlines() if line.startswith("moeless_knobs_generation")), "")
            ok = self.identity_of(policy) == identity and gauge.endswith(f" {float(applied)}")
            detail = (f"{policy}: status.servingGeneration {applied} (was {generation}), /metrics {gauge!r}; pod uid and "
                      f"restarts {identity} -> {self.identity_of(policy)}")
        except AssertionError as err:
            port = self.models[policy].port
            refused = [line for line in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
                       .decode().splitlines() if line.startswith("moeless_knobs_")]
            ok, detail = False, f"{err}; /metrics {refused}"
        self.checks.record("kubectl apply of a knob reaches the model's serving pod live", ok, detail,
                           time.monotonic() - start)

    def check_pool_keep_alive_live(self) -> None:
        start, host = time.monotonic(), self.pods("expert-host")[0]["metadata"]["uid"]
        self.kubectl("patch", "expertpool", POOL, "-n", NS, "--type=merge", "-p",
                     json.dumps({"spec": {"keepAliveSeconds": KEEP_ALIVE_S + 10}}))

        def host_keep_alive() -> float:
            text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=5).read().decode()
            return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                        if line.startswith("moeless_expert_host_keep_alive_seconds"))
        try:
            wait_for(lambda: host_keep_alive() == KEEP_ALIVE_S + 10, timeout=60, every=1, what="the host's keep-alive")
            time.sleep(6)  # the operator passes (resync 2 s) that would roll the pod if the template changed
            same = [p["metadata"]["uid"] for p in self.pods("expert-host")] == [host]
            self.checks.record("a new pool keep-alive reaches the running host without a roll", same,
                               f"host keep-alive {host_keep_alive():g} s after {time.monotonic() - start:.1f} s; same pod: "
                               f"{same}", time.monotonic() - start)
        except AssertionError as err:
            self.checks.record("a new pool keep-alive reaches the running host without a roll", False, str(err),
                               time.monotonic() - start)

    def check_max_hosts_live(self) -> None:
        """maxHosts 1 -> 2 (with minHosts 2: a second host whatever memory the replicas need): the serving pod takes
        the second slot, the loop plans over it and its calls reach host 1 (its metrics on the node's network at
        METRICS_PORT + 1), no restart."""
        policy, start = list(self.models)[0], time.monotonic()
        identity, port = self.identity_of(policy), self.models[policy].port
        self.kubectl("patch", "expertpool", POOL, "-n", NS, "--type=merge", "-p",
                     json.dumps({"spec": {"hosts": {"maxHosts": 2, "minHosts": 2}}}))
        try:
            self.wait_hosts(2, timeout=300)
            def healthz() -> dict:
                return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10).read())
            health = wait_for(lambda: healthz()["pool"] == [0, 1] and healthz(), timeout=120, every=1,
                              what="the serving pod using both slots")
            tokens = lambda: sum(float(line.rsplit(" ", 1)[1]) for line in urllib.request.urlopen(
                f"http://127.0.0.1:{METRICS_PORT + 1}/metrics", timeout=5).read().decode().splitlines()
                if line.startswith("moeless_expert_model_tokens") and f'model="{policy}"' in line)
            exact, deadline = True, time.monotonic() + 90
            while tokens() == 0 and time.monotonic() < deadline:  # until the loop's placement spans host 1
                answer, _ = self.complete(policy, PROMPTS[0])
                exact &= answer == self.reference[policy][PROMPTS[0]]
            ok = tokens() > 0 and exact and self.identity_of(policy) == identity
            detail = (f"{policy}'s /healthz slots {health['slots']}, pool {health['pool']}; host 1 computed "
                      f"{tokens():.0f} tokens of it; answers exact: {exact}; pod uid and restarts {identity} -> "
                      f"{self.identity_of(policy)}")
        except AssertionError as err:
            ok, detail = False, str(err)
        self.checks.record("maxHosts raised while serving: a new host pod is called without a restart", ok, detail,
                           time.monotonic() - start)
        self.tables()

    def check_pool_sleeps_and_wakes(self) -> None:
        delay, start = 20, time.monotonic()
        self.kubectl("patch", "expertpool", POOL, "-n", NS, "--type=merge", "-p",
                     json.dumps({"spec": {"scaleToZero": {"enabled": True, "delaySeconds": delay}}}))
        try:
            wait_for(lambda: not self.pods("expert-host"), timeout=delay + 180, every=1, what="the pool at zero")
        except AssertionError as err:
            self.checks.record("the pool scales to zero when no model is busy", False, str(err), time.monotonic() - start)
            return
        self.checks.record("the pool scales to zero when no model is busy", True,
                           f"no expert-host pod {time.monotonic() - start:.1f} s after the change", time.monotonic() - start)
        self.tables()
        policy = list(self.models)[1]
        try:
            answer, seconds = self.complete(policy, PROMPTS[0], timeout=420)
            ok = answer == self.reference[policy][PROMPTS[0]] and \
                self.epool()["status"].get("wokenBy") is not None
            self.checks.record("a request of one model wakes the shared pool (its annotation, serving's RBAC)", ok,
                               f"{policy} answered in {seconds:.1f} s from zero hosts, {answer!r}; pool wokenBy "
                               f"{self.epool()['status'].get('wokenBy')}", seconds)
        except Exception as err:  # noqa: BLE001
            self.checks.record("a request of one model wakes the shared pool (its annotation, serving's RBAC)", False,
                               f"{type(err).__name__}: {err}", time.monotonic() - start)

    def check_uninstall_pool(self) -> None:
        start = time.monotonic()
        self.helm_cmd("uninstall", RELEASE, "-n", NS, "--wait", "--timeout", "180s")
        self.installed = False
        try:
            wait_for(lambda: not self.pods() and not self.kubectl.json("get", "eap,epool", "-A")["items"]
                     and not self.kubectl.json("get", "statefulsets", "-n", NS)["items"], timeout=180, every=1,
                     what="no pod, no policy, no pool, no StatefulSet")
            ok, detail = True, "no pod, no ExpertAutoscalingPolicy, no ExpertPool, no StatefulSet"
        except AssertionError as err:
            ok, detail = False, str(err)
        self.checks.record("helm uninstall leaves no pod, policy or pool", ok, detail, time.monotonic() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", default="HEAD", help="git ref whose sources go into the image (default HEAD; "
                        "'worktree': the working tree as it is)")
    return run_checks(PoolRun(parser.parse_args()), "k8s_pool_e2e")


if __name__ == "__main__":
    sys.exit(main())
