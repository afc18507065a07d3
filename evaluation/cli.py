"""`moeless eval` (the paper's evaluation as one command, one run directory) and `moeless report RUN_DIR`."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from moeless.controller.knobs import KnobError, add_knob_flags, knobs_from_args
from moeless.twin.arrivals import DEFAULT_CV, DEFAULT_RATE, NAMED_TRACES
from moeless.twin.batching import BATCHING

QUICK = dict(model="tiny", requests=40, prompt_count=6, new_tokens=8, max_iterations=300, cv=("0.2", "0.6", "1.0"))
DEFAULT_WORKLOAD = "conversation=azure-conv:sharegpt"


def register(commands: argparse._SubParsersAction) -> None:
    """Add `moeless eval` and `moeless report`."""
    p = commands.add_parser(
        "eval",
        help="the paper's evaluation: replay real prompts and arrivals through every planner, ablations, sweeps, "
             "GB·s costs; one run directory and its report",
        description=(
            "Traces real prompts through the model (routing and the gate-replica predictor's forecasts at every "
            "distance; cached), batches them by a real arrival trace, then replays moeless, the paper's planner, "
            "static EP, EPLB and the Oracle through the digital twin with a measured cost profile: MoE-layer time "
            "under both execution models (serial, paper), GB·s under both billing models (resident, per-layer), cold "
            "starts after prefetch, prefill and decode apart; the ablations and the distance and CV-threshold sweeps. "
            "Writes RUN_DIR/run.json and the report (markdown, JSON, CSV, PNG); `moeless report RUN_DIR` re-renders it."),
    )
    p.add_argument("--workload", action="append", metavar="[NAME=]TRACE[:PROMPTS]",
                   help=f"a workload (repeatable): TRACE is an Azure CSV or Mooncake JSONL file, one of {', '.join(NAMED_TRACES)} "
                        "(from $MOELESS_TRACES or ../shared/data/traces; the generated process when missing) or 'generated'; "
                        f"PROMPTS sharegpt (test split, default) or humaneval (default {DEFAULT_WORKLOAD})")
    p.add_argument("--model", choices=("default", "tiny"), default=None,
                   help="'default' (the default MoE model) or 'tiny' (a tiny random model: wiring only); default: default, tiny with --quick")
    p.add_argument("--requests", type=int, default=None, help="arrivals replayed per workload (the cap; default 400, 40 with --quick)")
    p.add_argument("--prompt-count", type=int, default=None,
                   help="distinct prompts traced per workload; arrival i replays prompt i mod this (default 96, 6 with --quick)")
    p.add_argument("--new-tokens", type=int, default=None, help="decode tokens traced per prompt (default 32, 8 with --quick)")
    p.add_argument("--time-scale", type=float, default=1.0, help="arrival times x this (0.5: twice the rate; default 1)")
    p.add_argument("--rate", type=float, default=DEFAULT_RATE,
                   help=f"generated process: requests per second (default {DEFAULT_RATE:.2f}, the Azure conversation trace's)")
    p.add_argument("--burstiness", type=float, default=DEFAULT_CV,
                   help=f"generated process: coefficient of variation of inter-arrival gaps, 1 = Poisson (default {DEFAULT_CV}, "
                        "the Azure conversation trace's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated process (default 0)")
    p.add_argument("--batching", nargs="+", choices=BATCHING, default=list(BATCHING),
                   help="batching models, the first one also for ablations and sweeps: iteration-level 'continuous' and the "
                        "paper's 'per-second' (requests arriving within each second form one batch) (default both)")
    p.add_argument("--step-ms", type=float, default=50.0, help="wall time of one serving iteration (default 50)")
    p.add_argument("--max-batch", type=int, default=32, help="most requests in a batch (default 32)")
    p.add_argument("--max-iterations", type=int, default=None, help="iterations replayed at most (default 4000, 300 with --quick)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs (expert hosts) of the replayed cluster (default 8)")
    p.add_argument("--tier", choices=("host", "disk"), default="host", help="where cold starts load from (default host)")
    p.add_argument("--profile", metavar="JSON",
                   help="a measured cost profile (cost-profile.json or a `moeless bench planner --out` JSON; a GPU profile "
                        "works the same); default: measured now on this machine")
    p.add_argument("--ablate", nargs="+", default=["all"], metavar="PARTS",
                   help="ablations: predictor, scaler, placer, combinations like scaler,placer, 'all' (every combination; "
                        "default) or 'none'")
    p.add_argument("--sweep-distances", nargs="+", default=None, metavar="D",
                   help="prediction distances swept (default 1 2 3 4 5; 'none' skips)")
    p.add_argument("--sweep-cv", nargs="+", default=None, metavar="V",
                   help="CV thresholds swept with the paper's planner (default 0.2 0.4 0.6 0.8 1.0; 'none' skips)")
    d = p.add_argument_group("deployments (any of these flags: the paper's models on GPU clusters, docs/deployments.md)")
    d.add_argument("--geometry", nargs="+", metavar="NAME|config.json",
                   help="models: a known geometry (mixtral-8x7b, phi-3.5-moe, llama-4-scout, ...) or an HF config.json; "
                        "replays chunked-prefill batches of GPU size priced by the GPUs' roofline (or --profile)")
    d.add_argument("--gpu", nargs="+", metavar="NAME[xCOUNT]", help="GPUs, e.g. H100x8 A6000x8 (default H100x8)")
    d.add_argument("--routing", metavar="FILE|NAME|moefied", default=None,
                   help="per-token routing: a file of `moeless trace import|record`, a shipped log's name (`moeless trace "
                        "list`: flame-moe-290m, E=64, k=6, fits deepseek-v2-lite), or 'moefied' (default: the default "
                        "model rebuilt at each geometry's E and k, labelled 'moefied SmolLM2 routing')")
    d.add_argument("--max-batched-tokens", type=int, default=None, help="the scheduler's token budget per iteration (default 8192)")
    d.add_argument("--max-seqs", type=int, default=None, help="the scheduler's running requests at most (default 256)")
    d.add_argument("--load", type=float, default=None, help="offered tokens / the scheduler's capacity (default 0.8)")
    sp = p.add_argument_group("shared pool (--shared-pool: several models on one pool of GPUs, three ways, or with "
                              "--finetunes N fine-tunes of a base, four ways; docs/shared-pool.md; takes --geometry, --gpu NAME, "
                              "--routing moefied|uniform, --keep-alive, --step-ms, --seed)")
    sp.add_argument("--shared-pool", action="store_true",
                    help="the models of --geometry (default mixtral-8x7b phi-3.5-moe llama-4-scout) on one pool: dedicated "
                         "static-EP pools, one pool shared by whole models, moeless's pool shared by experts")
    sp.add_argument("--levels", nargs="+", type=float, metavar="PER_MIN",
                    help="load levels, requests per minute per model (default 0.1 0.3 1 3 10 60)")
    sp.add_argument("--horizon", type=float, metavar="S", help="seconds replayed (default 3600; 600 with --quick)")
    sp.add_argument("--idle-delay", type=float, metavar="S", help="a model without a request this long sleeps in a shared pool (default 60)")
    sp.add_argument("--keep-warm", type=float, metavar="SHARE", default=0.0,
                    help="share of each layer's experts (the most popular) a model keeps resident while asleep in the "
                         "expert-grain pool, 0..1 (default 0)")
    sp.add_argument("--finetunes", nargs="+", type=int, metavar="N",
                    help="instead of several models: N fine-tunes of each --geometry (a base; default mixtral-8x7b "
                         "deepseek-v2-lite), each base's pool apart, for each N given, four ways: dedicated, whole-model, "
                         "expert-grain, and shared keys (a replica of an expert the fine-tunes did not change serves them all); "
                         "--quick: the level 1 request/min alone unless --levels")
    sp.add_argument("--step-hold", type=float, metavar="S",
                    help="with --finetunes: seconds a GPU added to keep the one engine's batched step within its SLO "
                         "stays after the last second that needed it (default 2)")
    sp.add_argument("--step-lag", type=float, metavar="S",
                    help="with --finetunes: seconds late that GPU's scaler sees the step's need (default 0: a scaler in "
                         "the engine's step loop; under a window, e.g. 0.02: the GPUs it adds take their part that much "
                         "later; 1: one that reads each second's figures after it)")
    sp.add_argument("--scale-up-copies", choices=("peer", "host"), default="peer",
                    help="with --finetunes: where those added GPUs get their share of the keys: copied from a GPU of the "
                         "pool holding them (peer, the default: the GPU's link) or loaded from host memory (host: serving's "
                         "expert hosts as built, each spare loading from its own store)")
    sp.add_argument("--peer-copy-ms", type=float, metavar="MS", help="with --finetunes: a peer copy's fixed cost beside "
                    "its bytes (default 2.1: measured on an H200, one ask a replica; 0: the link's roofline alone)")
    sp.add_argument("--peer-batch-mb", type=float, metavar="MB", help="with --finetunes: one ask copies the replicas that "
                    "fit this many MB at the geometry's bytes, paying that fixed cost once (default 0: one ask a replica)")
    sp.add_argument("--no-family-warm", dest="family_warm", action="store_false",
                    help="with --finetunes: no family warmth (the expert hosts' --no-family-warm): the base's experts "
                         "are neither loaded where a fine-tune holds its own nor kept past their keep-alive while a "
                         "fine-tune is awake (default: both, so a waking fine-tune loads only its own)")
    sp.add_argument("--replaced", nargs="+", type=float, metavar="SHARE", help="with --finetunes: shares of the base's "
                    "experts each fine-tune replaces, ESFT-style, in [0, 1) (default 0.05 0.15)")
    add_knob_flags(p)
    p.add_argument("--out", metavar="DIR", default="moeless-eval", help="the run directory (default ./moeless-eval)")
    p.add_argument("--markdown", metavar="FILE", help="also write the report's markdown here (links relative to it)")
    p.add_argument("--quick", action="store_true", help="a small run (tiny model, few requests) in under a minute")
    p.set_defaults(func=eval_command)

    r = commands.add_parser("report", help="render a `moeless eval` run directory: markdown, JSON, CSV and PNG plots",
                            description="Renders RUN_DIR/run.json into RUN_DIR/report.md, report.json, *.csv and *.png; the "
                                        "same run directory always renders to the same bytes.")
    r.add_argument("run_dir", metavar="RUN_DIR", help="a directory written by `moeless eval`")
    r.add_argument("--markdown", metavar="FILE", help="also write the report's markdown here (links relative to it)")
    r.set_defaults(func=report_command)


def _fail(command: str, message: str) -> int:
    print(f"moeless {command}: {message}", file=sys.stderr)
    return 2


def _config(args: argparse.Namespace):
    """EvalConfig from the flags (quick defaults filled in); raises the errors eval_command reports."""
    # heavy (the evaluation pipeline): kept off --help's start-up path
    from moeless.evaluation.evaluate import EvalConfig
    from moeless.evaluation.runs import CV_THRESHOLDS, DISTANCES, parse_ablations
    from moeless.evaluation.workload import Sizes, WorkloadError, parse_workload

    quick = args.quick
    knobs = knobs_from_args(args)
    if quick and args.knob_distance is None:
        knobs = replace(knobs, distance=1)  # the tiny model has two layers
    ints = {"--requests": args.requests, "--prompt-count": args.prompt_count, "--new-tokens": args.new_tokens,
            "--max-batch": args.max_batch, "--max-iterations": args.max_iterations, "--gpus": args.gpus}
    bad = [flag for flag, value in ints.items() if value is not None and value <= 0]
    if bad or not (args.time_scale > 0 and args.rate > 0 and args.burstiness > 0 and args.step_ms > 0):
        raise WorkloadError(f"{bad[0] if bad else '--time-scale, --rate, --burstiness and --step-ms'} must be positive")
    sizes = Sizes(requests=args.requests or (QUICK["requests"] if quick else 400),
                  prompts=args.prompt_count or (QUICK["prompt_count"] if quick else 96),
                  new_tokens=args.new_tokens or (QUICK["new_tokens"] if quick else 32), time_scale=args.time_scale,
                  step_s=args.step_ms / 1e3, max_batch=args.max_batch,
                  max_iterations=args.max_iterations or (QUICK["max_iterations"] if quick else 4000),
                  rate=args.rate, cv=args.burstiness, seed=args.seed)
    workloads = tuple(parse_workload(w) for w in (args.workload or [DEFAULT_WORKLOAD]))
    names = [w.name for w in workloads]
    if len(set(names)) < len(names):
        raise WorkloadError(f"--workload: two workloads named {next(n for n in names if names.count(n) > 1)!r}; name them NAME=TRACE")
    return EvalConfig(
        workloads=workloads, knobs=knobs, sizes=sizes, model=args.model or (QUICK["model"] if quick else "default"),
        batchings=tuple(dict.fromkeys(args.batching)), gpus=args.gpus, tier=args.tier, profile=args.profile,
        ablations=tuple(parse_ablations(args.ablate)),
        distances=tuple(_sweep(args.sweep_distances, int, "--sweep-distances", DISTANCES)),
        cv_thresholds=tuple(_sweep(args.sweep_cv or (QUICK["cv"] if quick else None), float, "--sweep-cv", CV_THRESHOLDS)),
        quick=quick,
    )


def _sweep(values, kind, flag: str, default) -> list:
    # heavy (the evaluation pipeline): kept off --help's start-up path
    from moeless.evaluation.workload import WorkloadError

    if values is None:
        return list(default)
    if values == ["none"]:
        return []
    try:
        out = sorted({kind(v) for v in values})
    except ValueError:
        raise WorkloadError(f"{flag}: expected numbers (or 'none'), got {' '.join(values)}") from None
    if out[0] <= 0:
        raise WorkloadError(f"{flag}: values must be positive, got {out[0]}")
    return out


def _deployment_config(args: argparse.Namespace):
    """DeploymentConfig from the flags (--quick: small sizes)."""
    # heavy (the evaluation pipeline): kept off --help's start-up path
    from moeless.evaluation.deployment import DeploymentSizes
    from moeless.evaluation.deployment_run import DeploymentConfig
    from moeless.evaluation.workload import WorkloadError, parse_workload

    base = DeploymentSizes()
    picked = {"max_batched_tokens": args.max_batched_tokens, "max_seqs": args.max_seqs, "load": args.load,
              "requests": args.requests or (QUICK["requests"] if args.quick else None),
              "max_iterations": args.max_iterations or (60 if args.quick else None),
              "routing_prompts": args.prompt_count or (QUICK["prompt_count"] if args.quick else None),
              "routing_tokens": args.new_tokens or (QUICK["new_tokens"] if args.quick else None)}
    bad = [k for k, v in picked.items() if v is not None and v <= 0]
    if bad:
        raise WorkloadError(f"--{bad[0].replace('_', '-')} must be positive")
    sizes = DeploymentSizes(**{k: (v if v is not None else getattr(base, k)) for k, v in picked.items()},
                            step_s=args.step_ms / 1e3)
    workloads = tuple(parse_workload(w) for w in (args.workload or [DEFAULT_WORKLOAD]))
    return DeploymentConfig(tuple(args.geometry or ["default"]), tuple(args.gpu or ["H100x8"]), workloads,
                            args.routing or "moefied", sizes, knobs_from_args(args), args.profile, args.quick)


DEPLOYMENT_FLAGS = ("geometry", "gpu", "routing", "max_batched_tokens", "max_seqs", "load")


def eval_command(args: argparse.Namespace) -> int:
    # heavy (the evaluation pipeline): kept off --help's start-up path
    from moeless.evaluation.evaluate import evaluate
    from moeless.evaluation.report import render

    if (args.finetunes or args.replaced) and not args.shared_pool:
        return _fail("eval", "--finetunes and --replaced are for the shared pool: moeless eval --shared-pool --finetunes N ...")
    if args.shared_pool:
        return _shared_pool(args)
    if any(getattr(args, f) is not None for f in DEPLOYMENT_FLAGS):
        return _deployments(args)
    try:
        config = _config(args)
        evaluate(config, args.out)
    except _errors() as err:
        return _fail("eval", str(err))
    paths = render(args.out, args.markdown)
    print(f"wrote {args.out}/run.json and the report: " + ", ".join(str(p) for p in paths[:3]) + f" (+{len(paths) - 3} files)")
    return 0


def _deployments(args: argparse.Namespace) -> int:
    # heavy (the evaluation pipeline): kept off --help's start-up path
    from moeless.evaluation.deployment_report import render
    from moeless.evaluation.deployment_run import evaluate_deployments

    return _evaluate_and_render(lambda: evaluate_deployments(_deployment_config(args), args.out), render, args)


def _evaluate_and_render(evaluate, render, args: argparse.Namespace) -> int:
    """Run evaluate(), then render(args.out, args.markdown); a bad input is one error line."""
    try:
        evaluate()
    except _errors() as err:
        return _fail("eval", str(err))
    paths = render(args.out, args.markdown)
    print(f"wrote {args.out}/run.json and the report: " + ", ".join(str(p) for p in paths))
    return 0


def _shared_pool_config(args: argparse.Namespace):
    """SharedPoolConfig from the flags (--quick: uniform routing, a 10-minute horizon)."""
    # heavy (the evaluation pipeline): kept off --help's start-up path
    from moeless.evaluation.deployment import DeploymentError
    from moeless.evaluation.shared_pool_run import SharedPoolConfig
    from moeless.hardware.gpus import parse_gpu_arg
    from moeless.twin.shared_pool import PoolSettings

    base, settings = SharedPoolConfig(), PoolSettings()
    picked = {"horizon_s": args.horizon or (600.0 if args.quick else None), "idle_delay_s": args.idle_delay,
              "keep_alive_s": args.knob_keep_alive_s}
    bad = [k for k, v in picked.items() if v is not None and not v > 0]
    if bad or not args.step_ms > 0:
        raise DeploymentError(f"--{(bad[0] if bad else 'step_ms').removesuffix('_s').replace('_', '-')} must be positive")
    if not 0 <= args.keep_warm <= 1:
        raise DeploymentError(f"--keep-warm: a share of each layer's experts, 0..1; got {args.keep_warm:g}")
    for flag, value, unit in (("--step-hold", args.step_hold, "seconds"), ("--step-lag", args.step_lag, "seconds"),
                              ("--peer-copy-ms", args.peer_copy_ms, "milliseconds"), ("--peer-batch-mb", args.peer_batch_mb, "MB")):
        if value is not None and not value >= 0:
            raise DeploymentError(f"{flag}: {unit}, 0 or more; got {value:g}")
    settings = PoolSettings(**{k: (v if v is not None else getattr(settings, k)) for k, v in picked.items()},
                            step_s=args.step_ms / 1e3, seed=args.seed, keep_warm=args.keep_warm, family_warm=args.family_warm,
                            step_hold_s=settings.step_hold_s if args.step_hold is None else args.step_hold,
                            step_lag_s=settings.step_lag_s if args.step_lag is None else args.step_lag, scale_up_copies=args.scale_up_copies,
                            peer_copy_s=settings.peer_copy_s if args.peer_copy_ms is None else args.peer_copy_ms / 1e3,
                            peer_batch_bytes=(args.peer_batch_mb or 0.0) * 1e6)
    gpus = args.gpu or [base.gpu]
    if len(gpus) != 1:
        raise DeploymentError(f"--gpu: the shared pool takes one GPU type, got {gpus}")
    return SharedPoolConfig(tuple(args.geometry or base.geometries), parse_gpu_arg(gpus[0])[0].name,
                            tuple(args.levels or base.levels), args.routing or ("uniform" if args.quick else base.routing), settings)


def _shared_pool(args: argparse.Namespace) -> int:
    # heavy (the evaluation pipeline): kept off --help's start-up path
    from moeless.evaluation import finetune_report, shared_pool_report
    from moeless.evaluation.finetune_run import evaluate_finetune_pools
    from moeless.evaluation.shared_pool_run import evaluate_shared_pool

    if args.finetunes is None and args.replaced is None:
        return _evaluate_and_render(lambda: evaluate_shared_pool(_shared_pool_config(args), args.out),
                                    shared_pool_report.render, args)
    return _evaluate_and_render(lambda: evaluate_finetune_pools(_finetune_config(args), args.out),
                                finetune_report.render, args)


def _finetune_config(args: argparse.Namespace):
    """FineTuneConfig from the flags: the shared pool's, with --geometry naming the bases."""
    # heavy (the evaluation pipeline): kept off --help's start-up path
    from moeless.evaluation.deployment import DeploymentError
    from moeless.evaluation.finetune_run import BASES, FineTuneConfig

    if not args.finetunes:
        raise DeploymentError("--replaced: give --finetunes N too (how many fine-tunes of each base share its pool)")
    pool = replace(_shared_pool_config(args), geometries=tuple(args.geometry or BASES))
    if args.quick and not args.levels:
        pool = replace(pool, levels=(1.0,))  # the level alone: under a minute
    return FineTuneConfig(pool, tuple(args.finetunes), tuple(args.replaced or FineTuneConfig.replaced))


def report_command(args: argparse.Namespace) -> int:
    # heavy (the evaluation pipeline): kept off --help's start-up path
    from moeless.evaluation import deployment_report, finetune_report, shared_pool_report
    from moeless.evaluation.deployment_run import FORMAT as DEPLOYMENTS
    from moeless.evaluation.finetune_run import FORMAT as FINETUNES
    from moeless.evaluation.report import render, run_format
    from moeless.evaluation.shared_pool_run import FORMAT as SHARED_POOL

    renderers = {DEPLOYMENTS: deployment_report.render, SHARED_POOL: shared_pool_report.render,
                 FINETUNES: finetune_report.render}
    try:
        paths = renderers.get(run_format(args.run_dir), render)(args.run_dir, args.markdown)
    except _errors() as err:
        return _fail("report", str(err))
    print(f"rendered {len(paths)} files into {args.run_dir}" + (f" and {args.markdown}" if args.markdown else ""))
    return 0


def _errors() -> tuple[type[Exception], ...]:
    """The errors of bad input: each is one line saying what was wrong and what to do."""
    # heavy (the evaluation pipeline): kept off --help's start-up path
    from moeless.evaluation.deployment import DeploymentError
    from moeless.evaluation.report import RunDirError
    from moeless.evaluation.runs import CaseError
    from moeless.evaluation.workload import WorkloadError
    from moeless.model.datasets import DatasetError
    from moeless.placement.cluster import ClusterError
    from moeless.placement.profile import ProfileError
    from moeless.twin.arrivals import TraceError
    from moeless.twin.geometry import GeometryError
    from moeless.hardware.gpus import GpuError
    from moeless.traces.routing_file import RoutingError

    return (ProfileError, TraceError, RunDirError, CaseError, WorkloadError, KnobError, DatasetError, ClusterError,
            DeploymentError, GeometryError, GpuError, RoutingError)
