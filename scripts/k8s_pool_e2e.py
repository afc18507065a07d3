"""`helm install` of one ExpertPool shared by two models, end to end on a real node (docs/kubernetes.md; slow,
not in CI). The node, images and cleanup are scripts/k8s_helm_e2e.py's; the chart runs with pool.enabled and two
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
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from k8s_helm_e2e import (DOCKER, GRPC_PORT, METRICS_PORT, NS, OPERATOR_PORT, RELEASE, ROOT, ControlPlane,  # noqa: E402
                          Kubectl, Run, build_images, k8s_binaries, log, pod_ready, port_free, run_checks, sh,
                          start_node, strip_for_apply, wait_for)

POOL = f"{RELEASE}-pool"
MODELS = {"moeless-default": ("default", 18000), "tiny-mixtral": ("tiny:mixtral", 18001)}  # policy: (--model, port)
PROMPTS = ("The capital of France is", "Three primary colours are")
MAX_TOKENS = 12
KEEP_ALIVE_S = 20
KEEP_WARM = 3  # replicas of the quiet model its keepWarmGiB holds past the keep-alive


def references() -> tuple[dict[str, dict[str, str]], dict[str, Path]]:
    """Each model's greedy completions in process (no expert host) and its weight store."""
    # torch and the models load here, once the docker engine and the ports are checked (as k8s_helm_e2e)
    from moeless.serving.api import GenerationRequest
    from moeless.serving.config import choose_model
    from moeless.model.weight_store import export_store
    from moeless.serving.engine import Engine

    answers, stores = {}, {}
    for policy, (flag, _) in MODELS.items():
        choice = choose_model(flag)
        model = (choice.first_load or choice.loader)()
        stores[policy] = Path(export_store(model, choice.name))
        engine = Engine(model, model.local_executor())
        answers[policy] = {}
        for prompt in PROMPTS:
            request = GenerationRequest(choice.name, MAX_TOKENS, False, prompt=prompt)
            answers[policy][prompt] = "".join(e.get("text", "") for step in engine.run([request]) for e in step[0])
    return answers, stores


def model_meters(name: str) -> dict[str, float]:
    """The pool host's moeless_expert_model_* values of one model (host 0, on the node's network)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("moeless_expert_model_") and f'model="{name}"' in line:
            out[line.split("{")[0].removeprefix("moeless_expert_model_")] = float(line.rsplit(" ", 1)[1])
    return out


class PoolRun(Run):
    def complete(self, policy: str, prompt: str, timeout: float = 300) -> tuple[str, float]:
        from openai import OpenAI  # the test extra; the checks above run without it

        flag, port = MODELS[policy]
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=timeout, max_retries=0)
        start = time.perf_counter()
        reply = client.completions.create(model=self.served[policy], prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        return reply.choices[0].text, time.perf_counter() - start

    def serving_pod_of(self, policy: str) -> dict:
        pods = [p for p in self.kubectl.json("get", "pods", "-n", NS, "-l", f"moeless.io/serves={policy}")["items"]
                if not p["metadata"].get("deletionTimestamp")]
        assert len(pods) == 1, f"{len(pods)} serving pods of {policy}"
        return pods[0]

    def identity_of(self, policy: str) -> tuple[str, int]:
        pod = self.serving_pod_of(policy)
        return pod["metadata"]["uid"], sum(c.get("restartCount", 0) for c in pod["status"].get("containerStatuses") or [])

    def epool(self) -> dict:
        return self.kubectl.json("get", "expertpool", POOL, "-n", NS)

    def eap_of(self, policy: str) -> dict:
        return self.kubectl.json("get", "eap", policy, "-n", NS)

    def tables(self) -> None:
        print(self.kubectl("get", "epool,eap", "-n", NS, "-o", "wide").stdout, flush=True)

    def run(self) -> int:
        if subprocess.run([DOCKER, "info"], capture_output=True).returncode != 0:
            print("k8s_pool_e2e: no docker engine; start dockerd first (see the docstring)", file=sys.stderr)
            return 2
        busy = [p for p in (GRPC_PORT, METRICS_PORT, OPERATOR_PORT, *(port for _, port in MODELS.values()))
                if not port_free(p)]
        if busy:
            print(f"k8s_pool_e2e: ports {busy} are in use on this machine", file=sys.stderr)
            return 2
        bin_dir = k8s_binaries()
        tag = build_images(bin_dir, self.work, self.args.ref)
        import torch  # heavy: only once the checks above passed (as k8s_helm_e2e)

        from moeless.core.paths import cache_dir
        from moeless.model.default import BuildConfig, model_path
        from moeless.serving.config import choose_model

        torch.set_num_threads(1)
        self.reference, stores = references()
        from moeless.model.weight_store import WeightStore

        self.expert_bytes = WeightStore.open(stores[list(MODELS)[1]]).expert_bytes(0, 0)  # the quiet model's
        self.served = {policy: choose_model(flag).name for policy, (flag, _) in MODELS.items()}
        models_dir = self.work / "models"  # the pool's storage: one directory holding both stores
        models_dir.mkdir()
        for policy, store in stores.items():
            sh("cp", "-r", str(store), str(models_dir / policy))
        cache = cache_dir()
        for path in (models_dir, model_path(BuildConfig())):  # the pods run as user 10001
            sh("chmod", "-R", "a+rX", str(path))
        os.chmod(cache, os.stat(cache).st_mode | 0o055)
        log(f"models ready in {models_dir}: {', '.join(MODELS)}; references computed in process")

        self.plane = ControlPlane(self.work / "k8s", bin_dir).start()
        start_node(self.plane, bin_dir)
        self.kubectl = Kubectl(self.plane.kubeconfig)
        wait_for(lambda: self.kubectl.json("get", "node", "localhost")["metadata"], timeout=60, what="the node")
        values = {
            "image": {"repository": "local/moeless", "tag": tag, "pullPolicy": "Never"},
            "operator": {"hostNetwork": True, "metricsPort": OPERATOR_PORT, "resyncSeconds": 2,
                         "resources": {"requests": {"cpu": "50m"}}},
            "pool": {"enabled": True, "storage": {"hostPath": str(models_dir), "mountPath": "/models"},
                     "keepAliveSeconds": KEEP_ALIVE_S, "upscaleDelaySeconds": 0, "downscaleDelaySeconds": 30,
                     "hosts": {"minHosts": 1, "maxHosts": 1, "gpusPerHost": 0, "cpu": "500m", "memoryGiBPerHost": 2,
                               "hostNetwork": True, "grpcPort": GRPC_PORT, "metricsPort": METRICS_PORT,
                               "drainSeconds": 5},
                     "models": [{"name": policy, "store": f"/models/{policy}", "port": port,
                                 **({"model": flag} if flag != "default" else {}),
                                 **({"keepWarmGiB": (KEEP_WARM + 0.5) * self.expert_bytes / 2**30} if i == 1 else {}),
                                 "guaranteedGiB": 0.05, "serving": {"keepAliveSeconds": KEEP_ALIVE_S}}
                                for i, (policy, (flag, port)) in enumerate(MODELS.items())]},
            "serving": {"hostNetwork": True, "modelCache": {"hostPath": str(cache)},
                        "resources": {"requests": {"cpu": "400m", "memory": "1Gi"}, "limits": {"memory": "6Gi"}},
                        "env": [{"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
                                {"name": "KUBERNETES_SERVICE_PORT", "value": str(self.plane.port)}]},
        }
        values["operator"]["env"] = values["serving"]["env"]
        path = self.work / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        print(yaml.safe_dump(values["pool"]), flush=True)
        start = time.monotonic()
        self.helm_cmd("install", RELEASE, str(ROOT / "helm" / "moeless"), "-n", NS, "--create-namespace", "-f", str(path))
        self.installed = True
        self.wait_hosts(1, timeout=300)
        for policy, (_, port) in MODELS.items():
            wait_for(lambda: pod_ready(self.serving_pod_of(policy)), timeout=900, every=2, what=f"{policy}'s serving pod")
            wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).status == 200,
                     timeout=300, every=2, what=f"{policy}'s /healthz 200")
        command = " ".join(self.pods("expert-host")[0]["spec"]["containers"][0]["command"])
        both = all(f"--store {policy}=/models/{policy}" in command for policy in MODELS)
        self.checks.record("helm install: one pool, two models, each with its policy and serving pod", both,
                           f"{len(self.pods())} pods; the pool's host runs {command.split('exec ')[-1][:160]}...",
                           time.monotonic() - start)
        self.tables()
        self.check_each_model_exact()
        self.check_billing_adds_up()
        self.check_idle_model_gives_memory_back()
        self.check_live_knob()
        self.check_pool_keep_alive_live()
        self.check_max_hosts_live()
        self.check_pool_sleeps_and_wakes()
        if not self.checks.ok:
            self.dump()  # the pods' logs, before the uninstall takes them
        self.check_uninstall_pool()
        return 0

    def check_each_model_exact(self) -> None:
        start, results = time.monotonic(), []
        for policy in MODELS:
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
        billed = {p: self.eap_of(p)["status"]["cost"]["expertGBSeconds"] for p in MODELS}
        after = self.epool()["status"]
        rows = {r["policy"]: r["expertGBSeconds"] for r in after["models"]}
        low = {r["policy"]: r["expertGBSeconds"] for r in before["models"]}
        ok = (abs(sum(rows.values()) - after["cost"]["expertGBSeconds"]) < 1e-6
              and all(low[p] - 1e-6 <= billed[p] <= rows[p] + 1e-6 for p in MODELS) and all(v > 0 for v in billed.values()))
        self.checks.record("per-model GB·s in kubectl get eap add up to the pool's", ok,
                           f"eap {billed}; pool rows {rows} sum {sum(rows.values()):.4f} = pool "
                           f"{after['cost']['expertGBSeconds']:.4f}", time.monotonic() - start)
        self.tables()

    def check_idle_model_gives_memory_back(self) -> None:
        busy, quiet = MODELS
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
        _, port = MODELS[quiet]
        wakes = [line for line in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
                 .splitlines() if line.startswith(("moeless_model_wake_seconds_count", "moeless_model_wake_seconds_sum"))]
        counted = any(line.startswith("moeless_model_wake_seconds_count") and float(line.rsplit(" ", 1)[1]) >= 1
                      for line in wakes)
        self.checks.record("its next request wakes it (experts loaded again), exactly, and the wake is metered",
                           answer == self.reference[quiet][PROMPTS[1]] and cold_after > cold_before and counted,
                           f"{seconds:.2f} s (a warm request: {warm:.2f} s), cold starts {cold_before:.0f} -> "
                           f"{cold_after:.0f}, {answer!r}; its serving pod: {wakes}", seconds)

    def check_live_knob(self) -> None:
        policy = list(MODELS)[1]
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
            _, port = MODELS[policy]
            gauge = next((line for line in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
                          .read().decode().splitlines() if line.startswith("moeless_knobs_generation")), "")
            ok = self.identity_of(policy) == identity and gauge.endswith(f" {float(applied)}")
            detail = (f"{policy}: status.servingGeneration {applied} (was {generation}), /metrics {gauge!r}; pod uid and "
                      f"restarts {identity} -> {self.identity_of(policy)}")
        except AssertionError as err:
            _, port = MODELS[policy]
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
        policy, start = list(MODELS)[0], time.monotonic()
        identity, (_, port) = self.identity_of(policy), MODELS[policy]
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
        policy = list(MODELS)[1]
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
