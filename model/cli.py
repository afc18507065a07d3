"""`moeless model ...` commands (registered by moeless.cli; `moeless bench model` and `model-quality` are
in moeless.bench.model)."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from moeless.model.dtypes import DTYPES
from moeless.model.shape import DEFAULT_EXPERTS, DEFAULT_SHARED, DEFAULT_TOP_K


def register(commands: argparse._SubParsersAction) -> None:
    """Add `moeless model {build,export,info,finetune}`."""
    model = commands.add_parser(
        "model",
        help="the default model: SmolLM2-135M-Instruct converted to an MoE (build, export, info, finetune)",
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
    export.add_argument("--finetune", metavar="DIR",
                        help="export this fine-tune of the model (`moeless model finetune`'s directory): ESFT merged; LoRA "
                             "with its expert LoRA factors beside the base's experts (hosts apply them at call time)")
    export.add_argument("--base", metavar="STORE",
                        help="a weight store to write over: experts it has (by content key) are not written but named "
                             "(a fine-tune's store over its base's: hosts serving both hold those experts once)")
    _add_model_flags(export)
    export.set_defaults(func=_export)

    _register_finetune(sub)

    info = sub.add_parser("info", help="print the model's shape and where its files are cached")
    info.add_argument("--model", metavar="PATH", help="a model directory (default: the default model, built if needed)")
    _add_model_flags(info)
    info.set_defaults(func=_info)


def _register_finetune(sub: argparse._SubParsersAction) -> None:
    """`moeless model finetune` (its flags have no model-shape flags: --experts is the share tuned)."""
    finetune = sub.add_parser(
        "finetune",
        help="fine-tune the model on a task: ESFT (only the task's experts) or a PEFT LoRA; writes the artefact",
        description="ESFT: score every expert by the task's routing, train the top SHARE of each layer's experts with "
        "everything else frozen, and write them alone (finetune.json + experts/*.safetensors). --lora: train a PEFT "
        "LoRA adapter instead. Either way, held-out perplexity of base and fine-tune is measured, printed and stored. "
        "See docs/model.md, 'Fine-tunes'.",
    )
    finetune.add_argument("--name", required=True, help="the fine-tune's name (e.g. code, chat)")
    finetune.add_argument("--task", required=True, choices=("humaneval", "sharegpt"),
                          help="training data: humaneval (code programs) or sharegpt (chat exchanges); test splits held out")
    finetune.add_argument("--experts", type=float, default=0.125, metavar="SHARE",
                          help="ESFT: the share of each layer's routed experts tuned (default 0.125: 2 of 16)")
    finetune.add_argument("--method", choices=("token", "gate"), default="token",
                          help="ESFT's expert score: token-selection ratio (default) or average gate score")
    finetune.add_argument("--threshold", type=float, metavar="P",
                          help="ESFT's rule: per layer the fewest experts whose cumulative score reaches P (capped by SHARE)")
    finetune.add_argument("--lora", choices=("attention", "experts", "both"), help="train a PEFT LoRA on these instead of ESFT")
    finetune.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8; alpha = 2 x rank)")
    finetune.add_argument("--steps", type=int, default=24, help="training steps (default 24)")
    finetune.add_argument("--batch", type=int, default=4, help="blocks per step (default 4)")
    finetune.add_argument("--block", type=int, default=128, help="tokens per block (default 128)")
    finetune.add_argument("--lr", type=float, help="AdamW learning rate (default 1e-3 ESFT, 2e-3 LoRA)")
    finetune.add_argument("--seed", type=int, default=0, help="seed of the batch order and LoRA init (default 0)")
    finetune.add_argument("--threads", type=int, default=1, metavar="N",
                          help="torch threads (default 1: the MoE's many small matmuls stall in a thread pool on a "
                               "busy machine; moeless/core/threads.py)")
    finetune.add_argument("--out", metavar="DIR", help="fine-tune directory (default $MOELESS_CACHE/finetunes/NAME)")
    finetune.add_argument("--model", metavar="PATH", help="the base model directory (default: the default model)")
    finetune.set_defaults(func=_finetune)


def _finetune(args: argparse.Namespace) -> int:
    from pathlib import Path

    # heavy (torch, the model, peft): kept off --help's start-up path
    from moeless.core.paths import cache_dir
    from moeless.core.threads import torch_threads
    from moeless.model.default import BuildConfig, build
    from moeless.model.esft import TrainConfig
    from moeless.model.finetune_make import DEFAULT_LR, FinetuneSpec, make_finetune, report
    from moeless.model.hf_loader import load_moe_model

    path = Path(args.model) if args.model else build(BuildConfig(), progress=True)
    lr = args.lr or DEFAULT_LR["lora" if args.lora else "esft"]
    spec = FinetuneSpec(args.name, args.task, args.experts, args.method, args.threshold, args.lora, args.rank, args.block,
                        TrainConfig(args.steps, args.batch, lr, args.seed))
    out = Path(args.out) if args.out else cache_dir() / "finetunes" / args.name
    try:
        with torch_threads(args.threads):
            manifest = make_finetune(load_moe_model(path), path.name, spec, out, base_path=path, progress=True)
    except ValueError as err:
        _usage_error(str(err))
    print(report(manifest))
    print(f"fine-tune: {out} ({manifest['seconds']} s, {manifest['cpu_seconds']} s CPU)")
    return 0


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

    from moeless.model.finetune import FinetuneError, read_manifest
    from moeless.model.finetune_load import load_finetune
    from moeless.model.weight_store import WeightStore, WeightStoreError

    model = _load(args)
    spec = model.spec
    name = args.model or f"smollm2-135m-moe-e{spec.num_experts}-sh{spec.shared_ffn}-k{spec.top_k}-s{args.seed}"
    try:
        if args.finetune:
            # a LoRA's expert LoRAs unmerged: the store carries its factors (model/lora_store.py)
            model = load_finetune(args.finetune, model, merge_expert_lora=False)
            name = f"{name}+{read_manifest(args.finetune)['name']}"
        base = WeightStore.open(args.base) if args.base else None
    except (FinetuneError, WeightStoreError) as err:
        _usage_error(str(err))
    dtype = getattr(torch, args.dtype)
    experts = tqdm(((layer, expert, {n: t.to(dtype) for n, t in weights.items()})
                    for layer, expert, weights in model.iter_experts()),
                   total=spec.num_layers * spec.num_experts, desc="export experts")
    try:
        store = export_experts(experts, args.out, model=name, num_layers=spec.num_layers, num_experts=spec.num_experts,
                               act=spec.act, base=base, loras=getattr(model, "expert_loras", None))
    except WeightStoreError as err:
        _usage_error(str(err))
    own = sum(1 for layer, expert in store.keys() if not store.in_base(layer, expert))
    print(f"weight store: {store.root} ({spec.num_layers} layers x {spec.num_experts} experts, {args.dtype}"
          + (f"; {own} written, the others its base's {base.root}" if base else "") + ")")
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
