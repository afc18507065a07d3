"""`moeless bench step-scaler`: how late serving's step scaler is, against a whole model's expert load.

The twin meets the family engine's step SLO only where a scaler widens the placement before a burst's
batch runs and holds the burst's newcomers until it has (twin/finetunes.py, the gated p99); what the
twin then needs is the scaler's lag (`moeless eval --shared-pool --finetunes --step-lag`). This bench
measures serving's (serving/step_gate.py, controller/planning/step_scaler.py) on a real pool:

1. Local expert hosts over the model's store (--hosts), the cost profile calibrated on the first;
   Ray Serve with the live loop planning over one host (the others are spares: ready, planned
   around), the step SLO set so that one prompt's step needs every host (its priced expert work
   over the hosts): every round's first newcomer is held for a widening.
2. --rounds times: the loop back at one host (the hold past, that host holding every expert again),
   then a burst of --burst requests at once (held-out ShareGPT prompts). Its newcomers wait out of
   the batch while the loop widens: the gate's hold, from the first held admission to the step that
   admits them, is the scaler's lag as serving has it (the ask to the loop, an immediate planning
   pass, or the spares' loads alone where the loop published over them before, the publish, the
   replica following the board, the next step). Rounds alternate: warm (the spares still hold what
   the last widening loaded: the replica switches to the loop's standby placement over them at once
   and holds nobody, the switch timed from the batch's need) and cold (the spares emptied first:
   their share of the experts loaded, as the twin's added GPUs copy theirs).
3. The baseline, in the same run: a whole model's experts loaded onto one emptied host, one after
   another from its store (the expert part of a whole-model wake on these hosts).
Printed per kind of round: the switches, the holds' p50 / p99, the loop's part (ask to published, nothing left to
load), the p99 hold over the whole-model load; the answers against the in-process model's (greedy).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from typing import Any

import numpy as np

from moeless.bench import BENCHES
from moeless.bench.common import add_bench_flags, print_and_write, start_local_ray
from moeless.serving.cli import MODEL_HELP, _positive, _positive_float


def register(benches: argparse._SubParsersAction) -> None:
    """Add `moeless bench step-scaler`."""
    bench = benches.add_parser("step-scaler", help=BENCHES["step-scaler"].help,
                               description="Serve with the step scaler on local expert hosts, send bursts that need "
                                           "every host, and print how long their newcomers waited for the placement "
                                           "to widen, against a whole model's expert load on one host. --quick: the "
                                           "tiny model, 3 rounds.")
    bench.add_argument("--model", default="default", help=MODEL_HELP.split(", or BASE")[0])
    bench.add_argument("--hosts", type=_positive, default=3, help="local expert hosts (default 3)")
    bench.add_argument("--burst", type=_positive, default=6, help="requests sent at once each round (default 6)")
    bench.add_argument("--rounds", type=_positive, default=8, help="bursts, each from one host (default 8)")
    bench.add_argument("--hold", type=_positive_float, default=1.0,
                       help="seconds a widening outlives its last need (default 1)")
    bench.add_argument("--max-tokens", type=_positive, default=4, help="completion tokens per request (default 4)")
    add_bench_flags(bench)
    bench.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    model, rounds = ("tiny:mixtral", 3) if args.quick else (args.model, args.rounds)
    result = run_step_scaler_bench(model, hosts=args.hosts, burst=args.burst, rounds=rounds, hold_s=args.hold,
                                   max_tokens=args.max_tokens)
    return print_and_write(args.out, "step-scaler", result, print_report)


def run_step_scaler_bench(model: str = "default", *, hosts: int = 3, burst: int = 6, rounds: int = 8,
                          hold_s: float = 1.0, max_tokens: int = 4, prompt_tokens: int = 48,
                          timeout_s: float = 600.0) -> dict[str, Any]:
    """The measurement of the module docstring; returns the figures."""
    import ray
    from ray import serve

    # heavy (ray, transformers): kept off --help's start-up path
    from moeless.bench.load import _prompts, _sequential
    from moeless.controller.knobs import Knobs
    from moeless.controller.planning.names import NAMESPACE
    from moeless.controller.planning.step_scaler import step_expert_s
    from moeless.expert_fn.client.client import ExpertHostClient
    from moeless.expert_fn.launcher import launch_local_hosts
    from moeless.hardware.host_profile import calibrate_host
    from moeless.model.weight_store import export_store
    from moeless.serving.app import ServeConfig, build_app
    from moeless.serving.config import choose_model
    from moeless.serving.embedded import free_port
    from moeless.serving.loadgen import replay, summarize
    from tqdm import tqdm

    choice = choose_model(model)
    loaded = choice.loader()
    spec = loaded.spec
    prompts = _prompts(loaded, burst * (rounds + 1), prompt_tokens)
    expected = _sequential(loaded, prompts[burst:], max_tokens)
    store = export_store(loaded, choice.name)
    loaded.drop_experts()
    non_expert = sum(p.numel() * p.element_size() for p in loaded.hf.parameters())
    del loaded
    knobs = Knobs(keep_alive_s=60.0).for_model(spec.num_layers)
    with launch_local_hosts(hosts, store, keep_alive_s=60.0, metrics=False) as group, contextlib.ExitStack() as stack:
        clients = [stack.enter_context(ExpertHostClient(a, timeout_s=60)) for a in group.addresses]
        costs = calibrate_host(clients[0], spec.hidden_size, non_expert, spec.num_experts, hosts)
        whole_s = _whole_model_load_s(clients[-1], spec.num_layers, spec.num_experts)
        # one prompt's step needs every host: each round's first newcomer is held for the widening
        slo_s = step_expert_s(prompt_tokens, costs.profile, spec.num_layers, spec.top_k, spec.num_experts) / hosts
        start_local_ray()
        stack.callback(ray.shutdown)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        stack.callback(serve.shutdown)
        config = ServeConfig(choice.name, choice.loader, tuple(group.addresses), replica_cpus=0.25, ingress_cpus=0.1,
                             placement_board="bench-step-board", plan_loop="bench-step-loop", knobs=knobs,
                             profile=costs.profile, step_slo_s=slo_s, step_hosts=1, step_hold_s=hold_s)
        serve.run(build_app(config), name="step", route_prefix="/step")
        url, loop = f"http://127.0.0.1:{port}/step", ray.get_actor(config.plan_loop, namespace=NAMESPACE)
        server = serve.get_deployment_handle("ModelServer", app_name="step")
        replay(url, choice.name, prompts[:1], [0.0], max_tokens, timeout_s=timeout_s)  # warm
        texts, rows = [], []
        for r in tqdm(range(rounds), desc="bursts", leave=False):
            cold = r % 2 == 1
            _wait_narrow(loop, clients[0], spec.num_layers * spec.num_experts, hold_s)
            if cold:  # the spares give back what the last widening loaded: this one loads their share again
                for client in clients[1:]:
                    _evict_all(client)
                _wait_no_standby(config.placement_board, server)  # the loop saw it, then the replica
            gate = server.stats.remote().result()["step_gate"]
            seen, switched = len(gate["waits_s"]), len(gate["switch_s"])
            settled = len(ray.get(loop.metrics.remote())["widenings"]["settle_s"])
            batch = prompts[(r + 1) * burst:(r + 2) * burst]
            outcomes = replay(url, choice.name, batch, [0.0] * burst, max_tokens, timeout_s=timeout_s)
            texts += [o.text for o in outcomes]
            gate = server.stats.remote().result()["step_gate"]
            rows.append({"kind": "cold" if cold else "warm", **summarize(outcomes), "holds_s": gate["waits_s"][seen:],
                         "switches_s": gate["switch_s"][switched:],
                         "loop_settle_s": ray.get(loop.metrics.remote())["widenings"]["settle_s"][settled:]})
        gate = server.stats.remote().result()["step_gate"]
        metrics = ray.get(loop.metrics.remote())
        ray.get(loop.stop.remote())
        serve.delete("step")
    kinds = {kind: _kind_figures([row for row in rows if row["kind"] == kind], whole_s) for kind in ("warm", "cold")}
    return {"model": choice.name, "layers": spec.num_layers, "experts": spec.num_experts, "top_k": spec.top_k,
            "hosts": hosts, "burst": burst, "rounds": rounds, "hold_s": hold_s, "max_tokens": max_tokens,
            "prompt_tokens": prompt_tokens, "step_slo_s": slo_s, "gate": gate, "kinds": kinds, "rounds_detail": rows,
            "loop_pass_s": metrics["plan_s"]["sum"] / max(metrics["passes"], 1), "loop_passes": metrics["passes"],
            "widenings_settled": metrics["widenings"]["settled"], "widenings_warm": metrics["widenings"]["warm"],
            "widenings_cold": metrics["widenings"]["cold"], "cold_load_s": metrics["widenings"]["cold_load_s"],
            "answer_parts": metrics["widenings"]["answer_parts"],
            "whole_model_load_s": whole_s, "load_host_s": costs.profile.load_s["host"],
            "identical": sum(a == b for a, b in zip(texts, expected)), "answers": len(texts),
            "load_average_1m": os.getloadavg()[0]}


def _kind_figures(rows: list[dict], whole_s: float) -> dict:
    """A kind of round's holds, switches to a standby placement and the loop's part: p50, p99, max
    (seconds) and the p99 hold over the whole-model load."""
    holds = [w for row in rows for w in row["holds_s"]]
    switches = [w for row in rows for w in row["switches_s"]]
    settles = [w for row in rows for w in row["loop_settle_s"]]

    def pct(values):
        return {q: float(np.percentile(values, float(q[1:]))) if values else None for q in ("p50", "p99")} | \
            {"max": max(values, default=None)}

    return {"rounds": len(rows), "holds": len(holds), "hold_s": pct(holds), "loop_settle_s": pct(settles),
            "switches": len(switches), "switch_s": pct(switches),
            "hold_p99_over_whole_load": pct(holds)["p99"] / whole_s if holds and whole_s > 0 else None}


def _evict_all(client) -> None:
    for r in client.status()["replicas"]:
        client.evict(r["layer"], r["expert"])


def _whole_model_load_s(client, num_layers: int, num_experts: int) -> float:
    """Seconds to load every expert of the model onto `client`'s host, emptied first, one after another."""
    _evict_all(client)
    began = time.perf_counter()
    for layer in range(num_layers):
        for expert in range(num_experts):
            client.load(layer, expert, wait=True)
    took = time.perf_counter() - began
    _evict_all(client)
    return took


def _wait_narrow(loop, first, experts: int, hold_s: float, timeout_s: float = 120.0) -> None:
    """Until the loop plans over one host again (the last widening's hold past), that host holds every
    expert (the narrowing pass's loads) and the placement over it is published and followed."""
    import ray  # heavy: kept off --help's start-up path, as in run_step_scaler_bench

    deadline = time.monotonic() + timeout_s
    time.sleep(hold_s)
    while time.monotonic() < deadline and (ray.get(loop.state.remote())["width"] != 1 or _resident(first) < experts):
        time.sleep(0.1)
    time.sleep(1.0)  # the publish after those loads, the replica following it


def _wait_no_standby(name: str, server, timeout_s: float = 60.0) -> None:
    """Until the board holds no standby placement (the loop has seen the spares emptied), then until
    `server`'s replica holds none either (its follower polls the board every 0.1 s: a burst sent before
    it read the board switched at once to a standby over the emptied spares, and held nobody)."""
    import ray  # heavy: kept off --help's start-up path, as in run_step_scaler_bench

    from moeless.controller.planning.board import board  # imports ray: likewise

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and ray.get(board(name).newer_than.remote(1 << 62, -1))[3]:
        time.sleep(0.05)
    while time.monotonic() < deadline and server.stats.remote().result()["standby_hosts"]:
        time.sleep(0.05)


def _resident(client) -> int:
    return sum(r["state"] in ("warm", "idle") for r in client.status()["replicas"])


def print_report(r: dict[str, Any]) -> None:
    print(f"step scaler: {r['model']} ({r['layers']} layers x {r['experts']} experts, top-{r['top_k']}), {r['hosts']} "
          f"local hosts, bursts of {r['burst']} requests of {r['prompt_tokens']} tokens, step SLO "
          f"{r['step_slo_s'] * 1e3:.2f} ms (one prompt's step needs every host), hold {r['hold_s']:g} s; "
          f"loop pass {r['loop_pass_s'] * 1e3:.0f} ms on average")
    for kind, what in (("warm", "the spares still hold their part"), ("cold", "the spares emptied: their share loaded")):
        k = r["kinds"][kind]
        if k["switches"]:
            print(f"  {kind} widenings ({what}): {k['switches']} in {k['rounds']} rounds run at once on a standby "
                  f"placement, nobody held: the switch {k['switch_s']['p50'] * 1e3:.2f} ms p50, "
                  f"{k['switch_s']['max'] * 1e3:.2f} ms max from the batch's need")
        if k["holds"]:
            print(f"  {kind} widenings ({what}), {k['holds']} holds in {k['rounds']} rounds: admission wait p50 "
                  f"{k['hold_s']['p50'] * 1e3:.0f} ms, p99 {k['hold_s']['p99'] * 1e3:.0f} ms; the loop's part (ask to "
                  f"published) p50 {k['loop_settle_s']['p50'] * 1e3:.0f} ms; p99 wait / whole-model load "
                  f"{k['hold_p99_over_whole_load']:.2f}x")
        elif not k["switches"]:
            print(f"  {kind}: no widening")
    print(f"  baseline, same run: a whole model's experts loaded on one host one after another "
          f"{r['whole_model_load_s'] * 1e3:.0f} ms (one load from host memory {r['load_host_s'] * 1e3:.2f} ms)")
    loads = r["cold_load_s"]
    print(f"  widenings settled by the loop: {r['widenings_settled']}, of which {r['widenings_warm']} republished "
          f"the placement the spares still held and {r['widenings_cold']} loaded what they lacked of it first (no "
          f"planning pass" + (f"; those loads {min(loads) * 1e3:.0f}-{max(loads) * 1e3:.0f} ms)" if loads else ")"))
    for cold in (False, True):
        parts = [p for p in r["answer_parts"] if p["cold"] == cold]
        if parts:
            print(f"  {'cold' if cold else 'warm'} answers' parts, p50 (max) ms: " + ", ".join(
                f"{key[:-2]} {np.median([p[key] for p in parts]) * 1e3:.1f} ({max(p[key] for p in parts) * 1e3:.1f})"
                for key in ("queued_s", "choose_s", "load_s", "publish_s")))
    print(f"  holds timed out: {r['gate']['timeouts']}; answers equal to the in-process model: "
          f"{r['identical']}/{r['answers']}")
