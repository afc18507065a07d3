"""The twin's commands: `moeless plan` (one plan for given loads, priced by a cost profile),
`moeless trace import` (routing logs -> the twin's routing file) and `moeless trace record` (an HF
MoE checkpoint's routing on real prompts)."""

from __future__ import annotations

import argparse
import sys

import numpy as np

from moeless.model.shape import DEFAULT_EXPERT_SHAPE
from moeless.placement.names import DEFAULT_PLANNER
from moeless.twin.routing import RoutingError, save_routing


def register(commands: argparse._SubParsersAction) -> None:
    """Add `moeless plan` and `moeless trace {import,record}`."""
    plan = commands.add_parser(
        "plan",
        help="plan one iteration's placement from per-layer expert loads and print it",
        description="Runs a planner on loads [L, E] (a .npy file) and prints, per layer, each GPU's replicas "
                    "(expert:share) and the predicted layer time under the paper's and the serial execution model.",
    )
    plan.add_argument("loads", help=".npy file of token counts per expert, shape [L, E] (or [E] for one layer)")
    plan.add_argument("--planner", default=DEFAULT_PLANNER,
                      help="a planner name (moeless, paper, static, eplb, eplb-global, oracle, ablations) "
                           "or 'module:function' (default moeless)")
    plan.add_argument("--gpus", type=int, default=8, help="GPUs (default 8)")
    plan.add_argument("--layer-cap", type=float, default=2.0, help="replicas per layer, in multiples of E (default 2)")
    plan.add_argument("--cv-threshold", type=float, default=0.2, help="the paper's CV threshold V (default 0.2)")
    plan.add_argument("--eplb-replicas", type=int, default=None, help="EPLB's replicas per layer (a multiple of --gpus)")
    plan.add_argument("--profile", metavar="JSON", help="a cost profile (default: measured now at the default model's expert shape)")
    plan.set_defaults(func=plan_command)
    trace = commands.add_parser("trace", help="routing traces for the twin and `moeless eval --routing`: import a log, record a model")
    sub = trace.add_subparsers(dest="trace_command", metavar="COMMAND", required=True)
    imp = sub.add_parser(
        "import", help="read a routing log (JSONL per token and layer, or the project's .npz capture) into a routing file",
        description="Reads JSONL with one record per (token, layer): a request id (req_id, request_id, problem_id), the "
                    "token's index (token_idx, token_pos, token_id), the layer (layer, layer_id) and its top-k expert ids "
                    "(topk_ids, experts, expert_ids), optional gate weights (topk_weights, weights) and phase; or the .npz "
                    "model/traces.py writes. Validates it (expert ids in range, one k, every token with every layer) and "
                    "writes the twin's routing file.")
    imp.add_argument("log", metavar="LOG", help="a .jsonl routing log or a .npz capture")
    imp.add_argument("--out", required=True, metavar="PATH", help="the routing file to write (.npz)")
    imp.add_argument("--experts", type=int, default=None, metavar="E",
                     help="routed experts per layer; ids must be below it (default: the largest id seen + 1)")
    imp.set_defaults(func=_import)
    rec = sub.add_parser("record", help="record the routing of an HF MoE checkpoint on real prompts (on the GPU when there is one)",
                         description="Greedy-generates real prompts through the checkpoint and writes every token's "
                                     "top-k expert ids per layer as the twin's routing file.")
    rec.add_argument("--model", required=True, metavar="DIR", help="an HF MoE checkpoint directory (config.json + safetensors)")
    rec.add_argument("--out", required=True, metavar="PATH", help="the routing file to write (.npz)")
    rec.add_argument("--prompts", choices=("sharegpt", "humaneval"), default="sharegpt", help="prompt set (default sharegpt)")
    rec.add_argument("--count", type=int, default=32, help="prompts (default 32)")
    rec.add_argument("--new-tokens", type=int, default=32, help="tokens generated per prompt (default 32)")
    rec.add_argument("--device", default="auto", help="torch device (default: cuda when available, else cpu)")
    rec.set_defaults(func=_record)


def _fail(message: str) -> int:
    print(f"moeless trace: {message}", file=sys.stderr)
    return 2


def _summary(routing, path) -> str:
    return (f"wrote {path}: {len(routing.lengths)} requests, {int(routing.lengths.sum())} tokens, "
            f"{routing.num_layers} layers, E={routing.num_experts}, k={routing.top_k} ({routing.label})")


def _import(args: argparse.Namespace) -> int:
    # heavy (the torch model code): kept off --help's start-up path
    from moeless.twin.routing_import import import_routing

    if args.experts is not None and args.experts <= 0:
        return _fail("--experts must be positive")
    try:
        routing = import_routing(args.log, args.experts)
    except RoutingError as err:
        return _fail(str(err))
    print(_summary(routing, save_routing(args.out, routing)))
    return 0


def _record(args: argparse.Namespace) -> int:
    # heavy (the torch model code): kept off --help's start-up path
    from moeless.model.hf_loader import ModelLoadError
    from moeless.twin.recording import record_checkpoint

    if args.count <= 0 or args.new_tokens < 0:
        return _fail("--count must be positive and --new-tokens >= 0")
    try:
        routing = record_checkpoint(args.model, args.prompts, args.count, args.new_tokens, args.device)
    except (RoutingError, ModelLoadError) as err:
        return _fail(str(err))
    print(_summary(routing, save_routing(args.out, routing)))
    return 0


def plan_command(args: argparse.Namespace) -> int:
    # compiled kernels (numba): kept off --help's start-up path
    from moeless.placement.cluster import Cluster
    from moeless.placement.planner import PlannerConfig, get_planner
    from moeless.placement.profile import CostProfile, ProfileError

    loads = np.atleast_2d(np.load(args.loads))
    num_layers, num_experts = loads.shape
    try:
        profile = CostProfile.from_json(args.profile) if args.profile else _measured_profile(num_experts, args.gpus)
    except ProfileError as err:
        print(f"moeless plan: {err}", file=sys.stderr)
        return 2
    model = profile.latency_model()
    cap = int(round(args.layer_cap * num_experts))
    cluster = Cluster.uniform(args.gpus, -(-num_layers * cap // args.gpus), expert_bytes=profile.expert_bytes,
                              layer_cap_replicas=cap)
    config = PlannerConfig(model=model, cv_threshold=args.cv_threshold, eplb_replicas=args.eplb_replicas)
    planner = get_planner(args.planner, config)
    placement = planner(loads, cluster)
    priced = planner.lossy_load(loads) if planner.lossy_load else loads
    for l, layer in enumerate(placement.layers):
        paper = model.layer_time(priced[l], layer, args.gpus, "paper")
        serial = model.layer_time(priced[l], layer, args.gpus, "serial")
        print(f"layer {l}: {layer.num_replicas} replicas, paper {paper * 1e6:.1f} us, serial {serial * 1e6:.1f} us")
        for g in range(args.gpus):
            mine = np.flatnonzero(layer.gpu == g)
            print(f"  gpu {g}: " + " ".join(f"{layer.expert[i]}:{layer.share[i]:.2f}" for i in mine))
    return 0


def _measured_profile(num_experts: int, num_gpus: int):
    """The cost profile measured now (a few repeats) at the default model's expert shape
    (non-expert bytes not measured: a plan does not bill them)."""
    from moeless.twin.measure import measure_profile  # torch: off --help's start-up path

    profile, _ = measure_profile(*DEFAULT_EXPERT_SHAPE, non_expert_bytes=0, repeats=10, num_experts=num_experts,
                                       num_gpus=num_gpus)
    return profile
