"""`moeless bench load`: static against continuous batching under concurrent clients, in one run.

1. One set of expert hosts, one local Ray, ShareGPT test prompts cut to `prompt_tokens`.
2. For each batching mode in turn (static with the old default batch of 8, static with batches
   as large as continuous batching's row cap, continuous), the app is deployed on the same hosts
   and, for each client count N, N clients send their requests at once (and each its next one
   as soon as it is answered) through the HTTP API with the load generator (loadgen.py).
3. Reported per mode and N: tokens/s, requests/s, TTFT and time per output token p50/p99,
   failures; the ratios continuous / static; how many texts equal sequential greedy decoding of
   each prompt alone, in-process (computed first): batching changes which kernels add up each
   sum (batch sizes, padding), so a near-tie can flip a token whichever way requests are batched.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Sequence

from moeless.bench import BENCHES
from moeless.bench.common import add_bench_flags, print_and_write, start_local_ray
from moeless.bench.serve import bench_prompts
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.serving.api import GenerationRequest
from moeless.serving.cli import MODEL_HELP, _names_of, _positive
from moeless.serving.loadgen import closed_loop, outcomes_json, summarize

MODES = ("static-8", "static-wide", "continuous")


def register(benches: argparse._SubParsersAction) -> None:
    """Add `moeless bench load`."""
    load = benches.add_parser(
        "load", help=BENCHES["load"].help,
        description="Deploy the app on local expert hosts once per batching mode (static, batches of 8; static, "
                    "batches as wide as continuous batching's row cap; continuous) and send the same requests from N "
                    "concurrent clients; print throughput, TTFT and time per output token p50/p99 and the ratios.",
    )
    load.add_argument("--model", default="default", help=MODEL_HELP)
    load.add_argument("--hosts", type=_positive, default=2, help="expert-host processes (default 2)")
    load.add_argument("--clients", type=_counts, help="concurrent client counts, comma-separated (default 32,48; 8 with --quick)")
    load.add_argument("--requests-per-client", type=_positive, default=1, help="requests each client sends in turn (default 1)")
    load.add_argument("--max-tokens", type=_positive, help="tokens per request (default 16; 8 with --quick)")
    load.add_argument("--prompt-tokens", type=_positive, default=64, help="ShareGPT prompts cut to this many tokens (default 64)")
    load.add_argument("--modes", type=_names_of(_load_modes, "mode(s)"), help="batching modes, comma-separated (default static-8,static-wide,continuous; "
                                                   "static-8,continuous with --quick)")
    add_bench_flags(load)
    load.set_defaults(func=_bench_load)


def _load_modes() -> list[str]:
    return list(MODES)


def _counts(text: str) -> list[int]:
    values = [_positive(part) for part in text.split(",") if part]
    if not values:
        raise argparse.ArgumentTypeError("expected client counts like 32,48")
    return values


def _bench_load(args: argparse.Namespace) -> int:
    result = run_load_bench(args.model, hosts=args.hosts, clients=args.clients or ([8] if args.quick else [32, 48]),
                            requests_per_client=args.requests_per_client,
                            max_tokens=args.max_tokens or (8 if args.quick else 16), prompt_tokens=args.prompt_tokens,
                            modes=args.modes or (["static-8", "continuous"] if args.quick else list(MODES)))
    return print_and_write(args.out, "load", result, print_report)


def run_load_bench(model: str = "default", *, hosts: int = 2, clients: Sequence[int] = (32, 48),
                   requests_per_client: int = 1, max_tokens: int = 16, prompt_tokens: int = 64,
                   modes: Sequence[str] = MODES, max_running: int = 64, max_tokens_per_iteration: int = 512,
                   timeout_s: float = 900.0) -> dict[str, Any]:
    """Measure each mode on the same requests (see the module docstring); returns the figures."""
    import ray
    from ray import serve

    # heavy (ray, transformers): kept off --help's start-up path
    from moeless.serving.app import ServeConfig, build_app
    from moeless.serving.config import choose_model
    from moeless.model.weight_store import export_store
    from moeless.serving.embedded import free_port
    from moeless.serving.scheduler import BatchLimits

    choice = choose_model(model)
    loaded = choice.loader()
    prompts = _prompts(loaded, max(clients) * requests_per_client, prompt_tokens)
    reference = _sequential(loaded, prompts, max_tokens)
    store = export_store(loaded, choice.name)
    del loaded
    limits = BatchLimits(max_running=max_running, max_tokens_per_iteration=max_tokens_per_iteration)
    configs = {"static-8": dict(batching="static", max_batch=8),
               "static-wide": dict(batching="static", max_batch=max_running),
               "continuous": dict(batching="continuous", limits=limits)}
    results: dict[str, dict] = {}
    texts: dict[str, dict[int, dict[int, str]]] = {}
    with launch_local_hosts(hosts, store, keep_alive_s=3600, metrics=False) as group:
        start_local_ray()
        try:
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            url = f"http://127.0.0.1:{port}"
            for mode in modes:
                config = ServeConfig(choice.name, choice.loader, tuple(group.addresses), replica_cpus=0.5,
                                     ingress_cpus=0.25, batch_wait_s=0.05, **configs[mode])
                serve.run(build_app(config), name="moeless", route_prefix="/")
                closed_loop(url, choice.name, prompts[:2], 2, 2, timeout_s=timeout_s)  # warm: loads, channels
                results[mode], texts[mode] = {}, {}
                for n in clients:
                    count = n * requests_per_client
                    print(f"{mode}: {n} clients, {count} requests of {max_tokens} tokens ...", flush=True)
                    outcomes = closed_loop(url, choice.name, prompts[:count], n, max_tokens, timeout_s=timeout_s)
                    differ = [o.index for o in outcomes if o.error is None and o.text != reference[o.index]]
                    results[mode][str(n)] = {**summarize(outcomes), "identical_to_sequential": count - len(differ),
                                             "differ_from_sequential": differ, "outcomes": outcomes_json(outcomes)}
                    texts[mode][n] = {o.index: o.text for o in outcomes if o.error is None}
                    _print_row(mode, n, results[mode][str(n)])
        finally:
            serve.shutdown()
            ray.shutdown()
    return {
        "model": choice.name, "hosts": hosts, "clients": list(clients), "requests_per_client": requests_per_client,
        "max_tokens": max_tokens, "prompt_tokens": prompt_tokens, "max_running": max_running,
        "max_tokens_per_iteration": max_tokens_per_iteration, "load_average_1m": os.getloadavg()[0],
        "identical_outputs": all(texts[m][n] == texts[modes[0]][n] for m in modes for n in clients),
        "modes": results, "continuous_vs_static": _ratios(results, clients),
    }


def _sequential(model, prompts: Sequence[str], max_tokens: int) -> list[str]:
    """Greedy completions of each prompt alone, experts in-process: the reference texts."""
    import torch
    from tqdm import tqdm

    # heavy (transformers): kept off --help's start-up path
    from moeless.serving.engine import Engine

    torch.set_num_threads(1)
    engine = Engine(model)
    texts = []
    for prompt in tqdm(prompts, desc="sequential reference", leave=False):
        events = [e for step in engine.run([GenerationRequest(model="reference", max_tokens=max_tokens, stream=False,
                                                                prompt=prompt)]) for e in step[0]]
        texts.append("".join(e.get("text", "") for e in events))
    return texts


def _prompts(model, count: int, prompt_tokens: int) -> list[str]:
    """`count` held-out ShareGPT prompts, each cut to prompt_tokens tokens of the model's tokenizer."""
    # heavy (transformers): kept off --help's start-up path
    from moeless.serving.engine import Engine

    engine = Engine(model)
    return [engine.codec.decode(ids) for ids in bench_prompts(engine, count, prompt_tokens)]


def _ratios(results: dict, clients: Sequence[int]) -> dict:
    """Per client count: continuous / each static mode, throughput and p99 TTFT."""
    if "continuous" not in results:
        return {}
    out = {}
    for n in clients:
        cont = results["continuous"][str(n)]
        for mode in (m for m in results if m != "continuous"):
            base = results[mode][str(n)]
            out.setdefault(str(n), {})[mode] = {
                "throughput": cont["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else None,
                "ttft_p99": (cont["ttft_s"]["p99"] / base["ttft_s"]["p99"]
                             if cont["ttft_s"]["p99"] and base["ttft_s"]["p99"] else None),
            }
    return out


def _print_row(mode: str, n: int, s: dict) -> None:
    def ms(d, key):
        return "-" if d[key] is None else f"{d[key]:.2f}"

    print(f"  {mode:12s} N={n:3d}: {s['tokens_per_s']:7.1f} tokens/s, {s['requests_per_s']:5.2f} req/s, TTFT p50/p99 "
          f"{ms(s['ttft_s'], 'p50')}/{ms(s['ttft_s'], 'p99')} s, TPOT p50/p99 {ms(s['tpot_s'], 'p50')}/"
          f"{ms(s['tpot_s'], 'p99')} s, {s['failed']} failed, {s['identical_to_sequential']}/{s['requests']} as "
          f"sequential, wall {s['wall_s']:.1f} s", flush=True)


def print_report(result: dict[str, Any]) -> None:
    print(f"model {result['model']}, {result['hosts']} expert hosts, requests of {result['max_tokens']} tokens on "
          f"ShareGPT prompts of <= {result['prompt_tokens']} tokens; identical outputs across modes: "
          f"{result['identical_outputs']}; load average {result['load_average_1m']:.1f}")
    for mode, rows in result["modes"].items():
        for n, s in rows.items():
            _print_row(mode, int(n), s)
    for n, ratios in result["continuous_vs_static"].items():
        cells = "; ".join(f"vs {m}: throughput {r['throughput']:.2f}x, p99 TTFT {r['ttft_p99']:.2f}x"
                          for m, r in ratios.items() if r["throughput"] and r["ttft_p99"])
        print(f"continuous, N={n}: {cells}")
