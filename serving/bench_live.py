"""`moeless bench live`: the running system, loop on, against static EP and EPLB on the same requests.

1. Requests: ShareGPT test prompts (cut to `prompt_tokens`), sent at the arrival times of the Azure
   LLM conversation trace (MOELESS_TRACES or ../shared/data/traces; a Poisson process at its rate
   where the file is missing), scaled to `rate` requests per second (this machine's pace), through
   the HTTP API with the load generator (serving/loadgen.py).
2. Every configuration gets expert hosts of its own (starting from static EP's replicas) and its
   app (its knobs, its planning loop), all deployed and warmed first: static EP (predictor off:
   home replicas only), EPLB re-planned every 10 iterations from past loads, moeless with the gate
   predictor, moeless with the history window only. The same requests go to every configuration
   in chunks of `chunk`, the order rotating per chunk, so the machine's other work weighs on each
   alike. Every configuration's processes stay up for the whole run (idle while the others
   replay), so keep-alive must outlast those pauses (default 60 s) or each pays cold starts at
   each of its chunks.
3. Measured per MoE-layer call (the serving replica's reports to the planning loop), per phase:
   the critical path = the slowest host's compute + exposed load waits + the transfer. Two cores
   cannot run several hosts without them taking turns, so a host's compute is its compute thread's
   CPU time (expert_fn/runtime.py), not wall time; exposed waits are the hosts' own meters (the
   seconds invocations waited for loads, shared out over the phases by the calls' cold starts);
   the transfer is a packed round trip's wall time minus the host's compute, fitted on an idle
   host before the run (c0 + 2 beta x tokens, medians of repeats) and applied to the tokens the
   busiest host received. Beside it: the latency model's prediction of the same calls (alpha x
   tokens + call overhead per replica, max over hosts, from the same idle-host calibration, + the
   same waits and transfer), and the same model calibrated in-run (its compute scaled, a x model +
   b per call, fitted on static EP's calls: the machine as loaded while serving; out of sample for
   the other configurations); TTFT and TPOT p50/p99, tokens/s, GB·s (experts: the hosts' meters
   over the measured part; non-expert: its bytes x the seconds the configuration's replays took),
   cold starts, and how many texts equal static EP's.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import replace
from dataclasses import replace as dc_replace
from typing import Any, Sequence

import numpy as np

from moeless.knobs import Knobs
from moeless.serving.loadgen import outcomes_json, replay, summarize

CONFIGS = {
    "static": ("static EP", dict(planner="static", predictor="off")),
    "eplb": ("EPLB, re-planned every 10 iterations from past loads", dict(planner="eplb-window", predictor="history")),
    "moeless": ("moeless + gate predictor", dict(planner="moeless", predictor="gate")),
    "moeless-history": ("moeless + history window", dict(planner="moeless", predictor="history")),
    "moeless-free-memory": ("moeless + gate predictor, memory unpriced (explains; not a claim)",
                            dict(planner="moeless", predictor="gate", memory_price=0.0)),
}
DEFAULT_CONFIGS = ("static", "eplb", "moeless", "moeless-history")


def run_live_bench(model: str = "default", *, hosts: int = 4, requests: int = 48, rate: float = 1.0,
                   max_tokens: int = 16, prompt_tokens: int = 64, configs: Sequence[str] = DEFAULT_CONFIGS,
                   knobs: Knobs = Knobs(keep_alive_s=60.0), chunk: int = 8, repeats: int = 10,
                   timeout_s: float = 900.0) -> dict[str, Any]:
    """Measure every configuration on the same requests (see the module docstring); returns the figures."""
    import ray
    from ray import serve

    from moeless.controller.iterations import arrival_times
    from moeless.expert_fn.client import ExpertHostClient
    from moeless.expert_fn.launcher import launch_local_hosts
    from moeless.serving.app import ServeConfig, build_app
    from moeless.serving.calibrate import calibrate_host
    from moeless.serving.embedded import choose_model, export_store, free_port
    from moeless.serving.plan_loop import NAMESPACE

    configs = ["static", *[c for c in configs if c != "static"]]  # static EP is every ratio's baseline
    choice = choose_model(model)
    loaded = choice.loader()
    spec = loaded.spec
    knobs = _fit_distance(knobs, spec.num_layers)
    prompts = _prompts(loaded, requests, prompt_tokens)
    arrivals, source = arrival_times(requests)
    if arrivals[-1] > 0:  # scaled to `rate` over these requests (the trace's first ones are not at its mean rate)
        arrivals = arrivals * (requests - 1) / (rate * arrivals[-1])
    store = export_store(loaded, choice.name)
    loaded.drop_experts()
    non_expert = sum(p.numel() * p.element_size() for p in loaded.hf.parameters())
    del loaded
    with contextlib.ExitStack() as stack:
        # 1. Hosts for every configuration (resident sets of their own), one Ray + Serve, every app deployed.
        groups = {name: stack.enter_context(launch_local_hosts(hosts, store, keep_alive_s=knobs.keep_alive_s,
                                                               metrics=False)) for name in configs}
        clients = {name: [stack.enter_context(ExpertHostClient(a, timeout_s=60)) for a in g.addresses]
                   for name, g in groups.items()}
        costs = calibrate_host(clients["static"][0], spec.hidden_size, non_expert, spec.num_experts, repeats)
        ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
        stack.callback(ray.shutdown)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        stack.callback(serve.shutdown)
        base, loops, knob_sets = f"http://127.0.0.1:{port}", {}, {}
        for name in configs:
            label, overrides = CONFIGS[name]
            print(f"deploying {label} on {hosts} expert hosts of its own ...", flush=True)
            _reset_hosts(clients[name], spec.num_layers, spec.num_experts)
            knob_sets[name] = replace(knobs, **overrides)
            config = ServeConfig(choice.name, choice.loader, tuple(groups[name].addresses), replica_cpus=0.25,
                                 ingress_cpus=0.1, placement_board=f"bench-live-board-{name}", knobs=knob_sets[name],
                                 plan_loop=f"bench-live-loop-{name}", profile=costs.profile)
            serve.run(build_app(config), name=name, route_prefix=f"/{name}")
            loops[name] = ray.get_actor(config.plan_loop, namespace=NAMESPACE)
        for name in configs:  # warm, all at once after the deployments (the first would idle past keep-alive)
            _reset_hosts(clients[name], spec.num_layers, spec.num_experts)
            replay(f"{base}/{name}", choice.name, prompts[:2], [0.0, 0.0], 4, timeout_s=timeout_s)
        time.sleep(1.0)
        before = {name: [c.status()["meters"] for c in clients[name]] for name in configs}
        for loop in loops.values():
            ray.get(loop.reset_stats.remote())
        # 2. The same requests to every configuration, chunk by chunk, the order rotating per chunk, so
        #    the machine's other work weighs on every configuration alike.
        outcomes: dict[str, list] = {name: [] for name in configs}
        serving_s = {name: 0.0 for name in configs}  # wall seconds of its replays (non-expert memory held)
        chunks = [range(i, min(i + chunk, requests)) for i in range(0, requests, chunk)]
        for r, part in enumerate(chunks):
            order = configs[r % len(configs):] + configs[:r % len(configs)]
            print(f"chunk {r + 1}/{len(chunks)}: requests {part.start}..{part.stop - 1}, order {', '.join(order)}",
                  flush=True)
            offsets = arrivals[part.start:part.stop] - arrivals[part.start]
            for name in order:
                began = time.perf_counter()
                done = replay(f"{base}/{name}", choice.name, prompts[part.start:part.stop], offsets, max_tokens,
                              timeout_s=timeout_s)
                serving_s[name] += time.perf_counter() - began
                outcomes[name] += [dc_replace(o, index=o.index + part.start) for o in done]
        time.sleep(0.5)  # the last reports reach the loops
        # 3. The figures.
        results = {}
        for name in configs:
            metrics = ray.get(loops[name].metrics.remote())
            after = [c.status()["meters"] for c in clients[name]]
            results[name] = {"label": CONFIGS[name][0], "knobs": knob_sets[name].to_mapping(), **summarize(outcomes[name]),
                             **config_figures(metrics, before[name], after, costs.samples),
                             "replay_s": serving_s[name], "non_expert_gb_s": non_expert / 1e9 * serving_s[name],
                             "texts": [o.text for o in outcomes[name]], "outcomes": outcomes_json(outcomes[name])}
            _print_row(name, results[name])
            ray.get(loops[name].stop.remote())
            ray.kill(loops[name])
    in_run = fit_in_run(results["static"]["phases"])
    add_in_run_model(results, *in_run)
    return {
        "model": choice.name, "experts": spec.num_experts, "top_k": spec.top_k, "layers": spec.num_layers,
        "hosts": hosts, "requests": requests, "rate_per_s": rate, "arrivals": source, "chunk": chunk,
        "max_tokens": max_tokens, "prompt_tokens": prompt_tokens, "knobs": knobs.to_mapping(),
        "load_average_1m": os.getloadavg()[0], "calibration": costs.as_dict(),
        "in_run_model": {"a": in_run[0], "b_s": in_run[1], "fitted_on": "static"}, "configs": results,
        "ratios": ratios(results),
        "identical_to_static": {n: sum(a == b for a, b in zip(r["texts"], results["static"]["texts"]))
                                for n, r in results.items()},
    }


def config_figures(metrics: dict, before: Sequence[dict], after: Sequence[dict], fit: dict) -> dict:
    """Per phase: the mean critical path per MoE-layer call and its parts, the latency model's
    prediction and its error; the hosts' GB·s, loads and cold starts over the run (meters after -
    before). fit: serving/calibrate.fit_costs's host_s, c0, beta (seconds)."""
    delta = {k: sum(a[k] - b[k] for a, b in zip(after, before))
             for k in ("gb_s", "loads", "cold_starts", "cold_exposed_s", "cold_hidden_s", "evictions")}
    phases = metrics["stats"]["phases"]
    client_cold = sum(sum(p["sum_cold_starts"]) for p in phases.values())
    out: dict[str, Any] = {"hosts_delta": delta, "expert_gb_s": delta["gb_s"],
                           "resident_replicas_end": metrics["resident_replicas"],
                           "planner": {k: metrics[k] for k in ("passes", "plans", "publishes", "loads_sent", "errors")},
                           "plan_s_mean": metrics["plan_s"]["sum"] / max(metrics["plans"], 1), "phases": {}}
    for phase, p in phases.items():
        calls = np.asarray(p["calls_per_layer"], dtype=np.float64)
        if calls.sum() == 0:
            continue
        share = sum(p["sum_cold_starts"]) / client_cold if client_cold else 0.0
        exposed = delta["cold_exposed_s"] * share  # the hosts' waits, shared out by the calls' cold starts
        sums = {k: np.asarray(p[f"sum_{k}"]) for k in ("compute_s", "host_tokens", "model_s", "wall_s")}
        move = fit["c0"] * calls + 2 * fit["beta"] * sums["host_tokens"]  # per layer [L]
        model = sums["model_s"] + fit["host_s"] * calls  # + a host call's fixed compute
        with np.errstate(invalid="ignore", divide="ignore"):
            per_layer = (sums["compute_s"] + move) / calls + exposed / calls.sum()
        n = calls.sum()
        measured = float((sums["compute_s"].sum() + move.sum() + exposed) / n)
        predicted = float((model.sum() + move.sum() + exposed) / n)
        out["phases"][phase] = {
            "iterations": p["iterations"], "layer_calls": int(n), "critical_path_s": measured,
            "compute_s": float(sums["compute_s"].sum() / n), "transfer_s": float(move.sum() / n),
            "exposed_wait_s": exposed / n, "host_tokens": float(sums["host_tokens"].sum() / n),
            "wall_s": float(sums["wall_s"].sum() / n), "model_s": predicted, "model_error": predicted / measured - 1.0,
            "model_compute_error": float(model.sum() / sums["compute_s"].sum() - 1.0),
            "critical_path_per_layer_s": np.nan_to_num(per_layer).tolist(),
            "forecast_s_per_iteration": p["forecast_s"] / max(p["iterations"], 1),
            "sums": {"calls": calls.tolist(), "compute_s": sums["compute_s"].tolist(), "model_compute_s": model.tolist(),
                     "transfer_and_waits_s": float(move.sum() + exposed)},
        }
    return out


def fit_in_run(phases: dict) -> tuple[float, float]:
    """(a, b) with a layer call's measured compute ~ a x the idle-calibrated model's + b seconds,
    least squares over a configuration's per-layer sums of both phases (static EP's: the machine
    as loaded during the run; the model's shape stays the calibration's)."""
    rows = [[m, c] for p in phases.values() for m, c in zip(p["sums"]["model_compute_s"], p["sums"]["calls"])]
    measured = [y for p in phases.values() for y in p["sums"]["compute_s"]]
    a, b = np.linalg.lstsq(np.array(rows), np.array(measured), rcond=None)[0]
    if a <= 0 or b < 0:  # no physical meaning: a scale alone
        a, b = float(np.dot(np.array(rows)[:, 0], measured) / np.dot(np.array(rows)[:, 0], np.array(rows)[:, 0])), 0.0
    return float(a), float(b)


def add_in_run_model(results: dict, a: float, b: float) -> None:
    """Each configuration's critical path as the model calibrated in-run (fit_in_run) predicts it."""
    for r in results.values():
        for p in r["phases"].values():
            s, n = p["sums"], p["layer_calls"]
            predicted = (a * sum(s["model_compute_s"]) + b * sum(s["calls"]) + s["transfer_and_waits_s"]) / n
            p["model_in_run_s"], p["model_in_run_error"] = predicted, predicted / p["critical_path_s"] - 1.0


def ratios(results: dict) -> dict:
    """Each configuration's mean critical path per phase over static EP's (the first config's)."""
    if "static" not in results:
        return {}
    base = results["static"]["phases"]
    return {name: {phase: r["phases"][phase]["critical_path_s"] / base[phase]["critical_path_s"]
                   for phase in base if phase in r["phases"]} for name, r in results.items()}


def _fit_distance(knobs: Knobs, num_layers: int) -> Knobs:
    return knobs if knobs.distance < num_layers else replace(knobs, distance=max(num_layers - 1, 1))


def _reset_hosts(clients, num_layers: int, num_experts: int) -> None:
    """Back to static EP's replicas: evict every other resident replica, load the missing home ones."""
    for g, client in enumerate(clients):
        held = {(r["layer"], r["expert"]) for r in client.status()["replicas"] if r["state"] in ("warm", "idle")}
        homes = {(l, e) for l in range(num_layers) for e in range(num_experts) if e * len(clients) // num_experts == g}
        for key in held - homes:
            client.evict(*key)
        for key in homes - held:
            client.load(*key, wait=True)


def _prompts(model, count: int, prompt_tokens: int) -> list[str]:
    from moeless.serving.bench import bench_prompts
    from moeless.serving.engine import Engine

    engine = Engine(model)
    return [engine.codec.decode(ids) for ids in bench_prompts(engine, count, prompt_tokens)]


def _print_row(name: str, r: dict) -> None:
    def ms(d):
        return "-" if d["p50"] is None else f"{d['p50'] * 1e3:.0f}/{d['p99'] * 1e3:.0f}"

    cells = "  ".join(f"{phase} {p['critical_path_s'] * 1e6:.0f} us (model {p['model_s'] * 1e6:.0f}, "
                      f"{p['model_error'] * 100:+.0f}%" + (f"; in-run {p['model_in_run_error'] * 100:+.0f}%"
                                                          if "model_in_run_error" in p else "") + ")"
                      for phase, p in r["phases"].items())
    print(f"  {name:16s} MoE-layer critical path: {cells}; TTFT p50/p99 {ms(r['ttft_s'])} ms, TPOT {ms(r['tpot_s'])} ms, "
          f"{r['tokens_per_s']:.1f} tokens/s, expert GB·s {r['expert_gb_s']:.3f} (non-expert "
          f"{r.get('non_expert_gb_s', 0.0):.1f}), cold starts "
          f"{r['hosts_delta']['cold_starts']}, loads {r['hosts_delta']['loads']}, {r['failed']} failed", flush=True)


def print_report(result: dict[str, Any]) -> None:
    print(f"model {result['model']} (L={result['layers']}, E={result['experts']}, k={result['top_k']}), "
          f"{result['hosts']} expert hosts; {result['requests']} requests at {result['rate_per_s']:g}/s "
          f"({result['arrivals']}); load average {result['load_average_1m']:.1f}")
    fit = result["in_run_model"]
    print(f"latency model: calibrated on an idle host before the run; in-run: compute x {fit['a']:.2f} + "
          f"{fit['b_s'] * 1e6:.0f} us per layer call, fitted on static EP's calls")
    for name, r in result["configs"].items():
        _print_row(name, r)
    for name, by_phase in result["ratios"].items():
        print(f"  {name:16s} critical path / static EP's: " + ", ".join(f"{p} {v:.2f}" for p, v in by_phase.items())
              + f"; texts identical to static EP's: {result['identical_to_static'][name]}/{result['requests']}")
