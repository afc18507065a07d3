"""A helm release of the chart on a real node, as the node-tier scripts drive it (scripts/k8s_helm_e2e.py,
scripts/k8s_pool_e2e.py): the images, the checks' record, the release's objects read from outside the pods,
dumping the pods' logs and stopping everything that was started.
"""

from __future__ import annotations

import hashlib
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

from k8s_node_e2e import DOCKER, build_pause_image, image_sources, sh, writable_tmp  # noqa: E402
from k8s_support import ControlPlane, Kubectl, helm_binary, wait_for  # noqa: E402

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


# Images -----------------------------------------------------------------------------------------------------

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


# Helpers ------------------------------------------------------------------------------------------------------

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


# The release -------------------------------------------------------------------------------------------------

class Release:
    """A release under test: its work folder, control plane, kubectl and helm, and the checks' record."""

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


def run_checks(run: Release, name: str) -> int:
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
