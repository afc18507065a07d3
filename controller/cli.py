"""`moeless` subcommands of moeless.controller (registered by moeless.cli): `moeless bench planner`."""

from __future__ import annotations

import argparse

from moeless.benchio import add_bench_flags, write_result

# Planners the quality part replays: the baselines, moeless, the paper's pair and the ablations.
QUALITY_PLANNERS = (
    "static", "oracle", "eplb", "eplb-window", "paper", "moeless",
    "moeless-no-scaler", "moeless-no-placer", "moeless-cold", "moeless-greedy",
)
TIMING_SIZES = ((8, 8), (16, 8), (64, 8), (256, 64))


def register(commands: argparse._SubParsersAction, benches: argparse._SubParsersAction) -> None:
    """Add `moeless plan` and `moeless bench planner`."""
    plan = commands.add_parser(
        "plan",
        help="plan one iteration's placement from per-layer expert loads and print it",
        description="Runs a planner on loads [L, E] (a .npy file) and prints, per layer, each GPU's replicas "
                    "(expert:share) and the predicted layer time under the paper's and the serial execution model.",
    )
    plan.add_argument("loads", help=".npy file of token counts per expert, shape [L, E] (or [E] for one layer)")
    plan.add_argument("--planner", default="moeless",
                      help="a planner name (moeless, paper, static, eplb, eplb-global, oracle, ablations) "
                           "or 'module:function' (default moeless)")
    plan.add_argument("--gpus", type=int, default=8, help="GPUs (default 8)")
    plan.add_argument("--layer-cap", type=float, default=2.0, help="replicas per layer, in multiples of E (default 2)")
    plan.add_argument("--cv-threshold", type=float, default=0.2, help="the paper's CV threshold V (default 0.2)")
    plan.add_argument("--eplb-replicas", type=int, default=None, help="EPLB's replicas per layer (a multiple of --gpus)")
    plan.set_defaults(func=plan_command)
    p = benches.add_parser(
        "planner",
        help="planning time per layer and plan quality on real loads: moeless vs the paper, EPLB, static EP, Oracle",
        description=(
            "Measures the latency model (alpha, call overhead, beta, cold start) on this machine, times "
            "planning per layer for (E, G) in (8,8) (16,8) (64,8) (256,64) beside EPLB, then replays real "
            "per-request routing loads batched by Azure arrivals and prices every planner's plans under the "
            "paper's and the serial execution model, as ratios to static EP and the Oracle."
        ),
    )
    add_bench_flags(p)
    p.add_argument("--loads", default=None, metavar="SOURCE",
                   help="routing loads: 'default' (the default model on ShareGPT test prompts, cached), 'tiny' "
                        "(a tiny random moeless-sliced model, wiring only) or a .npz written by "
                        "moeless.model.traces.save_request_loads (default: 'default', 'tiny' with --quick)")
    p.add_argument("--requests", type=int, default=None, help="prompts to trace (default 48, 6 with --quick)")
    p.add_argument("--new-tokens", type=int, default=None, help="decode tokens per request (default 32, 8 with --quick)")
    p.add_argument("--iterations", type=int, default=None, help="serving iterations to replay (default 400, 60 with --quick)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs (expert hosts) in the replayed cluster (default 8)")
    p.add_argument("--layer-cap", type=float, default=2.0,
                   help="memory cap per layer, in multiples of one replica per expert (the paper's M_cap; default 2)")
    p.add_argument("--cv-threshold", type=float, default=0.2, help="the paper's CV threshold V (default 0.2)")
    p.add_argument("--horizon", type=float, default=None,
                   help="iterations over which moeless amortises a cold start when it weighs a new plan against the "
                        "resident replicas (default 30; 1 puts every cold start on the critical path)")
    p.add_argument("--prefetch-layers", type=int, default=3,
                   help="layers ahead a forecast lets cold loads start; the 'prefetch' column hides that many layer "
                        "times of each layer's cold loads (default 3)")
    p.add_argument("--max-batch", type=int, default=32, help="most requests decoding together (default 32)")
    p.add_argument("--step-ms", type=float, default=50.0, help="wall time of one serving iteration (default 50 ms)")
    p.add_argument("--rate-scale", type=float, default=1.0, help="speed up arrivals by this factor (default 1)")
    p.add_argument("--timing-repeats", type=int, default=None, help="plans timed per size (default 1000, 150 with --quick)")
    p.add_argument("--skip-quality", action="store_true", help="only measure the latency model and planning time")
    p.add_argument("--skip-timing", action="store_true", help="skip the planning-time part")
    p.set_defaults(func=bench_planner)


def plan_command(args: argparse.Namespace) -> int:
    import numpy as np

    from moeless.controller import bench_planner as bench
    from moeless.controller.planner import PlannerConfig, get_planner
    from moeless.placement.cluster import Cluster

    loads = np.atleast_2d(np.load(args.loads))
    num_layers, num_experts = loads.shape
    model, _ = bench.measure_latency_model(repeats=10)  # never invented: measured here, in seconds
    cap = int(round(args.layer_cap * num_experts))
    cluster = Cluster.uniform(args.gpus, -(-num_layers * cap // args.gpus), expert_bytes=1, layer_cap_replicas=cap)
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


def bench_planner(args: argparse.Namespace) -> int:
    from moeless.controller import bench_planner as bench

    quick = args.quick
    model, facts = bench.measure_latency_model(repeats=20 if quick else 60)
    print("latency model (measured now, torch on 1 thread):")
    print(f"  alpha          {model.alpha * 1e9:9.1f} ns/token   (expert_forward H=576 F=192 float32, slope)")
    print(f"  call overhead  {model.call_overhead * 1e6:9.1f} us/call    (intercept of the same fit)")
    print(f"  beta           {model.beta * 1e9:9.2f} ns/token   (serialise + copy a [T, 576] float32)")
    print(f"  cold start     {model.cold_start * 1e3:9.3f} ms/expert  (load + checksum one safetensors file, {facts['expert_bytes']} bytes)")

    result = {"latency_model": vars(model), "latency_facts": facts}
    if not args.skip_timing:
        result["planning_time"] = _timing(args, bench, model)
    if not args.skip_quality:
        result["quality"] = _quality(args, bench, model)
    path = write_result(args.out, "planner", result)
    if path:
        print(f"\nwrote {path}")
    return 0


def _timing(args: argparse.Namespace, bench, model) -> list[dict]:
    repeats = args.timing_repeats or (150 if args.quick else 1000)
    rows = bench.planning_time(TIMING_SIZES, model, repeats)
    print(f"\nplanning time per layer, ms ({repeats} skewed loads each; EPLB at moeless's replica budget;"
          f" wall median / p99 (thread CPU median)):")
    print(f"  {'E':>4} {'G':>3} | {'moeless':^26} | {'paper':^26} | {'EPLB':^26} | EPLB/moeless")
    for r in rows:
        cells = [f"{x['median_ms']:7.3f} / {x['p99_ms']:7.3f} ({x['cpu_median_ms']:6.3f})" for x in (r["moeless"], r["paper"], r["eplb"])]
        print(f"  {r['E']:>4} {r['G']:>3} | {' | '.join(cells)} | {r['eplb']['median_ms'] / r['moeless']['median_ms']:6.2f}x")
    return rows


def _quality(args: argparse.Namespace, bench, model) -> dict:
    import numpy as np
    from tqdm import tqdm

    from moeless.controller import loads as loads_source
    from moeless.controller.iterations import arrival_times, compose_iterations
    from moeless.controller.planner import PlannerConfig, get_planner
    from moeless.placement.cluster import Cluster
    from moeless.placement.fill_placer import HORIZON

    quick = args.quick
    if args.prefetch_layers < 0:
        raise SystemExit(f"--prefetch-layers must be >= 0 (layers a forecast looks ahead), got {args.prefetch_layers}")
    source = args.loads or ("tiny" if quick else "default")
    requests, loads_note = loads_source.request_loads_from(
        source, args.requests or (6 if quick else 48), args.new_tokens or (8 if quick else 32)
    )
    num_layers, num_experts = requests[0].prefill.shape
    count = args.iterations or (60 if quick else 400)
    arrivals, arrivals_note = arrival_times(4 * count, rate_scale=args.rate_scale)
    iterations = compose_iterations(requests, arrivals, args.step_ms / 1e3, args.max_batch, count)
    cap = int(round(args.layer_cap * num_experts))
    # Memory in replica slots: the per-layer cap binds, the GPUs hold every layer at the cap.
    cluster = Cluster.uniform(args.gpus, -(-num_layers * cap // args.gpus), expert_bytes=1, layer_cap_replicas=cap)
    horizon = HORIZON if args.horizon is None else args.horizon
    config = PlannerConfig(model=model, cv_threshold=args.cv_threshold, horizon=horizon)
    print(f"\nplan quality: {loads_note}; {arrivals_note}")
    print(f"  {len(iterations)} iterations ({sum(i.phase == 'prefill' for i in iterations)} prefill), L={num_layers} E={num_experts} "
          f"G={args.gpus}, memory cap {cap} replicas/layer, V={args.cv_threshold}, horizon {horizon}")
    names = [n for n in QUALITY_PLANNERS if not n.startswith("eplb")]
    replays = {}
    with tqdm(total=len(iterations) * len(QUALITY_PLANNERS), desc="replaying planners") as bar:
        for name in names:
            replays[name] = bench.replay(get_planner(name, config), iterations, cluster, model, bar, args.prefetch_layers)
        # EPLB gets (at least) the replicas moeless used on average, a multiple of G.
        budget = max(num_experts, -(-round(float(np.mean(replays["moeless"].replicas))) // args.gpus) * args.gpus)
        for name in ("eplb", "eplb-window"):
            eplb = get_planner(name, PlannerConfig(model=model, eplb_replicas=budget))
            replays[name] = bench.replay(eplb, iterations, cluster, model, bar, args.prefetch_layers)
    summary = bench.summarise(replays, [i.phase for i in iterations])
    for phase, block in summary.items():
        print(f"\n  {phase} ({block['iterations']} iterations); mean layer time, ratio to static EP / to Oracle:")
        prefetch = f"cold, prefetch {args.prefetch_layers}"
        print(f"  {'planner':<20} {'paper model':>24} {'serial model':>24} {'serial + cold starts':>24} {prefetch:>24} {'replicas':>8} {'churn':>6}")
        for name in QUALITY_PLANNERS:
            row = block["planners"][name]
            cells = [f"{row[k] * 1e6:7.1f}us {row[k + '_vs_static']:5.2f} {row[k + '_vs_oracle']:5.2f}" for k in bench.TIMES]
            print(f"  {name:<20} {' '.join(f'{c:>24}' for c in cells)} {row['replicas']:8.1f} {row['churn']:6.1f}")
    return {"loads": loads_note, "arrivals": arrivals_note, "eplb_replicas": budget, "summary": summary,
            "config": {"gpus": args.gpus, "layer_cap": cap, "cv_threshold": args.cv_threshold, "horizon": horizon,
                       "prefetch_layers": args.prefetch_layers,
                       "max_batch": args.max_batch, "step_ms": args.step_ms, "rate_scale": args.rate_scale}}
