"""`moeless serve` (registered by moeless.cli; `moeless bench serve`, `load`, `live` and `transport` are
in moeless.bench)."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from moeless.controller.knobs import KnobError, add_knob_flags, knobs_from_args
from moeless.expert_fn.options import TRANSPORTS
from moeless.serving.options import BATCHING, DEVICES, STEP_ADMIT

MODEL_HELP = ("'default' (SmolLM2-135M turned MoE; built and cached on first use), 'tiny:ARCH' (a random test model, "
              "e.g. tiny:mixtral), a model directory, or BASE+FINETUNE: a fine-tune (`moeless model finetune`: its "
              "directory or its name under the cache's finetunes/) over one of those, served as BASE-NAME+NAME, its "
              "unchanged experts held once with the base's")


def register(commands: argparse._SubParsersAction) -> None:
    """Add `moeless serve`."""
    serve = commands.add_parser(
        "serve", help="serve a MoE model over HTTP with serverless experts (local Ray + expert-host processes)",
        description="Start local Ray, the expert hosts as local processes and the OpenAI-style HTTP app "
                    "(/v1/completions, /v1/chat/completions, /healthz, /metrics); print the URL.",
    )
    serve.add_argument("--model", action="append", metavar="MODEL",
                       help=MODEL_HELP + "; repeat it to serve several models on the same expert hosts, each answering "
                            "by its name (default: default)")
    serve.add_argument("--hosts", type=int, default=2, help="expert-host processes (default 2)")
    serve.add_argument("--replicas", type=int, default=1, help="data-parallel replicas of the non-expert layers (default 1)")
    serve.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000; 0 picks a free one)")
    serve.add_argument("--bind", default="127.0.0.1", help="HTTP address to listen on (default 127.0.0.1; 0.0.0.0 in a pod)")
    serve.add_argument("--batching", choices=BATCHING, default="continuous",
                       help="continuous: a request joins the running batch at the next iteration and leaves when it "
                            "ends (default); static: a batch decodes to its longest request (the old baseline)")
    serve.add_argument("--max-running", type=_positive, default=64,
                       help="continuous batching: requests decoding together (default 64)")
    serve.add_argument("--max-tokens-per-iteration", type=_positive, default=512,
                       help="continuous batching: newcomers' prompt tokens + running requests per iteration (default 512)")
    serve.add_argument("--max-waiting", type=_non_negative, default=256,
                       help="continuous batching: queued requests; more get HTTP 429 (default 256)")
    serve.add_argument("--micro-batches", type=_positive, default=1,
                       help="continuous batching: split each forward into this many micro-batches in flight together "
                            "(ping-pong: one computes while the other's expert calls are out; worth it where the calls "
                            "cross a network, see docs/serving.md) (default 1: never split)")
    serve.add_argument("--micro-batch-tokens", type=_positive, default=256,
                       help="continuous batching: split a forward only where each micro-batch gets this many tokens "
                            "(default 256: prefills, not small decode steps)")
    serve.add_argument("--max-batch", type=_positive, default=8, help="static batching: requests decoded as one batch (default 8)")
    serve.add_argument("--drain-s", type=_non_negative_float, default=30.0,
                       help="on SIGTERM/SIGINT, seconds running requests get to finish before they fail with a 503 (default 30)")
    serve.add_argument("--demo", action="store_true", help="send one short chat request, print the answer and shut down")
    serve.add_argument("--profile", metavar="JSON", help="the cost profile the planner prices with (`moeless bench "
                       "planner --out DIR` writes DIR/cost-profile.json; default: measured at start on this machine)")
    serve.add_argument("--predictor-file", metavar="FILE", help="gate replicas from `moeless predictor train` (default: "
                       "the cache's file for the model; untrained gate copies when there is none)")
    serve.add_argument("--poll-us", type=_non_negative_float, default=0.0, metavar="US",
                       help="the data plane's busy-poll: expert calls spin this many microseconds for their answer "
                            "(and local hosts for the next call) before blocking; worth it where cores are to spare "
                            "(default 0: block at once)")
    serve.add_argument("--device", choices=DEVICES, default="cpu",
                       help="where each replica runs the non-expert layers: cpu (default) or cuda (a GPU per replica, or "
                            "1/n of one, n replicas to a GPU, where there are fewer; local expert hosts compute on GPU 0)")
    serve.add_argument("--transport", choices=TRANSPORTS, default="auto",
                       help="how expert calls reach the hosts: auto (shared memory to a host on this machine, else "
                            "TCP, else gRPC), or one of them for every host; nixl: TCP with the rows moved by NIXL "
                            "(GPU memory over NVLink/RDMA; pip install 'moeless[nixl]' on both sides) (default auto)")
    serve.add_argument("--step-slo-ms", type=_step_slo, nargs="+", default=None, metavar="[MODEL=]MS",
                       help="the step scaler (serving/step_gate.py): price each batch's expert work at admission "
                            "and hold its newcomers until the placement spans the hosts that run it within MS "
                            "milliseconds; the loop plans over --step-hosts hosts, the others are warm spares. "
                            "MODEL=MS gives a served model (a fine-tune) its own; a batch meets the least of its "
                            "models' (e.g. 40 default+code=20) (default: off, every host planned over)")
    serve.add_argument("--step-hosts", type=_positive, default=1,
                       help="with --step-slo-ms: the hosts always planned over (default 1)")
    serve.add_argument("--step-hold", type=_non_negative_float, default=2.0, metavar="S",
                       help="with --step-slo-ms: seconds a widening outlives the last batch that needed it (default 2)")
    serve.add_argument("--step-admit", choices=STEP_ADMIT, default="wait",
                       help="with --step-slo-ms: a batch's newcomers wait out of it until the widened placement runs "
                            "(wait, the default), or go in at once, its steps longer until then (now)")
    add_knob_flags(serve)
    serve.set_defaults(func=_serve)


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


def _step_slo(text: str) -> tuple[str, float]:
    """An argparse type: MS (the engine's step SLO: name "") or MODEL=MS (that model's own)."""
    name, _, ms = text.rpartition("=")
    try:
        return name, _positive_float(ms)
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(f"{text!r}: MS or MODEL=MS, milliseconds {err}") from None


def _step_scaler(args: argparse.Namespace) -> dict | None:
    """The step scaler's fields of serve_embedded (None: off); KnobError where the SLOs lack the engine's own."""
    if args.step_slo_ms is None:
        return None
    bare = [ms for name, ms in args.step_slo_ms if not name]
    if len(bare) != 1:
        raise KnobError(f"--step-slo-ms: one bare MS (every model's step SLO), then MODEL=MS for any model's own; "
                        f"got {len(bare)} bare")
    return {"step_slo_s": bare[0] / 1e3, "step_slos_s": tuple((n, ms / 1e3) for n, ms in args.step_slo_ms if n),
            "step_hosts": args.step_hosts, "step_hold_s": args.step_hold, "step_admit": args.step_admit}


def _names_of(known: Callable[[], list[str]], what: str) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated list of names out of known() (called when parsed)."""
    def parse(text: str) -> list[str]:
        choices = known()
        names = [n for n in text.split(",") if n]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {unknown}; use some of {','.join(choices)}")
        return names
    return parse


def _serve(args: argparse.Namespace) -> int:
    # heavy (ray, transformers, compiled kernels): kept off --help's start-up path
    from moeless.placement.profile import CostProfile, ProfileError
    from moeless.serving.embedded import serve_embedded
    from moeless.serving.scheduler import BatchLimits

    limits = BatchLimits(args.max_running, args.max_tokens_per_iteration, args.max_waiting)
    try:
        knobs = knobs_from_args(args)
        profile = CostProfile.from_json(args.profile) if args.profile else None
        models = args.model or ["default"]
        serve_embedded(models[0] if len(models) == 1 else models, hosts=args.hosts, replicas=args.replicas, port=args.port, bind=args.bind, knobs=knobs,
                       profile=profile, predictor_file=args.predictor_file, batching=args.batching, limits=limits,
                       max_batch=args.max_batch, drain_s=args.drain_s, demo=args.demo, poll_s=args.poll_us / 1e6,
                       knob_file=args.config, transport=args.transport, micro_batches=args.micro_batches,
                       micro_batch_tokens=args.micro_batch_tokens, device=args.device,
                       step=_step_scaler(args))
    except (KnobError, ProfileError) as err:
        print(f"moeless serve: {err}", file=sys.stderr)
        return 2
    return 0
