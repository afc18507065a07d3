"""`moeless model ...` commands and the `moeless bench model` / `model-quality` benchmarks."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction, benches: argparse._SubParsersAction) -> None:
    """Add `moeless model {build,export,info}` and `moeless bench {model,model-quality}`."""
    from moeless.benchio import add_bench_flags

    model = commands.add_parser(
        "model",
        help="the default model: SmolLM2-135M-Instruct converted to an MoE (build, export, info)",
        description="Build, inspect and export the default model, SmolLM2-135M-Instruct MoEfied into E experts per layer.",
    )
    sub = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)

    build = sub.add_parser(
        "build",
        help="convert the dense model into an MoE and cache it (deterministic for a seed)",
        description="Load SmolLM2-135M-Instruct from its GGUF package, cluster each FFN's neurons by "
        "co-activation on ShareGPT prompts into E experts, train the routers, and cache the model.",
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
    _add_model_flags(export)
    export.set_defaults(func=_export)

    info = sub.add_parser("info", help="print the model's shape and where its files are cached")
    info.add_argument("--model", metavar="PATH", help="a model directory (default: the default model, built if needed)")
    _add_model_flags(info)
    info.set_defaults(func=_info)

    speed = benches.add_parser(
        "model",
        help="prefill and decode tokens/s of the MoE model against the dense model",
        description="Greedy generation on held-out ShareGPT prompts, one request at a time, with the "
        "dense SmolLM2 (baseline) and the default MoE model; prints tokens/s and the MoE/dense ratio.",
    )
    _add_model_flags(speed)
    add_bench_flags(speed)
    speed.set_defaults(func=_bench_speed)

    quality = benches.add_parser(
        "model-quality",
        help="held-out perplexity of the MoE for k in {1,2,4} against the dense model, and load skew",
        description="Perplexity on held-out ShareGPT prompts of the dense model (baseline) and of the "
        "MoE with k = 1, 2, 4 experts per token, and per-layer load skew (max/mean tokens per expert).",
    )
    quality.add_argument("--experts", type=int, default=8, help="experts per layer E (default 8)")
    quality.add_argument("--seed", type=int, default=0, help="conversion seed (default 0)")
    quality.add_argument("--ks", default="1,2,4", help="comma-separated experts per token to evaluate (default 1,2,4)")
    add_bench_flags(quality)
    quality.set_defaults(func=_bench_quality)


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--experts", type=int, default=8, help="experts per layer E; must divide 1536 (default 8)")
    parser.add_argument("--top-k", type=int, default=4, help="experts per token k, 1..E (default 4: see docs/model.md)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the neuron clustering (default 0)")


def _build(args: argparse.Namespace) -> int:
    import time

    from moeless.model.default import BuildConfig, build

    start = time.perf_counter()
    path = build(BuildConfig(args.experts, args.top_k, args.seed), force=args.force, progress=True)
    print(f"model: {path} ({time.perf_counter() - start:.1f} s)")
    return 0


def _load(args: argparse.Namespace):
    if args.model:
        from moeless.model.hf_loader import load_moe_model

        return load_moe_model(args.model)
    from moeless.model.default import default_model

    return default_model(args.experts, args.top_k, args.seed, progress=True)


def _export(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from moeless.model.weight_store import export_experts

    model = _load(args)
    spec = model.spec
    name = args.model or f"smollm2-135m-moe-e{spec.num_experts}-k{spec.top_k}-s{args.seed}"
    experts = tqdm(model.iter_experts(), total=spec.num_layers * spec.num_experts, desc="export experts")
    store = export_experts(experts, args.out, model=name, num_layers=spec.num_layers, num_experts=spec.num_experts, act=spec.act)
    print(f"weight store: {store.root} ({spec.num_layers} layers x {spec.num_experts} experts)")
    return 0


def _info(args: argparse.Namespace) -> int:
    from moeless.model.default import BuildConfig, conversion_path, model_path
    from moeless.model.gguf_source import dense_cache_path

    model = _load(args)
    for key, value in vars(model.spec).items():
        print(f"{key:>14}: {value}")
    if not args.model:
        cfg = BuildConfig(args.experts, args.top_k, args.seed)
        print(f"{'dense cache':>14}: {dense_cache_path()}")
        print(f"{'conversion':>14}: {conversion_path(cfg)}")
        print(f"{'model dir':>14}: {model_path(cfg)}")
    return 0


def _bench_speed(args: argparse.Namespace) -> int:
    from moeless.model.bench import speed_bench

    speed_bench(args.experts, args.top_k, args.seed, quick=args.quick, out=args.out)
    return 0


def _bench_quality(args: argparse.Namespace) -> int:
    from moeless.model.bench import quality_bench

    try:
        ks = [int(k) for k in args.ks.split(",")]
    except ValueError:
        raise SystemExit(f"--ks must be comma-separated integers like 1,2,4, got {args.ks!r}") from None
    quality_bench(args.experts, ks, args.seed, quick=args.quick, out=args.out)
    return 0
