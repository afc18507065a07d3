"""The helm release of one ExpertPool shared by several models (scripts/k8s_pool_e2e.py checks two unrelated ones,
scripts/k8s_family_e2e.py a base and two fine-tunes): the models' references computed here, their weight stores
written into the pool's directory, the chart installed with pool.enabled, and each model's objects read from outside
the pods. The node, images and cleanup are scripts/k8s_helm_release.py's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from k8s_helm_release import (DOCKER, GRPC_PORT, METRICS_PORT, NS, OPERATOR_PORT, RELEASE, ROOT, ControlPlane,  # noqa: E402
                              Kubectl, Release, build_images, log, pod_ready, port_free, sh, wait_for)
from k8s_node_e2e import start_node  # noqa: E402
from k8s_support import k8s_binaries  # noqa: E402

POOL = f"{RELEASE}-pool"


class Served(NamedTuple):
    """One model of the pool: its serving pod's --model, its port, and its base's policy (a fine-tune's)."""

    flag: str
    port: int
    base: str | None = None


MODELS = {"moeless-default": Served("default", 18000), "tiny-mixtral": Served("tiny:mixtral", 18001)}  # by policy
PROMPTS = ("The capital of France is", "Three primary colours are")
MAX_TOKENS = 12
KEEP_ALIVE_S = 20
KEEP_WARM = 3  # replicas of the quiet model its keepWarmGiB holds past the keep-alive


def references(models: dict[str, Served], models_dir: Path) -> dict[str, dict[str, str]]:
    """Each model's greedy completions in process (no expert host), and its weight store written to
    models_dir/POLICY: a fine-tune's over its base's (export_experts(base=), the base listed first), so the
    index names the base's files by a path relative to it and the hosts hold each shared expert once."""
    # torch and the models load here, once the docker engine and the ports are checked (as k8s_helm_e2e)
    from moeless.model.weight_store import WeightStore, export_experts
    from moeless.serving.api import GenerationRequest
    from moeless.serving.config import choose_model
    from moeless.serving.engine import Engine

    answers = {}
    for policy, served in models.items():
        choice = choose_model(served.flag)
        model = (choice.first_load or choice.loader)()
        spec = model.spec
        export_experts(model.iter_experts(), models_dir / policy, model=choice.name, num_layers=spec.num_layers,
                       num_experts=spec.num_experts, act=spec.act, loras=getattr(model, "expert_loras", None),
                       base=WeightStore.open(models_dir / served.base) if served.base else None)
        engine = Engine(model, model.local_executor())
        answers[policy] = {}
        for prompt in PROMPTS:
            request = GenerationRequest(choice.name, MAX_TOKENS, False, prompt=prompt)
            answers[policy][prompt] = "".join(e.get("text", "") for step in engine.run([request]) for e in step[0])
    return answers


def model_meters(name: str) -> dict[str, float]:
    """The pool host's moeless_expert_model_* values of one model (host 0, on the node's network)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("moeless_expert_model_") and f'model="{name}"' in line:
            out[line.split("{")[0].removeprefix("moeless_expert_model_")] = float(line.rsplit(" ", 1)[1])
    return out


class PoolRelease(Release):
    """The pool release: each model's requests, serving pod and policy, the pool, and installing it all.
    models: the pool's models by policy; keep_warm: the index of the one that keeps KEEP_WARM replicas warm
    (None: none does); serving_cpu: each serving pod's CPU request (they share the node's cores);
    fine_tunes_own_engine: a fine-tune gets a serving app of its own (pool.models[].ownEngine), not its base's."""

    models: dict[str, Served] = MODELS
    keep_warm: int | None = 1
    serving_cpu = "400m"
    fine_tunes_own_engine = False

    def app_of(self, policy: str) -> str:
        """The policy whose serving app answers this model's requests: a fine-tune's base's, unless it has its own."""
        base = self.models[policy].base
        return base if base and not self.fine_tunes_own_engine else policy

    def complete(self, policy: str, prompt: str, timeout: float = 300) -> tuple[str, float]:
        from openai import OpenAI  # the test extra; the checks above run without it

        port = self.models[self.app_of(policy)].port
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=timeout, max_retries=0)
        start = time.perf_counter()
        reply = client.completions.create(model=self.served[policy], prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        return reply.choices[0].text, time.perf_counter() - start

    def serving_pod_of(self, policy: str) -> dict:
        pods = [p for p in self.kubectl.json("get", "pods", "-n", NS, "-l", f"moeless.io/serves={self.app_of(policy)}")["items"]
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

    def install(self) -> int | None:
        """The models, the node and `helm install` with pool.enabled (checked); 2 where the docker engine or a
        port is missing, else None."""
        if subprocess.run([DOCKER, "info"], capture_output=True).returncode != 0:
            print("k8s_pool_e2e: no docker engine; start dockerd first (see the docstring)", file=sys.stderr)
            return 2
        busy = [p for p in (GRPC_PORT, METRICS_PORT, OPERATOR_PORT, *(m.port for m in self.models.values()))
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
        models_dir = self.work / "models"  # the pool's storage: one directory holding every store
        models_dir.mkdir()
        self.reference = references(self.models, models_dir)
        from moeless.model.weight_store import WeightStore

        quiet = list(self.models)[self.keep_warm or 0]
        self.expert_bytes = WeightStore.open(models_dir / quiet).expert_bytes(0, 0)  # the quiet model's
        self.served = {policy: choose_model(m.flag).name for policy, m in self.models.items()}
        cache = cache_dir()
        finetunes = [cache / "finetunes"] if (cache / "finetunes").is_dir() else []  # `moeless serve --model BASE+NAME`'s
        for path in (models_dir, model_path(BuildConfig()), *finetunes):  # the pods run as user 10001
            sh("chmod", "-R", "a+rX", str(path))
        os.chmod(cache, os.stat(cache).st_mode | 0o055)
        log(f"models ready in {models_dir}: {', '.join(self.models)}; references computed in process")

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
                     "models": [{"name": policy, "store": f"/models/{policy}", "port": m.port,
                                 **({"model": m.flag} if m.flag != "default" else {}),
                                 **({"base": m.base, "ownEngine": self.fine_tunes_own_engine} if m.base else {}),
                                 **({"keepWarmGiB": (KEEP_WARM + 0.5) * self.expert_bytes / 2**30}
                                    if i == self.keep_warm else {}),
                                 "guaranteedGiB": 0.05, "serving": {"keepAliveSeconds": KEEP_ALIVE_S}}
                                for i, (policy, m) in enumerate(self.models.items())]},
            "serving": {"hostNetwork": True, "modelCache": {"hostPath": str(cache)},
                        "resources": {"requests": {"cpu": self.serving_cpu, "memory": "1Gi"}, "limits": {"memory": "6Gi"}},
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
        for policy, port in ((p, m.port) for p, m in self.models.items() if self.app_of(p) == p):
            wait_for(lambda: pod_ready(self.serving_pod_of(policy)), timeout=900, every=2, what=f"{policy}'s serving pod")
            wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).status == 200,
                     timeout=300, every=2, what=f"{policy}'s /healthz 200")
        command = " ".join(self.pods("expert-host")[0]["spec"]["containers"][0]["command"])
        both = all(f"--store {policy}=/models/{policy}" in command for policy in self.models)
        self.checks.record(f"helm install: one pool, {len(self.models)} models, each with its policy and serving pod",
                           both,
                           f"{len(self.pods())} pods; the pool's host runs {command.split('exec ')[-1][:160]}...",
                           time.monotonic() - start)
