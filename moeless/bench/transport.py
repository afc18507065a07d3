"""`moeless bench transport`: what one expert call costs over each way of reaching a host, side by side.

One expert host process serves the model's weight store; the same calls go over:

- in_process: ExpertHostRuntime.invoke in this process (the baseline: the compute alone);
- routed_in_process: the host's whole routed call (gather, compute, weighted combine) in this
  process, on the frame's own rows: what a host adds to the compute before any transport;
- local: the shared-memory local channel (memfd + Unix socket): hosts on the same machine (node);
- tcp: the TCP channel (one connection, frames into preallocated buffers): the path between pods;
- nixl: the TCP channel with the rows and z written by NIXL into each side's registered buffer
  (nixl_link.py; only the head and the lists on the socket); left out, and said, where nixl is
  not installed;
- grpc: InvokeRouted over loopback gRPC (the frame as one bytes field);
- grpc_per_expert: the first API, Invoke (one protobuf message per expert, float32);
- ray_compiled_graph (with --ray): a Ray actor holding the same runtime behind a compiled graph
  (Ray's shared-memory channels), the other option considered.

Two kinds of call, each in two sizes:
- round trip: one expert, a decode-sized call of 16 rows (36 KB at H=576, float32) and a
  prefill-sized one of 1024 rows (2.4 MB), rows each way: what the transport costs by size;
- layer share: one host's routed call of one MoE layer with static EP over 2 hosts, from random
  top-k routing of a decode step of B = 4 tokens and a prefill of B = 256 tokens.
Reported per call: the median (p50) and p90 of the round trip, its ratio to in-process at p50,
the host's own compute, the bytes of the frame each way, and whether each transport's answer is
bit-identical to the same routed call run in-process.

--device cuda: the host computes on the GPU (the in-process baseline too, on the same GPU); the
serving side's rows stay in host memory, so every transport stages them (host -> GPU on the
host, GPU -> host for the reply). The `staging` row times those two copies alone for the same
rows: what a transport that moves GPU memory without a host copy (NIXL over NVLink or RDMA: not
built) could save at most, and the `device_rows` row is the compute alone on rows already on
the GPU, outputs left there: what static EP in one process on that GPU pays. Rows that start from
rows on the GPU, as a serving replica on a GPU would: `routed_device_rows`, the host's whole
routed call in this process; `local_device`, the same call over the local channel with the
rows and z in a GPU buffer the host maps (CUDA IPC, no host staging); `nixl_device`, NIXL writing
the rows and z from GPU buffer to GPU buffer (UCX's CUDA transports; the path between nodes over
RDMA, no host staging); `tcp_device` stages the same rows through host memory over TCP. On one GPU the host and
this process take turns on it: without MPS each turn is a context switch. Without CUDA it stops
with one clear error before loading anything.

--geometry NAME: instead of a model, one MoE layer of random experts in a named model's shape and
dtype (twin/geometry.py: Mixtral-8x7B's H=4096, F=14336, 8 experts, top-2, bfloat16), so a GPU
is timed on the sizes it would serve; the rows travel in that dtype. Needs neither a model
download nor Ray.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from moeless.bench import BENCHES
from moeless.bench.common import add_bench_flags, add_poll_flag, poll_from_args, print_and_write, start_local_ray
from moeless.core.timing import timed_calls
from moeless.expert_fn.client.client import ExpertHostClient
from moeless.expert_fn.errors import ExpertHostError
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.expert_fn.wire.nixl_link import unavailable as nixl_unavailable
from moeless.expert_fn.wire.polling import DEFAULT_CLIENT_POLL_S, DEFAULT_HOST_POLL_S
from moeless.expert_fn.wire.routed import RoutedCall, decode_call, encode_call
from moeless.expert_fn.host.run_routed import run_routed
from moeless.expert_fn.host.runtime import ExpertHostRuntime
from moeless.expert_fn.options import COMPUTE_DTYPES
from moeless.hardware.cuda_profile import CudaUnavailable, require_cuda
from moeless.model.dtypes import DTYPES
from moeless.model.weight_store import WeightStore, cached_store, export_experts, export_store, stored_dtype
from moeless.placement.types import LayerPlacement
from moeless.serving.scatter import plan_scatter
from moeless.serving.cli import MODEL_HELP, _positive
from moeless.twin.geometry import Geometry, GeometryError, load_geometry

BATCH_TOKENS = {"decode": 4, "prefill": 256}  # tokens of the layer call one host gets its share of
ROUND_TRIP_ROWS = {"decode": 16, "prefill": 1024}  # 36 KB and 2.4 MB at H=576, float32
TRANSPORTS = ("local", "tcp", "nixl", "grpc")


def register(benches: argparse._SubParsersAction) -> None:
    """Add `moeless bench transport`."""
    transport = benches.add_parser(
        "transport", help=BENCHES["transport"].help,
        description="Time expert calls of decode and prefill size on one local expert host over each transport "
                    "(round trips of 36 KB and 2.4 MB; one host's routed share of a layer); print p50 and p90, "
                    "ratios to the in-process call, and bytes each way.",
    )
    what = transport.add_mutually_exclusive_group()
    what.add_argument("--model", default="default", help=MODEL_HELP)
    what.add_argument("--geometry", metavar="NAME",
                      help="time one MoE layer of random experts in this model's shape and dtype instead (one of "
                           "twin/geometry.py's names: mixtral-8x7b, phi-3.5-moe, ...; a store written once under the "
                           "cache dir, ~3 GB for mixtral-8x7b)")
    transport.add_argument("--repeats", type=_positive, help="calls per transport and size (default 200; 50 with --quick)")
    add_poll_flag(transport)
    transport.add_argument("--compute-dtype", choices=COMPUTE_DTYPES, default="float32",
                           help="the hosts' and the baseline's compute dtype (expert-host --compute-dtype; default "
                                "float32; store: the weights' own, bfloat16 for --geometry mixtral-8x7b)")
    transport.add_argument("--ray", action="store_true", help="also time a Ray compiled graph (starts local Ray)")
    transport.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                           help="where the host computes (cuda: the hosts and the in-process baseline on GPU 0, "
                                "plus the host-memory staging alone; needs nvidia-ml-py, the gpu extra)")
    add_bench_flags(transport)
    transport.set_defaults(func=_bench_transport)


def _bench_transport(args: argparse.Namespace) -> int:
    try:
        if args.device == "cuda":
            require_cuda()
        if args.geometry:
            load_geometry(args.geometry)
    except (CudaUnavailable, GeometryError) as err:
        print(f"moeless bench transport: {err}", file=sys.stderr)
        return 2
    result = run_transport_bench(args.model, repeats=args.repeats or (50 if args.quick else 200), ray_graph=args.ray,
                                 poll_s=poll_from_args(args), device=args.device, geometry=args.geometry,
                                 compute_dtype=args.compute_dtype)
    return print_and_write(args.out, "transport", result, print_report)


def layer_calls(num_experts: int, top_k: int, hidden: int, seed: int = 0,
                dtype: torch.dtype = torch.float32) -> dict[str, tuple[RoutedCall, torch.Tensor]]:
    """Host 0's routed call of one MoE layer under static EP over 2 hosts, from random top-k routing
    of BATCH_TOKENS tokens (name -> (call, x), x in dtype)."""
    rng = np.random.default_rng(seed)
    placement = LayerPlacement.even(np.arange(num_experts), np.arange(num_experts) * 2 // num_experts, num_experts)
    out = {}
    for name, tokens in BATCH_TOKENS.items():
        idx = torch.tensor(np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(tokens)]))
        plan = plan_scatter(0, idx, torch.rand(tokens, top_k), placement)
        out[f"layer_{name}"] = (plan.hosts[0].call, torch.randn(tokens, hidden).to(dtype))
    return out


def round_trip_calls(hidden: int, dtype: torch.dtype = torch.float32) -> dict[str, tuple[RoutedCall, torch.Tensor]]:
    """One expert on ROUND_TRIP_ROWS rows, each its own output (name -> (call, x), x in dtype)."""
    return {f"round_trip_{name}": (RoutedCall.packed(0, [0], [rows], torch.arange(rows), dtype=dtype),
                                   torch.randn(rows, hidden).to(dtype))
            for name, rows in ROUND_TRIP_ROWS.items()}


def random_layer_store(geometry: Geometry, seed: int = 0) -> Path:
    """A weight store of one MoE layer of random experts in geometry's shape and dtype (weights
    ~ N(0, 0.02), as initialised), written once under the cache dir and reused."""
    dtype = getattr(torch, geometry.dtype if geometry.dtype in DTYPES else "bfloat16")  # float8: no store holds it
    h, f = geometry.hidden, geometry.expert_ffn
    sizes = f"h{h}-f{f}-e{geometry.num_experts}-s{seed}-{str(dtype).removeprefix('torch.')}"  # a name may repeat
    gen = torch.Generator().manual_seed(seed)

    def experts():
        for e in tqdm(range(geometry.num_experts), desc=f"random {geometry.name} experts", unit="expert"):
            shapes = {"gate": (f, h), "up": (f, h), "down": (h, f)}
            yield 0, e, {n: (0.02 * torch.randn(shape, generator=gen)).to(dtype) for n, shape in shapes.items()}

    return cached_store(f"random-{geometry.name}", sizes, lambda root: export_experts(
        experts(), root, model=f"random-{geometry.name}", num_layers=1, num_experts=geometry.num_experts, act="silu"))


def run_transport_bench(model: str = "default", *, repeats: int = 200, ray_graph: bool = False,
                        threads: int = 1, poll_s: tuple[float, float] = (DEFAULT_HOST_POLL_S, DEFAULT_CLIENT_POLL_S),
                        device: str = "cpu", geometry: str | None = None,
                        compute_dtype: str = "float32") -> dict[str, Any]:
    """Time every call over every transport (see the module docstring); poll_s: (host, client) spins;
    device: "cpu" or "cuda" (the hosts' and the baseline's; CudaUnavailable without one); geometry:
    a twin geometry's name to time one layer of random experts of its shape instead of `model`;
    compute_dtype: the hosts' and the baseline's (expert_fn/options.COMPUTE_DTYPES)."""
    torch_device = "cuda:0" if device == "cuda" else "cpu"
    if device == "cuda":
        require_cuda()
    from moeless.serving.config import choose_model  # heavy (transformers): kept off --help's start-up path

    torch.set_num_threads(threads)
    if geometry:
        shape = load_geometry(geometry)
        model_name, store_dir = f"random-{shape.name}", random_layer_store(shape)
        hidden, num_experts, top_k = shape.hidden, shape.num_experts, shape.top_k
    else:
        choice = choose_model(model)
        loaded = choice.loader()
        model_name, store_dir = choice.name, export_store(loaded, choice.name)
        hidden, num_experts, top_k = loaded.spec.hidden_size, loaded.spec.num_experts, loaded.spec.top_k
        del loaded
    store = WeightStore.open(store_dir)
    dtype = stored_dtype(store)
    calls = round_trip_calls(hidden, dtype) | layer_calls(num_experts, top_k, hidden, dtype=dtype)
    times: dict[str, dict[str, dict[str, float]]] = {name: {} for name in calls}
    reference, identical = {}, {name: {} for name in calls}
    # 1. In-process: the runtime alone, on the same experts' rows (on the GPU: rows from host memory, as a host gets them).
    runtime = ExpertHostRuntime(store, device=torch_device, capacity_bytes=4 * 10**9, keep_alive_s=3600,
                                compute_dtype=compute_dtype)
    for name, (call, x) in calls.items():
        batches = _batches(call, x)
        times[name]["in_process"] = timed_calls(lambda b=batches: runtime.invoke(0, b), repeats)
        decoded = decode_call(encode_call(0, call, x))
        times[name]["routed_in_process"] = timed_calls(lambda d=decoded: run_routed(runtime, d), repeats)
        reference[name] = run_routed(runtime, decoded)[0]
        if device == "cuda":
            rows = x.index_select(0, call.tokens).pin_memory()
            times[name]["staging"] = timed_calls(lambda r=rows: _stage(r, torch_device), repeats)
            on_gpu = {e: b.to(torch_device) for e, b in batches.items()}
            times[name]["device_rows"] = timed_calls(lambda b=on_gpu: runtime.invoke(0, b, on_device=True), repeats)
            rows_on_gpu = replace(decoded, x=decoded.x.to(torch_device))
            times[name]["routed_device_rows"] = timed_calls(lambda d=rows_on_gpu: run_routed(runtime, d), repeats)
    runtime.close()
    # 2. A host process over each transport.
    with launch_local_hosts(1, store_dir, keep_alive_s=3600, threads=threads, metrics=False, poll_s=poll_s[0],
                            compute_dtype=compute_dtype, cpu=device == "cpu") as group:
        no_nixl = nixl_unavailable()
        clients = {t: ExpertHostClient(group.addresses[0], timeout_s=60, transport=t, poll_s=poll_s[1])
                   for t in TRANSPORTS if t != "nixl" or no_nixl is None}
        host_device = clients["grpc"].status()["device"]
        if not host_device.startswith(torch_device.split(":")[0]):
            raise RuntimeError(f"the expert host computes on {host_device!r}, not {device}: install the gpu extra "
                               "(nvidia-ml-py), which the host needs to find the GPU")
        no_nixl = no_nixl or _drop_unlinkable(clients, calls, torch_device if device == "cuda" else None)
        for name, (call, x) in calls.items():
            for transport, client in clients.items():
                identical[name][transport] = bool(torch.equal(client.submit(call, x).result().z.cpu(), reference[name]))
                times[name][transport] = timed_calls(lambda c=client: c.submit(call, x).result(), repeats)
            if device == "cuda":  # the caller's rows on the GPU: shared (local), written GPU to GPU (nixl), staged (tcp)
                x_gpu = x.to(torch_device)
                for transport in [t for t in ("local", "nixl", "tcp") if t in clients]:
                    client = clients[transport]
                    same = torch.equal(client.submit(call, x_gpu).result().z.cpu(), reference[name])
                    identical[name][f"{transport}_device"] = bool(same)
                    times[name][f"{transport}_device"] = timed_calls(lambda c=client: c.submit(call, x_gpu).result(), repeats)
            batches = _batches(call, x)
            times[name]["grpc_per_expert"] = timed_calls(lambda: clients["grpc"].invoke_detailed(0, batches), repeats)
        for client in clients.values():
            client.close()
    # 3. Ray's compiled graph over the same runtime in an actor.
    if ray_graph:
        packed = {name: (call.experts, call.counts, torch.cat(list(_batches(call, x).values())))
                  for name, (call, x) in calls.items()}
        for name, figures in _ray_compiled_graph(store_dir, packed, repeats, threads).items():
            times[name]["ray_compiled_graph"] = figures
    sizes = {name: {"rows_sent": int(call.tokens.numel()), "pairs": call.pairs, "rows_back": call.n_out,
                    "bytes_sent": call.request_bytes(hidden, x.dtype), "bytes_back": call.reply_bytes(hidden, x.dtype)}
             for name, (call, x) in calls.items()}
    return {"model": model_name, "dtype": str(dtype).removeprefix("torch."), "compute_dtype": compute_dtype,
            "device": host_device, "repeats": repeats, "threads": threads, "hidden": hidden,
            "calls": sizes, "identical_to_in_process": identical,
            "poll_us": {"host": 1e6 * poll_s[0], "client": 1e6 * poll_s[1]},
            "nixl": no_nixl or "measured",
            "load_average_1m": os.getloadavg()[0],
            "us": {n: {k: {stat: 1e6 * v for stat, v in f.items()} for k, f in t.items()} for n, t in times.items()},
            "ratio_to_in_process": {n: {k: f["p50"] / t["in_process"]["p50"] for k, f in t.items()}
                                    for n, t in times.items()}}


def _drop_unlinkable(clients: dict[str, ExpertHostClient], calls: dict, gpu: str | None) -> str | None:
    """Why the nixl client cannot link to the host here (then it is closed and dropped), or None.
    One call from host memory, and from the GPU where there is one: a NIXL whose UCX lacks CUDA
    support refuses GPU memory on either side."""
    if "nixl" not in clients:
        return None
    call, x = next(iter(calls.values()))
    try:
        for rows in (x, x.to(gpu)) if gpu else (x,):
            clients["nixl"].submit(call, rows).result()
    except ExpertHostError as err:
        clients.pop("nixl").close()
        return str(err)
    return None


def _stage(rows: torch.Tensor, device: str) -> torch.Tensor:
    """The host-memory staging of a GPU host's call: the rows in, the same bytes back out."""
    back = rows.to(device, non_blocking=True).to("cpu")
    torch.cuda.synchronize()
    return back


def _batches(call: RoutedCall, x: torch.Tensor) -> dict[int, torch.Tensor]:
    """The call's rows per expert, as the host runs them (expert -> [n, H])."""
    rows = x.index_select(0, call.tokens)
    bounds = np.cumsum([0, *call.counts])
    return {e: rows.index_select(0, call.src[bounds[i]:bounds[i + 1]].long()) for i, e in enumerate(call.experts)}


def _ray_compiled_graph(store_dir, calls: dict, repeats: int, threads: int) -> dict[str, float]:
    import ray
    from ray.dag import InputNode

    @ray.remote(num_cpus=0.5)
    class Host:
        def __init__(self, root: str):
            # heavy (the expert runtime): kept off --help's start-up path
            from moeless.expert_fn.host.runtime import ExpertHostRuntime

            torch.set_num_threads(threads)
            self.runtime = ExpertHostRuntime(WeightStore.open(root), capacity_bytes=4 * 10**9, keep_alive_s=3600)

        def invoke(self, request):
            experts, counts, x = request
            torch.set_num_threads(threads)
            out = self.runtime.invoke(0, dict(zip(experts, torch.split(x, counts)))).outputs
            return torch.cat([out[e] for e in experts])

    start_local_ray()
    try:
        host = Host.remote(str(store_dir))
        with InputNode() as request:
            dag = host.invoke.bind(request)
        graph = dag.experimental_compile()
        try:
            return {name: timed_calls(lambda r=(experts, counts, x): ray.get(graph.execute(r)), repeats)
                    for name, (experts, counts, x) in calls.items()}
        finally:
            graph.teardown()
    finally:
        ray.shutdown()


def print_report(result: dict[str, Any]) -> None:
    print(f"model {result['model']} (H={result['hidden']}, {result['dtype']}; compute {result['compute_dtype']}) "
          f"on {result['device']}: "
          f"{result['repeats']} calls each, load average {result['load_average_1m']:.1f} on {os.cpu_count()} cores; "
          "us p50 / p90 (p50 ratio to in-process)")
    for name, row in result["us"].items():
        size = result["calls"][name]
        print(f"{name} ({size['rows_sent']} rows, {size['pairs']} pairs, {size['rows_back']} back; "
              f"{size['bytes_sent'] / 1e3:.1f} KB + {size['bytes_back'] / 1e3:.1f} KB):")
        print("   " + "  ".join(f"{k} {v['p50']:.0f} / {v['p90']:.0f} ({result['ratio_to_in_process'][name][k]:.2f}x)"
                                for k, v in row.items()))
        differ = [t for t, same in result["identical_to_in_process"][name].items() if not same]
        print(f"   answers {'differ from in-process over ' + ', '.join(differ) if differ else 'bit-identical to in-process'}")
    if result["nixl"] != "measured":
        print(f"nixl not measured: {result['nixl']}")
