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
   hosts set to copy from a peer always (`--peer-copies always`): WRITTEN over NIXL where nixl is
   installed (expert_fn/host/peer_links.py; GPU memory to GPU memory with --device cuda). A host
   opens its NIXL link to a peer in the background at its first copy from it (that copy goes over
   CUDA IPC on a GPU, else as bytes over gRPC), so host 1 first loads one replica and waits for its
   link (the seconds it took are printed), then loads the rest. With --device cuda, a fresh host
   with `--no-nixl` copies them over CUDA IPC, one ask a replica (the `ipc` row). A fresh host with
   `--no-peer-ipc --peer-ask-mb 0` does it in asks of one link region's worth each (64 MiB, or one
   replica where it is larger), not streamed through the region in asks of up to 1 GiB as by
   default (peer_links.py): the ratio says what the asks' fixed part costs. Then a fresh host with
   `--no-nixl --no-peer-ipc` loads them all from host 0 as bytes over gRPC.
Steps 2-3 run --repeats times. 4. --repeats times, a fresh host with the default `--peer-copies
measured`, host 0 every replica's source: it measures each way, then copies while copies measure
faster than its store reads, so it ends near the faster way (the copies and store reads it chose
are printed).
Printed: milliseconds per expert and GB/s each way, the ratios peer / store and peer / tier, and
how many replicas of each way compute other bits than host 0's (each expert's output on a batch of
tokens; a copy must differ in none; a store load is the reference for what two hosts' computes may do).

The store's files are in the OS page cache (host 0 read them first): the store's figure is the
read, checksum and parse out of memory, the least a store load costs (a network volume costs more).

`--expert-shape FxH` times experts of another size (e.g. 1408x2048, DeepSeek-V2-Lite's: 34.6 MB in
float32) from a store of random weights of that shape, --experts of them a layer: what is timed is
bytes moved and checked, which the values do not change; the copies are still checked exactly.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from moeless.bench import BENCHES
from moeless.bench.common import add_bench_flags, print_and_write
from moeless.expert_fn.client.client import ExpertHostClient
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.model.weight_store import export_experts, export_store
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
    bench.add_argument("--expert-shape", type=_shape, default=None, metavar="FxH",
                       help="time random experts of this shape instead of --model's (e.g. 1408x2048: DeepSeek-V2-Lite)")
    bench.add_argument("--experts", type=_positive, default=16, help="experts a layer with --expert-shape (default 16)")
    add_bench_flags(bench)
    bench.set_defaults(func=_bench)


def _shape(text: str) -> tuple[int, int]:
    try:
        ffn, hidden = (int(d) for d in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"an expert shape is FxH (e.g. 1408x2048), got {text!r}") from None
    if ffn < 1 or hidden < 1:
        raise argparse.ArgumentTypeError(f"an expert shape's sizes are >= 1, got {text!r}")
    return ffn, hidden


def _bench(args: argparse.Namespace) -> int:
    model, repeats = ("tiny:mixtral", 1) if args.quick else (args.model, args.repeats)
    result = run_peer_copy_bench(model, layers=args.layers, repeats=repeats, device=args.device,
                                 shape=args.expert_shape, experts=args.experts)
    return print_and_write(args.out, "peer-copy", result, print_report)


def random_store(shape: tuple[int, int], layers: int, experts: int, root: Path) -> Path:
    """A weight store of layers x experts random float32 experts of shape (F, H) under root."""
    ffn, hidden = shape
    make = torch.Generator().manual_seed(0)
    export_experts(((layer, expert, {"gate": torch.randn(ffn, hidden, generator=make) * 0.02,
                                     "up": torch.randn(ffn, hidden, generator=make) * 0.02,
                                     "down": torch.randn(hidden, ffn, generator=make) * 0.02})
                    for layer in range(layers) for expert in range(experts)),
                   root, model=f"random-{ffn}x{hidden}", num_layers=layers, num_experts=experts, act="silu")
    return root


def run_peer_copy_bench(model: str = "default", *, layers: int = 4, repeats: int = 3, device: str = "cpu",
                        shape: tuple[int, int] | None = None, experts: int = 16) -> dict[str, Any]:
    """The measurement of the module docstring; returns the figures."""
    with tempfile.TemporaryDirectory(prefix="moeless-peer-copy-") as scratch:
        if shape is not None:
            name, store = f"random-{shape[0]}x{shape[1]}", random_store(shape, layers, experts, Path(scratch))
            (ffn, hidden), num_experts = shape, experts
        else:
            choice = choose_model(model)
            loaded = choice.loader()
            name, store, spec = choice.name, export_store(loaded, choice.name), loaded.spec
            del loaded
            ffn, hidden, num_experts, layers = spec.expert_ffn, spec.hidden_size, spec.num_experts, min(layers, spec.num_layers)
        expert_bytes = 3 * ffn * hidden * 4  # float32 on the hosts
        result = _timed(store, layers, num_experts, hidden, expert_bytes, repeats, device)
    return {"model": name, "device": device, "layers": layers, "experts": layers * num_experts, "repeats": repeats,
            "expert_bytes": expert_bytes, **result}


def _timed(store: Path, layers: int, num_experts: int, hidden: int, expert_bytes: int, repeats: int,
           device: str) -> dict[str, Any]:
    """Steps 1-4 of the module docstring over `store`: the seconds each way, the copies' checks, the ratios."""
    replicas = [(layer, expert) for layer in range(layers) for expert in range(num_experts)]
    tokens = torch.randn(8, hidden, generator=torch.Generator().manual_seed(0))
    cpu = device == "cpu"
    # the routes timed beside the host's first (NIXL), a fresh host each: CUDA IPC on a GPU (no NIXL), NIXL asks
    # of one region's worth each, not streamed (--peer-ask-mb 0), bytes over gRPC
    routes = {**({} if cpu else {"ipc": {"nixl": False}}), "region": {"peer_ipc": False, "peer_ask_mb": 0},
              "grpc": {"nixl": False, "peer_ipc": False}}
    times: dict[str, list[float]] = {"store": [], "tier": [], "peer": [], **{route: [] for route in routes}}
    exact, linked, link_s = True, 0, []
    differing: dict[str, list[int]] = {way: [] for way in [*times, "measured"] if way != "tier"}
    with launch_local_hosts(2, store, keep_alive_s=600.0, metrics=False, cpu=cpu, peer_copies="always") as group:
        holder = ExpertHostClient(group.addresses[0], timeout_s=120)
        holder.load_many(replicas, wait=True)
        expected = {(layer, expert): holder.invoke(layer, {expert: tokens})[expert] for layer, expert in replicas}

        def differs(address: str) -> int:
            """How many of the host at `address`'s replicas compute other bits than host 0's."""
            with ExpertHostClient(address, timeout_s=120) as client:
                return sum(not torch.equal(client.invoke(layer, {expert: tokens})[expert], expected[layer, expert])
                           for layer, expert in replicas)

        def timed_load(address: str = group.addresses[1], some: list = replicas, **sources) -> float:
            """Seconds an expert, loading `some` in one LoadMany."""
            with ExpertHostClient(address, timeout_s=120) as client:
                started = time.perf_counter()
                client.load_many(some, wait=True, **sources)
                return (time.perf_counter() - started) / len(some)

        def copied(address: str, linking: bool, counted: bool = True) -> float:
            """Seconds an expert copied from host 0 to the fresh host at `address`, its NIXL link opened first
            where `linking`; the copies checked (exact), and counted where WRITTEN over NIXL (linked; not
            the region route's: the same link, asked otherwise)."""
            nonlocal exact, linked
            some = replicas[1:] if linking else replicas
            if linking:
                link_s.append(_open_link(address, replicas[0], group.addresses[0]))
            seconds = timed_load(address, some=some, sources=[group.addresses[0]] * len(some))
            with ExpertHostClient(address, timeout_s=120) as client:
                copies = client.status()["peer_copies"]
            linked += copies["linked"] if linking and counted else 0
            exact &= copies["copies"] == len(replicas)
            return seconds

        for _ in range(repeats):
            group.restart(1)
            times["store"].append(timed_load())
            differing["store"].append(differs(group.addresses[1]))
            with ExpertHostClient(group.addresses[1], timeout_s=120) as client:
                for layer, expert in replicas:
                    client.evict(layer, expert)
            times["tier"].append(timed_load())
            group.restart(1)
            times["peer"].append(copied(group.addresses[1], linking=True))
            differing["peer"].append(differs(group.addresses[1]))
            for route, flags in routes.items():
                with launch_local_hosts(1, store, keep_alive_s=600.0, metrics=False, cpu=cpu, peer_copies="always",
                                        **flags) as fresh:
                    times[route].append(copied(fresh.addresses[0], linking=route == "region", counted=False))
                    differing[route].append(differs(fresh.addresses[0]))
        times["measured"], chose = [], []
        for _ in range(repeats):
            with launch_local_hosts(1, store, keep_alive_s=600.0, metrics=False, cpu=cpu) as chooser:
                times["measured"].append(timed_load(chooser.addresses[0], sources=[group.addresses[0]] * len(replicas)))
                differing["measured"].append(differs(chooser.addresses[0]))
                with ExpertHostClient(chooser.addresses[0]) as client:
                    chose.append(client.status()["peer_copies"])
        holder.close()
    median = {way: statistics.median(t) for way, t in times.items()}
    return {
        "seconds_per_expert": times, "linked_per_round": linked / repeats, "differing": differing,
        "copies_exact": exact and not any(n for way, counts in differing.items() for n in counts if way != "store"),
        "link_open_s": link_s,
        "measured_chose": [{"peer": c["copies"], "store": c["passed"], "peer_gb_per_s": c["peer_gb_per_s"],
                            "store_gb_per_s": c["store_gb_per_s"]} for c in chose],
        "ms_per_expert": {way: s * 1e3 for way, s in median.items()},
        "gb_per_s": {way: expert_bytes / s / 1e9 for way, s in median.items()},
        "peer_over_store": median["peer"] / median["store"], "peer_over_tier": median["peer"] / median["tier"],
        "grpc_over_store": median["grpc"] / median["store"],
        **({"ipc_over_store": median["ipc"] / median["store"]} if "ipc" in median else {}),
        "streamed_over_region": median["peer"] / median["region"],
    }


def _open_link(address: str, replica: tuple[int, int], source: str, timeout_s: float = 30.0) -> float:
    """Load `replica` on the host at `address` from `source`, which opens its NIXL link to it in the
    background (its copy goes as bytes meanwhile), and wait for the link: seconds until it is open
    (nan where the host opens none: NIXL missing or refused)."""
    with ExpertHostClient(address, timeout_s=120) as client:
        started = time.perf_counter()
        client.load_many([replica], wait=True, sources=[source])
        while time.perf_counter() - started < timeout_s:
            if client.status()["peer_copies"]["links"]:
                return time.perf_counter() - started
            time.sleep(0.01)
    return float("nan")


def print_report(r: dict[str, Any]) -> None:
    print(f"{r['model']} on {r['device']}: {r['experts']} experts of {r['layers']} layers, "
          f"{r['expert_bytes'] / 1e6:.2f} MB each, median of {r['repeats']} (host 1 fresh each time)")
    gpu = r["device"].startswith("cuda")
    for way, label in (("store", "its weight store (read, sha256, parse, copy)"), ("tier", "its host tier (a copy)"),
                       ("peer", "a peer host holding them " + ("(NIXL)" if r["linked_per_round"] else
                                                               "(CUDA IPC, no NIXL)" if gpu else "(gRPC, no NIXL)")),
                       ("ipc", "a peer host, over CUDA IPC (--no-nixl)"),
                       ("region", "a peer host, NIXL asks of a region each"),
                       ("grpc", "a peer host, as bytes over gRPC (--no-nixl)"),
                       ("measured", "either, as --peer-copies measured chose")):
        if way in r["ms_per_expert"]:
            print(f"  from {label:45s} {r['ms_per_expert'][way]:8.3f} ms/expert  {r['gb_per_s'][way]:7.2f} GB/s")
    if r["linked_per_round"]:
        print(f"  (NIXL link opened in {statistics.median(r['link_open_s']):.2f} s, median; "
              f"{r['linked_per_round']:.0f} copies a round WRITTEN over it)")
    nixl = f"   over CUDA IPC / store: {r['ipc_over_store']:.2f}x" if "ipc_over_store" in r else ""
    print(f"  peer / store: {r['peer_over_store']:.2f}x{nixl}   over gRPC / store: {r['grpc_over_store']:.2f}x   peer / tier: "
          f"{r['peer_over_tier']:.2f}x   copies compute exactly: {'yes' if r['copies_exact'] else 'NO'}")
    print(f"  NIXL asks streamed (up to 1 GiB each) / one ask a region: {r['streamed_over_region']:.2f}x")
    print(f"  replicas computing other bits than host 0's, of {r['experts']} a round: "
          + ", ".join(f"{way} {'/'.join(map(str, counts))}" for way, counts in r["differing"].items()))
    for c in r["measured_chose"]:
        print(f"  measured: {c['peer']} from the peer, {c['store']} from the store (moving averages: peer "
              f"{c['peer_gb_per_s']:.2f} GB/s, store {c['store_gb_per_s']:.2f} GB/s)")
