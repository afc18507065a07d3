"""`moeless` subcommands of moeless.expert_fn (registered by moeless.cli)."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction, benches: argparse._SubParsersAction) -> None:
    """Add `moeless expert-host` and `moeless bench expert-invoke`."""
    from moeless.benchio import add_bench_flags
    from moeless.expert_fn.host import add_host_arguments

    host = commands.add_parser(
        "expert-host",
        help="run one expert host (gRPC server of expert replicas) in the foreground",
        description="Serve replicas of (layer, expert) FFNs from a weight store over gRPC until SIGTERM "
        "(then drain gracefully). Prints a JSON ready line with the chosen ports.",
    )
    add_host_arguments(host)
    host.set_defaults(func=_expert_host)

    bench = benches.add_parser(
        "expert-invoke",
        help="gRPC invoke round trip and per-token time vs the same experts in-process",
        description="Times Invoke on one local expert host (warm replicas) against computing the same "
        "experts in this process, for several tokens-per-expert sizes; prints overhead and ratio.",
    )
    bench.add_argument("--hidden", type=int, default=None, help="hidden size H (default: the default model's)")
    bench.add_argument("--ffn", type=int, default=None, help="expert FFN width F (default: the default model's)")
    bench.add_argument("--experts-per-call", type=int, default=4, help="experts carried by one Invoke (default 4)")
    bench.add_argument("--threads", type=int, default=1, help="torch threads, host and baseline alike (default 1)")
    add_bench_flags(bench)
    bench.set_defaults(func=_bench_invoke)


def _expert_host(args: argparse.Namespace) -> int:
    from moeless.expert_fn.host import serve

    return serve(args)


def _bench_invoke(args: argparse.Namespace) -> int:
    from moeless.benchio import write_result
    from moeless.expert_fn.bench import print_invoke_bench, run_invoke_bench

    sizes = dict(tokens=(1, 64, 512), repeats=10) if args.quick else {}
    from moeless.model.shape import DEFAULT_EXPERT_SHAPE

    hidden, ffn = args.hidden or DEFAULT_EXPERT_SHAPE[0], args.ffn or DEFAULT_EXPERT_SHAPE[1]
    result = run_invoke_bench(hidden=hidden, ffn=ffn, experts_per_call=args.experts_per_call,
                              threads=args.threads, **sizes)
    print_invoke_bench(result)
    path = write_result(args.out, "expert-invoke", result)
    if path:
        print(f"wrote {path}")
    return 0
