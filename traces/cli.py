"""`moeless trace`: `trace import` (routing logs -> the routing file), `trace record` (an HF MoE
checkpoint's routing on real prompts) and `trace list` (the logs shipped with moeless, by name), the
twin's and `moeless eval --routing`'s workloads."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moeless.traces.routing_file import RoutingError, load_routing, save_routing
from moeless.traces.routing_import import import_routing
from moeless.traces.shipped import LOGS_DIR, SHIPPED, shipped_routing


def register(commands: argparse._SubParsersAction) -> None:
    """Add `moeless trace {import,record,list}`."""
    trace = commands.add_parser("trace", help="routing traces for the twin and `moeless eval --routing`: import a log, record a model")
    sub = trace.add_subparsers(dest="trace_command", metavar="COMMAND", required=True)
    imp = sub.add_parser(
        "import", help="read a routing log (JSONL per token and layer, or the project's .npz capture) into a routing file",
        description="Reads JSONL with one record per (token, layer): a request id (req_id, request_id, problem_id), the "
                    "token's index (token_idx, token_pos, token_id), the layer (layer, layer_id) and its top-k expert ids "
                    "(topk_ids, experts, expert_ids), optional gate weights (topk_weights, weights) and phase; gzipped when "
                    "its name ends in .gz; or the .npz traces/request_loads.py writes; or a shipped log's name (`moeless trace "
                    "list`). Validates it (expert ids in range, one k, every token with every layer; a bad line is one error "
                    "naming the file, the line and the field) and writes the twin's routing file.")
    imp.add_argument("log", metavar="LOG", help="a .jsonl or .jsonl.gz routing log, a .npz capture, or a shipped log's name")
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
    listing = sub.add_parser("list", help="the routing logs shipped with moeless, by name, with their provenance",
                             description="Prints each shipped log's name and provenance line (model, E, k, layers, tokens, "
                                         "phases, licence, source). Any of them works as `moeless eval --routing NAME` or "
                                         "`moeless trace import NAME`; traces/logs/PROVENANCE.md has the details.")
    listing.set_defaults(func=_list)


def _fail(message: str) -> int:
    print(f"moeless trace: {message}", file=sys.stderr)
    return 2


def _summary(routing, path) -> str:
    return (f"wrote {path}: {len(routing.lengths)} requests, {int(routing.lengths.sum())} tokens, "
            f"{routing.num_layers} layers, E={routing.num_experts}, k={routing.top_k} ({routing.label})")


def _import(args: argparse.Namespace) -> int:
    if args.experts is not None and args.experts <= 0:
        return _fail("--experts must be positive")
    try:
        if args.log in SHIPPED and not Path(args.log).exists():
            if args.experts not in (None, SHIPPED[args.log].experts):
                return _fail(f"{args.log} has E={SHIPPED[args.log].experts}, --experts says {args.experts}")
            routing = load_routing(shipped_routing(args.log))
        else:
            routing = import_routing(args.log, args.experts)
    except RoutingError as err:
        return _fail(str(err))
    print(_summary(routing, save_routing(args.out, routing)))
    return 0


def _list(args: argparse.Namespace) -> int:
    for log in SHIPPED.values():
        print(log.provenance())
    print(f"(files in {LOGS_DIR}; provenance in {LOGS_DIR / 'PROVENANCE.md'})")
    return 0


def _record(args: argparse.Namespace) -> int:
    # heavy (the torch model code): kept off --help's start-up path
    from moeless.model.hf_loader import ModelLoadError
    from moeless.traces.recording import record_checkpoint

    if args.count <= 0 or args.new_tokens < 0:
        return _fail("--count must be positive and --new-tokens >= 0")
    try:
        routing = record_checkpoint(args.model, args.prompts, args.count, args.new_tokens, args.device)
    except (RoutingError, ModelLoadError) as err:
        return _fail(str(err))
    print(_summary(routing, save_routing(args.out, routing)))
    return 0
