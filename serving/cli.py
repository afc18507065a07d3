"""`moeless serve` and `moeless bench serve` (registered by moeless.cli)."""

from __future__ import annotations

import argparse

from moeless.benchio import add_bench_flags, write_result

MODEL_HELP = "'default' (SmolLM2-135M turned MoE; built and cached on first use), 'tiny:ARCH' (a random test model, e.g. tiny:mixtral) or a model directory"


def register(commands: argparse._SubParsersAction, benches: argparse._SubParsersAction) -> None:
    """Add `moeless serve` and `moeless bench serve`."""
    serve = commands.add_parser(
        "serve", help="serve a MoE model over HTTP with serverless experts (local Ray + expert-host processes)",
        description="Start local Ray, the expert hosts as local processes and the OpenAI-style HTTP app "
                    "(/v1/completions, /v1/chat/completions, /healthz, /metrics); print the URL.",
    )
    serve.add_argument("--model", default="default", help=MODEL_HELP)
    serve.add_argument("--hosts", type=int, default=2, help="expert-host processes (default 2)")
    serve.add_argument("--replicas", type=int, default=1, help="data-parallel replicas of the non-expert layers (default 1)")
    serve.add_argument("--port", type=int, default=8000, help="HTTP port on 127.0.0.1 (default 8000; 0 picks a free one)")
    serve.add_argument("--batching", choices=("continuous", "static"), default="continuous",
                       help="continuous: a request joins the running batch at the next iteration and leaves when it "
                            "ends (default); static: a batch decodes to its longest request (the old baseline)")
    serve.add_argument("--max-running", type=_positive, default=32,
                       help="continuous batching: requests decoding together (default 32)")
    serve.add_argument("--max-tokens-per-iteration", type=_positive, default=512,
                       help="continuous batching: newcomers' prompt tokens + running requests per iteration (default 512)")
    serve.add_argument("--max-waiting", type=_non_negative, default=256,
                       help="continuous batching: queued requests; more get HTTP 429 (default 256)")
    serve.add_argument("--max-batch", type=_positive, default=8, help="static batching: requests decoded as one batch (default 8)")
    serve.add_argument("--drain-s", type=_non_negative_float, default=30.0,
                       help="on SIGTERM/SIGINT, seconds running requests get to finish before they fail with a 503 (default 30)")
    serve.add_argument("--keep-alive-s", type=float, default=300.0, help="seconds an idle expert replica stays warm (default 300)")
    serve.add_argument("--demo", action="store_true", help="send one short chat request, print the answer and shut down")
    serve.set_defaults(func=_serve)

    bench = benches.add_parser(
        "serve", help="tokens/s and MoE-layer time through expert functions vs in-process experts; alpha and beta",
        description="Generate the same ShareGPT prompts with experts in-process (baseline) and through expert "
                    "functions on local expert hosts; print tokens/s, per-layer MoE time and its breakdown "
                    "(gate, scatter, invoke, expert compute, gather) and the latency model's alpha and beta.",
    )
    bench.add_argument("--model", default="default", help=MODEL_HELP)
    bench.add_argument("--hosts", type=int, default=2, help="expert-host processes (default 2)")
    bench.add_argument("--prompts", type=int, help="number of prompts (default 8; 4 with --quick)")
    bench.add_argument("--max-tokens", type=int, help="new tokens per prompt (default 16; 8 with --quick)")
    bench.add_argument("--batch", type=int, default=4, help="prompts decoded together (default 4)")
    bench.add_argument("--threads", type=int, default=1, help="torch threads in this process and in each host (default 1)")
    add_bench_flags(bench)
    bench.set_defaults(func=_bench)


def _positive(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _serve(args: argparse.Namespace) -> int:
    from moeless.serving.embedded import serve_embedded
    from moeless.serving.scheduler import BatchLimits

    limits = BatchLimits(args.max_running, args.max_tokens_per_iteration, args.max_waiting)
    serve_embedded(args.model, hosts=args.hosts, replicas=args.replicas, port=args.port, keep_alive_s=args.keep_alive_s,
                   batching=args.batching, limits=limits, max_batch=args.max_batch, drain_s=args.drain_s, demo=args.demo)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from moeless.serving.bench import print_report, run_bench

    prompts = args.prompts or (4 if args.quick else 8)
    max_tokens = args.max_tokens or (8 if args.quick else 16)
    result = run_bench(args.model, hosts=args.hosts, prompts=prompts, prompt_tokens=32 if args.quick else 64,
                       max_tokens=max_tokens, batch=args.batch, threads=args.threads)
    print_report(result)
    path = write_result(args.out, "serve", result)
    if path:
        print(f"wrote {path}")
    return 0
