"""`moeless bench live`: the running system, loop on, against static EP and EPLB on the same requests.

1. Requests: ShareGPT test prompts (cut to `prompt_tokens`), sent at the arrival times of the Azure
   LLM conversation trace (MOELESS_TRACES or ../shared/data/traces; a Poisson process at its rate
   where the file is missing), scaled to `rate` requests per second (this machine's pace), through
   the HTTP API with the load generator (serving/loadgen.py).
2. One configuration after another, each alone on the machine with expert hosts of its own
   (starting from static EP's replicas) and its app (its knobs, its planning loop): deployed,
   warmed, every request replayed, torn down. Configurations: static EP (predictor off: home
   replicas only), EPLB re-planned every 10 iterations from past loads, moeless with the gate
   predictor, moeless with the history window only, and static EP again last (the machine's
   drift over the run: read ratios against it too). With `mirror`, every configuration runs
   twice, in order and then in reverse (static, A, B, B~2, A~2, static~2): a drift linear in
   time then cancels in each configuration's mean over its two runs, which the ratios use. Run
   one after another, not interleaved: a configuration that waited while the others replayed
   would see its idle replicas evicted by keep-alive and pay cold starts that serving steadily
   never pays (measured: every replica once or twice per run with 60 s keep-alive and five
   interleaved configurations).
3. Measured per MoE-layer call (the serving replica's reports to the planning loop), per phase:
   the critical path = the slowest host's compute + exposed load waits + the transfer. Two cores
   cannot run several hosts without them taking turns, so a host's compute is its compute thread's
   CPU time (expert_fn/host/runtime.py), not wall time; exposed waits are the hosts' own meters (the
   seconds invocations waited for loads, shared out over the phases by the calls' cold starts);
   the transfer is a packed round trip's wall time minus the host's compute, fitted on an idle
   host before the run (c0 + 2 beta x tokens, medians of repeats) and applied to the tokens the
   busiest host received. Beside it: the latency model's prediction of the same calls (alpha x
   tokens + call overhead per replica, max over hosts, from the same idle-host calibration, + the
   same waits and transfer); the same model refitted online by the planning loop as the calls
   came (controller/planning/cost_fit.py: each call predicted from the calls before it, the model the
   running system plans with; its error is the one to read); and, to explain, the model fitted
   in hindsight on static EP's calls (compute a x model + b per call; out of sample for the other
   configurations); TTFT and TPOT p50/p99, tokens/s, GB·s (experts: the hosts' meters
   over the measured part; non-expert: its bytes x the seconds the configuration's replays took),
   cold starts, and how many texts equal static EP's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from dataclasses import replace
from typing import Any, Sequence

from moeless.bench import BENCHES
from moeless.bench.common import add_bench_flags, print_and_write, start_local_ray
from moeless.bench.live_figures import SECOND, add_in_run_model, config_figures, config_name, fit_in_run, ratios
from moeless.bench.serve import bench_prompts
from moeless.controller.knobs import Knobs
from moeless.expert_fn.client.client import ExpertHostClient
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.hardware.host_profile import calibrate_host
from moeless.serving.cli import MODEL_HELP, _names_of, _non_negative_float, _positive, _positive_float
from moeless.serving.loadgen import outcomes_json, replay, summarize
from moeless.twin.arrivals import arrival_times

CONFIGS = {
    "static": ("static EP", dict(planner="static", predictor="off")),
    "eplb": ("EPLB, re-planned every 10 iterations from past loads", dict(planner="eplb-window", predictor="history")),
    "moeless": ("moeless + gate predictor", dict(planner="moeless", predictor="gate")),
    "moeless-history": ("moeless + history window", dict(planner="moeless", predictor="history")),
    "static-again": ("static EP again, run last (the drift between runs)", dict(planner="static", predictor="off")),
    "moeless-free-memory": ("moeless + gate predictor, memory unpriced (explains; not a claim)",
                            dict(planner="moeless", predictor="gate", memory_price=0.0)),
}
DEFAULT_CONFIGS = ("static", "eplb", "moeless", "moeless-history")
QUICK_CONFIGS = ("static", "moeless")  # --quick: two deployments keep it under a minute


def register(benches: argparse._SubParsersAction) -> None:
    """Add `moeless bench live`."""
    live = benches.add_parser(
        "live", help=BENCHES["live"].help,
        description="Replay Azure conversation arrivals (a Poisson process where the trace is missing) with ShareGPT "
                    "prompts through the HTTP API, once per configuration on the same requests: static EP, EPLB "
                    "re-planned every 10 iterations, moeless with the gate predictor, moeless with the history window. "
                    "Print the MoE-layer critical path per phase (slowest host's compute + exposed load waits + "
                    "transfer), the latency model's prediction of it, TTFT/TPOT p50/p99, tokens/s, GB·s, cold starts.",
    )
    live.add_argument("--model", help="default: the default model; tiny:mixtral with --quick (" + MODEL_HELP + ")")
    live.add_argument("--hosts", type=_positive, help="expert-host processes per configuration (default 4; 2 with --quick)")
    live.add_argument("--requests", type=_positive, help="requests replayed per configuration (default 48; 8 with --quick)")
    live.add_argument("--rate", type=_positive_float, help="mean requests per second the trace is scaled to "
                                                          "(default 1.0; 4.0 with --quick)")
    live.add_argument("--max-tokens", type=_positive, help="tokens per request (default 16; 8 with --quick)")
    live.add_argument("--prompt-tokens", type=_positive, default=64, help="ShareGPT prompts cut to this many tokens (default 64)")
    live.add_argument("--configs", type=_names_of(_live_configs, "configuration(s)"), help="configurations, comma-separated (default "
                                                            "static,eplb,moeless,moeless-history, then static again "
                                                            "(with --mirror: each twice instead); "
                                                            "static,moeless with --quick; also moeless-free-memory)")
    live.add_argument("--keep-alive", type=_non_negative_float, default=60.0,
                      help="seconds an idle replica stays resident (knob keepAliveSeconds; default 60, the knob's)")
    live.add_argument("--distance", type=_positive, default=2, help="prediction distance in layers (knob distance; default 2)")
    live.add_argument("--mirror", action="store_true",
                      help="run every configuration twice, in order and then reversed, so a drift of the machine "
                           "linear in time cancels in each configuration's mean (doubles the time)")
    live.add_argument("--memory-price", type=_non_negative_float, default=None,
                      help="seconds of layer time one GB·s is worth (knob memoryPrice; default: the knob's, "
                           "memory-neutral: 1 / the deployment's GB)")
    add_bench_flags(live)
    live.set_defaults(func=_bench_live)


def _live_configs() -> list[str]:
    return list(CONFIGS)


def _bench_live(args: argparse.Namespace) -> int:
    knobs = Knobs(keep_alive_s=args.keep_alive, distance=args.distance, memory_price=args.memory_price)
    result = run_live_bench(args.model or ("tiny:mixtral" if args.quick else "default"),
                            hosts=args.hosts or (2 if args.quick else 4), requests=args.requests or (8 if args.quick else 48),
                            rate=args.rate or (4.0 if args.quick else 1.0), max_tokens=args.max_tokens or (8 if args.quick else 16),
                            prompt_tokens=args.prompt_tokens, configs=args.configs or list(QUICK_CONFIGS if args.quick else DEFAULT_CONFIGS), knobs=knobs,
                            repeats=3 if args.quick else 30, again=not args.quick, mirror=args.mirror)
    return print_and_write(args.out, "live", result, print_report)


def run_live_bench(model: str = "default", *, hosts: int = 4, requests: int = 48, rate: float = 1.0,
                   max_tokens: int = 16, prompt_tokens: int = 64, configs: Sequence[str] = DEFAULT_CONFIGS,
                   knobs: Knobs = Knobs(keep_alive_s=60.0), repeats: int = 10, again: bool = True,
                   mirror: bool = False, timeout_s: float = 900.0) -> dict[str, Any]:
    """Measure every configuration on the same requests (see the module docstring; again: static EP
    once more at the end; mirror: every configuration twice, in order then reversed, instead);
    returns the figures."""
    import ray
    from ray import serve

    # heavy (ray, transformers): kept off --help's start-up path
    from moeless.serving.config import choose_model
    from moeless.model.weight_store import export_store
    from moeless.serving.embedded import free_port

    configs = ["static", *[c for c in configs if c not in ("static", "static-again")]]
    runs = [*configs, *[f"{c}{SECOND}" for c in reversed(configs)]] if mirror else \
        [*configs, *(["static-again"] if again else [])]
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
        start_local_ray()
        stack.callback(ray.shutdown)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        stack.callback(serve.shutdown)
        run = _Run(choice, spec, store, hosts, non_expert, prompts, arrivals, max_tokens, f"http://127.0.0.1:{port}",
                   repeats, timeout_s)
        results = {key: run.config(key, replace(knobs, **CONFIGS[config_name(key)][1])) for key in runs}
    in_run = fit_in_run(results["static"]["phases"])
    add_in_run_model(results, *in_run)
    return {
        "model": choice.name, "experts": spec.num_experts, "top_k": spec.top_k, "layers": spec.num_layers,
        "hosts": hosts, "requests": requests, "rate_per_s": rate, "arrivals": source,
        "max_tokens": max_tokens, "prompt_tokens": prompt_tokens, "knobs": knobs.to_mapping(), "order": runs,
        "load_average_1m": os.getloadavg()[0], "calibration": run.costs.as_dict(),
        "in_run_model": {"a": in_run[0], "b_s": in_run[1], "fitted_on": "static"}, "configs": results,
        "ratios": ratios(results), "ratios_bracketed": ratios(results, ("static", "static-again")),
        "identical_to_static": {n: sum(a == b for a, b in zip(r["texts"], results["static"]["texts"]))
                                for n, r in results.items()},
    }


class _Run:
    """One configuration after another, each on expert hosts of its own (started from static EP's
    replicas), alone on the machine: deploy, warm, replay every request, read the figures, tear down."""

    def __init__(self, choice, spec, store, hosts, non_expert, prompts, arrivals, max_tokens, base, repeats, timeout_s):
        self.choice, self.spec, self.store, self.hosts, self.non_expert = choice, spec, store, hosts, non_expert
        self.prompts, self.arrivals, self.max_tokens, self.base = prompts, arrivals, max_tokens, base
        self.repeats, self.timeout_s = repeats, timeout_s
        self.costs = None

    def config(self, key: str, knobs: Knobs) -> dict:
        """One run of a configuration (key: its name, or NAME~2 for its mirrored second run)."""
        import ray
        from ray import serve

        # heavy (ray, transformers): kept off --help's start-up path
        from moeless.controller.planning.names import NAMESPACE
        from moeless.serving.app import ServeConfig, build_app

        spec, label = self.spec, CONFIGS[config_name(key)][0] + (", second run" if key.endswith(SECOND) else "")
        name = key.replace(SECOND, "-2")  # the app's name and route
        with launch_local_hosts(self.hosts, self.store, keep_alive_s=knobs.keep_alive_s, metrics=False) as group, \
                contextlib.ExitStack() as stack:
            clients = [stack.enter_context(ExpertHostClient(a, timeout_s=60)) for a in group.addresses]
            if self.costs is None:  # the cost profile, once, on an idle host
                self.costs = calibrate_host(clients[0], spec.hidden_size, self.non_expert, spec.num_experts, self.hosts,
                                            self.repeats)
            print(f"{label}: {self.hosts} expert hosts, deploying ...", flush=True)
            _reset_hosts(clients, spec.num_layers, spec.num_experts)
            config = ServeConfig(self.choice.name, self.choice.loader, tuple(group.addresses), replica_cpus=0.25,
                                 ingress_cpus=0.1, placement_board=f"bench-live-board-{name}", knobs=knobs,
                                 plan_loop=f"bench-live-loop-{name}", profile=self.costs.profile)
            serve.run(build_app(config), name=name, route_prefix=f"/{name}")
            loop = ray.get_actor(config.plan_loop, namespace=NAMESPACE)
            url = f"{self.base}/{name}"
            replay(url, self.choice.name, self.prompts[:2], [0.0, 0.0], 4, timeout_s=self.timeout_s)  # warm
            time.sleep(1.0)
            before = [c.status()["meters"] for c in clients]
            ray.get(loop.reset_stats.remote())
            began = time.perf_counter()
            outcomes = replay(url, self.choice.name, self.prompts, self.arrivals, self.max_tokens, timeout_s=self.timeout_s)
            replay_s = time.perf_counter() - began
            time.sleep(0.5)  # the last reports reach the loop
            metrics = ray.get(loop.metrics.remote())
            after = [c.status()["meters"] for c in clients]
            result = {"label": label, "knobs": knobs.to_mapping(), **summarize(outcomes),
                      **config_figures(metrics, before, after, self.costs.samples),
                      "replay_s": replay_s, "non_expert_gb_s": self.non_expert / 1e9 * replay_s,
                      "texts": [o.text for o in outcomes], "outcomes": outcomes_json(outcomes)}
            _print_row(key, result)
            ray.get(loop.stop.remote())
            ray.kill(loop)
            serve.delete(name)
        return result


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
    # heavy (transformers): kept off --help's start-up path
    from moeless.serving.engine import Engine

    engine = Engine(model)
    return [engine.codec.decode(ids) for ids in bench_prompts(engine, count, prompt_tokens)]


def _print_row(name: str, r: dict) -> None:
    def ms(d):
        return "-" if d["p50"] is None else f"{d['p50'] * 1e3:.0f}/{d['p99'] * 1e3:.0f}"

    cells = "  ".join(f"{phase} {p['critical_path_s'] * 1e6:.0f} us (model {p['model_s'] * 1e6:.0f}, "
                      f"{p['model_error'] * 100:+.0f}%; online {p['model_online_error'] * 100:+.0f}%"
                      + (f"; in-run {p['model_in_run_error'] * 100:+.0f}%"
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
    print(f"latency model: calibrated on an idle host before the run; online: refitted by the planning loop as "
          f"calls come, each predicted before it was seen; in-run (hindsight): compute x {fit['a']:.2f} + "
          f"{fit['b_s'] * 1e6:.0f} us per layer call, fitted on static EP's calls")
    for name, r in result["configs"].items():
        _print_row(name, r)
    bracketed = result.get("ratios_bracketed") or {}
    mirrored = any(key.endswith(SECOND) for key in result["configs"])
    for name, by_phase in result["ratios"].items():
        same = [n for key, n in result["identical_to_static"].items() if config_name(key) == name]
        print(f"  {name:16s} critical path / static EP's" + (" (means of two runs each)" if mirrored else "") + ": "
              + ", ".join(f"{p} {v:.2f}" for p, v in by_phase.items())
              + ("; / the mean of both static EP runs: " + ", ".join(f"{p} {v:.2f}" for p, v in bracketed[name].items())
                 if name in bracketed else "")
              + f"; texts identical to static EP's: {sum(same)}/{result['requests'] * len(same)}")
