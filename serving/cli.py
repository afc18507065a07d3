"""`moeless serve` and `moeless bench serve` (registered by moeless.cli)."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from moeless.benchio import add_bench_flags, write_result
from moeless.knobs import add_knob_flags, knobs_from_args

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
    serve.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000; 0 picks a free one)")
    serve.add_argument("--bind", default="127.0.0.1", help="HTTP address to listen on (default 127.0.0.1; 0.0.0.0 in a pod)")
    serve.add_argument("--batching", choices=("continuous", "static"), default="continuous",
                       help="continuous: a request joins the running batch at the next iteration and leaves when it "
                            "ends (default); static: a batch decodes to its longest request (the old baseline)")
    serve.add_argument("--max-running", type=_positive, default=64,
                       help="continuous batching: requests decoding together (default 64)")
    serve.add_argument("--max-tokens-per-iteration", type=_positive, default=512,
                       help="continuous batching: newcomers' prompt tokens + running requests per iteration (default 512)")
    serve.add_argument("--max-waiting", type=_non_negative, default=256,
                       help="continuous batching: queued requests; more get HTTP 429 (default 256)")
    serve.add_argument("--max-batch", type=_positive, default=8, help="static batching: requests decoded as one batch (default 8)")
    serve.add_argument("--drain-s", type=_non_negative_float, default=30.0,
                       help="on SIGTERM/SIGINT, seconds running requests get to finish before they fail with a 503 (default 30)")
    serve.add_argument("--demo", action="store_true", help="send one short chat request, print the answer and shut down")
    serve.add_argument("--profile", metavar="JSON", help="the cost profile the planner prices with (`moeless bench "
                       "planner --out DIR` writes DIR/cost-profile.json; default: measured at start on this machine)")
    serve.add_argument("--predictor-file", metavar="FILE", help="gate replicas from `moeless predictor train` (default: "
                       "the cache's file for the model; untrained gate copies when there is none)")
    add_knob_flags(serve)
    serve.set_defaults(func=_serve)

    bench = benches.add_parser(
        "serve", help="tokens/s and MoE-layer time through expert functions vs in-process experts; alpha and beta",
        description="Generate ShareGPT prompts once, running every MoE layer on each path back to back: experts "
                    "in-process (baselines) and through expert functions on local expert hosts (shared memory, "
                    "gRPC); print per-layer MoE time, its breakdown (gate, scatter, invoke, expert compute, "
                    "gather), tokens/s and the latency model's alpha and beta.",
    )
    bench.add_argument("--model", default="default", help=MODEL_HELP)
    bench.add_argument("--hosts", type=int, default=2, help="expert-host processes (default 2)")
    bench.add_argument("--prompts", type=int, help="number of prompts (default 8; 4 with --quick)")
    bench.add_argument("--max-tokens", type=int, help="new tokens per prompt (default 16; 8 with --quick)")
    bench.add_argument("--batch", type=int, default=4, help="prompts decoded together (default 4)")
    bench.add_argument("--threads", type=int, default=1, help="torch threads in this process and in each host (default 1)")
    add_bench_flags(bench)
    bench.set_defaults(func=_bench)

    load = benches.add_parser(
        "load", help="static vs continuous batching: N concurrent clients on ShareGPT prompts over HTTP (loopback)",
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

    live = benches.add_parser(
        "live", help="the running system with its planning loop vs static EP and EPLB: replayed trace arrivals over HTTP",
        description="Replay Azure conversation arrivals (a Poisson process where the trace is missing) with ShareGPT "
                    "prompts through the HTTP API, once per configuration on the same requests: static EP, EPLB "
                    "re-planned every 10 iterations, moeless with the gate predictor, moeless with the history window. "
                    "Print the MoE-layer critical path per phase (slowest host's compute + exposed load waits + "
                    "transfer), the latency model's prediction of it, TTFT/TPOT p50/p99, tokens/s, GB·s, cold starts.",
    )
    live.add_argument("--model", help="default: the default model; tiny:mixtral with --quick (" + MODEL_HELP + ")")
    live.add_argument("--hosts", type=_positive, help="expert-host processes per configuration (default 4; 2 with --quick)")
    live.add_argument("--requests", type=_positive, help="requests replayed per configuration (default 48; 8 with --quick)")
    live.add_argument("--rate", type=_positive_float, help="mean requests per second the trace is scaled to "
                                                          "(default 1.0; 4.0 with --quick)")
    live.add_argument("--max-tokens", type=_positive, help="tokens per request (default 16; 8 with --quick)")
    live.add_argument("--prompt-tokens", type=_positive, default=64, help="ShareGPT prompts cut to this many tokens (default 64)")
    live.add_argument("--configs", type=_names_of(_live_configs, "configuration(s)"), help="configurations, comma-separated (default "
                                                            "static,eplb,moeless,moeless-history, then static again "
                                                            "(with --mirror: each twice instead); "
                                                            "static,moeless with --quick; also moeless-free-memory)")
    live.add_argument("--keep-alive", type=_non_negative_float, default=60.0,
                      help="seconds an idle replica stays resident (knob keepAliveSeconds; default 60, the knob's)")
    live.add_argument("--distance", type=_positive, default=2, help="prediction distance in layers (knob distance; default 2)")
    live.add_argument("--mirror", action="store_true",
                      help="run every configuration twice, in order and then reversed, so a drift of the machine "
                           "linear in time cancels in each configuration's mean (doubles the time)")
    live.add_argument("--memory-price", type=_non_negative_float, default=None,
                      help="seconds of layer time one GB·s is worth (knob memoryPrice; default: the knob's, "
                           "memory-neutral: 1 / the deployment's GB)")
    add_bench_flags(live)
    live.set_defaults(func=_bench_live)

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


def _positive_float(text: str) -> float:
    value = _non_negative_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _names_of(known: Callable[[], list[str]], what: str) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated list of names out of known() (imported when parsed)."""
    def parse(text: str) -> list[str]:
        choices = known()
        names = [n for n in text.split(",") if n]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {unknown}; use some of {','.join(choices)}")
        return names
    return parse


def _live_configs() -> list[str]:
    from moeless.serving.bench_live import CONFIGS
    return list(CONFIGS)


def _load_modes() -> list[str]:
    from moeless.serving.bench_load import MODES
    return list(MODES)


def _bench_live(args: argparse.Namespace) -> int:
    from moeless.knobs import Knobs
    from moeless.serving.bench_live import DEFAULT_CONFIGS, QUICK_CONFIGS, print_report, run_live_bench

    knobs = Knobs(keep_alive_s=args.keep_alive, distance=args.distance, memory_price=args.memory_price)
    result = run_live_bench(args.model or ("tiny:mixtral" if args.quick else "default"),
                            hosts=args.hosts or (2 if args.quick else 4), requests=args.requests or (8 if args.quick else 48),
                            rate=args.rate or (4.0 if args.quick else 1.0), max_tokens=args.max_tokens or (8 if args.quick else 16),
                            prompt_tokens=args.prompt_tokens, configs=args.configs or list(QUICK_CONFIGS if args.quick else DEFAULT_CONFIGS), knobs=knobs,
                            repeats=3 if args.quick else 30, again=not args.quick, mirror=args.mirror)
    print_report(result)
    path = write_result(args.out, "live", result)
    if path:
        print(f"wrote {path}")
    return 0


def _counts(text: str) -> list[int]:
    values = [_positive(part) for part in text.split(",") if part]
    if not values:
        raise argparse.ArgumentTypeError("expected client counts like 32,48")
    return values




def _bench_load(args: argparse.Namespace) -> int:
    from moeless.serving.bench_load import MODES, print_report, run_load_bench

    result = run_load_bench(args.model, hosts=args.hosts, clients=args.clients or ([8] if args.quick else [32, 48]),
                            requests_per_client=args.requests_per_client,
                            max_tokens=args.max_tokens or (8 if args.quick else 16), prompt_tokens=args.prompt_tokens,
                            modes=args.modes or (["static-8", "continuous"] if args.quick else list(MODES)))
    print_report(result)
    path = write_result(args.out, "load", result)
    if path:
        print(f"wrote {path}")
    return 0


def _bench_transport(args: argparse.Namespace) -> int:
    from moeless.serving.bench_transport import print_report, run_transport_bench

    result = run_transport_bench(args.model, repeats=args.repeats or (50 if args.quick else 200), ray_graph=args.ray)
    print_report(result)
    path = write_result(args.out, "transport", result)
    if path:
        print(f"wrote {path}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from moeless.twin.profile import CostProfile, ProfileError
    from moeless.knobs import KnobError
    from moeless.serving.embedded import serve_embedded
    from moeless.serving.scheduler import BatchLimits

    limits = BatchLimits(args.max_running, args.max_tokens_per_iteration, args.max_waiting)
    try:
        knobs = knobs_from_args(args)
        profile = CostProfile.from_json(args.profile) if args.profile else None
        serve_embedded(args.model, hosts=args.hosts, replicas=args.replicas, port=args.port, bind=args.bind, knobs=knobs,
                       profile=profile, predictor_file=args.predictor_file, batching=args.batching, limits=limits,
                       max_batch=args.max_batch, drain_s=args.drain_s, demo=args.demo)
    except (KnobError, ProfileError) as err:
        print(f"moeless serve: {err}", file=sys.stderr)
        return 2
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
