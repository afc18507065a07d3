"""`moeless bench expert-invoke`: the cost of calling experts over gRPC instead of in-process, and
what a cold start costs from each weight tier beside the compute it delays.

Shape: the default model's experts unless given. For several tokens-per-expert sizes, with
`experts_per_call` experts per Invoke, it times the round trip to one local expert host (warm
replicas) and the same computation in this process (the baseline), and reports round-trip
overhead (ms per call) and time per token, and the ratio remote / in-process.

Cold starts, in the same run: one replica's load through the host's own path from each tier
(disk -> host memory: read, sha256, parse; host memory -> device: the copy; the whole cold path
with the host tier off), and over gRPC the first load of a replica (from disk) against a reload
after eviction (from host memory), each beside the host's compute time of one call (one layer's
experts on this host) at every size.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Callable

import torch
from tqdm import tqdm

from moeless.bench import BENCHES
from moeless.bench.common import add_bench_flags, print_and_write
from moeless.expert_fn.client.client import ExpertHostClient
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.expert_fn.stores.tiers import DeviceCopier, HostTier, TierConfig
from moeless.model.experts import expert_forward
from moeless.model.shape import DEFAULT_EXPERT_SHAPE
from moeless.model.weight_store import export_experts



def register(benches: argparse._SubParsersAction) -> None:
    """Add `moeless bench expert-invoke`."""
    bench = benches.add_parser(
        "expert-invoke",
        help=BENCHES["expert-invoke"].help,
        description="Times Invoke on one local expert host (warm replicas) against computing the same "
        "experts in this process, for several tokens-per-expert sizes; prints overhead and ratio.",
    )
    bench.add_argument("--hidden", type=int, default=None, help="hidden size H (default: the default model's)")
    bench.add_argument("--ffn", type=int, default=None, help="expert FFN width F (default: the default model's)")
    bench.add_argument("--experts-per-call", type=int, default=4, help="experts carried by one Invoke (default 4)")
    bench.add_argument("--threads", type=int, default=1, help="torch threads, host and baseline alike (default 1)")
    add_bench_flags(bench)
    bench.set_defaults(func=_bench_invoke)


def _bench_invoke(args: argparse.Namespace) -> int:
    sizes = dict(tokens=(1, 64, 512), repeats=10) if args.quick else {}
    hidden, ffn = args.hidden or DEFAULT_EXPERT_SHAPE[0], args.ffn or DEFAULT_EXPERT_SHAPE[1]
    result = run_invoke_bench(hidden=hidden, ffn=ffn, experts_per_call=args.experts_per_call,
                              threads=args.threads, **sizes)
    return print_and_write(args.out, "expert-invoke", result, print_invoke_bench)


def _timed(fn: Callable[[], object], repeats: int) -> tuple[float, float, list]:
    """(median and min wall seconds of fn, its results) over repeats calls after one warm-up.

    The min shows the cost on an unloaded machine; the median what a busy one gave.
    """
    fn()
    times, results = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        results.append(fn())
        times.append(time.perf_counter() - started)
    return statistics.median(times), min(times), results


def run_invoke_bench(
    *, hidden: int = 576, ffn: int = 192, experts_per_call: int = 4,
    tokens: tuple[int, ...] = (1, 8, 64, 256, 1024), repeats: int = 30, threads: int = 1,
) -> dict:
    """Figures per tokens-per-expert size: {"rows": [...], "cold_start_s": ..., shape facts}."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    shapes = {"gate": (ffn, hidden), "up": (ffn, hidden), "down": (hidden, ffn)}
    weights = [
        {name: torch.randn(shape, generator=gen) / shape[1] ** 0.5 for name, shape in shapes.items()}
        for _ in range(experts_per_call)
    ]
    rows = []
    with tempfile.TemporaryDirectory(prefix="moeless-bench-") as root:
        store = export_experts(((0, e, w) for e, w in enumerate(weights)), root, model="random", num_layers=1,
                               num_experts=experts_per_call, act="silu")
        tiers = tier_load_times(store, repeats)
        with launch_local_hosts(1, root, metrics=False, threads=threads) as hosts, ExpertHostClient(hosts.addresses[0]) as client:
            started = time.perf_counter()
            client.load(0, 0, wait=True)  # the host's first load of the file: from disk
            cold_start_s = time.perf_counter() - started
            reloads = []
            for _ in range(repeats):  # evicted, then loaded again: from the host's memory tier
                client.evict(0, 0)
                started = time.perf_counter()
                client.load(0, 0, wait=True)
                reloads.append(time.perf_counter() - started)
            tiers["grpc_host_s"] = statistics.median(reloads)
            for e in range(1, experts_per_call):
                client.load(0, e, wait=True)
            for n in tqdm(tokens, desc="tokens per expert"):
                batches = {e: torch.randn(n, hidden, generator=gen) for e in range(experts_per_call)}
                remote, remote_min, replies = _timed(lambda b=batches: client.invoke_detailed(0, b), repeats)
                local, local_min, _ = _timed(lambda b=batches: [expert_forward(weights[e], x) for e, x in b.items()], repeats)
                host_compute = statistics.median(r.compute_s for r in replies)
                total = n * experts_per_call
                rows.append({
                    "tokens_per_expert": n, "tokens_per_call": total, "remote_ms": remote * 1e3, "local_ms": local * 1e3,
                    "host_compute_ms": host_compute * 1e3, "overhead_ms": (remote - local) * 1e3,
                    "transport_ms": (remote - host_compute) * 1e3, "remote_us_per_token": remote / total * 1e6,
                    "local_us_per_token": local / total * 1e6, "ratio": remote / local,
                    "remote_min_ms": remote_min * 1e3, "local_min_ms": local_min * 1e3,
                })
    tiers["grpc_disk_s"] = cold_start_s
    return {"hidden": hidden, "ffn": ffn, "experts_per_call": experts_per_call, "threads": threads,
            "repeats": repeats, "cold_start_s": cold_start_s, "tiers": tiers, "rows": rows}


def tier_load_times(store, repeats: int) -> dict:
    """Median seconds of one replica's load per tier, as the expert host runs it (in-process):
    disk_to_host (read + sha256 + parse), host_to_device (the copy), cold_no_tier (both, tier off)."""
    copier = DeviceCopier("cpu")
    off = HostTier(store, TierConfig(capacity_bytes=0))
    times: dict[str, list[float]] = {"disk_to_host_s": [], "host_to_device_s": [], "cold_no_tier_s": []}
    for _ in range(repeats + 1):  # the first round warms the page cache and allocator
        tier = HostTier(store)
        started = time.perf_counter()
        weights, _ = tier.get((0, 0))
        read = time.perf_counter() - started
        started = time.perf_counter()
        copier.to_device(weights)
        copy = time.perf_counter() - started
        started = time.perf_counter()
        copier.to_device(off.get((0, 0))[0])
        whole = time.perf_counter() - started
        for name, value in zip(times, (read, copy, whole)):
            times[name].append(value)
    return {name: statistics.median(values[1:]) for name, values in times.items()}


def print_invoke_bench(result: dict) -> None:
    print(f"expert invoke: H={result['hidden']} F={result['ffn']}, {result['experts_per_call']} experts per call, "
          f"{result['threads']} thread(s), median of {result['repeats']}; baseline = the same experts in-process")
    print("overhead = remote - local; transport = remote - the host's own compute time")
    print(f"{'tok/expert':>10} {'remote ms':>10} {'local ms':>9} {'host ms':>8} {'overhead ms':>12} {'transport ms':>13} "
          f"{'remote us/tok':>14} {'local us/tok':>13} {'ratio':>6}")
    for r in result["rows"]:
        print(f"{r['tokens_per_expert']:>10} {r['remote_ms']:>10.3f} {r['local_ms']:>9.3f} {r['host_compute_ms']:>8.3f} "
              f"{r['overhead_ms']:>12.3f} {r['transport_ms']:>13.3f} "
              f"{r['remote_us_per_token']:>14.2f} {r['local_us_per_token']:>13.2f} {r['ratio']:>6.2f}")
    print("min over the repeats (least disturbed by other load), remote / local ms: "
          + ", ".join(f"{r['tokens_per_expert']}: {r['remote_min_ms']:.2f} / {r['local_min_ms']:.2f}" for r in result["rows"]))
    t = result["tiers"]
    print(f"cold start of one replica ({result['hidden']}x{result['ffn']} float32), median:")
    print(f"  in-process: disk -> host {t['disk_to_host_s'] * 1e3:.3f} ms (read + sha256 + parse), host -> device "
          f"{t['host_to_device_s'] * 1e3:.3f} ms (the copy), no host tier {t['cold_no_tier_s'] * 1e3:.3f} ms")
    print(f"  over gRPC (Load, wait): first load {t['grpc_disk_s'] * 1e3:.3f} ms (from disk), reload after eviction "
          f"{t['grpc_host_s'] * 1e3:.3f} ms (from host memory)")
    print("  beside the host's compute of one call (one layer's experts on this host), ms: "
          + ", ".join(f"{r['tokens_per_expert']} tok/expert {r['host_compute_ms']:.3f}" for r in result["rows"]))
    first = result["rows"][0]["host_compute_ms"] / 1e3
    print(f"  a cold start from host memory is {t['host_to_device_s'] / first:.1f}x the smallest call's compute; "
          f"from disk {t['cold_no_tier_s'] / first:.1f}x")
