"""`moeless bench finetunes`: a base and its fine-tunes in one pool against the base alone, in one run.

1. The base (--model) and its fine-tunes: --finetune DIR (repeatable), else those of this base in the
   cache's finetunes/ (`moeless model finetune`), up to 3; where there are none, 3 stand-ins, each
   the base with a share of each layer's experts perturbed (not trained: the memory, the answers'
   exactness and the throughput do not depend on what the experts learnt), written as ESFT
   artefacts and reported as stand-ins. Stores: the base's, each fine-tune's over it (its own experts;
   a LoRA fine-tune's: none, only its expert LoRA factors, applied on the hosts over the base's replicas).
2. The same requests (held-out ShareGPT prompts, Poisson arrivals at --rate a second in all) three
   times, each time on fresh expert hosts where every expert of every served model is loaded first, so the
   memory the hosts hold is all the expert memory the models need:
   - the base alone, every request to it (the baseline);
   - the base and the fine-tunes on the same hosts, request i to model i mod N, in one engine (the
     base's non-expert layers batching every model's requests, each token to its own model's
     experts: serving/family.py, how `moeless serve --model A --model A+B ...` runs ESFT fine-tunes; a
     LoRA fine-tune adapting attention has non-expert layers of its own, so an engine of its own here too);
   - the same in one engine per model (a ModelServer each, as LoRA fine-tunes are served).
3. Reported: the hosts' expert memory (the ratio to the base alone; whole models would hold N x),
   each model's GB·s from the hosts (shared replicas split among their users) and that they add up,
   throughput and TTFT / TPOT p50 and p99 with their ratios, and how many answers equal the
   in-process greedy completion of the model they named (its merged model alone), computed first
   (in the base's run, of the requests the mixed run sends the base).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from moeless.bench import BENCHES
from moeless.bench.common import add_bench_flags, print_and_write, start_local_ray
from moeless.bench.finetunes_report import memory_held, prewarm, print_report, ratios
from moeless.bench.load import _prompts, _sequential
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.serving.cli import MODEL_HELP, _positive
from moeless.serving.loadgen import outcomes_json, replay, summarize

if TYPE_CHECKING:
    from moeless.model.moe_model import MoEModel
    from moeless.serving.config import ModelChoice


def register(benches: argparse._SubParsersAction) -> None:
    """Add `moeless bench finetunes`."""
    bench = benches.add_parser(
        "finetunes", help=BENCHES["finetunes"].help,
        description="Serve a base alone, then the base and its fine-tunes together on the same expert hosts, with "
                    "the same open-loop requests; print the hosts' expert memory, per-model GB·s, throughput, "
                    "latency and exactness against each merged model alone, with the ratios to the base alone. --quick: the "
                    "tiny model, stand-ins, and no run of one engine per model.")
    bench.add_argument("--model", default="default", help="the base: " + MODEL_HELP.split(", or BASE")[0])
    bench.add_argument("--finetune", action="append", default=[], metavar="DIR",
                       help="a fine-tune of the base (repeatable; default: the base's under the cache's finetunes/, "
                            "up to 3, else 3 stand-ins)")
    bench.add_argument("--share", type=float, default=0.125,
                       help="stand-ins: the share of each layer's experts changed (default 0.125)")
    bench.add_argument("--hosts", type=_positive, default=2, help="expert-host processes (default 2)")
    bench.add_argument("--rate", type=float, help="requests a second over all models (default 1; 4 with --quick)")
    bench.add_argument("--requests", type=_positive, help="requests in each run (default 48; 12 with --quick)")
    bench.add_argument("--max-tokens", type=_positive, help="tokens per request (default 16; 8 with --quick)")
    bench.add_argument("--prompt-tokens", type=_positive, default=64, help="prompts cut to this many tokens (default 64)")
    bench.add_argument("--seed", type=int, default=0, help="seed of the arrivals and the stand-ins (default 0)")
    add_bench_flags(bench)
    bench.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    if not 0 < args.share <= 1 or (args.rate is not None and args.rate <= 0):
        raise SystemExit("moeless bench finetunes: --share must be in (0, 1] and --rate > 0")
    result = run_finetunes_bench("tiny:mixtral" if args.quick and args.model == "default" else args.model,
                                 args.finetune, hosts=args.hosts, rate=args.rate or (4.0 if args.quick else 1.0),
                                 requests=args.requests or (12 if args.quick else 48),
                                 max_tokens=args.max_tokens or (8 if args.quick else 16),
                                 prompt_tokens=args.prompt_tokens, share=args.share, seed=args.seed,
                                 runs=RUNS[:2] if args.quick else RUNS)
    return print_and_write(args.out, "finetunes", result, print_report)


RUNS = ("base_alone", "one_engine", "engine_per_model")


def run_finetunes_bench(model: str = "default", finetunes: Sequence[str] = (), *, share: float = 0.125, seed: int = 0,
                        **options: Any) -> dict[str, Any]:
    """The base `model` and its fine-tunes (directories; none: module docstring) through the runs
    (`compare`, options: its keywords); returns the figures."""
    # heavy (ray, transformers): kept off --help's start-up path
    from moeless.serving.config import choose_model

    base_choice = choose_model(model)
    base = base_choice.loader()
    dirs, stand_in = (list(finetunes), False) if finetunes else _finetunes_of(base, base_choice.name, share, seed)
    choices = [base_choice] + [choose_model(f"{model}+{Path(d).resolve()}") for d in dirs]
    models = [base] + [c.loader() for c in choices[1:]]
    return {**compare(choices, models, seed=seed, **options), "finetune_dirs": [str(d) for d in dirs],
            "stand_ins": stand_in}


def compare(choices: Sequence["ModelChoice"], models: Sequence["MoEModel"], *, hosts: int = 2, rate: float = 1.0, requests: int = 48,
            max_tokens: int = 16, prompt_tokens: int = 64, seed: int = 0, timeout_s: float = 900.0,
            runs: Sequence[str] = RUNS) -> dict[str, Any]:
    """choices[0] (a ModelChoice, the base) alone, then every choice together (RUNS: in one engine, in
    one per model; runs: which, the base alone first), on the same requests; models: each choice's
    model, loaded (its experts are exported, its answers are the references)."""
    import ray
    from ray import serve

    # heavy (ray, transformers): kept off --help's start-up path
    from moeless.model.weight_store import export_store
    from moeless.serving.app import ServeConfig, build_app
    from moeless.serving.embedded import free_port

    names = [c.name for c in choices]
    merged = dict(zip(names, models))
    prompts = _prompts(models[0], requests, prompt_tokens)
    asked = [names[i % len(names)] for i in range(requests)]
    print("references: each prompt through the model it names, alone, in-process ...", flush=True)
    reference: dict[int, str] = {}
    for name in names:
        indices = [i for i in range(requests) if asked[i] == name]
        reference |= dict(zip(indices, _sequential(merged[name], [prompts[i] for i in indices], max_tokens)))
    base_store = Path(export_store(models[0], names[0]))
    stores = {names[0]: base_store} | {name: Path(export_store(merged[name], name, base=base_store)) for name in names[1:]}
    whole = {name: _store_bytes(root) for name, root in stores.items()}
    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, requests)).tolist()
    results: dict[str, dict] = {}
    start_local_ray()
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        for run in runs:
            served = choices[:1] if run == "base_alone" else choices
            sent = [names[0]] * requests if run == "base_alone" else asked  # the base alone: every request to it
            several = len(served) > 1
            pairs = [(c.name, stores[c.name]) for c in served]
            # serving/family.py: fine-tunes with the base's non-expert layers in its engine; a LoRA on attention in its own
            family = tuple(c.name for c in served[1:] if c.joins_base) if run == "one_engine" else ()
            with launch_local_hosts(hosts, pairs if several else pairs[0][1], keep_alive_s=3600, metrics=False) as group:
                engines = [c for c in served if c.name not in family]
                configs = [ServeConfig(c.name, c.loader, tuple(group.addresses), replica_cpus=0.5 / len(engines),
                                       ingress_cpus=0.25, host_model=c.name if several else None,
                                       family=family if c is served[0] else ()) for c in engines]
                print(f"{run}: {', '.join(c.name for c in served)} on {hosts} expert hosts ...", flush=True)
                serve.run(build_app(configs), name="moeless", route_prefix="/")
                prewarm(group.addresses, [(c.name if several else None, merged[c.name].spec) for c in served])
                replay(url, [c.name for c in served], prompts[:len(served)], [0.0] * len(served), 2,
                       timeout_s=timeout_s)  # warm: channels, first forwards
                outcomes = replay(url, sent, prompts, arrivals, max_tokens, timeout_s=timeout_s)
                checked = [o for o in outcomes if sent[o.index] == asked[o.index]]  # alone: the base's requests
                differ = [o.index for o in checked if o.error is not None or o.text != reference[o.index]]
                results[run] = {**summarize(outcomes), "checked": len(checked), "identical_to_merged_alone":
                             len(checked) - len(differ), "differ_from_merged_alone": differ,
                             "memory": memory_held(group.addresses),
                             "outcomes": outcomes_json(outcomes)}
                serve.delete("moeless")
    finally:
        serve.shutdown()
        ray.shutdown()
    return {"base": names[0], "finetunes": names[1:], "hosts": hosts, "rate_per_s": rate, "requests": requests,
            "max_tokens": max_tokens, "prompt_tokens": prompt_tokens, "seed": seed,
            "load_average_1m": os.getloadavg()[0], "expert_bytes_whole_models": whole, "runs": results,
            **ratios(results, whole, names)}


def _store_bytes(root: Path) -> int:
    """All expert bytes of the model a store serves (its own files and its base's it names)."""
    from moeless.model.weight_store import WeightStore  # heavy (torch, safetensors): off --help's start-up path

    store = WeightStore.open(root)
    return sum(store.expert_bytes(layer, expert) for layer, expert in store.keys())


def _finetunes_of(base, base_name: str, share: float, seed: int, count: int = 3) -> tuple[list[Path], bool]:
    """(fine-tune directories, whether they are stand-ins): the base's in the cache's finetunes/ (made
    by `moeless model finetune` over this base: its fingerprint; ESFT or LoRA), up to `count`, else
    `count` stand-ins."""
    # heavy (torch, safetensors): off --help's start-up path
    from moeless.core.paths import cache_dir
    from moeless.model.finetune import FinetuneError, read_manifest, weights_fingerprint

    fingerprint = weights_fingerprint(base)
    found = []
    for root in sorted((cache_dir() / "finetunes").glob("*/")):
        try:
            manifest = read_manifest(root)
        except FinetuneError:
            continue
        if manifest["base"]["fingerprint"] == fingerprint and "stand-in" not in manifest:
            found.append(root)
    if found:
        return found[:count], False
    return [stand_in_finetune(base, base_name, i, share, seed) for i in range(count)], True


def stand_in_finetune(base: "MoEModel", base_name: str, i: int, share: float, seed: int) -> Path:
    """Stand-in fine-tune i of base (in the cache's finetunes/, made once): `share` of each layer's experts
    (chosen at random) perturbed, not trained, written as an ESFT artefact (model/finetune.py)."""
    import torch

    # heavy (torch, safetensors): off --help's start-up path
    from moeless.core.paths import cache_dir
    from moeless.model.finetune import FinetuneError, base_record, merge_experts, read_manifest, save_esft

    out = cache_dir() / "finetunes" / f"stand-in-{i}-{base_name}-{share:g}-{seed}"
    try:
        read_manifest(out)
        return out
    except FinetuneError:
        pass
    spec = base.spec
    g = torch.Generator().manual_seed(seed * 1000 + i)
    per_layer = max(1, round(share * spec.num_experts))
    replaced = [(layer, int(e)) for layer in range(spec.num_layers)
                for e in torch.randperm(spec.num_experts, generator=g)[:per_layer]]
    experts = {key: {n: t + 0.01 * t.std() * torch.randn(t.shape, generator=g) for n, t in base.expert_weights(*key).items()}
               for key in replaced}
    record = base_record(base, base_name)
    save_esft(out, merge_experts(base, experts), replaced,
              {"name": f"stand-in-{i}", "base": record, "task": "none", "stand-in": "experts perturbed, not trained"})
    return out
