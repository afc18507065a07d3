"""`moeless bench transport`: what one expert call costs over each way of reaching a host.

One expert host process serves the model's weight store; the same packed calls (one layer's
experts on one host, decode-sized and prefill-sized) go over:

- in-process: ExpertHostRuntime.invoke in this process (the baseline: the compute alone);
- local: the shared-memory local channel (memfd + Unix socket), what `moeless serve` uses;
- grpc: InvokePacked over loopback gRPC (one tensor), what a host on another machine gets;
- grpc-per-expert: the previous Invoke (one message per expert);
- ray-compiled-graph (with --ray): a Ray actor holding the same runtime behind a compiled graph
  (Ray's shared-memory channels), the other option considered.

The calls are one host's share of one MoE layer with static EP over 2 hosts (E/2 experts, each
with B * k / E rows): a decode step of B = 4 sequences and a prefill of B = 256 tokens.
Reported: median round trip per call and its ratio to in-process, over `repeats` calls each.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Callable

import numpy as np
import torch

from moeless.bench.common import add_bench_flags, write_result
from moeless.expert_fn.client import ExpertHostClient
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.model.weight_store import WeightStore
from moeless.serving.cli import MODEL_HELP, _positive

BATCH_TOKENS = {"decode": 4, "prefill": 256}  # tokens of the layer call one host gets its share of


def register(benches: argparse._SubParsersAction) -> None:
    """Add `moeless bench transport`."""
    transport = benches.add_parser(
        "transport", help="one expert call over the shared-memory local channel, gRPC and (--ray) Ray compiled "
                          "graphs, against the same call in-process",
        description="Time packed expert calls of decode and prefill size on one local expert host over each "
                    "transport; print medians and ratios to the in-process call.",
    )
    transport.add_argument("--model", default="default", help=MODEL_HELP)
    transport.add_argument("--repeats", type=_positive, help="calls per transport and size (default 200; 50 with --quick)")
    transport.add_argument("--ray", action="store_true", help="also time a Ray compiled graph (starts local Ray)")
    add_bench_flags(transport)
    transport.set_defaults(func=_bench_transport)


def _bench_transport(args: argparse.Namespace) -> int:
    result = run_transport_bench(args.model, repeats=args.repeats or (50 if args.quick else 200), ray_graph=args.ray)
    print_report(result)
    path = write_result(args.out, "transport", result)
    if path:
        print(f"wrote {path}")
    return 0


def call_shapes(num_experts: int, top_k: int) -> dict[str, tuple[int, int]]:
    """(experts, rows per expert) of one host's call: half the experts, B * k / E rows each."""
    return {name: (max(1, num_experts // 2), max(1, tokens * top_k // num_experts))
            for name, tokens in BATCH_TOKENS.items()}


def _median_s(call: Callable[[], Any], repeats: int) -> float:
    for _ in range(max(3, repeats // 10)):
        call()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return float(np.median(samples))


def run_transport_bench(model: str = "default", *, repeats: int = 200, ray_graph: bool = False,
                        threads: int = 1) -> dict[str, Any]:
    # heavy (ray, transformers; the expert runtime): kept off --help's start-up path
    from moeless.expert_fn.runtime import ExpertHostRuntime
    from moeless.serving.config import choose_model
    from moeless.serving.embedded import export_store

    torch.set_num_threads(threads)
    choice = choose_model(model)
    loaded = choice.loader()
    spec, store_dir = loaded.spec, export_store(loaded, choice.name)
    hidden, shapes = spec.hidden_size, call_shapes(spec.num_experts, spec.top_k)
    del loaded
    calls = {}
    for name, (experts, rows) in shapes.items():
        x = torch.randn(experts * rows, hidden)
        calls[name] = (list(range(experts)), [rows] * experts, x, torch.arange(x.shape[0]))
    times: dict[str, dict[str, float]] = {name: {} for name in shapes}
    # 1. In-process: the runtime alone.
    runtime = ExpertHostRuntime(WeightStore.open(store_dir), capacity_bytes=4 * 10**9, keep_alive_s=3600)
    for name, (experts, counts, x, _) in calls.items():
        batches = dict(zip(experts, torch.split(x, counts)))
        times[name]["in_process"] = _median_s(lambda b=batches: runtime.invoke(0, b), repeats)
    runtime.close()
    # 2. A host process over each transport.
    with launch_local_hosts(1, store_dir, keep_alive_s=3600, threads=threads, metrics=False) as group:
        clients = {t: ExpertHostClient(group.addresses[0], timeout_s=60, transport=t) for t in ("local", "grpc")}
        for name, (experts, counts, x, rows) in calls.items():
            for transport, client in clients.items():
                times[name][transport] = _median_s(
                    lambda c=client: c.submit(0, experts, counts, x, rows).result(), repeats)
            batches = dict(zip(experts, torch.split(x, counts)))
            times[name]["grpc_per_expert"] = _median_s(lambda: clients["grpc"].invoke_detailed(0, batches), repeats)
        for client in clients.values():
            client.close()
    # 3. Ray's compiled graph over the same runtime in an actor.
    if ray_graph:
        for name, seconds in _ray_compiled_graph(store_dir, calls, repeats, threads).items():
            times[name]["ray_compiled_graph"] = seconds
    return {"model": choice.name, "repeats": repeats, "threads": threads, "shapes": shapes,
            "load_average_1m": os.getloadavg()[0],
            "median_ms": {n: {k: 1e3 * v for k, v in t.items()} for n, t in times.items()},
            "ratio_to_in_process": {n: {k: v / t["in_process"] for k, v in t.items()} for n, t in times.items()}}


def _ray_compiled_graph(store_dir, calls: dict, repeats: int, threads: int) -> dict[str, float]:
    import ray
    from ray.dag import InputNode

    @ray.remote(num_cpus=0.5)
    class Host:
        def __init__(self, root: str):
            # heavy (the expert runtime): kept off --help's start-up path
            from moeless.expert_fn.runtime import ExpertHostRuntime

            torch.set_num_threads(threads)
            self.runtime = ExpertHostRuntime(WeightStore.open(root), capacity_bytes=4 * 10**9, keep_alive_s=3600)

        def invoke(self, request):
            experts, counts, x = request
            torch.set_num_threads(threads)
            out = self.runtime.invoke(0, dict(zip(experts, torch.split(x, counts)))).outputs
            return torch.cat([out[e] for e in experts])

    ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        host = Host.remote(str(store_dir))
        with InputNode() as request:
            dag = host.invoke.bind(request)
        graph = dag.experimental_compile()
        try:
            return {name: _median_s(lambda r=(experts, counts, x): ray.get(graph.execute(r)), repeats)
                    for name, (experts, counts, x, _) in calls.items()}
        finally:
            graph.teardown()
    finally:
        ray.shutdown()


def print_report(result: dict[str, Any]) -> None:
    print(f"model {result['model']}: median of {result['repeats']} calls each, load average "
          f"{result['load_average_1m']:.1f} on {os.cpu_count()} cores")
    for name, row in result["median_ms"].items():
        experts, rows = result["shapes"][name]
        cells = "  ".join(f"{k} {v:.3f} ms ({result['ratio_to_in_process'][name][k]:.2f}x)" for k, v in row.items())
        print(f"{name:8s} ({experts} experts x {rows} rows): {cells}")
