"""One expert host process: `python -m moeless.expert_fn.host --store DIR --port N ...`
(the same as `moeless expert-host`).

It serves the ExpertHost gRPC API on --bind:--port (0 picks a free port), the shared-memory
local channel for clients on the same machine (unless --no-local-channel), the TCP channel for
clients on other machines on --bind:--tcp-port (unless --no-tcp-channel; the host offers both
over gRPC) and, with
--metrics-port, /metrics, /healthz and /readyz over HTTP. Once listening it prints one JSON line
to stdout, {"event": "ready", "port": ..., "tcp_port": ..., "metrics_port": ...}, which the launcher waits for.
SIGTERM (or SIGINT) drains gracefully: readiness turns false, new calls are refused, calls in
flight finish (up to --drain-s), then the process exits 0. With --exit-with-parent it also
drains and exits when its parent process is gone (a launcher killed without cleaning up
leaves no host behind).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from moeless.expert_fn.host.gpu import detect_device
from moeless.expert_fn.options import COMPUTE_DTYPES, PEER_ASK_MB, PEER_COPIES, add_tier_arguments
from moeless.expert_fn.wire.polling import DEFAULT_HOST_POLL_S

log = logging.getLogger("moeless.expert_fn.host")
REPLY_LINGER_S = 0.5  # after the last call of a drain: time for its reply to be read before the server closes

def add_host_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--store", required=True, action="append", metavar="[NAME=]DIR",
        help="a weight-store directory (from `moeless model export`); repeat it to serve several models from one "
             "memory (model_stores.py), NAME defaulting to the store's model name")
    add("--port", type=int, default=0, help="gRPC port (default 0: pick a free one and print it)")
    add("--bind", default="127.0.0.1", metavar="ADDR", help="address to listen on (default 127.0.0.1)")
    add("--keep-alive-s", type=float, default=60.0, metavar="S", help="seconds an idle replica stays warm (default 60)")
    add("--memory-gb", type=float, metavar="G",
        help="replica memory (GB = 1e9 bytes); default: 90%% of the GPU's free memory, or 4 on a CPU")
    add("--metrics-port", type=int, metavar="P",
        help="serve /metrics, /healthz, /readyz over HTTP on this port (0: pick one)")
    add("--gpu", type=int, default=0, metavar="I", help="NVML index of the GPU to use where there is one (default 0)")
    add("--cpu", action="store_true", help="compute on the CPU even where a GPU is visible")
    add("--threads", type=int, default=1, help="torch CPU threads for expert compute (default 1)")
    add("--compute-dtype", choices=COMPUTE_DTYPES, default="float32",
        help="float32 (default: outputs bit-identical to the float32 reference model) or store: the weight store's own "
             "dtype (a bfloat16 model's replicas hold half the memory and run on a GPU's bfloat16 tensor cores; "
             "outputs equal the reference to that dtype's rounding)")
    add("--drain-s", type=float, default=30.0, metavar="S",
        help="on SIGTERM, wait this long for calls in flight (default 30)")
    add("--no-local-channel", action="store_true",
        help="offer no shared-memory channel to clients on this machine (gRPC only)")
    add("--tcp-port", type=int, default=0, metavar="P",
        help="the TCP channel's port, the data plane between machines (default 0: a free one, offered over gRPC)")
    add("--no-tcp-channel", action="store_true", help="offer no TCP channel (data calls then take gRPC or shared memory)")
    add("--no-nixl", action="store_true",
        help="no NIXL: refuse clients' offers on the TCP channel (transport 'nixl') and copy replicas to and from peer "
             "hosts as bytes over gRPC (NIXL is used by default where nixl is installed)")
    add("--share", action="append", default=[], metavar="NAME=GB",
        help="a model's guaranteed share of the replica memory while it is active (repeatable): another model's "
             "load never evicts its replicas below it (shares.py); default 0 (least recently used first)")
    add("--keep-warm", action="append", default=[], metavar="NAME=GB",
        help="a model's hottest replicas (most tokens) kept resident past the keep-alive, up to GB (repeatable): it "
             "wakes with them after a quiet spell; not guaranteed (a load that needs room evicts them); default 0")
    add("--no-family-warm", dest="family_warm", action="store_false",
        help="no family warmth: a fine-tune's calls neither load its base's expert where it calls its own nor keep "
             "the base's replicas past their keep-alive (default: they do, for the models not calling, so that a "
             "sibling fine-tune wakes loading only its own experts; model_calls.py)")
    add("--peer-copies", choices=PEER_COPIES, default="measured",
        help="a load the planning loop gives a peer host holding its replica copies it from there: while such "
             "copies measure faster than this host's store reads (measured, the default), always, or never (off); "
             "never where this host's tier holds the expert (peer_copy.py)")
    add("--no-peer-ipc", dest="peer_ipc", action="store_false",
        help="never map a peer host's GPU memory over CUDA IPC for a copy (pods that share no IPC namespace, "
             "Kubernetes' hostIPC off, cannot): copy over NIXL or as bytes at once (default: CUDA IPC first on a GPU)")
    add("--peer-ask-mb", type=float, default=PEER_ASK_MB, metavar="MB",
        help="the most MiB one ask of a peer over NIXL carries, streamed through the link's region a chunk at a "
             "time: a LoadMany's replicas from one peer go in as few asks as this allows (default %(default)g; 0: "
             "what one region holds, 64 MiB or the replica)")
    add("--poll-us", type=float, default=DEFAULT_HOST_POLL_S * 1e6, metavar="US",
        help="after each data-plane call, spin this many microseconds for the next before blocking: shorter "
             "wake-ups for a core's worth of CPU while calls keep coming (default %(default)g; 0: block at once)")
    add("--exit-with-parent", action="store_true", help="drain and exit when the parent process is gone")
    add_tier_arguments(parser)

def serve(args: argparse.Namespace) -> int:
    """Run one host until SIGTERM/SIGINT; returns the exit status."""
    # heavy (grpc, protobuf, prometheus_client): kept off --help's start-up path
    import grpc
    import torch

    # heavy, as above: the gRPC service and its endpoints
    from moeless.expert_fn.wire import expert_host_pb2_grpc as pb_grpc
    from moeless.expert_fn.wire.codec import CHANNEL_OPTIONS
    from moeless.expert_fn.host.http_endpoints import start_http_endpoints
    from moeless.expert_fn.host.local_channel_server import LocalChannelServer
    from moeless.expert_fn.host.peer_copy import PeerCopies
    from moeless.expert_fn.stores.model_stores import ModelStores
    from moeless.expert_fn.host.runtime import ExpertHostRuntime
    from moeless.expert_fn.host.servicer import ExpertHostServicer
    from moeless.expert_fn.host.tcp_server import TcpServer
    from moeless.expert_fn.stores.tiers import tier_config_from_args
    from moeless.model.weight_store import WeightStoreError

    parent = os.getppid()  # before the ready line: the launcher is alive until it has read it
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(args.threads)
    if hasattr(os, "SCHED_BATCH"):
        # A woken host thread then never preempts the caller, which is still handing the same
        # layer to the other hosts (on 2 cores that preemption serialised the hosts). Inherited
        # by every thread started below; no privilege needed.
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    # 1. Store, device, runtime.
    if (args.memory_gb is not None and args.memory_gb <= 0) or args.keep_alive_s < 0 or args.threads < 1 \
            or args.poll_us < 0:
        print("expert-host: --memory-gb must be > 0, --keep-alive-s, --poll-us >= 0 and --threads >= 1", file=sys.stderr)
        return 2
    try:
        store = ModelStores.open([_named(s) for s in args.store])
    except WeightStoreError as err:
        print(f"expert-host: {err}", file=sys.stderr)
        return 2
    try:
        tier = tier_config_from_args(args)
    except ValueError as err:
        print(f"expert-host: {err}", file=sys.stderr)
        return 2
    memory = round(args.memory_gb * 1e9) if args.memory_gb is not None else None
    device, capacity = detect_device(None if args.cpu else args.gpu, memory)
    try:
        shares = (store.shares(_gb_items(args.share, "--share"), capacity, args.keep_alive_s,
                               _gb_items(args.keep_warm, "--keep-warm")) if args.share or args.keep_warm else None)
    except (ValueError, WeightStoreError) as err:
        print(f"expert-host: {err}", file=sys.stderr)
        return 2
    runtime = ExpertHostRuntime(store, device=device.torch_device, capacity_bytes=capacity, keep_alive_s=args.keep_alive_s,
                                tier=tier, shares=shares, compute_dtype=args.compute_dtype, family_warm=args.family_warm,
                                peer_copies=PeerCopies(args.peer_copies, device.torch_device, nixl=not args.no_nixl,
                                                                       cuda_ipc=args.peer_ipc,
                                                                       ask_bytes=int(args.peer_ask_mb * 2**20)))
    if device.torch_device.startswith("cuda") and not args.no_nixl:  # a GPU host's first copy link opens fast
        from moeless.expert_fn.wire.nixl_link import warm  # as the imports above: off --help's start-up path

        threading.Thread(target=warm, name="nixl-warm", daemon=True).start()
    # 2. gRPC server and HTTP endpoints.
    # OpenMP's thread count is per thread: without the initializer, handler threads compute on every core.
    handlers = ThreadPoolExecutor(max_workers=16, thread_name_prefix="grpc", initializer=torch.set_num_threads,
                                  initargs=(args.threads,))
    server = grpc.server(handlers, options=CHANNEL_OPTIONS)
    local = None if args.no_local_channel else LocalChannelServer(runtime, threads=args.threads, poll_s=args.poll_us / 1e6)
    try:
        tcp = None if args.no_tcp_channel else TcpServer(runtime, args.bind, args.tcp_port, threads=args.threads,
                                                            poll_s=args.poll_us / 1e6, nixl=not args.no_nixl)
    except OSError as err:
        print(f"expert-host: cannot listen on {args.bind}:{args.tcp_port} ({err}); pick another --tcp-port", file=sys.stderr)
        return 2
    servicer = ExpertHostServicer(runtime, local.name if local else "", tcp.port if tcp else 0, store.ranges())
    pb_grpc.add_ExpertHostServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"{args.bind}:{args.port}")
    if port == 0:
        print(f"expert-host: cannot listen on {args.bind}:{args.port} (in use?); pick another --port", file=sys.stderr)
        return 2
    http = start_http_endpoints(runtime, args.metrics_port, args.bind) if args.metrics_port is not None else None
    server.start()
    runtime.health = "serving"
    # 3. Announce, then wait for a stop signal (handlers run on this, the main, thread).
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    ready = {"event": "ready", "port": port, "tcp_port": tcp.port if tcp else None,
             "metrics_port": http.server_port if http else None, "device": device.torch_device}
    print(json.dumps(ready), flush=True)
    log.info("serving %s on %s:%d (%s, %.2f GB for replicas, keep-alive %.1f s)",
             store.describe(), args.bind, port, device.name, capacity / 1e9, args.keep_alive_s)
    while not stop.wait(0.5):
        if args.exit_with_parent and os.getppid() != parent:  # orphans are re-parented at once
            log.warning("parent process %d is gone; stopping", parent)
            break
    # 4. Drain: refuse new calls, let those in flight finish. A second SIGTERM (a supervisor's, after
    #    its first) changes nothing now: ignored, also through interpreter shutdown, where Python
    #    puts its own handlers back to the default and the signal would kill the host (exit -15).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    runtime.health = "draining"  # new data calls are refused from now on, on every channel
    log.info("draining (up to %.1f s)", args.drain_s)
    # gRPC's stop() closes each connection once its calls end, and a large reply still unread by
    # the client then meets a reset (its unread flow-control frames make the close an RST): so the
    # calls in flight finish and their replies get a moment to be read before the server stops.
    deadline = time.monotonic() + args.drain_s
    while runtime.inflight and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(max(0.0, min(REPLY_LINGER_S, deadline - time.monotonic())))
    stopped = server.stop(grace=max(0.0, deadline - time.monotonic()))
    for channel in (local, tcp):
        if channel:
            channel.close(max(0.0, deadline - time.monotonic()))
    stopped.wait()
    runtime.close()
    if http:
        http.shutdown()
    log.info("stopped")
    return 0


def _gb_items(items: list[str], flag: str) -> dict[str, float]:
    """--share / --keep-warm NAME=GB items -> {NAME: GB}; ValueError names a bad one."""
    out = {}
    for item in items:
        name, _, gb = item.partition("=")
        try:
            out[name] = float(gb)
        except ValueError:
            raise ValueError(f"{flag} {item!r}: expected NAME=GB, e.g. mixtral=12") from None
        if not name or not out[name] >= 0:
            raise ValueError(f"{flag} {item!r}: expected NAME=GB with GB >= 0")
    return out


def _named(text: str) -> tuple[str | None, str]:
    """--store [NAME=]DIR -> (NAME or None, DIR); a directory may hold '=' when NAME is given."""
    name, sep, root = text.partition("=")
    return (name, root) if sep and name and "/" not in name else (None, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moeless.expert_fn.host", description=__doc__.split("\n\n")[0])
    add_host_arguments(parser)
    return serve(parser.parse_args(argv))
