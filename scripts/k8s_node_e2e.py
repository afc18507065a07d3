"""The real-node tier (docs/kubernetes.md; slow, not in CI): expert-host pods from a locally built image
really run on a kubelet and serve the default model while the operator scales them.

    dockerd --bridge=none --iptables=false --ip-masq=false &     # Debian's docker.io, no bridge
    .venv/bin/python scripts/k8s_node_e2e.py [--keep]

Steps: 1. images (local/pause:3.2 from the kube build's pause binary; local/moeless:dev from this
machine's own Python, venv and sources, since no registry is reachable); 2. control plane
(tests/k8s/k8s_support.ControlPlane) + kube-scheduler + kubelet on the docker engine; 3. CRD, RBAC,
the operator as a local `moeless operator` process; 4. the default model's weight store on a
hostPath; 5. a policy (hostNetwork: host i on 127.0.0.1:50051+i); 6. once a pod is Ready, the
default model runs a real prompt with its experts on the pods and is compared with the unmodified
model; resident replicas make the operator scale out, and the same prompt runs over both hosts;
7. everything is stopped (policy deleted: pods drain on SIGTERM).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "k8s"))

from k8s_support import ControlPlane, Kubectl, k8s_binaries, wait_for  # noqa: E402

DOCKER = "/usr/bin/docker"  # Debian's docker.io client
IMAGE = "local/moeless:dev"
NS = "node-e2e"


def sh(*argv: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=True, text=True, capture_output=True, **kw)


def log(message: str, t0: float) -> None:
    print(f"[{time.monotonic() - t0:7.1f} s] {message}", flush=True)


def image_sources() -> tuple[str, ...]:
    """What an image carries of the checkout: pyproject.toml, README.md and the folder of every package
    that pyproject's [tool.setuptools.package-dir] maps (one list: a new package cannot be left out)."""
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return ("pyproject.toml", "README.md", *sorted({folder.split("/")[0] for folder in dirs.values()}))


def writable_tmp(work: Path) -> list[str]:
    """tar arguments that add an empty, world-writable /tmp (sticky) to an image made by `docker import`:
    HOME, numba's cache and Ray live there, and a pod without an emptyDir on /tmp would have none."""
    tmp = work / "image-tmp" / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    tmp.chmod(0o1777)
    return ["-C", str(tmp.parent), "tmp"]


def build_pause_image(bin_dir: Path, work: Path) -> None:
    """local/pause:3.2 from the kube build's pause binary (the kubelet's sandbox image)."""
    ctx = work / "pause"
    ctx.mkdir(exist_ok=True)
    (ctx / "pause").write_bytes((bin_dir / "pause").read_bytes())
    (ctx / "pause").chmod(0o755)
    (ctx / "Dockerfile").write_text('FROM scratch\nCOPY pause /pause\nENTRYPOINT ["/pause"]\n')
    sh(DOCKER, "build", "-q", "-t", "local/pause:3.2", str(ctx))


def build_images(bin_dir: Path, work: Path) -> None:
    """local/pause:3.2 and local/moeless:dev (a rootfs of this machine's Python, venv and sources)."""
    build_pause_image(bin_dir, work)
    if subprocess.run([DOCKER, "image", "inspect", IMAGE], capture_output=True).returncode == 0:
        return
    venv = Path(sys.prefix)
    python_home = Path(os.path.realpath(venv / "bin" / "python")).parents[1]
    paths = ["/bin", "/lib", "/lib64", "/sbin", "/usr/bin", "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/etc",
             str(python_home), str(venv), *(str(ROOT / d) for d in image_sources())]
    changes = [f"ENV PATH={venv}/bin:/usr/bin:/bin", "ENV HOME=/tmp", "USER 10001:10001", "WORKDIR /tmp"]
    tar = subprocess.Popen(["tar", "-c", "--mode=a+rX", "--exclude=__pycache__", *[p for p in paths if Path(p).exists()],
                            *writable_tmp(work)],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    args = [DOCKER, "import", *[a for c in changes for a in ("--change", c)], "-", IMAGE]
    subprocess.run(args, stdin=tar.stdout, check=True, capture_output=True)
    tar.wait()


def start_node(plane: ControlPlane, bin_dir: Path) -> None:
    d = plane.run_dir
    plane._spawn("scheduler", [str(bin_dir / "kube-scheduler"), f"--kubeconfig={plane.kubeconfig}",
                               "--leader-elect=false", "--port=0", "--secure-port=0"])
    (d / "kubelet").mkdir(exist_ok=True)
    plane._spawn("kubelet", [
        str(bin_dir / "kubelet"), f"--kubeconfig={plane.kubeconfig}", "--hostname-override=localhost",
        "--container-runtime=docker", "--pod-infra-container-image=local/pause:3.2", "--fail-swap-on=false",
        "--cgroup-driver=cgroupfs", f"--root-dir={d / 'kubelet'}", f"--cert-dir={d / 'kubelet' / 'pki'}",
        "--address=127.0.0.1", "--read-only-port=0", "--cgroups-per-qos=false", "--enforce-node-allocatable=",
        "--eviction-hard=", "--image-gc-high-threshold=100", "--image-gc-low-threshold=99", "--oom-score-adj=0"])


def run_prompt(model, addresses: list[str]) -> float:
    """Max |logit difference| of the default model with its experts on `addresses` vs in process."""
    import torch

    from moeless.expert_fn.client.client import ExpertHostClient
    from moeless.model.datasets import sharegpt_prompts
    from moeless.placement.types import Placement
    from moeless.serving.executor import RemoteExecutor
    from moeless.serving.placement_source import PlacementSource

    prompt = sharegpt_prompts(1)[0]
    ids = model.tokenizer(prompt, return_tensors="pt").input_ids[:, :64]
    mask = torch.ones_like(ids)
    clients = [ExpertHostClient(a, timeout_s=120) for a in addresses]
    spec = model.spec
    executor = RemoteExecutor(clients, PlacementSource(Placement.static(spec.num_layers, spec.num_experts, len(clients))))
    try:
        got = model.forward(ids, mask, executor=executor).logits
    finally:
        executor.close()
        for c in clients:
            c.close()
    return float((got - model.forward(ids, mask).logits).abs().max())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true", help="leave the cluster running at the end (Ctrl-C stops it)")
    args = parser.parse_args()
    for sig in (signal.SIGTERM, signal.SIGINT):  # stop everything on the way out (the finally below)
        signal.signal(sig, lambda *_: sys.exit(130))
    if subprocess.run([DOCKER, "info"], capture_output=True).returncode != 0:
        print("k8s_node_e2e: no docker engine; start `dockerd --bridge=none --iptables=false --ip-masq=false` first",
              file=sys.stderr)
        return 2
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="moeless-node-"))
    os.chmod(work, 0o755)
    bin_dir = k8s_binaries()
    build_images(bin_dir, work)
    log(f"images built: local/pause:3.2, {IMAGE}", t0)
    from moeless.model.default import default_model
    from moeless.model.weight_store import export_store

    model = default_model()
    store = Path(export_store(model, "moeless-default"))
    sh("chmod", "-R", "a+rX", str(store))  # the pods run as user 10001
    held = sum(f.stat().st_size for f in (store / "experts").rglob("*") if f.is_file())
    log(f"default model ready; weight store {store} ({held / 1e6:.0f} MB of experts)", t0)
    plane = ControlPlane(work / "k8s", bin_dir).start()
    operator = None
    try:
        start_node(plane, bin_dir)
        kubectl = Kubectl(plane.kubeconfig)
        kubectl("apply", "-f", str(ROOT / "manifests" / "crd.yaml"), "-f", str(ROOT / "manifests" / "rbac.yaml"))
        kubectl("create", "namespace", NS)
        wait_for(lambda: kubectl.json("get", "node", "localhost")["metadata"], timeout=60, what="the node")
        log("control plane and node up", t0)
        operator = subprocess.Popen([sys.executable, "-m", "moeless", "operator", "--kubeconfig", str(plane.kubeconfig),
                                     "--resync-s", "2", "--metrics-port", "0", "--no-leader-elect"],
                                    stdout=open(work / "operator.log", "w"), stderr=subprocess.STDOUT)
        # Every expert resident on one host fills 1.25 x 80% of it: the operator must add a second.
        gib = held / 1024**3 / 0.8 / 1.25
        policy = {"apiVersion": "moeless.io/v1alpha1", "kind": "ExpertAutoscalingPolicy",
                  "metadata": {"name": "smollm", "namespace": NS},
                  "spec": {"model": {"store": str(store), "hostPath": str(store)},
                           "hosts": {"image": IMAGE, "imagePullPolicy": "Never", "minHosts": 1, "maxHosts": 2,
                                     "gpusPerHost": 0, "memoryGiBPerHost": round(gib, 6), "cpu": "100m",
                                     "hostNetwork": True, "drainSeconds": 5},
                           "serving": {"keepAliveSeconds": 600}, "upscaleDelaySeconds": 0}}
        kubectl("apply", "-f", "-", stdin=json.dumps(policy))
        ready = lambda i: any(c["type"] == "Ready" and c["status"] == "True" for c in
                              kubectl.json("get", "pod", f"smollm-hosts-{i}", "-n", NS)["status"]["conditions"])
        wait_for(lambda: ready(0), timeout=300, every=1, what="pod smollm-hosts-0 Ready")
        log("pod smollm-hosts-0 Ready (kubelet, docker, /readyz)", t0)
        diff = run_prompt(model, ["127.0.0.1:50051"])
        log(f"default model, experts on 1 pod: max |logits - reference| = {diff:.2e}", t0)
        wait_for(lambda: kubectl.json("get", "statefulset", "smollm-hosts", "-n", NS)["spec"]["replicas"] == 2,
                 timeout=120, every=1, what="scale out to 2 hosts")
        log("operator scaled the pool to 2 hosts", t0)
        wait_for(lambda: ready(1), timeout=300, every=1, what="pod smollm-hosts-1 Ready")
        log("pod smollm-hosts-1 Ready", t0)
        diff2 = run_prompt(model, ["127.0.0.1:50051", "127.0.0.1:50052"])
        log(f"default model, experts on 2 pods: max |logits - reference| = {diff2:.2e}", t0)
        time.sleep(5)
        print(kubectl("get", "eap", "-n", NS, "-o", "wide").stdout)
        print(kubectl("get", "pods", "-n", NS, "-o", "wide").stdout)
        print(kubectl("get", "events", "-n", NS, "--field-selector", "involvedObject.kind=ExpertAutoscalingPolicy").stdout)
        if args.keep:
            print(f"KUBECONFIG={plane.kubeconfig}; Ctrl-C stops everything")
            while True:
                time.sleep(3600)
        kubectl("delete", "eap", "smollm", "-n", NS)
        wait_for(lambda: not kubectl.json("get", "pods", "-n", NS)["items"], timeout=120, every=1, what="pods gone")
        log("policy deleted: pods drained and gone", t0)
        return 0 if max(diff, diff2) < 1e-4 else 1
    finally:
        if operator is not None:
            operator.terminate()
            operator.wait(30)
        for name in ("kubelet", "scheduler"):
            plane._stop(name)
        plane.stop()
        ids = sh(DOCKER, "ps", "-aq", "--filter", "name=k8s_").stdout.split()
        if ids:
            subprocess.run([DOCKER, "rm", "-f", *ids], capture_output=True)
        subprocess.run(f"mount | awk '{{print $3}}' | grep '^{work}/' | sort -r | xargs -r -n1 umount", shell=True)


if __name__ == "__main__":
    sys.exit(main())
