"""`moeless model ...` commands (registered by moeless.cli; `moeless bench model` and `model-quality` are
in moeless.bench.model)."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from moeless.model.dtypes import DTYPES
from moeless.model.shape import DEFAULT_EXPERTS, DEFAULT_SHARED, DEFAULT_TOP_K


def register(commands: argparse._SubParsersAction) -> None:
    """Add `moeless model {build,export,info}`."""
    model = commands.add_parser(
        "model",
        help="the default model: SmolLM2-135M-Instruct converted to an MoE (build, export, info)",
        description="Build, inspect and export the default model, SmolLM2-135M-Instruct MoEfied into a shared "
        "expert and E routed experts per layer.",
    )
    sub = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)

    build = sub.add_parser(
        "build",
        help="convert the dense model into an MoE and cache it (deterministic for a seed)",
        description="Load SmolLM2-135M-Instruct from its GGUF package, put each FFN's most active neurons "
        "into a shared expert, cluster the others by co-activation on ShareGPT prompts into E routed experts, "
        "train the routers, and cache the model.",
    )
    _add_model_flags(build)
    build.add_argument("--force", action="store_true", help="rebuild even when the cache holds this model")
    build.set_defaults(func=_build)

    export = sub.add_parser(
        "export",
        help="write the per-expert weight store that expert functions load",
        description="Export every (layer, expert) FFN as its own safetensors file plus index.json.",
    )
    export.add_argument("--out", metavar="DIR", required=True, help="weight-store directory to write")
    export.add_argument("--model", metavar="PATH", help="a model directory (default: the default model, built if needed)")
    export.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="the experts' dtype in the store (default float32, exactly the model's; bfloat16 or float16 "
                             "halve it, and hosts run with --compute-dtype store compute in it)")
    _add_model_flags(export)
    export.set_defaults(func=_export)

    info = sub.add_parser("info", help="print the model's shape and where its files are cached")
    info.add_argument("--model", metavar="PATH", help="a model directory (default: the default model, built if needed)")
    _add_model_flags(info)
    info.set_defaults(func=_info)


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--experts", type=int, default=DEFAULT_EXPERTS,
                        help=f"routed experts per layer E; must divide 1536 - S (default {DEFAULT_EXPERTS})")
    parser.add_argument("--shared", type=int, default=DEFAULT_SHARED,
                        help=f"neurons of the shared expert S, 0 for none (default {DEFAULT_SHARED})")
    parser.add_argument("--top-k", type=int, default=DEFAULT_TOP_K,
                        help=f"routed experts per token k, 1..E (default {DEFAULT_TOP_K}: see docs/model.md)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the neuron clustering (default 0)")


def _usage_error(message: str) -> NoReturn:
    """One line on stderr saying what was wrong, exit code 2 (a usage error)."""
    print(f"moeless: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _config(args: argparse.Namespace):
    """The BuildConfig of the model flags; a bad shape is a usage error (exit 2) saying what to change."""
    # heavy (the torch model code): kept off --help's start-up path
    from moeless.model.default import BuildConfig

    try:
        return BuildConfig(args.experts, args.top_k, args.seed, args.shared)
    except ValueError as err:
        _usage_error(str(err))


def _build(args: argparse.Namespace) -> int:
    import time

    # heavy (the torch model code): kept off --help's start-up path
    from moeless.model.default import build

    start = time.perf_counter()
    path = build(_config(args), force=args.force, progress=True)
    print(f"model: {path} ({time.perf_counter() - start:.1f} s)")
    return 0


def _load(args: argparse.Namespace):
    # heavy (the torch model code): kept off --help's start-up path
    from moeless.model.hf_loader import load_moe_model

    if args.model:
        return load_moe_model(args.model)
    from moeless.model.default import build

    return load_moe_model(build(_config(args), progress=True))


def _export(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from moeless.model.weight_store import export_experts  # heavy (torch, safetensors): off --help's start-up path

    model = _load(args)
    spec = model.spec
    name = args.model or f"smollm2-135m-moe-e{spec.num_experts}-sh{spec.shared_ffn}-k{spec.top_k}-s{args.seed}"
    dtype = getattr(torch, args.dtype)
    experts = tqdm(((layer, expert, {n: t.to(dtype) for n, t in weights.items()})
                    for layer, expert, weights in model.iter_experts()),
                   total=spec.num_layers * spec.num_experts, desc="export experts")
    store = export_experts(experts, args.out, model=name, num_layers=spec.num_layers, num_experts=spec.num_experts, act=spec.act)
    print(f"weight store: {store.root} ({spec.num_layers} layers x {spec.num_experts} experts, {args.dtype})")
    return 0


def _info(args: argparse.Namespace) -> int:
    # heavy (the torch model code): kept off --help's start-up path
    from moeless.model.default import conversion_path, model_path
    from moeless.model.gguf_source import dense_cache_path

    model = _load(args)
    for key, value in vars(model.spec).items():
        print(f"{key:>14}: {value}")
    if not args.model:
        cfg = _config(args)
        print(f"{'dense cache':>14}: {dense_cache_path()}")
        print(f"{'conversion':>14}: {conversion_path(cfg)}")
        print(f"{'model dir':>14}: {model_path(cfg)}")
    return 0
