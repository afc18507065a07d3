"""`moeless bench peer-copy`: a replica copied from a peer host that holds it, against a load from
the loading host's own weight store and from its host tier.

A spare that a widening loads, or a host a scale-out adds, starts with an empty host tier: each of
its loads reads and verifies its store's file (disk -> host memory -> device). Where another host
of the pool holds the replica resident, the planning loop names that host as the load's source and
the loading host copies it from there (expert_fn/host/peer_copy.py). On two local hosts over a
model's store:

1. Host 0 loads every expert of the first --layers layers (the holder).
2. Host 1, started fresh (its host tier empty): those experts in one LoadMany from its store (the
   baseline: read, sha256, parse, copy to the device), then evicted and loaded again from its host
   tier (what a host that held them before pays).
3. Host 1 restarted (its tier empty again): the same LoadMany, host 0 every replica's source, the
   hosts set to copy from a peer always (`--peer-copies always`).
Steps 2-3 run --repeats times. 4. --repeats times, a fresh host with the default `--peer-copies
measured`, host 0 every replica's source: it measures each way, then copies while copies measure
faster than its store reads, so it ends near the faster way (the copies and store reads it chose
are printed).
Printed: milliseconds per expert and GB/s each way, the ratios peer / store and peer / tier, and
whether every copied replica computes what host 0's does (each expert's output on a batch of
tokens, bit for bit).

The store's files are in the OS page cache (host 0 read them first): the store's figure is the
read, checksum and parse out of memory, the least a store load costs (a network volume costs more).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from moeless.bench import BENCHES
from moeless.bench.common import add_bench_flags, print_and_write
from moeless.expert_fn.client.client import ExpertHostClient
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.model.weight_store import export_store
from moeless.serving.cli import MODEL_HELP, _positive
from moeless.serving.config import choose_model


def register(benches: argparse._SubParsersAction) -> None:
    """Add `moeless bench peer-copy`."""
    bench = benches.add_parser("peer-copy", help=BENCHES["peer-copy"].help,
                               description="Load a model's experts on a fresh expert host from its weight store, from "
                                           "its host tier and from a peer host holding them; print ms per expert, "
                                           "GB/s and the ratios, and check the copies compute exactly. --quick: the "
                                           "tiny model, one repeat.")
    bench.add_argument("--model", default="default", help=MODEL_HELP.split(", or BASE")[0])
    bench.add_argument("--layers", type=_positive, default=4, help="layers whose experts are loaded (default 4)")
    bench.add_argument("--repeats", type=_positive, default=3, help="store / peer rounds (default 3)")
    bench.add_argument("--device", default="cpu", help="the hosts' device: cpu (default) or cuda")
    add_bench_flags(bench)
    bench.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    model, repeats = ("tiny:mixtral", 1) if args.quick else (args.model, args.repeats)
    result = run_peer_copy_bench(model, layers=args.layers, repeats=repeats, device=args.device)
    return print_and_write(args.out, "peer-copy", result, print_report)


def run_peer_copy_bench(model: str = "default", *, layers: int = 4, repeats: int = 3, device: str = "cpu") -> dict[str, Any]:
    """The measurement of the module docstring; returns the figures."""
    choice = choose_model(model)
    loaded = choice.loader()
    spec = loaded.spec
    store = export_store(loaded, choice.name)
    del loaded
    layers = min(layers, spec.num_layers)
    replicas = [(layer, expert) for layer in range(layers) for expert in range(spec.num_experts)]
    tokens = torch.randn(8, spec.hidden_size, generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {"store": [], "tier": [], "peer": []}
    exact = True
    cpu = device == "cpu"
    with launch_local_hosts(2, store, keep_alive_s=600.0, metrics=False, cpu=cpu, peer_copies="always") as group:
        holder = ExpertHostClient(group.addresses[0], timeout_s=120)
        holder.load_many(replicas, wait=True)

        def timed_load(address: str = group.addresses[1], **sources) -> float:
            with ExpertHostClient(address, timeout_s=120) as client:
                started = time.perf_counter()
                client.load_many(replicas, wait=True, **sources)
                return time.perf_counter() - started

        for _ in range(repeats):
            group.restart(1)
            times["store"].append(timed_load())
            with ExpertHostClient(group.addresses[1], timeout_s=120) as client:
                for layer, expert in replicas:
                    client.evict(layer, expert)
            times["tier"].append(timed_load())
            group.restart(1)
            times["peer"].append(timed_load(sources=[group.addresses[0]] * len(replicas)))
            with ExpertHostClient(group.addresses[1], timeout_s=120) as client:
                copies = client.status()["peer_copies"]
                exact &= copies["copies"] == len(replicas) and all(
                    torch.equal(client.invoke(layer, {expert: tokens})[expert],
                                holder.invoke(layer, {expert: tokens})[expert]) for layer, expert in replicas)
        times["measured"], chose = [], []
        for _ in range(repeats):
            with launch_local_hosts(1, store, keep_alive_s=600.0, metrics=False, cpu=cpu) as chooser:
                times["measured"].append(timed_load(chooser.addresses[0], sources=[group.addresses[0]] * len(replicas)))
                with ExpertHostClient(chooser.addresses[0]) as client:
                    chose.append(client.status()["peer_copies"])
        holder.close()
    expert_bytes = 3 * spec.expert_ffn * spec.hidden_size * 4  # float32 on the hosts
    median = {way: statistics.median(t) for way, t in times.items()}
    return {
        "model": choice.name, "device": device, "layers": layers, "experts": len(replicas), "repeats": repeats,
        "expert_bytes": expert_bytes, "seconds": times, "copies_exact": exact,
        "measured_chose": [{"peer": c["copies"], "store": c["passed"], "peer_gb_per_s": c["peer_gb_per_s"],
                            "store_gb_per_s": c["store_gb_per_s"]} for c in chose],
        "ms_per_expert": {way: s / len(replicas) * 1e3 for way, s in median.items()},
        "gb_per_s": {way: expert_bytes * len(replicas) / s / 1e9 for way, s in median.items()},
        "peer_over_store": median["peer"] / median["store"], "peer_over_tier": median["peer"] / median["tier"],
    }


def print_report(r: dict[str, Any]) -> None:
    print(f"{r['model']} on {r['device']}: {r['experts']} experts of {r['layers']} layers, "
          f"{r['expert_bytes'] / 1e6:.2f} MB each, median of {r['repeats']} (host 1 fresh each time)")
    for way, label in (("store", "its weight store (read, sha256, parse, copy)"), ("tier", "its host tier (a copy)"),
                       ("peer", "a peer host holding them " + ("(CUDA IPC)" if r["device"].startswith("cuda") else "(gRPC)")),
                       ("measured", "either, as --peer-copies measured chose")):
        print(f"  from {label:45s} {r['ms_per_expert'][way]:8.3f} ms/expert  {r['gb_per_s'][way]:7.2f} GB/s")
    print(f"  peer / store: {r['peer_over_store']:.2f}x   peer / tier: {r['peer_over_tier']:.2f}x   "
          f"copies compute exactly: {'yes' if r['copies_exact'] else 'NO'}")
    for c in r["measured_chose"]:
        print(f"  measured: {c['peer']} from the peer, {c['store']} from the store (moving averages: peer "
              f"{c['peer_gb_per_s']:.2f} GB/s, store {c['store_gb_per_s']:.2f} GB/s)")
