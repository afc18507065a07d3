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
import concurrent.futures as futures
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "k8s"))
sys.path.insert(0, str(ROOT / "scripts"))

from k8s_node_e2e import DOCKER, build_pause_image, image_sources, sh, start_node, writable_tmp  # noqa: E402
from k8s_support import ControlPlane, Kubectl, helm_binary, k8s_binaries, wait_for  # noqa: E402

NS = "moeless"
RELEASE = "moeless"  # the policy is named after the release; its pool is StatefulSet moeless-hosts
MODEL_NAME = "moeless-default"
# On the node's network: host i on GRPC_PORT + i and METRICS_PORT + i. Below Linux's ephemeral range (32768-60999): a
# port there may be taken for a moment by any outgoing connection on the machine (a restarted host then fails to bind).
GRPC_PORT, METRICS_PORT, SERVING_PORT, OPERATOR_PORT = 31051, 19400, 18000, 18080
POD_USER = 10001
QUESTIONS = ("What is the capital of France?", "Name three primary colours.", "Write a haiku about the sea.",
             "What is 12 times 12?")
MAX_TOKENS = 16
T0 = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} {time.monotonic() - T0:7.1f} s] {message}", flush=True)


class Checks:
    """Each check: name, passed, detail, seconds; a failed check does not stop the run unless it must."""

    def __init__(self) -> None:
        self.results: list[tuple[str, bool, str, float]] = []

    def record(self, name: str, passed: bool, detail: str, seconds: float) -> bool:
        self.results.append((name, passed, detail, seconds))
        log(f"{'PASS' if passed else 'FAIL'} {name} ({seconds:.1f} s): {detail}")
        return passed

    def summary(self) -> str:
        lines = [f"  {'PASS' if ok else 'FAIL'}  {s:6.1f} s  {name}: {detail}" for name, ok, detail, s in self.results]
        return "\n".join(lines)

    @property
    def ok(self) -> bool:
        return bool(self.results) and all(ok for _, ok, _, _ in self.results)


# 1. Images ------------------------------------------------------------------------------------------------

def build_images(bin_dir: Path, work: Path, ref: str) -> str:
    """local/pause:3.2, the base (Python + venv, no sources) and local/moeless:<tag>; returns the tag."""
    build_pause_image(bin_dir, work)
    venv = Path(sys.prefix)
    site = next((venv / "lib").glob("python3*/site-packages"))
    venv_hash = hashlib.sha256("\n".join(sorted(p.name for p in site.iterdir())).encode()).hexdigest()[:12]
    base = f"local/moeless-base:{venv_hash}"
    if subprocess.run([DOCKER, "image", "inspect", base], capture_output=True).returncode != 0:
        log(f"building {base} from this machine's Python and venv (first time: about a minute) ...")
        python_home = Path(os.path.realpath(venv / "bin" / "python")).parents[1]
        paths = ["/bin", "/lib", "/lib64", "/sbin", "/usr/bin", "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/etc",
                 str(python_home), str(venv)]
        changes = [f"ENV PATH={venv}/bin:/usr/bin:/bin", "ENV HOME=/tmp", "USER 10001:10001", "WORKDIR /tmp"]
        tar = subprocess.Popen(["tar", "-c", "--mode=a+rX", "--exclude=__pycache__", *[p for p in paths if Path(p).exists()],
                                *writable_tmp(work)],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        subprocess.run([DOCKER, "import", *[a for c in changes for a in ("--change", c)], "-", base], stdin=tar.stdout,
                       check=True, capture_output=True)
        tar.wait()
    # The sources of `ref` (or the working tree) where the venv's editable install looks for them (ROOT).
    if ref == "worktree":
        archive = subprocess.run(["tar", "-c", "--mode=a+rX", "--sort=name", "--mtime=@0", "--owner=0", "--group=0",
                                  "--exclude=__pycache__", "-C", "/", *(str((ROOT / p).relative_to("/")) for p in image_sources())],
                                 check=True, capture_output=True).stdout
        tag = f"worktree-{hashlib.sha256(archive).hexdigest()[:12]}-{venv_hash[:6]}"
    else:
        commit = sh("git", "-C", str(ROOT), "rev-parse", ref).stdout.strip()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", f"--prefix={ROOT.relative_to('/')}/",
                                  commit, *image_sources()], check=True, capture_output=True).stdout
        tag = f"{commit[:12]}-{venv_hash[:6]}"
    image = f"local/moeless:{tag}"
    if subprocess.run([DOCKER, "image", "inspect", image], capture_output=True).returncode != 0:
        src = work / "src"
        src.mkdir(exist_ok=True)
        (src / "sources.tar").write_bytes(archive)
        (src / "Dockerfile").write_text(f"FROM {base}\nADD sources.tar /\n")  # git archive: files a+r, dirs a+rx
        sh(DOCKER, "build", "-q", "-t", image, str(src))
    return tag


# 2. The model, in this process ----------------------------------------------------------------------------

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


# Helpers ----------------------------------------------------------------------------------------------------

def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: TIME_WAIT is no obstacle
        try:
            s.bind(("0.0.0.0", port))
            return True
        except OSError:
            return False


def host_metrics(i: int) -> dict[str, float]:
    """Expert host i's Prometheus counters (on the node's network: port METRICS_PORT + i)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT + i}/metrics", timeout=5).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                values[name.split("{")[0]] = values.get(name.split("{")[0], 0.0) + float(value)
            except ValueError:
                pass
    return values


def calls_of(metrics: dict[str, float]) -> float:
    """A host's Invoke calls so far (moeless_expert_host_invocations: one per layer per call)."""
    return metrics.get("moeless_expert_host_invocations_total", 0.0)


def pod_ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in (pod.get("status") or {}).get("conditions") or [])


def strip_for_apply(obj: dict) -> dict:
    meta = obj["metadata"]
    keep = {k: meta[k] for k in ("name", "namespace", "labels", "annotations") if k in meta}
    keep.get("annotations", {}).pop("kubectl.kubernetes.io/last-applied-configuration", None)
    return {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "metadata": keep, "spec": obj["spec"]}


# The run -----------------------------------------------------------------------------------------------------

class Run:
    def __init__(self, args) -> None:
        self.args = args
        self.checks = Checks()
        self.work = Path(tempfile.mkdtemp(prefix="moeless-helm-"))
        os.chmod(self.work, 0o755)
        self.plane: ControlPlane | None = None
        self.kubectl: Kubectl | None = None
        self.helm = str(helm_binary())
        self.installed = False
        self.port = 0
        self.last_request = time.monotonic()
        self.snapshots: list[tuple[str, dict]] = []

    def helm_cmd(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        result = subprocess.run([self.helm, *args, "--kubeconfig", str(self.plane.kubeconfig)], capture_output=True,
                                text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)}: {result.stderr}")
        return result

    def pods(self, component: str | None = None) -> list[dict]:
        selector = ["-l", f"app.kubernetes.io/component={component}"] if component else []
        return self.kubectl.json("get", "pods", "-n", NS, *selector)["items"]

    def eap(self) -> dict:
        return self.kubectl.json("get", "eap", RELEASE, "-n", NS)

    def get_eap_table(self) -> str:
        return self.kubectl("get", "eap", "-n", NS, "-o", "wide").stdout

    def chat(self, question: str, timeout: float = 300) -> tuple[str, float]:
        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", timeout=timeout, max_retries=0)
        start = time.perf_counter()
        reply = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": question}],
                                               max_tokens=MAX_TOKENS, temperature=0)
        return reply.choices[0].message.content, time.perf_counter() - start

    def serving_pod(self) -> dict:
        pods = [p for p in self.pods("serving") if not p["metadata"].get("deletionTimestamp")]
        assert len(pods) == 1, f"{len(pods)} serving pods"
        return pods[0]

    def serving_identity(self) -> tuple[str, int]:
        pod = self.serving_pod()
        restarts = sum(c.get("restartCount", 0) for c in pod["status"].get("containerStatuses") or [])
        return pod["metadata"]["uid"], restarts

    def apply_policy(self, change) -> dict:
        """kubectl apply of the live policy with `change(spec)` applied, as a user edits and applies it."""
        doc = strip_for_apply(self.eap())
        change(doc["spec"])
        path = self.work / f"policy-{int(time.monotonic() * 1000)}.yaml"
        path.write_text(yaml.safe_dump(doc))
        self.kubectl("apply", "-f", str(path))
        return doc

    def wait_hosts(self, count: int, timeout: float = 300) -> None:
        def ready_hosts():
            pods = [p for p in self.pods("expert-host") if not p["metadata"].get("deletionTimestamp")]
            return len(pods) == count and all(pod_ready(p) for p in pods)
        wait_for(ready_hosts, timeout=timeout, every=1, what=f"{count} expert-host pods Ready")

    # -- steps ---------------------------------------------------------------------------------------------------

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

    def dump(self) -> None:
        """What a failed run needs: pods, events, the pods' logs."""
        if self.kubectl is None:
            return
        out = self.work / "logs"
        out.mkdir(exist_ok=True)
        for p in self.kubectl.json("get", "pods", "-n", NS)["items"] if self.kubectl else []:
            name = p["metadata"]["name"]
            (out / f"{name}.log").write_text(self.kubectl("logs", name, "-n", NS, "--tail=200", check=False).stdout)
        (out / "events.txt").write_text(self.kubectl("get", "events", "-n", NS, check=False).stdout)
        log(f"pod logs and events in {out}")

    def cleanup(self) -> None:
        if self.plane is None:
            return
        try:
            if self.installed:
                self.helm_cmd("uninstall", RELEASE, "-n", NS, "--timeout", "60s", check=False)
        except Exception as err:  # noqa: BLE001 - go on stopping the rest
            log(f"cleanup: helm uninstall: {err}")
        for name in ("kubelet", "scheduler"):
            self.plane._stop(name)
        self.plane.stop()
        ids = sh(DOCKER, "ps", "-aq", "--filter", "name=k8s_").stdout.split()
        if ids:
            subprocess.run([DOCKER, "rm", "-f", *ids], capture_output=True)
        subprocess.run(f"mount | awk '{{print $3}}' | grep '^{self.work}/' | sort -r | xargs -r -n1 umount", shell=True)
        log("stopped: kubelet, scheduler, control plane, pod containers")


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


def run_checks(run: Run, name: str) -> int:
    """Run the checks, dump the pods' logs on a failure, always stop what was started; 0 if every check passed."""
    for sig in (signal.SIGTERM, signal.SIGINT):  # stop everything on the way out (the finally below)
        signal.signal(sig, lambda *_: sys.exit(130))
    code = 1
    try:
        code = run.run()
    except BaseException as err:  # noqa: BLE001 - report, dump, clean up
        if not isinstance(err, SystemExit):
            log(f"ABORTED: {type(err).__name__}: {err}")
        code = 1 if not isinstance(err, SystemExit) else (err.code or 1)
    finally:
        if not run.checks.ok or code:
            try:
                run.dump()
            except Exception as err:  # noqa: BLE001
                log(f"dump failed: {err}")
        run.cleanup()
    print("\nchecks:\n" + run.checks.summary(), flush=True)
    ok = code == 0 and run.checks.ok
    print(f"{name}: {'every check passed' if ok else 'FAILED'} in {time.monotonic() - T0:.0f} s", flush=True)
    return 0 if ok else 1

if __name__ == "__main__":
    sys.exit(main())
