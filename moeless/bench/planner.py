"""`moeless bench planner`: the cost profile measured here, planning time, and every planner
replayed through the digital twin with every cost counted.

1. The cost profile (hardware/cpu_profile.py on this CPU, hardware/cuda_profile.py with --device cuda), beside
   the roofline's prediction of it.
2. Planning time per layer for several (E, G): moeless, moeless-fill and the paper beside EPLB.
3. Plan quality: real per-request loads batched by real arrivals, replayed through the twin for
   every planner and forecast kind (twin/compare.py).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import asdict
from typing import Sequence

import numpy as np
from tqdm import tqdm

from moeless.bench import BENCHES
from moeless.bench.common import add_bench_flags, write_result
from moeless.bench.planner_report import print_profile, print_quality, print_roofline, print_timing
from moeless.hardware.gpus import gpu_from_device_name, gpu_spec, known_gpus
from moeless.placement.cluster import Cluster
from moeless.placement.fill_placer import HORIZON
from moeless.placement.latency_model import LatencyModel
from moeless.placement.planner import Planner, PlannerConfig, get_planner
from moeless.placement.profile import CostProfile
from moeless.twin import compare as q, roofline as rl
from moeless.twin.arrivals import arrival_times
from moeless.twin.geometry import default_geometry, load_geometry
from moeless.twin.iterations import compose_iterations
from moeless.twin.twin import TwinSettings

TIMING_SIZES = ((8, 8), (16, 8), (64, 8), (256, 64))
KEEP_ALIVE_S = 1.0  # the bench's keep-alive: shorter than its replay, so evictions happen (the knob's default is 60 s)


def register(benches: argparse._SubParsersAction) -> None:
    """Add `moeless bench planner`."""
    p = benches.add_parser(
        "planner",
        help=BENCHES["planner"].help,
        description=(
            "Measures the cost profile (alpha, call overhead, beta, one replica's load from disk and from host memory, "
            "bytes) on this machine, times planning per layer beside EPLB, then replays real per-request routing loads "
            "batched by Azure arrivals through the digital twin: every planner fed a perfect forecast, the previous "
            "iteration's loads and the gate-replica predictor's forecast at d = 1, 2, 3, cold starts prefetched d "
            "layers ahead, keep-alive in force; layer time, exposed cold starts, resident replicas and GB·s, as "
            "ratios to static EP, prefill and decode apart and all iterations by time."
        ),
    )
    add_bench_flags(p)
    p.add_argument("--loads", default=None, metavar="SOURCE",
                   help="'default' (the default model on ShareGPT test prompts, with its gate-replica forecasts; cached), "
                        "'tiny' (a tiny random model, wiring only) or a .npz of loads (and forecasts) "
                        "(default: 'default', 'tiny' with --quick)")
    p.add_argument("--requests", type=int, default=None, help="prompts to trace (default 48, 6 with --quick)")
    p.add_argument("--new-tokens", type=int, default=None, help="decode tokens per request (default 32, 8 with --quick)")
    p.add_argument("--iterations", type=int, default=None, help="serving iterations to replay (default 400, 60 with --quick)")
    p.add_argument("--distances", type=int, nargs="+", default=None, metavar="D",
                   help="prefetch / prediction distances in layers (default 1 2 3; 1 with --quick)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs (expert hosts) in the replayed cluster (default 8)")
    p.add_argument("--layer-cap", type=float, default=2.0,
                   help="memory cap per layer, in multiples of one replica per expert (the paper's M_cap; default 2)")
    p.add_argument("--keep-alive", type=float, default=KEEP_ALIVE_S,
                   help=f"seconds an unused replica stays resident (default {KEEP_ALIVE_S})")
    p.add_argument("--gb-s-price", type=float, default=None,
                   help="seconds of layer time one GB·s of replica memory is worth to moeless (default: memory-neutral, "
                        "1 / the deployment's GB: its non-expert weights and L x E expert replicas)")
    p.add_argument("--horizon", type=float, default=None,
                   help="iterations over which moeless counts a new replica's gain (default 30)")
    p.add_argument("--tier", choices=("host", "disk"), default="host",
                   help="where cold starts load from: the host memory tier (default) or disk (read + sha256 each time)")
    p.add_argument("--profile", metavar="JSON", help="a cost profile to use instead of measuring one")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where to measure the cost profile: this CPU (default) or cuda:0 (a clear error without CUDA); "
                        "either way the roofline's prediction is compared with it, field by field")
    p.add_argument("--geometry", default="default", metavar="NAME|config.json",
                   help="with --device cuda, the model whose experts are measured (a name such as mixtral-8x7b, or a HF "
                        "config.json; default: the default model, whose loads are replayed)")
    p.add_argument("--gpu", default=None, metavar="NAME",
                   help="with --device cuda, the datasheet the roofline uses (default: from the device's name)")
    p.add_argument("--efficiency", nargs="+", default=[], metavar="KEY=VALUE|FILE.json",
                   help="roofline efficiency overrides for the comparison (compute, memory, link, pcie, launch_s, ...; "
                        "a .json file of them)")
    p.add_argument("--cv-threshold", type=float, default=0.2, help="the paper's CV threshold V (default 0.2)")
    p.add_argument("--max-batch", type=int, default=32, help="most requests decoding together (default 32)")
    p.add_argument("--step-ms", type=float, default=50.0, help="wall time of one serving iteration (default 50 ms)")
    p.add_argument("--rate-scale", type=float, default=1.0, help="speed up arrivals by this factor (default 1)")
    p.add_argument("--timing-repeats", type=int, default=None, help="plans timed per size (default 1000, 150 with --quick)")
    p.add_argument("--no-ablations", action="store_true", help="skip moeless's ablation rows")
    p.add_argument("--skip-quality", action="store_true", help="only measure the cost profile and planning time")
    p.add_argument("--skip-timing", action="store_true", help="skip the planning-time part")
    p.set_defaults(func=bench_planner)


TIMED = ("moeless", "moeless-fill", "paper")  # planners timed beside EPLB


def skewed_loads(rng: np.random.Generator, count: int, experts: int, tokens: int, concentration: float = 0.3) -> np.ndarray:
    """count skewed [E] token vectors (Dirichlet routing probabilities): [count, E]."""
    return np.stack([rng.multinomial(tokens, rng.dirichlet(np.full(experts, concentration))) for _ in range(count)]).astype(np.float64)


def _time_planner(planner: Planner, loads: np.ndarray, cluster: Cluster) -> dict:
    """Time one-layer plan calls (chained: each plan is the next one's previous).

    Wall time, and the thread's CPU time (what the call costs without waiting for a busy CPU).
    """
    planner(loads[:1], cluster, None)  # warm-up: the first call loads the compiled kernels (once per process)
    previous, wall, cpu, replicas = None, [], [], []
    enabled = gc.isenabled()
    gc.disable()  # as timeit does: a collection pause is not the planner's time
    try:
        for load in loads:
            start, start_cpu = time.perf_counter(), time.thread_time()
            previous = planner(load[None, :], cluster, previous)
            wall.append(time.perf_counter() - start)
            cpu.append(time.thread_time() - start_cpu)
            replicas.append(previous.layers[0].num_replicas)
    finally:
        if enabled:
            gc.enable()
    return {
        "median_ms": 1e3 * float(np.median(wall)),
        "p99_ms": 1e3 * float(np.percentile(wall, 99)),
        "cpu_median_ms": 1e3 * float(np.median(cpu)),
        "replicas": float(np.mean(replicas)),
    }


def planning_time(sizes: Sequence[tuple[int, int]], model: LatencyModel, count: int, seed: int = 0) -> list[dict]:
    """Per-layer planning time of moeless, moeless-fill and the paper beside EPLB (at moeless's replica budget)."""
    rng = np.random.default_rng(seed)
    rows = []
    for experts, gpus in sizes:
        loads = skewed_loads(rng, count, experts, tokens=32 * experts)
        cluster = Cluster.uniform(gpus, 2 * (-(-2 * experts // gpus)), expert_bytes=1, layer_cap_replicas=2 * experts)
        row: dict = {"E": experts, "G": gpus}
        for name in TIMED:
            row[name] = _time_planner(get_planner(name, PlannerConfig(model=model)), loads, cluster)
        budget = max(experts, -(-round(row["moeless"]["replicas"]) // gpus) * gpus)
        row["eplb"] = _time_planner(get_planner("eplb", PlannerConfig(eplb_replicas=budget)), loads, cluster)
        rows.append(row)
    return rows


def _fail(message: str) -> int:
    print(f"moeless bench planner: {message}", file=sys.stderr)
    return 2


def bench_planner(args: argparse.Namespace) -> int:
    # heavy (torch): kept off --help's start-up path, as in every bench
    from moeless.model.default import default_model
    from moeless.model.shape import model_facts
    from moeless.traces.sources import requests_from
    from moeless.hardware.cuda_profile import CudaUnavailable, require_cuda

    quick = args.quick
    distances = sorted(set(args.distances or ([1] if quick else [1, 2, 3])))
    if min(distances) < 1 or args.keep_alive < 0 or (args.gb_s_price is not None and args.gb_s_price < 0):
        return _fail("--distances must be >= 1, --keep-alive and --gb-s-price >= 0")
    try:  # arguments checked before the (long) tracing
        rl.parse_efficiency_args(args.efficiency)
        if args.device == "cuda" and not args.profile:
            require_cuda()
            load_geometry(args.geometry)
            _datasheet(args)
    except (ValueError, CudaUnavailable) as err:
        return _fail(str(err))
    data = None
    if not args.skip_quality:
        source = args.loads or ("tiny" if quick else "default")
        data = requests_from(source, args.requests or (6 if quick else 48), args.new_tokens or (8 if quick else 32), distances)
    try:
        if args.profile:
            profile, facts = CostProfile.from_json(args.profile), {"from": args.profile}
        else:
            if data:
                shape, num_experts = data[2], data[0][0].prefill.shape[1]
            elif args.device == "cuda":  # the geometry's experts are measured: no model to build
                shape, num_experts = None, load_geometry(args.geometry).num_experts
            else:
                model = default_model()
                shape, num_experts = model_facts(model), model.spec.num_experts
            profile, facts = _measure(args, shape, num_experts, 20 if quick else 60)
    except ValueError as err:  # ProfileError, GeometryError, GpuError, a bad --efficiency
        return _fail(str(err))
    print_profile(profile)
    result = {"cost_profile": vars(profile), "profile_facts": facts}
    if "roofline" in facts:
        print_roofline(facts["roofline"])
    if not args.skip_timing:
        repeats = args.timing_repeats or (150 if quick else 1000)
        result["planning_time"] = planning_time(TIMING_SIZES, profile.latency_model(), repeats)
        print_timing(result["planning_time"], repeats)
    if data is not None:
        result["quality"] = _quality(args, data, distances, profile)
        print_quality(result["quality"])
    path = write_result(args.out, "planner", result)
    if path:
        profile.to_json(path.parent / "cost-profile.json")
        print(f"\nwrote {path} and {path.parent / 'cost-profile.json'}")
    return 0


def _measure(args: argparse.Namespace, shape, num_experts: int, repeats: int):
    """(profile, facts) measured on args.device, facts["roofline"] the roofline's prediction of it
    (twin/roofline.py) and the ratios, field by field (absent where no geometry matches the shape)."""

    overrides = rl.parse_efficiency_args(args.efficiency)
    if args.device == "cpu":
        # heavy (torch): kept off --help's start-up path
        from moeless.hardware.cpu_peaks import measure_cpu_peaks
        from moeless.hardware.cpu_profile import measure_profile

        profile, facts = measure_profile(shape.hidden, shape.ffn, shape.non_expert_bytes, repeats,
                                         num_experts=num_experts, num_gpus=args.gpus)
        geometry = default_geometry()
        if (geometry.hidden, geometry.expert_ffn) == (shape.hidden, shape.ffn):
            peaks = measure_cpu_peaks(threads=1)
            predicted = rl.cpu_roofline_profile(peaks, geometry, args.gpus)
            facts["roofline"] = {"device": "this CPU", "peaks": asdict(peaks), "profile": vars(predicted),
                                 "ratios": rl.compare_profiles(predicted, profile)}
        return profile, facts
    from moeless.hardware.cuda_profile import measure_cuda_profile  # heavy (torch): off --help's path

    geometry, spec = load_geometry(args.geometry), _datasheet(args)
    stand_in = rl.roofline_profile(geometry, spec, args.gpus, **overrides).beta if spec else 0.0
    profile, facts = measure_cuda_profile(geometry, repeats, num_experts=num_experts, num_gpus=args.gpus,
                                          roofline_beta=stand_in)
    if spec is None:
        print(f"no datasheet for {facts['device']!r}: no roofline comparison (pass --gpu NAME)", file=sys.stderr)
        return profile, facts
    guess = rl.roofline_profile(geometry, spec, 2, **overrides)  # beta is measured GPU 0 -> GPU 1: a pair's
    ratios = rl.compare_profiles(guess, profile)
    if not facts["beta_measured"]:
        ratios["beta"] = None  # one GPU: beta is the roofline's own
    facts["roofline"] = {"device": f"{spec.name} datasheet", "profile": vars(guess), "ratios": ratios}
    return profile, facts


def _datasheet(args: argparse.Namespace):
    """The GpuSpec the roofline compares a CUDA measurement with: --gpu, else the device's name
    (None if unknown). ValueError where there is neither a datasheet nor a second GPU (no beta)."""
    import torch  # heavy: kept off --help's start-up path


    name = torch.cuda.get_device_name(0)
    spec = gpu_spec(args.gpu) if args.gpu else gpu_from_device_name(name)
    if spec is None and torch.cuda.device_count() < 2:
        raise ValueError(f"no datasheet for {name!r} and one GPU, so no beta (measured or by roofline); pass --gpu NAME "
                         f"(one of {', '.join(known_gpus())})")
    return spec


def _quality(args: argparse.Namespace, data, distances: list[int], profile) -> dict:
    # heavy (torch): kept off --help's start-up path
    from moeless.twin.forecasts import accuracy as twin_accuracy, iteration_forecasts

    requests, forecasts, _, loads_note = data
    num_layers, num_experts = requests[0].prefill.shape
    distances = [d for d in distances if d < num_layers] or [1]
    kinds = ["perfect", "previous", *(["predictor"] if forecasts is not None else [])]
    count = args.iterations or (60 if args.quick else 400)
    arrivals, arrivals_note = arrival_times(4 * count, rate_scale=args.rate_scale)
    iterations = compose_iterations(requests, arrivals, args.step_ms / 1e3, args.max_batch, count)
    per_kind = {(k, d): iteration_forecasts(iterations, k, forecasts, d) for k in kinds for d in distances}
    cap = int(round(args.layer_cap * num_experts))
    # Memory in replica slots: the per-layer cap binds, the GPUs hold every layer at the cap.
    cluster = Cluster.uniform(args.gpus, -(-num_layers * cap // args.gpus), expert_bytes=profile.expert_bytes,
                              layer_cap_replicas=cap)
    horizon = HORIZON if args.horizon is None else args.horizon
    price = profile.memory_neutral_price(num_layers, num_experts) if args.gb_s_price is None else args.gb_s_price
    config = PlannerConfig(model=profile.latency_model(args.tier), cv_threshold=args.cv_threshold, horizon=horizon,
                           keep_alive_s=args.keep_alive, gb_s_price=price, iteration_s=args.step_ms / 1e3)
    settings = TwinSettings(keep_alive_s=args.keep_alive, tier=args.tier)
    runs = q.plan_runs(distances, kinds, ablations=not args.no_ablations)
    print(f"\nplan quality: {loads_note}; {arrivals_note}")
    print(f"  {len(iterations)} iterations ({sum(i.phase == 'prefill' for i in iterations)} prefill), L={num_layers} "
          f"E={num_experts} G={args.gpus}, cap {cap} replicas/layer, keep-alive {args.keep_alive} s, cold starts from "
          f"{args.tier} ({profile.load_s[args.tier] * 1e3:.3f} ms), GB·s price {price:.3g} s"
          + (" (memory-neutral)" if args.gb_s_price is None else "") + f", horizon {horizon}")
    with tqdm(total=len(iterations) * len(runs), desc="replaying planners") as bar:
        records = q.run_all(runs, iterations, per_kind, cluster, profile, config, settings, bar)
    accuracy = {f"d={d}": twin_accuracy({("predictor", d): per_kind[("predictor", d)]}, iterations)[0]["all"]
                for d in distances if "predictor" in kinds}
    return {"loads": loads_note, "arrivals": arrivals_note, "summary": q.summarise(records),
            "predictor_load_accuracy": accuracy,
            "config": {"gpus": args.gpus, "layer_cap": cap, "cv_threshold": args.cv_threshold, "horizon": horizon,
                       "distances": distances, "keep_alive_s": args.keep_alive, "gb_s_price": price,
                       "tier": args.tier, "max_batch": args.max_batch, "step_ms": args.step_ms, "rate_scale": args.rate_scale,
                       "iterations": len(iterations), "prefill_iterations": int(np.sum([i.phase == "prefill" for i in iterations]))}}
