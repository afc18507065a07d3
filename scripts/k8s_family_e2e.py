"""`helm install` of one ExpertPool serving a base model and two of its ESFT fine-tunes, end to end on a real node
(docs/kubernetes.md, "A base and its fine-tunes"; slow, not in CI). The node, images and cleanup are
scripts/k8s_helm_release.py's, the release scripts/k8s_pool_release.py's with these models: the default model
(policy `smollm`) and the fine-tunes `code` and `chat` of `moeless model finetune` over it (policies `smollm-code`,
`smollm-chat`, `pool.models[].base: smollm`) on one host pod, served by one Deployment for the family (the chart's
default: `moeless serve --model default --model default+code --model default+chat`, one engine batching the three,
serving/family.py) or, with --engines per-model, each by its own (`moeless serve --model default+NAME`,
pool.models[].ownEngine). Their stores are written into the pool's directory, each fine-tune's over the base's (its
index names the base's files: the host holds each shared expert once).

    moeless model finetune --name code --task humaneval    # once (about 8 min each on 2 cores)
    moeless model finetune --name chat --task sharegpt
    dockerd --bridge=none --iptables=false --ip-masq=false --ip6tables=false &
    .venv/bin/python scripts/k8s_family_e2e.py [--ref HEAD] [--finetunes DIR] [--engines one|per-model]

Checks, all from outside the pods: the host runs the base's store first and both fine-tunes'; a request to each
model is answered exactly (each merged model's greedy completion in process, computed here); the experts the three
share are held once (the host's /metrics: its resident replicas are each model's own plus the shared ones once,
fewer than the models use together, at most the union of the three stores' keys); per-model GB·s in `kubectl get
eap` add up to the pool's, each fine-tune paying a shared part; with one engine, one serving pod answers all three
(its /v1/models) and only the base's policy bills non-expert GB·s (held once); `helm uninstall` leaves nothing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from k8s_helm_release import METRICS_PORT, run_checks  # noqa: E402
from k8s_pool_e2e import PoolRun  # noqa: E402
from k8s_pool_release import PROMPTS, Served, model_meters  # noqa: E402

FINETUNES = {"code": "humaneval", "chat": "sharegpt"}  # name: its task (`moeless model finetune --task`)
FAMILY = {"smollm": Served("default", 18000),
          **{f"smollm-{name}": Served(f"default+{name}", 18001 + i, "smollm") for i, name in enumerate(FINETUNES)}}


def host_metrics() -> dict[str, float]:
    """The pool host's moeless_expert_host_* gauges and counters (host 0, on the node's network)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=5).read().decode()
    return {line.split(" ")[0].removeprefix("moeless_expert_host_"): float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("moeless_expert_host_") and "{" not in line}


def replicas_of(model: str) -> tuple[int, int]:
    """(own, shared) resident replicas the host counts for one model (a shared one counted for each model)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=5).read().decode()
    counts = {kind: 0 for kind in ("own", "shared")}
    for line in text.splitlines():
        if line.startswith("moeless_expert_model_replicas{") and f'model="{model}"' in line:
            counts[line.split('kind="')[1].split('"')[0]] = int(float(line.rsplit(" ", 1)[1]))
    return counts["own"], counts["shared"]


class FamilyRun(PoolRun):
    """The base and two fine-tunes on one pool: install, then every check in order."""

    models = FAMILY
    keep_warm = None

    def __init__(self, args):
        super().__init__(args)
        self.fine_tunes_own_engine = args.engines == "per-model"
        # the serving pods (three, or one), the host and the operator on the node's 2 cores
        self.serving_cpu = "300m" if self.fine_tunes_own_engine else "800m"

    def run(self) -> int:
        missing = self.finetunes_in_cache()
        if missing:
            print(f"k8s_family_e2e: no fine-tune {', '.join(missing)} in {self.args.finetunes}; make them first: "
                  + "; ".join(f"moeless model finetune --name {n} --task {FINETUNES[n]}" for n in missing), file=sys.stderr)
            return 2
        return super().run()

    def checks_in_order(self) -> list:
        checks = [self.check_base_first, self.check_each_model_exact, self.check_experts_held_once,
                  self.check_billing_adds_up, self.check_fine_tunes_pay_a_shared_part]
        return checks if self.fine_tunes_own_engine else [*checks, self.check_one_engine_for_the_family]

    def finetunes_in_cache(self) -> list[str]:
        """The fine-tunes this run serves, copied into the model cache the serving pods mount (where `moeless serve
        --model default+NAME` finds them) when --finetunes names another directory; the names missing there."""
        from moeless.core.paths import cache_dir  # moeless after the script's own checks, as k8s_pool_release

        source, cache = Path(self.args.finetunes), cache_dir() / "finetunes"
        missing = [name for name in FINETUNES if not (source / name / "finetune.json").is_file()]
        if not missing and source.resolve() != cache.resolve():
            for name in FINETUNES:
                shutil.rmtree(cache / name, ignore_errors=True)
                shutil.copytree(source / name, cache / name)
        return missing

    def check_base_first(self) -> None:
        command = " ".join(self.pods("expert-host")[0]["spec"]["containers"][0]["command"])
        order = [command.find(f"--store {policy}=") for policy in self.models]
        self.checks.record("the pool's host serves the base's store first, then each fine-tune's over it",
                           min(order) >= 0 and order[0] == min(order),
                           f"--store positions {dict(zip(self.models, order))}", 0.0)

    def check_experts_held_once(self) -> None:
        """Right after a request to each model: the host's resident replicas are every model's own plus each shared
        one once (moeless_expert_host_shared_replicas), fewer than the three use together (what three whole models
        would hold), and no more than the union of the stores' keys."""
        from moeless.model.weight_store import WeightStore  # torch: loaded by the install already, not by --help

        start = time.monotonic()
        for policy in self.models:
            self.complete(policy, PROMPTS[0])
        host, used = host_metrics(), {policy: replicas_of(policy) for policy in self.models}
        stores = {policy: WeightStore.open(self.work / "models" / policy) for policy in self.models}
        union = len({s.key(layer, expert) for s in stores.values() for layer, expert in s.keys()})
        base_alone = len(list(stores["smollm"].keys()))
        held = round(host["bytes_held"] / self.expert_bytes)
        own = sum(o for o, _ in used.values())
        together = sum(o + s for o, s in used.values())
        ok = (host["shared_replicas"] > 0 and held == own + host["shared_replicas"] and held < together
              and held <= union and all(s > 0 for _, s in used.values()))
        self.checks.record("experts the base and its fine-tunes share are held once (the host's /metrics)", ok,
                           f"host holds {held} replicas ({host['bytes_held'] / 1e6:.1f} MB), {host['shared_replicas']:.0f} "
                           f"of them shared; the models use {together} together (own, shared: {used}); the stores' "
                           f"keys: {union} distinct, the base alone {base_alone}: held / base alone "
                           f"{held / base_alone:.3f}x (three whole models: {together / base_alone:.3f}x of it)",
                           time.monotonic() - start)

    def check_fine_tunes_pay_a_shared_part(self) -> None:
        """Each fine-tune's policy shows a shared part of its GB·s (its split of the base's replicas it uses), and
        the host's per-model meters say the same."""
        start = time.monotonic()
        shared = {p: self.eap_of(p)["status"]["cost"].get("sharedExpertGBSeconds", 0.0) for p in self.models}
        meters = {p: model_meters(p).get("shared_gb_seconds_total", 0.0) for p in self.models}
        ok = all(shared[p] > 0 and meters[p] > 0 for p in self.models)
        self.checks.record("each model pays a shared part of its GB·s (kubectl get eap, the host's meters)", ok,
                           f"eap sharedExpertGBSeconds {shared}; host moeless_expert_model_shared_gb_seconds {meters}",
                           time.monotonic() - start)


    def check_one_engine_for_the_family(self) -> None:
        """One serving pod answers the base and both fine-tunes (its /v1/models lists them), and the non-expert
        weights it holds once are billed once: the base's policy has non-expert GB·s, the fine-tunes' none."""
        start = time.monotonic()
        pods = [p for p in self.pods("serving") if not p["metadata"].get("deletionTimestamp")]
        port = self.models["smollm"].port
        listed = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10).read())["data"]
        billed = {p: self.eap_of(p)["status"]["cost"].get("nonExpertGBSeconds", 0.0) for p in self.models}
        ok = (len(pods) == 1 and sorted(m["id"] for m in listed) == sorted(self.served.values())
              and billed["smollm"] > 0 and not any(billed[p] for p in self.models if p != "smollm"))
        self.checks.record("one serving pod for the family: it answers all three, its non-expert GB·s billed once", ok,
                           f"{len(pods)} serving pods; /v1/models on :{port}: {[m['id'] for m in listed]}; "
                           f"eap nonExpertGBSeconds {billed}", time.monotonic() - start)


def main() -> int:
    from moeless.core.paths import cache_dir  # the default of --finetunes: the cache `moeless model finetune` writes to

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", default="HEAD", help="git ref whose sources go into the image (default HEAD; "
                        "'worktree': the working tree as it is)")
    parser.add_argument("--finetunes", default=str(cache_dir() / "finetunes"), metavar="DIR",
                        help=f"the directory holding the fine-tunes {', '.join(FINETUNES)} (`moeless model finetune` "
                             "writes them to $MOELESS_CACHE/finetunes/NAME, the default); copied into the model cache")
    parser.add_argument("--engines", choices=("one", "per-model"), default="one",
                        help="one serving app for the family (the chart's default) or one per model (ownEngine)")
    return run_checks(FamilyRun(parser.parse_args()), "k8s_family_e2e")


if __name__ == "__main__":
    sys.exit(main())
