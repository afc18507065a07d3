"""`moeless bench serve`: the cost of going serverless, measured in one run.

1. The same model generates real prompts (ShareGPT, held-out split) once, and every MoE-layer
   call is run on three paths back to back, in turn (the order rotates call by call), on the
   same input: experts in-process on 1 torch thread (the baseline), and through expert functions
   on local expert-host processes over the shared-memory local channel (the node-local path:
   what `moeless serve` uses, and pods on one node), over the TCP channel only (the pod path:
   hosts reached as if on other nodes, no shared memory) and over gRPC, and the node-local path
   with every expert on every host and each call's tokens paired on its own loads (dispatch-time
   pairing, bench/serve_pairing.py: its microseconds per layer printed). Paired within milliseconds, the paths meet the
   same machine: a shared machine's other jobs slow them alike instead of whichever path ran
   during a burst. Every expert-function output must equal the in-process output bit for bit;
   the generation goes on with that output. Hosts compute in parallel, so the in-process layer
   is also measured on as many threads as the hosts have together (the second baseline), batch
   by batch right after the paired run of the same batch (in its own pass: OpenMP's waiting
   worker threads would take a core from the hosts' calls next to it); ratios are to the faster
   baseline.
2. Reported: MoE time per layer call (mean, median, 10th and 90th percentile; prefill and
   decode apart) and the ratios to the faster in-process baseline at p50 and p90; bytes on the
   wire per layer call (the routed calls each way) against one float32 row per (token, expert)
   each way (the packed call before them); the round trip of one decode-sized (36 KB) and one
   prefill-sized (2.4 MB) call over each transport (bench/transport.py); tokens/s each path would give (the
   generation's time outside the MoE layers plus that path's MoE time); each remote path's layer
   broken into gate, scatter (plan + pack + send), invoke (of which the slowest host's expert
   compute; the rest is transfer and call overhead) and gather; each path also alone, as serving
   runs it (serving/path_timing.run_alone); and what two micro-batches in flight would give on cores of
   their own (twin/overlap.py on this run's figures: modelled), beside what they gave when run
   (serving/path_timing.run_pingpong: continuous batching's prefill and decode forwards over TCP and shared
   memory with 1 and 2 micro-batches, serving/pingpong.py, as `moeless serve` runs them: the live
   loop's forecasts and reports on every forward (the knobs' default predictor and distance; no
   planning loop, so the placement stays static EP's), against in-process without them).
3. The latency model's constants, fitted on single-expert calls of T tokens over the local
   channel: host compute = alpha * T, and round trip - compute = overhead + 2 * beta * T.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from moeless.bench import BENCHES
from moeless.bench.common import add_bench_flags, add_poll_flag, poll_from_args, print_and_write
from moeless.bench.serve_pairing import pairing_figures, preload, replicated_placement, timed_relevel
from moeless.bench.serve_report import print_report
from moeless.bench.transport import round_trip_calls
from moeless.core.timing import timed_calls
from moeless.twin.overlap import LayerCosts, hidden_fraction, pingpong_s, serial_s
from moeless.expert_fn.client.client import ExpertHostClient
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.expert_fn.wire.nixl_link import unavailable as nixl_unavailable
from moeless.expert_fn.wire.polling import DEFAULT_CLIENT_POLL_S, DEFAULT_HOST_POLL_S
from moeless.hardware.host_profile import fit_host_calls
from moeless.model.datasets import sharegpt_prompts
from moeless.serving.cli import MODEL_HELP, _positive
from moeless.serving.codec import CharCodec
from moeless.serving.path_timing import PairedExecutor, TimedExecutor, generate_batch, run_alone, run_pingpong
from moeless.serving.placement_source import PlacementSource

if TYPE_CHECKING:
    from moeless.serving.live_engine import LiveEngine

FIT_TOKENS = (1, 8, 32, 128, 512)
TRANSPORTS = ("local", "tcp", "nixl", "grpc")  # node-local, pod path (TCP only), NIXL where installed, gRPC
PINGPONG_TRANSPORTS = ("tcp", "local")
PAIRED = "expert_functions_local_paired"  # every expert on every host, each call's tokens paired (serve_pairing.py)


def register(benches: argparse._SubParsersAction) -> None:
    """Add `moeless bench serve`."""
    bench = benches.add_parser(
        "serve", help=BENCHES["serve"].help,
        description="Generate ShareGPT prompts once, running every MoE layer on each path back to back: experts "
                    "in-process (baselines) and through expert functions on local expert hosts (shared memory: "
                    "node-local; TCP only: the pod path; gRPC); print per-layer MoE time at p50 and p90, its "
                    "breakdown (gate, scatter, invoke, expert compute, gather), bytes on the wire per layer call, "
                    "round trips, tokens/s and the latency model's alpha and beta.",
    )
    bench.add_argument("--model", default="default", help=MODEL_HELP)
    bench.add_argument("--hosts", type=int, default=2, help="expert-host processes (default 2)")
    bench.add_argument("--prompts", type=int, help="number of prompts (default 8; 4 with --quick)")
    bench.add_argument("--max-tokens", type=int, help="new tokens per prompt (default 16; 8 with --quick)")
    bench.add_argument("--batch", type=int, default=4, help="prompts decoded together (default 4)")
    bench.add_argument("--threads", type=int, default=1, help="torch threads in this process and in each host (default 1)")
    bench.add_argument("--micro-batch-tokens", type=_positive, default=64,
                       help="the ping-pong run splits a forward in 2 micro-batches where each gets this many tokens "
                            "(default 64: the prefills split, the decode steps do not)")
    add_poll_flag(bench)
    add_bench_flags(bench)
    bench.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    prompts = args.prompts or (4 if args.quick else 8)
    max_tokens = args.max_tokens or (8 if args.quick else 16)
    result = run_bench(args.model, hosts=args.hosts, prompts=prompts, prompt_tokens=32 if args.quick else 64,
                       max_tokens=max_tokens, batch=args.batch, threads=args.threads, poll_s=poll_from_args(args),
                       micro_batch_tokens=args.micro_batch_tokens, pingpong_tokens=4 if args.quick else None)
    return print_and_write(args.out, "serve", result, print_report)


def bench_prompts(engine, count: int, prompt_tokens: int) -> list[list[int]]:
    """Token ids of `count` held-out ShareGPT prompts, each cut to prompt_tokens tokens."""
    prompts = sharegpt_prompts(count, "test")
    if isinstance(engine.codec, CharCodec):  # test models read only their small alphabet
        prompts = ["".join(c for c in p if ord(c) < engine.codec.vocab_size) or "?" for p in prompts]
    return [engine.codec.encode(p)[:prompt_tokens] for p in prompts]


def fit_alpha_beta(client, hidden: int, repeats: int = 7) -> dict[str, float]:
    """alpha, beta and the per-call overhead (the round trip's beyond the host's compute) from
    packed calls of expert (0, 0) on T tokens: the host cost fitter (hardware/host_profile.py) on
    single-expert calls, least squares over the median of `repeats` calls per T."""
    fit = fit_host_calls(client, hidden, experts=(1,), tokens=FIT_TOKENS, repeats=repeats)
    return {"alpha_s_per_token": fit["alpha"], "beta_s_per_token": fit["beta"], "call_overhead_s": fit["c0"],
            "fit_tokens": list(FIT_TOKENS), "repeats": repeats, "transport": client.path}


def run_bench(model: str = "default", *, hosts: int = 2, prompts: int = 8, prompt_tokens: int = 64,
              max_tokens: int = 16, batch: int = 4, threads: int = 1,
              poll_s: tuple[float, float] = (DEFAULT_HOST_POLL_S, DEFAULT_CLIENT_POLL_S),
              micro_batch_tokens: int = 64, pingpong_tokens: int | None = None) -> dict[str, Any]:
    """Measure every path on the same prompts (see the module docstring); poll_s: the (hosts',
    clients') busy-polling; micro_batch_tokens: the ping-pong run's split rule (Engine);
    pingpong_tokens: the new tokens per prompt in the ping-pong run (default max_tokens); returns
    the figures."""
    # heavy (ray, transformers; the executor): kept off --help's start-up path
    from moeless.serving.config import choose_model
    from moeless.model.weight_store import export_store
    from moeless.serving.engine import Engine
    from moeless.serving.executor import LayerTimes, RemoteExecutor

    torch.set_num_threads(threads)
    choice = choose_model(model)
    moe = choice.loader()
    spec = moe.spec
    store = export_store(moe, choice.name)
    ids = bench_prompts(Engine(moe), prompts, prompt_tokens)
    wide = hosts * threads  # the cores the hosts compute on together
    no_nixl = nixl_unavailable()
    transports = [t for t in TRANSPORTS if t != "nixl" or no_nixl is None]
    baselines = {f"in_process_{n}_threads": n for n in sorted({threads, wide})}
    timed = {name: TimedExecutor(moe.local_executor()) for name in baselines}
    with launch_local_hosts(hosts, store, keep_alive_s=600, threads=threads, metrics=False, poll_s=poll_s[0]) as group:
        clients = {t: [ExpertHostClient(a, timeout_s=120, transport=t, poll_s=poll_s[1]) for a in group.addresses]
                   for t in transports}
        remotes = {t: RemoteExecutor(clients[t], PlacementSource.static(spec.num_layers, spec.num_experts, hosts))
                   for t in transports}
        timed |= {f"expert_functions_{t}": TimedExecutor(remotes[t]) for t in transports}
        # the node-local path with every expert on every host, paired per call (bench/serve_pairing.py)
        relevel = timed_relevel(clients["local"][0], spec.hidden_size, spec.num_experts, hosts, batch)
        replicated = replicated_placement(spec.num_layers, spec.num_experts, hosts)
        preload(clients["local"], replicated)
        timed[PAIRED] = TimedExecutor(RemoteExecutor(clients["local"], PlacementSource(replicated), relevel=relevel))
        timed[PAIRED].inner.split_experts = relevel.split
        wide_name = f"in_process_{wide}_threads" if wide != threads else None
        paired = PairedExecutor({name: (executor, threads) for name, executor in timed.items() if name != wide_name},
                                threads)
        engine, wide_engine = Engine(moe, paired), Engine(moe, timed[wide_name]) if wide_name else None
        # 1. Warm every path (replica loads, channels, allocator), then measure.
        generate_batch(engine, ids[:batch], 2)
        for executor in timed.values():
            executor.samples = []
        for remote in remotes.values():
            remote.times = LayerTimes()
        paired.mismatches = dict.fromkeys(paired.paths, 0)
        relevel.samples = []
        from tqdm import tqdm

        paired_s, generated, captures, paired_rows = 0.0, 0, [], []
        for i in tqdm(range(0, len(ids), batch), desc="batches", leave=False):
            start = time.perf_counter()
            with moe.capture() as capture:  # the gate inputs (for the gate's own time)
                rows = generate_batch(engine, ids[i:i + batch], max_tokens)
            captures.append(capture)
            paired_rows.append(rows)
            paired_s += time.perf_counter() - start
            generated += sum(len(r) for r in rows)
            if wide_engine:  # the same batch on the wide baseline, on its own
                torch.set_num_threads(wide)
                wide_rows = generate_batch(wide_engine, ids[i:i + batch], max_tokens)
                torch.set_num_threads(threads)
                paired.mismatches.setdefault(wide_name, 0)
                paired.mismatches[wide_name] += sum(a != b for a, b in zip(rows, wide_rows))
        torch.set_num_threads(threads)
        dispatch = relevel.summary()  # the paired run's calls (the alone run below adds its own)
        # 2. Each path alone, as serving runs it (serving/path_timing.py).
        alone, alone_differ = run_alone(lambda executor: Engine(moe, executor),
                                        {name: (executor.inner, wide if name == wide_name else threads)
                                         for name, executor in timed.items()},
                                        [ids[i:i + batch] for i in range(0, len(ids), batch)], max_tokens, paired_rows)
        # 3. Two micro-batches in flight (ping-pong), run on continuous batching's forwards (serving/path_timing.py).
        reports: dict[str, list] = {}
        engines = {"in_process": Engine(moe, moe.local_executor())} | {
            f"{t}_{m}": _live_engine(moe, RemoteExecutor(clients[t], PlacementSource.static(spec.num_layers,
                                                                                          spec.num_experts, hosts)),
                                     reports.setdefault(f"{t}_{m}", []), micro_batches=m,
                                     micro_batch_tokens=micro_batch_tokens)
            for t in PINGPONG_TRANSPORTS for m in (1, 2)}
        pingpong_run = run_pingpong(engines, [ids[i:i + batch] for i in range(0, len(ids), batch)],
                                    pingpong_tokens or max_tokens, prefill_rounds=2 if len(ids) <= batch else 3)
        for name, sent in reports.items():
            engines[name].executor.close()
            pingpong_run[name]["forecast_ms_per_report"] = 1e3 * float(np.median([r.forecast_s for r in sent]))
            pingpong_run[name]["reports"] = len(sent)
        fit = fit_alpha_beta(clients["local"][0], spec.hidden_size)
        trips = {name: {t: {k: 1e6 * v for k, v in timed_calls(lambda c=cs[0]: c.submit(call, x).result(), 50).items()}
                        for t, cs in clients.items()}
                 for name, (call, x) in round_trip_calls(spec.hidden_size).items()}
        for client in (c for cs in clients.values() for c in cs):
            client.close()
    # 4. Figures per path against the faster in-process baseline, per phase.
    layer_ms = {name: executor.summary_ms(batch) for name, executor in timed.items()}
    alone_ms = {name: executor.summary_ms(batch) for name, executor in alone.items()}
    moe_s = {name: sum(s for _, s in executor.samples) for name, executor in timed.items()}
    outside_moe_s = paired_s - sum(moe_s[name] for name in paired.paths)  # the forward's own time
    phases = list(layer_ms[next(iter(baselines))])
    best = {stat: {phase: min(layer_ms[name][phase][stat] for name in baselines) for phase in phases}
            for stat in ("median", "p10", "p90")}
    best_alone = {stat: {phase: min(alone_ms[name][phase][stat] for name in baselines) for phase in phases}
                  for stat in ("median", "p90")}
    iterations = [it for capture in captures for it in capture.iterations]
    gate_ms = 1e3 * _gate_seconds(moe, iterations) / max(len(iterations) * spec.num_layers, 1)
    return {
        "model": choice.name, "experts": spec.num_experts, "top_k": spec.top_k, "expert_ffn": spec.expert_ffn,
        "hosts": hosts, "prompts": len(ids), "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens, "batch": batch, "threads_per_host": threads, "baseline_threads": list(baselines.values()),
        "load_average_1m": os.getloadavg()[0],  # a busy machine inflates every time below
        "poll_us": {"host": 1e6 * poll_s[0], "client": 1e6 * poll_s[1]},
        "nixl": no_nixl or "measured",
        "layer_calls": len(next(iter(timed.values())).samples),
        # expert functions: layer calls not bit-identical to the in-process ones; the wide baseline
        # (2 threads round differently): generations that differ from the paired run's
        "identical_outputs": {name: paired.mismatches[name] == 0 for name in timed},
        "mismatches": paired.mismatches,
        "tokens_per_s": {name: generated / (outside_moe_s + s) for name, s in moe_s.items()},
        "moe_layer_ms": layer_ms,
        "ratio_to_best_in_process": {name: {phase: ms[phase]["median"] / best["median"][phase] for phase in phases}
                                     for name, ms in layer_ms.items()},
        "ratio_to_best_in_process_p10": {name: {phase: ms[phase]["p10"] / best["p10"][phase] for phase in phases}
                                         for name, ms in layer_ms.items()},
        "ratio_to_best_in_process_p90": {name: {phase: ms[phase]["p90"] / best["p90"][phase] for phase in phases}
                                         for name, ms in layer_ms.items()},
        # each path alone (serving/path_timing.run_alone): the MoE layer as serving runs it
        "alone_moe_layer_ms": alone_ms,
        "alone_generations_differing": alone_differ,
        "alone_ratio_to_best_in_process": {name: {phase: ms[phase]["median"] / best_alone["median"][phase] for phase in phases}
                                           for name, ms in alone_ms.items()},
        "alone_ratio_to_best_in_process_p90": {name: {phase: ms[phase]["p90"] / best_alone["p90"][phase] for phase in phases}
                                               for name, ms in alone_ms.items()},
        "wire_per_layer_call": _wire(remotes["tcp"].times, spec.hidden_size, next(moe.hf.parameters()).dtype),
        "round_trip_us": trips,
        "breakdown_ms_per_layer": {t: _breakdown(remotes[t].times, gate_ms) for t in transports},
        "pingpong": {t: _pingpong(_breakdown(remotes[t].times, gate_ms), 1e3 * outside_moe_s / max(len(timed["in_process_1_threads"].samples), 1),
                                  trips["round_trip_decode"][t], spec.num_layers) for t in transports},
        "pingpong_run": {"micro_batch_tokens": micro_batch_tokens, "engines": pingpong_run,
                         "effect": {t: _pingpong_effect(pingpong_run[f"{t}_1"], pingpong_run[f"{t}_2"])
                                    for t in PINGPONG_TRANSPORTS}},
        "tokens_moved_per_layer": remotes["local"].times.tokens_moved / max(remotes["local"].times.layers, 1),
        "latency_model": fit,
        "pairing": pairing_figures(dispatch, relevel.model, layer_ms[PAIRED], layer_ms["expert_functions_local"]),
    }


def _wire(t, hidden: int, dtype: torch.dtype) -> dict[str, float]:
    """Per layer call: token rows and bytes each way, against one float32 row per (token, expert)
    each way (the packed call the routed call replaced), and their ratio."""
    layers = max(t.layers, 1)
    packed = 2 * t.tokens_moved * hidden * 4 / layers
    routed = (t.bytes_sent + t.bytes_received) / layers
    return {"rows_sent": t.rows_sent / layers, "rows_received": t.rows_received / layers,
            "pairs": t.tokens_moved / layers, "bytes_sent": t.bytes_sent / layers,
            "bytes_received": t.bytes_received / layers, "bytes_one_row_per_pair_float32": packed,
            "ratio_to_one_row_per_pair": routed / packed if packed else 0.0, "dtype": str(dtype)}


def _breakdown(t, gate_ms: float) -> dict[str, float]:
    def per_call(seconds: float) -> float:  # ms per MoE-layer call
        return 1e3 * seconds / max(t.layers, 1)

    return {"gate": gate_ms, "scatter": per_call(t.scatter_s), "invoke": per_call(t.invoke_s),
            "expert_compute": per_call(t.compute_s), "transfer_and_call": per_call(t.invoke_s - t.compute_s),
            "gather": per_call(t.gather_s)}


def _pingpong(breakdown: dict[str, float], outside_ms: float, trip_us: dict[str, float], layers: int) -> dict:
    """Two micro-batches in flight, modelled from this run's figures (twin/overlap.py), per layer call
    averaged over both phases: the replica's side is the forward outside the MoE layer plus gate,
    scatter and gather; the expert call is `invoke`, of which transfer_and_call is not host compute;
    each micro-batch's call pays again the decode-sized round trip's time beyond the host's compute."""
    costs = LayerCosts(attention_s=(outside_ms + breakdown["gate"] + breakdown["scatter"] + breakdown["gather"]) / 1e3,
                       remote_s=breakdown["invoke"] / 1e3, transfer_s=breakdown["transfer_and_call"] / 1e3,
                       call_s=max(trip_us["p50"] - trip_us["compute_p50"], 0.0) / 1e6)
    return {"serial_ms_per_layer": 1e3 * serial_s(costs, layers) / layers,
            "pingpong_ms_per_layer": 1e3 * pingpong_s(costs, layers) / layers,
            "hidden_fraction": hidden_fraction(costs, layers), "call_ms": 1e3 * costs.call_s}


def _live_engine(moe, remote, reports: list, **split) -> "LiveEngine":
    """An engine as `moeless serve` runs it over `remote`: a LiveExecutor forecasting with the
    knobs' default predictor and distance (`build_predictor`: the cache's trained gate replicas, else
    untrained gate copies, the same work), its reports appended to `reports`."""
    # heavy (transformers, through the engine): kept off --help's start-up path, as in run_bench
    from moeless.controller.knobs import Knobs
    from moeless.predictor.build import build_predictor
    from moeless.serving.live_engine import LiveEngine
    from moeless.serving.live_executor import LiveExecutor

    knobs, spec = Knobs(), moe.spec
    runtime = build_predictor(moe, knobs.predictor, knobs.distance)
    live = LiveExecutor(remote, spec.num_layers, spec.num_experts, replica="bench", sink=reports.append,
                        runtime=runtime, distance=knobs.distance)
    return LiveEngine(moe, live, **split)


def _pingpong_effect(one: dict, two: dict) -> dict:
    """Per phase: a forward with 2 micro-batches / with 1 (p50), and the share of the 1-micro-batch
    forward's transfer that the split hid ((ms 1 - ms 2) / transfer 1; negative: it cost more)."""
    return {phase: {"ratio": two[phase]["ms"] / one[phase]["ms"],
                    "hidden_fraction": (one[phase]["ms"] - two[phase]["ms"]) / one[phase]["transfer_ms"]
                    if one[phase]["transfer_ms"] > 0 else 0.0}
            for phase in ("prefill", "decode") if phase in one and phase in two}


def _gate_seconds(moe, iterations) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        for iteration in iterations:
            for layer, record in enumerate(iteration):
                moe.route(layer, record.gate_input)
    return time.perf_counter() - start
