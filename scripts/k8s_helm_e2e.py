"""`helm install` end to end on a real node (docs/kubernetes.md; slow, not in CI): the chart as a user runs it
brings up the operator, the serving Deployment and the expert-host pool as pods on a kubelet, and every check
below is made from outside the pods.

    dockerd --bridge=none --iptables=false --ip-masq=false --ip6tables=false &    # Debian's docker.io, no bridge
    .venv/bin/python scripts/k8s_helm_e2e.py [--ref HEAD] [--transport T] [--cuda-ipc] [--keep]

Steps (each check prints PASS or FAIL with its timing; the script exits 1 if any failed, and always stops
what it started: the release, the kubelet's containers, the control plane):
1. images: local/pause:3.2; local/moeless-base:<venv hash> (this machine's Python and venv, `docker import`:
   no registry is reachable) and on top of it local/moeless:<tag> with the sources of git ref --ref (the
   committed tree, not the working copy);
2. the default model in this process: its weight store (a hostPath for the hosts), its cache (a hostPath for
   the serving pod) and the reference answers (greedy, the unmodified model, no expert host);
3. control plane + kube-scheduler + kubelet on the docker engine (scripts/k8s_node_e2e.py);
4. `helm install` with the image, hostNetwork and the hostPaths set on the command line;
5. checks: a chat request through the `openai` client equals the reference; `kubectl apply` of more hosts:
   the operator scales out, the new host receives calls, no serving pod restarted, `kubectl get eap` moves;
   each host's data path (`--transport`; auto: shared memory) and the MoE layer's ratio to in-process, warm;
   `kubectl apply` of an ablation (manifests/examples/ablation-no-scaler.yaml's serving knobs): the operator
   writes them; an expert-host pod deleted during a burst: every request completes, exactly; scale to zero
   after the idle delay, and the next request wakes the pool (its latency); `helm uninstall`: no pod, no
   policy, no container, no process of the pods' user left.
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

from k8s_helm_release import (DOCKER, GRPC_PORT, MAX_TOKENS, METRICS_PORT, MODEL_NAME, NS, OPERATOR_PORT,  # noqa: E402
                              POD_USER, QUESTIONS, RELEASE, ROOT, SERVING_PORT, ControlPlane, Kubectl, build_images,
                              host_metrics, log, pod_ready, port_free, run_checks, sh, wait_for)
from k8s_helm_scaling import PoolSizeChecks  # noqa: E402
from k8s_node_e2e import start_node  # noqa: E402
from k8s_support import k8s_binaries  # noqa: E402


def reference_answers(model) -> tuple[dict[str, str], dict[str, float]]:
    """The unmodified default model's greedy answers (no expert host), as tests/serving checks them,
    and its in-process MoE-layer seconds per call by phase (mean; the baseline of the pod's ratio)."""
    from moeless.serving.path_timing import TimedExecutor
    from moeless.serving.api import ChatMessage, GenerationRequest
    from moeless.serving.engine import Engine

    out, timed = {}, TimedExecutor(model.local_executor())
    for q in QUESTIONS:
        request = GenerationRequest(MODEL_NAME, MAX_TOKENS, False, messages=(ChatMessage("user", q),))
        events = [e for step in Engine(model, timed).run([request]) for e in step[0]]
        out[q] = "".join(e.get("text", "") for e in events)
    phases = timed.summary_ms(batch=1)
    return out, {phase: phases[phase]["mean"] / 1e3 for phase in ("prefill", "decode") if phase in phases}


class Run(PoolSizeChecks):
    """The whole run: install (steps 1-4 of the module docstring), then every check in order."""

    def run(self) -> int:
        args = self.args
        if subprocess.run([DOCKER, "info"], capture_output=True).returncode != 0:
            print("k8s_helm_e2e: no docker engine; start `dockerd --bridge=none --iptables=false --ip-masq=false "
                  "--ip6tables=false` first", file=sys.stderr)
            return 2
        busy = [p for p in (GRPC_PORT, GRPC_PORT + 1, METRICS_PORT, METRICS_PORT + 1, SERVING_PORT, OPERATOR_PORT)
                if not port_free(p)]
        if busy:
            print(f"k8s_helm_e2e: ports {busy} are in use on this machine (the pods use the node's network)",
                  file=sys.stderr)
            return 2
        bin_dir = k8s_binaries()
        start = time.monotonic()
        tag = build_images(bin_dir, self.work, args.ref)
        log(f"images: local/pause:3.2, local/moeless:{tag} ({time.monotonic() - start:.0f} s)")

        import torch

        from moeless.model.default import BuildConfig, default_model, model_path
        from moeless.core.paths import cache_dir
        from moeless.model.weight_store import export_store

        torch.set_num_threads(1)
        model = default_model()
        store = Path(export_store(model, MODEL_NAME))
        cache = cache_dir()
        model_dir = model_path(BuildConfig())  # what the serving pod's default_model() loads
        for path in (store, model_dir):  # the pods run as user 10001
            sh("chmod", "-R", "a+rX", str(path))
        os.chmod(cache, os.stat(cache).st_mode | 0o055)
        reference, self.in_process_moe_s = reference_answers(model)
        log(f"default model ready: store {store}, cache {cache}; reference answers computed in process "
            f"(e.g. {QUESTIONS[0]!r} -> {reference[QUESTIONS[0]]!r})")
        del model

        self.plane = ControlPlane(self.work / "k8s", bin_dir).start()
        start_node(self.plane, bin_dir)
        self.kubectl = Kubectl(self.plane.kubeconfig)
        wait_for(lambda: self.kubectl.json("get", "node", "localhost")["metadata"], timeout=60, what="the node")
        log("control plane and node up")

        self.port = SERVING_PORT
        sets = {
            "image.repository": "local/moeless", "image.tag": tag, "image.pullPolicy": "Never",
            "operator.hostNetwork": "true", "operator.metricsPort": str(OPERATOR_PORT), "operator.resyncSeconds": "2",
            "operator.resources.requests.cpu": "50m",
            "policy.model.store": str(store), "policy.model.hostPath": str(store),
            "policy.hosts.minHosts": "1", "policy.hosts.maxHosts": "2", "policy.hosts.gpusPerHost": "0",
            "policy.hosts.cpu": "700m", "policy.hosts.memoryGiBPerHost": "2", "policy.hosts.hostNetwork": "true",
            "policy.hosts.grpcPort": str(GRPC_PORT), "policy.hosts.metricsPort": str(METRICS_PORT),
            "policy.hosts.drainSeconds": "5", "policy.upscaleDelaySeconds": "0", "policy.downscaleDelaySeconds": "30",
            "policy.serving.keepAliveSeconds": "600",
            "serving.hostNetwork": "true", "serving.port": str(self.port),
            "serving.modelCache.hostPath": str(cache),
            "serving.resources.requests.cpu": "500m", "serving.resources.requests.memory": "1Gi",
            "serving.resources.limits.memory": "6Gi",
        }
        if args.planner:
            sets["policy.serving.planner"] = args.planner
        if args.expert_hosts:
            sets["serving.expertHosts"] = args.expert_hosts
        sets["serving.transport"] = args.transport
        if args.cuda_ipc:  # the pods join the node's PID and IPC namespaces (a GPU node's CUDA IPC; here: shared memory)
            sets["serving.cudaIpc"] = sets["policy.hosts.cudaIpc"] = "true"
        # No Service network here (no kube-proxy): the in-cluster client reaches the API server on loopback.
        api_env = json.dumps([{"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
                              {"name": "KUBERNETES_SERVICE_PORT", "value": str(self.plane.port)}])
        command = ["install", RELEASE, str(ROOT / "helm" / "moeless"), "-n", NS, "--create-namespace",
                   *[a for k, v in sets.items() for a in ("--set", f"{k}={v.replace(',', chr(92) + ',')}")],
                   "--set-json", f"operator.env={api_env}", "--set-json", f"serving.env={api_env}"]
        print("helm " + " ".join(command).replace(str(ROOT) + "/", ""), flush=True)
        start = time.monotonic()
        self.helm_cmd(*command)
        self.installed = True
        log("helm install done; waiting for the operator, the pool and the serving pod")
        wait_for(lambda: all(pod_ready(p) for p in self.pods("operator")) and self.pods("operator"), timeout=300,
                 every=1, what="the operator pod Ready")
        log(f"operator pod Ready ({time.monotonic() - start:.0f} s after helm install)")
        self.wait_hosts(1)
        log(f"expert-host pod {RELEASE}-hosts-0 Ready ({time.monotonic() - start:.0f} s)")
        wait_for(lambda: pod_ready(self.serving_pod()), timeout=600, every=2, what="the serving pod Ready")
        wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=5).status == 200,
                 timeout=300, every=2, what="the serving app's /healthz: 200 (its expert hosts live)")
        self.checks.record("helm install: operator, serving Deployment and expert-host pool Ready", True,
                           f"{len(self.pods())} pods on the kubelet, serving /healthz 200", time.monotonic() - start)
        print(self.kubectl("get", "pods", "-n", NS, "-o", "wide").stdout, flush=True)

        self.check_chat(reference)
        self.check_more_hosts(reference)
        self.check_paths(reference)
        self.check_ablation()
        self.check_keep_alive_live()
        self.check_delete_during_burst(reference)
        self.check_eap_moved()
        self.check_scale_to_zero(reference)
        if args.keep:
            print(f"KUBECONFIG={self.plane.kubeconfig}; serving at http://127.0.0.1:{self.port}; Ctrl-C stops everything",
                  flush=True)
            while True:
                time.sleep(3600)
        self.check_uninstall()
        return 0

    def check_chat(self, reference: dict[str, str]) -> None:
        q = QUESTIONS[0]
        answer, seconds = self.chat(q)
        self.checks.record("chat request (openai client) equals the unmodified model's answer", answer == reference[q],
                           f"{answer!r} vs reference {reference[q]!r}", seconds)

    def layer_metrics(self) -> tuple[dict[int, str], dict[str, float], dict[str, float]]:
        """From the serving pod's /metrics: each host slot's data path, and the MoE layer's seconds and
        calls so far by phase."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10).read().decode()
        paths, sums, counts = {}, {}, {}
        for line in text.splitlines():
            if line.startswith("moeless_expert_host_path{") and line.endswith(" 1.0"):
                labels = dict(part.split("=") for part in line[line.index("{") + 1:line.index("}")].replace('"', "").split(","))
                paths[int(labels["slot"])] = labels["path"]
            for kind, into in (("_sum{", sums), ("_count{", counts)):
                if line.startswith("moeless_moe_layer_seconds" + kind):
                    into[line.split('phase="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
        return paths, sums, counts

    def check_paths(self, reference: dict[str, str]) -> None:
        """Which data path the serving pod's calls to each host take, and its MoE layer against the same model's
        in process here (mean per call by phase; the same 2 cores): warm (over one more pass of the questions,
        every replica resident, answers exact) and over every call so far (the cold starts included)."""
        start = time.monotonic()
        _, sums0, counts0 = self.layer_metrics()
        exact = all(self.chat(q)[0] == reference[q] for q in QUESTIONS)
        paths, sums, counts = self.layer_metrics()

        def ratios(s: dict, c: dict) -> str:
            return ", ".join(f"{p} {s[p] / c[p] * 1e3:.2f} ms / {self.in_process_moe_s[p] * 1e3:.2f} ms = "
                             f"{s[p] / c[p] / self.in_process_moe_s[p]:.2f}x" for p in self.in_process_moe_s if c.get(p))
        # --cuda-ipc: every serving and host pod in the node's PID and IPC namespaces, as the chart and operator made them.
        namespaces = {p["metadata"]["name"]: (p["spec"].get("hostPID", False), p["spec"].get("hostIPC", False))
                      for p in self.pods("serving") + self.pods("expert-host")}
        shared = all(pid and ipc for pid, ipc in namespaces.values()) if self.args.cuda_ipc else True
        warm_sums = {p: sums[p] - sums0.get(p, 0.0) for p in sums}
        warm_counts = {p: counts[p] - counts0.get(p, 0.0) for p in counts}
        detail = (", ".join(f"host {slot} {path}" for slot, path in sorted(paths.items())) +
                  (f"; hostPID/hostIPC {namespaces}" if self.args.cuda_ipc else "") + "; MoE layer / in process, "
                  f"warm ({len(QUESTIONS)} requests, exact: {exact}): {ratios(warm_sums, warm_counts)}; over every call "
                  f"so far: {ratios(sums, counts)}")
        self.checks.record("each host's data path and the MoE layer against in-process", sorted(paths) == [0, 1] and
                           exact and shared and all(warm_counts.get(p) for p in self.in_process_moe_s), detail,
                           time.monotonic() - start)

    def check_ablation(self) -> None:
        start = time.monotonic()
        example = yaml.safe_load((ROOT / "manifests" / "examples" / "ablation-no-scaler.yaml").read_text())
        generation = self.eap()["metadata"]["generation"]
        identity = self.serving_identity()
        self.apply_policy(lambda spec: spec.setdefault("serving", {}).update(example["spec"]["serving"]))
        log(f"kubectl apply: the ablation's serving knobs {example['spec']['serving']} on policy {RELEASE}")

        def written():
            cm = self.kubectl.json("get", "configmap", f"{RELEASE}-serving", "-n", NS)
            knobs = yaml.safe_load(cm["data"]["config.yaml"]) or {}
            status = self.eap().get("status") or {}
            return knobs.get("scaler") is False and status.get("observedGeneration", 0) > generation and knobs
        try:
            knobs = wait_for(written, timeout=60, every=1, what="the operator writing the ablation's knobs")
            ok, detail = True, f"ConfigMap {RELEASE}-serving config.yaml now {knobs}"
        except AssertionError as err:
            ok, detail = False, str(err)
        self.checks.record("kubectl apply (an ablation) followed by the operator", ok, detail, time.monotonic() - start)
        # The serving pod's planning loop applies it live (controller/planning/knob_sources.py): the policy's
        # status.servingGeneration reaches the new generation, the same pod (uid, restarts) still serving.
        start = time.monotonic()
        try:
            applied = wait_for(lambda: (self.eap().get("status") or {}).get("servingGeneration", 0) > generation and
                               (self.eap().get("status") or {}).get("servingGeneration"),
                               timeout=60, every=1, what="the serving pod reporting the new knobs' generation")
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10).read().decode()
            gauge = next((line for line in metrics.splitlines() if line.startswith("moeless_knobs_generation")), "")
            ok = self.serving_identity() == identity and gauge.endswith(f" {float(applied)}")
            detail = (f"status.servingGeneration {applied} (was {generation}), /metrics {gauge!r}, serving pod "
                      f"{identity[0][:8]} with {identity[1]} restarts before and {self.serving_identity()} after")
        except AssertionError as err:
            ok, detail = False, str(err)
        self.checks.record("the knobs reach the serving pod live (no restart, generation reported)", ok, detail,
                           time.monotonic() - start)
        print(self.get_eap_table(), flush=True)

    def check_keep_alive_live(self) -> None:
        """`kubectl apply` of keepAliveSeconds: the serving pod's loop sets it on every host (Configure), the
        host pods are not rolled (same uids), the serving pod not restarted."""
        start = time.monotonic()
        hosts_before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in self.pods("expert-host")}
        identity = self.serving_identity()
        self.apply_policy(lambda spec: spec.setdefault("serving", {}).update(keepAliveSeconds=900))
        log("kubectl apply: keepAliveSeconds 600 -> 900")

        def keep_alive(i: int) -> float:
            return host_metrics(i).get("moeless_expert_host_keep_alive_seconds", -1.0)
        try:
            wait_for(lambda: all(keep_alive(i) == 900.0 for i in range(len(hosts_before))), timeout=90, every=1,
                     what="every host's keep-alive at 900 s")
            time.sleep(6)  # the operator passes (resync 2 s) that would roll the pods if the template changed
            hosts_after = {p["metadata"]["name"]: p["metadata"]["uid"] for p in self.pods("expert-host")}
            ok = hosts_after == hosts_before and self.serving_identity() == identity
            detail = (f"hosts' keep-alive {[keep_alive(i) for i in range(len(hosts_before))]} s after "
                      f"{time.monotonic() - start:.1f} s; host pods unchanged: {hosts_after == hosts_before}; serving pod "
                      f"unchanged: {self.serving_identity() == identity}")
        except AssertionError as err:
            ok, detail = False, str(err)
        self.checks.record("kubectl apply of keepAliveSeconds reaches the hosts live (no pod rolled)", ok, detail,
                           time.monotonic() - start)

    def check_uninstall(self) -> None:
        start = time.monotonic()
        self.helm_cmd("uninstall", RELEASE, "-n", NS, "--wait", "--timeout", "180s")
        self.installed = False
        try:
            wait_for(lambda: not self.pods() and not self.kubectl.json("get", "eap", "-A")["items"]
                     and not self.kubectl.json("get", "statefulsets", "-n", NS)["items"], timeout=180, every=1,
                     what="no pod, no policy, no StatefulSet")
            containers = sh(DOCKER, "ps", "-q", "--filter", "name=k8s_").stdout.split()
            procs = subprocess.run(["pgrep", "-u", str(POD_USER)], capture_output=True, text=True).stdout.split()
            ok = not containers and not procs
            detail = (f"no pod, no ExpertAutoscalingPolicy, no StatefulSet; running pod containers {len(containers)}, "
                      f"processes of the pods' user {POD_USER}: {len(procs)}")
        except AssertionError as err:
            ok, detail = False, str(err)
        self.checks.record("helm uninstall leaves no pod, no policy and no process", ok, detail,
                           time.monotonic() - start)


def main() -> int:
    from moeless.expert_fn.options import TRANSPORTS  # the package's imports stay inside functions, as above

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", default="HEAD", help="git ref whose sources go into the image (default HEAD; "
                        "'worktree': the working tree as it is)")
    parser.add_argument("--planner", default="", help="policy.serving.planner (default: the chart's, i.e. moeless's "
                        "default planner)")
    parser.add_argument("--expert-hosts", default="", help="serving.expertHosts (default: the chart's)")
    parser.add_argument("--transport", default="auto", choices=TRANSPORTS,
                        help="serving.transport (default auto: shared memory here, every pod on the node's network; "
                             "tcp: the pod path between nodes, over loopback)")
    parser.add_argument("--cuda-ipc", action="store_true", help="serving.cudaIpc and policy.hosts.cudaIpc: the pods in the "
                        "node's PID and IPC namespaces (CUDA IPC on a GPU node; on a CPU node the shared-memory channel)")
    parser.add_argument("--keep", action="store_true", help="leave the cluster running after the checks (Ctrl-C stops it)")
    return run_checks(Run(parser.parse_args()), "k8s_helm_e2e")


if __name__ == "__main__":
    sys.exit(main())
